"""One request's generation, run on the worker thread, through the pair's public steps:
`Pair.prefill` (from the prefix cache), `Pair.decode` with the request's settings, streaming text
pieces back to the event loop as tokens are accepted and stopping at a stop string or when the
client has gone, then `Pair.remember` (the prompt's KV into the prefix cache) once the answer is
out, so storing it delays only the next request.

The worker and the event loop talk only through the job: the worker posts events onto the
job's asyncio queue (thread-safely), the loop sets `cancel`, which the worker reads at every
accepted batch of tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..api import Pair, Result
from ..detokenize import Detokenizer
from ..grammar import Grammar
from ..settings import Settings
from .stops import StopStrings

log = logging.getLogger("specextend.serve")


@dataclass
class Outcome:
    """A finished generation: the text sent (cut at a stop string), why it ended, the statistics."""

    text: str
    finish_reason: str  # OpenAI's: "stop" (end of sequence or a stop string) or "length"
    result: Result
    queue_s: float
    replica: str | None = None  # the replica that served it, where there are several


@dataclass
class Job:
    ids: list[int]
    settings: Settings
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    grammar: Grammar | None = None  # compiled on the event loop, so a bad one is refused at once
    logprobs: int | None = None  # alternatives per position; None: no log-probabilities
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def post(self, kind: str, value: Any = None) -> None:
        """Hand an event to the event loop: ("text", (piece, logprob entries or None)), ("done",
        Outcome), ("error", exc), ("cancelled", None). Safe from any thread; a loop already closed drops it."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


def run_job(pair: Pair, job: Job) -> None:
    """Generate for one job on the calling (worker) thread; every outcome is posted as an event."""
    if job.cancel.is_set():
        job.post("cancelled")
        return
    queue_s = time.perf_counter() - job.submitted
    s = job.settings
    stops = StopStrings(job.stops)
    sent: list[str] = []
    pending: list[str] = []  # text of the batch being sent
    proc = pair.processor(job.ids, s, job.grammar, job.logprobs)
    given = 0  # log-probabilities sent so far

    def send(piece: str) -> None:
        safe = stops.push(piece)
        if safe:
            sent.append(safe)
            pending.append(safe)

    def post() -> None:
        # One event per batch of tokens: its text and its tokens' log-probabilities together.
        nonlocal given
        entries = None
        if proc is not None and proc.top_logprobs is not None:
            entries = pair.logprob_entries(proc.logprobs[given:])
            given = len(proc.logprobs)
        if pending or entries:
            job.post("text", ("".join(pending), entries))
        pending.clear()

    detok = Detokenizer(pair.detokenize, send)

    def on_tokens(new_ids: list[int]) -> bool:
        if job.cancel.is_set():
            return True
        detok.push(new_ids)
        post()
        return stops.hit

    state = pair.prefill(job.ids, s)
    result = pair.decode(state, s, on_tokens=on_tokens, processor=proc)
    if not stops.hit:
        detok.finish(result.text)
        tail = stops.flush()
        if tail:
            sent.append(tail)
            pending.append(tail)
        post()
    cancelled = job.cancel.is_set() and result.stop_reason == "stopped" and not stops.hit
    if cancelled:
        job.post("cancelled")
    else:
        finish = "length" if result.stop_reason == "length" and not stops.hit else "stop"
        job.post("done", Outcome("".join(sent), finish, result, queue_s))
    log.info("%d prompt tokens (%d cached, prefill %.2f s) + %d new (%s, %.2f tok/s, tau %.2f)%s",
             result.prompt_tokens, result.cached_prompt_tokens, result.prefill_s, result.new_tokens, result.method,
             result.decode_tokens_per_s, result.accepted_per_step, ", client gone" if cancelled else "")
    # After the answer is out: storing the prompt's KV (and writing its file) delays only the next request.
    pair.remember(state)
