"""Calls from the scheduler's thread into event loops: handed over once per batch step, by a thread
of their own.

A batch step resumes every sequence after the target's forward, and each one that streams posts
its new text to the server's event loop. `loop.call_soon_threadsafe` wakes the loop by a write to
its self-pipe, which releases the GIL: the woken loop takes it and runs the event's callbacks
while the caller waits to get it back (a server step measured a median 0.8 ms, up to several, a
call). With 16 streams a step paid that up to 16 times, on its critical path, while the other
core idled between forwards. So inside `held()` (a batch step) the calls are kept, and when the
block ends each loop's calls go, as one call, to the hand-over thread, which makes the
`call_soon_threadsafe`: it gets the GIL once the scheduler's thread releases it for the next
forward, and the loop then streams the step's text while the models compute.

Every call goes through the one hand-over thread, in the order made, so events posted inside and
outside a step keep their order. A closed loop drops its calls, as `call_soon_threadsafe` would
refuse them.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

Call = tuple[Callable[..., Any], tuple[Any, ...]]
Item = tuple[asyncio.AbstractEventLoop, list[Call]] | threading.Event | None


class _HandOver:
    """The thread that makes the `call_soon_threadsafe` calls, started on first use (again after
    a fork, where it does not exist) and stopped at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def put(self, item: Item) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, args=(self._queue,), name="specextend-handoff",
                                                daemon=True)
                self._thread.start()
            self._queue.put(item)

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None and thread.is_alive():
                self._queue.put(None)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    @staticmethod
    def _run(q: queue.SimpleQueue[Item]) -> None:
        while (item := q.get()) is not None:
            if isinstance(item, threading.Event):
                item.set()
                continue
            loop, calls = item
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_run_all, calls)


_HAND_OVER = _HandOver()
atexit.register(_HAND_OVER.stop)
_local = threading.local()


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """`fn(*args)` on `loop`, soon: kept until the calling thread's `held()` block ends if it is in
    one, else handed over now. Safe from any thread; a closed loop drops the call."""
    pending: dict[asyncio.AbstractEventLoop, list[Call]] | None = getattr(_local, "pending", None)
    if pending is None:
        _HAND_OVER.put((loop, [(fn, (*args,))]))
    else:
        pending.setdefault(loop, []).append((fn, (*args,)))


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Keep this thread's `call_soon` calls until the block ends (however it ends), then hand each
    loop its calls as one. Nested blocks hand over at the outermost one's end."""
    if getattr(_local, "pending", None) is not None:
        yield
        return
    _local.pending = {}
    try:
        yield
    finally:
        pending, _local.pending = _local.pending, None
        for loop, calls in pending.items():
            _HAND_OVER.put((loop, calls))


def settled(timeout: float | None = None) -> bool:
    """Wait until every call handed over so far has reached its loop's `call_soon_threadsafe`;
    whether it did within `timeout`."""
    done = threading.Event()
    _HAND_OVER.put(done)
    return done.wait(timeout)


def _run_all(calls: list[Call]) -> None:
    for fn, args in calls:
        fn(*args)
