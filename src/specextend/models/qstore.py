"""The quantized model file: one safetensors file holding float tensors under their Hugging Face
names and block-quantized tensors (`quant.Segment`) as uint8 blobs, with each blob's format in
the file's metadata. Written by the GGUF converter, read by the loader.

A blob's size must match its format and shape exactly, so a truncated or overwritten file is
refused when it is opened, never read back half-written.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..common.errors import UserError
from ..runtime import hugepages, kernels
from ..runtime.quant import FORMATS, PANEL, Segment, bf16_pairs, blob_bytes, stacking_runs

_KEY = "specextend.quantized"

# What `stream_tensors` is given for one tensor: the whole, or its runs of rows in order.
Produced = torch.Tensor | Segment | Iterable[torch.Tensor | Segment]


# safetensors' names for the dtypes we write.
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.uint8: "U8"}
_TORCH_DTYPES = {name: dtype for dtype, name in _DTYPES.items()}


def save_tensors(path: Path, floats: dict[str, torch.Tensor], segments: dict[str, Segment]) -> None:
    """Write float tensors and quantized segments into one safetensors file at `path`, atomically
    (a temporary file renamed into place: readers see the old file or the whole new one)."""
    planned = {name: (t.dtype, tuple(t.shape)) for name, t in floats.items()}
    stream_tensors(path, planned, segments, lambda name: floats[name] if name in floats else segments[name])


def stream_tensors(path: Path, floats: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                   segments: dict[str, Segment], produce: Callable[[str], Produced]) -> None:
    """`save_tensors`, one tensor (or less) in memory at a time: `floats` gives each float tensor's
    dtype and shape, `segments` each quantized one's format (its blob may be a stand-in: only its
    format, n, k, offset and groups are read), and `produce(name)` the real tensor or segment when
    it is written, or an iterable of its runs of rows in order (each segment's but the last a
    whole number of panels), written as they come.

    The safetensors library writes only from a dict of every tensor, which held a whole expanded
    model in memory while converting; the format is simple enough to write in order, and in an order
    of our own (below), which the library reads as well.
    """
    meta = {name: {"format": s.fmt, "n": s.n, "k": s.k, "offset": s.offset, "groups": s.groups}
            for name, s in segments.items()}
    entries = {**floats, **{name: (torch.uint8, (blob_bytes(s.fmt, s.n, s.k, s.groups),))
                            for name, s in segments.items()}}
    # Blobs first (each a multiple of 64 bytes, so each starts on a cache line), the parts the loader
    # stacks next to one another in its order, then float tensors by decreasing element size.
    floats_only = set(floats) - set(segments)
    order = sorted(segments, key=_write_key) + sorted(floats_only, key=lambda name: (-entries[name][0].itemsize, name))
    header: dict[str, Any] = {"__metadata__": {"format": "pt", _KEY: json.dumps(meta)}}
    start = 0
    for name in order:
        dtype, shape = entries[name]
        size = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 64)  # the data starts on a cache line (the library pads to 8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for name in order:
                got = produce(name)
                _write_parts(f, name, [got] if isinstance(got, (torch.Tensor, Segment)) else got,
                             entries[name], segments.get(name))
                del got
        os.chmod(tmp, 0o644)  # match the other files of a model folder
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# The loader stacks q, k, v and gate, up into one weight each (`loader._Weights.project`): written
# side by side in that order, a stack is one span of the file and is used in place.
_STACKED_ROLES = {"q_proj": "qkv0", "k_proj": "qkv1", "v_proj": "qkv2", "gate_proj": "gate_up0", "up_proj": "gate_up1"}


def _write_key(name: str) -> str:
    return ".".join(_STACKED_ROLES.get(part, part) for part in name.split("."))


def _write_parts(f: Any, name: str, parts: Iterable[torch.Tensor | Segment],
                 planned: tuple[torch.dtype, tuple[int, ...]], segment: Segment | None) -> None:
    """Write one tensor's runs of rows as they come, checking that they make up the tensor planned."""
    dtype, shape = planned
    rows = 0
    for part in parts:
        if isinstance(part, Segment):
            if segment is None or (part.fmt, part.k, part.offset, part.groups) != (
                    segment.fmt, segment.k, segment.offset, segment.groups):
                raise ValueError(f"{name}: the segment's format differs from the one planned")
            if rows % PANEL:  # the blobs would not join: the earlier run's last panel is padded
                raise ValueError(f"{name}: a run of {rows} rows, not whole panels, before the last of those planned")
            data = part.blob
            if data.dtype != torch.uint8 or data.numel() != blob_bytes(part.fmt, part.n, part.k, part.groups):
                raise ValueError(f"{name}: a blob of {data.numel()} bytes written for {part.n} rows as planned")
            rows += part.n
        else:
            if (segment is not None or part.dtype != dtype or part.dim() != len(shape)
                    or tuple(part.shape[1:]) != shape[1:]):
                raise ValueError(f"{name}: {part.dtype} {tuple(part.shape)} written, {dtype} {shape} planned")
            rows += part.shape[0] if shape else 1
            data = part
        f.write(data.contiguous().reshape(-1).view(torch.uint8).numpy().data)
        del part, data
    expected = segment.n if segment is not None else shape[0] if shape else 1
    if rows != expected:
        raise ValueError(f"{name}: {rows} rows written, {expected} planned")


class DerivedWeights:
    """Quantized forms a scheme computes from a model's weights (int8/int4 from float or from other
    grids), kept in `path` so the quantization runs once: later loads read them back."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.stored: QuantizedFile | None = None
        self.new: dict[str, Segment] = {}
        if path.is_file():
            try:
                self.stored = QuantizedFile(path)
            except UserError as e:  # it can be computed again; say so and do
                print(f"specextend: recomputing {path.name}: {e}", file=sys.stderr)

    def get(self, key: str, compute: Callable[[], Segment | None], streamed: bool = True) -> Segment | None:
        seg = self.stored.segment(key, streamed=streamed) if self.stored is not None else None
        if seg is None:
            seg = compute()
            if seg is not None:
                self.new[key] = seg
        return seg

    def save(self) -> None:
        """Write what was computed (with what was already stored); a read-only cache is skipped."""
        if not self.new:
            return
        stored = self.stored
        # What was stored before is read back one segment at a time as it is written, not all at once.
        old = {n: Segment(f["format"], int(f["n"]), torch.empty(0, dtype=torch.uint8), int(f["offset"]), int(f["k"]),
                          int(f.get("groups", 8)))
               for n, f in (stored.formats if stored else {}).items() if n not in self.new}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            stream_tensors(self.path, {}, {**old, **self.new},
                           lambda n: self.new[n] if n in self.new else stored.segment(n))
        except OSError as e:
            print(f"specextend: could not cache {self.path}: {e.strerror}", file=sys.stderr)


def is_quantized_file(path: Path) -> bool:
    """Whether `path` is a safetensors file written by `save_tensors` (cheap: reads the header)."""
    return _KEY in (_header(path).get("__metadata__") or {})


def _header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < 100 * 2**20:
                raise ValueError("bad header size")
            return json.loads(f.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is corrupt or truncated: {e}") from None


class QuantizedFile:
    """Lazy access to a `save_tensors` file: float tensors by name, quantized ones as segments."""

    quantized = True

    def __init__(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        header = _header(path)
        try:  # safetensors refuses a file shorter than its header says
            self.handle = safe_open(str(path), framework="pt")
            meta = self.handle.metadata() or {}
            self.formats: dict[str, dict[str, Any]] = json.loads(meta.get(_KEY, "{}"))
            self.names = set(self.handle.keys())
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{path} is corrupt or truncated: {e}") from None
        self.path = path
        self.header = header
        with open(path, "rb") as f:
            self.data_start = 8 + int.from_bytes(f.read(8), "little")
        # Weights streamed whole are read into fresh 2 MB pages (an arena: the fastest to stream,
        # runtime/hugepages.py) or, with the switch off, used in place from the file's map; tables read
        # in parts always are. The map's pages are left 2 MB where the kernel can cache the file so.
        self.whole = hugepages.map_file(path)
        self.arena = hugepages.Arena() if hugepages.wanted() else None
        # BF16 matrices are stored as bf16 (the file never depends on the CPU) and loaded as bf16d
        # where this CPU's arithmetic for them is bfloat16 dot products (kernels.bf16_products).
        self.bf16_products = kernels.bf16_products()
        hugepages.huge_file_pages(self.whole, path)  # for its side: a file cached in small pieces is read again
        for name, f in self.formats.items():
            shape = header.get(name, {}).get("shape")
            size = blob_bytes(f["format"], f["n"], f["k"], f.get("groups", 8)) if f.get("format") in FORMATS else -1
            if shape is None or shape[0] != size:
                raise UserError(f"{path} is corrupt: quantized tensor {name} does not match its format")

    def has(self, name: str) -> bool:
        return name in self.names

    def segment(self, name: str, mapped: bool = True, streamed: bool = True) -> Segment | None:
        """The quantized tensor `name`, or None when it is stored as float. `mapped` False reads it
        into memory of its own: for a segment about to be stacked with others (copied again).
        `streamed` False: a table read in parts (an embedding's rows, a layer's experts), kept on the
        file's pages, of which only the parts used become resident."""
        f = self.formats.get(name)
        if f is None:
            return None
        # Kept as it is stored: a copy in the arena (a blob streamed whole every step), else the file's
        # own pages. A part about to be stacked is neither: the pages its copy was read from would
        # stay resident beside the copy.
        own = self.arena is not None and mapped and streamed
        if own:
            blob = self._read(name, out=self.arena.empty(self._nbytes(name)))
        else:
            blob = self._view([name], populated=streamed) if mapped else self._read(name)
        seg = Segment(f["format"], int(f["n"]), blob, int(f["offset"]), int(f["k"]), int(f.get("groups", 8)))
        return self._loaded(seg, own or not mapped)

    def _loaded(self, seg: Segment, own: bool) -> Segment:
        """`seg` as the kernels take it here: a bf16 one as bf16d where bf16_products says so (into its
        own blob where it has one, else a copy beside the file's pages)."""
        return bf16_pairs(seg, in_place=own) if seg.fmt == "bf16" and self.bf16_products else seg

    def stacked_segments(self, names: list[str]) -> list[Segment] | None:
        """The rows of `names` stacked (q, k, v -> qkv) as `QWeight.concat` stacks them, adjacent
        parts of one format, grid and group count in one blob, but each part read straight into its
        place; None where a part is stored as float. Reading the parts first and copying them after
        left their freed memory in the heap, where the C library kept it (hundreds of MB a model)."""
        fs = [self.formats.get(n) for n in names]
        if any(f is None for f in fs) or len({int(f["k"]) for f in fs}) != 1:
            return None  # float parts, or widths that do not stack (concat says why)
        kinds = [(f["format"], int(f["offset"]), int(f.get("groups", 8))) for f in fs]
        segs = []
        for run in stacking_runs(kinds, [int(f["n"]) for f in fs]):
            spans = [[int(x) for x in self.header[names[i]]["data_offsets"]] for i in run]
            adjacent = all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # as `stream_tensors` writes them
            own = not (adjacent and self.arena is None)
            if not own:
                blob = self._view([names[i] for i in run])
            else:  # into the arena, or from a file written before stacked parts were kept together
                size = sum(e - s for s, e in spans)
                blob = self.arena.empty(size) if self.arena is not None else torch.empty(size, dtype=torch.uint8)
                at = 0
                for i, (s, e) in zip(run, spans, strict=True):
                    self._read(names[i], out=blob[at:at + e - s])
                    at += e - s
            fmt, offset, groups = kinds[run[0]]
            segs.append(self._loaded(Segment(fmt, sum(int(fs[i]["n"]) for i in run), blob, offset, int(fs[0]["k"]),
                                             groups), own))
        return segs

    def get(self, name: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor as float `dtype` (quantized ones are dequantized exactly, then cast), into
        `out` (contiguous, of its shape and `dtype`) when given: a part of a stacked weight."""
        seg = self.segment(name)
        if seg is not None and out is not None and dtype == torch.float32:
            return seg.dequantize(out=out)
        t = seg.dequantize() if seg is not None else self._read(name)
        if out is None:
            return t.to(dtype)
        return out.copy_(t)

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as `get` returns it, from the header (nothing read)."""
        f = self.formats.get(name)
        if f is not None:
            return int(f["n"]), int(f["k"])
        if name not in self.names:
            raise UserError(f"{self.path} is missing tensor {name}")
        return tuple(int(d) for d in self.header[name]["shape"])

    def _nbytes(self, name: str) -> int:
        start, end = (int(x) for x in self.header[name]["data_offsets"])
        return end - start

    def _view(self, names: list[str], populated: bool = True) -> torch.Tensor:
        """The bytes of `names` (adjacent in the file, in this order) where they lie in its map;
        `populated`: read in now rather than at the first step's touch."""
        start = int(self.header[names[0]]["data_offsets"][0])
        end = int(self.header[names[-1]]["data_offsets"][1])
        view = self.whole[self.data_start + start:self.data_start + end]
        if view.numel() != end - start:  # safe_open has checked the size; a file cut since is refused
            raise UserError(f"{self.path} is corrupt or truncated: tensor {names[-1]} is short")
        return hugepages.populate(view) if populated else view

    def _read(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """A float tensor, read into memory of its own (`out`: a contiguous uint8 tensor of its
        size, its bytes). A plain read, not the library's memory map:
        pages of a map stay resident once touched, so reading float tensors that are then quantized
        through one held the whole file in the process's memory beside the model made from it (a
        converted float32 file: several GB at a first load)."""
        if name not in self.names:
            raise UserError(f"{self.path} is missing tensor {name}")
        entry = self.header[name]
        dtype = _TORCH_DTYPES.get(entry["dtype"])
        if dtype is None and out is None:  # a dtype we never write: the library reads it
            return self._read_mapped(name)
        start, end = (int(x) for x in entry["data_offsets"])
        if out is None:
            out = torch.empty([int(d) for d in entry["shape"]], dtype=dtype)
        raw = out.reshape(-1).view(torch.uint8).numpy()
        try:
            with open(self.path, "rb") as f:
                f.seek(self.data_start + start)
                got = f.readinto(memoryview(raw))
        except OSError as e:
            raise UserError(f"{self.path} is corrupt or truncated: {e}") from None
        if got != end - start or raw.nbytes != end - start:
            raise UserError(f"{self.path} is corrupt or truncated: tensor {name} is short")
        return out

    def _read_mapped(self, name: str) -> torch.Tensor:
        from safetensors import SafetensorError

        if name not in self.names:
            raise UserError(f"{self.path} is missing tensor {name}")
        try:
            return self.handle.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise UserError(f"{self.path} is corrupt or truncated: {e}") from None
