"""One request's whole life, on whichever engine runs it: the pair's own (`Pair.generate`,
`Pair.stream`, on the calling thread) or a batch's (`batch.Batch.engine`: a list of prompts from
Python, the server's requests).

A `Generation` holds the request's settings and, from its start to its end: the prefix cache's
lookup before prefill, the logits processing (grammar, penalties, log-probabilities), the
decode, streaming (accepted tokens -> text pieces through the detokenizer, cut at stop strings,
with their log-probability entries), cancelling (a set `cancel` event stops it at its next
accepted batch of tokens), the `Result`, and the prefix cache's remember once the answer is out.

`Origin` is what a generation needs of its pair: the models and their description (for the
`Result`), a tokenizer for the thread it decodes on, and the prefix cache. `Pair` (api.py) makes
both; nothing here loads or tokenizes a prompt.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

from ..common.errors import UserError
from ..common.jsonl import finite_json
from ..common.settings import Settings
from ..models.loader import QUANTIZED_WEIGHTS
from ..runtime import kernels
from ..runtime.kv_cache import PrefixKV
from ..sampling.grammar import Grammar, tokenizer_for
from ..sampling.logits_process import MAX_TOP_LOGPROBS, LogitsProcessor, TokenLogprob
from ..sampling.penalties import Penalties
from ..speculation.decoder import GenerationResult, Prefilled, ProgressCallback, TokensCallback
from . import callmarkup
from .detokenize import Detokenizer
from .stops import StopStrings
from .toolcalls import ToolSpec, answer_parser

if TYPE_CHECKING:
    from ..models.resolve import ResolvedPair
    from ..runtime.transformer import Transformer
    from .prefix_cache import PrefixCache

# Each accepted batch's text (cut at a stop string) and, when asked for, its tokens' entries.
PieceCallback = Callable[[str, "list[dict[str, Any]] | None"], None]


class Engine(Protocol):
    """What a generation runs on: `engine.SpecEngine`, alone or over a batch's ports."""

    def prefill(self, prompt_ids: list[int], settings: Settings, prefix: PrefixKV | None = None,
                on_progress: ProgressCallback | None = None) -> Prefilled: ...

    def decode(self, state: Prefilled, settings: Settings, on_tokens: TokensCallback | None = None,
               processor: LogitsProcessor | None = None) -> GenerationResult: ...


# --------------------------------------------------------------------------- results


@dataclass(kw_only=True)
class Result(GenerationResult):
    """One generation: the engine's measurements (GenerationResult), the decoded text and what ran."""

    text: str
    method: str
    target: str
    draft: str | None
    dtype: str
    draft_dtype: str | None
    device: str
    weights: str = "float"
    draft_weights: str | None = None
    cpu_kernels: str | None = None  # the C++ kernel path that ran (kernels.PATHS), None without them
    # Per generated token, when asked for: {token, token_id, logprob, bytes, top_logprobs: [...]}.
    logprobs: list[dict[str, Any]] | None = None
    # With tools: the calls the answer made (OpenAI's shape; [] when it answered with text).
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def config(self) -> dict[str, Any]:
        """Every resolved setting, as plain JSON values, and the CPU kernel path that ran."""
        return {**self.settings.as_dict(), "cpu_kernels": self.cpu_kernels}

    def to_json(self) -> dict[str, Any]:
        """The `generate --json` object of the contract (plus stop_reason, accept_lengths, extra)."""
        names = ("method", "target", "draft", "dtype", "draft_dtype", "weights", "draft_weights", "device")
        d: dict[str, Any] = {name: getattr(self, name) for name in names}
        d.update(
            config=self.config, prompt_tokens=self.prompt_tokens, new_tokens=self.new_tokens,
            token_ids=list(self.token_ids), text=self.text, prefill_s=self.prefill_s, decode_s=self.decode_s,
            total_s=self.total_s, decode_tokens_per_s=self.decode_tokens_per_s, steps=self.steps,
            accepted_per_step=self.accepted_per_step, phases=dict(self.phases), stop_reason=self.stop_reason,
            accept_lengths=list(self.accept_lengths), extra=dict(self.extra),
            cached_prompt_tokens=self.cached_prompt_tokens,
        )
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        if self.tool_calls is not None:
            d["tool_calls"] = self.tool_calls
        return finite_json(d)


# --------------------------------------------------------------------------- what a generation needs of its pair


@dataclass(frozen=True)
class Origin:
    """A pair as its generations see it: the models and their description, the tokenizer of the
    thread that decodes, and the prefix cache (None: off)."""

    spec: ResolvedPair
    target: Transformer
    draft: Transformer | None
    tokenizer: Any
    prefix_cache: PrefixCache | None = None

    @property
    def vocab(self) -> int:
        return int(self.spec.target.config.vocab_size)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens skipped but the markers an answer's parser reads:
        callmarkup.decode)."""
        return callmarkup.decode(self.tokenizer, token_ids)

    def processor(self, prompt_ids: Sequence[int], s: Settings, grammar: Grammar | None = None,
                  logprobs: int | None = None) -> LogitsProcessor | None:
        """A decode's own logits processing (grammar, penalties, log-probabilities); None if the
        request needs none."""
        check_logprobs(logprobs)
        if grammar is None and logprobs is None and not s.penalised:
            return None
        penalties = Penalties(s.frequency_penalty, s.presence_penalty, s.repetition_penalty, prompt_ids, self.vocab)
        return LogitsProcessor(grammar=grammar, penalties=penalties, top_logprobs=logprobs,
                               eos_ids=list(self.spec.eos_ids))

    def logprob_entries(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Log-probabilities as OpenAI's entries (token text, its bytes, the alternatives)."""
        tok = tokenizer_for(self.tokenizer, self.vocab)

        def one(token: int, logprob: float) -> dict[str, Any]:
            raw = bytes(tok.decode_bytes([token]))
            return {"token": raw.decode("utf-8", errors="replace"), "token_id": token, "logprob": logprob,
                    "bytes": list(raw)}

        return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in logprobs]

    # ----------------------------------------------------------------- the prefix cache

    def lookup(self, ids: list[int], s: Settings) -> PrefixKV | None:
        """The KV of the longest cached prefix of the prompt that this prefill would write alike."""
        if self.prefix_cache is None:
            return None
        target_backend = kv_backend(self.target, s.attention)
        draft_backend = kv_backend(self.draft, s.attention) if s.uses_draft and self.draft is not None else None
        return self.prefix_cache.lookup(ids, target_backend, draft_backend)

    def remember(self, state: Prefilled) -> None:
        """Offer a prefilled prompt to the prefix cache (no-op without one). Valid after decoding too."""
        if self.prefix_cache is None:
            return
        snap = state.snapshot()  # the draft's slots computed so far, if any
        target_backend = kv_backend(self.target, state.attention)
        draft_backend = kv_backend(self.draft, state.attention) if snap.draft_kv is not None else None
        self.prefix_cache.insert(state.prompt_ids, snap, target_backend, draft_backend)

    # ----------------------------------------------------------------- results

    def result(self, res: GenerationResult, proc: LogitsProcessor | None = None) -> Result:
        """The engine's measurements with the decoded text, what ran (models, dtypes, device) and
        what `proc` recorded (its time; the log-probability entries it was asked for)."""
        s: Settings = res.settings
        fields_ = {f.name: getattr(res, f.name) for f in fields(GenerationResult)}
        fields_.update(token_ids=list(res.token_ids), phases=dict(res.phases), accept_lengths=list(res.accept_lengths),
                       settings=s, extra=dict(res.extra or {}))
        spec, draft = self.spec, self.draft if s.uses_draft else None
        draft_weights = draft.weights if draft is not None else None
        out = Result(
            **fields_,
            text=self.detokenize(res.token_ids),
            method=s.method,
            target=str(spec.target.path),
            draft=str(spec.draft.path) if draft is not None and spec.draft is not None else None,
            dtype=spec.target.dtype,
            draft_dtype=spec.draft.dtype if draft is not None and spec.draft is not None else None,
            device=spec.device,
            weights=self.target.weights,
            draft_weights=draft_weights,
            cpu_kernels=kernels.path() if {self.target.weights, draft_weights} & set(QUANTIZED_WEIGHTS) else None,
        )
        if proc is not None:
            out.extra["processor_s"] = proc.seconds  # grammar, penalties, logprobs: within decode_s
            if proc.top_logprobs is not None:
                out.logprobs = self.logprob_entries(proc.logprobs)
        return out


def kv_backend(model: Any, attention: str) -> str:
    """The kernel that writes a prefill's KV: the row-independent one whatever the setting on the
    quantized runtime, else the attention backend (their float K/V agree only to rounding). The
    prefix cache reuses KV only for a prefill that the same kernel would write."""
    return "rowwise" if model.rowwise_attention else str(attention)


def check_logprobs(logprobs: Any) -> None:
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise UserError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs!r}")


# --------------------------------------------------------------------------- one request


class Generation:
    """One request: checked prompt ids and resolved settings, run once on an engine (`run`), then
    its prompt offered to the prefix cache (`remember`, which the driver calls once the answer
    is out, so storing it delays only what comes next).

    `on_piece(text, entries)` receives each accepted batch's text (cut before the first stop
    string; `sent` is all of it) and its log-probability entries when `logprobs` asked for them.
    A set `cancel` stops the decode at its next accepted batch (`cancelled` then says so). With
    `tools` the result's `tool_calls` are the calls its text makes (callparser.CallParser, as the
    text streams), and a call that repeats an earlier one ends the decode as a stop string does.
    `on_progress(done, total)` hears the prefill's progress, chunk by chunk."""

    def __init__(self, origin: Origin, ids: list[int], settings: Settings, *, grammar: Grammar | None = None,
                 logprobs: int | None = None, stops: Sequence[str] = (), on_piece: PieceCallback | None = None,
                 cancel: threading.Event | None = None, tools: ToolSpec | None = None,
                 on_progress: ProgressCallback | None = None) -> None:
        check_logprobs(logprobs)
        # the answer parsed into calls, in the markup of the model's own chat template (or harmony),
        # after the thought of a thinking model (reasoning.py)
        self.calls = answer_parser(origin.tokenizer, tools) if tools is not None else None
        self.origin, self.ids, self.settings = origin, ids, settings
        self.grammar, self.logprobs = grammar, logprobs
        self.stops = StopStrings(stops)
        self.on_piece = on_piece
        self.cancel = cancel
        self.on_progress = on_progress  # the prefill's (done, total) prompt tokens after each chunk
        self.sent: list[str] = []  # the text streamed, cut at a stop string
        self.result: Result | None = None
        self._state: Prefilled | None = None
        self._pending: list[str] = []  # text of the batch being streamed
        self._given = 0  # log-probability entries streamed so far

    @property
    def streams(self) -> bool:
        return self.on_piece is not None or bool(self.stops.stops) or self.calls is not None

    @property
    def cancelled(self) -> bool:
        """Stopped early because `cancel` was set (not by a stop string, its length or an end token)."""
        r = self.result
        return (r is not None and r.stop_reason == "stopped" and self.cancel is not None and self.cancel.is_set()
                and not self.stopped)

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "length" when max_new_tokens ended it, else "stop" (an end token, a stop
        string, a repeated tool call)."""
        assert self.result is not None
        return "length" if self.result.stop_reason == "length" and not self.stopped else "stop"

    @property
    def stopped(self) -> bool:
        """Its text ended it: a stop string, or a tool call that repeats an earlier one."""
        return self.stops.hit or (self.calls is not None and self.calls.ended)

    def run(self, engine: Engine) -> Result:
        """Prefill (from the longest cached prefix), decode and stream; the `Result`."""
        s = self.settings
        proc = self.origin.processor(self.ids, s, self.grammar, self.logprobs)
        detok = Detokenizer(self.origin.detokenize, self._send) if self.streams else None

        def on_tokens(new_ids: list[int]) -> bool | int:
            if self.cancel is not None and self.cancel.is_set():
                return True
            if detok is None:
                return self.stopped
            if not self.stops.stops and self.calls is None:  # nothing in the text can end it: a batch a push
                detok.push(new_ids)
                self._post(proc)
                return False
            # One token at a time: where the text ends (a stop string, a repeated call) the rest of
            # the batch is dropped (the engine's TokensCallback), so speculation ends where `ar` does.
            for i, t in enumerate(new_ids):
                detok.push([t])
                if self.stopped:
                    self._post(proc, len(new_ids) - i - 1)
                    return i + 1 if i + 1 < len(new_ids) else True
            self._post(proc)
            return False

        listens = detok is not None or self.cancel is not None
        self._state = engine.prefill(self.ids, s, self.origin.lookup(self.ids, s), self.on_progress)
        self.result = self.origin.result(engine.decode(self._state, s, on_tokens if listens else None, proc), proc)
        if detok is not None and not self.stopped:
            detok.finish(self.result.text)
            self._send(self.stops.flush(), held=True)
            self._post(proc)
        if self.calls is not None:
            self.calls.finish()
            self.result.tool_calls = self.calls.tool_calls()
        return self.result

    def remember(self) -> None:
        """Offer the prompt's KV to the prefix cache (after `run`; no-op without a cache)."""
        if self._state is not None:
            self.origin.remember(self._state)

    def _send(self, piece: str, held: bool = False) -> None:
        safe = piece if held else self.stops.push(piece)
        if safe:
            self.sent.append(safe)
            self._pending.append(safe)
            if self.calls is not None:
                self.calls.push(safe)

    def _post(self, proc: LogitsProcessor | None, dropped: int = 0) -> None:
        # One piece per batch of tokens: its text and its tokens' log-probabilities together (not
        # of the `dropped` last ones, after the text ended).
        entries = None
        if proc is not None and proc.top_logprobs is not None:
            end = len(proc.logprobs) - dropped
            entries = self.origin.logprob_entries(proc.logprobs[self._given:end])
            self._given = end
        if self.on_piece is not None and (self._pending or entries):
            self.on_piece("".join(self._pending), entries)
        self._pending.clear()
