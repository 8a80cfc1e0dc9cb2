"""A server request's generation, run on the scheduler's thread: the job (what the event loop
checked and tokenized, and the queue of events it reads) and `run_job`, which drives the
request's `Generation` (requests/generation.py: prefix cache, decode, streaming, stop strings, cancel) on
the batch's engine and posts its pieces and outcome, then lets it remember its prompt once the
answer is out, so storing it delays only the next request.

The worker and the event loop talk only through the job: the worker posts events onto the
job's asyncio queue (thread-safely), the loop sets `cancel`, which the generation reads at every
accepted batch of tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..api import Pair
from ..batching import loop_handoff
from ..common.settings import Settings
from ..requests.generation import Engine, Result
from ..sampling.grammar import Grammar

log = logging.getLogger("specextend.serve")

# The events that a job may post before its last ("done", "error" or "cancelled" end it).
STREAM_EVENTS = frozenset({"text", "progress"})


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
    request: Any = None  # the checked protocol.Request (a replica makes its own job of it)
    events: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def post(self, kind: str, value: Any = None) -> None:
        """Hand an event to the event loop: ("progress", (prompt tokens prefilled, of all)), ("text",
        (piece, logprob entries or None)), ("done", Outcome), ("error", exc), ("cancelled", None).
        Safe from any thread; a loop already closed drops it. From a batch step, the step's events
        reach the loop together when it ends (loop_handoff.py)."""
        loop_handoff.call_soon(self.loop, self.events.put_nowait, (kind, value))


def run_job(pair: Pair, engine: Engine, job: Job) -> None:
    """Generate for one job on the calling (worker) thread, on `engine` (the batch's); every
    outcome is posted as an event."""
    if job.cancel.is_set():
        job.post("cancelled")
        return
    queue_s = time.perf_counter() - job.submitted
    tools = job.request.tools if job.request is not None else None  # its calls end the answer (requests/toolcalls.py)
    gen = pair.generation(job.ids, settings=job.settings, response_format=job.grammar, logprobs=job.logprobs,
                          tool_spec=tools, stops=job.stops, cancel=job.cancel,
                          on_piece=lambda text, entries: job.post("text", (text, entries)),
                          on_progress=lambda done, total: job.post("progress", (done, total)))
    result = gen.run(engine)
    if gen.cancelled:
        job.post("cancelled")
    else:
        job.post("done", Outcome("".join(gen.sent), gen.finish_reason, result, queue_s))
    log.info("%d prompt tokens (%d cached, prefill %.2f s) + %d new (%s, %.2f tok/s, tau %.2f)%s",
             result.prompt_tokens, result.cached_prompt_tokens, result.prefill_s, result.new_tokens, result.method,
             result.decode_tokens_per_s, result.accepted_per_step, ", client gone" if gen.cancelled else "")
    gen.remember()
