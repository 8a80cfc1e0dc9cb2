"""The host's memory as the kernel reports it (Linux `/proc/meminfo`), for the checks that refuse
work which would not fit: a model's first load, the server's KV budget; and the freed heap given back
to it."""

from __future__ import annotations

import ctypes


def available_memory_mb() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_free_heap() -> None:
    """Give the C library's free heap pages back to the kernel (glibc's malloc_trim; elsewhere
    nothing): a load's temporaries, freed, otherwise stay in the process's resident memory."""
    # The process's own symbols (libc among them): no library search, which runs a subprocess.
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
