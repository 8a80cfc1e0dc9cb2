"""One generation at a time (the paper's batch size 1), the rest waiting in arrival order.

At most `max_queue` requests wait behind the running one; a request beyond that is refused at
once (HTTP 429) with an estimate of when to retry. Generations run on one worker thread, so
the event loop keeps answering (health checks, refusals, streams) while the models compute.
A job's turn is held until its worker call has returned, not until its client has gone: a
client that disconnects frees the slot when its generation has stopped, never while it runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .jobs import Job


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class Scheduler:
    def __init__(self, run: Callable[[Job], None], max_queue: int) -> None:
        self.run = run
        self.max_queue = max_queue
        self.admitted = 0  # running + waiting
        self.running = False
        self.current: Job | None = None
        self.completed = 0
        self._turn = asyncio.Lock()  # asyncio's lock wakes its waiters in arrival order
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="specextend-generate")
        self._tasks: set[asyncio.Task[None]] = set()
        self._mean_s = 5.0  # running mean of a generation's wall time, for Retry-After

    @property
    def waiting(self) -> int:
        return self.admitted - (1 if self.running else 0)

    def submit(self, job: Job) -> None:
        """Queue a job (called on the event loop); QueueFull when `max_queue` are already waiting."""
        if self.admitted >= 1 + self.max_queue:
            raise QueueFull(max(1, min(3600, math.ceil(self._mean_s * self.admitted))))
        self.admitted += 1
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, job: Job) -> None:
        try:
            async with self._turn:
                self.running, self.current = True, job
                t0 = time.perf_counter()
                try:
                    await asyncio.get_running_loop().run_in_executor(self._executor, self._call, job)
                finally:
                    self.running, self.current = False, None
                    self.completed += 1
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.perf_counter() - t0)
        finally:
            self.admitted -= 1

    def _call(self, job: Job) -> None:
        try:
            self.run(job)
        except BaseException as e:  # reported to the request's handler, never raised into the loop
            job.post("error", e)

    def shutdown(self) -> None:
        """Stop the running generation at its next step and drop the waiting ones."""
        if self.current is not None:
            self.current.cancel.set()
        self._executor.shutdown(wait=False, cancel_futures=True)
