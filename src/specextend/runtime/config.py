"""What a model is, read from its Hugging Face `config.json`: the architecture, the sizes the
runtime builds and its family's switches (`ModelConfig`), and the architectures the runtime
implements (`SUPPORTED_ARCHS`, from families.py). No torch here: a config is read before anything
is loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..common.errors import UserError
from ..common.plural import count
from ..common.settings import check_context
from .families import FAMILIES, HF_CLASSES, QK_ROWS_KEY, ROTATE_HALF, family_of, supported

SUPPORTED_ARCHS = HF_CLASSES
# Bytes of a short convolution's state a token (a float32 value a hidden unit, whatever the KV cache's kind).
CONV_STATE_BYTES = 4


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: str  # "" (none), "head" (RMSNorm over each head's q and k) or "full" (over all of q and of k)
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    # The most positions the file allows (0: `max_position`). Above `max_position` where a longer
    # context changes the arithmetic, so the default stays below it: LongRoPE (Phi-3.5, Phi-4-mini)
    # takes its long factors above its original window (`with_context`, `long_rope`).
    context_limit: int = 0
    # The family's switches (families.py); the defaults are Llama's.
    norms: tuple[str, ...] = ("attn_norm", "mlp_norm")  # which of Block's four norm placements exist
    norm_plus_one: bool = False  # norms scale by (1 + weight) (Gemma): the loader adds the 1
    activation: str = "silu"  # of the gated MLP: "silu", "gelu_tanh" or "swiglu_oai" (experts.clamped_swiglu)
    embed_scale: float = 1.0  # multiplies the embeddings (in the model dtype)
    residual_scale: float = 1.0  # multiplies attention's and the MLP's outputs before the residual add
    attn_scale: float | None = None  # the attention score scale; None: 1/sqrt(head_dim)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    logit_divisor: float = 1.0  # logits are divided by it
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    sliding_window: int = 0  # the window of the layers `window_layers` marks (keys with q - k < window)
    window_layers: tuple[bool, ...] = ()  # per layer: attends through the window (empty: none does)
    rope_layers: tuple[bool, ...] = ()  # per layer: applies rope (empty: every layer does)
    local_rope_theta: float | None = None  # windowed layers' rope base, unscaled (None: the global rope)
    rotary_dim: int = 0  # the leading dimensions of each head that rope rotates (0: all of them)
    attn_sinks: bool = False  # a learned logit per query head joins each softmax's denominator (gpt-oss)
    # Llama 4's attention temperature (Ministral 3): queries at position p scaled by 1 + attn_temperature
    # * log(1 + floor(p / temperature_length)), exactly 1 within the first temperature_length positions.
    attn_temperature: float = 0.0
    temperature_length: int = 0
    o_bias: bool = False  # the output projection has a bias (gpt-oss)
    layer_norm: bool = False  # every norm a LayerNorm without bias: the row's mean subtracted first (Cohere)
    # Cohere's parallel block: attention and the MLP both read the layer's input through the attention norm, and
    # their outputs join the residual together (x + attention + MLP, in that order).
    parallel: bool = False
    # The checkpoint's Q/K rows rotate adjacent pairs (a GLM or ERNIE Hugging Face checkpoint): the loader puts them
    # in rotate-half order (families.py `hf_interleaved_qk`). Not a switch: the runtime never sees such rows.
    qk_rows_interleaved: bool = False
    # Mixture of experts (runtime/experts.py; 0 experts: the dense MLP of `intermediate_size`).
    experts: int = 0  # experts a layer holds
    experts_used: int = 0  # experts a token runs (top-k)
    expert_ff: int = 0  # each expert's MLP width
    shared_ff: int = 0  # the width of a shared expert every token runs (0: none)
    shared_gate: bool = True  # the shared expert joins under a sigmoid gate (Qwen2-MoE), else as it is (ERNIE 4.5)
    router: str = "softmax_topk"  # how the top-k experts are weighted (experts.WEIGHTINGS)
    expert_act: str = "silu"  # the experts' gated activation (experts.ACTIVATIONS)
    # per layer: holds experts (empty: every layer does); the others a dense MLP of intermediate_size (ERNIE 4.5)
    expert_layers: tuple[bool, ...] = ()
    # LFM2's short convolutions: per layer, a gated causal depthwise convolution over the last `conv_kernel` tokens
    # in place of attention (empty: every layer attends); its state is the last conv_kernel - 1 tokens' inputs,
    # which the cache keeps as a windowed layer's (kv_cache.py), so a tree's rows and a rewind stay exact.
    conv_layers: tuple[bool, ...] = ()
    conv_kernel: int = 0

    def conv(self, layer: int) -> bool:
        """Whether layer `layer` is a short convolution (LFM2) rather than attention."""
        return bool(self.conv_layers) and self.conv_layers[layer]

    @property
    def cache_windows(self) -> tuple[tuple[bool, ...], int]:
        """(per-layer flags, window) of the layers whose cache keeps only a window of tokens: the sliding-window
        layers, or the short convolutions (their state: the last `conv_kernel` tokens' inputs)."""
        if self.conv_layers:
            return self.conv_layers, self.conv_kernel
        return self.window_layers, self.sliding_window

    def expert_layer(self, layer: int) -> bool:
        """Whether layer `layer` holds experts (else a dense MLP)."""
        return self.experts > 0 and (not self.expert_layers or self.expert_layers[layer])

    @property
    def plain(self) -> bool:
        """Whether the model is the Llama block with none of the switches set but per-layer ropes
        (a rope of the windowed layers' own, none on some): the folded per-layer kernels implement
        exactly that, each layer rotating with its rope's table (other families run their switches
        between the same kernels; the whole-step call takes them all: `stepped`)."""
        defaults = {f.name: f.default for f in fields(self) if f.name in _SWITCHES - _ROPE_SWITCHES}
        return self.qk_norm != "full" and self == replace(self, **defaults)

    @property
    def stepped(self) -> bool:
        """Whether decode steps take the whole-step C++ call (fused_step.py): every family whose MLP
        activation it runs, expert layers included (gpt-oss's sinks, biases and clamped SwiGLU,
        Qwen2-MoE's shared expert) and Gemma 2's soft-capped scores (core/step.h)."""
        return self.activation in ("silu", "gelu_tanh")

    def switches(self) -> dict[str, Any]:
        """The family switches this model sets (those that differ from Llama's), by field name."""
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name in _SWITCHES and getattr(self, f.name) != f.default}
        if self.qk_norm:
            out["qk_norm"] = self.qk_norm
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
        return out

    def describe(self) -> str:
        """The family and what runs, in one line (`models inspect`)."""
        s = self.switches()
        parts = []
        if self.window_layers:
            parts.append(f"{sum(self.window_layers)} of {self.num_layers} layers windowed ({self.sliding_window})")
        if self.rope_layers:
            parts.append(f"{self.num_layers - sum(self.rope_layers)} layers without rope")
        if self.conv_layers:
            parts.append(f"{sum(self.conv_layers)} of {self.num_layers} layers short convolutions ({self.conv_kernel} "
                         "tokens)")

        def text(v: Any) -> str:
            return "+".join(v) if isinstance(v, tuple) else f"{v:.6g}" if isinstance(v, float) else str(v)

        if self.experts:
            shared = f", a{'' if self.shared_gate else 'n ungated'} shared expert ({self.shared_ff})" \
                if self.shared_ff else ""
            dense = self.num_layers - sum(self.expert_layer(i) for i in range(self.num_layers))
            dense_text = f", {count(dense, 'dense layer')} ({self.intermediate_size})" if dense else ""
            parts.append(f"{self.experts} experts ({self.expert_ff}), {self.experts_used} a token, router "
                         f"{self.router}, {self.expert_act}{shared}{dense_text}")
        skip = {"window_layers", "sliding_window", "rope_layers", "conv_layers", "conv_kernel", *_EXPERT_SWITCHES}
        parts += [k if v is True else f"{k} {text(v)}" for k, v in s.items() if k not in skip]  # a set flag: its name
        step = ("the whole-step C++ call for decode steps, the per-layer kernels for prefill" if self.stepped
                else f"the per-layer kernels (the whole-step C++ call does not run {self.activation})")
        return f"{self.arch}{': ' + ', '.join(parts) if parts else ''}; quantized weights run {step}"

    @property
    def longest(self) -> int:
        """The most positions `with_context` allows."""
        return self.context_limit or self.max_position

    @property
    def long_rope(self) -> bool:
        """Whether LongRoPE runs its long factors: the context exceeds its original window (as llama.cpp
        chooses by the context it is given; transformers by each sequence's length, which agrees on a
        sequence longer than the window)."""
        return self._longrope and self.max_position > int(self.rope_scaling["original_max_position_embeddings"])

    @property
    def _longrope(self) -> bool:
        return self.rope_scaling is not None and self.rope_scaling.get("rope_type") == "longrope"

    def with_context(self, tokens: int | None) -> ModelConfig:
        """The model serving sequences of at most `tokens` positions (prompt and answer; None: its
        default). UserError beyond what the file allows."""
        if tokens is None:
            return self
        check_context(tokens)
        if tokens > self.longest:
            raise UserError(f"--max-context {tokens:,} is beyond the model's {self.longest:,} positions")
        return replace(self, max_position=tokens)

    def context_note(self) -> str:
        """What a longer context would take, where the file allows one ('' otherwise)."""
        if self.longest <= self.max_position:
            return ""
        why = " (LongRoPE's long factors)" if self._longrope else ""
        return f"the file allows up to {self.longest:,} with --max-context{why}"

    @property
    def windowed_layers(self) -> int:
        """The layers whose cache keeps a window of tokens (`cache_windows`)."""
        flags, window = self.cache_windows
        return sum(flags) if window else 0

    def kv_bytes_per_token(self, row_bytes: int | None = None) -> int:
        """What a token of context costs in the KV cache past the windows: keys and values of the
        layers that attend to every token (a target's windowed layers keep a fixed number,
        `kv_bytes`). `row_bytes`: one head's K or V row (default bfloat16, the quantized runtime's)."""
        row = 2 * self.head_dim if row_bytes is None else row_bytes
        return (self.num_layers - self.windowed_layers) * 2 * self.num_kv_heads * row

    def kv_bytes(self, tokens: int, room: int | None, row_bytes: int | None = None) -> int:
        """What `tokens` of context cost in the KV cache: every token on the layers that attend to
        all of them, and on the windowed layers at most the window and `room` (None: every token); a
        short convolution's slot is one float32 row of the hidden size."""
        row = 2 * self.head_dim if row_bytes is None else row_bytes
        kept = tokens if room is None else min(tokens, self.cache_windows[1] + room)
        slot = CONV_STATE_BYTES * self.hidden_size if self.conv_layers else 2 * self.num_kv_heads * row
        return self.kv_bytes_per_token(row) * tokens + self.windowed_layers * slot * kept

    def windowed(self, layer: int) -> bool:
        return bool(self.window_layers) and self.window_layers[layer]

    def rope_kind(self, layer: int) -> int:
        """Which rope layer `layer` applies: 0 the global one, 1 the windowed layers' own, -1 none (a NoPE layer, a
        short convolution)."""
        if (self.rope_layers and not self.rope_layers[layer]) or self.conv(layer):
            return -1
        return 1 if self.local_rope_theta is not None and self.windowed(layer) else 0

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict; refuse architectures we do not implement."""
        archs = d.get("architectures") or []
        family = family_of(d)
        arch = None if family is None else family.name
        if arch is None:
            name = ", ".join(archs) or d.get("model_type") or "unknown"
            raise UserError(f"unsupported model architecture {name}; supported families: {supported()}")
        # transformers 5 folds rope settings into `rope_parameters`; older configs use top-level keys. A
        # family with a rope a layer type (Gemma 3, OLMo 3) has the global layers' as the model's: its switches
        # say what its windowed layers take.
        rope = dict(d.get("rope_parameters") or {})
        rope = dict(rope.get("full_attention") or {}) if "full_attention" in rope else rope
        scaling = d.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", rope.get("type", "default")) != "default":
            scaling = rope
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3", "longrope", "su", "yarn"):
                raise UserError(f"unsupported RoPE scaling {kind!r} (supported: default, linear, llama3, longrope, "
                                "yarn)")
            if kind == "default":
                scaling = None
            elif kind == "yarn":
                scaling = yarn_scaling(scaling, rope, int(d.get("max_position_embeddings", 4096)))
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        max_pos = int(d.get("max_position_embeddings", 4096))
        # Mistral v0.1 attends through a sliding window; we attend fully, so stay inside it.
        if d.get("sliding_window") and d.get("use_sliding_window", arch == "mistral"):
            max_pos = min(max_pos, int(d["sliding_window"]))
        base = cls(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d.get("intermediate_size") or 0),  # LFM2's: its switches say
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            qk_norm="",
            rope_scaling=scaling,
        )
        interleaved = family.hf_interleaved_qk and d.get(QK_ROWS_KEY) != ROTATE_HALF
        return replace(base, qk_rows_interleaved=interleaved, **FAMILIES[arch].switches(d))


def yarn_scaling(scaling: dict[str, Any], rope: dict[str, Any], max_position: int) -> dict[str, Any]:
    """YaRN's settings with transformers' defaults filled in (_compute_yarn_parameters): the
    original window (else the model's), beta_fast 32, beta_slow 1, `truncate` (read, as transformers
    reads it, from the top-level rope parameters; true unless set) and the attention factor that
    multiplies cos and sin (from `factor`, or `mscale` over `mscale_all_dim` where both are set)."""
    out = dict(scaling)
    factor = out.get("factor")
    original = int(out.get("original_max_position_embeddings") or max_position)
    factor = float(factor) if factor is not None else max_position / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = out.get("attention_factor")
    if attention is None:
        m, m_all = out.get("mscale"), out.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    out.update(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
               beta_fast=float(out.get("beta_fast") or 32), beta_slow=float(out.get("beta_slow") or 1),
               truncate=bool(rope.get("truncate", out.get("truncate", True))), attention_factor=float(attention))
    return out


# The fields a family sets (everything after the sizes): `plain` compares them with the defaults.
_SWITCHES = frozenset({"norms", "norm_plus_one", "activation", "embed_scale", "residual_scale", "attn_scale",
                       "attn_softcap", "logit_divisor", "final_softcap", "sliding_window", "window_layers",
                       "rope_layers", "local_rope_theta", "rotary_dim", "attn_sinks", "attn_temperature", "o_bias",
                       "layer_norm", "parallel",
                       "experts", "experts_used", "expert_ff", "shared_ff", "shared_gate", "router", "expert_act",
                       "expert_layers", "conv_layers", "conv_kernel"})
# The expert layer's switches (the folded per-layer kernels have no expert layer: `plain` is False with them).
_EXPERT_SWITCHES = frozenset({"experts", "experts_used", "expert_ff", "shared_ff", "shared_gate", "router",
                              "expert_act", "expert_layers"})
# The switches the plain block takes as per-layer rope tables.
_ROPE_SWITCHES = frozenset({"rope_layers", "local_rope_theta"})
