"""Load a Hugging Face-format folder (config.json + safetensors) into `specextend.model`.

Hugging Face names map onto our fused layout here: q/k/v projections become one `qkv`
matrix and gate/up one `gate_up` matrix, so a decode step makes 4 matrix calls per layer
instead of 7.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import UserError
from ..model import ModelConfig, Transformer, rope_inv_freq

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


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


DRAFT_DTYPE_HELP = "the draft's dtype (default: bfloat16 on a CPU with native bf16 if --dtype is float32, else --dtype)"


def add_model_arguments(p: argparse.ArgumentParser, draft_note: str = "", draft: bool = True) -> None:
    """The `models` option group every command that loads models shares (generate, bench, needle,
    demo, the sweep; the runtime benchmark, which times the target alone, with `draft=False`)."""
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: folder, .gguf file, known name (default: the default pair)")
    if draft:
        g.add_argument("--draft", help=f"draft model, same forms as --target{draft_note}")
    g.add_argument("--dtype", default="float32", help="float32|float64|bfloat16|float16 (default: float32)")
    if draft:
        g.add_argument("--draft-dtype", default=None, help=DRAFT_DTYPE_HELP)
    g.add_argument("--device", default="cpu", help="cpu|cuda[:N] (default: cpu)")


def default_draft_dtype(dtype: str, device: str) -> str:
    """The draft's precision when none is asked for.

    The draft only proposes; the target decides every token, so the draft's precision can
    never change the output, only how often its guesses are accepted. A decode step is bound
    by reading weights, so on a CPU with native bfloat16 dot products (AVX512-BF16/AMX) a
    bfloat16 draft runs about 1.7x faster than float32 with the same acceptance (measured
    on the default pair; see README). float64 (exactness tests) and GPUs keep the target's.
    """
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
    """Lazy access to every tensor of a (possibly sharded) safetensors checkpoint."""

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

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.where:
            raise UserError(f"checkpoint is missing tensor {name}")
        h, f = self.where[name]
        try:
            t = h.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise UserError(f"{f} is corrupt or truncated: {e}") from None
        return t.to(dtype)

    def has(self, name: str) -> bool:
        return name in self.where


def load_model(folder: Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               pack: bool = True) -> Transformer:
    """Build a `Transformer` from an HF folder. `pack` prepares the fast CPU kernels."""
    cfg = ModelConfig.from_hf(read_config(folder))
    ts = _Tensors(_weight_files(folder))
    with torch.device("meta"):
        model = Transformer(cfg)

    def param(t: torch.Tensor) -> torch.nn.Parameter:
        return torch.nn.Parameter(t.to(device), requires_grad=False)

    model.embed.weight = param(ts.get("model.embed_tokens.weight", dtype))
    _check_shape(model.embed.weight, (cfg.vocab_size, cfg.hidden_size), "model.embed_tokens.weight")
    for i, blk in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        blk.qkv.weight = param(torch.cat([ts.get(a + f"{n}_proj.weight", dtype) for n in "qkv"]))
        _check_shape(blk.qkv.weight, (blk.qkv.weight.shape[0], cfg.hidden_size), a + "q_proj.weight")
        if blk.qkv.bias is not None:
            blk.qkv.bias = param(torch.cat([ts.get(a + f"{n}_proj.bias", dtype) for n in "qkv"]))
        blk.o.weight = param(ts.get(a + "o_proj.weight", dtype))
        blk.gate_up.weight = param(
            torch.cat([ts.get(p + "mlp.gate_proj.weight", dtype), ts.get(p + "mlp.up_proj.weight", dtype)])
        )
        blk.down.weight = param(ts.get(p + "mlp.down_proj.weight", dtype))
        blk.attn_norm.weight = param(ts.get(p + "input_layernorm.weight", dtype))
        blk.mlp_norm.weight = param(ts.get(p + "post_attention_layernorm.weight", dtype))
        if blk.q_norm is not None:
            blk.q_norm.weight = param(ts.get(a + "q_norm.weight", dtype))
            blk.k_norm.weight = param(ts.get(a + "k_norm.weight", dtype))
    model.norm.weight = param(ts.get("model.norm.weight", dtype))
    if cfg.tie_word_embeddings or not ts.has("lm_head.weight"):
        model.lm_head.weight = model.embed.weight
    else:
        model.lm_head.weight = param(ts.get("lm_head.weight", dtype))
    model.inv_freq = rope_inv_freq(cfg).to(device)
    model.eval()
    if pack:
        model.pack()
    return model


def _check_shape(t: torch.Tensor, shape: tuple[int, ...], name: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise UserError(f"tensor {name} has shape {tuple(t.shape)}, config says {tuple(shape)}")


def load_tokenizer(folder: Path) -> Any:
    """The tokenizer stored beside the weights (with its chat template)."""
    from transformers import AutoTokenizer

    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        raise UserError(f"{folder} has no tokenizer (tokenizer.json)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds for a broken tokenizer
        raise UserError(f"cannot load the tokenizer in {folder}: {e}") from None


def eos_token_ids(folder: Path, tokenizer: Any = None) -> list[int]:
    """Every end-of-sequence id: the generation config's list, the config's, the tokenizer's."""
    ids: list[int] = []

    def add(x: Any) -> None:
        if isinstance(x, int):
            ids.append(x)
        elif isinstance(x, list):
            ids.extend(i for i in x if isinstance(i, int))

    gen = folder / "generation_config.json"
    if gen.is_file():
        with contextlib.suppress(json.JSONDecodeError):
            add(json.loads(gen.read_text()).get("eos_token_id"))
    add(read_config(folder).get("eos_token_id"))
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return sorted(set(ids))
