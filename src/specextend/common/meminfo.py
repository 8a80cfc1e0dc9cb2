"""The host's memory as the kernel reports it (Linux `/proc/meminfo`), for the checks that refuse
work which would not fit: a model's first load, the server's KV budget."""

from __future__ import annotations


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
