"""Which replica a request goes to: the routing policies, apart from Ray (ray_router.py adapts them to
Ray Serve's request router), so they are plain code with plain tests.

Document affinity (`Affinity`): a replica's prefix cache turns a follow-up question about a long
document into a short prefill, but only on the replica that prefilled the document. The policy
remembers, per replica, the prompts it sent there as a chain of hashes of fixed-size token
blocks (block i's hash covers tokens 0..i*BLOCK, so one dictionary lookup per block finds how
many leading blocks a replica has seen). A request goes to

1. the replica that saw the longest run of its leading blocks, if that run is at least
   MIN_MATCH tokens (among equals, the least loaded);
2. otherwise the replica its leading tokens hash to (rendezvous hashing over the live replicas:
   any front end, even one just restarted with no memory, sends a document to the same replica,
   and a replica that leaves moves only its own documents);
3. unless that replica is saturated (`Load.saturated`): then the least loaded one.

What it cannot know: a replica's own evictions (it may have dropped a document it was sent), and
what other front ends sent where (their memories are their own; the hashing still agrees).
`RoundRobin` ignores prompts: the contrast the tests and the benchmark measure affinity against.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# A block of this many tokens is the unit the router remembers prompts by. A shared run shorter
# than MIN_MATCH (a chat template's header, a short system prompt) counts for nothing: it would
# pull every new document to the replica that first saw it, for a prefill of a second or so.
# MIN_MATCH = HASH_TOKENS: a prompt that shares fewer leading tokens is hashed on its own ones.
BLOCK = 64
HASH_TOKENS = 256  # the leading tokens a new prompt is hashed by
MIN_MATCH = HASH_TOKENS
MAX_BLOCKS = 1 << 20  # remembered block hashes, all replicas together (least recently used go first)
IMBALANCE = 4  # a replica this many requests above the least loaded is saturated (see Load)


@dataclass(frozen=True)
class Route:
    """What the router reads of a request: its prompt's token ids, and the replicas a retry avoids."""

    ids: tuple[int, ...]
    avoid: tuple[str, ...] = ()


@dataclass(frozen=True)
class Load:
    """A replica's requests in flight as this front end counts them, and the bounds of saturation:
    `capacity` (it runs that many at once; more wait) and `imbalance` (this many more than the least
    loaded replica: a document's prefill elsewhere costs less than the wait)."""

    in_flight: int
    capacity: int
    imbalance: int

    def saturated(self, least: int) -> bool:
        return self.in_flight >= self.capacity or self.in_flight - least >= self.imbalance


def block_hashes(ids: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """The chained hash of each full leading block of `ids`."""
    out: list[bytes] = []
    h = b""
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.blake2b(h + _pack(ids[start:start + block]), digest_size=16).digest()
        out.append(h)
    return out


def _pack(ids: Sequence[int]) -> bytes:
    return b"".join(int(t).to_bytes(4, "little", signed=True) for t in ids)


def owner(ids: Sequence[int], replicas: Sequence[str]) -> str:
    """The replica `ids`' leading tokens hash to (rendezvous hashing: the highest score wins)."""
    key = _pack(ids[:HASH_TOKENS])
    return max(replicas, key=lambda r: hashlib.blake2b(key + r.encode(), digest_size=8).digest())


class Affinity:
    name = "affinity"

    def __init__(self, block: int = BLOCK, max_blocks: int = MAX_BLOCKS) -> None:
        self.block, self.max_blocks = block, max_blocks
        self._seen: OrderedDict[bytes, set[str]] = OrderedDict()  # block hash -> replicas sent it

    def matches(self, ids: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """Leading tokens of `ids` each replica has been sent (whole blocks)."""
        out = dict.fromkeys(replicas, 0)
        alive = set(replicas)
        for i, h in enumerate(block_hashes(ids, self.block)):
            holders = self._seen.get(h, set()) & alive
            if not holders:
                break
            for r in holders:
                out[r] = (i + 1) * self.block
            alive = holders
        return out

    def choose(self, ids: Sequence[int], loads: dict[str, Load]) -> list[str]:
        """The live replicas (the keys of `loads`), best first."""
        replicas = sorted(loads)
        if not replicas:
            return []
        match = self.matches(ids, replicas)
        best = max(match.values())
        home = owner(ids, replicas)
        if best >= MIN_MATCH:  # the longest match; among equals, the least loaded, then the hashed owner
            pick = min((r for r in replicas if match[r] == best), key=lambda r: (loads[r].in_flight, r != home, r))
        else:
            pick = home
        least = min(load.in_flight for load in loads.values())
        by_load = sorted(replicas, key=lambda r: (loads[r].in_flight, -match[r], r))
        if loads[pick].saturated(least):
            return by_load
        return [pick, *(r for r in by_load if r != pick)]

    def routed(self, ids: Sequence[int], replica: str) -> None:
        """Remember that `replica` was sent `ids` (its prefix cache will hold them)."""
        for h in block_hashes(ids, self.block):
            holders = self._seen.get(h)
            if holders is None:
                self._seen[h] = {replica}
            else:
                holders.add(replica)
                self._seen.move_to_end(h)
        while len(self._seen) > self.max_blocks:
            self._seen.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica that left (died, scaled down): its cache went with it."""
        for h in [h for h, holders in self._seen.items() if replica in holders]:
            holders = self._seen[h]
            holders.discard(replica)
            if not holders:
                del self._seen[h]


class RoundRobin:
    """Each request to the next replica in turn, whatever it asks (the contrast to affinity)."""

    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, ids: Sequence[int], loads: dict[str, Load]) -> list[str]:
        replicas = sorted(loads)
        if not replicas:
            return []
        i = next(self._turn) % len(replicas)
        return replicas[i:] + replicas[:i]

    def routed(self, ids: Sequence[int], replica: str) -> None:
        pass

    def forget(self, replica: str) -> None:
        pass


POLICIES = {"affinity": Affinity, "round-robin": RoundRobin}
