"""The Python API: load a target/draft pair once, then generate, stream or time generations.

    import specextend
    pair = specextend.load()                      # the default pair, pulled on first use
    res = pair.generate("def fib(n):", method="specextend", max_new_tokens=64)
    print(res.text, res.decode_tokens_per_s, res.accepted_per_step)
    for piece in pair.stream("def fib(n):", max_new_tokens=64):
        print(piece, end="", flush=True)

The command line (`specextend generate`) is a thin layer over `load` and `Pair.generate`.
"""

from __future__ import annotations

import hashlib
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import kernels
from .detokenize import Detokenizer
from .engine import GenerationResult, Prefilled, check_fits
from .errors import UserError
from .jsonl import finite_json
from .models.loader import QUANTIZED_WEIGHTS
from .settings import Settings

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache

__all__ = ["Pair", "Prepared", "Result", "Settings", "load", "prepare"]

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
        return finite_json(d)


class _Cancelled(Exception):
    """Raised inside the engine's callback when a stream's consumer has gone away."""


# --------------------------------------------------------------------------- the pair


class _Prompts:
    """Prompt text <-> token ids, shared by a prepared (not yet loaded) pair and a loaded one."""

    tokenizer: Any
    target_cfg: Any  # specextend.model.ModelConfig
    target_path: Path

    @property
    def context(self) -> int:
        """Longest sequence (prompt + generated) the target accepts."""
        return int(self.target_cfg.max_position)

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

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """Prompt token ids of a conversation ({"role", "content"} dicts) in the tokenizer's chat
        template, ending with the assistant's turn opened."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer in {self.target_path} has no chat template; send a plain prompt")
        # Render to text, then tokenize: the template already holds any special tokens.
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        ids = [int(i) for i in self.tokenizer.encode(text, add_special_tokens=False, verbose=False)]
        self._check_ids(ids)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise UserError("the prompt is empty")
        vocab = int(self.target_cfg.vocab_size)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise UserError(f"prompt token id {bad[0]} is outside the target's vocabulary of {vocab}")
        if len(ids) >= self.context:
            raise UserError(
                f"the prompt is {len(ids)} tokens, longer than the target's context of {self.context} tokens"
            )

    def prompt_ids(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Checked token ids of a text prompt (in the chat template with `chat`) or of token ids."""
        if isinstance(prompt, str):
            return self.encode(prompt, chat=chat)
        if chat:
            raise UserError("chat=True needs a text prompt, not token ids")
        ids = [int(i) for i in prompt]
        self._check_ids(ids)
        return ids


class Pair(_Prompts):
    """A loaded target (and optional draft) with its tokenizer and decoding engine."""

    def __init__(
        self,
        target: Any,
        draft: Any | None,
        tokenizer: Any,
        eos_ids: Sequence[int],
        target_path: Path,
        draft_path: Path | None,
        dtype: str = "float32",
        device: str = "cpu",
        draft_dtype: str | None = None,
    ) -> None:
        from .engine import SpecEngine

        self.target = target
        self.draft = draft
        self.target_cfg = target.cfg
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.target_path = Path(target_path)
        self.draft_path = Path(draft_path) if draft_path is not None else None
        self.dtype = dtype
        self.draft_dtype = (draft_dtype or dtype) if draft is not None else None
        self.device = device
        self.engine = SpecEngine(target, draft, self.eos_ids)
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
        (paths, sizes, modification times) and how they were loaded."""
        h = hashlib.sha256()
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

    @staticmethod
    def kv_kind(model: Any, s: Settings) -> str:
        """The kernel that writes a prefill's KV: the row-independent one whatever the setting on
        the quantized runtime, else the attention backend (their float K/V agree only to rounding)."""
        return "rowwise" if model.rowwise_attention else str(s.attention)

    def prefill(self, ids: list[int], s: Settings) -> Prefilled:
        """Both models' caches over the prompt, starting from the longest cached prefix if any."""
        prefix = None
        if self.prefix_cache is not None:
            draft_kind = self.kv_kind(self.draft, s) if s.uses_draft and self.draft is not None else None
            prefix = self.prefix_cache.lookup(ids, self.kv_kind(self.target, s), draft_kind)
        return self.engine.prefill(ids, s, prefix)

    def remember(self, state: Prefilled, s: Settings) -> None:
        """Offer a prefilled prompt (prefilled with settings `s`) to the prefix cache (no-op without one)."""
        if self.prefix_cache is None:
            return
        draft_kind = self.kv_kind(self.draft, s) if state.draft_store is not None else None
        self.prefix_cache.insert(state.prompt_ids, state.snapshot(), self.kv_kind(self.target, s), draft_kind)

    # ----------------------------------------------------------------- generation

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        on_text: TextCallback | None = None,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Result:
        """Generate after `prompt` (text, or token ids). Keyword overrides are `Settings` fields
        (method, max_new_tokens, temperature, ...), applied on top of `settings` if given.
        `on_text` receives text pieces as tokens are accepted."""
        s = self._settings(settings, overrides)
        return self._generate(self.prompt_ids(prompt, chat), s, on_text)

    def _generate(
        self, ids: list[int], s: Settings, on_text: TextCallback | None, cancel: threading.Event | None = None
    ) -> Result:
        detok = Detokenizer(self.decode, on_text) if on_text is not None else None

        def on_tokens(new_ids: list[int]) -> None:
            if cancel is not None and cancel.is_set():
                raise _Cancelled
            if detok is not None:
                detok.push(new_ids)

        wants_tokens = detok is not None or cancel is not None
        state = self.prefill(ids, s)
        gen = self.engine.decode(state, s, on_tokens=on_tokens if wants_tokens else None)
        self.remember(state, s)
        self.last_result = self.result(gen)
        if detok is not None:
            detok.finish(self.last_result.text)
        return self.last_result

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        chat: bool = False,
        settings: Settings | None = None,
        **overrides: Any,
    ) -> Iterator[str]:
        """Text pieces as they are accepted. The finished `Result` is then `pair.last_result`
        (and the generator's return value). Settings are checked before the first piece."""
        s = self._settings(settings, overrides)
        ids = self.prompt_ids(prompt, chat)  # bad input raises here, in the caller's thread
        return self._stream(ids, s)

    def _settings(self, settings: Settings | None, overrides: dict[str, Any]) -> Settings:
        s = make_settings(settings, **overrides)
        if s.uses_draft and self.draft is None:
            raise UserError(f"method {s.method!r} needs a draft model (this pair was loaded without one)")
        return s

    def _stream(self, ids: list[int], s: Settings) -> Generator[str, None, Result | None]:
        pieces: queue.Queue[tuple[str, Any]] = queue.Queue()
        cancel = threading.Event()

        def work() -> None:
            try:
                pieces.put(("done", self._generate(ids, s, lambda p: pieces.put(("text", p)), cancel)))
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

    def result(self, gen: GenerationResult) -> Result:
        """The engine's measurements with the decoded text and what ran (models, dtypes, device)."""
        s: Settings = gen.settings
        fields_ = {f.name: getattr(gen, f.name) for f in fields(GenerationResult)}
        fields_.update(token_ids=list(gen.token_ids), phases=dict(gen.phases), accept_lengths=list(gen.accept_lengths),
                       settings=s, extra=dict(gen.extra or {}))
        draft_weights = self.draft.weights if s.uses_draft and self.draft is not None else None
        return Result(
            **fields_,
            text=self.decode(gen.token_ids),
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


def make_settings(settings: Settings | None = None, **overrides: Any) -> Settings:
    """Settings from a base and keyword overrides; unknown names and bad values raise UserError."""
    known = {f.name for f in fields(Settings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"unknown setting {unknown[0]!r}; known: {', '.join(sorted(known - {'labels'}))}")
    base = settings if settings is not None else Settings()
    if not isinstance(base, Settings):
        raise UserError(f"settings must be a specextend.Settings, not {type(base).__name__}")
    return replace(base, **overrides).resolved()


# --------------------------------------------------------------------------- loading


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"specextend: {message}", file=sys.stderr, flush=True)


def load(
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
) -> Pair:
    """Load a target and (unless `load_draft` is False) a draft model with the target's tokenizer.

    References are whatever `specextend.models.registry.resolve_model_ref` accepts: None for
    the default pair (pulled on first use), a folder, a .gguf file or a known short name.
    Everything cheap (names, configs, tokenizers) is checked before any weights are read.
    """
    return prepare(target, draft, dtype=dtype, device=device, draft_dtype=draft_dtype, weights=weights,
                   draft_weights=draft_weights, load_draft=load_draft, progress=progress).load()


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
    """Everything `load` does short of reading weights: resolve (and pull) the references, read
    the configs and tokenizers and check they fit together. The result can already encode and
    check prompts, so bad input fails before the slow part."""
    from .model import ModelConfig
    from .models.loader import (
        check_weights,
        default_draft_dtype,
        load_tokenizer,
        parse_device,
        parse_dtype,
        read_config,
    )
    from .models.registry import resolve_model_ref

    parse_dtype(dtype)
    parse_device(device)
    check_weights(weights)
    check_weights(draft_weights)
    draft_dtype = draft_dtype or default_draft_dtype(dtype, device, draft_weights)
    parse_dtype(draft_dtype)
    target_path = resolve_model_ref(_ref(target), "target", progress=progress)
    draft_path = resolve_model_ref(_ref(draft), "draft", progress=progress) if load_draft else None
    target_cfg = ModelConfig.from_hf(read_config(target_path))
    draft_cfg = ModelConfig.from_hf(read_config(draft_path)) if draft_path is not None else None
    tokenizer = load_tokenizer(target_path)
    if draft_path is not None and draft_cfg is not None:
        check_same_vocabulary(tokenizer, draft_path, target_cfg.vocab_size, draft_cfg.vocab_size)
    return Prepared(target_path, draft_path, target_cfg, draft_cfg, tokenizer, dtype, draft_dtype, device, progress,
                    weights, draft_weights)


@dataclass
class Prepared(_Prompts):
    """A checked pair whose weights are not loaded yet (see `prepare`)."""

    target_path: Path
    draft_path: Path | None
    target_cfg: Any
    draft_cfg: Any | None
    tokenizer: Any
    dtype: str
    draft_dtype: str | None
    device: str
    progress: bool
    weights: str = "auto"
    draft_weights: str = "auto"

    def check_fits(self, prompt_tokens: int, settings: Settings) -> None:
        """The engine's context limit (`engine.check_fits`), before any weights are read."""
        draft_context = int(self.draft_cfg.max_position) if self.draft_cfg is not None else None
        check_fits(prompt_tokens, settings, self.context, draft_context)

    def load(self) -> Pair:
        from .models.loader import eos_token_ids, load_model, parse_device, parse_dtype

        dev = parse_device(self.device)
        # One line once loaded: a failed load then leaves only its error line on stderr.
        t0 = time.perf_counter()
        target = load_model(self.target_path, parse_dtype(self.dtype), dev, weights=self.weights)
        draft = None
        if self.draft_path is not None:
            draft = load_model(self.draft_path, parse_dtype(self.draft_dtype or self.dtype), dev,
                               weights=self.draft_weights, draft=True)
        what = f"target {self.target_path.name} ({target.weights})"
        if draft is not None:
            what += f" and draft {self.draft_path.name} ({draft.weights})"
        _say(self.progress, f"loaded {what} on {self.device} in {time.perf_counter() - t0:.1f} s")
        return Pair(
            target,
            draft,
            self.tokenizer,
            eos_token_ids(self.target_path, self.tokenizer),
            self.target_path,
            self.draft_path,
            dtype=self.dtype,
            device=self.device,
            draft_dtype=self.draft_dtype,
        )


def _ref(ref: str | Path | None) -> str | None:
    return None if ref is None else str(ref)


def check_same_vocabulary(target_tok: Any, draft_path: Path, target_vocab: int, draft_vocab: int) -> None:
    """Refuse a draft that speaks another vocabulary: its proposals would be other tokens.

    The embedding sizes must agree (draft and target logits are compared index by index), and
    when the draft folder has its own tokenizer, every token string must agree too.
    """
    if target_vocab != draft_vocab:
        raise UserError(
            f"draft and target tokenizers differ: the target's vocabulary has {target_vocab} entries, "
            f"the draft's {draft_vocab}"
        )
    if not ((draft_path / "tokenizer.json").is_file() or (draft_path / "tokenizer.model").is_file()):
        return  # nothing to compare against; the sizes agree
    from .models.loader import load_tokenizer

    draft_tok = load_tokenizer(draft_path)
    if len(target_tok) != len(draft_tok):
        raise UserError(
            f"draft and target tokenizers differ: {len(target_tok)} tokens in the target's, "
            f"{len(draft_tok)} in the draft's"
        )
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        d_by_id = {i: t for t, i in d_vocab.items()}
        for tok, i in sorted(t_vocab.items(), key=lambda kv: kv[1]):
            if d_by_id.get(i) != tok:
                raise UserError(
                    f"draft and target tokenizers differ: token {i} is {tok!r} in the target's, "
                    f"{d_by_id.get(i)!r} in the draft's"
                )
        raise UserError("draft and target tokenizers differ")
