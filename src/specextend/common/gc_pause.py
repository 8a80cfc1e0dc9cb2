"""Loading without the cyclic garbage collector's full passes.

Reading a tokenizer (a tokenizer.json parsed into up to millions of Python objects) and building
a model allocate objects that all live on. Each allocation burst makes Python's collector run a
full pass, and each full pass walks every object made so far, so a load's passes grow with it and
take a visible share of a command's start (docs/benchmarks.md, "Start-up time"). Nothing a load
allocates is cyclic garbage worth collecting mid-load (tensors and buffers are freed by reference
counting), so the collector waits until the block ends and then runs on its usual thresholds.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs with automatic collection off, restored at its end (even on an error).

    A collector someone already turned off stays off; blocks may nest, and another thread's block
    ending first only turns collection back on sooner (the switch is process-wide)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
