"""One cached prompt prefix as a file: its token ids, what wrote it, and its KV, written atomically
and read back only when its checksum holds.

Layout: MAGIC, the header's length (8 bytes, little-endian), the header (UTF-8 JSON: format,
model fingerprint, kinds, token ids, tensor dtypes and shapes), a SHA-256 of header + payload
(32 bytes), then the payload (the tensors' raw bytes, in header order). The checksum covers the
header too, because the token ids in it decide which prompts the KV is used for: a flipped bit
there would silently attach one prompt's KV to another.

Writes go to a temporary file in the same folder, are flushed to disk, then renamed over the
final name (and the folder synced), so a reader sees the old file, the new one, or none, never
half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..runtime.kv_cache import KVSnapshot, PrefixKV, first_head

MAGIC = b"SPXKV\x00\x01\n"
FORMAT = 1
SUFFIX = ".kv"
_LEN = struct.Struct("<Q")
_DIGEST = 32
MAX_HEADER = 64 << 20  # a header is token ids and a few names; more means a corrupt length field

_DTYPES = {str(d).removeprefix("torch."): d
           for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8)}


class CorruptFile(Exception):
    """A cache file that cannot be trusted (truncated, altered, foreign or of another format)."""


@dataclass(frozen=True)
class Header:
    """What a file says about itself, readable without reading (or trusting) its payload."""

    fingerprint: str  # the models and runtime that wrote the KV (see PrefixCache)
    target_kind: str
    draft_kind: str | None
    tokens: tuple[int, ...]
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape)
    payload_bytes: int
    # per model ("target", "draft"): (first position its windowed layers hold, window), if it has any
    windows: tuple[tuple[str, int, int], ...] = ()

    @property
    def first_head(self) -> int:
        """The fewest leading tokens the file's KV serves (kv_cache.KVSnapshot.first_head)."""
        return max([1] + [first_head(first, window) for _, first, window in self.windows])


def _snapshots(prefix: PrefixKV) -> list[tuple[str, KVSnapshot]]:
    return [("target", prefix.target_kv)] + ([("draft", prefix.draft_kv)] if prefix.draft_kv is not None else [])


def _tensors(prefix: PrefixKV) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, snap in _snapshots(prefix):
        out += [(f"{name}.k", snap.k), (f"{name}.v", snap.v)]
        if snap.wk is not None and snap.wv is not None:  # the windowed layers' (their last tokens)
            out += [(f"{name}.wk", snap.wk), (f"{name}.wv", snap.wv)]
    if prefix.draft_computed is not None:  # the slots the draft computed (absent: all)
        out.append(("draft.computed", prefix.draft_computed.to(torch.uint8)))
    return out


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (one if it is not contiguous); none of an empty one (a convolution's
    values)."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()).cast("B")


def write(path: Path, tokens: list[int], prefix: PrefixKV, fingerprint: str, target_kind: str,
          draft_kind: str | None) -> None:
    """Write atomically: a reader never sees a partial file under `path`."""
    tensors = _tensors(prefix)
    header = json.dumps({
        "format": FORMAT,
        "fingerprint": fingerprint,
        "target_kind": target_kind,
        "draft_kind": draft_kind,
        "tokens": list(tokens),
        "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors],
        "windows": [[name, snap.wfirst, snap.window] for name, snap in _snapshots(prefix) if snap.wk is not None],
    }).encode()
    raws = [_raw(t) for _, t in tensors]
    digest = hashlib.sha256(header)
    for r in raws:
        digest.update(r)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LEN.pack(len(header)) + header + digest.digest())
            for r in raws:
                f.write(r)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    """Make the rename itself durable (where the platform allows opening a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def read_header(path: Path) -> Header:
    """The header alone (not yet verified: `read` checks it with the payload before any use)."""
    with open(path, "rb") as f:
        return _parse_header(f, os.fstat(f.fileno()).st_size)[0]


def _parse_header(f: Any, size: int) -> tuple[Header, bytes, bytes]:
    head = f.read(len(MAGIC) + _LEN.size)
    if len(head) < len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
        raise CorruptFile("not a specextend KV file (bad magic)")
    (n,) = _LEN.unpack(head[len(MAGIC):])
    if n > min(MAX_HEADER, size):
        raise CorruptFile("header length field out of range")
    raw = f.read(n)
    digest = f.read(_DIGEST)
    if len(raw) != n or len(digest) != _DIGEST:
        raise CorruptFile("truncated header")
    try:
        d = json.loads(raw)
        if d["format"] != FORMAT:
            raise CorruptFile(f"format {d['format']!r}, expected {FORMAT}")
        tensors = tuple((str(name), str(dt), tuple(int(x) for x in shape)) for name, dt, shape in d["tensors"])
        if any(dt not in _DTYPES for _, dt, _ in tensors):
            raise CorruptFile("unknown tensor dtype")
        payload = sum(_numel(shape) * _DTYPES[dt].itemsize for _, dt, shape in tensors)
        header = Header(str(d["fingerprint"]), str(d["target_kind"]),
                        None if d["draft_kind"] is None else str(d["draft_kind"]),
                        tuple(int(t) for t in d["tokens"]), tensors, payload,
                        tuple((str(name), int(first), int(window)) for name, first, window in d.get("windows", [])))
    except CorruptFile:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptFile(f"unreadable header: {type(e).__name__}") from None
    expected = len(MAGIC) + _LEN.size + n + _DIGEST + payload
    if size != expected:
        raise CorruptFile(f"file is {size} bytes, its header describes {expected}")
    return header, raw, digest


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def read(path: Path) -> tuple[Header, PrefixKV]:
    """The header and KV, after checking the checksum over both; CorruptFile if anything is off."""
    with open(path, "rb") as f:
        header, raw_header, digest = _parse_header(f, os.fstat(f.fileno()).st_size)
        payload = bytearray(header.payload_bytes)
        if f.readinto(payload) != header.payload_bytes:
            raise CorruptFile("truncated payload")
    check = hashlib.sha256(raw_header)
    check.update(payload)
    if check.digest() != digest:
        raise CorruptFile("checksum mismatch")
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for name, dt, shape in header.tensors:
        nbytes = _numel(shape) * _DTYPES[dt].itemsize
        # The tensors share the one buffer just read: no second copy of a long prompt's KV.
        tensors[name] = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset).view(
            _DTYPES[dt]).view(shape) if nbytes else torch.empty(shape, dtype=_DTYPES[dt])
        offset += nbytes
    try:
        windows = {name: (first, window) for name, first, window in header.windows}

        def snapshot(name: str) -> KVSnapshot:
            first, window = windows.get(name, (0, 0))
            return KVSnapshot(tensors[f"{name}.k"], tensors[f"{name}.v"], tensors.get(f"{name}.wk"),
                              tensors.get(f"{name}.wv"), first, window)

        target = snapshot("target")
        draft = snapshot("draft") if "draft.k" in tensors else None
        computed = tensors["draft.computed"].to(torch.bool) if "draft.computed" in tensors else None
        prefix = PrefixKV(target, draft, computed)
    except (KeyError, ValueError) as e:
        raise CorruptFile(f"inconsistent tensors: {e}") from None
    if prefix.length != len(header.tokens) or (draft is None) != (header.draft_kind is None):
        raise CorruptFile("tensors do not match the header's tokens")
    return header, prefix
