"""Load a model folder into `runtime.transformer.Transformer`: a Hugging Face checkpoint (config.json +
safetensors) or our converted GGUF folder (`qstore`: kept quantization grids).

Loading is two steps: `resolve_model` reads the folder's config.json (once) and settles the
dtype and the concrete weight scheme into a `ResolvedModel`; `build_model` reads the weights
and builds the `Transformer` from that description, reading no config again. `load_model` does
both for one folder (tests, tools); a pair is resolved by `models.resolve`.

Hugging Face names map onto our fused layout here: q/k/v projections become one `qkv`
matrix and gate/up one `gate_up` matrix, so a decode step makes 4 matrix calls per layer
instead of 7. The weight scheme (`--weights`) decides each projection's form: the GGUF's own
grids, int8 or int4 for the C++ kernels (computed once and stored, see `DerivedWeights`), or a
float dtype for PyTorch's kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..common import meminfo
from ..common.errors import UserError
from ..runtime import quant
from ..runtime.config import ModelConfig
from ..runtime.experts import BIASED
from ..runtime.families import FAMILIES, SELECT_BIAS, hf_norm_names
from ..runtime.layers import Block, Embedding, Experts, Linear, rope_inv_freq
from ..runtime.quant import QWeight
from ..runtime.transformer import Transformer
from .gguf import rotate_half_order
from .qstore import DerivedWeights, QuantizedFile, is_quantized_file

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# Weight schemes (`--weights`): quantized ones run on the C++ CPU kernels with float32
# activations; float ones run the whole model in that dtype.
QUANTIZED_WEIGHTS = ("gguf", "int8", "int4")
WEIGHTS = ("auto", *QUANTIZED_WEIGHTS, "float32", "bfloat16", "float16", "float64")


def check_weights(weights: str) -> str:
    if weights not in WEIGHTS:
        raise UserError(f"unknown --weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    return weights


def fast_kernels() -> bool:
    """Whether the quantized kernels build here and run a vector path (AVX-512, AVX2 or NEON)."""
    from ..runtime import kernels

    return kernels.has_fast_path()


def resolve_weights(weights: str, dtype: torch.dtype, device: torch.device | str, quantized_source: bool,
                    draft: bool = False) -> str:
    """The concrete weight scheme for `weights` (see WEIGHTS); UserError for a combination that cannot run.

    A draft only proposes (the target decides every token), so its automatic choice is 4-bit
    weights, the fewest bytes a step: a faster draft forward for a little less acceptance
    (docs/benchmarks.md, "Measured choices")."""
    check_weights(weights)
    device = torch.device(device)
    if weights == "auto":
        if device.type == "cpu" and dtype == torch.float32 and fast_kernels():
            return "int4" if draft else "gguf" if quantized_source else "int8"
        return next(name for name, d in DTYPES.items() if d == dtype)
    if weights in QUANTIZED_WEIGHTS:
        if device.type != "cpu":
            raise UserError(f"--weights {weights} runs on the CPU kernels; on {device.type} use a float scheme")
        if dtype != torch.float32:
            raise UserError(f"--weights {weights} computes in float32; drop --dtype or pass --dtype float32")
        if weights == "gguf" and not quantized_source:
            raise UserError("--weights gguf keeps a GGUF file's quantization; this model is stored in float "
                            "(use int8 or int4)")
        from ..runtime import kernels

        kernels.path()  # a forced kernel path this CPU cannot run is refused here, before any weight is read
    return weights


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise UserError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"device {name!r} requested but no CUDA device is available")
        return torch.device(name)
    raise UserError(f"unknown device {name!r}; choose cpu or cuda")


def default_draft_dtype(dtype: str, device: str, weights: str = "auto") -> str:
    """The draft's precision when none is asked for.

    The draft only proposes; the target decides every token, so the draft's precision can
    never change the output, only how often its guesses are accepted. Quantized weights compute
    in float32. Otherwise a decode step is bound by reading weights, so on a CPU with native
    bfloat16 dot products (AVX512-BF16/AMX) a bfloat16 draft runs faster than float32 with the
    same acceptance (docs/benchmarks.md, "Measured choices"). float64 (exactness tests) and GPUs keep the
    target's.
    """
    if weights in QUANTIZED_WEIGHTS or (weights == "auto" and dtype == "float32" and device == "cpu"
                                        and fast_kernels()):
        return dtype
    if dtype == "float32" and device == "cpu" and torch.backends.mkldnn.is_available():
        try:
            if torch.ops.mkldnn._is_mkldnn_bf16_supported():
                return "bfloat16"
        except (AttributeError, RuntimeError):
            pass
    return dtype


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not folder.is_dir():
        raise UserError(f"model path not found: {folder}")
    if not path.is_file():
        raise UserError(f"{folder} is not a model folder: no config.json")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise UserError(f"{index} is malformed: {e}") from None
        files = [folder / n for n in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"{folder}: missing weight shards {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UserError(f"{folder} is not a model folder: no .safetensors weights")
    return files


class _Tensors:
    """Lazy access to every tensor of a (possibly sharded) Hugging Face safetensors checkpoint."""

    quantized = False  # float tensors only (see `qstore.QuantizedFile` for the other kind)

    def __init__(self, files: list[Path]) -> None:
        self.where: dict[str, Any] = {}
        self.handles = []
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
                keys = list(h.keys())
            except (SafetensorError, OSError, ValueError) as e:
                raise UserError(f"{f} is corrupt or truncated: {e}") from None
            self.handles.append(h)
            for k in keys:
                self.where[k] = (h, f)

    def get(self, name: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        h, f = self._where(name)
        try:
            t = h.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise UserError(f"{f} is corrupt or truncated: {e}") from None
        return t.to(dtype) if out is None else out.copy_(t)

    def shape(self, name: str) -> tuple[int, ...]:
        h, _ = self._where(name)
        return tuple(h.get_slice(name).get_shape())

    def _where(self, name: str) -> tuple[Any, Path]:
        if name not in self.where:
            raise UserError(f"checkpoint is missing tensor {name}")
        return self.where[name]

    def has(self, name: str) -> bool:
        return name in self.where

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def segment(self, name: str, mapped: bool = True, streamed: bool = True) -> None:
        return None  # a Hugging Face checkpoint holds float tensors only

    def stacked_segments(self, names: list[str]) -> None:
        return None


_QK = re.compile(r"model\.layers\.\d+\.self_attn\.([qk])_proj\.(weight|bias)$")


def qk_row_order(name: str, cfg: ModelConfig) -> torch.Tensor | None:
    """A Q/K projection's rows (weight or bias) in rotate-half order (`gguf.rotate_half_order`, over
    the rotated part of each head), for a family whose checkpoints rotate adjacent pairs; None for any
    other tensor."""
    m = _QK.match(name)
    if m is None:
        return None
    heads = cfg.num_heads if m.group(1) == "q" else cfg.num_kv_heads
    return torch.from_numpy(rotate_half_order(heads * cfg.head_dim, heads, cfg.rotary_dim))


class _RotateHalfRows:
    """A Hugging Face checkpoint whose Q/K rows rotate adjacent pairs (GLM, ERNIE), read with each
    head's rows in rotate-half order (`ModelConfig.qk_rows_interleaved`): the runtime's rope."""

    def __init__(self, inner: Any, cfg: ModelConfig) -> None:
        if cfg.qk_norm:
            raise UserError(f"a {cfg.arch} checkpoint with q/k norms and rope on adjacent pairs is not supported")
        self.inner, self.cfg = inner, cfg

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def get(self, name: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        order = qk_row_order(name, self.cfg)
        if order is None:
            return self.inner.get(name, dtype, out)
        t = self.inner.get(name, dtype)[order]
        return t if out is None else out.copy_(t)


class _Renamed:
    """A checkpoint of a family that names weights otherwise than Llama (`Family.hf_names`), read by Llama's names."""

    def __init__(self, inner: Any, names: dict[str, str]) -> None:
        self.inner, self.names = inner, names

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _name(self, name: str) -> str:
        for ours, theirs in self.names.items():
            if ours in name:
                return name.replace(ours, theirs)
        return name

    def get(self, name: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.get(self._name(name), dtype, out)

    def has(self, name: str) -> bool:
        return self.inner.has(self._name(name))

    def shape(self, name: str) -> tuple[int, ...]:
        return self.inner.shape(self._name(name))

    def segment(self, name: str, mapped: bool = True, streamed: bool = True) -> Any:
        return self.inner.segment(self._name(name), mapped, streamed)

    def stacked_segments(self, names: list[str]) -> Any:
        return self.inner.stacked_segments([self._name(n) for n in names])


def holds_quantized_file(folder: Path) -> bool:
    """Whether the folder's weights are our quantized file (a converted GGUF), not a Hugging Face checkpoint."""
    single = folder / "model.safetensors"
    return single.is_file() and is_quantized_file(single)


def open_tensors(folder: Path) -> Any:
    """The folder's weights: our quantized file (a converted GGUF) or a Hugging Face checkpoint."""
    if holds_quantized_file(folder):
        return QuantizedFile(folder / "model.safetensors")
    return _Tensors(_weight_files(folder))


@dataclass(frozen=True)
class ResolvedModel:
    """One model as it will be loaded: its folder, its config (config.json, read once), the dtype of
    activations and KV cache, the concrete weight scheme (never "auto") and the end-of-sequence ids
    its files name."""

    path: Path
    config: ModelConfig
    dtype: str  # a DTYPES name
    weights: str  # a WEIGHTS name other than "auto"
    eos_ids: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def resolve_model(folder: Path, dtype: str = "float32", device: torch.device | str = "cpu", weights: str = "auto",
                  draft: bool = False, context: int | None = None) -> ResolvedModel:
    """Read `folder`'s config and settle its weight scheme (see `resolve_weights`); no weights are read.
    `context`: the longest sequence it serves (`ModelConfig.with_context`; None: the model's default;
    a draft's is cut to its own limit)."""
    hf_config = read_config(folder)
    config = ModelConfig.from_hf(hf_config)  # an unsupported architecture is refused before any weight file is read
    if context is not None:
        config = config.with_context(min(context, config.longest) if draft else context)
    scheme = resolve_weights(weights, parse_dtype(dtype), device, holds_quantized_file(folder), draft)
    return ResolvedModel(folder, config, dtype, scheme, _eos_ids(folder, hf_config))


def load_model(folder: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               pack: bool = True, weights: str = "auto", draft: bool = False, context: int | None = None
               ) -> Transformer:
    """Resolve and build one model folder with the weight scheme `weights` (see WEIGHTS)."""
    name = next(n for n, d in DTYPES.items() if d == dtype)
    return build_model(resolve_model(folder, name, device, weights, draft, context), device, pack)


def build_model(m: ResolvedModel, device: torch.device | str = "cpu", pack: bool = True) -> Transformer:
    """Build a `Transformer` from a resolved model, reading its weights (and nothing else).

    Quantized schemes keep activations and the KV cache in `m.dtype` (float32); float schemes run
    the whole model in their dtype. `pack` prepares the fast CPU kernels of float weights.
    """
    ts = open_tensors(m.path)
    quantized = m.weights in QUANTIZED_WEIGHTS
    act = m.torch_dtype if quantized else DTYPES[m.weights]
    derived = DerivedWeights(derived_path(m.path, m.weights)) if quantized else None
    inv_freq = rope_inv_freq(m.config).to(device)
    with torch.device("meta"):
        model = Transformer(m.config, inv_freq)
    if m.config.qk_rows_interleaved:
        ts = _RotateHalfRows(ts, m.config)
    names = FAMILIES[m.config.arch].hf_names
    if names:
        ts = _Renamed(ts, names)
    _fill(model, _Weights(ts, act, device, derived, m.weights))
    if derived is not None:
        derived.save()
    model.inv_freq = inv_freq
    if m.config.local_rope_theta is not None:  # built on the meta device above, like inv_freq
        model.inv_freq_local = rope_inv_freq(m.config, local=True).to(device)
    model.weights = m.weights
    model.rowwise_attention = quantized
    model.eval()
    if pack:
        model.pack()
    meminfo.release_free_heap()
    return model


class _Weights:
    """Where a model's parameters come from: the checkpoint's tensors in the activation dtype, or
    quantized where the scheme asks and the shape allows (computed ones through `derived`)."""

    def __init__(self, ts: Any, act: torch.dtype, device: torch.device | str, derived: DerivedWeights | None,
                 scheme: str) -> None:
        self.ts, self.act, self.device, self.derived, self.scheme = ts, act, device, derived, scheme

    def param(self, name: str) -> torch.nn.Parameter:
        return self.wrap(self.ts.get(name, self.act))

    def wrap(self, t: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(t.to(self.device), requires_grad=False)

    def project(self, mod: Linear | Embedding, names: list[str], rows: int | None, width: int,
                streamed: bool = True) -> None:
        """Give one projection (or the embedding) its weights: quantized where the scheme asks
        and the shape allows, else float; `rows` None means any number of output rows; `streamed`
        False: only looked up by row (an untied embedding)."""
        q = _quantized(self.ts, names, self.scheme, self.derived, streamed) if self.derived is not None else None
        if q is not None:
            _check_shape((q.n, q.k), (rows or q.n, width), names[0])
            mod.quantize(q)
            return
        w = self.stacked(names)
        _check_shape(tuple(w.shape), (rows or w.shape[0], width), names[0])
        mod.weight = self.wrap(w)

    def stacked(self, names: list[str]) -> torch.Tensor:
        return _stacked(self.ts, names, self.act)


def _stacked(ts: Any, names: list[str], dtype: torch.dtype) -> torch.Tensor:
    """The tensors' rows one after the other, each written into its place (a weight of several
    GB is not made twice, as a concatenation would)."""
    if len(names) == 1:
        return ts.get(names[0], dtype)
    shapes = [ts.shape(n) for n in names]
    if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
        raise UserError(f"{', '.join(names)} cannot be stacked: shapes {', '.join(map(str, shapes))}")
    w = torch.empty(sum(s[0] for s in shapes), shapes[0][1], dtype=dtype)
    r = 0
    for n, s in zip(names, shapes, strict=True):
        ts.get(n, dtype, out=w[r : r + s[0]])
        r += s[0]
    return w


def _fill(model: Transformer, w: _Weights) -> None:
    """Every parameter of `model` (built on the meta device) from the checkpoint's Hugging Face names."""
    cfg = model.cfg
    h = cfg.hidden_size
    if cfg.arch == "gpt-oss" and w.ts.has("model.layers.0.mlp.router.weight"):
        # transformers' layout: experts' gate and up interleaved in one tensor, often as MXFP4 blocks
        raise UserError("a gpt-oss Hugging Face checkpoint is not supported yet: load the model's GGUF")

    def norm(name: str) -> torch.nn.Parameter:
        # Gemma's norms scale by (1 + weight): the 1 is added here, once, in the activations' dtype,
        # so every path (the folded kernels' norms included) multiplies by the weight alone.
        t = w.ts.get(name, w.act)
        return w.wrap(t + 1 if cfg.norm_plus_one else t)

    tied = cfg.tie_word_embeddings or not w.ts.has("lm_head.weight")
    w.project(model.embed, ["model.embed_tokens.weight"], cfg.vocab_size, h, streamed=tied)
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if blk.conv is not None:  # LFM2's short convolution: its two projections and kernel [hidden, 1, kernel]
            w.project(blk.qkv, [p + "conv.in_proj.weight"], 3 * h, h)
            w.project(blk.o, [p + "conv.out_proj.weight"], h, h)
            kernel = w.ts.get(p + "conv.conv.weight", w.act)
            blk.conv = w.wrap(_checked(kernel, (h, 1, cfg.conv_kernel), p + "conv.conv.weight").reshape(h, -1))
            _fill_mlp(blk, w, p, cfg, norm)
            continue
        # Fused q/k/v and gate/up checkpoints (Phi-3) already hold our layout.
        fused_qkv = w.ts.has(a + "qkv_proj.weight")
        w.project(blk.qkv, [a + "qkv_proj.weight"] if fused_qkv else [a + f"{n}_proj.weight" for n in "qkv"], None, h)
        if blk.qkv.bias is not None:
            blk.qkv.bias = w.wrap(torch.cat([w.ts.get(a + f"{n}_proj.bias", w.act) for n in "qkv"]))
        w.project(blk.o, [a + "o_proj.weight"], h, cfg.num_heads * cfg.head_dim)
        if blk.o.bias is not None:
            blk.o.bias = w.wrap(w.ts.get(a + "o_proj.bias", w.act))
        if blk.sinks is not None:  # one logit a query head (a GGUF's `attn_sinks.weight`)
            blk.sinks = w.wrap(w.ts.get(a + "sinks" if w.ts.has(a + "sinks") else a + "sinks.weight", w.act))
        _fill_mlp(blk, w, p, cfg, norm)
        if blk.q_norm is not None:
            blk.q_norm.weight = norm(a + "q_norm.weight")
            blk.k_norm.weight = norm(a + "k_norm.weight")
    model.norm.weight = norm("model.norm.weight")
    if tied:
        if model.embed.qweight is not None:
            model.lm_head.quantize(model.embed.qweight)
        else:
            model.lm_head.weight = model.embed.weight
    else:
        w.project(model.lm_head, ["lm_head.weight"], cfg.vocab_size, h)


def _fill_mlp(blk: Block, w: _Weights, p: str, cfg: ModelConfig, norm: Callable[[str], torch.nn.Parameter]) -> None:
    """A layer's MLP (dense, or its experts) and its block norms."""
    h = cfg.hidden_size
    if blk.moe is not None:
        _fill_experts(blk.moe, w, p + "mlp.", cfg)
    else:
        gate_up = [p + "mlp.gate_up_proj.weight"] if w.ts.has(p + "mlp.gate_up_proj.weight") else \
            [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        w.project(blk.gate_up, gate_up, 2 * cfg.intermediate_size, h)
        w.project(blk.down, [p + "mlp.down_proj.weight"], h, cfg.intermediate_size)
    for place, hf in hf_norm_names(cfg.norms, cfg.arch).items():
        getattr(blk, place).weight = norm(p + hf + ".weight")


def _fill_experts(moe: Experts, w: _Weights, p: str, cfg: ModelConfig) -> None:
    """A layer's experts (`p`: its `model.layers.{i}.mlp.` prefix): the router (and its bias) and the
    shared expert's gate in float (the runtime multiplies them exactly: experts.exact_bf16); the
    experts' projections stacked [experts x rows, width], as a converted GGUF holds them (kept in the
    file's types) or stacked here from a Hugging Face checkpoint (`_expert_tensor`); the shared
    expert as any projection."""
    h, n, ff = cfg.hidden_size, cfg.experts, cfg.expert_ff
    # A checkpoint's block_sparse_moe (Mixtral's, Granite MoE's), its router `gate` or (Granite MoE) `router.layer`.
    p, router = next(((q, r) for q in (p, _mixtral(p)) for r in ("gate.weight", "router.layer.weight", "router.weight")
                      if w.ts.has(q + r)), (p, "gate.weight"))
    moe.router.weight = w.wrap(_checked(w.ts.get(p + router, w.act), (n, h), p + router))
    if w.ts.has(p + "gate.bias"):
        moe.router.bias = w.param(p + "gate.bias")
    if cfg.router in BIASED:  # the selection bias ([1, experts]; ERNIE's checkpoints' name, or transformers')
        name = p + SELECT_BIAS if w.ts.has(p + SELECT_BIAS) else p + SELECT_BIAS.removeprefix("gate.")
        moe.select_bias = w.wrap(_checked(w.ts.get(name, w.act).reshape(-1), (n,), name))
    if moe.shared_gated:
        moe.shared_gate.weight = w.wrap(w.ts.get(p + "shared_expert_gate.weight", w.act).reshape(1, h))
    if moe.shared:  # Qwen2-MoE's `shared_expert`, ERNIE's `shared_experts` (its shared experts as one MLP)
        s = p + ("shared_experts." if w.ts.has(p + "shared_experts.down_proj.weight") else "shared_expert.")
        w.project(moe.shared_gate_up, [s + "gate_proj.weight", s + "up_proj.weight"], 2 * cfg.shared_ff, h)
        w.project(moe.shared_down, [s + "down_proj.weight"], h, cfg.shared_ff)
    shapes = {"gate": (ff, h), "up": (ff, h), "down": (h, ff)}
    for name in shapes:
        if w.ts.has(f"{p}experts.{name}_proj.bias"):
            setattr(moe, f"{name}_bias", w.param(f"{p}experts.{name}_proj.bias"))
    stacked = {name: f"{p}experts.{name}_proj.weight" for name in shapes}
    if w.derived is not None and all(w.ts.has(k) for k in stacked.values()):  # a converted GGUF
        moe.quantize(*(_expert_segment(w, stacked[name], n * rows, width) for name, (rows, width) in shapes.items()))
        return
    for name, (rows, width) in shapes.items():
        t = _expert_tensor(w, p, name, n, ff)
        setattr(moe, name, w.wrap(_checked(t, (n, rows, width), stacked[name]).contiguous()))
    if w.derived is not None:  # a checkpoint's float experts under a quantized scheme
        bits = 4 if w.scheme == "int4" else 8
        moe.quantize(*(quant.quantize(getattr(moe, name).reshape(-1, width).float(), bits).segments[0]
                       for name, (_, width) in shapes.items()))


def _mixtral(p: str) -> str:
    return p.replace(".mlp.", ".block_sparse_moe.")


def _expert_tensor(w: _Weights, p: str, name: str, n: int, ff: int) -> torch.Tensor:
    """One projection of every expert, [experts, rows, width], in float: stacked already (a converted
    GGUF), transformers 5's fused `gate_up_proj` (Granite MoE's `input_linear`), or one tensor an expert
    (`experts.{e}.gate_proj`, Mixtral's and LFM2's `experts.{e}.w1`)."""
    if w.ts.has(f"{p}experts.{name}_proj.weight"):
        return w.ts.get(f"{p}experts.{name}_proj.weight", w.act).reshape(n, -1, w.ts.shape(
            f"{p}experts.{name}_proj.weight")[-1])
    # transformers 5's fused gate_up_proj and stacked down_proj, or Granite MoE's checkpoint names of the same
    fused, down = next(((a, b) for a, b in (("experts.gate_up_proj", "experts.down_proj"),
                                            ("input_linear.weight", "output_linear.weight")) if w.ts.has(p + b)),
                       (None, None))
    if name != "down" and fused is not None and w.ts.has(p + fused):
        both = w.ts.get(p + fused, w.act)
        return both[:, :ff] if name == "gate" else both[:, ff:]
    if down is not None:
        return w.ts.get(p + down, w.act)
    # Mixtral's and LFM2's MoE checkpoints name an expert's projections w1, w3, w2
    llama_names = "block_sparse_moe" in p or w.ts.has(f"{p}experts.0.w1.weight")
    own = {"gate": "w1", "up": "w3", "down": "w2"}[name] if llama_names else f"{name}_proj"
    names = [f"{p}experts.{e}.{own}.weight" for e in range(n)]
    return w.stacked(names).reshape(n, -1, w.ts.shape(names[0])[-1])


def _expert_segment(w: _Weights, name: str, rows: int, width: int) -> quant.Segment:
    """A stacked expert tensor quantized: as the file keeps it, else computed once (`derived`). Kept on
    the file's pages (not streamed: a token reads k of a layer's experts), which become resident as
    experts are used: a copy of every expert would take the whole file's memory and its time to load."""
    def compute() -> quant.Segment:
        bits = 4 if w.scheme == "int4" else 8
        return quant.quantize(w.ts.get(name, torch.float32).reshape(rows, width), bits).segments[0]

    seg = w.ts.segment(name, streamed=False) if w.scheme == "gguf" else None
    seg = seg or w.derived.get(name, compute, streamed=False)
    _check_shape((seg.n, seg.k), (rows, width), name)
    return seg


def _checked(t: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    _check_shape(tuple(t.shape) if t.numel() != math.prod(shape) else shape, shape, name)
    return t.reshape(shape)


def _quantized(ts: Any, names: list[str], scheme: str, derived: DerivedWeights,
               streamed: bool = True) -> QWeight | None:
    """The stacked rows of `names` in the quantized `scheme`, or None where the shape does not allow
    it. Whatever has to be computed (rather than read as stored) goes through `derived`; `streamed`:
    as `QuantizedFile.segment` takes it."""

    def from_float(key: list[str], bits: int) -> quant.Segment | None:
        w = _stacked(ts, key, torch.float32)
        return None if w.shape[1] % 32 else quant.quantize(w, bits).segments[0]

    if scheme == "gguf":
        segs = ts.stacked_segments(names) if len(names) > 1 else None
        if segs is not None:
            return quant.QWeight(segs[0].k, segs)
        parts = []
        for name in names:
            # Stored in float in the GGUF too: the 8-bit format stands in.
            seg = ts.segment(name, mapped=len(names) == 1, streamed=streamed) or derived.get(
                name, lambda name=name: from_float([name], 8), streamed)
            if seg is None:
                return None
            parts.append(quant.QWeight(seg.k, [seg]))
        return quant.QWeight.concat(parts)
    seg = derived.get("+".join(names), lambda: from_float(names, 4 if scheme == "int4" else 8), streamed)
    return None if seg is None else quant.QWeight(seg.k, [seg])


def derived_path(folder: Path, scheme: str) -> Path:
    """Where `scheme`'s computed weights for `folder` are kept: inside our own model folders (a new
    conversion replaces them with the folder), else in the cache under a key that changes when the
    folder's weight files do."""
    from .pull import specextend_home

    folder = folder.resolve()
    home = specextend_home().resolve()
    if folder.is_relative_to(home):
        return folder / f"derived-{scheme}.safetensors"
    files = sorted(folder.glob("*.safetensors"))
    stamp = "".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns};" for p in files)
    key = hashlib.sha256(f"{folder}\0{stamp}".encode()).hexdigest()[:16]
    return home / "derived" / f"{folder.name}-{key}" / f"{scheme}.safetensors"


def _check_shape(got: tuple[int, ...], shape: tuple[int, ...], name: str) -> None:
    if tuple(got) != tuple(shape):
        raise UserError(f"tensor {name} has shape {tuple(got)}, config says {tuple(shape)}")


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer stored beside the weights (with its chat template)."""
    from transformers import AutoTokenizer

    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise UserError(f"{folder} has no tokenizer (tokenizer.json)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds for a broken tokenizer
        raise UserError(f"cannot load the tokenizer in {folder}: {e}") from None


def _eos_ids(folder: Path, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """Every end-of-sequence id the model's files name: the generation config's, then the config's."""
    ids: list[int] = []

    def add(x: Any) -> None:
        if isinstance(x, int):
            ids.append(x)
        elif isinstance(x, list):
            ids.extend(i for i in x if isinstance(i, int))

    gen_config = folder / "generation_config.json"
    if gen_config.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            add(json.loads(gen_config.read_text()).get("eos_token_id"))
    add(hf_config.get("eos_token_id"))
    return tuple(sorted(set(ids)))
