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

import hashlib
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from jinja2 import TemplateError

from . import kernels, vocab_trim
from .batching import Generations
from .engine import DraftAnswer, GenerationResult, Prefilled, SpecEngine, TokensCallback, check_fits, kv_bytes
from .errors import UserError
from .generation import Generation, Origin, PieceCallback, Result
from .grammar import Grammar, GrammarSpec, compile_grammar, tokenizer_for
from .models.resolve import LoadOptions, ResolvedPair, resolve_pair
from .progress import say
from .settings import Settings
from .toolcalls import ToolSpec, template_messages

if TYPE_CHECKING:
    import torch

    from .costmodel import CostModel
    from .logits_process import LogitsProcessor
    from .model import Transformer
    from .prefix_cache import PrefixCache

__all__ = ["LoadOptions", "Pair", "Prefilled", "Prepared", "Result", "Settings", "load", "prepare"]

TextCallback = Callable[[str], None]


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

    `generate` and `stream` are prefill + decode in one call: each makes a `Generation`
    (generation.py: the request's whole life) and runs it on the pair's engine. For more than one
    decode of a prompt (a benchmark, a sweep), `prefill` it once and `decode` the state with each
    setting: decoding only appends after the prompt, so every decode starts from the same caches.
    With a prefix cache (`enable_prefix_cache`), `prefill` continues from the longest cached
    prefix of the prompt and `remember` offers a prefilled prompt to the cache.
    """

    def __init__(self, spec: ResolvedPair, target: Transformer, draft: Transformer | None) -> None:
        self.spec = spec
        self.target, self.draft = target, draft
        vocab_trim.enable(draft, spec.eos_ids)
        self._engine = SpecEngine(target, draft, spec.eos_ids)
        self.last_result: Result | None = None
        self.prefix_cache: PrefixCache | None = None
        self._batch: Generations | None = None  # made at the first list of prompts
        self._lock = threading.Lock()

    def origin(self, tokenizer: Any = None) -> Origin:
        """The pair as its generations see it (`tokenizer`: one for another thread than the pair's)."""
        return Origin(self.spec, self.target, self.draft, tokenizer if tokenizer is not None else self.tokenizer,
                      self.prefix_cache)

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
        self.origin().remember(state)

    # ----------------------------------------------------------------- costs and memory

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
        ids, s = self.prompt_ids(prompt, chat), self.settings(settings, **overrides)
        return self._engine.prefill(ids, s, self.origin().lookup(ids, s))

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
        return self.origin().result(self._engine.decode(state, s, on_tokens, proc), proc)

    def processor(self, prompt_ids: Sequence[int], s: Settings, response_format: Any = None,
                  logprobs: int | None = None) -> LogitsProcessor | None:
        """A decode's own logits processing (grammar, penalties, log-probabilities); None if
        the request needs none."""
        return self.origin().processor(prompt_ids, s, self.grammar(response_format), logprobs)

    def result(self, res: GenerationResult) -> Result:
        """The engine's measurements with the decoded text and what ran (models, dtypes, device)."""
        return self.origin().result(res)

    # ----------------------------------------------------------------- the draft alone

    def retrieval_scores(self, state: Prefilled, settings: Settings | None = None, **overrides: Any) -> torch.Tensor:
        """What the last prompt token of a prefilled prompt attends to in the target layers CMR
        ranks chunks with: the scores of its first retrieval (`engine.SpecEngine.retrieval`)."""
        return self._engine.retrieval(state, self.settings(settings, **overrides))

    def draft_alone(self, state: Prefilled, policy: str, scores: torch.Tensor, max_new_tokens: int,
                    settings: Settings | None = None, **overrides: Any) -> DraftAnswer:
        """The draft alone answering greedily from the working cache of draft cache `policy`
        (full, streaming, cmr) started from `scores`, after a prefill that used the draft (needle
        retrieval; `engine.SpecEngine.draft_alone`). The state can answer again, with any policy."""
        return self._engine.draft_alone(state, policy, self.settings(settings, **overrides), scores, max_new_tokens)

    # ----------------------------------------------------------------- whole generations

    def generation(self, prompt: str | Sequence[int], *, chat: bool = False, settings: Settings | None = None,
                   response_format: Any = None, logprobs: int | None = None, tools: list[dict[str, Any]] | None = None,
                   tool_choice: str | dict[str, Any] | None = None, parallel_tool_calls: bool | None = None,
                   stops: Sequence[str] = (), on_piece: PieceCallback | None = None,
                   cancel: threading.Event | None = None, tokenizer: Any = None, **overrides: Any) -> Generation:
        """One request, checked (bad input raises UserError here) and ready to run on an engine
        (`Generation.run`). Arguments as in `generate`; `stops`, `on_piece` and `cancel` as in
        `Generation`; `tokenizer`: one of its own for a generation run on another thread."""
        s = self.settings(settings, **overrides)
        spec = ToolSpec.parse(tools, tool_choice, parallel_tool_calls)
        ids = self.prompt_ids(prompt, chat, spec)
        if spec is not None and response_format is not None:
            raise UserError("tools and a response_format cannot be combined (a call is constrained to its schema)")
        grammar = self.grammar(spec.grammar(self.tokenizer) if spec is not None else response_format)
        return Generation(self.origin(tokenizer), ids, s, grammar=grammar, logprobs=logprobs, stops=stops,
                          on_piece=on_piece, cancel=cancel, tool_calls=spec is not None)

    @overload
    def generate(self, prompt: str | Sequence[int], *, chat: bool = False, on_text: TextCallback | None = None,
                 settings: Settings | None = None, response_format: Any = None, logprobs: int | None = None,
                 **overrides: Any) -> Result: ...

    @overload
    def generate(self, prompt: list[Any], *, chat: bool = False, on_text: TextCallback | None = None,
                 settings: Settings | None = None, response_format: Any = None, logprobs: int | None = None,
                 **overrides: Any) -> list[Result | None]: ...

    def generate(
        self,
        prompt: Any,
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
    ) -> Result | list[Result | None]:
        """Generate after `prompt` (text, OpenAI's messages, or token ids). Keyword overrides are
        `Settings` fields (method, max_new_tokens, temperature, frequency_penalty, ...), applied on
        top of `settings` if given. `on_text` receives text pieces as tokens are accepted.
        `response_format` constrains the output (OpenAI's, or a regex / grammar: see the module's
        docstring); `logprobs` (0-20) asks for each token's log-probability and that many
        alternatives. `tools`, `tool_choice` and `parallel_tool_calls` are OpenAI's (toolcalls.py):
        the result's `tool_calls` are the calls the answer made.

        A list of prompts runs in one continuous batch (batching.py) and returns their results in
        order, each the tokens that prompt gets alone. An item is a prompt, a dict of its `prompt`
        and its own arguments (settings, `chat`, `response_format`, `logprobs`) over the common
        ones, or a `Generation` from `generation` (which can be cancelled: its result is then None).
        Calls from several threads share the batch."""
        tool_args = dict(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        if _many(prompt):
            return self._generate_many(prompt, dict(chat=chat, on_text=on_text, settings=settings,
                                                    response_format=response_format, logprobs=logprobs,
                                                    **tool_args, **overrides))
        on_piece = None if on_text is None else lambda text, _entries: on_text(text)
        gen = self.generation(prompt, chat=chat, settings=settings, response_format=response_format,
                              logprobs=logprobs, on_piece=on_piece, **tool_args, **overrides)
        self.last_result = gen.run(self._engine)
        gen.remember()
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
        pieces: queue.Queue[tuple[str, Any]] = queue.Queue()
        # Bad input raises here, in the caller's thread.
        gen = self.generation(prompt, chat=chat, settings=settings, response_format=response_format,
                              logprobs=logprobs, on_piece=lambda text, _entries: pieces.put(("text", text)),
                              cancel=threading.Event(), **overrides)
        return self._stream(gen, pieces)

    def _stream(self, gen: Generation, pieces: queue.Queue[tuple[str, Any]]) -> Generator[str, None, Result | None]:
        def work() -> None:
            try:
                result = gen.run(self._engine)
                if not gen.cancelled:
                    self.last_result = result
                    gen.remember()
                pieces.put(("done", None if gen.cancelled else result))
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
            assert gen.cancel is not None
            gen.cancel.set()
            worker.join()

    # ----------------------------------------------------------------- many prompts at once

    def _generate_many(self, requests: Sequence[Any], common: dict[str, Any]) -> list[Result | None]:
        """Every request in one continuous batch (see `generate`); results in order."""
        if common.get("on_text") is not None:
            raise UserError("on_text streams one prompt; a list of prompts returns its results")
        common = {k: v for k, v in common.items() if k != "on_text"}
        batch = self._generations()
        gens = [r if isinstance(r, Generation) else self._request(r, common, batch.tokenizer) for r in requests]
        return batch.run(gens)

    def _request(self, request: Any, common: dict[str, Any], tokenizer: Any) -> Generation:
        """One item of a list of prompts: a prompt, or a dict of its `prompt` and its own arguments."""
        if not isinstance(request, dict):
            return self.generation(request, tokenizer=tokenizer, **common)
        if "prompt" not in request:
            raise UserError(f"a request given as a dict needs its 'prompt' (it has {', '.join(sorted(request))})")
        own = {k: v for k, v in request.items() if k != "prompt"}
        return self.generation(request["prompt"], tokenizer=tokenizer, **{**common, **own})

    def _generations(self) -> Generations:
        with self._lock:
            if self._batch is None:
                self._batch = Generations(self, self.spec.with_own_tokenizer().tokenizer)
            return self._batch


def _many(prompt: Any) -> bool:
    """A list of prompts, not one prompt's token ids (a list whose items are not ints) nor one
    conversation (OpenAI's messages: dicts with a `role`)."""
    if not isinstance(prompt, list | tuple) or not prompt or isinstance(prompt[0], int):
        return False
    return not all(isinstance(m, dict) and "role" in m for m in prompt)


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
