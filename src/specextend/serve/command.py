"""The `specextend serve` command: flags, loading, the prefix cache's size, and the HTTP server."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import socket
import sys

from ..batching.budget import GAP_GOAL_S
from ..batching.scheduler import DEFAULT_MAX_BATCH, KV_SHARE
from ..common.errors import UserError
from ..options import add_model_arguments, add_settings_arguments, settings_from_args
from . import auth
from .assemble import CACHE_SHARE
from .drain import DEFAULT_DRAIN_S
from .limits import BODY_BYTES_PER_TOKEN, MIN_BODY_BYTES

DEFAULT_MAX_QUEUE = 16
INSTALL_CLUSTER = "pip install -e '.[cluster]'"
ROUTINGS = ("affinity", "round-robin")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_settings_arguments(p, labels=False)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    g.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait behind the running one; beyond it 429 (default: "
                        f"{DEFAULT_MAX_QUEUE})")
    g.add_argument("--max-batch", type=int, default=None,
                   help=f"requests served at once (continuous batching; default: {DEFAULT_MAX_BATCH})")
    g.add_argument("--step-tokens", type=int, default=None,
                   help="target rows per batch step: decode rows first, then prompt tokens in chunks (default: "
                        "alone, the chunk the measured prefill costs find efficient; beside decoding streams, as "
                        f"many as keep a step within half of their {GAP_GOAL_S:.0f} s gap goal)")
    g.add_argument("--kv-mb", type=float, default=None,
                   help="memory the running requests' KV caches may take in MB; a request that does not fit waits "
                        f"(default: {KV_SHARE * 100:.0f}%% of the memory available after loading)")
    g.add_argument("--cache-mb", type=float, default=None,
                   help="memory cap of the prefix cache in MB; 0 turns it off (default: "
                        f"{CACHE_SHARE * 100:.0f}%% of the memory available after loading)")
    g.add_argument("--cache-dir", default=None, help="also keep the prefix cache in this folder, across restarts")
    g.add_argument("--cache-disk-mb", type=float, default=None,
                   help="cap of --cache-dir in MB (default: --cache-mb)")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health (repeatable; also from "
                        f"{auth.ENV}, comma-separated, which keeps keys out of the process list)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="also accept the keys in FILE (one a line; # comments)")
    g.add_argument("--max-body-mb", type=float, default=None, metavar="MB",
                   help="largest request body in MB; a larger one is refused with 413 before it is read (default: "
                        f"the context in tokens x {BODY_BYTES_PER_TOKEN} bytes, at least "
                        f"{MIN_BODY_BYTES // 2**20} MB)")
    g.add_argument("--drain-s", type=float, default=DEFAULT_DRAIN_S, metavar="S",
                   help="on SIGTERM or Ctrl-C, seconds the requests already taken may run on while new ones get "
                        "503; those still running then are cancelled, and the server exits with status 0 (default: "
                        f"{DEFAULT_DRAIN_S:g})")
    g.add_argument("--no-tool-call-recovery", dest="tool_call_recovery", action="store_false",
                   help="under tool_choice auto, an answer that is a bare JSON call stays text unless the request "
                        "sets tool_call_recovery: true (default: such an answer, valid against a declared tool's "
                        "schema, becomes tool_calls)")
    g.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    c = p.add_argument_group("replicas (Ray Serve; needs the cluster extra: " + INSTALL_CLUSTER + ")")
    c.add_argument("--replicas", type=int, default=None,
                   help="serve with N replicas of the model pair on a Ray cluster, each request routed to the "
                        "replica that holds its document (default: one server in this process, no Ray)")
    c.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or HOST:6379 of a `ray start --head`); default: start "
                        "a local one")
    c.add_argument("--routing", choices=ROUTINGS, default=None,
                   help="affinity: the replica whose prefix cache holds the prompt's longest prefix, else the one "
                        "its leading tokens hash to, else the least loaded; round-robin: each in turn (default: "
                        "affinity)")
    c.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs (and threads) each replica takes (default: a node's CPUs shared by the replicas "
                        "that may land on it)")


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (so a taken port is one clear error before anything loads)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def _check(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if args.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {args.max_queue}")
    for name in ("cache_mb", "cache_disk_mb"):
        v = getattr(args, name)
        if v is not None and not 0 <= v < float("inf"):
            raise UserError(f"--{name.replace('_', '-')} must be a number >= 0, got {v}")
    for name in ("max_batch", "step_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.max_body_mb is not None and not 0 < args.max_body_mb < float("inf"):
        raise UserError(f"--max-body-mb must be a number > 0, got {args.max_body_mb}")
    if not 0 <= args.drain_s < float("inf"):
        raise UserError(f"--drain-s must be a number >= 0, got {args.drain_s}")
    if args.kv_mb is not None and not 0 < args.kv_mb < float("inf"):
        raise UserError(f"--kv-mb must be a number > 0, got {args.kv_mb}")
    if args.cache_disk_mb is not None and args.cache_dir is None:
        raise UserError("--cache-disk-mb needs --cache-dir")
    if args.replicas is None:
        for name in ("ray_address", "routing", "replica_cpus"):
            if getattr(args, name) is not None:
                raise UserError(f"--{name.replace('_', '-')} needs --replicas")
        return
    if args.replicas < 1:
        raise UserError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replica_cpus is not None and not 0 < args.replica_cpus < float("inf"):
        raise UserError(f"--replica-cpus must be a number > 0, got {args.replica_cpus}")
    if importlib.util.find_spec("ray") is None:
        raise UserError(f"--replicas needs Ray Serve: {INSTALL_CLUSTER}")


def run(args: argparse.Namespace) -> int:
    from .app import run_http

    logging.basicConfig(stream=sys.stderr, format="specextend: %(message)s",
                        level=logging.WARNING if args.quiet else logging.INFO)
    logging.getLogger("specextend").setLevel(logging.WARNING if args.quiet else logging.INFO)
    settings_from_args(args)  # bad settings fail here, before anything loads
    _check(args)
    keys = auth.load_keys(args.api_key, args.api_key_file)  # a bad key file fails before anything loads
    sock = listen(args.host, args.port)  # before the slow part: a taken port fails at once
    if args.replicas is not None:
        try:
            from .ray_serve import run_replicas  # Ray is an optional extra, imported only here
        except ImportError as e:  # Ray without its serve packages
            raise UserError(f"--replicas needs Ray Serve ({e}): {INSTALL_CLUSTER}") from None

        return run_replicas(args, sock, keys)
    from .assemble import build

    server = build(args)
    # The loaded pair (the default one: ~225K objects) lives as long as the server: frozen, the cyclic
    # collector's full passes stop walking it (each took 80-140 ms of the step thread, ~3 a busy 2 minutes).
    gc.collect()
    gc.freeze()
    server.configure(keys, args.max_body_mb, args.drain_s, args.tool_call_recovery)
    run_http(server, sock, args.quiet)
    return 0
