"""What a GGUF file holds and what it costs once loaded, read from its header alone (no conversion).

Each tensor either keeps its own quantization grid (`is_kept`: the types the kernels compute
with, `quant.GGUF_BLOCKS`, F16 and BF16 matrices as their 16-bit floats) or is stored as float32
by the converter; under the kernels' scheme
(`--weights auto` on a CPU) the loader then requantizes each float32 matrix to 8 bits (`loader._quantized`)
and keeps vectors (norms, biases) in float32. A type the kernels do not compute with is therefore
*expanded*: the converted copy holds it in float32 and the model that runs holds it in 8 bits,
not the file's own weights. `notice` says so in one line at load, and `check_fits` refuses a
model whose first load would not fit in the memory available.

The figures are computed from shapes: a kept tensor's bytes are its kernel layout's
(`quant.kept_bytes`, panels of 16 rows included): the file's bytes, or up to 4% more (the
K-quants' and IQ4_XS's 6-bit scale codes kept as whole bytes; docs/design.md). This module does
arithmetic on tensor descriptions only; `gguf.file_footprint` reads them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..common.errors import UserError
from ..runtime import kernels

F32_BYTES = 4
Q8_BYTES = 34 / 32  # the 8-bit format: 32 one-byte codes and a float16 scale per group of 32
# A float32 matrix being requantized at load holds a few transient copies of itself (the float32
# read, its groups, the codes) beside the model loaded so far.
TRANSIENT_COPIES = 3


# Float types whose float32 form holds every value exactly: stored as float32 they lose nothing.
EXACT_IN_FLOAT32 = ("F32", "F16", "BF16")


def is_kept(kind: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of GGUF type `kind` and `shape` (GGUF order: the input width first) keeps
    its own quantization grid or 16-bit floats (the kernels compute with it as it is); every other
    tensor is stored as float32. The one rule: the types `quant.GGUF_BLOCKS` lists, as matrices of
    whole blocks (F16 and BF16: widths that are multiples of 32), or stacks of them (a layer's
    experts, llama.cpp's 3-D `ffn_*_exps`: each expert's rows a whole number of the kernels' panels)."""
    from ..runtime import quant

    if len(shape) == 3 and shape[1] % quant.PANEL:
        return False
    return kind in quant.GGUF_BLOCKS and len(shape) in (2, 3) and shape[0] % quant.GGUF_BLOCKS[kind][1] == 0


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file as the footprint needs it."""

    kind: str  # the GGUF type name
    shape: tuple[int, ...]  # GGUF order: the input width (the fastest dimension) first
    file_bytes: int
    router: bool = False  # an expert router (`ffn_gate_inp.weight`): float32, run exactly (runtime/experts.py)
    # a bias (`*.bias`): float32 whatever its shape (the experts' are [experts, width]); LFM2's convolution kernels too
    bias: bool = False


@dataclass
class TypeRow:
    """Every tensor of one GGUF type that runs one way."""

    type: str
    runs_as: str  # how the loaded model computes with it (see `_runs_as`)
    kept: bool  # its own grid kept
    expanded: bool  # a quantized type stored as float32 and run in 8 bits
    tensors: int = 0
    parameters: int = 0
    file_bytes: int = 0
    converted_bytes: int = 0  # in the converted copy on disk
    loaded_bytes: int = 0  # in memory, under the kernels' scheme


@dataclass
class Footprint:
    """A GGUF file's types and memory, for `models inspect`, the load notice and the fit check."""

    file: str
    file_bytes: int
    architecture: str
    kernel_path: str | None  # the kernels' active path here; None: PyTorch in float32
    types: list[TypeRow] = field(default_factory=list)
    config: dict[str, Any] | None = None  # the model's shape; None for an unsupported architecture
    unsupported: str | None = None  # why it cannot be converted, if it cannot
    largest_float_bytes: int = 0  # the largest matrix in float32 (the transient at load)
    random_weights: bool = False  # made by `bench.gguf_files random`
    experts: dict[str, int] | None = None  # an expert model's experts (`expert_share`), else None
    tokenizer: str | None = None  # how its text becomes tokens (`pretokenize.describe`); None: no vocabulary
    chat_template: str | None = None  # the file's `tokenizer.chat_template`, if it has one

    @property
    def parameters(self) -> int:
        return sum(r.parameters for r in self.types)

    @property
    def loaded_bytes(self) -> int:
        return sum(r.loaded_bytes for r in self.types)

    @property
    def converted_bytes(self) -> int:
        return sum(r.converted_bytes for r in self.types)

    @property
    def float32_bytes(self) -> int:
        return self.parameters * F32_BYTES

    @property
    def first_load_bytes(self) -> int:
        """The estimated peak of the first load: the model plus the requantization's transients."""
        return self.loaded_bytes + TRANSIENT_COPIES * self.largest_float_bytes

    @property
    def expanded(self) -> list[TypeRow]:
        return [r for r in self.types if r.expanded]

    def as_json(self) -> dict[str, Any]:
        shape = None
        if self.config is not None:
            keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                    "tie_word_embeddings")
            shape = {k: self.config[k] for k in keys if k in self.config}
        return {
            "file": self.file,
            "file_bytes": self.file_bytes,
            "architecture": self.architecture,
            "supported": self.unsupported is None,
            "unsupported": self.unsupported,
            "shape": shape,
            "parameters": self.parameters,
            "kernel_path": self.kernel_path,
            "types": [asdict(r) for r in self.types],
            "expanded": [r.type for r in self.expanded],
            "largest_float_bytes": self.largest_float_bytes,
            "random_weights": self.random_weights,
            "experts": self.experts,
            "tokenizer": self.tokenizer,
            "chat_template": self.chat_template,
            "memory": {
                "loaded_bytes": self.loaded_bytes,
                "first_load_peak_bytes": self.first_load_bytes,
                "converted_bytes": self.converted_bytes,
                "float32_bytes": self.float32_bytes,
            },
        }


    @staticmethod
    def from_json(data: dict[str, Any]) -> Footprint:
        """The footprint `as_json` wrote (a converted folder keeps its source's)."""
        return Footprint(file=data["file"], file_bytes=int(data["file_bytes"]), architecture=data["architecture"],
                         kernel_path=data["kernel_path"], types=[TypeRow(**r) for r in data["types"]],
                         config=None, unsupported=data.get("unsupported"),
                         largest_float_bytes=int(data.get("largest_float_bytes", 0)),
                         random_weights=bool(data.get("random_weights", False)), experts=data.get("experts"),
                         tokenizer=data.get("tokenizer"), chat_template=data.get("chat_template"))


def expert_share(count: int, used: int, tensors: list[tuple[str, TensorInfo]]) -> dict[str, int]:
    """What a token of an expert model reads: `used` of `count` experts' share of the stacked expert
    tensors (named `*_exps*`) and all of every other tensor; parameters count everything so (the
    usual "active parameters"), bytes (the file's) leave out the token embedding, of which a token
    reads one row."""
    params = active = nbytes = 0
    for name, t in tensors:
        n = math.prod(t.shape)
        share = used / count if "_exps" in name else 1.0
        params += n
        active += round(n * share)
        if not name.startswith("token_embd"):
            nbytes += round(t.file_bytes * share)
    return {"count": count, "used": used, "parameters": params, "active_parameters": active,
            "active_bytes": nbytes}


def active_kernel_path() -> str | None:
    """The kernels' path on this CPU (`SPECEXTEND_CPU` honoured), or None where they cannot run."""
    from ..runtime import kernels

    return kernels.path() if kernels.available() else None


def runs_float(kernel_path: str | None) -> bool:
    """Whether `--weights auto` runs the whole model in float32 through PyTorch: no kernels, or
    only their portable path (`loader.resolve_weights`)."""
    return kernel_path in (None, "portable")


def _runs_as(kind: str, shape: tuple[int, ...], path: str | None, bias: bool = False) -> tuple[str, bool, bool]:
    """(how the loaded model computes with a tensor, kept, expanded); a bias is a vector whatever its shape."""
    dims = 1 if bias else len(shape)
    kept = is_kept(kind, shape)
    expanded = not kept and kind not in EXACT_IN_FLOAT32
    if runs_float(path) and dims == 2:
        return f"{kind} on disk, float32 in memory (PyTorch: no vector kernel path)", kept, expanded
    if kept and kind == "BF16" and dims == 2 and kernels.bf16_products():
        return f"BF16 as it is, on bfloat16 dot products ({path} kernels)", True, False
    if kept:
        return f"{kind} as it is ({path} kernels)", True, False
    if dims != 2:
        return ("float32" if kind in EXACT_IN_FLOAT32 else "expanded to float32"), False, expanded
    if kind in EXACT_IN_FLOAT32:
        return f"float32, requantized to 8 bits ({path} kernels)", False, False
    return f"expanded to float32, then requantized to 8 bits ({path} kernels)", False, True


def footprint(file: str | os.PathLike[str], architecture: str, tensors: list[TensorInfo],
              kernel_path: str | None) -> Footprint:
    """The footprint of the GGUF file `file` holding `tensors` (those the model loads)."""
    from ..runtime import quant

    fp = Footprint(file=str(file), file_bytes=Path(file).stat().st_size, architecture=architecture,
                   kernel_path=kernel_path)
    rows: dict[tuple[str, str], TypeRow] = {}
    for t in tensors:
        dims, count = 1 if t.bias else len(t.shape), math.prod(t.shape)
        runs_as, kept, expanded = _runs_as(t.kind, t.shape, kernel_path, t.bias)
        if t.router and not runs_float(kernel_path):
            runs_as = f"float32 routers, exact as three bfloat16 parts ({kernel_path} kernels)"
        row = rows.setdefault((t.kind, runs_as), TypeRow(t.kind, runs_as, kept, expanded))
        row.tensors += 1
        row.parameters += count
        row.file_bytes += t.file_bytes
        stored = quant.kept_bytes(t.kind, math.prod(t.shape[1:]), t.shape[0]) if kept else count * F32_BYTES
        row.converted_bytes += stored
        if runs_float(kernel_path) or t.bias:
            row.loaded_bytes += count * F32_BYTES
        elif kept:
            row.loaded_bytes += stored
        elif t.router:
            row.loaded_bytes += count * (F32_BYTES + 6)  # the float32 weights and their three bfloat16 parts
        else:
            requantized = dims == 2 and t.shape[0] % 32 == 0
            row.loaded_bytes += round(count * Q8_BYTES) if requantized else count * F32_BYTES
        if dims == 2 and not kept:
            fp.largest_float_bytes = max(fp.largest_float_bytes, count * F32_BYTES)
    fp.types = sorted(rows.values(), key=lambda r: -r.file_bytes)
    return fp


def gb(n: float, sign: bool = False) -> str:
    """Bytes for people: GB with one decimal, MB below 1 GB (`sign`: with + or -)."""
    scale, unit = (1e9, "GB") if abs(n) >= 1e9 else (1e6, "MB")
    return f"{n / scale:{'+' if sign else ''}.1f} {unit}"


def _types_phrase(rows: list[TypeRow]) -> str:
    parts = [f"{r.tensors} tensors of {r.type}" if i == 0 else f"{r.tensors} of {r.type}" for i, r in enumerate(rows)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _how(fp: Footprint) -> str:
    return "in float32" if runs_float(fp.kernel_path) else "requantized to 8 bits"


def notice(fp: Footprint) -> str | None:
    """One line naming the types the kernels do not compute with and what expanding them costs."""
    rows = fp.expanded
    if not rows:
        return None
    disk = sum(r.converted_bytes - r.file_bytes for r in rows)
    memory = sum(r.loaded_bytes - r.file_bytes for r in rows)
    verb = "is" if len(rows) == 1 and rows[0].tensors == 1 else "are"
    return (f"{Path(fp.file).name}: {_types_phrase(rows)} {verb} expanded to float32 ({gb(disk, True)} on disk) "
            f"and run {_how(fp)} ({gb(memory, True)} in memory), not as the file's own weights; "
            f"see specextend models inspect")


def random_notice(fp: Footprint) -> str | None:
    """One line for a file of random weights: what it is good for."""
    if not fp.random_weights:
        return None
    return (f"{Path(fp.file).name} holds random weights: its text and the tokens accepted from it mean "
            f"nothing; it measures formats, memory and speed only")


def check_fits(fp: Footprint, available_mb: Callable[[], float | None]) -> None:
    """UserError (one line: the types and the estimate) when the first load would not fit in the
    memory available now; nothing when it fits or the memory cannot be read."""
    avail = available_mb()
    if avail is None:
        return
    need = fp.first_load_bytes
    if need <= avail * 2**20:
        return
    rows = fp.expanded
    why = f" ({_types_phrase(rows)} expanded to float32, run {_how(fp)})" if rows else ""
    raise UserError(f"{Path(fp.file).name} would need about {gb(need)} of memory to load{why}; "
                    f"{gb(avail * 2**20)} is available (see specextend models inspect)")
