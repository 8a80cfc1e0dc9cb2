"""A pair's models run as one continuous batch: the batch (batch.py), the engine its sequences
decode with (`Batch.engine`) and the scheduler (scheduler.py) that admits requests and runs the
steps on a thread of its own. The server's local backend runs its requests here, and so does
`Pair.generate` given a list of prompts; concurrent callers share the steps.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ..common.errors import UserError
from ..common.plural import count
from ..common.settings import Settings
from ..requests.generation import Generation, Result
from ..runtime import fused_step
from ..runtime.costmodel import CostModel
from ..speculation.decoder import SpecEngine
from .batch import Batch, Cancelled
from .scheduler import Limits, Scheduler, default_limits

if TYPE_CHECKING:
    from ..runtime.transformer import Transformer

QUEUE_UNBOUNDED = 1 << 30  # Python callers wait for their turn: no 429s
# Python callers wait for their whole list, so no stream's gaps are at stake: every step takes
# prompt tokens up to the scheduler's largest budget (a step re-reads every weight once).
OFFLINE_STEP_TOKENS = 1024


class Models(Protocol):
    """What a batch needs of a pair."""

    target: Transformer
    draft: Transformer | None

    @property
    def eos_ids(self) -> list[int]: ...

    def step_costs(self) -> CostModel: ...

    def kv_bytes(self, prompt_tokens: int, settings: Settings) -> int: ...


class Batching:
    """The batch over a pair's models and the scheduler that runs it. `run(engine, job)` runs one
    admitted job on the batch's engine (inside the batch's steps) and posts its outcome; jobs are
    anything with `ids`, `settings`, `cancel` and `post` (scheduler.Job)."""

    def __init__(self, pair: Models, run: Callable[[SpecEngine, Any], None], limits: Limits | None = None,
                 max_queue: int = QUEUE_UNBOUNDED, **batching: Any) -> None:
        self.batch = Batch(pair.target, pair.draft)
        engine = self.batch.engine(pair.eos_ids, pair.step_costs())  # measures the costs once per machine (cached)
        self.limits = limits if limits is not None else default_limits(pair, max_queue, **batching)
        # The scheduler's thread must not keep the pair alive (a Pair collected by Python stops its
        # batch: Pair.close), so the estimate reaches the pair through a weak reference.
        kv_bytes = weakref.WeakMethod(pair.kv_bytes)
        self.scheduler = Scheduler(self.batch, lambda job: run(engine, job),
                                   lambda job: _call(kv_bytes)(len(job.ids), job.settings), self.limits)
        fused_step.release_thread_team()  # this thread loaded and measured; the scheduler's runs the steps

    def shutdown(self) -> None:
        """Stop the steps; running and waiting requests end as cancelled."""
        self.scheduler.shutdown()


def _call(ref: weakref.WeakMethod[Callable[[int, Settings], int]]) -> Callable[[int, Settings], int]:
    method = ref()
    if method is None:
        raise RuntimeError("the pair of this batch has been closed")
    return method


class _Call:
    """A generation submitted from Python: a scheduler job whose outcome lands in a future."""

    def __init__(self, gen: Generation) -> None:
        self.gen, self.ids, self.settings = gen, gen.ids, gen.settings
        self.cancel = gen.cancel if gen.cancel is not None else threading.Event()
        self.future: Future[Result] = Future()

    def post(self, kind: str, value: Any = None) -> None:
        if kind == "done":
            self.future.set_result(value)
        elif kind == "error":
            self.future.set_exception(value)
        elif kind == "cancelled":
            self.future.set_exception(Cancelled())


def _run_call(engine: SpecEngine, call: _Call) -> None:
    result = call.gen.run(engine)
    call.post("done" if not call.gen.cancelled else "cancelled", result)
    call.gen.remember()


class Generations:
    """Generations from Python threads run together in one batch: `run` submits some and waits
    for them, so concurrent callers share the steps. They detokenize on the batch's thread with
    `tokenizer`, one of its own (a tokenizer is not safe to share across threads)."""

    def __init__(self, pair: Models, tokenizer: Any, **batching: Any) -> None:
        self.tokenizer = tokenizer
        self.batching = Batching(pair, _run_call, **{"step_tokens": OFFLINE_STEP_TOKENS, **batching})

    def run(self, gens: Sequence[Generation]) -> list[Result | None]:
        """Each generation's `Result`, in order (None for one cancelled through its `cancel`).
        An error of one raises here once all have ended."""
        calls = [_Call(g) for g in gens]
        budget = self.batching.limits.kv_bytes
        for c in calls:  # before any runs: one that can never fit refuses the whole list
            if self.batching.scheduler.kv_bytes(c) > budget:
                raise UserError(f"a prompt of {count(len(c.ids), 'token')} with max_new_tokens="
                                f"{c.settings.max_new_tokens} needs more KV memory than the batch's budget of "
                                f"{budget / 2**20:.0f} MB")
        fused_step.release_thread_team()  # the caller's team (a `generate` before, say) would slow the steps
        for c in calls:
            self.batching.scheduler.submit(c)
        out: list[Result | None] = []
        error: BaseException | None = None
        for c in calls:
            try:
                out.append(c.future.result())
            except Cancelled:
                out.append(None)
            except Exception as e:  # the first one is raised once every call has ended
                error = error or e
                out.append(None)
        if error is not None:
            raise error
        return out

    def shutdown(self) -> None:
        self.batching.shutdown()
