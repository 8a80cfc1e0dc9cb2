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

import queue
import threading
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from .batching.runner import Generations
from .common.errors import UserError
from .common.settings import Settings, make_settings
from .models.resolve import LoadOptions, ResolvedPair, resolve_pair
from .requests.generation import Generation, Origin, PieceCallback, Result
from .requests.prefix_cache import PrefixCache, fingerprint
from .requests.prompts import Prompts
from .speculation.decoder import DraftAnswer, Prefilled, ProgressCallback, SpecEngine, TokensCallback, kv_bytes

if TYPE_CHECKING:
    import torch

    from .requests.toolcalls import ToolSpec
    from .runtime.costmodel import CostModel
    from .runtime.transformer import Transformer

__all__ = ["LoadOptions", "Pair", "Prefilled", "Prepared", "Result", "Settings", "load", "prepare"]

TextCallback = Callable[[str], None]


# --------------------------------------------------------------------------- the pair


class Prepared(Prompts):
    """A checked pair whose weights are not loaded yet (see `prepare`): it can already encode
    prompts and check them against the context, so bad input fails before the slow part."""

    def __init__(self, spec: ResolvedPair, progress: bool = True) -> None:
        self.spec, self.progress = spec, progress

    def with_own_tokenizer(self) -> Prepared:
        """The same pair with a tokenizer of its own, for encoding on another thread than the pair's."""
        return Prepared(self.spec.with_own_tokenizer(), self.progress)

    def load(self) -> Pair:
        """Read both models' weights (as resolved) and make the pair."""
        return Pair(self.spec, *self.spec.load(self.progress))


class Pair(Prompts):
    """A loaded target (and optional draft) with its tokenizer and decoding engine.

    `generate` and `stream` are prefill + decode in one call: each makes a `Generation`
    (requests/generation.py: the request's whole life) and runs it on the pair's engine. For more than one
    decode of a prompt (a benchmark, a sweep), `prefill` it once and `decode` the state with each
    setting: decoding only appends after the prompt, so every decode starts from the same caches.
    With a prefix cache (`enable_prefix_cache`), `prefill` continues from the longest cached
    prefix of the prompt and `remember` offers a prefilled prompt to the cache.
    """

    def __init__(self, spec: ResolvedPair, target: Transformer, draft: Transformer | None) -> None:
        self.spec = spec
        self.target, self.draft = target, draft
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
        self.prefix_cache = PrefixCache(int(max_mb * 2**20), self.fingerprint(), directory,
                                        None if max_disk_mb is None else int(max_disk_mb * 2**20))
        return self.prefix_cache

    def fingerprint(self) -> str:
        """What must match for KV written by another process to be used here
        (`prefix_cache.fingerprint` of both models)."""
        return fingerprint([(self.target_path, self.target), (self.draft_path, self.draft)])

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
               response_format: Any = None, logprobs: int | None = None, **overrides: Any) -> Result:
        """Decode after a prefilled prompt with these settings (any method the prefill's caches
        serve; `max_new_tokens` within its room). `on_tokens` receives every accepted batch of
        token ids; a true return value stops after that batch (stop reason "stopped").
        `response_format` and `logprobs` as in `generate` (the logits processing and the `Result`
        are the generation's: `generation.Origin.processor`, `Origin.result`)."""
        s = self.settings(settings, **overrides)
        origin = self.origin()
        proc = origin.processor(state.prompt_ids, s, self.grammar(response_format), logprobs)
        return origin.result(self._engine.decode(state, s, on_tokens, proc), proc)

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
                   tool_call_recovery: bool | None = None, tool_spec: ToolSpec | None = None,
                   stops: Sequence[str] = (), on_piece: PieceCallback | None = None,
                   cancel: threading.Event | None = None, tokenizer: Any = None,
                   on_progress: ProgressCallback | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                   **overrides: Any) -> Generation:
        """One request, checked (bad input raises UserError here) and ready to run on an engine
        (`Generation.run`). Arguments as in `generate`; `stops`, `on_piece`, `cancel` and
        `on_progress` as in `Generation`; `tokenizer`: one of its own for a generation run on another
        thread; `tool_spec`: tools already checked (a server's request, whose grammar is `response_format`)."""
        s = self.settings(settings, **overrides)
        req = self.request(prompt, chat, response_format, tools, tool_choice, parallel_tool_calls, tool_call_recovery,
                           chat_template_kwargs)
        return Generation(self.origin(tokenizer), req.ids, s, grammar=req.grammar, logprobs=logprobs, stops=stops,
                          on_piece=on_piece, cancel=cancel, tools=req.tools or tool_spec, on_progress=on_progress)

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
        tool_call_recovery: bool | None = None,
        on_progress: ProgressCallback | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> Result | list[Result | None]:
        """Generate after `prompt` (text, OpenAI's messages, or token ids). Keyword overrides are
        `Settings` fields (method, max_new_tokens, temperature, frequency_penalty, ...), applied on
        top of `settings` if given. `on_text` receives text pieces as tokens are accepted.
        `response_format` constrains the output (OpenAI's, or a regex / grammar: see the module's
        docstring); `logprobs` (0-20) asks for each token's log-probability and that many
        alternatives. `tools`, `tool_choice` and `parallel_tool_calls` are OpenAI's (requests/toolcalls.py):
        the result's `tool_calls` are the calls the answer made (under `auto`, an answer that is
        nothing but a call written as bare JSON too, unless `tool_call_recovery` is False).
        `on_progress(done, total)` hears the prefill's prompt tokens after each chunk (a progress bar's).
        `chat_template_kwargs`: more of the chat template's variables (Qwen3's `enable_thinking`, say).

        A list of prompts runs in one continuous batch (batching/runner.py) and returns their results in
        order, each the tokens that prompt gets alone. An item is a prompt, a dict of its `prompt`
        and its own arguments (settings, `chat`, `response_format`, `logprobs`) over the common
        ones, or a `Generation` from `generation` (which can be cancelled: its result is then None).
        Calls from several threads share the batch."""
        tool_args = dict(tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                         tool_call_recovery=tool_call_recovery, chat_template_kwargs=chat_template_kwargs)
        if _many(prompt):
            return self._generate_many(prompt, dict(chat=chat, on_text=on_text, settings=settings,
                                                    response_format=response_format, logprobs=logprobs,
                                                    on_progress=on_progress, **tool_args, **overrides))
        on_piece = None if on_text is None else lambda text, _entries: on_text(text)
        gen = self.generation(prompt, chat=chat, settings=settings, response_format=response_format,
                              logprobs=logprobs, on_piece=on_piece, on_progress=on_progress, **tool_args,
                              **overrides)
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
                # Collected without close(): its batch's thread is stopped and joined all the same.
                weakref.finalize(self, self._batch.shutdown)
            return self._batch

    def close(self) -> None:
        """Stop the thread that runs lists of prompts (started by the first list), waiting for
        the step it is in. The pair stays usable: a later list starts a new batch. Also done when
        the pair is collected and at interpreter exit; `with specextend.load() as pair:` closes it."""
        with self._lock:
            batch, self._batch = self._batch, None
        if batch is not None:
            batch.shutdown()

    def __enter__(self) -> Pair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _many(prompt: Any) -> bool:
    """A list of prompts, not one prompt's token ids (a list whose items are not ints) nor one
    conversation (OpenAI's messages: dicts with a `role`)."""
    if not isinstance(prompt, list | tuple) or not prompt or isinstance(prompt[0], int):
        return False
    return not all(isinstance(m, dict) and "role" in m for m in prompt)


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
    kv_cache: str = "bf16",
    max_context: int | None = None,
    load_draft: bool = True,
    progress: bool = True,
) -> Prepared:
    """Everything `load` does short of reading weights: check the options, resolve (and pull)
    the references, read the configs and the tokenizer and check that they fit together.

    References are whatever `specextend.models.registry.resolve_model_ref` accepts: None for
    the default pair (pulled on first use), a folder, a .gguf file or a known short name.
    `dtype`, `device`, `draft_dtype`, `weights`, `draft_weights` and `kv_cache` (the target's KV
    cache: "bf16", or "q8", int8 rows at about half the bytes, on the quantized CPU kernels) and
    `max_context` (the longest sequence served, up to the file's; None: each model's default, which
    for LongRoPE models is their original window) are `LoadOptions`; without `load_draft` the pair
    has no draft (methods ar and lookup need none).
    """
    options = LoadOptions(dtype, device, draft_dtype, weights, draft_weights, kv_cache, max_context)
    return Prepared(resolve_pair(target, draft, options, load_draft=load_draft, progress=progress), progress)


def load(target: str | Path | None = None, draft: str | Path | None = None, **options: Any) -> Pair:
    """`prepare(target, draft, **options).load()`: the pair, loaded (options as in `prepare`)."""
    return prepare(target, draft, **options).load()
