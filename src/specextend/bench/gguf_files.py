"""GGUF files of any type and size without a model hub, to time and size what users run.

    python -m specextend.bench.gguf_files quantize TYPE [--source FILE] [--out FILE]
    python -m specextend.bench.gguf_files random --shape qwen2.5-7b --type Q4_K_M [--out FILE]

`quantize` makes TYPE (Q5_K_M, Q4_0, IQ4_XS, Q3_K_M, Q2_K, Q8_0, F16, ...) from the default GGUF
with llama.cpp's own `llama-quantize` (built by `make peers` beside `llama-server`). A requantized
file is of lower quality than one quantized from the original weights: it tests formats, memory
and speed, not text.

`random` writes a random-weight GGUF of a Hugging Face config's shape (a preset: the default 1.5B,
qwen2.5-7b, llama-3-8b, gemma2-2b, gemma3-4b, gemma3-12b, phi4-mini, granite-3-8b, the mixtures of experts
olmoe-1b-7b, qwen3-30b-a3b, qwen1.5-moe-a2.7b and gpt-oss-20b; or a config.json) with the default
pair's tokenizer copied from the default GGUF (its vocabulary sets the embedding's rows, so the
default draft pairs with it), one tensor at a time (a 7B file never holds
more than one matrix in memory). Types gguf-py quantizes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16)
are quantized from random floats; K-quants, IQ4 and MXFP4 are random bytes with their scales set so
the weights have a small spread: any bytes are a valid block (`MXFP4_MOE`: gpt-oss's experts in
MXFP4, the rest Q8_0). `_M` names (Q3_K_M, Q4_K_M, Q5_K_M) use a higher type for some tensors as
llama.cpp does (the output and V and down projections of some layers). The file says in its metadata
that its weights are random, and loading it says so: tokens accepted from random weights mean
nothing (the draft agrees with nothing); such a file measures formats, memory and speed only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..common.errors import UserError
from ..models.gguf import RANDOM_WEIGHTS_KEY, open_gguf
from ..models.pull import DEFAULT_TARGET, gguf_file

RANDOM_NOTE = "tokens accepted from random weights mean nothing: such a file measures formats, memory and speed only"

# Hugging Face config fields of the presets (the default target's, and two common bigger shapes).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "rope_theta": 1000000.0,
                     "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": True},
    "qwen2.5-7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "tie_word_embeddings": False},
    "llama-3-8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 500000.0,
                   "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "tie_word_embeddings": False},
    # A mixture of experts: 64 experts of 1024, 8 a token, q/k norms over whole projections.
    "olmoe-1b-7b": {"model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": 16,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 4096, "tie_word_embeddings": False, "num_experts": 64,
                    "num_experts_per_tok": 8},
    # 128 experts of 768 a layer, 8 a token, per-head q/k norms, head_dim 128 (not hidden / heads).
    "qwen3-30b-a3b": {"model_type": "qwen3moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                      "max_position_embeddings": 40960, "tie_word_embeddings": False, "num_experts": 128,
                      "num_experts_per_tok": 8},
    # Qwen1.5-MoE-A2.7B (qwen2moe): 60 experts of 1,408, 4 a token, and a shared expert of 5,632 under a sigmoid
    # gate; q/k/v biases. 1,408 is no multiple of 256: the K-quant mixes cannot take it (use Q8_0 or Q4_0).
    "qwen1.5-moe-a2.7b": {"model_type": "qwen2moe", "hidden_size": 2048, "intermediate_size": 5632,
                          "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
                          "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
                          "tie_word_embeddings": False, "num_experts": 60, "num_experts_per_tok": 4},
    # Gemma 3 4B (text): sandwich norms, per-head q/k norms, head_dim 256, 5 windowed layers (1,024) to 1
    # global, the global rope linearly scaled by 8, tied embeddings (vocabulary: --tokenizer-from).
    "gemma3-4b": {"model_type": "gemma3", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rope_theta": 1000000.0,
                  "rope_scaling_factor": 8.0, "sliding_window": 1024, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 131072, "tie_word_embeddings": True},
    # Gemma 3 12B (text): the 4B's layout, wider and deeper, 16 query heads over 8 KV heads.
    "gemma3-12b": {"model_type": "gemma3", "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "rope_theta": 1000000.0,
                   "rope_scaling_factor": 8.0, "sliding_window": 1024, "rms_norm_eps": 1e-6,
                   "max_position_embeddings": 131072, "tie_word_embeddings": True},
    # Gemma 2 2B: sandwich norms, head_dim 256, soft-capped attention scores (50) and logits (30), a 4,096-token
    # window on alternating layers, tied embeddings (vocabulary: --tokenizer-from).
    "gemma2-2b": {"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rope_theta": 10000.0,
                  "sliding_window": 4096, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                  "rms_norm_eps": 1e-6, "max_position_embeddings": 8192, "tie_word_embeddings": True},
    # Phi-4-mini: fused q/k/v and gate/up projections, 96 of 128 head dimensions rotated, LongRoPE (its factors
    # as tensors, random here: a context within the original 4,096 takes the short ones), tied embeddings.
    "phi4-mini": {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
                  "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 10000.0,
                  "partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                  "max_position_embeddings": 131072, "tie_word_embeddings": True},
    # OLMo 3 7B (llama.cpp files it as olmo2): norms after attention and the MLP, q/k norms over all heads, a
    # 4,096-token window on all but every 4th layer, YaRN (8x over 8,192) on the global layers alone.
    "olmo-3-7b": {"model_type": "olmo2", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 32, "rope_theta": 500000.0, "sliding_window": 4096,
                  "rope_scaling_type": "yarn", "rope_scaling_factor": 8.0, "original_max_position_embeddings": 8192,
                  "yarn_attention_factor": 1.2079441541679836, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 65536, "tie_word_embeddings": False},
    # Ministral 3 8B (text; llama.cpp's mistral3): Mistral's layers, YaRN (16x over 16,384, magnitude 1), Llama 4's
    # attention temperature (beta 0.1) from 16,384 tokens on.
    "ministral-3-8b": {"model_type": "mistral3", "hidden_size": 4096, "intermediate_size": 14336,
                       "num_hidden_layers": 34, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                       "rope_theta": 1000000.0, "rope_scaling_type": "yarn", "rope_scaling_factor": 16.0,
                       "original_max_position_embeddings": 16384, "yarn_log_multiplier": 1.0,
                       "attention_temperature_scale": 0.1, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
                       "tie_word_embeddings": False},
    # Granite 3.1 3B-A800M: Granite's multipliers over 40 experts of 512 a layer, 8 a token (the top 8 logits'
    # softmax), tied embeddings.
    "granite-3.1-3b-a800m": {"model_type": "granitemoe", "hidden_size": 1536, "intermediate_size": 512,
                             "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8,
                             "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
                             "tie_word_embeddings": True, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                             "attention_multiplier": 0.015625, "logits_scaling": 6.0, "num_experts": 40,
                             "num_experts_per_tok": 8},
    # GLM-4-9B-0414: norms before and after attention and the MLP, q/k/v biases, the fused gate-up projection,
    # rope on adjacent pairs of half of each head; its MLP's 13,696 no multiple of 256 (llama.cpp's fallback types).
    "glm-4-9b": {"model_type": "glm4", "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
                 "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "partial_rotary_factor": 0.5,
                 "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 32768,
                 "tie_word_embeddings": False},
    # ERNIE 4.5 0.3B: Llama's layers with rope on adjacent pairs, head_dim 128 over a 1,024 hidden, tied embeddings.
    "ernie-4.5-0.3b": {"model_type": "ernie4_5", "hidden_size": 1024, "intermediate_size": 3072,
                       "num_hidden_layers": 18, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
                       "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                       "tie_word_embeddings": True},
    # ERNIE-4.5-21B-A3B: ERNIE 4.5's layers with 64 experts of 1,536 a layer, 6 a token (picked with a selection
    # bias), two shared experts as one ungated MLP, the first layer dense (12,288); tied embeddings.
    "ernie-4.5-21b-a3b": {"model_type": "ernie4_5-moe", "hidden_size": 2560, "intermediate_size": 12288,
                          "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4,
                          "head_dim": 128, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                          "max_position_embeddings": 131072, "tie_word_embeddings": True, "num_experts": 64,
                          "num_experts_per_tok": 6, "moe_intermediate_size": 1536, "moe_num_shared_experts": 2,
                          "moe_layer_start_index": 1},
    # Granite 3.1 8B: Llama's layers with embedding, residual, attention and logit multipliers, tied embeddings.
    "granite-3-8b": {"model_type": "granite", "hidden_size": 4096, "intermediate_size": 12800,
                     "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8,
                     "rope_theta": 10000000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                     "tie_word_embeddings": True, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                     "attention_multiplier": 0.0078125, "logits_scaling": 16.0},
    # gpt-oss-20b: 32 experts of 2880, 4 a token (top-k then softmax), biases on attention, router and
    # experts, attention sinks, 128-token windows on alternating layers, YaRN (32x over 4,096).
    "gpt-oss-20b": {"model_type": "gpt-oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "rope_theta": 150000.0,
                    "rope_scaling_type": "yarn", "rope_scaling_factor": 32.0, "original_max_position_embeddings": 4096,
                    "sliding_window": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
                    "tie_word_embeddings": False, "num_experts": 32, "num_experts_per_tok": 4},
    # LFM2-1.2B: gated short convolutions (3 tokens) on 10 of 16 layers, attention with per-head q/k norms on the
    # others, tied embeddings (its own vocabulary has 65,536 tokens: --tokenizer-from sets the file's).
    "lfm2-1.2b": {"model_type": "lfm2", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
                  "max_position_embeddings": 128000, "tie_word_embeddings": True,
                  "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3},
    # LFM2-8B-A1B: LFM2's layers (attention on 6 of 24) with 32 experts of 1,792 a layer, 4 a token, picked by
    # sigmoids plus a selection bias, after 2 dense layers (7,168).
    "lfm2-8b-a1b": {"model_type": "lfm2moe", "hidden_size": 2048, "intermediate_size": 7168, "num_hidden_layers": 24,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 128000, "tie_word_embeddings": True,
                    "full_attn_idxs": [2, 6, 10, 14, 18, 21], "conv_L_cache": 3, "num_experts": 32,
                    "num_experts_per_tok": 4, "moe_intermediate_size": 1792, "num_dense_layers": 2},
    # Granite SWA 2B (granite-swash; transformers' GraniteSWAConfig defaults): Granite's multipliers, a 128-token window
    # on all but every 4th layer, a learned sink logit a head, tied embeddings.
    "granite-swash-2b": {"model_type": "granite_swa", "hidden_size": 2560, "intermediate_size": 8192,
                         "num_hidden_layers": 24, "num_attention_heads": 20, "num_key_value_heads": 4,
                         "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 128,
                         "max_position_embeddings": 8192, "tie_word_embeddings": True, "embedding_multiplier": 12.0,
                         "residual_multiplier": 0.22, "attention_multiplier": 0.0078125, "logits_scaling": 8.0},
    # Command R7B (cohere2): one LayerNorm before a parallel block, a 4,096-token window on 3 layers of 4 (which alone
    # take rope), logits scaled by 0.25, tied embeddings.
    "command-r7b": {"model_type": "cohere2", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "rope_theta": 50000.0, "layer_norm_eps": 1e-5,
                    "sliding_window": 4096, "logit_scale": 0.25, "max_position_embeddings": 131072,
                    "tie_word_embeddings": True},
    # Aya Expanse 8B (llama.cpp's command-r): Cohere's block, rope on every layer, logits scaled by 0.125.
    "aya-expanse-8b": {"model_type": "command-r", "hidden_size": 4096, "intermediate_size": 14336,
                       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                       "rope_theta": 10000.0, "layer_norm_eps": 1e-5, "logit_scale": 0.125,
                       "max_position_embeddings": 8192, "tie_word_embeddings": True},
    # LFM2-350M: the 1.2B's layout, half as wide (a draft for it: the same vocabulary).
    "lfm2-350m": {"model_type": "lfm2", "hidden_size": 1024, "intermediate_size": 4608, "num_hidden_layers": 16,
                  "num_attention_heads": 16, "num_key_value_heads": 8, "rope_theta": 1000000.0, "rms_norm_eps": 1e-5,
                  "max_position_embeddings": 128000, "tie_word_embeddings": True,
                  "full_attn_idxs": [2, 5, 8, 10, 12, 14], "conv_L_cache": 3},
}
# The model types a random file can take (the expert ones: each layer's experts stacked, llama.cpp's way).
RANDOM_TYPES = ("llama", "qwen2", "olmoe", "qwen3moe", "qwen2moe", "gemma2", "gemma3", "granite", "gpt-oss", "phi3",
                "olmo2", "mistral3", "granitemoe", "glm4", "ernie4_5", "ernie4_5-moe", "lfm2", "lfm2moe", "command-r",
                "cohere2", "granite_swa")
# Granite's multipliers: the config's names and the GGUF writer's (llama.cpp's *_scale keys).
GRANITE_SCALES = {"embedding_multiplier": "add_embedding_scale", "residual_multiplier": "add_residual_scale",
                  "attention_multiplier": "add_attention_scale", "logits_scaling": "add_logit_scale"}

# Types written as random blocks: the byte offsets of each block's float16 scale (d) and, for the
# types with one, its float16 min scale (dmin). Every other byte of a block is codes or small
# scales, valid whatever their value.
RANDOM_BLOCKS: dict[str, tuple[int, int | None]] = {
    "Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None),
    "IQ4_NL": (0, None), "IQ4_XS": (0, None), "MXFP4": (0, None),  # MXFP4's: an E8M0 exponent byte (`_set_scales`)
    "IQ3_S": (0, None), "IQ3_XXS": (0, None), "IQ2_XXS": (0, None), "IQ1_S": (0, None), "IQ2_XS": (0, None),
    "IQ2_S": (0, None), "IQ1_M": (48, None),  # IQ1_M's: d's bits in the top nibbles of 4 uint16 (`_set_scales`)
    "NVFP4": (0, None),  # NVFP4's: four unsigned E4M3 bytes, one a 16 values (`_set_scales`)
}
QUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32", "TQ1_0", "TQ2_0")
# A mix's main type, and the type of llama.cpp's "more bits" tensors (output, some V and down projections).
# MXFP4_MOE (llama.cpp's ftype of the released gpt-oss files): the experts in MXFP4, every other matrix Q8_0.
MIXES = {"Q3_K_M": ("Q3_K", "Q5_K"), "Q4_K_M": ("Q4_K", "Q6_K"), "Q5_K_M": ("Q5_K", "Q6_K"),
         "MXFP4_MOE": ("Q8_0", "Q8_0")}
EXPERT_TYPES = {"MXFP4_MOE": "MXFP4"}  # a mix whose experts take a type of their own
TYPES = (*MIXES, *RANDOM_BLOCKS, *QUANTIZED)
WEIGHT_STD = 0.02  # the spread of the random weights (Hugging Face's usual initializer range)


# --------------------------------------------------------------------------- quantize


def llama_quantize() -> Path:
    """llama.cpp's `llama-quantize` beside the `llama-server` that `make peers` built."""
    from .llamacpp import find_peer

    binary = Path(find_peer("quantize").binary).parent / "llama-quantize"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise UserError(f"no llama-quantize beside {binary.parent / 'llama-server'}: run `make peers`")
    return binary


def quantize(kind: str, source: Path, out: Path) -> Path:
    """`llama-quantize --allow-requantize source out kind`, written atomically; returns `out`."""
    binary = llama_quantize()
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        done = subprocess.run([str(binary), "--allow-requantize", str(source), str(tmp), kind],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"llama-quantize {kind} failed (exit {done.returncode}): {last[0]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------- random


def load_shape(shape: str) -> dict[str, Any]:
    """A preset's config, or the fields of a Hugging Face config.json."""
    if shape in PRESETS:
        return dict(PRESETS[shape])
    path = Path(shape).expanduser()
    if not path.is_file():
        raise UserError(f"--shape {shape}: neither a preset ({', '.join(PRESETS)}) nor a config.json file")
    try:
        config = json.loads(path.read_text())
        keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in keys if k not in config]
    except (ValueError, UnicodeDecodeError, AttributeError) as e:
        raise UserError(f"--shape {shape}: not a JSON config: {e}") from None
    if missing:
        raise UserError(f"--shape {shape}: the config lacks {', '.join(missing)}")
    if config.get("model_type", "llama") not in RANDOM_TYPES:
        raise UserError(f"--shape {shape}: model_type {config.get('model_type')!r}; random files are "
                        f"{', '.join(RANDOM_TYPES)}")
    return config


# llama.cpp's type for a matrix whose rows are no multiple of 256 values, where the mix asks for a 256-value type.
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL"}


def tensor_plan(config: dict[str, Any], vocab: int, kind: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape in torch order, GGUF type) of every tensor, in llama.cpp's order; a matrix whose rows
    a 256-value type cannot hold takes llama.cpp's fallback type (`FALLBACK`)."""
    for name, shape, t in _tensor_plan(config, vocab, kind):
        yield name, shape, FALLBACK.get(t, t) if len(shape) > 1 and shape[-1] % 256 else t


def _tensor_plan(config: dict[str, Any], vocab: int, kind: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    main, more = MIXES.get(kind, (kind, kind))
    h, f, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    hd = config.get("head_dim") or h // heads
    experts = int(config.get("num_experts") or 0)
    gemma = config.get("model_type") in ("gemma2", "gemma3")  # sandwich norms
    oss = config.get("model_type") == "gpt-oss"
    # Qwen3's and Gemma 3's q/k norms: one head's width, not all heads'
    head_norm = config.get("model_type") in ("qwen3moe", "gemma3")
    lfm2, conv = config.get("model_type") in ("lfm2", "lfm2moe"), conv_layers(config)
    exps = EXPERT_TYPES.get(kind)
    phi = config.get("model_type") == "phi3"  # fused projections, LongRoPE's factors as tensors
    olmo = config.get("model_type") == "olmo2"  # OLMo 2 and 3: norms after, not before; q/k norms over all heads
    glm = config.get("model_type") == "glm4"  # norms before and after, the fused gate-up projection
    fused_up = phi or glm
    cohere = config.get("model_type") in ("command-r", "cohere2")  # the parallel block: one norm a layer

    def more_bits(i: int) -> bool:  # llama.cpp's use_more_bits: the first and last eighth, every third between
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    yield "token_embd.weight", (vocab, h), main
    if phi:
        rot = int(hd * float(config.get("partial_rotary_factor", 1.0)))
        yield "rope_factors_long.weight", (rot // 2,), "F32"
        yield "rope_factors_short.weight", (rot // 2,), "F32"
    for i in range(layers):
        b = f"blk.{i}."
        if not olmo:
            yield b + "attn_norm.weight", (h,), "F32"
        if i in conv:  # LFM2's convolution in place of attention, then the MLP or experts as any layer's
            yield from _conv_tensors(b, config, main)
        else:
            yield from _attention_tensors(b, config, main, more if more_bits(i) else main)
        if oss:  # gpt-oss: an output bias, a sink logit a head; its MLP's pre-norm is llama.cpp's post_attention_norm
            yield b + "attn_output.bias", (h,), "F32"
        if oss or config.get("model_type") == "granite_swa":
            yield b + "attn_sinks.weight", (heads,), "F32"
        if gemma or oss or olmo or glm:
            yield b + "post_attention_norm.weight", (h,), "F32"
        if not oss and not olmo and not cohere:  # (Cohere's MLP reads the attention norm's output)
            yield b + "ffn_norm.weight", (h,), "F32"
        if experts and i >= int(config.get("moe_layer_start_index", config.get("num_dense_layers", 0))):  # leading
            # dense layers (ERNIE's, LFM2's)
            if config.get("model_type") in ("qwen3moe", "olmoe"):  # their q/k norms
                yield b + "attn_q_norm.weight", (hd if head_norm else heads * hd,), "F32"
                yield b + "attn_k_norm.weight", (hd if head_norm else kv * hd,), "F32"
            yield from _expert_tensors(b, config, exps or main, exps or (more if more_bits(i) else main))
            continue
        if not fused_up:
            yield b + "ffn_gate.weight", (f, h), main
        yield b + "ffn_up.weight", (2 * f if fused_up else f, h), main
        yield b + "ffn_down.weight", (h, f), more if more_bits(i) else main
        if gemma or olmo or glm:
            yield b + "post_ffw_norm.weight", (h,), "F32"
    yield "token_embd_norm.weight" if lfm2 else "output_norm.weight", (h,), "F32"  # LFM2's final norm's name
    if not config.get("tie_word_embeddings", False):
        yield "output.weight", (vocab, h), more


def conv_layers(config: dict[str, Any]) -> set[int]:
    """The layers of an LFM2 shape that are short convolutions (all but `full_attn_idxs`; none for other types)."""
    if config.get("model_type") not in ("lfm2", "lfm2moe"):
        return set()
    return set(range(config["num_hidden_layers"])) - set(config["full_attn_idxs"])


def _conv_tensors(b: str, config: dict[str, Any], main: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """An LFM2 convolution (prefix `b`): its projections and kernel [channels, length], in place of attention."""
    h = config["hidden_size"]
    yield b + "shortconv.in_proj.weight", (3 * h, h), main
    yield b + "shortconv.conv.weight", (h, int(config.get("conv_L_cache", 3))), "F32"
    yield b + "shortconv.out_proj.weight", (h, h), main


def _attention_tensors(b: str, config: dict[str, Any], main: str, v_kind: str
                       ) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A layer's attention projections (prefix `b`), its q/k norms where the family has them before the MLP's."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    hd = config.get("head_dim") or h // heads
    kind = config.get("model_type")
    yield from _qkv_tensors(b, config, main, v_kind)
    head = kind in ("gemma3", "lfm2", "lfm2moe")  # one head's width, not all heads'
    if head or kind == "olmo2":
        yield b + "attn_q_norm.weight", (hd if head else heads * hd,), "F32"
        yield b + "attn_k_norm.weight", (hd if head else kv * hd,), "F32"
    yield b + "attn_output.weight", (h, heads * hd), main


def _qkv_tensors(b: str, config: dict[str, Any], main: str, v_kind: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A layer's query, key and value projections (prefix `b`; one fused tensor for Phi-3, in `v_kind`
    as llama.cpp's mixes give the value projection) and their biases (Qwen2, Qwen2-MoE, gpt-oss)."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    hd = config.get("head_dim") or h // heads
    if config.get("model_type") == "phi3":
        yield b + "attn_qkv.weight", ((heads + 2 * kv) * hd, h), v_kind
    else:
        yield b + "attn_q.weight", (heads * hd, h), main
        yield b + "attn_k.weight", (kv * hd, h), main
        yield b + "attn_v.weight", (kv * hd, h), v_kind
    if config.get("model_type") in ("qwen2", "qwen2moe", "gpt-oss", "glm4"):
        yield b + "attn_q.bias", (heads * hd,), "F32"
        yield b + "attn_k.bias", (kv * hd,), "F32"
        yield b + "attn_v.bias", (kv * hd,), "F32"


def _expert_tensors(b: str, config: dict[str, Any], kind: str, down: str) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """A layer's router and stacked experts (prefix `b`), with gpt-oss's biases on each of them."""
    h, experts, ef = config["hidden_size"], int(config["num_experts"]), expert_ff(config)
    yield b + "ffn_gate_inp.weight", (experts, h), "F32"  # llama.cpp keeps routers in F32
    yield b + "ffn_gate_exps.weight", (experts, ef, h), kind
    yield b + "ffn_up_exps.weight", (experts, ef, h), kind
    yield b + "ffn_down_exps.weight", (experts, h, ef), down
    if config.get("model_type") in ("ernie4_5-moe", "lfm2moe"):  # the selection bias
        yield b + "exp_probs_b.bias", (experts,), "F32"
    shared = int(config.get("shared_expert_intermediate_size") or ef * int(config.get("moe_num_shared_experts", 0)))
    if shared:  # Qwen2-MoE's shared expert (its gate a vector) or ERNIE's ungated ones, their projections dense
        if config.get("shared_expert_intermediate_size"):
            yield b + "ffn_gate_inp_shexp.weight", (h,), "F32"
        yield b + "ffn_gate_shexp.weight", (shared, h), kind
        yield b + "ffn_up_shexp.weight", (shared, h), kind
        yield b + "ffn_down_shexp.weight", (h, shared), down
    if config.get("model_type") == "gpt-oss":
        yield b + "ffn_gate_inp.bias", (experts,), "F32"
        yield b + "ffn_gate_exps.bias", (experts, ef), "F32"
        yield b + "ffn_up_exps.bias", (experts, ef), "F32"
        yield b + "ffn_down_exps.bias", (experts, h), "F32"


def expert_ff(config: dict[str, Any]) -> int:
    """An expert's width: `moe_intermediate_size` where the config has one (Qwen3-MoE), else
    `intermediate_size` (OLMoE)."""
    return int(config.get("moe_intermediate_size") or config["intermediate_size"])


def _block_scales(kind: str, rng: np.random.Generator) -> tuple[float, float]:
    """(d, dmin) that give random blocks of `kind` mean 0 and spread WEIGHT_STD, measured on a sample
    through gguf's dequantizer (so every type's block layout is gguf's, not ours)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    _, size = GGML_QUANT_SIZES[qtype]
    sample = rng.integers(0, 256, size=(64, size), dtype=np.uint8)

    def values(d: float, dmin: float) -> np.ndarray:
        _set_scales(sample, kind, d, dmin)
        return dequantize(sample.reshape(-1), qtype).astype(np.float64)

    ratio = 0.0
    if RANDOM_BLOCKS[kind][1] is not None:  # w = d * (...) - dmin * (...): balance the two means
        ratio = -values(1.0, 0.0).mean() / values(0.0, 1.0).mean()
    std = values(1.0, ratio).std()
    return WEIGHT_STD / std, WEIGHT_STD * ratio / std


def _set_scales(blocks: np.ndarray, kind: str, d: float, dmin: float) -> None:
    """Write the float16 scales into every block of `blocks` ([..., block bytes] uint8); MXFP4's scale
    is a power of two, its E8M0 byte the nearest exponent's; NVFP4's four are the E4M3 nearest d."""
    d_at, dmin_at = RANDOM_BLOCKS[kind]
    if kind == "MXFP4":
        blocks[..., d_at] = np.uint8(min(254, max(1, 127 + round(float(np.log2(d))))))
        return
    if kind == "NVFP4":  # the E4M3 byte whose scale (as gguf decodes it) is nearest d
        from gguf.quants import NVFP4

        codes = np.arange(127, dtype=np.uint8)
        blocks[..., 0:4] = codes[np.argmin(np.abs(NVFP4.ue4m3_to_fp32(codes) - d))]
        return
    if kind == "IQ1_M":
        words = np.ascontiguousarray(blocks[..., d_at:d_at + 8]).view("<u2")
        bits = int(np.float16(d).view(np.uint16))
        nibbles = np.array([(bits >> (4 * j)) & 15 for j in range(4)], dtype=np.uint16)
        blocks[..., d_at:d_at + 8] = ((words & 0x0FFF) | (nibbles << 12)).view(np.uint8)
        return
    blocks[..., d_at:d_at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
    if dmin_at is not None:
        blocks[..., dmin_at:dmin_at + 2] = np.frombuffer(np.float16(dmin).tobytes(), dtype=np.uint8)


def random_tensor(shape: tuple[int, ...], kind: str, rng: np.random.Generator,
                  scales: dict[str, tuple[float, float]]) -> np.ndarray:
    """Random data of one tensor in GGUF type `kind` (float32 values, or the quantized bytes)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    if kind == "F32":
        if len(shape) == 1:  # norms near 1, biases near 0: a random model that stays in range
            return (1.0 + WEIGHT_STD * rng.standard_normal(shape)).astype(np.float32)
        return (WEIGHT_STD * rng.standard_normal(shape)).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    if shape[-1] % block:
        raise UserError(f"{kind} needs rows of a multiple of {block} values; this shape has {shape[-1]}")
    if kind in RANDOM_BLOCKS:
        if kind not in scales:
            scales[kind] = _block_scales(kind, rng)
        rows = int(np.prod(shape[:-1]))  # a stack of experts' matrices: all their rows
        blocks = rng.integers(0, 256, size=(rows, shape[-1] // block, size), dtype=np.uint8)
        _set_scales(blocks, kind, *scales[kind])
        return blocks.reshape(*shape[:-1], -1)
    values = (WEIGHT_STD * rng.standard_normal(shape)).astype(np.float32)
    return gguf_quantize(values, qtype)


def _copy_tokenizer(writer: Any, reader: Any) -> None:
    """Every `tokenizer.*` key of `reader` into `writer`, with its own value types."""
    from gguf import GGUFValueType

    for key, f in reader.fields.items():
        if not key.startswith("tokenizer.") or not f.types:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), f.types[0], sub_type=sub)


def _write_keys(w: Any, config: dict[str, Any]) -> None:
    """The metadata keys of the model (the random marker, the shape, the experts) into writer `w`."""
    heads = config["num_attention_heads"]
    w.add_bool(RANDOM_WEIGHTS_KEY, True)
    w.add_description(RANDOM_NOTE)
    w.add_context_length(int(config.get("max_position_embeddings", 4096)))
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    kv = config.get("num_key_value_heads", heads)
    conv = conv_layers(config)
    w.add_head_count_kv([0 if i in conv else kv for i in range(config["num_hidden_layers"])] if conv else kv)
    if conv:  # LFM2: a convolution's layer has no KV heads; the kernel's length
        w.add_shortconv_l_cache(int(config.get("conv_L_cache", 3)))
    if config.get("head_dim"):
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
    if "layer_norm_eps" in config:  # Cohere's LayerNorms and logit scale
        w.add_layer_norm_eps(float(config["layer_norm_eps"]))
        w.add_logit_scale(float(config["logit_scale"]))
    else:
        w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    w.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    for name, add in GRANITE_SCALES.items():
        if name in config:
            getattr(w, add)(float(config[name]))
    if config.get("sliding_window"):
        w.add_sliding_window(int(config["sliding_window"]))
    if config.get("model_type") == "granite_swa":  # its windowed layers: all but every 4th, from the first
        w.add_sliding_window_pattern([i % 4 != 0 for i in range(config["num_hidden_layers"])])
    if config.get("partial_rotary_factor"):  # Phi-4-mini, GLM-4: the rotated dimensions of a head
        hd = config.get("head_dim") or config["hidden_size"] // heads
        w.add_rope_dimension_count(int(hd * float(config["partial_rotary_factor"])))
    if config.get("model_type") == "phi3" and config.get("original_max_position_embeddings"):
        w.add_rope_scaling_orig_ctx_len(int(config["original_max_position_embeddings"]))
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's keys, as its converter names them
        if config.get(cap):
            w.add_float32(f"{config['model_type']}.{cap}", float(config[cap]))
    if config.get("rope_scaling_factor"):
        import gguf

        yarn = config.get("rope_scaling_type") == "yarn"
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN if yarn else gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(config["rope_scaling_factor"]))
        if yarn:
            w.add_rope_scaling_orig_ctx_len(int(config["original_max_position_embeddings"]))
        if config.get("yarn_attention_factor"):  # OLMo 3's converter writes HF's attention_factor
            w.add_rope_scaling_attn_factors(float(config["yarn_attention_factor"]))
        if "yarn_log_multiplier" in config:  # Ministral 3's converter: HF's mscale_all_dim
            w.add_rope_scaling_yarn_log_mul(float(config["yarn_log_multiplier"]))
    if config.get("attention_temperature_scale"):
        w.add_attn_temperature_scale(float(config["attention_temperature_scale"]))
    _expert_keys(w, config)


def _expert_keys(w: Any, config: dict[str, Any]) -> None:
    """An expert model's keys: the experts' count, top k and width, the shared experts', the dense layers' and the
    router's where the family writes them."""
    if config.get("num_experts"):
        w.add_expert_count(int(config["num_experts"]))
        w.add_expert_used_count(int(config["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(expert_ff(config))
    if config.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(int(config["shared_expert_intermediate_size"]))
    if config.get("model_type") == "lfm2moe":  # the leading dense layers, the router's sigmoid (llama.cpp needs it)
        import gguf

        w.add_leading_dense_block_count(int(config["num_dense_layers"]))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
    if config.get("moe_num_shared_experts"):  # ERNIE's: the shared experts' count and width, the leading dense layers
        w.add_expert_shared_count(int(config["moe_num_shared_experts"]))
        w.add_expert_shared_feed_forward_length(expert_ff(config) * int(config["moe_num_shared_experts"]))
        w.add_leading_dense_block_count(int(config.get("moe_layer_start_index", 0)))
        w.add_interleave_moe_layer_step(1)


def write_random(out: Path, config: dict[str, Any], kind: str, tokenizer_from: Path, seed: int = 0,
                 progress: bool = True) -> Path:
    """Write a random-weight GGUF of `config`'s shape in `kind`, atomically, one tensor at a time."""
    import gguf
    from tqdm import tqdm

    if kind not in TYPES:
        raise UserError(f"--type {kind}: choose one of {', '.join(TYPES)}")
    source = open_gguf(tokenizer_from)
    if "tokenizer.ggml.tokens" not in source.fields:
        raise UserError(f"{tokenizer_from} has no tokenizer to copy")
    embd = next((t for t in source.tensors if t.name == "token_embd.weight"), None)
    vocab = int(embd.shape[-1]) if embd is not None else len(source.fields["tokenizer.ggml.tokens"].data)
    arch = config.get("model_type", "llama")
    plan = list(tensor_plan(config, vocab, kind))
    w = gguf.GGUFWriter(None, arch)
    w.add_name(f"random {kind} {arch} {config['hidden_size']}x{config['num_hidden_layers']}")
    _write_keys(w, config)
    _copy_tokenizer(w, source)
    del source
    for name, shape, t in plan:
        qtype = gguf.GGMLQuantizationType[t]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        if t == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            rows = int(np.prod(shape[:-1]))
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8),
                              rows * (shape[-1] // block) * size, raw_dtype=qtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    rng = np.random.default_rng(seed)
    scales: dict[str, tuple[float, float]] = {}
    try:
        w.open_output_file(tmp)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _name, shape, t in tqdm(plan, unit="tensor", desc="write", file=sys.stderr, disable=not progress):
            w.write_tensor_data(random_tensor(shape, t, rng, scales))
        w.close()
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# --------------------------------------------------------------------------- command


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specextend.bench.gguf_files", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = sub.add_parser("quantize", help="make TYPE from the default GGUF with llama.cpp's llama-quantize")
    q.add_argument("type", metavar="TYPE", help="llama-quantize's type name: Q5_K_M, Q4_0, IQ4_XS, Q3_K_M, Q2_K, ...")
    q.add_argument("--source", default=None, help=f"the file to requantize (default: the pulled {DEFAULT_TARGET})")
    q.add_argument("--out", default=None, help="the output file (default: SOURCE-STEM-TYPE.gguf here)")
    r = sub.add_parser("random", help=f"a random-weight GGUF of a config's shape ({RANDOM_NOTE})")
    r.add_argument("--shape", default="qwen2.5-1.5b",
                   help=f"a preset ({', '.join(PRESETS)}) or a Hugging Face config.json (default: qwen2.5-1.5b)")
    r.add_argument("--type", default="Q4_K_M", dest="kind", help=f"one of {', '.join(TYPES)} (default: Q4_K_M)")
    r.add_argument("--layers", type=int, default=None, help="override the number of layers (smaller files)")
    r.add_argument("--tokenizer-from", default=None,
                   help=f"the GGUF whose tokenizer is copied (default: the pulled {DEFAULT_TARGET})")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=None, help="the output file (default: random-SHAPE-TYPE.gguf here)")
    r.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    try:
        if args.action == "quantize":
            source = Path(args.source) if args.source else gguf_file(DEFAULT_TARGET)
            if not source.is_file():
                raise UserError(f"{source} not found (run specextend models pull, or pass --source)")
            out = Path(args.out) if args.out else Path(f"{source.stem}-{args.type}.gguf")
            print(quantize(args.type, source, out))
            print(f"gguf_files: requantized from {source.name}: lower quality than a file quantized from the "
                  f"original weights (it tests formats and speed, not text)", file=sys.stderr)
            return 0
        config = load_shape(args.shape)
        if args.layers is not None:
            if args.layers < 1:
                raise UserError("--layers must be at least 1")
            config["num_hidden_layers"] = args.layers
        tokenizer_from = Path(args.tokenizer_from) if args.tokenizer_from else gguf_file(DEFAULT_TARGET)
        stem = Path(args.shape).stem if args.shape not in PRESETS else args.shape
        out = Path(args.out) if args.out else Path(f"random-{stem}-{args.kind}.gguf")
        print(write_random(out, config, args.kind, tokenizer_from, args.seed, progress=not args.quiet))
        print(f"gguf_files: {RANDOM_NOTE}", file=sys.stderr)
        return 0
    except UserError as e:
        print(f"gguf_files: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
