"""The prefix cache: prefilled KV of earlier prompts, so a prompt that starts the same way (the same
long document with another question) prefills only what differs.

An entry is one prompt's KV, the target cache and the draft's store (the slots the draft computed
so far: it computes a prompt's KV where its policy reads it, speculation/draft_prefill.py), keyed by its
token ids. A lookup takes the entry sharing the longest run of leading
tokens with the new prompt and uses that many of its slots: slot i depends on tokens 0..i only
(attention is causal), so the first n slots of any prompt that starts with those n tokens are
the same. At least the prompt's last token is always prefilled, since decoding needs its logits
and retrieval its queries.

Entries are also keyed by their *kind*, the attention kernel that wrote them (see
`api.kv_backend`): the float backends write K/V that agree only to rounding, so a prefix is reused
only by a prefill that would have written the same bits.

Memory is bounded: least recently used entries go first once their KV bytes exceed the cap. An
entry whose tokens extend an older one's replaces it (the older is then a prefix of it), and an
entry that an existing one already covers is not stored twice. Two prompts that share a long head and
differ only in short tails (questions about one document) keep one entry in memory, the shared head:
the second copy of a 32K-token document's KV would be 0.9 GB (`_Tier.fork`). With a folder, every entry is
also written there (`kv_file`: atomic, checksummed), under its own LRU cap, so a restarted
server finds its long prefills again; a file that fails its check is removed and never used. The folder
forks as memory does: two such questions leave one file, the shared head (written from the newer prompt's
KV, the file it replaces removed once the head is on disk).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..runtime import kernels
from ..runtime.kv_cache import PrefixKV, common_prefix
from . import kv_file

log = logging.getLogger("specextend.requests.prefix_cache")

STALE_TMP_S = 3600  # a writer's temporary file older than this was left by a crash
# Two entries sharing at least FORK_MIN leading tokens, neither tail longer than 1/FORK_TAIL of them,
# become their shared head: what is lost is at most that much prefill a tail, what is kept is one copy.
FORK_MIN = 1024
FORK_TAIL = 8


@dataclass
class _Entry:
    tokens: np.ndarray  # int64
    target_kind: str
    draft_kind: str | None
    nbytes: int
    prefix: PrefixKV | None = None  # in memory
    path: Path | None = None  # on disk
    draft_slots: int = 0  # slots holding draft KV (a file read back counts as complete)
    first_head: int = 1  # the fewest leading tokens its KV serves (windowed layers keep their last)

    def serves(self, target_kind: str, draft_kind: str | None) -> bool:
        """Whether this entry's KV can stand in for a prefill of these kinds (None: no draft
        needed). An entry without draft KV serves a draft too: the draft computes its slots."""
        return self.target_kind == target_kind and (draft_kind is None or self.draft_kind in (None, draft_kind))

    def holds(self, other: _Entry) -> bool:
        """Whether this entry has every kind of KV `other` has, as much of the draft's."""
        return (self.serves(other.target_kind, other.draft_kind)
                and (other.draft_kind is None or self.draft_kind == other.draft_kind)
                and self.draft_slots >= other.draft_slots)


class _Tier:
    """Entries in least- to most-recently-used order under a byte cap (memory, or the folder)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, _Entry] = OrderedDict()
        self.bytes = 0
        self.evictions = 0

    def __iter__(self) -> Iterator[tuple[str, _Entry]]:
        return iter(list(self.entries.items()))

    def best(self, tokens: np.ndarray, target_kind: str, draft_kind: str | None, most: int
             ) -> tuple[str | None, int]:
        """The entry sharing the longest leading run with `tokens` (at most `most` tokens of it) whose
        KV serves that run, and the run's length."""
        best_key, best_n, best_draft = None, 0, -1
        for key, e in self.entries.items():
            if e.serves(target_kind, draft_kind):
                n = min(common_prefix(e.tokens, tokens), most)
                n = n if n >= e.first_head else 0
                draft = e.draft_slots if draft_kind is not None and e.draft_kind is not None else 0
                if (n, draft) > (best_n, best_draft):  # the longest run; with the draft's KV on a tie
                    best_key, best_n, best_draft = key, n, draft
        return best_key, best_n

    def covering(self, new: _Entry) -> str | None:
        """An entry that already holds all of `new`'s tokens and KV."""
        for key, e in self.entries.items():
            if (e.holds(new) and len(e.tokens) >= len(new.tokens) and e.first_head <= new.first_head
                    and common_prefix(e.tokens, new.tokens) == len(new.tokens)):
                return key
        return None

    def superseded(self, new: _Entry) -> list[str]:
        """Entries that `new` makes redundant: their tokens start `new`'s, and `new` holds their KV."""
        return [key for key, e in self.entries.items()
                if new.holds(e) and len(e.tokens) <= len(new.tokens) and new.first_head <= e.first_head
                and common_prefix(e.tokens, new.tokens) == len(e.tokens)]

    def fork(self, new: _Entry) -> tuple[str, _Entry] | None:
        """An entry that shares a long head with `new` and differs only in a short tail (FORK_MIN,
        FORK_TAIL), and that head as an entry of its own: a view of whichever of the two holds more of
        the draft's KV there (it keeps that one's storage, a tail longer than the head, alive)."""
        for key, e in self.entries.items():
            if e.target_kind != new.target_kind or e.draft_kind != new.draft_kind:
                continue
            n = common_prefix(e.tokens, new.tokens)
            tails = max(len(e.tokens), len(new.tokens)) - n
            if n < FORK_MIN or tails * FORK_TAIL > n or n < max(e.first_head, new.first_head):
                continue
            heads = [(x.prefix.head(n), x) for x in (e, new) if x.prefix is not None]
            head, src = max(heads, key=lambda h: h[0].draft_slots)
            return key, _Entry(src.tokens[:n].copy(), src.target_kind, src.draft_kind, src.nbytes, prefix=head,
                               draft_slots=head.draft_slots, first_head=head.first_head)
        return None

    def make_way(self, new: _Entry, own_bytes: bool) -> tuple[_Entry, list[tuple[str, _Entry]]]:
        """Take out the entries `new` makes redundant (those it extends, and one it shares a long head
        with: `fork`) and return what to store instead of `new` (itself, or that shared head) with the
        entries taken out. own_bytes: the head counts its own bytes (a file), not the storage it views."""
        gone = [(old, self.remove(old)) for old in self.superseded(new)]
        fork = self.fork(new)
        if fork is None:
            return new, gone
        gone.append((fork[0], self.remove(fork[0])))
        head = fork[1]
        if own_bytes and head.prefix is not None:
            head.nbytes = head.prefix.nbytes
        return head, gone

    def add(self, key: str, e: _Entry) -> None:
        if key in self.entries:  # the same tokens and kinds again (a fork's head): replaced
            self.remove(key)
        self.entries[key] = e
        self.bytes += e.nbytes

    def remove(self, key: str) -> _Entry:
        e = self.entries.pop(key)
        self.bytes -= e.nbytes
        return e

    def touch(self, key: str) -> None:
        self.entries.move_to_end(key)

    def overflow(self) -> Iterator[tuple[str, _Entry]]:
        """Remove and yield least recently used entries until the tier fits its cap."""
        while self.bytes > self.max_bytes and self.entries:
            key = next(iter(self.entries))
            self.evictions += 1
            yield key, self.remove(key)


def fingerprint(models: Sequence[tuple[Path | None, Any]]) -> str:
    """What must match for KV written by another process to be used here: each model's files
    (`(path, model)`; paths, sizes, modification times), how it was loaded (weights, dtypes, the
    rope factors a context chose), and
    the version of the kernels' arithmetic. A missing model (no draft) counts as such."""
    h = hashlib.sha256(f"kernels {kernels.arithmetic_version()}\0".encode())
    for path, model in models:
        if path is None or model is None:
            h.update(b"none\0")
            continue
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        for f in files:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\0".encode())
        h.update(f"{model.weights}:{model.dtype}:{model.kv_dtype}\0".encode())
        if model.kv_dtype == torch.int8 and model.key_offset_digest:  # a q8 cache's keys less its offsets
            h.update(f"key offsets {model.key_offset_digest}\0".encode())
        if model.cfg.long_rope:  # keys rotated with LongRoPE's long factors (a context beyond its window)
            h.update(b"long rope\0")
    return h.hexdigest()[:32]


class PrefixCache:
    """LRU store of prompt-prefix KV under a memory cap, optionally mirrored to a folder."""

    def __init__(self, max_bytes: int, fingerprint: str = "", directory: str | Path | None = None,
                 max_disk_bytes: int | None = None) -> None:
        """`fingerprint` names the models and runtime: a folder's files written under another
        are left alone (they hold another model's KV)."""
        if max_bytes < 0:
            raise ValueError("the cache cap must be >= 0")
        self.memory = _Tier(max_bytes)
        self.fingerprint = fingerprint
        self.directory = Path(directory) if directory is not None else None
        self.disk = _Tier(max_bytes if max_disk_bytes is None else max_disk_bytes)
        self.hits = self.misses = self.corrupt_files = 0
        self.cached_tokens = 0  # prompt tokens served from the cache, in all
        self._lock = threading.Lock()
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan()

    # ----------------------------------------------------------------- the two operations

    def lookup(self, tokens: Sequence[int], target_kind: str, draft_kind: str | None) -> PrefixKV | None:
        """The KV of the longest cached run of `tokens`' leading tokens, stopping one short of
        the whole prompt; None on a miss. `draft_kind` None: only the target's KV is needed."""
        ids = np.asarray(tokens, dtype=np.int64)
        most = len(ids) - 1
        with self._lock:
            while True:
                key, n = self.memory.best(ids, target_kind, draft_kind, most)
                disk_key, disk_n = self.disk.best(ids, target_kind, draft_kind, most)
                prefix = None
                if disk_key is not None and disk_n > n:
                    prefix = self._load(disk_key)
                    if prefix is None:
                        continue  # that file was corrupt and is gone: look again
                    n = disk_n
                elif key is not None and n >= 1:
                    self.memory.touch(key)
                    prefix = self.memory.entries[key].prefix
                if prefix is None or n < 1:
                    self.misses += 1
                    return None
                self.hits += 1
                self.cached_tokens += n
                head = prefix.head(n)
                return head if draft_kind is not None else PrefixKV(head.target_kv, None)

    def insert(self, tokens: Sequence[int], prefix: PrefixKV, target_kind: str, draft_kind: str | None) -> None:
        """Remember a prompt's KV (`prefix` covers all of `tokens`; draft_kind None: no draft KV)."""
        if prefix.length != len(tokens) or (prefix.draft_kv is None) != (draft_kind is None):
            raise ValueError("the KV does not match the tokens and kinds it is stored under")
        ids = np.asarray(tokens, dtype=np.int64)
        key = self._key(ids, target_kind, draft_kind)
        with self._lock:
            entry = _Entry(ids, target_kind, draft_kind, prefix.nbytes, prefix=prefix, draft_slots=prefix.draft_slots,
                           first_head=prefix.first_head)
            self._insert_memory(key, entry)
            if self.directory is not None:
                self._insert_disk(key, entry)

    # ----------------------------------------------------------------- memory

    def _insert_memory(self, key: str, entry: _Entry) -> None:
        if entry.nbytes > self.memory.max_bytes:
            log.info("prefix of %d tokens (%.0f MB) is larger than the cache cap; not kept in memory",
                     len(entry.tokens), entry.nbytes / 2**20)
            return
        covering = self.memory.covering(entry)
        if covering is not None:
            self.memory.touch(covering)
            return
        stored, _ = self.memory.make_way(entry, own_bytes=False)  # a shared head is a view: no copy
        if stored is not entry:
            key, entry = self._key(stored.tokens, stored.target_kind, stored.draft_kind), stored
        self.memory.add(key, entry)
        for _ in self.memory.overflow():
            pass

    # ----------------------------------------------------------------- disk

    def _key(self, ids: np.ndarray, target_kind: str, draft_kind: str | None) -> str:
        h = hashlib.sha256(f"{self.fingerprint}\0{target_kind}\0{draft_kind}\0".encode())
        h.update(ids.tobytes())
        return h.hexdigest()[:40]

    def _insert_disk(self, key: str, entry: _Entry) -> None:
        assert self.directory is not None and entry.prefix is not None
        if entry.nbytes > self.disk.max_bytes:
            return
        covering = self.disk.covering(entry)
        if covering is not None:
            self._touch_disk(covering)
            return
        stored, gone = self.disk.make_way(entry, own_bytes=True)  # one file for a shared head, as in memory
        if stored is not entry:
            key, entry = self._key(stored.tokens, stored.target_kind, stored.draft_kind), stored
        path = self.directory / f"{key}{kv_file.SUFFIX}"
        try:
            kv_file.write(path, entry.tokens.tolist(), entry.prefix, self.fingerprint, entry.target_kind,
                          entry.draft_kind)
        except OSError as e:
            log.warning("could not write the prefix cache file %s: %s", path, e)
            for old, e_old in gone:  # still on disk: indexed again
                self.disk.add(old, e_old)
            return
        for old, e_old in gone:
            if old != key:  # the same key's file was just rewritten in place
                self._unlink(e_old)
        self.disk.add(key, _Entry(entry.tokens, entry.target_kind, entry.draft_kind, entry.nbytes, path=path,
                                  draft_slots=entry.draft_slots, first_head=entry.first_head))
        for _, old_entry in self.disk.overflow():
            self._unlink(old_entry)

    def _load(self, key: str) -> PrefixKV | None:
        """A folder entry's KV after checking it, kept in memory if it fits; None (and the file
        removed) if it fails the check."""
        e = self.disk.entries[key]
        assert e.path is not None
        try:
            header, prefix = kv_file.read(e.path)
            if (header.fingerprint != self.fingerprint or header.target_kind != e.target_kind
                    or header.draft_kind != e.draft_kind or not np.array_equal(np.asarray(header.tokens), e.tokens)):
                raise kv_file.CorruptFile("the file changed since it was indexed")
        except (kv_file.CorruptFile, OSError) as err:
            self._corrupt(e.path, err)
            self.disk.remove(key)
            return None
        self._touch_disk(key)
        self._insert_memory(key, _Entry(e.tokens, e.target_kind, e.draft_kind, prefix.nbytes, prefix=prefix,
                                        draft_slots=prefix.draft_slots, first_head=prefix.first_head))
        return prefix

    def _touch_disk(self, key: str) -> None:
        self.disk.touch(key)
        path = self.disk.entries[key].path
        if path is not None:
            with contextlib.suppress(OSError):
                os.utime(path)  # the folder's LRU order survives a restart (it is read from mtimes)

    def _scan(self) -> None:
        """Index the folder's files (headers only; payloads are checked when first used)."""
        assert self.directory is not None
        found = []
        for path in self.directory.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if time.time() - path.stat().st_mtime > STALE_TMP_S:
                        path.unlink()
                continue
            if path.suffix != kv_file.SUFFIX or not path.is_file():
                continue
            try:
                header = kv_file.read_header(path)
                mtime = path.stat().st_mtime
            except (kv_file.CorruptFile, OSError) as err:
                self._corrupt(path, err)
                continue
            if header.fingerprint != self.fingerprint:
                continue  # another model's KV: not ours to use or remove
            found.append((mtime, path, header))
        for _, path, header in sorted(found, key=lambda f: f[0]):
            ids = np.asarray(header.tokens, dtype=np.int64)
            self.disk.add(path.stem, _Entry(ids, header.target_kind, header.draft_kind, header.payload_bytes,
                                            path=path, draft_slots=len(ids) if header.draft_kind else 0,
                                            first_head=header.first_head))
        for _, old in self.disk.overflow():
            self._unlink(old)
        if found:
            log.info("prefix cache: %d entries (%.0f MB) in %s", len(self.disk.entries), self.disk.bytes / 2**20,
                     self.directory)

    def _corrupt(self, path: Path, err: Exception) -> None:
        self.corrupt_files += 1
        log.warning("ignored and removed the corrupt prefix cache file %s: %s", path.name, err)
        with contextlib.suppress(OSError):
            path.unlink()

    def _unlink(self, e: _Entry) -> None:
        if e.path is not None:
            with contextlib.suppress(OSError):
                e.path.unlink()

    # ----------------------------------------------------------------- reporting

    def stats(self) -> dict[str, Any]:
        with self._lock:
            d: dict[str, Any] = {
                "entries": len(self.memory.entries),
                "bytes": self.memory.bytes,
                "max_bytes": self.memory.max_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "cached_tokens": self.cached_tokens,
                "evictions": self.memory.evictions,
            }
            if self.directory is not None:
                d.update(disk_entries=len(self.disk.entries), disk_bytes=self.disk.bytes,
                         disk_max_bytes=self.disk.max_bytes, corrupt_files=self.corrupt_files,
                         directory=str(self.directory))
            return d
