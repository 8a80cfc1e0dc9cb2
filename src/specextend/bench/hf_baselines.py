"""The alternatives users have today, run with transformers on the same weights and prompts.

- `hf-ar`: plain greedy `generate`;
- `hf-assisted`: assisted generation with the same draft (`assistant_model=`), HF's defaults
  (20 assistant tokens, constant schedule, dynamic confidence stop);
- `hf-lookup`: prompt lookup decoding (`prompt_lookup_num_tokens=10`).

Memory is tight (the fp32 default target alone is 7 GB), so the HF models are loaded lazily, only
when an hf-* method runs, the draft only for `hf-assisted`, and `close()` frees them (del +
garbage collection). The bench runs all hf-* rows after our own methods, having released our
models first, so the two copies of the weights are never resident together.

Timing: forward hooks on the HF target timestamp its forward passes. Prefill ends when the
target's first forward returns (for `hf-assisted` that includes the draft's own prefill and first
proposal, which HF runs before the target's first forward); decode runs from there to the end of
`generate`. `steps` counts target forwards after the first; `accepted_per_step` is the mean number
of drafted tokens accepted per target forward (each forward yields its accepted tokens + one).
`phases`: verify_s = target forwards after the first, draft_s = assistant forwards in that
window (prompt lookup's n-gram search is in other_s), retrieval_s = 0.
"""

from __future__ import annotations

import gc
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..common.errors import UserError
from ..models.loader import qk_row_order, read_config
from ..runtime.config import ModelConfig
from ..runtime.families import QK_ROWS_KEY, ROTATE_HALF

HF_METHODS = ("hf-ar", "hf-assisted", "hf-lookup")
PROMPT_LOOKUP_TOKENS = 10


@dataclass
class HFSettings:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def config(self, method: str) -> dict[str, Any]:
        """What ran, for the row's `config` (and the resume hash)."""
        d: dict[str, Any] = {"method": method, "max_new_tokens": self.max_new_tokens,
                             "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
                             "attn_implementation": "sdpa"}
        if method == "hf-lookup":
            d["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        if method == "hf-assisted":
            d["assistant"] = "hf defaults (num_assistant_tokens 20, constant schedule)"
        return d


class _ForwardTimer:
    """Forward hooks recording (start, end) of each call of a module."""

    def __init__(self, module: torch.nn.Module, sync: bool) -> None:
        self.sync = sync
        self.calls: list[tuple[float, float]] = []
        self._start = 0.0
        self._handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _pre(self, *_: Any) -> None:
        self._start = self._now()

    def _post(self, *_: Any) -> None:
        self.calls.append((self._start, self._now()))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _no_init_weights() -> AbstractContextManager[Any]:
    """transformers' switch for building a model whose weights are loaded afterwards, where this
    version has it (else building initialises them, slower, to the same end)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return nullcontext()
    return no_init_weights()


def hf_model(path: Path, dtype: torch.dtype) -> Any:
    """A transformers model of the folder: a Hugging Face checkpoint as it is, or our converted GGUF
    folder (quantized tensors) with every weight dequantized exactly, as transformers' own GGUF
    loader would give it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..models.loader import open_tensors

    tensors = open_tensors(Path(path))
    raw = read_config(Path(path))
    reordered = raw.get(QK_ROWS_KEY) == ROTATE_HALF
    if not tensors.quantized and not reordered:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    config = AutoConfig.from_pretrained(str(path))
    with _no_init_weights():  # every weight is loaded next: initialising 0.5B of them took 5 s
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = model.state_dict()
    # a vector llama.cpp keeps flat where transformers has [1, n] (ERNIE's selection bias) takes the model's shape
    state = {name: _shaped(tensors.get(name, dtype), params.get(name)) for name in tensors.names}
    if reordered:  # our converter put GLM's and ERNIE's Q/K rows in rotate-half order: back to theirs
        cfg = ModelConfig.from_hf(raw)
        orders = {name: qk_row_order(name, cfg) for name in state}
        state = {name: t if orders[name] is None else t[torch.argsort(orders[name])] for name, t in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]:
        raise UserError(f"{path}: tensors do not match the transformers model ({(missing + unexpected)[:3]})")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model


def _shaped(t: torch.Tensor, like: torch.Tensor | None) -> torch.Tensor:
    """`t` in `like`'s shape where they differ only in dimensions of 1."""
    if like is None or t.shape == like.shape or t.numel() != like.numel():
        return t
    return t.reshape(like.shape) if [d for d in t.shape if d != 1] == [d for d in like.shape if d != 1] else t


class HFBaselines:
    """HF copies of the pair, loaded on first use; call `close()` to free them."""

    def __init__(self, target_path: Path | str, draft_path: Path | str | None, dtype: torch.dtype = torch.float32,
                 draft_dtype: torch.dtype | None = None, device: str = "cpu") -> None:
        self.target_path = Path(target_path)
        self.draft_path = Path(draft_path) if draft_path is not None else None
        self.dtype = dtype
        self.draft_dtype = draft_dtype or dtype
        self.device = torch.device(device)
        self._target: Any = None
        self._draft: Any = None

    # ----------------------------------------------------------------- models

    def _load(self, path: Path, dtype: torch.dtype) -> Any:
        from transformers.utils import logging as hf_logging

        # Generation-config chatter and loading bars would drown the bench's progress bar.
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model = hf_model(path, dtype)
        except UserError:
            raise
        except Exception as e:  # transformers raises many kinds for an unloadable folder
            raise UserError(f"transformers cannot load {path}: {type(e).__name__}: {e}") from None
        return model.to(self.device).eval()

    @property
    def target(self) -> Any:
        if self._target is None:
            self._target = self._load(self.target_path, self.dtype)
        return self._target

    @property
    def draft(self) -> Any:
        if self._draft is None:
            if self.draft_path is None:
                raise UserError("hf-assisted needs a draft model")
            self._draft = self._load(self.draft_path, self.draft_dtype)
        return self._draft

    def close(self) -> None:
        self._target = self._draft = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ----------------------------------------------------------------- generation

    def _generation_config(self, method: str, s: HFSettings, eos_ids: list[int]) -> Any:
        from transformers import GenerationConfig

        kw: dict[str, Any] = {
            "max_new_tokens": s.max_new_tokens,
            "eos_token_id": list(eos_ids) or None,
            "pad_token_id": eos_ids[0] if eos_ids else None,
        }
        if s.temperature > 0:
            # top_k=0: the same distribution our engine samples from (temperature, then top-p).
            kw.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=0)
        else:
            kw.update(do_sample=False)
        if method == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        return GenerationConfig(**kw)

    def run(self, method: str, prompt_ids: list[int], settings: HFSettings, eos_ids: list[int]) -> dict[str, Any]:
        """Generate with one baseline; returns the contract's timing and token fields."""
        if method not in HF_METHODS:
            raise UserError(f"unknown HF baseline {method!r}; choose one of {', '.join(HF_METHODS)}")
        target = self.target
        extra: dict[str, Any] = {}
        if method == "hf-assisted":
            extra["assistant_model"] = self.draft
        config = self._generation_config(method, settings, eos_ids)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        sync = self.device.type == "cuda"
        t_timer = _ForwardTimer(target, sync)
        d_timer = _ForwardTimer(extra["assistant_model"], sync) if "assistant_model" in extra else None
        torch.manual_seed(settings.seed)
        try:
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      **extra)
            if sync:
                torch.cuda.synchronize()
            t_end = time.perf_counter()
        finally:
            t_timer.remove()
            if d_timer is not None:
                d_timer.remove()
        new = [int(t) for t in out[0, len(prompt_ids):].tolist()]
        return _measurements(new, t0, t_end, t_timer.calls, d_timer.calls if d_timer else [], eos_ids,
                             settings.max_new_tokens, method)


def _measurements(new: list[int], t0: float, t_end: float, target_calls: list[tuple[float, float]],
                  draft_calls: list[tuple[float, float]], eos_ids: list[int], max_new: int,
                  method: str) -> dict[str, Any]:
    # HF pads nothing for one sequence, but be safe: cut after the first EOS.
    for i, t in enumerate(new):
        if t in eos_ids:
            new = new[: i + 1]
            break
    prefill_end = target_calls[0][1] if target_calls else t0
    forwards = len(target_calls)
    decode_s = t_end - prefill_end
    verify_s = float(sum(e - s for s, e in target_calls[1:]))
    draft_s = float(sum(e - s for s, e in draft_calls if s >= prefill_end))
    accepted = 0.0
    if method != "hf-ar" and forwards:
        accepted = max(0, len(new) - forwards) / forwards
    stop = "eos" if new and new[-1] in eos_ids else ("length" if len(new) >= max_new else "other")
    return {
        "token_ids": new,
        "new_tokens": len(new),
        "prefill_s": prefill_end - t0,
        "decode_s": decode_s,
        "total_s": t_end - t0,
        "decode_tokens_per_s": len(new) / decode_s if decode_s > 0 else 0.0,
        "steps": max(0, forwards - 1) if forwards else None,
        "accepted_per_step": accepted,
        "phases": {"draft_s": draft_s, "verify_s": verify_s, "retrieval_s": 0.0,
                   "other_s": max(0.0, decode_s - verify_s - draft_s)},
        "stop_reason": stop,
    }
