"""Memory for the quantized weights that the kernel may back with 2 MB pages (Linux transparent huge
pages), asked for where the system leaves it to the program (`madvise`, most distributions' default).

Why: a decode step streams every weight once, gigabytes a token. In 4 KB pages that is a page-table
walk every 4 KB, and inside a virtual machine each walk is two-level and slow; the CPU's hardware
prefetcher also stops at every 4 KB boundary. On a 2-core Xeon VM a one-row Q4_K product streamed
23.1 GB/s from 2 MB pages against 19-20 from 4 KB ones, and a plain sum of a buffer 34 against 24
(docs/log/2026-12-huge-pages.md). The file's own pages (a memory map) cannot be given 2 MB pages, so
the weights are read into memory of their own instead.

`SPECEXTEND_HUGE_PAGES=0` keeps the memory map (the file's pages, shared between processes that load
the same file).
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
CHUNK = 256 << 20  # an arena's unit: few mappings a model, at most one part-used huge page each
ALIGN = 64  # a cache line: where each blob starts inside an arena
ENV = "SPECEXTEND_HUGE_PAGES"
_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it


def system_mode(path: str = _MODE_FILE) -> str | None:
    """The kernel's transparent-huge-page setting (`always`, `madvise` or `never`: the bracketed
    word), or None where it has none (not Linux, or compiled without)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def wanted() -> bool:
    """Whether weights go into huge-page arenas: the variable allows it, the kernel gives huge pages
    to memory that asks (`always` or `madvise`), and Python can ask."""
    return refusal() is None


def refusal() -> str | None:
    """Why weights stay on the file's pages here, in words; None where they go into huge pages."""
    if os.environ.get(ENV, "1").strip() == "0":
        return f"{ENV}=0"
    mode = system_mode()
    if not hasattr(mmap, "MADV_HUGEPAGE") or mode not in ("always", "madvise"):
        return f"transparent huge pages: {mode or 'not offered here'}"
    return None


def like_weights(nbytes: int) -> torch.Tensor:
    """A uint8 tensor in the kind of memory a loaded model's weights get (an arena of its own, or
    plain memory where huge pages are off): for benchmarks that stand in for a model's stream."""
    return _populated(_mapping(nbytes)) if wanted() else torch.empty(nbytes, dtype=torch.uint8)


class Arena:
    """Bump allocation of uint8 blobs from anonymous mappings that ask for huge pages, CHUNK at a time
    (a larger blob gets a mapping of its own). Each blob is a view of its chunk's tensor, so a chunk
    is unmapped when the last blob cut from it is freed; nothing here needs closing."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._free: torch.Tensor | None = None  # the current chunk's unused tail

    def empty(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 tensor of `nbytes` (contents undefined), 64-byte aligned."""
        need = (nbytes + ALIGN - 1) // ALIGN * ALIGN
        if self._free is None or self._free.numel() < need:
            if need > self.chunk // 4:  # a big blob alone: the current chunk's tail stays for small ones
                return _populated(_mapping(need)[:nbytes])
            self._free = _mapping(self.chunk)
        out, self._free = self._free[:nbytes], self._free[need:]
        return _populated(out)


def _mapping(nbytes: int) -> torch.Tensor:
    """A private anonymous mapping that asks for huge pages, as a uint8 tensor starting on a 2 MB
    boundary (mapped one huge page longer to find one); its pages are given at first touch."""
    size = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE + HUGE_PAGE
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel without huge pages: the memory still serves, in small pages
        region.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping while any view lives
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def _populated(blob: torch.Tensor) -> torch.Tensor:
    """`blob` with its pages given now, in one call (MADV_POPULATE_WRITE): faulting 2 MB pages in one
    at a time as a read fills them measured 3.0 s a GB on a 2-core VM; populated first, 0.35 s a GB
    where the system had the memory at hand and up to 1.9 s where it had to fetch it (a VM whose host
    takes freed memory back; threads did not help). An older kernel refuses the advice; the pages
    then come at first touch."""
    page = mmap.PAGESIZE
    start = blob.data_ptr() // page * page
    end = -(-(blob.data_ptr() + blob.numel()) // page) * page
    _madvise(start, end - start, _MADV_POPULATE_WRITE)
    return blob


_LIBC: ctypes.CDLL | None = None


def _madvise(addr: int, length: int, advice: int) -> int:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)  # the process's own symbols: no library search
        _LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _LIBC.madvise(addr, length, advice)
