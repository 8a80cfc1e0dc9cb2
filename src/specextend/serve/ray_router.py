"""Ray Serve's request router over a routing.py policy (Ray's request-router interface, alpha).

Ray calls the router in the deployment handle's process, the front end's (ray_serve.py):
`choose_replicas` ranks the replicas for a request (Ray sends it to the first that has room,
else the next), and the `on_*` hooks keep the policy's memory of what went where and each
replica's requests in flight. Ray ships this module to where the handle runs by value, so it
holds the router class alone: what it shares with the front end (the `Route` it reads) lives in
routing.py, which is imported, not copied. /health is not the router's: the front end's backend
counts its own requests per replica and asks the replicas for their reports (ray_serve.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from . import routing


class Router(RequestRouter):
    def initialize_state(self, routing_policy: str = "affinity", capacity: int = 16,
                         imbalance: int = routing.IMBALANCE, **_: Any) -> None:
        """Ray's call with the deployment's `request_router_kwargs`."""
        self.policy = routing.POLICIES[routing_policy]()
        self.capacity, self.imbalance = capacity, imbalance
        self.flying: dict[str, str] = {}  # Ray's internal request id -> the replica serving it
        self.known: set[str] = set()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        route = _route(pending_request)
        if route is None:  # not a generation (the start-up call): any replica, the least queued
            return [candidate_replicas]
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        names = [n for n in by_name if n not in route.avoid] or list(by_name)
        in_flight = Counter(self.flying.values())
        loads = {n: routing.Load(in_flight[n], self.capacity, self.imbalance) for n in names}
        return [[by_name[n]] for n in self.policy.choose(route.ids, loads)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        route = _route(pending_request)
        if route is not None:
            name = replica_id.unique_id
            self.policy.routed(route.ids, name)
            self.flying[pending_request.metadata.internal_request_id] = name

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.flying.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        now = {r.replica_id.unique_id for r in replicas}
        for name in self.known - now:
            self._forget(name)
        self.known = now

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id)

    def _forget(self, name: str) -> None:
        """A replica that left: its cache went with it, and its requests will not complete here."""
        self.policy.forget(name)
        self.known.discard(name)


def _route(pending_request: PendingRequest | None) -> routing.Route | None:
    if pending_request is None:
        return None
    return next((a for a in pending_request.args if isinstance(a, routing.Route)), None)
