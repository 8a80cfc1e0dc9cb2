"""Attention kernel timings: Hybrid Tree Attention vs eager masked attention, on CPU or CUDA.

    python -m specextend.bench.kernels [--device cuda] [--dtype bfloat16] [--prefixes 16K,32K]
                                       [--tree-nodes 64] [--config config.json] [--json OUT]

Three measurements per prefix length P, each the median of `--repeats` timed runs after warm-up:

1. one layer's attention of a random `--tree-nodes`-node draft tree over P cached tokens;
2. the target's whole verification forward of that tree (every layer, the LM head for all tree
   rows) over a cache of P tokens, with random weights of the target's shape (the cost of a
   forward does not depend on the weights' values, so no checkpoint is needed);
3. chunked prefill of P tokens (optional, `--prefill`), whose eager form materialises a
   [heads, chunk, P] score matrix per layer and whose efficient form never does.

The shape defaults to the default target (Qwen2.5-Coder-1.5B: 28 layers, 12 query heads, 2 K/V
heads of 128); `--config` takes any Hugging Face config.json instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..models.loader import parse_device, parse_dtype
from ..runtime.attention import eager_attention, hybrid_tree_attention
from ..runtime.config import ModelConfig
from ..runtime.transformer import Transformer
from .data import parse_length

# Qwen2.5-Coder-1.5B-Instruct's config.json, the fields the model reads.
DEFAULT_TARGET_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """[n, n] ancestry mask of a random tree: node i's parent is a random earlier node."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        if i:
            mask[i] = mask[int(torch.randint(0, i, (1,), generator=gen))]
        mask[i, i] = True
    return mask


def median_time(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int | None:
    """Extra device memory a call allocates at its peak (CUDA only; None on CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Transformer:
    with torch.device(device):
        model = Transformer(cfg)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
            p.data = p.data.to(dtype)
    if device.type == "cpu":
        model.pack()
    return model.eval()


def bench_layer_attention(cfg: ModelConfig, p: int, tree: torch.Tensor, dtype: torch.dtype,
                          device: torch.device, repeats: int) -> dict:
    nodes = tree.shape[0]
    q = torch.randn(cfg.num_heads, nodes, cfg.head_dim, device=device, dtype=dtype)
    k = torch.randn(cfg.num_kv_heads, p + nodes, cfg.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    res = {}
    for name, fn in (("hybrid", hybrid_tree_attention), ("eager", eager_attention)):
        res[f"layer_attention_s_{name}"] = median_time(lambda fn=fn: fn(q, k, v, tree), device, repeats)
        res[f"layer_attention_peak_bytes_{name}"] = peak_bytes(lambda fn=fn: fn(q, k, v, tree), device)
    return res


def bench_prefix(model: Transformer, p: int, nodes: int, device: torch.device, repeats: int,
                 do_prefill: bool) -> dict:
    cfg = model.cfg
    gen = torch.Generator().manual_seed(p)
    tree = random_tree(nodes, gen).to(device)
    res: dict = {"prefix": p, "tree_nodes": nodes}

    # 1. One layer's attention.
    res.update(bench_layer_attention(cfg, p, tree, model.dtype, device, repeats))

    # 2. The whole verification forward over a cache of p tokens (random K/V: cost is value-free).
    cache = model.new_cache(p + nodes)
    cache.k[:, :, :p].normal_()
    cache.v[:, :, :p].normal_()
    cache.length = p
    tokens = torch.randint(0, cfg.vocab_size, (nodes,), generator=gen).to(device)
    depth = tree.sum(-1) - 1
    positions = (p + depth).cpu()

    for backend in ("efficient", "eager"):
        def verify(backend=backend) -> None:
            model(tokens, positions, cache, tree, backend, logits_rows=slice(None))
            cache.discard()

        res[f"verify_s_{backend}"] = median_time(verify, device, repeats)
        res[f"verify_peak_bytes_{backend}"] = peak_bytes(verify, device)
    del cache

    # 3. Chunked prefill of p tokens.
    if do_prefill:
        cache = model.new_cache(p)
        ids = torch.randint(0, cfg.vocab_size, (p,), generator=gen)
        for backend in ("efficient", "eager"):
            def prefill(backend=backend) -> None:
                cache.reset()
                model.prefill(ids, cache, backend)

            res[f"prefill_s_{backend}"] = median_time(prefill, device, max(1, repeats // 5), warmup=1)
            res[f"prefill_peak_bytes_{backend}"] = peak_bytes(prefill, device)
        del cache
    return res


def _mb(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.0f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| prefix | tree | layer attn hybrid ms | eager ms | ratio | verify efficient ms | eager ms | ratio "
        "| verify peak MB eff / eager |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        la, le = r["layer_attention_s_hybrid"], r["layer_attention_s_eager"]
        va, ve = r["verify_s_efficient"], r["verify_s_eager"]
        lines.append(
            f"| {r['prefix']:,} | {r['tree_nodes']} | {la * 1e3:.3f} | {le * 1e3:.3f} | {le / la:.2f}x "
            f"| {va * 1e3:.2f} | {ve * 1e3:.2f} | {ve / va:.2f}x "
            f"| {_mb(r['verify_peak_bytes_efficient'])} / {_mb(r['verify_peak_bytes_eager'])} |"
        )
    if any("prefill_s_efficient" in r for r in rows):
        lines += ["", "| prefix | prefill efficient s | eager s | ratio | peak MB efficient / eager |",
                  "|---:|---:|---:|---:|---:|"]
        for r in rows:
            if "prefill_s_efficient" in r:
                a, e = r["prefill_s_efficient"], r["prefill_s_eager"]
                lines.append(f"| {r['prefix']:,} | {a:.2f} | {e:.2f} | {e / a:.2f}x "
                             f"| {_mb(r['prefill_peak_bytes_efficient'])} / {_mb(r['prefill_peak_bytes_eager'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu|cuda[:N] (default: cpu)")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--prefixes", default="16K,32K", help="cached prefix lengths, e.g. 4K,16K,32K")
    ap.add_argument("--tree-nodes", type=int, default=64)
    ap.add_argument("--config", type=Path, default=None, help="an HF config.json (default: the default target's)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers (faster CPU runs)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prefill", action="store_true", help="also time chunked prefill of each prefix")
    ap.add_argument("--json", type=Path, default=None, help="write the results here as JSON")
    a = ap.parse_args(argv)

    device = parse_device(a.device)
    dtype = parse_dtype(a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    d = json.loads(a.config.read_text()) if a.config else dict(DEFAULT_TARGET_CONFIG)
    if a.layers:
        d["num_hidden_layers"] = a.layers
    cfg = ModelConfig.from_hf(d)
    model = random_model(cfg, dtype, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    rows = []
    for p in (parse_length(s) for s in a.prefixes.split(",")):
        rows.append(bench_prefix(model, p, a.tree_nodes, device, a.repeats, a.prefill))
        print(f"prefix {p}: done", file=sys.stderr)
    head = (f"{name}, {dtype}, torch {torch.__version__}; {cfg.num_layers} layers, {cfg.num_heads} query / "
            f"{cfg.num_kv_heads} K/V heads of {cfg.head_dim}")
    print(head)
    print(table(rows))
    if a.json:
        out = {"device": name, "dtype": str(dtype), "torch": torch.__version__, "rows": rows}
        tmp = a.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=2))
        tmp.replace(a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
