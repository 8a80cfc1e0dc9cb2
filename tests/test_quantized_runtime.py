"""The quantized CPU runtime end to end: greedy speculative decoding equals target-only decoding at
the same (quantized) precision, a token's logits do not depend on the other tokens of its forward,
and a converted GGUF keeps its grid through the model cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specextend.common.errors import UserError
from specextend.common.settings import Settings
from specextend.models import gguf as conv
from specextend.models.loader import load_model, resolve_weights
from specextend.runtime import kernels
from specextend.speculation.decoder import SpecEngine

from conftest import make_tiny_hf

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

# head_dim 64 (the attention kernel's fast path), widths divisible by 32 (8-bit) and 256 (4-bit).
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab=96)
SMALL = dict(chunk_size=4, top_k_chunks=3, retrieve_every=2, tree_budget=6, tree_depth=4, tree_topk=2,
             cmr_min_ratio=0.0)
METHODS = {
    "sd": dict(method="sd"),
    "sd+streaming": dict(method="sd", draft_cache="streaming"),
    "specextend": dict(method="specextend", draft_gate=False),  # the draft runs: its kernels are tested
    "specextend+gated": dict(method="specextend"),
    "sd+chain": dict(method="sd", tree="chain", chain_length=3),
}
PROMPT = torch.randint(0, 95, (60,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for arch in ("qwen2", "llama", "qwen3"):  # qwen3: per-head query/key norms (head_dim 8, the portable path)
        for seed, layers in ((0, 2), (5, 1)):
            d = tmp_path_factory.mktemp(f"q{arch}{seed}")
            kw = dict(SHAPE, layers=layers)
            make_tiny_hf(arch, seed, dtype=torch.float32, **kw).save_pretrained(d)
            out[(arch, seed)] = d
    return out


def pair(folders, arch: str, weights: str, same_draft: bool = False):
    target = load_model(folders[(arch, 0)], torch.float32, weights=weights)
    draft = target if same_draft else load_model(folders[(arch, 5)], torch.float32, weights=weights)
    return target, draft


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("name", list(METHODS))
def test_greedy_equals_ar_in_the_quantized_precision(folders, arch, weights, name):
    target, draft = pair(folders, arch, weights, same_draft=name == "sd+chain")
    assert target.weights == weights and target.rowwise_attention
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40))
    r = eng.generate(PROMPT, Settings(max_new_tokens=40, **SMALL, **METHODS[name]))
    assert r.token_ids == ar.token_ids
    if name == "sd+chain":
        assert r.accepted_per_step > 1.5  # the draft is the target: long runs are accepted and compared


@pytest.mark.parametrize("path", kernels.cpu_paths())
@pytest.mark.parametrize("name", ["sd", "specextend"])
def test_greedy_equals_ar_on_every_kernel_path(folders, monkeypatch, path, name):
    """SPECEXTEND_CPU forces each path this CPU runs (the avx2 path on an AVX-512 machine too)."""
    monkeypatch.setenv(kernels.CPU_ENV, path)
    target, draft = pair(folders, "qwen2", "int4")
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=24))
    r = eng.generate(PROMPT, Settings(max_new_tokens=24, **SMALL, **METHODS[name]))
    assert r.token_ids == ar.token_ids


def test_every_kernel_path_gives_the_same_logits(folders, monkeypatch):
    model = load_model(folders[("qwen2", 0)], torch.float32, weights="int4")
    ids = torch.tensor(PROMPT)
    logits = {}
    for path in kernels.cpu_paths():
        monkeypatch.setenv(kernels.CPU_ENV, path)
        logits[path] = model(ids, torch.arange(len(ids)), model.new_cache(len(ids)))
    assert all(torch.equal(v, logits["portable"]) for v in logits.values())


def tree(n: int) -> tuple[torch.Tensor, list[int]]:
    """The first n nodes of a 9-node draft tree: its ancestor mask (each node sees itself and its
    ancestors) and its depths."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5][:n]
    mask = torch.zeros(n, n, dtype=torch.bool)
    depth = [0] * n
    for i in range(n):
        if i:
            mask[i] = mask[parents[i]]
            depth[i] = depth[parents[i]] + 1
        mask[i, i] = True
    return mask, depth


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_a_token_gets_the_same_logits_alone_and_inside_a_tree(folders, weights):
    model = load_model(folders[("qwen2", 0)], torch.float32, weights=weights)
    n = 9
    mask, depth = tree(n)
    tokens = torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor(PROMPT)
    cache = model.new_cache(len(PROMPT) + 2 * n)
    model.prefill(prompt, cache)
    p = cache.length
    tree_logits = model(tokens, p + torch.tensor(depth), cache, mask)
    cache.discard()
    for i in range(n):
        path = [j for j in range(n) if mask[i, j]]  # ancestors then i, in order
        alone = model.new_cache(len(PROMPT) + n)
        model.prefill(prompt, alone)
        if len(path) > 1:
            model(tokens[path[:-1]], p + torch.arange(len(path) - 1), alone)
            alone.commit()
        logits = model(tokens[i : i + 1], torch.tensor([p + depth[i]]), alone)
        assert torch.equal(logits[0], tree_logits[i]), i


def test_quantized_logits_track_the_float_model(folders):
    """int8 weights and int8 activations per block of 32 stay close to the float64 model."""
    ref = load_model(folders[("qwen2", 0)], torch.float64, weights="float64")
    q = load_model(folders[("qwen2", 0)], torch.float32, weights="int8")
    ids = torch.tensor(PROMPT)
    lr = ref(ids, torch.arange(len(ids)), ref.new_cache(len(ids)))
    lq = q(ids, torch.arange(len(ids)), q.new_cache(len(ids)))
    agree = (lr.argmax(-1) == lq.argmax(-1)).float().mean().item()
    assert agree >= 0.9
    assert (lq.double() - lr).abs().max() < 0.05 * lr.abs().max()


def test_auto_weights_choice(folders):
    fast = kernels.has_fast_path()  # AVX2, AVX-512 or NEON: quantized weights
    assert resolve_weights("auto", torch.float32, "cpu", quantized_source=True) == ("gguf" if fast else "float32")
    assert resolve_weights("auto", torch.float32, "cpu", quantized_source=False) == ("int8" if fast else "float32")
    assert resolve_weights("auto", torch.float32, "cpu", quantized_source=True, draft=True) == (
        "int4" if fast else "float32")
    assert resolve_weights("auto", torch.float64, "cpu", quantized_source=True) == "float64"
    with pytest.raises(UserError, match="float32"):
        resolve_weights("int8", torch.float64, "cpu", quantized_source=False)
    with pytest.raises(UserError, match="GGUF"):
        resolve_weights("gguf", torch.float32, "cpu", quantized_source=False)
    with pytest.raises(UserError, match="unknown --weights"):
        resolve_weights("int3", torch.float32, "cpu", quantized_source=False)


def test_auto_weights_follow_the_kernel_path(monkeypatch):
    """Quantized weights wherever a vector path runs; float weights on the portable path alone."""
    for path in kernels.cpu_paths():
        monkeypatch.setenv(kernels.CPU_ENV, path)
        want = ("gguf", "int8", "int4") if path != "portable" else ("float32",) * 3
        assert (resolve_weights("auto", torch.float32, "cpu", quantized_source=True),
                resolve_weights("auto", torch.float32, "cpu", quantized_source=False),
                resolve_weights("auto", torch.float32, "cpu", quantized_source=True, draft=True)) == want


# --------------------------------------------------------------------------- GGUF -> cache -> load


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    from test_gguf import write_tiny_gguf

    src = tmp_path / "tiny.gguf"
    quantized = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight", "lm_head.weight")
    write_tiny_gguf(src, "qwen2", tokenizer=False, quantized=quantized)
    return conv.convert_gguf(src, tmp_path / "model", progress=False, tokenizer=False)


def test_gguf_grid_survives_the_cache_and_the_float_model_matches(converted: Path) -> None:
    q = load_model(converted, torch.float32, weights="gguf")
    assert q.weights == "gguf"
    fmts = [s.fmt for s in q.layers[0].qkv.qweight.segments]
    assert fmts == ["q8"]  # the Q8_0 q_proj kept; k/v (float in the file) in the 8-bit format
    assert q.lm_head.qweight.segments[0].offset == 128  # Q8_0's grid
    f = load_model(converted, torch.float64, weights="float64")
    # The float model's weights are the GGUF's, exactly (dequantised from the kept grid).
    assert torch.equal(f.lm_head.weight.float(), q.lm_head.qweight.dequantize())
    assert np.isfinite(q(torch.tensor([1, 2, 3]), torch.arange(3), q.new_cache(3)).numpy()).all()


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_a_damaged_cached_model_is_refused(converted: Path, damage: str) -> None:
    path = converted / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x13" * 64 + data[64:])
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_model(converted, torch.float32, weights="gguf")


def test_derived_weights_are_computed_once_and_read_back(folders, tmp_path, monkeypatch):
    from specextend.models.loader import derived_path
    from specextend.runtime import quant

    monkeypatch.setenv("SPECEXTEND_HOME", str(tmp_path))
    first = load_model(folders[("qwen2", 5)], torch.float32, weights="int4")

    def blob(model):
        return model.layers[0].gate_up.qweight.segments[0].blob

    path = derived_path(folders[("qwen2", 5)], "int4")
    assert path.is_file() and path.is_relative_to(tmp_path)

    def no_quantizing(*a, **k):
        raise AssertionError("quantized again instead of reading the cache")

    monkeypatch.setattr(quant, "quantize", no_quantizing)
    again = load_model(folders[("qwen2", 5)], torch.float32, weights="int4")
    assert torch.equal(blob(again), blob(first))
    monkeypatch.undo()
    monkeypatch.setenv("SPECEXTEND_HOME", str(tmp_path))
    path.write_bytes(path.read_bytes()[:1000])  # damaged: computed again, not used
    third = load_model(folders[("qwen2", 5)], torch.float32, weights="int4")
    assert torch.equal(blob(third), blob(first))


def decodes_alike_on_every_path(model, monkeypatch) -> None:
    """Greedy speculative decoding equals target-only on every kernel path, and every path gives
    the portable path's tokens."""
    prompt = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    tokens = {}
    for path in kernels.cpu_paths():
        monkeypatch.setenv(kernels.CPU_ENV, path)
        eng = SpecEngine(model, model, eos_ids=[])
        ar = eng.generate(prompt, Settings(method="ar", max_new_tokens=24))
        sd = eng.generate(prompt, Settings(max_new_tokens=24, **SMALL, method="sd"))
        assert sd.token_ids == ar.token_ids, path
        tokens[path] = ar.token_ids
    assert all(t == tokens["portable"] for t in tokens.values())


# A file of the 32-weight types (the tiny model's widths are not multiples of 256; the K-quant
# and IQ4_XS grids are checked per tensor in test_quant.py and test_kernel_paths.py).
MIXED = {
    "model.layers.0.self_attn.q_proj.weight": "Q4_0", "model.layers.0.self_attn.k_proj.weight": "Q4_1",
    "model.layers.0.self_attn.v_proj.weight": "Q5_1", "model.layers.0.self_attn.o_proj.weight": "IQ4_NL",
    "model.layers.0.mlp.gate_proj.weight": "Q5_0", "model.layers.0.mlp.up_proj.weight": "Q4_1",
    "model.layers.0.mlp.down_proj.weight": "Q4_0", "model.layers.1.mlp.down_proj.weight": "Q5_1",
    "lm_head.weight": "IQ4_NL",
}


def test_a_file_of_mixed_types_keeps_each_grid_and_every_path_decodes_alike(tmp_path, monkeypatch):
    from specextend.models.qstore import QuantizedFile
    from test_gguf import write_tiny_gguf

    src = tmp_path / "mixed.gguf"
    expected = write_tiny_gguf(src, "qwen2", tokenizer=False, quantized=MIXED)
    out = conv.convert_gguf(src, tmp_path / "model", progress=False, tokenizer=False)
    stored = QuantizedFile(out / conv.WEIGHTS_FILE)
    assert set(stored.formats) == set(MIXED)  # every one kept, none expanded to float32
    for name in MIXED:
        assert torch.equal(stored.segment(name).dequantize(), torch.from_numpy(expected[name])), name
    model = load_model(out, torch.float32, weights="gguf")
    decodes_alike_on_every_path(model, monkeypatch)


# A file of 16-bit float weights (as an F16 or BF16 download holds them, norms in F32).
FLOATS = {
    "model.embed_tokens.weight": "F16", "model.layers.0.self_attn.q_proj.weight": "F16",
    "model.layers.0.self_attn.k_proj.weight": "BF16", "model.layers.0.self_attn.v_proj.weight": "F16",
    "model.layers.0.self_attn.o_proj.weight": "BF16", "model.layers.0.mlp.gate_proj.weight": "F16",
    "model.layers.0.mlp.up_proj.weight": "F16", "model.layers.0.mlp.down_proj.weight": "BF16",
    "model.layers.1.self_attn.q_proj.weight": "BF16", "model.layers.1.self_attn.k_proj.weight": "BF16",
    "model.layers.1.self_attn.v_proj.weight": "BF16", "model.layers.1.self_attn.o_proj.weight": "F16",
    "model.layers.1.mlp.gate_proj.weight": "BF16", "model.layers.1.mlp.up_proj.weight": "BF16",
    "model.layers.1.mlp.down_proj.weight": "F16", "lm_head.weight": "F16",
}


@pytest.mark.parametrize("products", ["0", "1"])
def test_a_file_of_float16_weights_keeps_them_and_every_path_decodes_alike(tmp_path, monkeypatch, capsys, products):
    """F16 and BF16 matrices stay 16-bit (on disk: 2 bytes a weight), are the file's values exactly,
    are not named as expanded, and greedy speculative decoding equals target-only on every path; with
    bfloat16 products (SPECEXTEND_BF16_PRODUCTS=1) the BF16 ones load as bf16d, every path alike."""
    monkeypatch.setenv(kernels.BF16_PRODUCTS_ENV, products)
    bf16 = "bf16d" if products == "1" else "bf16"
    from specextend.models.qstore import QuantizedFile
    from test_gguf import write_tiny_gguf

    src = tmp_path / "f16.gguf"
    expected = write_tiny_gguf(src, "qwen2", tokenizer=False, quantized=FLOATS)
    out = conv.convert_gguf(src, tmp_path / "model", progress=False, tokenizer=False)
    assert "expanded" not in capsys.readouterr().err
    stored = QuantizedFile(out / conv.WEIGHTS_FILE)
    assert set(stored.formats) == set(FLOATS)
    for name, kind in FLOATS.items():
        seg = stored.segment(name)
        assert seg.fmt == (bf16 if kind == "BF16" else "f16") and seg.nbytes == 2 * -(-seg.n // 16) * 16 * seg.k, name
        assert torch.equal(seg.dequantize(), torch.from_numpy(expected[name])), name
    model = load_model(out, torch.float32, weights="gguf")
    assert model.embed.qweight.segments[0].fmt == "f16"
    assert [s.fmt for s in model.layers[0].qkv.qweight.segments] == ["f16", bf16, "f16"]
    decodes_alike_on_every_path(model, monkeypatch)
