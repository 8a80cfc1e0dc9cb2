"""A model pair, resolved once: what a command's or an API call's model arguments mean, worked
out before any weights are read.

`LoadOptions` holds the precision, device and weight-scheme choices, checked as given (a bad
name fails here, before any model is fetched). `resolve_pair` turns two references (None for the
default pair, a folder, a .gguf file, a known short name, a hub id) and the options into a
`ResolvedPair`: each model's folder, config, dtype and concrete weight scheme
(`loader.ResolvedModel`), the target's tokenizer and every end-of-sequence id. Each config.json
is read here, once; `loader.build_model` then reads only weights. The API (`api.prepare`) and
through it every command build their pair this way.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..common.errors import UserError
from ..common.gc_pause import collector_paused
from ..common.progress import say
from ..common.settings import KV_CACHES, check_context
from . import calibration
from .loader import (
    ResolvedModel,
    build_model,
    check_weights,
    default_draft_dtype,
    load_tokenizer,
    parse_device,
    parse_dtype,
    resolve_model,
)
from .registry import resolve_model_ref

if TYPE_CHECKING:
    from ..runtime.transformer import Transformer


@dataclass(frozen=True)
class LoadOptions:
    """How to load a pair: dtype and device, the draft's dtype (None: `default_draft_dtype`), and
    each model's weight scheme (`loader.WEIGHTS`). Checked when made; UserError on a bad name."""

    dtype: str = "float32"
    device: str = "cpu"
    draft_dtype: str | None = None
    weights: str = "auto"
    draft_weights: str = "auto"
    kv_cache: str = "bf16"  # the target's KV cache kind (runtime.kv_cache.KV_CACHES)
    max_context: int | None = None  # the longest sequence served (None: each model's default; ModelConfig.with_context)

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.draft_dtype is not None:
            parse_dtype(self.draft_dtype)
        parse_device(self.device)
        check_weights(self.weights)
        check_weights(self.draft_weights)
        if self.kv_cache not in KV_CACHES:
            raise UserError(f"unknown --kv-cache {self.kv_cache!r}; choose one of {', '.join(KV_CACHES)}")
        if self.max_context is not None:
            check_context(self.max_context)


@dataclass(frozen=True)
class ResolvedPair:
    """A target (and optional draft) ready to be loaded, with the target's tokenizer."""

    target: ResolvedModel
    draft: ResolvedModel | None
    device: str
    tokenizer: Any
    eos_ids: tuple[int, ...]  # the target's files' and its tokenizer's
    # When resolving began (perf_counter): the "loaded" line counts the whole wait from there
    # (a first run's pull, conversion and tokenizer), not only the reading of the weights.
    asked_at: float = field(default_factory=time.perf_counter, compare=False)
    kv_cache: str = "bf16"  # LoadOptions.kv_cache, applied to the target when loaded

    def with_own_tokenizer(self) -> ResolvedPair:
        """The same pair with a tokenizer of its own (a tokenizer is not safe to share across threads)."""
        with collector_paused():
            return replace(self, tokenizer=load_tokenizer(self.target.path))

    def load(self, progress: bool = True) -> tuple[Transformer, Transformer | None]:
        """Read both models' weights (the draft's: None without one), saying so in one line."""
        # One line once loaded: a failed load then leaves only its error line on stderr.
        t0 = time.perf_counter()
        with collector_paused():
            target = build_model(self.target, self.device)
            draft = build_model(self.draft, self.device) if self.draft is not None else None
        if self.kv_cache == "q8" and not target.fused:
            raise UserError("--kv-cache q8 needs the quantized CPU kernels (a quantized target on a CPU with "
                            f"AVX2, AVX-512 or NEON); this target runs {target.weights} weights")
        target.kv_cache = self.kv_cache
        if self.kv_cache == "q8":  # the keys' offsets, from a fixed text (models/calibration.py)
            calibration.calibrate(target, self.tokenizer, self.target.path, self.target.weights)
        what = f"target {self.target.path.name} ({target.weights})"
        if draft is not None and self.draft is not None:
            what += f" and draft {self.draft.path.name} ({draft.weights})"
        now = time.perf_counter()
        waited = now - min(self.asked_at, t0)
        say(progress, f"loaded {what} on {self.device} in {waited:.1f} s (reading the weights: {now - t0:.1f} s)")
        return target, draft


def resolve_pair(target: str | Path | None, draft: str | Path | None, options: LoadOptions, *,
                 load_draft: bool = True, progress: bool = True) -> ResolvedPair:
    """Resolve (and on first use pull or convert) both references, read their configs and the
    target's tokenizer, and check that the two fit together. Without `load_draft`, no draft."""
    asked_at = time.perf_counter()
    target_path = resolve_model_ref(_ref(target), "target", progress=progress)
    draft_path = resolve_model_ref(_ref(draft), "draft", progress=progress) if load_draft else None
    with collector_paused():
        t = resolve_model(target_path, options.dtype, options.device, options.weights, context=options.max_context)
        d = None
        if draft_path is not None:
            draft_dtype = options.draft_dtype or default_draft_dtype(options.dtype, options.device,
                                                                     options.draft_weights)
            d = resolve_model(draft_path, draft_dtype, options.device, options.draft_weights, draft=True,
                              context=options.max_context)
        tokenizer = load_tokenizer(target_path)
        if d is not None:
            check_same_vocabulary(tokenizer, target_path, d.path, t.config.vocab_size, d.config.vocab_size)
    eos = set(t.eos_ids)
    if isinstance(getattr(tokenizer, "eos_token_id", None), int):
        eos.add(tokenizer.eos_token_id)
    return ResolvedPair(t, d, options.device, tokenizer, tuple(sorted(eos)), asked_at, options.kv_cache)


def _ref(ref: str | Path | None) -> str | None:
    return None if ref is None else str(ref)


def check_same_vocabulary(target_tok: Any, target_path: Path, draft_path: Path, target_vocab: int,
                          draft_vocab: int) -> None:
    """Refuse a draft that speaks another vocabulary: its proposals would be other tokens.

    The embedding sizes must agree (draft and target logits are compared index by index), and
    when the draft folder has its own tokenizer, every token string must agree too (a draft whose
    tokenizer files are the target's agrees without its tokenizer being read: reading one is a
    visible share of a command's start).
    """
    if target_vocab != draft_vocab:
        raise UserError(
            f"draft and target tokenizers differ: the target's vocabulary has {target_vocab} entries, "
            f"the draft's {draft_vocab}"
        )
    if not ((draft_path / "tokenizer.json").is_file() or (draft_path / "tokenizer.model").is_file()):
        return  # nothing to compare against; the sizes agree
    if same_tokenizer_files(target_path, draft_path):
        return
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


# The files a tokenizer's vocabulary is read from (tokenizer_config.json too, apart from its chat
# template: that changes how chats are written, not which string each id stands for).
_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                "special_tokens_map.json")


def same_tokenizer_files(a: Path, b: Path) -> bool:
    """Whether two model folders build their tokenizers from the same bytes (same vocabulary)."""
    for name in _VOCAB_FILES:
        fa, fb = a / name, b / name
        if fa.is_file() != fb.is_file():
            return False
        if fa.is_file() and (fa.stat().st_size != fb.stat().st_size or fa.read_bytes() != fb.read_bytes()):
            return False
    return _config_sans_template(a) == _config_sans_template(b)


def _config_sans_template(folder: Path) -> Any:
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return object()  # equal to nothing: the full comparison (and its error) decides
    if isinstance(config, dict):
        config.pop("chat_template", None)
    return config
