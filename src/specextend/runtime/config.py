"""What a model is, read from its Hugging Face `config.json`: the architecture and the sizes the
runtime builds (`ModelConfig`), and the architectures the runtime implements (`SUPPORTED_ARCHS`).
No torch here: a config is read before anything is loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..common.errors import UserError

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


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
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict; refuse architectures we do not implement."""
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None and d.get("model_type") in SUPPORTED_ARCHS.values():
            arch = d["model_type"]
        if arch is None:
            name = ", ".join(archs) or d.get("model_type") or "unknown"
            raise UserError(
                f"unsupported model architecture {name}; supported: {', '.join(sorted(SUPPORTED_ARCHS))}"
            )
        # transformers 5 folds rope settings into `rope_parameters`; older configs use top-level keys.
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling") or None
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise UserError(f"unsupported RoPE scaling {kind!r} (supported: default, linear, llama3)")
            if kind == "default":
                scaling = None
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        max_pos = int(d.get("max_position_embeddings", 4096))
        # Mistral v0.1 attends through a sliding window; we attend fully, so stay inside it.
        if d.get("sliding_window") and d.get("use_sliding_window", arch == "mistral"):
            max_pos = min(max_pos, int(d["sliding_window"]))
        return cls(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            rope_scaling=scaling,
        )
