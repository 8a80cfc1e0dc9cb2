"""Continuous batching: the requests being served advance together, one batch step at a time.

The scheduler owns the requests and decides; `specextend.batch.Batch` runs the steps (vLLM's
scheduler/worker split). Each request's generation is the ordinary one (a `Generation`: prefill
from the prefix cache, decode with its own settings, stream, remember), run as a sequence of the
batch on the scheduler's thread, so its callers (the server's event loop, Python threads) go on
while the models compute. A request is a `Job`: the server's (serve/jobs.py) or a Python call's
(batching.py).

- Admission: a request starts once fewer than `max_batch` run and its caches fit the KV budget
  (`kv_bytes`, estimated before anything is allocated: `engine.kv_bytes`). First come first
  served, except that a request that fits may start before an earlier one that does not fit yet,
  until that one has waited `HEAD_WAIT_S`. A request whose caches alone exceed the budget can
  never start and is refused at once (`TooLarge`, 400); beyond `max_batch + max_queue` admitted
  requests, `QueueFull` (429 with an estimate of when to retry).
- Each step: every running request's decode rows, then prompt tokens up to `step_tokens` rows in
  all, the shortest remaining prompt first, so a short question's prefill finishes in the next step
  even while a long document prefills a chunk per step (vLLM's short prompts first). While no
  request decodes (every running one is prefilling), no stream's gaps are at stake, so the step
  takes `idle_step_tokens`, larger: a step re-reads every weight and pays its Python once, so
  larger chunks prefill faster, and a request arriving meanwhile waits at most one such step.
- A withdrawn request (its client gone) is unwound at the start of the next step, which frees its
  caches and its slot.
"""

from __future__ import annotations

import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .batch import Batch, Cancelled, Sequence

if TYPE_CHECKING:
    from .costmodel import CostModel, ForwardCurve

log = logging.getLogger("specextend.serve")

# Continuous batching. The KV budget: this share of the memory available once the models are
# loaded (the prefix cache takes its own share of what is left). The step's token budget: as many
# target rows as the measured step costs put within STEP_S at STEP_CONTEXT cached tokens, so that
# running streams keep a token every fraction of a second while a long prompt prefills; while
# nothing decodes, as many as fit within IDLE_STEP_S (what a newcomer may wait for its first step).
DEFAULT_MAX_BATCH = 16
KV_SHARE = 0.3
MIN_DEFAULT_KV_MB = 512
STEP_S = 0.5
IDLE_STEP_S = 1.5
STEP_CONTEXT = 2048
STEP_TOKENS_RANGE = (16, 1024)
HEAD_WAIT_S = 30.0  # after this long at the head of the queue, a request waiting for memory blocks the others
IDLE_POLL_S = 0.5


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


class Job(Protocol):
    """A request as the scheduler sees it: withdrawn when `cancel` is set; told how it ended
    through `post` ("cancelled", or ("error", exception)); the rest is its runner's."""

    cancel: threading.Event

    def post(self, kind: str, value: Any = None) -> None: ...


class Measured(Protocol):
    def step_costs(self) -> CostModel: ...


def default_limits(pair: Measured, max_queue: int, max_batch: int | None = None, step_tokens: int | None = None,
                   kv_mb: float | None = None) -> Limits:
    """The batching bounds: those given, the defaults for the rest (see the constants above). A
    given `step_tokens` bounds every step, idle ones too."""
    idle_tokens = step_tokens
    if step_tokens is None:
        curve = pair.step_costs().target_curve
        step_tokens, idle_tokens = _tokens_within(curve, STEP_S), _tokens_within(curve, IDLE_STEP_S)
    if kv_mb is None:
        kv_mb = default_kv_mb()
    return Limits(max_batch=max_batch or DEFAULT_MAX_BATCH, max_queue=max_queue, step_tokens=step_tokens,
                  kv_bytes=int(kv_mb * 2**20), idle_step_tokens=idle_tokens)


def _tokens_within(curve: ForwardCurve, seconds: float) -> int:
    """The largest power of two of rows (in STEP_TOKENS_RANGE) the curve puts within `seconds`."""
    lo, hi = STEP_TOKENS_RANGE
    n = lo
    while n < hi and curve.predict(2 * n, STEP_CONTEXT) <= seconds:
        n *= 2
    return n


def default_kv_mb() -> float:
    avail = available_memory_mb()
    return 4096.0 if avail is None else max(MIN_DEFAULT_KV_MB, KV_SHARE * avail)


class QueueFull(Exception):
    def __init__(self, retry_after: int) -> None:
        super().__init__(f"the queue is full; retry in {retry_after} s")
        self.retry_after = retry_after


class TooLarge(Exception):
    """A request whose caches alone exceed the KV budget."""


@dataclass(frozen=True)
class Limits:
    max_batch: int  # requests running at once
    max_queue: int  # requests waiting beyond those
    step_tokens: int  # target rows per step (decode rows first, then prompt tokens)
    kv_bytes: int  # the running requests' caches, at most
    idle_step_tokens: int | None = None  # per step while no request decodes (None: step_tokens)

    def budget(self, decoding: bool) -> int:
        """The step's rows: `step_tokens` while some request decodes, else the idle budget."""
        return self.step_tokens if decoding or self.idle_step_tokens is None else self.idle_step_tokens


@dataclass
class _Request:
    job: Job
    kv: int  # bytes its caches take (estimated at admission)
    arrived: float
    seq: Sequence | None = None


class Scheduler:
    def __init__(self, batch: Batch, run: Callable[[Job], None], kv_bytes: Callable[[Job], int],
                 limits: Limits) -> None:
        self.batch, self.run, self.kv_bytes, self.limits = batch, run, kv_bytes, limits
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
        """Queue a job (from the event loop); QueueFull or TooLarge when it cannot be taken."""
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
        """Stop the steps; running and waiting requests end as cancelled."""
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(30)

    # ----------------------------------------------------------------- the scheduler's thread

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                self._take(block=not self.running_list and not self.waiting_list)
                self._withdraw()
                self._admit()
                if self.batch.sequences:
                    try:
                        self.batch.step(self.limits.budget(self.batch.streaming()), _shortest_first)
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

    def _take(self, block: bool) -> None:
        with contextlib.suppress(queue.Empty):
            r = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
            while r is not None:
                self.waiting_list.append(r)
                r = self._inbox.get_nowait()

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
        return {"running": self.running, "waiting": self.waiting, "max_batch": self.limits.max_batch,
                "step_tokens": self.limits.step_tokens, "idle_step_tokens": self.limits.budget(False),
                "steps": self.steps,
                "kv_in_use_mb": round(self.kv_in_use / 2**20, 1),
                "kv_budget_mb": round(self.limits.kv_bytes / 2**20, 1),
                "last_step": {"decode_rows": last.decode_rows, "prefill_rows": last.prefill_rows,
                              "draft_rounds": last.draft_rounds}}


def _shortest_first(seqs: list[Sequence]) -> list[Sequence]:
    return sorted(seqs, key=lambda s: s.waiting_tokens)

