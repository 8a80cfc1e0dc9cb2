"""Memory for the quantized weights that the kernel may back with 2 MB pages (Linux transparent huge
pages), asked for where the system leaves it to the program (`madvise`, most distributions' default).

Why: a decode step streams every weight once, gigabytes a token. In 4 KB pages that is a page-table
walk every 4 KB, and inside a virtual machine each walk is two-level and slow; the CPU's hardware
prefetcher also stops at every 4 KB boundary. On a 2-core Xeon VM a one-row Q4_K product streamed
23.1 GB/s from 2 MB pages against 19-20 from 4 KB ones, and a plain sum of a buffer 34 against 24
(docs/log/2026-12-huge-pages.md).

By default the weights a step streams whole are read into arenas of fresh anonymous memory that asks
for 2 MB pages (`Arena`); tables read in parts (an embedding's rows, an expert model's experts) stay
on the file's pages. `SPECEXTEND_HUGE_PAGES=0` uses them in place from a map of the file (`map_file`): nothing
is copied, a load takes no memory of its own and processes that load the same file share its pages.
Where the kernel keeps the file in 2 MB pages (its page cache in 2 MB folios, as Linux 6.x does on
filesystems with large folios), the map is in 2 MB pages too (`huge_file_pages` asks, and has a file
cached in small pieces read again). On the Xeon VM the arena still read 2-10% faster than the file's
2 MB pages (docs/log/2026-12-weights-in-place.md), so it stays the default where loads are rare.
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
_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux 5.14+; Python 3.11's mmap module names neither
_MADV_POPULATE_WRITE = 23
_SMAPS = "/proc/self/smaps"


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


def map_file(path: str | os.PathLike[str]) -> torch.Tensor:
    """The whole file mapped (private: never written, so its pages stay the page cache's, shared),
    advised for huge pages, as a uint8 tensor that holds the map while any view of it lives."""
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a cold page cache then reads the file in 2 MB folios
            region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)


def huge_file_pages(whole: torch.Tensor, path: str | os.PathLike[str] | None = None, smaps: str = _SMAPS,
                    windows: int = 8) -> bool:
    """Whether the kernel maps this file map (`map_file`, nothing of it touched yet) in 2 MB pages:
    a few aligned 2 MB windows spread over it are read in and its mapping's `FilePmdMapped` read back
    (a file's page cache may hold some parts in 2 MB folios and others in small ones: all must be
    2 MB). The first 2 MB are left out: opening the file reads its header in small folios. False
    where the file is under 6 MB, the kernel cannot say (not Linux, an older kernel) or maps any
    window in small pages.

    With `path` (the map's file), a file cached in small folios (read or written a little at a time)
    is read again: where one window dropped from the cache comes back in 2 MB, the whole file is
    dropped, to come back so as it is used (a disk read; pages another process maps stay)."""
    first = -(-whole.data_ptr() // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
    pages = (whole.data_ptr() + whole.numel() - first) // HUGE_PAGE
    spots = [first + i * (pages // min(windows, pages)) * HUGE_PAGE for i in range(min(windows, pages))]
    if not spots or _huge_after_reading(whole, spots, smaps):
        return bool(spots)
    if path is None or not hasattr(os, "posix_fadvise"):
        return False
    fd, base = os.open(path, os.O_RDONLY), whole.data_ptr()
    try:  # one window first: where it too comes back small, the kernel maps this file so; nothing more is dropped
        for offset, size, again in ((spots[0] - base, HUGE_PAGE, spots[:1]), (0, 0, spots)):
            _madvise(base, whole.numel(), _MADV_DONTNEED)  # our map lets go of its pages, so the cache can
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)
            if not _huge_after_reading(whole, again, smaps):
                return False
        return True
    finally:
        os.close(fd)


def _huge_after_reading(whole: torch.Tensor, spots: list[int], smaps: str) -> bool:
    """Read the 2 MB windows at `spots` in; whether the map's mapping now holds them all in 2 MB pages."""
    for spot in spots:
        if _madvise(spot, HUGE_PAGE, _MADV_POPULATE_READ) != 0:
            return False
    return _pmd_mapped_kb(whole.data_ptr(), smaps) >= len(spots) * (HUGE_PAGE >> 10)


def populate(view: torch.Tensor) -> torch.Tensor:
    """`view` (of a file map) read in now, in one call: the first step then finds its pages mapped."""
    page = mmap.PAGESIZE
    start = view.data_ptr() // page * page
    end = view.data_ptr() + view.numel()
    if end > start:
        _madvise(start, end - start, _MADV_POPULATE_READ)
    return view


def _pmd_mapped_kb(addr: int, smaps: str) -> int:
    """The `FilePmdMapped` of the mapping holding `addr`, in kB (0 where it has none or none is read)."""
    inside = False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: its range
                    lo, _, hi = head.partition("-")
                    inside = int(lo, 16) <= addr < int(hi, 16)
                elif inside and head == "FilePmdMapped:":
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return 0


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
