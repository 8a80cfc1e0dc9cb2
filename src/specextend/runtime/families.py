"""Model families: what each architecture changes in the one shared decoder (layers.py), as data.

A family is a handful of switches over the Llama-style block: where the norms sit, the activation,
multipliers on the embedding, residual, attention scores and logits, soft-capping, per-layer
attention windows, rope bases and layers without rope, and per-head or whole-projection q/k norms.
`Family.switches` reads them from a Hugging Face `config.json` into `ModelConfig` fields
(config.py); `Family` also says how llama.cpp's converter wrote the family into a GGUF
(`gguf_*`), which models/gguf.py reads to rebuild the Hugging Face config and tensor names.
Adding a family is one entry here (and, where a switch is new, its few lines in layers.py).

No torch here: a config is read before anything is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..common.errors import UserError

# The HF norm names of a block, by placement: before attention (`attn_norm`), on attention's output
# (`attn_out_norm`), before the MLP (`mlp_norm`), on the MLP's output (`mlp_out_norm`).
PRE_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
POST_NORMS = {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}



# GLM-4's sandwich: its pre-MLP norm keeps the pre-norm blocks' name, its output norms have their own.
GLM_NORMS = {"attn_norm": "input_layernorm", "attn_out_norm": "post_self_attn_layernorm",
             "mlp_norm": "post_attention_layernorm", "mlp_out_norm": "post_mlp_layernorm"}


def hf_norm_names(norms: tuple[str, ...], arch: str = "") -> dict[str, str]:
    """Block norm placement -> the HF module name of a layer's norm, for the placements `norms` has
    (HF reuses `post_attention_layernorm` for the pre-MLP norm of pre-norm blocks; `arch`'s family
    may name its norms otherwise: `Family.hf_norms`)."""
    family = FAMILIES.get(arch)
    table = family.hf_norms if family is not None and family.hf_norms else \
        SANDWICH_NORMS if "attn_norm" in norms and "attn_out_norm" in norms else \
        POST_NORMS if "attn_out_norm" in norms else PRE_NORMS
    return {n: table[n] for n in norms}


# A converted GGUF's config.json key (ours; transformers keeps it as an unused attribute): its Q/K rows are in
# rotate-half order already (`Family.hf_interleaved_qk`), where a Hugging Face checkpoint's are not.
QK_ROWS_KEY, ROTATE_HALF = "qk_rows", "rotate_half"

GgufKey = Callable[..., Any]  # `key(name, default)`: the GGUF metadata value `<arch>.<name>`


@dataclass(frozen=True)
class Family:
    name: str  # our name and the GGUF `general.architecture`
    hf_class: str  # the HF `architectures` entry
    # ModelConfig switches from a HF config dict (config.py applies them over the Llama defaults).
    switches: Callable[[dict[str, Any]], dict[str, Any]] = lambda d: {}
    # GGUF: llama.cpp interleaves the rotary halves of Q/K rows (the families it ropes the "norm" way).
    gguf_permuted_qk: bool = False
    # GGUF: what llama.cpp's converter added to every `*norm.weight` (Gemma's 1 + w norms).
    gguf_norm_shift: float = 0.0
    # GGUF layer tensor -> HF module, where the family's differs from the Llama mapping.
    gguf_tensors: dict[str, str] = field(default_factory=dict)
    # GGUF metadata -> HF config keys the family needs beyond the common ones.
    gguf_config: Callable[[GgufKey, dict[str, Any]], dict[str, Any]] = lambda key, cfg: {}
    # Tokens that end a turn in this family's chat models, besides the file's own EOS id.
    eos_tokens: tuple[str, ...] = ()
    rms_eps_default: float = 1e-6
    hf_model_type: str = ""  # the HF model_type, where it is not `name`
    # The HF checkpoints rotate adjacent pairs of each head's Q/K rows (GLM's and ERNIE's rope; llama.cpp's
    # "norm" rope, its files holding the rows as HF does). The runtime ropes rotate-half, which is the same
    # product once both Q's and K's rows of a head are put in rotate-half order: the loader reorders them
    # (models/gguf.py `rotate_half_order`), and a converted GGUF's folder holds them reordered already.
    hf_interleaved_qk: bool = False
    hf_norms: dict[str, str] = field(default_factory=dict)  # placement -> HF norm name, where not the usual
    # Llama's HF tensor names -> the family's, where its checkpoints name the same weights otherwise (the loader asks
    # for Llama's names).
    hf_names: dict[str, str] = field(default_factory=dict)
    # GGUF: a layer of 0 KV heads (`attention.head_count_kv` an array) is a short convolution (LFM2).
    gguf_conv_layers: bool = False

    @property
    def model_type(self) -> str:
        return self.hf_model_type or self.name


def _qwen2(d: dict[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(d.get("attention_bias", True))}


def _granite(d: dict[str, Any]) -> dict[str, Any]:
    return {"embed_scale": float(d.get("embedding_multiplier", 1.0)),
            "residual_scale": float(d.get("residual_multiplier", 1.0)),
            "attn_scale": float(d.get("attention_multiplier", 1.0)),
            "logit_divisor": float(d.get("logits_scaling", 1.0))}


def _granite_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp writes Granite's *_multiplier and logits_scaling under *_scale names.
    return {"embedding_multiplier": float(key("embedding_scale", 1.0)),
            "residual_multiplier": float(key("residual_scale", 1.0)),
            "attention_multiplier": float(key("attention.scale", 1.0)),
            "logits_scaling": float(key("logit_scale", 1.0))}


def _smollm3(d: dict[str, Any]) -> dict[str, Any]:
    n = int(d["num_hidden_layers"])
    # no_rope_layers[i] is 1 where layer i uses rope (HF's naming); the default drops every 4th.
    uses = d.get("no_rope_layers") or [int((i + 1) % int(d.get("no_rope_layer_interval", 4)) != 0) for i in range(n)]
    return {"rope_layers": tuple(bool(u) for u in uses)}


def _smollm3_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp's converter writes no NoPE metadata: its runtime drops rope on every 4th layer.
    n = int(cfg["num_hidden_layers"])
    return {"no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n)]}


def _legacy_scaling(cfg: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """The top-level `rope_scaling` a config built from a GGUF carries (which config.py reads first), made the
    rope a family's keys completed: where the config has one at all."""
    return {"rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}} if cfg.get("rope_scaling") else {}


_OLMO2 = {"norms": ("attn_out_norm", "mlp_out_norm"), "qk_norm": "full"}  # norms after, q/k norms over all heads


def _windowed(d: dict[str, Any], every: int, first: bool = False) -> tuple[int, tuple[bool, ...]]:
    """(window, per-layer flags) of a config's sliding-window layers: HF's `layer_types`, by default all but every
    `every`-th layer (the last of each period; with `first`, the first); none where no window is set."""
    n = int(d["num_hidden_layers"])
    window = int(d.get("sliding_window") or 0)
    types = d.get("layer_types") or ["full_attention" if (i if first else i + 1) % every == 0 else "sliding_attention"
                                     for i in range(n)]
    return window, tuple(window > 0 and t == "sliding_attention" for t in types)


def _olmo3(d: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3: OLMo 2's block with windowed layers (HF's `layer_types`; by default all but every 4th) whose
    rope is never scaled (transformers' and llama.cpp's); the global layers take the model's rope, YaRN in
    the long-context models."""
    window, windowed = _windowed(d, 4)
    rope = d.get("rope_parameters") or {}
    local, glob = rope.get("sliding_attention") or {}, rope.get("full_attention") or rope
    theta = local.get("rope_theta") or glob.get("rope_theta") or d.get("rope_theta") or 10_000.0  # config.py's default
    out: dict[str, Any] = {**_OLMO2, "sliding_window": window, "window_layers": windowed}
    if any(windowed):
        out["local_rope_theta"] = float(theta)
    return out


def _olmo3_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's OLMo 3 keys (its olmo2 files with a window): the windowed layers as a list or a period (by
    default 4: all but every 4th layer), their rope base where the file has one; YaRN's attention factor."""
    n = int(cfg["num_hidden_layers"])
    pattern = key("attention.sliding_window_pattern", 4)
    windowed = [bool(x) for x in pattern] if isinstance(pattern, list) else [i % int(pattern) < int(pattern) - 1
                                                                             for i in range(n)]
    if len(windowed) != n:
        raise UserError(f"an OLMo 3 GGUF whose sliding_window_pattern has {len(windowed)} layers, not {n}")
    glob = dict(cfg["rope_parameters"])
    if glob.get("rope_type") == "yarn" and key("rope.scaling.attn_factor") is not None:
        glob["attention_factor"] = float(key("rope.scaling.attn_factor"))
    local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", glob["rope_theta"]))}
    out = {"sliding_window": int(key("attention.sliding_window")),
           "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
           "rope_parameters": {"full_attention": glob, "sliding_attention": local}}
    return {**out, **_legacy_scaling(cfg, glob)}


# llama.cpp's names of the norms on attention's and the MLP's outputs (OLMo 2, Gemma).
_POST_NORM_TENSORS = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

def _gemma(d: dict[str, Any], pattern: int) -> dict[str, Any]:
    """Gemma 2 and 3: sandwich norms with (1 + weight), GeGLU, the embeddings scaled by sqrt(hidden),
    the query scale from query_pre_attn_scalar, soft-capping where set, and sliding-window layers
    (HF's `layer_types`; by default all but every `pattern`-th layer)."""
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UserError(f"unsupported Gemma activation {act!r} (supported: gelu_pytorch_tanh)")
    window, windowed = _windowed(d, pattern)
    softcap = d.get("attn_logit_softcapping")
    final = d.get("final_logit_softcapping")
    for name, cap in (("attn_logit_softcapping", softcap), ("final_logit_softcapping", final)):
        if cap is not None and not (isinstance(cap, int | float) and 0 <= cap < float("inf")):
            raise UserError(f"{name} must be a positive number (or 0 / absent: no cap), not {cap!r}")
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    return {"norms": tuple(SANDWICH_NORMS), "norm_plus_one": True, "activation": "gelu_tanh",
            "embed_scale": float(d["hidden_size"]) ** 0.5,
            "attn_scale": float(d.get("query_pre_attn_scalar") or head_dim) ** -0.5,
            "attn_softcap": float(softcap) if softcap else None, "final_softcap": float(final) if final else None,
            "sliding_window": window, "window_layers": windowed}


def _gemma2(d: dict[str, Any]) -> dict[str, Any]:
    return _gemma(d, 2)


def _gemma3(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 adds per-head q/k norms and a rope of its own on the windowed layers (base 10K,
    unscaled); the global layers' rope may be linearly scaled."""
    out = {**_gemma(d, int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)),
           "qk_norm": "head"}
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope:  # transformers 5: one rope per layer type
        glob, loc = dict(rope["full_attention"]), dict(rope.get("sliding_attention") or {})
    else:
        glob = {"rope_theta": d.get("rope_theta", 1_000_000.0), **(d.get("rope_scaling") or {})}
        loc = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    kind = glob.get("rope_type", glob.get("type", "default"))
    if kind not in ("default", "linear") or loc.get("rope_type", "default") != "default":
        raise UserError(f"unsupported Gemma 3 RoPE scaling {kind!r} (supported: default, linear)")
    out["rope_theta"] = float(glob.get("rope_theta", 1_000_000.0))
    out["rope_scaling"] = {"rope_type": "linear", "factor": float(glob["factor"])} if kind == "linear" else None
    out["local_rope_theta"] = float(loc.get("rope_theta", 10_000.0))
    return out


def _gemma_query_scalar(key: GgufKey, cfg: dict[str, Any], big: int) -> int:
    # llama.cpp keeps no query_pre_attn_scalar: it scales by 1/sqrt(head_dim), except for the 27B
    # models (known by their layer count), which take hidden / heads.
    if int(cfg["num_hidden_layers"]) == big:
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return int(cfg["head_dim"])


def _gemma2_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_query_scalar(key, cfg, 46),
            "sliding_window": int(key("attention.sliding_window", 4096)),
            "layer_types": ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)],
            "attn_logit_softcapping": key("attn_logit_softcapping"),
            "final_logit_softcapping": key("final_logit_softcapping")}


def _gemma3_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp fixes what its converter does not write: 5 windowed layers to 1 global, and the
    # windowed layers' rope base 10K, unscaled.
    n = int(cfg["num_hidden_layers"])
    window = key("attention.sliding_window")
    glob = dict(cfg["rope_parameters"])
    return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma_query_scalar(key, cfg, 62),
            "sliding_window": int(window) if window else None,
            "layer_types": ["sliding_attention" if window and (i + 1) % 6 else "full_attention" for i in range(n)],
            "final_logit_softcapping": key("final_logit_softcapping"), "attn_logit_softcapping": None,
            "rope_parameters": {"full_attention": glob,
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}


def _rotary_dim(d: dict[str, Any]) -> dict[str, Any]:
    """The rotated leading dimensions of each head, where a config rotates only part of it."""
    rope = d.get("rope_parameters") or {}
    head_dim = int(d.get("head_dim") or int(d["hidden_size"]) // int(d["num_attention_heads"]))
    partial = float(d.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0)
    return {"rotary_dim": int(head_dim * partial)} if partial < 1.0 else {}


def _phi3(d: dict[str, Any]) -> dict[str, Any]:
    """Phi-3, 3.5 and 4-mini: the Llama block with fused projections (the loader reads them as they
    are), a sliding window on every layer where set, partial rotary dimensions (Phi-4-mini) and
    LongRoPE. LongRoPE's short factors serve contexts up to the original window and its long
    factors beyond; transformers switches between them with each sequence's length, llama.cpp by
    the context it is given. So do we (`ModelConfig.long_rope`): the default context is the
    original window (exact against both there), and `--max-context` up to the file's own takes the long
    factors (exact against transformers on sequences longer than the window)."""
    rope = dict(d.get("rope_parameters") or {})
    out: dict[str, Any] = _rotary_dim(d)
    scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    context = int(d.get("max_position_embeddings", 4096))
    window = int(d.get("sliding_window") or 0)
    if scaling is None:
        if 0 < window < context:
            out.update(sliding_window=window, window_layers=(True,) * int(d["num_hidden_layers"]))
        return out
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("longrope", "su"):
        raise UserError(f"unsupported Phi-3 RoPE scaling {kind!r} (supported: longrope)")
    original = int(scaling.get("original_max_position_embeddings") or d["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or int(d["max_position_embeddings"]) / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    out["rope_scaling"] = {"rope_type": "longrope", "short_factor": [float(x) for x in scaling["short_factor"]],
                           "long_factor": [float(x) for x in scaling["long_factor"]],
                           "original_max_position_embeddings": original, "attention_factor": float(attention)}
    out["max_position"] = min(context, original)
    out["context_limit"] = context
    if 0 < window < context:
        out.update(sliding_window=window, window_layers=(True,) * int(d["num_hidden_layers"]))
    return out


def _rope_dims_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """A file's rotated dimensions a head (`rope.dimension_count`) as transformers' partial_rotary_factor, at the top
    level and in the rope parameters (where transformers 5 reads it), where fewer than the head's."""
    dims = key("rope.dimension_count")
    if not dims or int(dims) == int(cfg["head_dim"]):
        return {}
    factor = int(dims) / int(cfg["head_dim"])
    rope = {**cfg["rope_parameters"], "partial_rotary_factor": factor}
    return {"partial_rotary_factor": factor, "rope_parameters": rope}


def _phi3_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_parameters": dict(cfg["rope_parameters"]),
                           "sliding_window": int(key("attention.sliding_window", 0)) or None,
                           **_rope_dims_gguf(key, cfg)}  # Phi-4-mini's partial rotary
    original = key("rope.scaling.original_context_length")
    if original:
        out["original_max_position_embeddings"] = int(original)
    return out


def _ernie4_5(d: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5 (dense): the Llama block, its rope on adjacent pairs (`hf_interleaved_qk`); biases on no released
    model, and the MLP's would have nowhere to go."""
    if d.get("use_bias"):
        raise UserError("an ERNIE 4.5 config with use_bias is not supported (no released model has biases)")
    return {}


def _glm4(d: dict[str, Any]) -> dict[str, Any]:
    """GLM-4 (0414): sandwich norms (GLM's names: `hf_norms`), biases on q/k/v, the fused gate-up projection (the
    loader reads it as it is), rope on adjacent pairs of the leading half of each head."""
    return {"norms": tuple(GLM_NORMS), "attention_bias": bool(d.get("attention_bias", True)), **_rotary_dim(d)}


def _exaone4(d: dict[str, Any]) -> dict[str, Any]:
    """EXAONE 4.0: OLMo 2's norms after attention and the MLP, per-head q/k norms, and where a window is set (the 32B)
    windowed layers (HF's `layer_types`; by default all but every `sliding_window_pattern`-th) with rope, the
    global layers without (NoPE), as transformers' Exaone4Attention ropes only windowed layers once a window is set."""
    n = int(d["num_hidden_layers"])
    window = int(d.get("sliding_window") or 0)
    pattern = d.get("sliding_window_pattern")
    types = d.get("layer_types")
    if types is None:
        every = int(pattern) if isinstance(pattern, int) and window else 0
        types = ["sliding_attention" if every and (i + 1) % every else "full_attention" for i in range(n)]
    out: dict[str, Any] = {"norms": ("attn_out_norm", "mlp_out_norm"), "qk_norm": "head"}
    if window:
        windowed = tuple(t == "sliding_attention" for t in types)
        out.update(sliding_window=window, window_layers=windowed, rope_layers=windowed)
    return out


def _exaone4_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp windows an EXAONE 4.0 file only where it has 64 layers (the 32B): all but every 4th layer, 4,096
    tokens unless the file says its window; the 1.2B attends fully with rope on every layer."""
    n = int(cfg["num_hidden_layers"])
    if n != 64:
        return {"sliding_window": None, "layer_types": ["full_attention"] * n}
    return {"sliding_window": int(key("attention.sliding_window", 4096)), "sliding_window_pattern": 4,
            "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]}


def _cohere(d: dict[str, Any]) -> dict[str, Any]:
    """Cohere (Command R, Aya): one LayerNorm without bias before a parallel block (attention and the MLP read the
    same normed input, their outputs join the residual together), rope on adjacent pairs (`hf_interleaved_qk`), the
    logits multiplied by `logit_scale` (as a divisor: 1 / 0.0625 and 1 / 0.25 are exact, the same products)."""
    if d.get("use_qk_norm"):
        raise UserError("Cohere's per-head q/k LayerNorms (use_qk_norm: Command R+) are not supported")
    scale = float(d.get("logit_scale", 0.0625))
    if not (math.isfinite(scale) and scale > 0):
        raise UserError(f"logit_scale must be a positive number, not {d.get('logit_scale')!r}")
    return {"norms": ("attn_norm",), "layer_norm": True, "parallel": True, "logit_divisor": 1.0 / scale,
            "rms_norm_eps": float(d.get("layer_norm_eps", 1e-5)), "o_bias": bool(d.get("attention_bias", False))}


def _cohere2(d: dict[str, Any]) -> dict[str, Any]:
    """Command R7B: Cohere's block, windowed layers (HF's `layer_types`; by default all but every
    `sliding_window_pattern`-th) that take rope and global layers that take none, as transformers' Cohere2Attention
    ropes only where a layer has a window."""
    window, windowed = _windowed(d, int(d.get("sliding_window_pattern", 4)))
    out = {**_cohere(d), "rope_layers": windowed}
    if window:
        out.update(sliding_window=window, window_layers=windowed)
    return out


def _cohere_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    return {"logit_scale": float(key("logit_scale", 1.0)), "layer_norm_eps": float(key("attention.layer_norm_epsilon",
                                                                                          1e-5))}


def _cohere2_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    # llama.cpp fixes the pattern its converter does not write: 3 windowed layers to 1 global.
    n = int(cfg["num_hidden_layers"])
    window = key("attention.sliding_window")
    return {**_cohere_gguf(key, cfg), "sliding_window": int(window) if window else None,
            "layer_types": ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]}


def _seed_oss(d: dict[str, Any]) -> dict[str, Any]:
    """Seed-OSS (ByteDance): the Llama block with biases on q/k/v (`attention_bias`) and on the output projection
    where set (`attention_out_bias`); the MLP's biases (`mlp_bias`, off in the released model) are refused."""
    if d.get("mlp_bias"):
        raise UserError("a Seed-OSS config with MLP biases (mlp_bias) is not supported")
    return {"attention_bias": bool(d.get("attention_bias", True)), "o_bias": bool(d.get("attention_out_bias", False))}


def _lfm2(d: dict[str, Any]) -> dict[str, Any]:
    """LFM2: pre-norm blocks whose mixer is attention with per-head q/k norms on a few layers (HF's `layer_types`,
    or the older configs' `full_attn_idxs`) and a gated short convolution on the others; tied embeddings, the MLP's
    width from `block_ff_dim` through the adjustment transformers' Lfm2MLP applies."""
    ff = int(d.get("block_ff_dim") or d.get("intermediate_size") or 0)
    if d.get("block_auto_adjust_ff_dim", True):
        ff = int(2 * ff / 3)
        if d.get("block_ffn_dim_multiplier") is not None:
            ff = int(float(d["block_ffn_dim_multiplier"]) * ff)
            multiple = int(d.get("block_multiple_of", 256))
            ff = multiple * ((ff + multiple - 1) // multiple)
    return {**_lfm2_layers(d), "intermediate_size": ff}


def _lfm2_layers(d: dict[str, Any]) -> dict[str, Any]:
    """LFM2's layers (its MoE's too): convolutions and attention layers, per-head q/k norms, tied embeddings."""
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is None:
        full = set(d.get("full_attn_idxs") or range(n))
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    if len(types) != n or not set(types) <= {"conv", "full_attention"}:
        raise UserError(f"an LFM2 config's layer_types must be {n} of conv and full_attention, not {types}")
    if d.get("conv_bias"):
        raise UserError("an LFM2 config with conv_bias is not supported (no released model has biases)")
    conv = tuple(t == "conv" for t in types)
    return {"qk_norm": "head", "rms_norm_eps": float(d.get("norm_eps", 1e-5)),
            "tie_word_embeddings": bool(d.get("tie_word_embeddings", d.get("tie_embedding", True))),
            "conv_layers": conv if any(conv) else (), "conv_kernel": int(d.get("conv_L_cache", 3)) if any(conv) else 0}


def _lfm2moe(d: dict[str, Any]) -> dict[str, Any]:
    """LFM2's MoE (LFM2-8B-A1B): LFM2's layers, the first `num_dense_layers` with a dense MLP, the others experts
    picked by their logits' sigmoids plus a selection bias and weighted by the sigmoids renormalised (transformers'
    Lfm2MoeTopKRouter, as every released model configures it)."""
    if not d.get("use_expert_bias", True) or not d.get("norm_topk_prob", True) or \
            float(d.get("routed_scaling_factor", 1.0)) != 1.0:
        raise UserError("an LFM2 MoE config without the expert bias, without renormalised weights or with a routed "
                        "scaling factor is not supported (no released model has them)")
    dense = int(d.get("num_dense_layers", 0))
    return {**_lfm2_layers(d), "intermediate_size": int(d["intermediate_size"]),
            "experts": int(d["num_experts"]), "experts_used": int(d["num_experts_per_tok"]),
            "expert_ff": int(d["moe_intermediate_size"]), "router": "sigmoid_biased_topk_norm",
            "expert_layers": tuple(i >= dense for i in range(int(d["num_hidden_layers"])))}


SIGMOID_GATING = 2  # llama.cpp's expert_gating_func for a sigmoid router (LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)


def _lfm2moe_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's LFM2 MoE keys: LFM2's, the experts' count, width and top k, the leading dense layers."""
    count = key("expert_count")
    if not count:
        raise UserError("an expert model's GGUF without expert_count")
    if int(key("expert_gating_func", SIGMOID_GATING)) != SIGMOID_GATING:
        raise UserError("an LFM2 MoE file whose router is no sigmoid is not supported (no released model has one)")
    return {**_lfm2_gguf(key, cfg), "num_experts": int(count), "num_experts_per_tok": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length")),
            "num_dense_layers": int(key("leading_dense_block_count", 0)), "use_expert_bias": True,
            "norm_topk_prob": True, "routed_scaling_factor": 1.0}


def _lfm2_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's LFM2 keys: a layer of 0 KV heads is a convolution, the MLP's width as it runs, the kernel's
    length (`shortconv.l_cache`)."""
    n = int(cfg["num_hidden_layers"])
    kv = key("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * n
    return {"layer_types": ["full_attention" if h else "conv" for h in kv], "block_auto_adjust_ff_dim": False,
            "conv_L_cache": int(key("shortconv.l_cache", 3)), "norm_eps": cfg["rms_norm_eps"], "conv_bias": False}


def _ministral3(d: dict[str, Any]) -> dict[str, Any]:
    """Ministral 3 (llama.cpp's mistral3): Mistral's block under YaRN (config.py reads it, its mscale terms
    with it) and Llama 4's attention temperature past the original window (`attn_temperature`)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    if not beta:
        return {}
    length = rope.get("original_max_position_embeddings") or d.get("original_max_position_embeddings")
    if not length:
        raise UserError("a Ministral 3 config with llama_4_scaling_beta but no original_max_position_embeddings")
    return {"attn_temperature": beta, "temperature_length": int(length)}


def _mistral3_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's mistral3 keys in transformers' terms: YaRN's betas and its mscale_all_dim (the file's
    yarn_log_multiplier; mscale 1), the temperature's beta (from the original context on, as llama.cpp)."""
    if key("expert_count"):
        raise UserError("a mistral3 GGUF with experts (Mistral Large 3) is not supported")
    rope = dict(cfg["rope_parameters"])
    if rope.get("rope_type") == "yarn":
        rope.update(beta_fast=float(key("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(key("rope.scaling.yarn_beta_slow", 1.0)),
                    mscale=1.0, mscale_all_dim=float(key("rope.scaling.yarn_log_multiplier", 1.0)))
    beta = key("attention.temperature_scale")
    if beta:
        rope["llama_4_scaling_beta"] = float(beta)
        rope.setdefault("original_max_position_embeddings", int(key("attention.temperature_length", 0)) or None)
    return {"rope_parameters": rope, **_legacy_scaling(cfg, rope)}


# --------------------------------------------------------------------------- mixtures of experts
# An expert family's MLP is runtime/experts.py's layer: a router picks `experts_used` of `experts`
# MLPs a token (weighted as `router` says: experts.WEIGHTINGS), each of width `expert_ff`, with
# `expert_act` (experts.ACTIVATIONS) and, where `shared_ff` is set, a shared expert under a
# sigmoid gate. llama.cpp's converter stacks each layer's experts into 3-D `ffn_*_exps` tensors
# ([experts, out, in] in torch order); the loader keeps them so (models/loader.py).

# GGUF layer tensors of the expert layers -> our names (the experts' stacked as the file holds them).
_EXPERT_TENSORS = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}


def _experts(d: dict[str, Any], renormalise: bool | None = None) -> dict[str, Any]:
    """The expert switches of a HF MoE config (Qwen2/3-MoE, Mixtral, OLMoE names). `renormalise`:
    whether the top-k probabilities are divided by their sum (None: the config's norm_topk_prob)."""
    if d.get("mlp_only_layers") or int(d.get("decoder_sparse_step") or 1) != 1:
        raise UserError("dense MLP layers between expert layers (mlp_only_layers, decoder_sparse_step) "
                        "are not supported yet")
    norm = bool(d.get("norm_topk_prob", False)) if renormalise is None else renormalise
    return {"experts": int(d.get("num_experts") or d["num_local_experts"]),
            "experts_used": int(d["num_experts_per_tok"]),
            "expert_ff": int(d.get("moe_intermediate_size") or d["intermediate_size"]),
            "shared_ff": int(d.get("shared_expert_intermediate_size") or 0),
            "router": "softmax_topk_norm" if norm else "softmax_topk"}


def _experts_gguf(key: GgufKey, cfg: dict[str, Any], renormalise: bool | None) -> dict[str, Any]:
    """HF expert keys from llama.cpp's `<arch>.expert_*` metadata. llama.cpp fixes per family whether
    the top-k weights are renormalised (`renormalise`; None: the file's expert_weights_norm key)."""
    count = key("expert_count")
    if not count:
        raise UserError("an expert model's GGUF without expert_count")
    norm = key("expert_weights_norm", False) if renormalise is None else renormalise
    out = {"num_experts": int(count), "num_experts_per_tok": int(key("expert_used_count")),
           "moe_intermediate_size": int(key("expert_feed_forward_length") or cfg["intermediate_size"]),
           "norm_topk_prob": bool(norm), "decoder_sparse_step": 1, "mlp_only_layers": []}
    shared = key("expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


# ERNIE 4.5's selection bias, under a layer's `mlp.` (a parameter of its own: no `.weight`).
SELECT_BIAS = "gate.moe_statics.e_score_correction_bias"


def _ernie4_5_moe(d: dict[str, Any]) -> dict[str, Any]:
    """ERNIE 4.5's MoE: the dense model's block; expert layers from `moe_layer_start_index` to
    `moe_layer_end_index`, every `moe_layer_interval`-th (the rest dense MLPs of intermediate_size); a
    softmax router whose top k are picked with a learned bias added and weighted without it, renormalised;
    its shared experts as one ungated MLP beside them."""
    n = int(d["num_hidden_layers"])
    start, interval = int(d.get("moe_layer_start_index", 1)), int(d.get("moe_layer_interval", 1))
    end = int(d.get("moe_layer_end_index", -1))
    end = n - 1 if end < 0 else end
    ff = int(d["moe_intermediate_size"])
    return {**_ernie4_5(d), "experts": int(d.get("moe_num_experts") or d["num_experts"]),
            "experts_used": int(d.get("moe_k") or d["num_experts_per_tok"]), "expert_ff": ff,
            "shared_ff": ff * int(d.get("moe_num_shared_experts") or 0), "shared_gate": False,
            "router": "softmax_biased_topk_norm",
            "expert_layers": tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n))}


def _ernie4_5_moe_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's ERNIE 4.5 MoE keys: the leading dense layers and the step between expert layers (they
    run to the last layer), the experts' counts and width, the shared experts' count."""
    if not key("expert_count"):
        raise UserError("an ERNIE 4.5 MoE GGUF without expert_count")
    return {"moe_num_experts": int(key("expert_count")), "moe_k": int(key("expert_used_count")),
            "moe_intermediate_size": int(key("expert_feed_forward_length")),
            "moe_num_shared_experts": int(key("expert_shared_count", 0)),
            "moe_layer_start_index": int(key("leading_dense_block_count", 1)),
            "moe_layer_interval": int(key("interleave_moe_layer_step", 1)),
            "moe_layer_end_index": int(cfg["num_hidden_layers"]) - 1, "use_bias": False}


def _olmoe(d: dict[str, Any]) -> dict[str, Any]:
    if d.get("clip_qkv") is not None:
        raise UserError("OLMoE with clip_qkv is not supported yet")
    return {**_experts(d), "qk_norm": "full"}


def _granitemoe(d: dict[str, Any]) -> dict[str, Any]:
    """Granite 3 MoE: Granite's multipliers over experts whose router takes the top k logits, then their softmax."""
    return {**_granite(d), **_experts(d), "router": "topk_softmax"}


def _granite_swa(d: dict[str, Any]) -> dict[str, Any]:
    """Granite SWA (IBM's granite-swash): Granite's multipliers, a sliding window on the layers HF's `layer_types`
    names (by default all but every 4th, from the first), attention sinks, and a rope base a layer
    (`layer_rope_theta`, 0: no rope), read as the global layers' base and the windowed layers' own."""
    n = int(d["num_hidden_layers"])
    window, windowed = _windowed(d, 4, first=True)
    rope = d.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    thetas = [float(t) for t in (d.get("layer_rope_theta") or [theta] * n)]
    if len(thetas) != n or len(windowed) != n:
        raise UserError(f"a Granite SWA config whose layer_types or layer_rope_theta list is not of its {n} layers")
    bases = [{t for t, w in zip(thetas, windowed, strict=True) if t and w == kind} for kind in (False, True)]
    if len(bases[0]) > 1 or len(bases[1]) > 1:
        raise UserError("a Granite SWA config with several rope bases among its global or its windowed layers is not "
                        f"supported (layer_rope_theta {sorted(set(thetas))})")
    glob = next(iter(bases[0] or bases[1] or {theta}))
    local = next(iter(bases[1]), glob)
    out = {**_granite(d), "attn_sinks": True, "rope_theta": glob,
           "rope_layers": () if all(thetas) else tuple(bool(t) for t in thetas)}
    if local != glob:
        if d.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise UserError("a Granite SWA config with a scaled rope and a windowed layers' base of their own is not "
                            "supported")
        out["local_rope_theta"] = local
    if window:
        out.update(sliding_window=window, window_layers=windowed)
    return out


def _granite_swa_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's keys: the windowed layers and the layers with rope as lists (one rope base for all)."""
    n = int(cfg["num_hidden_layers"])
    windowed, roped = key("attention.sliding_window_pattern"), key("attention.rope_pattern", [True] * n)
    if not isinstance(windowed, list) or not isinstance(roped, list) or len(windowed) != n or len(roped) != n:
        raise UserError(f"a Granite SWA GGUF whose sliding_window_pattern or rope_pattern is not a list of its {n} "
                        "layers")
    theta = float(cfg["rope_parameters"]["rope_theta"])
    return {**_granite_gguf(key, cfg), "sliding_window": int(key("attention.sliding_window")),
            "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
            "layer_rope_theta": [theta if r else 0 for r in roped]}


def _granitemoe_swa(d: dict[str, Any]) -> dict[str, Any]:
    """Granite MoE SWA: Granite SWA's attention over Granite 3 MoE's experts (its optional shared expert refused)."""
    if int(d.get("shared_intermediate_size") or 0):
        raise UserError("a Granite MoE SWA config with a shared expert (shared_intermediate_size) is not supported")
    return {**_granite_swa(d), **_experts(d), "router": "topk_softmax"}


def _local_experts_gguf(key: GgufKey, cfg: dict[str, Any], renormalise: bool | None) -> dict[str, Any]:
    """`_experts_gguf` in the keys of the configs that name their experts `num_local_experts` and their width
    `intermediate_size` (Mixtral, Granite MoE)."""
    out = _experts_gguf(key, cfg, renormalise)
    return {"num_local_experts": out.pop("num_experts"), **out, "intermediate_size": out["moe_intermediate_size"]}


def _granitemoe_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    # its router's weights, a softmax of the top k, need no renormalising
    return {**_granite_gguf(key, cfg), **_local_experts_gguf(key, cfg, None)}


def _mixtral_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    return _local_experts_gguf(key, cfg, True)  # Mixtral always renormalises its top 2


def _gpt_oss(d: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: biases on q/k/v and o, attention sinks (a learned logit a head), sliding-window
    attention on alternating layers (HF's `layer_types`; by default the even ones), YaRN rope (read
    by config.py), and experts in every layer: a router with a bias, top-k then softmax over the
    chosen, biases on the experts' projections and the clamped SwiGLU (`swiglu_oai`)."""
    if (float(d.get("swiglu_alpha", 1.702)), float(d.get("swiglu_limit", 7.0))) != (1.702, 7.0):
        raise UserError("a gpt-oss config with a SwiGLU alpha or limit other than 1.702 and 7.0 is not supported")
    window, windowed = _windowed(d, 2)
    return {**_experts(d), "router": "topk_softmax", "expert_act": "swiglu_oai",
            "attention_bias": bool(d.get("attention_bias", True)), "o_bias": bool(d.get("attention_bias", True)),
            "attn_sinks": True, "sliding_window": window,
            "window_layers": windowed}


def _gpt_oss_gguf(key: GgufKey, cfg: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's gpt-oss keys: the experts' counts and width, the window on the even layers (as
    llama.cpp sets them), YaRN without truncating its ramp (transformers' gpt-oss default)."""
    n = int(cfg["num_hidden_layers"])
    window = key("attention.sliding_window")
    out = {"num_local_experts": int(key("expert_count")), "num_experts_per_tok": int(key("expert_used_count")),
           "intermediate_size": int(key("expert_feed_forward_length") or cfg["intermediate_size"]),
           "sliding_window": int(window) if window else None, "attention_bias": True,
           "layer_types": ["sliding_attention" if window and (i + 1) % 2 else "full_attention" for i in range(n)]}
    for name in ("rope_parameters", "rope_scaling"):
        if cfg.get(name, {}).get("rope_type") == "yarn":
            out[name] = {**cfg[name], "truncate": False}
    return out


# llama.cpp's names of Gemma's four norms (its `ffn_norm` is the pre-MLP norm, as for Llama).
_GEMMA_TENSORS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}

# LFM2's names: its block's norms, its final norm ("embedding_norm"), attention's output and q/k norms, the MLP, the
# convolution.
_LFM2_NORMS = {"attn_norm": "operator_norm", "mlp_norm": "ffn_norm"}
_LFM2_NAMES = {"self_attn.o_proj.": "self_attn.out_proj.", "self_attn.q_norm.": "self_attn.q_layernorm.",
               "self_attn.k_norm.": "self_attn.k_layernorm.", "mlp.gate_proj.": "feed_forward.w1.",
               "mlp.up_proj.": "feed_forward.w3.", "mlp.down_proj.": "feed_forward.w2.",
               "model.norm.": "model.embedding_norm."}
_LFM2_TENSORS = {"attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_output": "self_attn.out_proj",
                 "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
                 "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
                 "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                 "shortconv.out_proj": "conv.out_proj", "token_embd_norm.weight": "model.embedding_norm.weight"}

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", "LlamaForCausalLM", gguf_permuted_qk=True, rms_eps_default=1e-5,
           eos_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")),
    Family("mistral", "MistralForCausalLM", gguf_permuted_qk=True, rms_eps_default=1e-5),
    Family("mistral3", "Ministral3ForCausalLM", _ministral3, gguf_permuted_qk=True, gguf_config=_mistral3_gguf,
           rms_eps_default=1e-5, hf_model_type="ministral3"),
    Family("qwen2", "Qwen2ForCausalLM", _qwen2, eos_tokens=("<|im_end|>", "<|endoftext|>")),
    Family("qwen3", "Qwen3ForCausalLM", lambda d: {"qk_norm": "head"}, eos_tokens=("<|im_end|>", "<|endoftext|>")),
    Family("granite", "GraniteForCausalLM", _granite, gguf_permuted_qk=True, gguf_config=_granite_gguf,
           eos_tokens=("<|end_of_text|>", "<|end_of_role|>")),
    Family("granite_swa", "GraniteSWAForCausalLM", _granite_swa, gguf_permuted_qk=True, gguf_config=_granite_swa_gguf,
           gguf_tensors={"attn_sinks": "self_attn.sinks"}, eos_tokens=("<|end_of_text|>", "<|end_of_role|>")),
    # llama.cpp files it under granite_swa; its experts tell it apart (models/gguf.py).
    Family("granitemoe_swa", "GraniteMoeSWAForCausalLM", _granitemoe_swa, gguf_permuted_qk=True,
           gguf_config=lambda key, cfg: {**_granite_swa_gguf(key, cfg), **_local_experts_gguf(key, cfg, None)},
           gguf_tensors={**_EXPERT_TENSORS, "attn_sinks": "self_attn.sinks"}, rms_eps_default=1e-5,
           eos_tokens=("<|end_of_text|>", "<|end_of_role|>")),
    Family("smollm3", "SmolLM3ForCausalLM", _smollm3, gguf_permuted_qk=True, gguf_config=_smollm3_gguf,
           eos_tokens=("<|im_end|>", "<|end_of_text|>")),
    Family("olmo2", "Olmo2ForCausalLM", lambda d: _OLMO2, gguf_tensors=_POST_NORM_TENSORS,
           eos_tokens=("<|endoftext|>", "<|im_end|>")),
    # llama.cpp files OLMo 3 under olmo2; its windowed layers tell it apart (models/gguf.py).
    Family("olmo3", "Olmo3ForCausalLM", _olmo3, gguf_tensors=_POST_NORM_TENSORS, gguf_config=_olmo3_gguf,
           eos_tokens=("<|endoftext|>", "<|im_end|>")),
    # llama.cpp ropes both the "norm" way with the HF rows as they are: reading them is undoing llama's permutation.
    Family("ernie4_5", "Ernie4_5ForCausalLM", _ernie4_5, gguf_permuted_qk=True, hf_interleaved_qk=True,
           rms_eps_default=1e-5, eos_tokens=("</s>", "<|end_of_sentence|>")),
    Family("ernie4_5-moe", "Ernie4_5_MoeForCausalLM", _ernie4_5_moe, gguf_permuted_qk=True, hf_interleaved_qk=True,
           gguf_config=_ernie4_5_moe_gguf, rms_eps_default=1e-5, eos_tokens=("</s>", "<|end_of_sentence|>"),
           hf_model_type="ernie4_5_moe",
           gguf_tensors={**_EXPERT_TENSORS, "exp_probs_b": "mlp." + SELECT_BIAS,
                         "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
                         "ffn_down_shexp": "mlp.shared_experts.down_proj"}),
    Family("glm4", "Glm4ForCausalLM", _glm4, gguf_permuted_qk=True, hf_interleaved_qk=True, hf_norms=GLM_NORMS,
           gguf_tensors={"ffn_up": "mlp.gate_up_proj", "ffn_norm": "post_attention_layernorm",
                         "post_attention_norm": "post_self_attn_layernorm", "post_ffw_norm": "post_mlp_layernorm"},
           gguf_config=_rope_dims_gguf, rms_eps_default=1e-5,
           eos_tokens=("<|endoftext|>", "<|user|>", "<|observation|>")),
    Family("exaone4", "Exaone4ForCausalLM", _exaone4, gguf_tensors=_POST_NORM_TENSORS, gguf_config=_exaone4_gguf,
           rms_eps_default=1e-5, eos_tokens=("[|endofturn|]",)),
    Family("phi3", "Phi3ForCausalLM", _phi3, gguf_config=_phi3_gguf, rms_eps_default=1e-5,
           gguf_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
           eos_tokens=("<|end|>", "<|endoftext|>")),
    Family("gemma2", "Gemma2ForCausalLM", _gemma2, gguf_norm_shift=1.0, gguf_tensors=_GEMMA_TENSORS,
           gguf_config=_gemma2_gguf, eos_tokens=("<end_of_turn>", "<eos>")),
    Family("gemma3", "Gemma3ForCausalLM", _gemma3, gguf_norm_shift=1.0, gguf_tensors=_GEMMA_TENSORS,
           gguf_config=_gemma3_gguf, eos_tokens=("<end_of_turn>", "<eos>"), hf_model_type="gemma3_text"),
    Family("qwen3moe", "Qwen3MoeForCausalLM", lambda d: {**_experts(d), "qk_norm": "head"},
           gguf_tensors=_EXPERT_TENSORS, gguf_config=lambda key, cfg: _experts_gguf(key, cfg, True),
           eos_tokens=("<|im_end|>", "<|endoftext|>"), hf_model_type="qwen3_moe"),
    Family("qwen2moe", "Qwen2MoeForCausalLM",
           lambda d: {**_experts(d), "attention_bias": bool(d.get("qkv_bias", d.get("attention_bias", True)))},
           gguf_tensors=_EXPERT_TENSORS, gguf_config=lambda key, cfg: _experts_gguf(key, cfg, False),
           eos_tokens=("<|im_end|>", "<|endoftext|>"), hf_model_type="qwen2_moe"),
    # llama.cpp files Mixtral under `llama`; its expert tensors tell it apart (models/gguf.py).
    Family("mixtral", "MixtralForCausalLM", lambda d: _experts(d, True), gguf_permuted_qk=True,
           gguf_tensors=_EXPERT_TENSORS, gguf_config=_mixtral_gguf, rms_eps_default=1e-5),
    Family("granitemoe", "GraniteMoeForCausalLM", _granitemoe, gguf_permuted_qk=True, gguf_tensors=_EXPERT_TENSORS,
           gguf_config=_granitemoe_gguf, rms_eps_default=1e-5, eos_tokens=("<|end_of_text|>", "<|end_of_role|>")),
    Family("olmoe", "OlmoeForCausalLM", _olmoe, gguf_tensors=_EXPERT_TENSORS,
           gguf_config=lambda key, cfg: _experts_gguf(key, cfg, False), rms_eps_default=1e-5,
           eos_tokens=("<|endoftext|>", "<|im_end|>")),
    # llama.cpp names its pre-MLP norm post_attention_norm (as transformers does).
    Family("seed_oss", "SeedOssForCausalLM", _seed_oss, eos_tokens=("<seed:eos>",),
           gguf_tensors={"post_attention_norm": "post_attention_layernorm"}),
    # Cohere: LayerNorms and the parallel block; llama.cpp ropes it the "norm" way with the HF rows as they are.
    Family("command-r", "CohereForCausalLM", _cohere, gguf_permuted_qk=True, hf_interleaved_qk=True,
           gguf_config=_cohere_gguf, hf_model_type="cohere",
           eos_tokens=("<|END_OF_TURN_TOKEN|>", "<EOS_TOKEN>")),
    Family("cohere2", "Cohere2ForCausalLM", _cohere2, gguf_permuted_qk=True, hf_interleaved_qk=True,
           gguf_config=_cohere2_gguf, eos_tokens=("<|END_OF_TURN_TOKEN|>", "<|END_RESPONSE|>", "<EOS_TOKEN>")),
    # LFM2 (Liquid AI): short convolutions beside attention, its own names (_LFM2_NAMES).
    Family("lfm2", "Lfm2ForCausalLM", _lfm2, gguf_config=_lfm2_gguf, gguf_conv_layers=True, rms_eps_default=1e-5,
           hf_norms=_LFM2_NORMS, hf_names=_LFM2_NAMES, gguf_tensors=_LFM2_TENSORS,
           eos_tokens=("<|im_end|>", "<|endoftext|>")),
    Family("lfm2moe", "Lfm2MoeForCausalLM", _lfm2moe, gguf_config=_lfm2moe_gguf, gguf_conv_layers=True,
           rms_eps_default=1e-5, hf_model_type="lfm2_moe", hf_norms=_LFM2_NORMS,
           hf_names={"mlp." + SELECT_BIAS: "feed_forward.expert_bias", "mlp.gate.": "feed_forward.gate.",
                     "mlp.experts.": "feed_forward.experts.", **_LFM2_NAMES},
           gguf_tensors={**_LFM2_TENSORS, "ffn_gate_inp": "feed_forward.gate",
                         "ffn_gate_exps": "feed_forward.experts.gate_proj",
                         "ffn_up_exps": "feed_forward.experts.up_proj",
                         "ffn_down_exps": "feed_forward.experts.down_proj", "exp_probs_b": "feed_forward.expert_bias"},
           eos_tokens=("<|im_end|>", "<|endoftext|>")),
    # gpt-oss's harmony format ends an answer with <|return|> and a tool call with <|call|>; its
    # <|end|> closes a message (the reasoning's too) inside one turn, so it does not stop.
    Family("gpt-oss", "GptOssForCausalLM", _gpt_oss, eos_tokens=("<|return|>", "<|call|>"), rms_eps_default=1e-5,
           hf_model_type="gpt_oss", gguf_config=_gpt_oss_gguf,
           gguf_tensors={**_EXPERT_TENSORS, "attn_sinks": "self_attn.sinks",
                         "post_attention_norm": "post_attention_layernorm"}),
)}

# HF `architectures` entry -> family name.
HF_CLASSES = {f.hf_class: f.name for f in FAMILIES.values()}
# HF model_type -> family name.
MODEL_TYPES = {f.model_type: f.name for f in FAMILIES.values()}


def family_of(hf: dict[str, Any]) -> Family | None:
    """The family of a HF config dict (by its architectures, else its model_type), or None."""
    for a in hf.get("architectures") or []:
        if a in HF_CLASSES:
            return FAMILIES[HF_CLASSES[a]]
    name = MODEL_TYPES.get(str(hf.get("model_type")))
    return None if name is None else FAMILIES[name]


def supported() -> str:
    """The families we read, for a refusal's one line."""
    return ", ".join(sorted(FAMILIES))
