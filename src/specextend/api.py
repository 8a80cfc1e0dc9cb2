"""The Python API: load a target/draft pair once, then generate, stream or time generations.

    import specextend
    pair = specextend.load()                      # the default pair, pulled on first use
    res = pair.generate("def fib(n):", method="specextend", max_new_tokens=64)
    print(res.text, res.decode_tokens_per_s, res.accepted_per_step)
    for piece in pair.stream("def fib(n):", max_new_tokens=64):
        print(piece, end="", flush=True)

    state = pair.prefill(long_prompt, method="sd")    # prefill once (target and draft) ...
    for method in ("ar", "sd", "specextend"):          # ... decode it with several settings
        print(method, pair.decode(state, method=method).decode_tokens_per_s)

Structured outputs, penalties and log-probabilities:

    res = pair.generate(report, chat=True, response_format={"type": "json_schema", "json_schema":
                        {"name": "facts", "schema": schema}}, frequency_penalty=0.3, logprobs=2)
    json.loads(res.text); res.logprobs[0]["top_logprobs"]

`response_format` is OpenAI's (text, json_object, json_schema) or the extensions {"type": "regex",
"regex": ...} and {"type": "grammar", "grammar": ...} (Lark or GBNF); `logprobs` is the number of
alternatives per position (0: the chosen token's only). Penalties are `Settings` fields.

`prepare` resolves the models (`models.resolve`: paths, configs, dtypes, weight schemes, the
tokenizer, once) without reading weights; `Prepared.load` reads them. `load` is both. Every
command goes through `prepare`, and only this module drives a pair's decoding engine: callers
use `Pair.prefill`, `Pair.decode`, `Pair.remember` (the prefix cache) and `Pair.generate`.
"""

from __future__ import annotations

import copy
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateError

from . import kernels, vocab_trim
from .batch import Batch, Port, StepCosts
from .detokenize import Detokenizer
from .engine import GenerationResult, Prefilled, SpecEngine, TokensCallback, check_fits, kv_bytes
from .errors import UserError
from .grammar import Grammar, GrammarSpec, compile_grammar, tokenizer_for
from .jsonl import finite_json
from .logits_process import MAX_TOP_LOGPROBS, LogitsProcessor, TokenLogprob
from .models.loader import QUANTIZED_WEIGHTS
from .models.resolve import LoadOptions, ResolvedPair, resolve_pair
from .penalties import Penalties
from .progress import say
from .settings import Settings
from .toolcalls import CallParser, ToolSpec, template_messages

if TYPE_CHECKING:
    from .costmodel import CostModel
    from .model import Transformer
    from .prefix_cache import PrefixCache

__all__ = ["LoadOptions", "Pair", "Prefilled", "Prepared", "Result", "Settings", "load", "prepare"]

TextCallback = Callable[[str], None]


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
        d: dict[str, Any] = {
            "method": self.method,
            "target": self.target,
            "draft": self.draft,
            "dtype": self.dtype,
            "draft_dtype": self.draft_dtype,
            "weights": self.weights,
            "draft_weights": self.draft_weights,
            "device": self.device,
            "config": self.config,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "token_ids": list(self.token_ids),
            "text": self.text,
            "prefill_s": self.prefill_s,
            "decode_s": self.decode_s,
            "total_s": self.total_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "steps": self.steps,
            "accepted_per_step": self.accepted_per_step,
            "phases": dict(self.phases),
            "stop_reason": self.stop_reason,
            "accept_lengths": list(self.accept_lengths),
            "extra": dict(self.extra),
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }
        if self.logprobs is not None:
            d["logprobs"] = self.logprobs
        if self.tool_calls is not None:
            d["tool_calls"] = self.tool_calls
        return finite_json(d)


class _Cancelled(Exception):
    """Raised inside the engine's callback when a stream's consumer has gone away."""


# --------------------------------------------------------------------------- the pair


class _Prompts:
    """Prompt text <-> token ids and the context limit, shared by a prepared (not yet loaded) pair
    and a loaded one; both hold the pair's resolved description (`spec`)."""

    spec: ResolvedPair

    @property
    def tokenizer(self) -> Any:
        return self.spec.tokenizer

    @property
    def target_path(self) -> Path:
        return self.spec.target.path

    @property
    def draft_path(self) -> Path | None:
        return self.spec.draft.path if self.spec.draft is not None else None

    @property
    def dtype(self) -> str:
        return self.spec.target.dtype

    @property
    def draft_dtype(self) -> str | None:
        return self.spec.draft.dtype if self.spec.draft is not None else None

    @property
    def device(self) -> str:
        return self.spec.device

    @property
    def eos_ids(self) -> list[int]:
        return list(self.spec.eos_ids)

    @property
    def context(self) -> int:
        """Longest sequence (prompt + generated) the target accepts."""
        return int(self.spec.target.config.max_position)

    def check_fits(self, prompt_tokens: int, settings: Settings) -> None:
        """The engine's context limit (`engine.check_fits`), checkable before any weights are read."""
        draft_context = int(self.spec.draft.config.max_position) if self.spec.draft is not None else None
        check_fits(prompt_tokens, settings if settings.is_resolved else settings.resolved(), self.context,
                   draft_context)

    # ----------------------------------------------------------------- text <-> tokens

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Prompt token ids; with `chat`, wrapped in the tokenizer's chat template as a user turn."""
        if not isinstance(prompt, str):
            raise UserError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}")
        if not prompt.strip():
            raise UserError("the prompt is empty")
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        # verbose=False: our own length check below says it better than transformers' warning.
        ids = [int(i) for i in self.tokenizer.encode(prompt, verbose=False)]
        self._check_ids(ids)
        return ids

    def encode_chat(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
                    ) -> list[int]:
        """Prompt token ids of a conversation ({"role", "content"} dicts; an assistant's
        `tool_calls` and tool results as toolcalls.template_messages makes them) in the
        tokenizer's chat template, ending with the assistant's turn opened; `tools` (OpenAI's
        shape) are described as the template describes them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer in {self.target_path} has no chat template; send a plain prompt")
        # Render to text, then tokenize: the template already holds any special tokens.
        extra = {"tools": list(tools)} if tools else {}
        try:
            text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                      **extra)
        except TemplateError as e:  # a template's own raise_exception (an order of roles it refuses)
            raise UserError(f"the chat template cannot render these messages: {str(e).strip()[:300]}") from None
        ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False, verbose=False)]
        self._check_ids(ids)
        return ids

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens skipped)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise UserError("the prompt is empty")
        vocab = int(self.spec.target.config.vocab_size)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the target's vocabulary of {vocab}")
        if len(ids) >= self.context:
            raise UserError(
                f"the prompt is {len(ids)} tokens, longer than the target's context of {self.context} tokens"
            )

    # ----------------------------------------------------------------- structured outputs

    def grammar(self, response_format: Any) -> Grammar | None:
        """The compiled grammar of a `response_format` (see the module's docstring) for this pair's
        tokenizer, None for plain text; UserError (one line) for one that is malformed, does not
        compile or admits nothing. Compiled grammars are cached per grammar and tokenizer."""
        if isinstance(response_format, Grammar):
            return response_format
        spec = GrammarSpec.parse(response_format)
        if spec is None:
            return None
        return compile_grammar(spec, self.tokenizer, int(self.spec.target.config.vocab_size))

    def warm_grammars(self) -> None:
        """Build the grammar engine's view of the tokenizer now (about 1.5 s at 150K tokens, once
        per tokenizer), so that the first constrained request does not wait for it."""
        tokenizer_for(self.tokenizer, int(self.spec.target.config.vocab_size))

    def prompt_ids(self, prompt: str | Sequence[int] | Sequence[dict[str, Any]], chat: bool = False,
                   tools: ToolSpec | None = None) -> list[int]:
        """Checked token ids of a text prompt (in the chat template with `chat`), of a
        conversation (OpenAI's messages, tool calls and results included) or of token ids (used
        as they are). `tools` are described in the template (a text prompt needs `chat`)."""
        if isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt):
            return self.encode_chat(template_messages(prompt), tools.template_tools() if tools else None)
        if isinstance(prompt, str) and tools is not None:
            if not chat:
                raise UserError("tools need a chat prompt: chat=True, or a list of messages")
            return self.encode_chat([{"role": "user", "content": prompt}], tools.template_tools())
        if isinstance(prompt, str):
            return self.encode(prompt, chat=chat)
        if chat:
            raise UserError("chat=True needs a text prompt, not token ids")
        ids = [int(i) for i in prompt]
        self._check_ids(ids)
        return ids


class Prepared(_Prompts):
    """A checked pair whose weights are not loaded yet (see `prepare`): it can already encode
    prompts and check them against the context, so bad input fails before the slow part."""

    def __init__(self, spec: ResolvedPair, progress: bool = True) -> None:
        self.spec, self.progress = spec, progress

    def with_own_tokenizer(self) -> Prepared:
        """The same pair with a tokenizer of its own, for encoding on another thread than the pair's."""
        return Prepared(self.spec.with_own_tokenizer(), self.progress)

    def load(self) -> Pair:
        """Read both models' weights (as resolved) and make the pair."""
        from .models.loader import build_model

        # One line once loaded: a failed load then leaves only its error line on stderr.
        t0 = time.perf_counter()
        target = build_model(self.spec.target, self.device)
        draft = build_model(self.spec.draft, self.device) if self.spec.draft is not None else None
        what = f"target {self.target_path.name} ({target.weights})"
        if draft is not None and self.draft_path is not None:
            what += f" and draft {self.draft_path.name} ({draft.weights})"
        say(self.progress, f"loaded {what} on {self.device} in {time.perf_counter() - t0:.1f} s")
        return Pair(self.spec, target, draft)


class Pair(_Prompts):
    """A loaded target (and optional draft) with its tokenizer and decoding engine.

    `generate` and `stream` are prefill + decode in one call. For more than one decode of a prompt
    (a benchmark, a sweep), `prefill` it once and `decode` the state with each setting: decoding
    only appends after the prompt, so every decode starts from the same caches. With a prefix
    cache (`enable_prefix_cache`), `prefill` continues from the longest cached prefix of the
    prompt and `remember` offers a prefilled prompt to the cache.
    """

    def __init__(self, spec: ResolvedPair, target: Transformer, draft: Transformer | None) -> None:
        self.spec = spec
        self.target, self.draft = target, draft
        vocab_trim.enable(draft, spec.eos_ids)
        self._engine = SpecEngine(target, draft, spec.eos_ids)
        self.last_result: Result | None = None
        self.prefix_cache: PrefixCache | None = None

    # ----------------------------------------------------------------- prefix cache

    def enable_prefix_cache(self, max_mb: float, directory: str | Path | None = None,
                            max_disk_mb: float | None = None) -> PrefixCache:
        """Keep prompts' prefilled KV (up to `max_mb` MB; optionally also in `directory`, up to
        `max_disk_mb`, default the same): a later prompt that starts the same way prefills only
        the rest. Returns the cache (see `prefix_cache.PrefixCache.stats`)."""
        from .prefix_cache import PrefixCache

        self.prefix_cache = PrefixCache(int(max_mb * 2**20), self.fingerprint(), directory,
                                        None if max_disk_mb is None else int(max_disk_mb * 2**20))
        return self.prefix_cache

    def fingerprint(self) -> str:
        """What must match for KV written by another process to be used here: both models' files
        (paths, sizes, modification times), how they were loaded, and the version of the
        kernels' arithmetic."""
        h = hashlib.sha256(f"kernels {kernels.ARITHMETIC_VERSION}\0".encode())
        for path, model in ((self.target_path, self.target), (self.draft_path, self.draft)):
            if path is None or model is None:
                h.update(b"none\0")
                continue
            files = sorted(path.iterdir()) if path.is_dir() else [path]
            for f in files:
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\0".encode())
            h.update(f"{model.weights}:{model.dtype}:{model.kv_dtype}\0".encode())
        return h.hexdigest()[:32]

    def remember(self, state: Prefilled) -> None:
        """Offer a prefilled prompt to the prefix cache (no-op without one). Valid after decoding too."""
        if self.prefix_cache is None:
            return
        snap = state.snapshot()  # the draft's slots computed so far, if any
        draft_backend = kv_backend(self.draft, state.attention) if snap.draft_kv is not None else None
        self.prefix_cache.insert(state.prompt_ids, snap, kv_backend(self.target, state.attention), draft_backend)

    # ----------------------------------------------------------------- batching

    def in_batch(self, batch: Batch) -> Pair:
        """This pair as the sequences of `batch` run it: the same models, tokenizer and prefix
        cache, with an engine whose forwards run in the batch's steps (`batch.Port`) and whose
        trees are sized for the step (`batch.StepCosts`). Its `prefill`, `decode` and `remember`
        must be called from a sequence of that batch."""
        base = self.step_costs()
        other = copy.copy(self)
        other._engine = SpecEngine(Port(self.target), Port(self.draft) if self.draft is not None else None,
                                   self.spec.eos_ids)
        other._engine.eos = self._engine.eos
        other._engine.costs = StepCosts(base, batch)
        return other

    def step_costs(self) -> CostModel:
        """The measured step costs of both models (measured once per machine and cached), which
        tree sizing and the server's step budget read."""
        return self._engine.cost_model(make_settings(method="specextend" if self.draft is not None else "lookup"))

    def kv_bytes(self, prompt_tokens: int, settings: Settings) -> int:
        """Bytes of the caches a generation of this prompt length allocates (`engine.kv_bytes`)."""
        return kv_bytes(self.target, self.draft, prompt_tokens, settings)

    # ----------------------------------------------------------------- prefill and decode

    def settings(self, settings: Settings | None = None, **overrides: Any) -> Settings:
        """Resolved settings from a base and keyword overrides (`Settings` fields), checked against
        this pair (a method that needs a draft, on a pair without one, is refused)."""
        s = make_settings(settings, **overrides)
        if s.uses_draft and self.draft is None:
            raise UserError(f"method {s.method!r} needs a draft model (this pair was loaded without one)")
        return s

    def warmup(self) -> None:
        """Run every forward shape decoding will use once, untimed (kernel builds stay out of timings)."""
        self._engine.warmup()

    def prefill(self, prompt: str | Sequence[int], settings: Settings | None = None, *, chat: bool = False,
                **overrides: Any) -> Prefilled:
        """Both models' caches over the prompt (the draft's only if the method uses one), with room
        for `max_new_tokens`, continued from the longest cached prefix if a prefix cache is on.
        Settings as in `generate`; their attention backend writes the caches."""
        return self._prefill(self.prompt_ids(prompt, chat), self.settings(settings, **overrides))

    def _prefill(self, ids: list[int], s: Settings) -> Prefilled:
        prefix = None
        if self.prefix_cache is not None:
            draft_backend = kv_backend(self.draft, s.attention) if s.uses_draft and self.draft is not None else None
            prefix = self.prefix_cache.lookup(ids, kv_backend(self.target, s.attention), draft_backend)
        return self._engine.prefill(ids, s, prefix)

    def decode(self, state: Prefilled, settings: Settings | None = None, *, on_tokens: TokensCallback | None = None,
               response_format: Any = None, logprobs: int | None = None, processor: LogitsProcessor | None = None,
               **overrides: Any) -> Result:
        """Decode after a prefilled prompt with these settings (any method the prefill's caches
        serve; `max_new_tokens` within its room). `on_tokens` receives every accepted batch of
        token ids; a true return value stops after that batch (stop reason "stopped").
        `response_format` and `logprobs` as in `generate`; or a fresh `processor` (see
        `processor`) whose log-probabilities the caller reads as they grow."""
        s = self.settings(settings, **overrides)
        proc = processor if processor is not None else self.processor(state.prompt_ids, s, response_format, logprobs)
        return self._result(self._engine.decode(state, s, on_tokens, proc), proc)

    def processor(self, prompt_ids: Sequence[int], s: Settings, response_format: Any = None,
                  logprobs: int | None = None) -> LogitsProcessor | None:
        """A decode's own logits processing (grammar, penalties, log-probabilities); None if
        the request needs none."""
        grammar = self.grammar(response_format)
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise UserError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs!r}")
        if grammar is None and logprobs is None and not s.penalised:
            return None
        vocab = int(self.spec.target.config.vocab_size)
        penalties = Penalties(s.frequency_penalty, s.presence_penalty, s.repetition_penalty, prompt_ids, vocab)
        return LogitsProcessor(grammar=grammar, penalties=penalties, top_logprobs=logprobs, eos_ids=self.eos_ids)

    def _result(self, res: GenerationResult, proc: LogitsProcessor | None) -> Result:
        out = self.result(res)
        if proc is not None:
            out.extra["processor_s"] = proc.seconds  # grammar, penalties, logprobs: within decode_s
        if proc is not None and proc.top_logprobs is not None:
            out.logprobs = self.logprob_entries(proc.logprobs)
        return out

    def logprob_entries(self, logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
        """Log-probabilities as OpenAI's entries (token text, its bytes, the alternatives)."""
        tok = tokenizer_for(self.tokenizer, int(self.spec.target.config.vocab_size))

        def one(token: int, logprob: float) -> dict[str, Any]:
            raw = bytes(tok.decode_bytes([token]))
            return {"token": raw.decode("utf-8", errors="replace"), "token_id": token, "logprob": logprob,
                    "bytes": list(raw)}

        return [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in logprobs]

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        on_text: TextCallback | None = None,
        settings: Settings | None = None,
        response_format: Any = None,
        logprobs: int | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
        **overrides: Any,
    ) -> Result:
        """Generate after `prompt` (text, OpenAI's messages, or token ids). Keyword overrides are
        `Settings` fields (method, max_new_tokens, temperature, frequency_penalty, ...), applied on
        top of `settings` if given. `on_text` receives text pieces as tokens are accepted.
        `response_format` constrains the output (OpenAI's, or a regex / grammar: see the module's
        docstring); `logprobs` (0-20) asks for each token's log-probability and that many
        alternatives. `tools`, `tool_choice` and `parallel_tool_calls` are OpenAI's (toolcalls.py):
        the result's `tool_calls` are the calls the answer made."""
        s = self.settings(settings, **overrides)
        spec = ToolSpec.parse(tools, tool_choice, parallel_tool_calls)
        ids = self.prompt_ids(prompt, chat, spec)
        if spec is not None:
            if response_format is not None:
                raise UserError("tools and a response_format cannot be combined (a call is constrained to its schema)")
            response_format = self.grammar(spec.grammar(self.tokenizer))
        res = self._generate(ids, s, on_text, proc=self.processor(ids, s, response_format, logprobs))
        if spec is not None:
            res.tool_calls = CallParser().answer(res.text)[1]
        return res

    def _generate(
        self, ids: list[int], s: Settings, on_text: TextCallback | None, cancel: threading.Event | None = None,
        proc: LogitsProcessor | None = None,
    ) -> Result:
        detok = Detokenizer(self.detokenize, on_text) if on_text is not None else None

        def on_tokens(new_ids: list[int]) -> None:
            if cancel is not None and cancel.is_set():
                raise _Cancelled
            if detok is not None:
                detok.push(new_ids)

        wants_tokens = detok is not None or cancel is not None
        state = self._prefill(ids, s)
        self.last_result = self._result(self._engine.decode(state, s, on_tokens if wants_tokens else None, proc), proc)
        self.remember(state)
        if detok is not None:
            detok.finish(self.last_result.text)
        return self.last_result

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        settings: Settings | None = None,
        response_format: Any = None,
        logprobs: int | None = None,
        **overrides: Any,
    ) -> Iterator[str]:
        """Text pieces as they are accepted. The finished `Result` is then `pair.last_result`
        (and the generator's return value). Settings are checked before the first piece."""
        s = self.settings(settings, **overrides)
        ids = self.prompt_ids(prompt, chat)  # bad input raises here, in the caller's thread
        return self._stream(ids, s, self.processor(ids, s, response_format, logprobs))

    def _stream(self, ids: list[int], s: Settings, proc: LogitsProcessor | None = None
                ) -> Generator[str, None, Result | None]:
        pieces: queue.Queue[tuple[str, Any]] = queue.Queue()
        cancel = threading.Event()

        def work() -> None:
            try:
                pieces.put(("done", self._generate(ids, s, lambda p: pieces.put(("text", p)), cancel, proc)))
            except _Cancelled:
                pieces.put(("done", None))
            except BaseException as e:  # re-raised in the consumer's thread
                pieces.put(("error", e))

        worker = threading.Thread(target=work, name="specextend-stream", daemon=True)
        worker.start()
        try:
            while True:
                kind, value = pieces.get()
                if kind == "text":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return value
        finally:
            # The consumer stopped early (or finished): stop the engine at its next batch.
            cancel.set()
            worker.join()

    def result(self, res: GenerationResult) -> Result:
        """The engine's measurements with the decoded text and what ran (models, dtypes, device)."""
        s: Settings = res.settings
        fields_ = {f.name: getattr(res, f.name) for f in fields(GenerationResult)}
        fields_.update(token_ids=list(res.token_ids), phases=dict(res.phases), accept_lengths=list(res.accept_lengths),
                       settings=s, extra=dict(res.extra or {}))
        draft_weights = self.draft.weights if s.uses_draft and self.draft is not None else None
        return Result(
            **fields_,
            text=self.detokenize(res.token_ids),
            method=s.method,
            target=str(self.target_path),
            draft=str(self.draft_path) if s.uses_draft and self.draft_path is not None else None,
            dtype=self.dtype,
            draft_dtype=self.draft_dtype if s.uses_draft else None,
            device=self.device,
            weights=self.target.weights,
            draft_weights=draft_weights,
            cpu_kernels=kernels.path() if {self.target.weights, draft_weights} & set(QUANTIZED_WEIGHTS) else None,
        )


def kv_backend(model: Any, attention: str) -> str:
    """The kernel that writes a prefill's KV: the row-independent one whatever the setting on the
    quantized runtime, else the attention backend (their float K/V agree only to rounding). The
    prefix cache reuses KV only for a prefill that the same kernel would write."""
    return "rowwise" if model.rowwise_attention else str(attention)


def make_settings(settings: Settings | None = None, **overrides: Any) -> Settings:
    """Settings from a base and keyword overrides; unknown names and bad values raise UserError."""
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"unknown setting {unknown[0]!r}; known: {', '.join(sorted(known - {'labels'}))}")
    base = settings if settings is not None else Settings()
    if not isinstance(base, Settings):
        raise UserError(f"settings must be a specextend.Settings, not {type(base).__name__}")
    return (replace(base, **overrides) if overrides else base).resolved()


# --------------------------------------------------------------------------- loading


def prepare(
    target: str | Path | None = None,
    draft: str | Path | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    draft_dtype: str | None = None,
    weights: str = "auto",
    draft_weights: str = "auto",
    load_draft: bool = True,
    progress: bool = True,
) -> Prepared:
    """Everything `load` does short of reading weights: check the options, resolve (and pull)
    the references, read the configs and the tokenizer and check that they fit together.

    References are whatever `specextend.models.registry.resolve_model_ref` accepts: None for
    the default pair (pulled on first use), a folder, a .gguf file or a known short name.
    `dtype`, `device`, `draft_dtype`, `weights` and `draft_weights` are `LoadOptions`; without
    `load_draft` the pair has no draft (methods ar and lookup need none).
    """
    options = LoadOptions(dtype, device, draft_dtype, weights, draft_weights)
    return Prepared(resolve_pair(target, draft, options, load_draft=load_draft, progress=progress), progress)


def load(target: str | Path | None = None, draft: str | Path | None = None, **options: Any) -> Pair:
    """`prepare(target, draft, **options).load()`: the pair, loaded (options as in `prepare`)."""
    return prepare(target, draft, **options).load()
