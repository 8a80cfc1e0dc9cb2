"""Continuous batching: the requests being served advance together, one batch step at a time.

The scheduler owns the requests and decides; `batch.Batch` runs the steps (vLLM's
scheduler/worker split). Each request's generation is the ordinary one (a `Generation`: prefill
from the prefix cache, decode with its own settings, stream, remember), run as a sequence of the
batch on the scheduler's thread, so its callers (the server's event loop, Python threads) go on
while the models compute. A request is a `Job`: the server's (serve/jobs.py) or a Python call's
(runner.py).

- Admission: a request starts once fewer than `max_batch` run and its caches fit the KV budget
  (`kv_bytes`, estimated before anything is allocated: `engine.kv_bytes`). First come first
  served, except that a request that fits may start before an earlier one that does not fit yet,
  until that one has waited `HEAD_WAIT_S`. A request whose caches alone exceed the budget can
  never start and is refused at once (`TooLarge`, 400); beyond `max_batch + max_queue` admitted
  requests, `QueueFull` (429 with an estimate of when to retry).
- Each step: every running request's decode rows, then prompt tokens up to the step's rows, the
  shortest remaining prompt first, so a short question's prefill finishes in the next step even
  while a long document prefills a chunk per step (vLLM's short prompts first). How many rows is
  `budget.StepBudget`'s rule (from the measured prefill and step costs and the streams' gap goal):
  while no request decodes (one alone, or only prompts prefilling, a draft's prompt pass
  included), chunks as large as the many-row kernels want; beside decoding streams, smaller ones.
- A withdrawn request (its client gone) is unwound at the start of the next step, which frees its
  caches and its slot.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..common.meminfo import available_memory_mb, release_free_heap
from ..runtime.costmodel import cached_curve
from . import loop_handoff
from .batch import Batch, Cancelled, Sequence
from .budget import REFERENCE_CONTEXT, StepBudget

if TYPE_CHECKING:
    from ..runtime.costmodel import CostModel

log = logging.getLogger("specextend.serve")

# Continuous batching. The KV budget: this share of the memory available once the models are
# loaded (the prefix cache takes its own share of what is left). The step's rows: budget.py.
DEFAULT_MAX_BATCH = 16
KV_SHARE = 0.3
MIN_DEFAULT_KV_MB = 512
HEAD_WAIT_S = 30.0  # after this long at the head of the queue, a request waiting for memory blocks the others
IDLE_POLL_S = 0.5


# Every scheduler whose thread may still run. Its thread is a daemon (a forgotten scheduler must not
# keep the interpreter alive), so it is stopped and joined at exit: a daemon thread left inside a C++
# call while the interpreter finalizes is ended by the runtime mid-call, which aborts the process
# ("terminate called without an active exception") after all its output was written.
_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()


@atexit.register
def shutdown_all() -> None:
    """Stop and join every live scheduler's thread (at interpreter exit; safe to call any time)."""
    for sched in list(_LIVE):
        sched.shutdown()


class Job(Protocol):
    """A request as the scheduler sees it: withdrawn when `cancel` is set; told how it ended
    through `post` ("cancelled", or ("error", exception)); the rest is its runner's."""

    cancel: threading.Event

    def post(self, kind: str, value: Any = None) -> None: ...


class Measured(Protocol):
    target: Any  # the model whose prefill costs are measured (costmodel.cached_curve)

    def step_costs(self) -> CostModel: ...


def default_limits(pair: Measured, max_queue: int, max_batch: int | None = None, step_tokens: int | None = None,
                   kv_mb: float | None = None) -> Limits:
    """The batching bounds: those given, the defaults for the rest. Without `step_tokens`, the
    step's rows follow `StepBudget` over the target's measured prefill and step costs (measured
    once per machine, cached); a given `step_tokens` bounds every step, idle ones too."""
    if kv_mb is None:
        kv_mb = default_kv_mb()
    bounds = dict(max_batch=max_batch or DEFAULT_MAX_BATCH, max_queue=max_queue, kv_bytes=int(kv_mb * 2**20))
    if step_tokens is not None:
        return Limits(step_tokens=step_tokens, idle_step_tokens=step_tokens, **bounds)
    rule = StepBudget(cached_curve(pair.target, "efficient", kind="prefill"), pair.step_costs().target_curve)
    return Limits(step_tokens=rule.rows(1, REFERENCE_CONTEXT), idle_step_tokens=rule.alone_rows, rule=rule, **bounds)


def default_kv_mb() -> float:
    avail = available_memory_mb()
    return 4096.0 if avail is None else max(MIN_DEFAULT_KV_MB, KV_SHARE * avail)


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class Stopped(Exception):
    """A job submitted after `Scheduler.shutdown`."""


class TooLarge(Exception):
    """A request whose caches alone exceed the KV budget."""


@dataclass(frozen=True)
class Limits:
    max_batch: int  # requests running at once
    max_queue: int  # requests waiting beyond those
    step_tokens: int  # target rows per step while some request decodes (decode rows first, then prompt tokens)
    kv_bytes: int  # the running requests' caches, at most
    idle_step_tokens: int | None = None  # per step while no request decodes (None: step_tokens)
    rule: StepBudget | None = None  # the measured rule; None: the fixed bounds above

    def budget(self, decoding: bool) -> int:
        """The fixed bounds: `step_tokens` while some request decodes, else the idle budget."""
        return self.step_tokens if decoding or self.idle_step_tokens is None else self.idle_step_tokens

    def rows(self, decoders: int, context: int) -> int:
        """The step's rows with `decoders` sequences decoding beside prompt chunks that attend to
        `context` cached tokens: the rule's, else the fixed bounds."""
        if self.rule is not None:
            return self.rule.rows(decoders, context)
        return self.budget(decoders > 0)


@dataclass
class _Request:
    job: Job
    kv: int  # bytes its caches take (estimated at admission)
    arrived: float
    seq: Sequence | None = None


class Scheduler:
    def __init__(self, batch: Batch, run: Callable[[Job], None], kv_bytes: Callable[[Job], int],
                 limits: Limits, release_heap: Callable[[], None] = release_free_heap) -> None:
        """`release_heap` runs on the scheduler's thread once it has been idle for IDLE_POLL_S after
        any steps: a burst's freed buffers (caches, activations, the threads' malloc arenas: ~0.5 GB
        after six concurrent requests on the default pair) stay resident until the C library is asked
        to give them back."""
        self.batch, self.run, self.kv_bytes, self.limits = batch, run, kv_bytes, limits
        self.release_heap = release_heap
        self.heap_releases = 0
        self._released_at = 0  # self.steps when the heap was last given back
        self.admitted = 0  # running + waiting, counted on the event loop at submit
        self.waiting_list: list[_Request] = []  # the scheduler thread's
        self.running_list: list[_Request] = []
        self.kv_in_use = 0
        self.completed = 0
        self.steps = 0
        self._inbox: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._mean_s = 5.0  # running mean of a request's wall time, for Retry-After
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="specextend-batch", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # ----------------------------------------------------------------- the event loop's side

    @property
    def max_queue(self) -> int:
        return self.limits.max_queue

    @property
    def running(self) -> int:
        return len(self.running_list)

    @property
    def waiting(self) -> int:
        return max(0, self.admitted - self.running)

    def submit(self, job: Job) -> None:
        """Queue a job (from the event loop); QueueFull or TooLarge when it cannot be taken,
        Stopped once the scheduler is shut down."""
        if self._stop.is_set():
            raise Stopped("the batch has been shut down")
        need = self.kv_bytes(job)
        if need > self.limits.kv_bytes:
            raise TooLarge(f"this request's caches need {need / 2**20:.0f} MB, more than the server's KV budget of "
                           f"{self.limits.kv_bytes / 2**20:.0f} MB (--kv-mb); send a shorter prompt or fewer "
                           "max_tokens")
        with self._lock:
            if self.admitted >= self.limits.max_batch + self.limits.max_queue:
                behind = self.admitted - self.limits.max_batch + 1
                raise QueueFull(max(1, min(3600, math.ceil(self._mean_s * behind / self.limits.max_batch))))
            self.admitted += 1
        self._inbox.put(_Request(job, need, time.perf_counter()))

    def shutdown(self) -> None:
        """Stop the steps and join the thread (it ends after the step it is in); running and
        waiting requests end as cancelled. Idempotent; a no-op on the scheduler's own thread."""
        self._stop.set()
        self._inbox.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        _LIVE.discard(self)

    @property
    def alive(self) -> bool:
        """Whether the scheduler's thread still runs."""
        return self._thread.is_alive()

    # ----------------------------------------------------------------- the scheduler's thread

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                idle = not self.running_list and not self.waiting_list
                if not self._take(block=idle) and idle and self.steps != self._released_at:
                    self._released_at = self.steps  # idle a whole poll since the last steps: not between requests
                    try:
                        self.release_heap()
                        self.heap_releases += 1
                    except Exception as e:  # memory kept is no reason to stop serving
                        log.warning("giving the freed heap back failed", exc_info=e)
                self._withdraw()
                self._admit()
                if self.batch.sequences:
                    try:
                        self._step()
                    except Exception as e:  # reported to every request of the step; the server goes on
                        log.error("a batch step failed", exc_info=e)
                        for seq in self.batch.sequences:
                            seq.fail(e)
                    self.steps += 1
                self._finish()
            for r in self.waiting_list + self.running_list:
                if r.seq is not None:
                    r.seq.cancel()
                r.job.post("cancelled")

    def _step(self) -> None:
        """One batch step within the limits' rows for what is running now; its time refreshes the rule."""
        seqs = self.batch.sequences
        context = max((s.call.rows.cache.length for s in seqs if s.prefilling), default=0)  # type: ignore[union-attr]
        with loop_handoff.held():  # the step's events reach the event loops at once, as the next forward starts
            report = self.batch.step(self.limits.rows(self.batch.decoders(), context), _shortest_first)
        if self.limits.rule is not None and report.prefill_rows:
            self.limits.rule.observe(report.decode_rows + report.prefill_rows, context, report.seconds)

    def _take(self, block: bool) -> bool:
        """Move what was submitted to the waiting list (waiting up to IDLE_POLL_S for it when `block`);
        whether anything came."""
        came = False
        with contextlib.suppress(queue.Empty):
            r = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
            came = True
            while r is not None:
                self.waiting_list.append(r)
                r = self._inbox.get_nowait()
        return came

    def _withdraw(self) -> None:
        """Requests whose client is gone: waiting ones are dropped, running ones unwound."""
        for r in [r for r in self.waiting_list if r.job.cancel.is_set()]:
            self.waiting_list.remove(r)
            r.job.post("cancelled")
            self._done(r, 0.0)
        for r in self.running_list:
            if r.job.cancel.is_set() and r.seq is not None and not r.seq.done:
                r.seq.cancel()

    def _admit(self) -> None:
        now = time.perf_counter()
        for r in list(self.waiting_list):
            if len(self.running_list) >= self.limits.max_batch:
                return
            if self.kv_in_use + r.kv > self.limits.kv_bytes:
                if now - r.arrived > HEAD_WAIT_S and r is self.waiting_list[0]:
                    return  # it has waited long enough: no one goes ahead of it any more
                continue
            self.waiting_list.remove(r)
            self.kv_in_use += r.kv
            r.seq = Sequence(lambda job=r.job: self.run(job), tag=r)
            self.running_list.append(r)
            self.batch.add(r.seq)

    def _finish(self) -> None:
        for seq in self.batch.reap():
            r: _Request = seq.tag
            # The request and its sequence point at each other: unlinked, both go (and the caches
            # with them) now, as the budget below is given back, not when the cyclic collector runs.
            r.seq = None
            self.running_list.remove(r)
            self.kv_in_use -= r.kv
            if isinstance(seq.error, Cancelled):
                r.job.post("cancelled")
            elif seq.error is not None:
                r.job.post("error", seq.error)
            self._done(r, time.perf_counter() - r.arrived)

    def _done(self, r: _Request, seconds: float) -> None:
        with self._lock:
            self.admitted -= 1
        self.completed += 1
        if seconds > 0:
            self._mean_s = 0.8 * self._mean_s + 0.2 * seconds

    # ----------------------------------------------------------------- reporting

    def stats(self) -> dict[str, object]:
        last = self.batch.last
        rule = self.limits.rule
        return {"running": self.running, "waiting": self.waiting, "max_batch": self.limits.max_batch,
                "step_tokens": rule.rows(1, REFERENCE_CONTEXT) if rule is not None else self.limits.step_tokens,
                "idle_step_tokens": self.limits.rows(0, 0),
                "budget": rule.stats() if rule is not None else {"why": "--step-tokens bounds every step"},
                "steps": self.steps,
                "heap_releases": self.heap_releases,
                "kv_in_use_mb": round(self.kv_in_use / 2**20, 1),
                "kv_budget_mb": round(self.limits.kv_bytes / 2**20, 1),
                "last_step": {"decode_rows": last.decode_rows, "prefill_rows": last.prefill_rows,
                              "draft_rounds": last.draft_rounds}}


def _shortest_first(seqs: list[Sequence]) -> list[Sequence]:
    return sorted(seqs, key=lambda s: s.waiting_tokens)

