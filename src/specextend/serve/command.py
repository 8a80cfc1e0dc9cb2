"""The `specextend serve` command: flags, loading, the prefix cache's size, and the HTTP server."""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from pathlib import Path

from ..errors import UserError
from ..options import add_model_arguments, add_settings_arguments, model_options, settings_from_args
from .scheduler import DEFAULT_MAX_BATCH, KV_SHARE, STEP_S, available_memory_mb, default_kv_mb

DEFAULT_MAX_QUEUE = 16
CACHE_SHARE = 0.4  # of the memory still available once the models are loaded
MIN_DEFAULT_CACHE_MB = 256


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
                   help="target rows per batch step: decode rows first, then prompt tokens in chunks (default: as "
                        f"many as the measured step costs fit in {STEP_S} s)")
    g.add_argument("--kv-mb", type=float, default=None,
                   help="memory the running requests' KV caches may take in MB; a request that does not fit waits "
                        f"(default: {KV_SHARE * 100:.0f}%% of the memory available after loading)")
    g.add_argument("--cache-mb", type=float, default=None,
                   help="memory cap of the prefix cache in MB; 0 turns it off (default: "
                        f"{CACHE_SHARE * 100:.0f}%% of the memory available after loading)")
    g.add_argument("--cache-dir", default=None, help="also keep the prefix cache in this folder, across restarts")
    g.add_argument("--cache-disk-mb", type=float, default=None,
                   help="cap of --cache-dir in MB (default: --cache-mb)")
    g.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")


def default_cache_mb(reserved_mb: float = 0.0) -> float:
    """The prefix cache's share of the memory available, less `reserved_mb` (the KV budget)."""
    avail = available_memory_mb()
    return 2048.0 if avail is None else max(MIN_DEFAULT_CACHE_MB, CACHE_SHARE * (avail - reserved_mb))


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
    if args.kv_mb is not None and not 0 < args.kv_mb < float("inf"):
        raise UserError(f"--kv-mb must be a number > 0, got {args.kv_mb}")
    if args.cache_disk_mb is not None and args.cache_dir is None:
        raise UserError("--cache-disk-mb needs --cache-dir")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from .. import api
    from .app import Server

    logging.basicConfig(stream=sys.stderr, format="specextend: %(message)s",
                        level=logging.WARNING if args.quiet else logging.INFO)
    logging.getLogger("specextend").setLevel(logging.WARNING if args.quiet else logging.INFO)
    defaults = settings_from_args(args)
    _check(args)
    sock = listen(args.host, args.port)  # before the slow part: a taken port fails at once
    prepared = api.prepare(args.target, args.draft, **model_options(args), progress=not args.quiet)
    encoder = prepared.with_own_tokenizer()
    pair = prepared.load()
    # The KV budget's default share is of the memory available now; the prefix cache's of what is left.
    kv_mb = args.kv_mb if args.kv_mb is not None else default_kv_mb()
    cache_mb = default_cache_mb(kv_mb) if args.cache_mb is None else args.cache_mb
    if cache_mb > 0 or args.cache_dir is not None:
        cache = pair.enable_prefix_cache(cache_mb, Path(args.cache_dir) if args.cache_dir else None,
                                         args.cache_disk_mb)
        where = f", mirrored in {args.cache_dir}" if args.cache_dir else ""
        logging.getLogger("specextend.serve").info("prefix cache: up to %.0f MB%s (%d entries on disk)", cache_mb,
                                                   where, cache.stats().get("disk_entries", 0))
    model_id = prepared.target_path.name
    server = Server(pair, encoder, defaults, args.max_queue, model_id,
                    batching=dict(max_batch=args.max_batch, step_tokens=args.step_tokens, kv_mb=kv_mb))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"specextend: serving {model_id} ({defaults.method}) on http://{shown}:{port}/v1", file=sys.stderr,
          flush=True)
    config = uvicorn.Config(server.app(), log_level="warning" if args.quiet else "info", access_log=not args.quiet,
                            timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on Ctrl-C, then re-raises it: a normal stop for a server.
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run(sockets=[sock])
    print("specextend: server stopped", file=sys.stderr, flush=True)
    return 0
