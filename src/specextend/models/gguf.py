"""Convert a `.gguf` file into a model folder: config.json, tokenizer and `model.safetensors`.

The weights keep the file's own quantization grids in the layout the CPU kernels read (see
`runtime/quant.py` and `qstore.py`): a Q4_K_M model stays about the size of its GGUF and loads with a
plain read, and any other precision (`--weights float32`, `int8`, ...) is derived from it at load
time without a second copy on disk. Tensor types the kernels do not compute with as they are
(F32 norms and biases, other quantization types) are stored as float32 under their HF names
(F16 and BF16 matrices are kept as their 16-bit values, which the kernels compute with);
each load of a file with such types says so in one line, and one whose first load would not fit
in memory is refused before anything is written (`footprint.py`). Tensors are converted and
written a run of rows at a time, so converting takes a few runs' memory beside the file's metadata,
whatever the model's size.

The folder is written atomically: everything goes into a temporary sibling, the marker file
`.complete` is written last, and only then is the folder renamed into place. A folder without
`.complete` is never treated as valid, so a killed conversion is simply redone.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import unittest.mock
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..common import meminfo
from ..common.errors import UserError
from ..runtime.families import FAMILIES, QK_ROWS_KEY, ROTATE_HALF, SELECT_BIAS, Family, family_of, supported
from . import pretokenize
from .footprint import Footprint, TensorInfo, check_fits, expert_share, footprint, is_kept, notice, random_notice

COMPLETE_MARKER = ".complete"
WEIGHTS_FILE = "model.safetensors"
# The source file's footprint (types and memory, `footprint.py`), so later loads can say it again.
FOOTPRINT_FILE = "gguf-footprint.json"
KEPT_KEY = "kept_types"  # in FOOTPRINT_FILE: the types the converting version kept (is_current)
# Set (true) in files of random weights (`python -m specextend.bench.gguf_files random`): loading one says so.
RANDOM_WEIGHTS_KEY = "specextend.random_weights"
# Written into the completion marker; a folder converted by an older version is converted again.
# 3: Q4_0, Q5_0 and IQ4_NL under q8's header (runtime/quant.py), at their files' bits a weight; 4: IQ4_XS
# without the minimum's header bytes; 5: Q4_1 and Q5_1 under q8's header with a minimum.
# 6: blobs first, 64-byte aligned, stacked parts (q, k, v; gate, up) side by side (models/qstore.py).
FORMAT = "specextend-quantized-6"

# GGUF `general.architecture` -> (HF model_type, HF architectures entry); each family's facts
# (Q/K permutation, norm offsets, tensor names, metadata, turn-end tokens) are in runtime/families.py.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {f.name: (f.model_type, f.hf_class) for f in FAMILIES.values()}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Tensors llama.cpp adds that have no HF weight: rope factors are folded back into the config.
_SKIPPED_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})

_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+(?:\.[a-z_]+)?)\.(weight|bias)$")  # LFM2's `shortconv.conv` too
_PER_EXPERT_RE = re.compile(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$")

# Weights converted at a time (`tensor_parts`): a few runs of this size are all the converting
# holds beside the reader, whatever the model's size.
CHUNK_WEIGHTS = 1 << 22


# --------------------------------------------------------------------------- reading


def _array_parts(plain: np.ndarray, orig_offs: int, scalar_types: dict[Any, Any]
                 ) -> tuple[int, list[Any], list[int], list[Any]] | None:
    """A little-endian array's parts as gguf's reader builds them (a length and its bytes a string,
    a one-value array a number), walked in one loop instead of one recursive call an element: a
    vocabulary's token and merge arrays are 300K elements (gguf's reader: 8.6 s a 152K-token header;
    this: 0.4 s). None for an array of arrays (gguf's own code reads those)."""
    from gguf import GGUFValueType

    raw_itype = plain[orig_offs : orig_offs + 4].view(np.uint32)
    alen = plain[orig_offs + 4 : orig_offs + 12].view(np.uint64)
    itype, n = GGUFValueType(int(raw_itype[0])), int(alen[0])
    parts: list[Any] = [raw_itype, alen]
    offs, size = orig_offs + 12, plain.size
    if itype == GGUFValueType.STRING:
        raw = memoryview(plain)
        for _ in range(n):
            if offs + 8 > size:
                raise ValueError("a string array runs past the end of the file")
            length = int.from_bytes(raw[offs : offs + 8], "little")
            if offs + 8 + length > size:
                raise ValueError("a string runs past the end of the file")
            parts.append(plain[offs : offs + 8].view(np.uint64))
            parts.append(plain[offs + 8 : offs + 8 + length])
            offs += 8 + length
        return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), [GGUFValueType.ARRAY, itype]
    nptype = scalar_types.get(itype)
    if nptype is None:
        return None
    if offs + np.dtype(nptype).itemsize * n > size:
        raise ValueError("an array runs past the end of the file")
    values = plain[offs : offs + np.dtype(nptype).itemsize * n].view(nptype)
    parts.extend(values[i : i + 1] for i in range(n))
    return 12 + values.nbytes, parts, list(range(2, n + 2)), [GGUFValueType.ARRAY, itype]


# Architectures whose files transformers' GGUF tokenizer loader reads (it refuses the others before
# it looks at the tokenizer, which it builds from the `tokenizer.ggml.*` keys alone).
_TRANSFORMERS_GGUF_ARCHS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"})


def _reader_class(architecture: str | None = None) -> type:
    """Our reader (see `Reader`); `architecture`: the name `general.architecture` reads as."""
    from gguf import GGUFReader, GGUFValueType

    class Reader(GGUFReader):
        """gguf's reader, its header read through a plain array over the same memory map: the
        reader slices it once a value and twice a string (a 152K-token vocabulary and its merges
        are a million and a half slices), and each slice of a `np.memmap` runs that subclass's
        Python hooks; a plain view's does not (a 0.5B file's header: 17 s -> 3 s). The data
        stays the map (`data`), its pages read and released as before."""

        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I" or \
                    int(plain[orig_offs + 4 : orig_offs + 12].view(np.uint64)[0]) == 0:
                return super()._get_field_parts(orig_offs, raw_type)  # scalars, big-endian files, empty arrays
            walked = _array_parts(plain, orig_offs, self.gguf_scalar_to_np)
            return super()._get_field_parts(orig_offs, raw_type) if walked is None else walked  # arrays of arrays

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            f = self.fields.get("general.architecture")
            if architecture is not None and f is not None and f.data:
                parts = list(f.parts)
                parts[f.data[0]] = np.frombuffer(architecture.encode(), dtype=np.uint8)
                self.fields["general.architecture"] = f._replace(parts=parts)

    return Reader


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """Open `path` with `gguf.GGUFReader`, turning every way a file can be broken into a UserError.

    The reader memory-maps the file and trusts its header; a truncated file can therefore parse
    and only fail (or silently read short) later, so tensor extents are checked here too.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}")
    try:
        reader = _reader_class()(path)
    except Exception as exc:  # the reader raises ValueError, KeyError, IndexError, OverflowError, ...
        raise UserError(f"{path} is not a valid GGUF file: {_short(exc)}") from exc
    size = int(reader.data.size)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise UserError(
                f"{path} is not a valid GGUF file: tensor {t.name} runs past the end of the file (truncated download?)"
            )
    if field(reader, "general.architecture") is None:
        raise UserError(f"{path} is not a valid GGUF file: no general.architecture key")
    return reader


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, list), or `default` if absent."""
    f = reader.fields.get(key)
    if f is None or not f.types:
        return default
    value = f.contents()
    if isinstance(value, float):
        # GGUF stores float32; its shortest decimal form is the number the model author wrote.
        value = float(str(np.float32(value)))
    return value


def _tensor_map(reader: Any) -> dict[str, Any]:
    return {t.name: t for t in reader.tensors}


# --------------------------------------------------------------------------- config


def gguf_architecture(reader: Any) -> str:
    """The GGUF architecture, checked against the ones we can convert."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"unsupported GGUF architecture {arch!r} (supported: {supported()})")
    return arch


def _hf_model_type(reader: Any, arch: str) -> str:
    """The family of a file llama.cpp filed under another's architecture: Mistral under "llama" (only the model
    name tells), Mixtral under "llama" (its experts tell), OLMo 3 under "olmo2" (its window tells), Granite MoE SWA
    under "granite_swa" (its experts tell)."""
    name = str(field(reader, "general.name", "") or "").lower()
    if arch == "llama" and field(reader, "llama.expert_count"):  # Mixtral: the llama block with experts
        return "mixtral"
    if arch == "olmo2" and field(reader, "olmo2.attention.sliding_window"):
        return "olmo3"
    if arch == "granite_swa" and field(reader, "granite_swa.expert_count"):  # Granite MoE SWA: its experts tell
        return "granitemoe_swa"
    if arch == "llama" and "mistral" in name:
        return "mistral"
    return arch


def gguf_to_hf_config(reader: Any) -> dict[str, Any]:
    """Build the Hugging Face `config.json` dict that describes the model in this GGUF."""
    arch = gguf_architecture(reader)
    family = FAMILIES[_hf_model_type(reader, arch)]
    model_type, hf_class = family.model_type, family.hf_class
    tensors = _tensor_map(reader)

    def key(name: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    n_heads = int(_uniform(key("attention.head_count"), "attention.head_count"))
    n_kv = _kv_heads(key("attention.head_count_kv", n_heads), family, n_heads)
    head_dim = int(key("attention.key_length", hidden // n_heads))
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise UserError("GGUF file has no token_embd.weight tensor")
    # The embedding's row count is authoritative: the tokenizer list can be shorter (padding rows).
    vocab_size = int(embd.shape[-1]) if len(embd.shape) > 1 else int(embd.shape[0])
    rope_theta = float(key("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length") or key("expert_feed_forward_length") or 0),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", family.rms_eps_default)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    config.update(_family_flags(arch, family, tensors))
    scaling = _rope_scaling(reader, arch, tensors)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta, **(scaling or {})}
    if scaling:
        config["rope_scaling"] = scaling
    # Rows un-permuted as llama's are (`_qk_heads`) are in rotate-half order: say so where HF's are not.
    config.update(family.gguf_config(key, config), **({QK_ROWS_KEY: ROTATE_HALF} if family.hf_interleaved_qk else {}))
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        value = field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


def _family_flags(arch: str, family: Family, tensors: dict[str, Any]) -> dict[str, Any]:
    """The config keys of a family that the file's tensors tell, or that transformers' defaults would get wrong."""
    out: dict[str, Any] = {}
    if family.gguf_permuted_qk:
        out["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch == "seed_oss":  # its output projection's bias, where the file has one (llama.cpp's is optional); no
        # dropout (its config's default is 0.1: a model transformers builds from the folder in training mode drops)
        out.update(attention_out_bias="blk.0.attn_output.bias" in tensors, residual_dropout=0.0)
    if arch == "qwen2":
        out["use_sliding_window"] = False
    return out


def _family(config: dict[str, Any]) -> Family:
    family = family_of(config)
    assert family is not None, "a config this module wrote names its family"
    return family


def _kv_heads(kv: Any, family: Family, n_heads: int) -> int:
    """The KV heads of the attention layers; a layer of none is a short convolution where the family has them
    (its gguf_config reads which)."""
    if family.gguf_conv_layers and isinstance(kv, list):
        kv = [h for h in kv if h] or [n_heads]
    return int(_uniform(kv, "attention.head_count_kv"))


def _uniform(value: Any, name: str) -> Any:
    """Some GGUFs store per-layer head counts as arrays; we only handle the uniform case."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise UserError(f"GGUF has a per-layer {name} ({sorted(set(value))}); not supported")
        return value[0]
    if value is None:
        raise UserError(f"GGUF is missing {name}")
    return value


def _rope_scaling(reader: Any, arch: str, tensors: dict[str, Any]) -> dict[str, Any] | None:
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind in ("linear", "yarn") and factor:
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if "rope_factors_short.weight" in tensors and "rope_factors_long.weight" in tensors:
        # Phi-3's LongRoPE: llama.cpp writes the factors as tensors and the magnitude factor as a key.
        scaling = {"rope_type": "longrope",
                   "short_factor": [float(x) for x in _dequantize(tensors["rope_factors_short.weight"]).reshape(-1)],
                   "long_factor": [float(x) for x in _dequantize(tensors["rope_factors_long.weight"]).reshape(-1)]}
        attn = field(reader, f"{arch}.rope.scaling.attn_factor")
        if attn is not None:
            scaling["attention_factor"] = float(attn)
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    if "rope_freqs.weight" in tensors:
        return _llama3_scaling_from_factors(reader, arch, tensors["rope_freqs.weight"])
    return None


def _llama3_scaling_from_factors(reader: Any, arch: str, tensor: Any) -> dict[str, Any]:
    """Recover Llama 3.x rope scaling from llama.cpp's precomputed per-frequency factors.

    llama.cpp stores the factors, not the parameters. The largest factor is `factor`; the other
    parameters have had the same values in every Llama 3.x release, which we check by recomputing.
    """
    stored = np.asarray(_dequantize(tensor), dtype=np.float64).reshape(-1)
    scaling = {
        "rope_type": "llama3",
        "factor": float(round(stored.max(), 4)),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    dim = len(stored) * 2
    expected = llama3_rope_factors(theta, dim, scaling)
    if not np.allclose(expected, stored, rtol=1e-3):
        raise UserError("GGUF has rope_freqs factors that do not match Llama 3 rope scaling; not supported")
    return scaling


def llama3_rope_factors(theta: float, dim: int, scaling: dict[str, Any]) -> np.ndarray:
    """The per-frequency divisors llama.cpp writes as `rope_freqs.weight` for Llama 3 scaling."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out)


# --------------------------------------------------------------------------- tensors


def hf_tensor_name(gguf_name: str, family: Family | None = None) -> str | None:
    """HF parameter name for a GGUF tensor name (of `family`'s files; None: Llama's names); None for
    tensors with no HF counterpart."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    if gguf_name in _SKIPPED_TENSORS:
        return None
    if family is not None and gguf_name in family.gguf_tensors:  # a whole name: a global tensor of the family's
        return family.gguf_tensors[gguf_name]
    if _PER_EXPERT_RE.match(gguf_name):
        raise UserError(f"GGUF tensor {gguf_name!r}: an old Mixtral file with one tensor an expert; convert the "
                        "model again with a recent llama.cpp (experts stacked in ffn_*_exps)")
    m = _LAYER_RE.match(gguf_name)
    names = _LAYER_TENSORS if family is None else {**_LAYER_TENSORS, **family.gguf_tensors}
    if m and m.group(2) in names:
        layer, kind, suffix = m.groups()
        # a parameter of its own in HF (llama.cpp's a bias or weight): a selection bias, attention sinks
        if names[kind].endswith((SELECT_BIAS, "expert_bias", "sinks")):
            return f"model.layers.{layer}.{names[kind]}"
        return f"model.layers.{layer}.{names[kind]}.{suffix}"
    raise UserError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent; cannot convert")


def permute_qk(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K rows for llama: per head, interleave the two rotary halves.

    HF rotates pairs (i, i + d/2) of each head; GGML rotates adjacent pairs (2i, 2i + 1).
    """
    shape = weights.shape
    return weights.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def unpermute_qk(weights: np.ndarray, n_heads: int, rot: int = 0) -> np.ndarray:
    """Inverse of `permute_qk`: restores the HF row order (`rot`: see `rotate_half_order`)."""
    return weights[rotate_half_order(weights.shape[0], n_heads, rot)]


def rotate_half_order(rows: int, n_heads: int, rot: int = 0) -> np.ndarray:
    """The rows of a Q/K projection whose rope rotates adjacent pairs (2i, 2i + 1) of each head, in
    the order whose rope rotates halves (i, i + rot/2): each head's even rows of its leading `rot`
    (0: all) then its odd ones, then the rest. Q and K reordered alike give the same scores."""
    d = rows // n_heads
    rot = rot or d
    head = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, d)])
    return (np.arange(n_heads)[:, None] * d + head[None, :]).reshape(-1)


def _dequantize(tensor: Any) -> np.ndarray:
    """The tensor as float32 in torch (row-major, HF) shape; `ReaderTensor.data` is already reversed."""
    return _float32(tensor.data, tensor.tensor_type, torch_shape(tensor))


def _float32(data: np.ndarray, tensor_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """GGUF values of `tensor_type` (a tensor's data, or some of its rows) as float32 of `shape`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(tensor_type)
    if qtype == GGMLQuantizationType.F32:
        out = np.array(data, dtype=np.float32)  # copy: leave the memory map read-only
    else:
        out = dequantize(data, qtype).astype(np.float32, copy=False)
    return np.ascontiguousarray(out.reshape(shape))


def _qk_heads(name: str, config: dict[str, Any]) -> tuple[int, int] | None:
    """Heads and rotated dimensions a head (0: all) to un-permute for a Q/K projection of an
    architecture llama.cpp permutes (or ropes the "norm" way as HF holds it), else None."""
    if not _family(config).gguf_permuted_qk:
        return None
    m = _LAYER_RE.match(name)
    kind = m.group(2) if m else ""
    if kind not in ("attn_q", "attn_k"):
        return None
    heads = int(config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"])
    return heads, int(int(config["head_dim"]) * float(config.get("partial_rotary_factor") or 1.0))


def hf_tensor(tensor: Any, config: dict[str, Any]) -> np.ndarray:
    """Dequantise one GGUF tensor and undo what llama.cpp's converter did to it: the Q/K permutation
    and the norm offset, where it applied them."""
    out = _dequantize(tensor)
    heads = _qk_heads(tensor.name, config)
    if heads is not None:
        out = unpermute_qk(out, *heads)
    shift = _family(config).gguf_norm_shift
    if shift and tensor.name.endswith("norm.weight"):  # back to the HF weight (Gemma's 1 + w norms)
        out = out - np.float32(shift)
    if _is_conv_kernel(tensor.name, out.ndim):  # HF's Conv1d weight [channels, 1, length]
        out = out.reshape(out.shape[0], 1, out.shape[1])
    return np.ascontiguousarray(out)


def _is_conv_kernel(name: str, dims: int) -> bool:
    """Whether a tensor of `dims` dimensions is a depthwise convolution's kernel (LFM2's `shortconv.conv`), which
    llama.cpp's converter squeezed to [channels, length]."""
    return name.endswith("shortconv.conv.weight") and dims == 2


def type_name(tensor: Any) -> str:
    """The tensor's GGUF type name (`Q4_K`, `F32`, `IQ2_XXS`, ...)."""
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(tensor.tensor_type).name


def kept_format(tensor: Any) -> Any:
    """The format the kernels keep the tensor in with its own quantization grid (a `quant.Segment`
    of the whole tensor's n and k, its blob a stand-in: its first row repacked), or None when its
    type is not one the kernels compute with as it is (it is then stored as float32)."""
    from ..runtime import quant

    kind = type_name(tensor)
    if not is_kept(kind, tuple(int(d) for d in tensor.shape)):
        return None
    n, k = _rows(tensor), int(tensor.shape[0])
    first = quant.from_gguf_blocks(kind, np.asarray(_matrix(tensor)[:1]), 1, k)
    return quant.Segment(first.fmt, n, first.blob, first.offset, first.k, first.groups)


def _rows(tensor: Any) -> int:
    """A matrix's rows; a stack of experts' matrices ([experts, rows, width], llama.cpp's `ffn_*_exps`)
    counts every expert's rows, one expert after the other."""
    return math.prod(int(d) for d in tensor.shape[1:])


def _matrix(tensor: Any) -> np.ndarray:
    """The tensor's data as [rows, bytes a row] (a stack of experts' matrices as one of all their rows)."""
    return tensor.data.reshape(_rows(tensor), -1)


def tensor_parts(reader: Any, tensor: Any, config: dict[str, Any], kept: bool) -> Iterator[Any]:
    """The tensor converted in runs of rows, in order: kept ones in the kernels' layout
    (`quant.Segment`s), others as float32 torch tensors; llama.cpp's Q/K permutation undone.

    A run is a whole number of the kernels' 16-row panels, so the runs' blobs joined are the
    whole tensor's blob; converting one run at a time keeps the repacking's or expansion's
    temporaries to a few runs' worth, not a few copies of the largest tensor (the token
    embedding of a 150K-token vocabulary: hundreds of MB a copy). Each run's pages of the mapped
    file are released once it is converted."""
    import torch

    from ..runtime import quant

    heads = _qk_heads(tensor.name, config)
    small = len(tensor.shape) != 2 and not (kept and len(tensor.shape) == 3)
    if small or _is_conv_kernel(tensor.name, len(tensor.shape)):  # norms, biases, a convolution's kernel: whole
        yield torch.from_numpy(hf_tensor(tensor, config))
        _release(reader, int(tensor.data_offset), int(tensor.n_bytes))
        return
    n, k = _rows(tensor), int(tensor.shape[0])
    data = _matrix(tensor)
    kind = type_name(tensor)
    # Rows are output channels; unpermuting moves each row's blocks as a whole.
    order = None if heads is None else rotate_half_order(n, *heads)
    step = max(quant.PANEL, CHUNK_WEIGHTS // k // quant.PANEL * quant.PANEL)
    row_bytes = int(tensor.n_bytes) // n
    for start in range(0, n, step):
        rows = slice(start, min(n, start + step))
        raw = data[rows] if order is None else data[order[rows]]
        count = rows.stop - start
        if kept:
            yield quant.from_gguf_blocks(kind, np.asarray(raw), count, k)
        else:
            yield torch.from_numpy(_float32(raw, tensor.tensor_type, (count, k)))
        del raw
        if order is None:
            _release(reader, int(tensor.data_offset) + start * row_bytes, count * row_bytes)
    if order is not None:
        _release(reader, int(tensor.data_offset), int(tensor.n_bytes))


def torch_shape(tensor: Any) -> tuple[int, ...]:
    """The tensor's shape as torch (and Hugging Face) orders it: GGUF lists dimensions fastest first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def hf_shape(tensor: Any) -> tuple[int, ...]:
    """The HF parameter's shape of a GGUF tensor: its torch shape, but a depthwise convolution's kernel [channels,
    1, length] (`hf_tensor`)."""
    shape = torch_shape(tensor)
    return (shape[0], 1, shape[1]) if _is_conv_kernel(tensor.name, len(shape)) else shape


def write_weights(reader: Any, config: dict[str, Any], out: Path, progress: bool = True) -> list[str]:
    """Write `model.safetensors`: quantized tensors in the kernels' layout with their GGUF grid
    unchanged (see `runtime/quant.py`), every other tensor as float32; returns the file names.

    A 4-bit model stays about the size of its GGUF file (the default target: 1.2 GB, where
    float32 would take 7 GB), and loading it is a plain read. Tensors are converted a run of rows
    at a time as they are written (`tensor_parts`), so converting holds a few runs, whatever the
    model's size: each kept tensor's format is planned from its first row.
    """
    import torch
    from tqdm import tqdm

    from ..runtime import quant
    from .qstore import stream_tensors

    family = _family(config)
    tensors = {name: t for t in reader.tensors if (name := hf_tensor_name(t.name, family)) is not None}
    floats: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    segments: dict[str, quant.Segment] = {}
    for name, tensor in tensors.items():
        planned = kept_format(tensor)
        if planned is None:
            floats[name] = (torch.float32, hf_shape(tensor))
        else:
            segments[name] = planned

    with tqdm(total=len(tensors), unit="tensor", desc="convert", file=sys.stderr, disable=not progress) as bar:

        def produce(name: str) -> Iterator[Any]:
            bar.update(1)
            return tensor_parts(reader, tensors[name], config, name in segments)

        stream_tensors(out / WEIGHTS_FILE, floats, segments, produce)
    return [WEIGHTS_FILE]


def _release(reader: Any, offset: int, size: int) -> None:
    """Drop the pages of the memory-mapped file under bytes [offset, offset + size) from this
    process (they are read again from the file if ever needed): else every page read stays
    resident until the end, and the conversion's peak would grow to the whole file."""
    import mmap

    region = getattr(reader.data, "base", None)
    if not isinstance(region, mmap.mmap) or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = offset // page * page
    end = min(-(-(offset + size) // page) * page, len(region))
    with contextlib.suppress(OSError, ValueError):
        region.madvise(mmap.MADV_DONTNEED, start, end - start)


def file_footprint(reader: Any, path: str | os.PathLike[str], kernel_path: str | None) -> Footprint:
    """The footprint (types, counts, bytes, memory once loaded) of the GGUF file open in `reader`."""
    tensors: list[tuple[str, TensorInfo]] = []
    arch = str(field(reader, "general.architecture"))
    for t in reader.tensors:
        try:
            if hf_tensor_name(t.name, FAMILIES.get(arch)) is None:
                continue
        except UserError:
            pass  # counted all the same: inspect describes what the file holds
        bias = t.name.endswith(".bias") or _is_conv_kernel(t.name, len(t.shape))  # float32 as it is, like a bias
        router = ".ffn_gate_inp" in t.name and not bias
        tensors.append((t.name, TensorInfo(type_name(t), tuple(int(d) for d in t.shape), int(t.n_bytes), router,
                                           bias)))
    fp = footprint(path, arch, [t for _, t in tensors], kernel_path)
    fp.random_weights = bool(field(reader, RANDOM_WEIGHTS_KEY, False))
    if "tokenizer.ggml.tokens" in reader.fields:
        fp.tokenizer = pretokenize.describe(len(reader.fields["tokenizer.ggml.tokens"].data), vocabulary_keys(reader))
    fp.chat_template = field(reader, "tokenizer.chat_template")
    count, used = field(reader, f"{arch}.expert_count"), field(reader, f"{arch}.expert_used_count")
    if count and used:
        fp.experts = expert_share(int(count), int(used), tensors)
    try:
        fp.config = gguf_to_hf_config(reader)
    except UserError as e:
        fp.unsupported = str(e)
    return fp


def recorded_footprint(folder: str | os.PathLike[str]) -> Footprint | None:
    """The footprint a conversion recorded in `folder`, or None (none recorded, or unreadable)."""
    try:
        return Footprint.from_json(json.loads((Path(folder) / FOOTPRINT_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def announce(fp: Footprint) -> None:
    """Say at load what is expanded, and that random weights are random (never silent, even with -q:
    the model that runs is not the file's own, or means nothing)."""
    for line in (notice(fp), random_notice(fp)):
        if line:
            print(f"specextend: {line}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tokenizer


def eos_token_ids(reader: Any, arch: str) -> list[int]:
    """Every id that should stop generation: the file's EOS, EOT/EOM, and the family's turn-end tokens."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = field(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    wanted = FAMILIES[arch].eos_tokens if arch in FAMILIES else ()
    if wanted:
        tokens_field = reader.fields.get("tokenizer.ggml.tokens")
        if tokens_field is not None:
            position = _find_tokens(tokens_field, wanted)
            for token in wanted:
                if token in position and position[token] not in ids:
                    ids.append(position[token])
    return ids


def _find_tokens(tokens_field: Any, wanted: tuple[str, ...]) -> dict[str, int]:
    """Ids of `wanted` token strings, without decoding the whole vocabulary into Python strings."""
    targets = {t.encode("utf-8"): t for t in wanted}
    found: dict[str, int] = {}
    for token_id, part_index in enumerate(tokens_field.data):
        part = tokens_field.parts[part_index]
        if part.nbytes in {len(b) for b in targets}:
            raw = part.tobytes()
            if raw in targets:
                found[targets[raw]] = token_id
    return found


def vocabulary_keys(reader: Any) -> pretokenize.Vocabulary:
    """The `tokenizer.ggml.*` keys `pretokenize`'s rules read."""
    keys = ("model", "pre", "add_space_prefix", "add_bos_token", "bos_token_id")
    return pretokenize.Vocabulary(*(field(reader, f"tokenizer.ggml.{key}") for key in keys))


def write_tokenizer(gguf_path: Path, out: Path, chat_template: str | None, architecture: str | None = None,
                    vocabulary: pretokenize.Vocabulary | None = None) -> None:
    """Rebuild the HF tokenizer from the GGUF metadata (via transformers) and save it into `out`.
    `vocabulary`: the file's `vocabulary_keys` (read again if not given), by which its text becomes
    llama.cpp's ids (`pretokenize`).

    transformers 5 saves the chat template as `chat_template.jinja`; we also keep a copy in
    `tokenizer_config.json` so that readers that only look there find it.
    """
    import gguf
    from transformers import AutoTokenizer

    # transformers opens the file with `gguf.GGUFReader` (twice): ours reads a 152K-token header
    # in under a second, gguf's in eight (`_reader_class`). Conversions run one at a time (pull
    # converts one model after the other, under its lock), so patching the module is safe.
    # A family transformers does not read (Granite, SmolLM3, OLMo 2) has its tokenizer read as a
    # Llama file's: the tokenizer is the same kind of file either way.
    arch = architecture or field(open_gguf(gguf_path), "general.architecture")
    stand_in = None if arch in _TRANSFORMERS_GGUF_ARCHS else "llama"
    try:
        with unittest.mock.patch.object(gguf, "GGUFReader", _reader_class(stand_in)):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as exc:  # transformers raises many types for vocabularies it cannot rebuild
        raise UserError(f"cannot build a tokenizer from {gguf_path}: {_short(exc)}") from exc
    if chat_template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = chat_template
    notice = pretokenize.apply(tokenizer, vocabulary or vocabulary_keys(open_gguf(gguf_path)))
    if notice:
        print(f"specextend: {gguf_path.name}: {notice}", file=sys.stderr, flush=True)
    tokenizer.save_pretrained(str(out))
    for required in ("tokenizer.json", "tokenizer_config.json"):
        if not (out / required).is_file():
            raise UserError(f"tokenizer conversion of {gguf_path} did not write {required}")
    if chat_template:
        config_path = out / "tokenizer_config.json"
        tok_config = json.loads(config_path.read_text())
        if not tok_config.get("chat_template"):
            tok_config["chat_template"] = chat_template
            config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n")


def generation_config(reader: Any, config: dict[str, Any]) -> dict[str, Any]:
    """A `generation_config.json` dict: greedy by default, stopping on every EOS id we know."""
    gen_config: dict[str, Any] = {"eos_token_id": eos_token_ids(reader, gguf_architecture(reader))}
    for key in ("bos_token_id", "pad_token_id"):
        if key in config:
            gen_config[key] = config[key]
    gen_config["do_sample"] = False
    return gen_config


# --------------------------------------------------------------------------- folder


def is_complete(folder: str | os.PathLike[str]) -> bool:
    """True only for a folder whose conversion finished (it carries the `.complete` marker)."""
    return (Path(folder) / COMPLETE_MARKER).is_file()


def is_current(folder: str | os.PathLike[str]) -> bool:
    """A finished conversion in this version's format (older ones hold float32 shards) that expanded
    no type this version keeps (a file converted before its type was kept is converted again), and
    whose tokenizer the rules of `pretokenize` would not change (one converted before them that they
    may change is converted again; one they leave as it is gets their stamp)."""
    marker = Path(folder) / COMPLETE_MARKER
    stamps = marker.read_text().split() if marker.is_file() else []
    if FORMAT not in stamps:
        return False
    if pretokenize.RULES_VERSION not in stamps:
        if pretokenize.cut_otherwise(Path(folder) / "tokenizer.json"):
            return False  # converted before the tokenizer rules, and they may change its tokens
        _stamp(marker, pretokenize.RULES_VERSION)  # the rules change nothing here: checked once
    try:
        data = json.loads((Path(folder) / FOOTPRINT_FILE).read_text())
        expanded = {r["type"] for r in data["types"] if r["expanded"]}
    except (OSError, ValueError, KeyError, TypeError):
        return True  # no footprint recorded: nothing to compare
    # Converted by this version's kernels (whatever it expanded, it expands still), or nothing it
    # expanded is a type kept now.
    kept = kept_types()
    return data.get(KEPT_KEY) == kept or not expanded & set(kept)


def _stamp(marker: Path, stamp: str) -> None:
    """Add `stamp` to a conversion's marker (atomically: a reader sees the old marker or the new one;
    a cache it cannot write only means checking again next time)."""
    with contextlib.suppress(OSError):
        tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
        tmp.write_text(marker.read_text().rstrip("\n") + f"\n{stamp}\n")
        tmp.replace(marker)


def kept_types() -> list[str]:
    """The GGUF types this version computes with as they are (recorded in each conversion)."""
    from ..runtime import quant

    return sorted(quant.GGUF_BLOCKS)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out_dir: Path) -> None:
    """Delete temp folders left next to `out_dir` by conversions whose process has died.

    They can be several GB each; without this every killed run would leak one.
    """
    for tmp in out_dir.parent.glob(f"{out_dir.name}.tmp-*"):
        suffix = tmp.name.rsplit(".tmp-", 1)[-1]
        if suffix.isdigit() and int(suffix) != os.getpid() and not pid_alive(int(suffix)):
            shutil.rmtree(tmp, ignore_errors=True)


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished `tmp` into `out_dir`, replacing whatever (complete or not) was there."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f"{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    progress: bool = True,
    tokenizer: bool = True,
    available_mb: Callable[[], float | None] | None = None,
) -> Path:
    """Convert `gguf_path` into an HF model folder at `out_dir`, atomically; returns `out_dir`.

    `tokenizer=False` skips the tokenizer files (for files without tokenizer metadata, e.g. tests).
    Before anything is written, a model whose first load would not fit in `available_mb()` MB
    (default: the host's MemAvailable) is refused (UserError), and types the kernels do not compute
    with are named (`footprint.py`).
    """
    from .footprint import active_kernel_path

    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    reader = open_gguf(gguf_path)
    config = gguf_to_hf_config(reader)
    fp = file_footprint(reader, gguf_path, active_kernel_path())
    check_fits(fp, available_mb or meminfo.available_memory_mb)
    announce(fp)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write_weights(reader, config, tmp, progress=progress)
        _write_json(tmp / "config.json", config)
        _write_json(tmp / FOOTPRINT_FILE, {**fp.as_json(), KEPT_KEY: kept_types()})
        _write_json(tmp / "generation_config.json", generation_config(reader, config))
        has_tokens = "tokenizer.ggml.tokens" in reader.fields
        arch = field(reader, "general.architecture")
        chat_template = field(reader, "tokenizer.chat_template")
        vocabulary = vocabulary_keys(reader)
        # Dropped (with its memory map) before transformers reads the file again for the tokenizer:
        # the reader's metadata holds a few Python objects per token (hundreds of MB for a 150K-token
        # vocabulary), and both at once made the tokenizer the conversion's peak.
        reader = None
        if tokenizer and has_tokens:
            write_tokenizer(gguf_path, tmp, chat_template, arch, vocabulary)
        elif tokenizer:
            print(f"specextend: {gguf_path.name} has no tokenizer; folder has weights only", file=sys.stderr)
        _fsync_dir_files(tmp)
        (tmp / COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n{FORMAT}\n{pretokenize.RULES_VERSION}\n")
        _install(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader = None  # drop the memory map before returning
    return out_dir


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _fsync_dir_files(folder: Path) -> None:
    """Flush file contents before the marker exists, so a power cut cannot leave a marked, empty file."""
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
