"""The server's start-up: load the pair that `serve`'s flags name, size its KV budget and prefix
cache from this machine's memory, and make the `Server` (app.py) over a local backend (local.py).
`specextend serve` assembles one in its own process; with `--replicas` each Ray replica does."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .. import api
from ..batching.scheduler import available_memory_mb, default_kv_mb
from ..options import model_options, settings_from_args
from .app import Server
from .local import LocalBackend

CACHE_SHARE = 0.4  # of the memory still available once the models are loaded
MIN_DEFAULT_CACHE_MB = 256

log = logging.getLogger("specextend.serve")


def default_cache_mb(reserved_mb: float = 0.0) -> float:
    """The prefix cache's share of the memory available, less `reserved_mb` (the KV budget)."""
    avail = available_memory_mb()
    return 2048.0 if avail is None else max(MIN_DEFAULT_CACHE_MB, CACHE_SHARE * (avail - reserved_mb))


def build(args: argparse.Namespace, memory_share: float = 1.0) -> Server:
    """Load the pair `args` names and make its server. The default KV budget and prefix cache take
    `memory_share` of their usual shares (replicas that share a machine split its memory)."""
    defaults = settings_from_args(args)
    prepared = api.prepare(args.target, args.draft, **model_options(args), progress=not args.quiet)
    encoder = prepared.with_own_tokenizer()
    pair = prepared.load()
    # The KV budget's default share is of the memory available now; the prefix cache's of what is left.
    kv_mb = args.kv_mb if args.kv_mb is not None else default_kv_mb() * memory_share
    cache_mb = default_cache_mb(kv_mb) * memory_share if args.cache_mb is None else args.cache_mb
    if cache_mb > 0 or args.cache_dir is not None:
        cache = pair.enable_prefix_cache(cache_mb, Path(args.cache_dir) if args.cache_dir else None,
                                         args.cache_disk_mb)
        where = f", mirrored in {args.cache_dir}" if args.cache_dir else ""
        log.info("prefix cache: up to %.0f MB%s (%d entries on disk)", cache_mb, where,
                 cache.stats().get("disk_entries", 0))
    backend = LocalBackend(pair, args.max_queue,
                           batching=dict(max_batch=args.max_batch, step_tokens=args.step_tokens, kv_mb=kv_mb))
    return Server(backend, encoder, defaults, prepared.target_path.name)
