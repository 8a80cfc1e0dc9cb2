"""The activation rules `bench.quality` emulates (`act-` schemes, bench/emulate.py): the built ones are
the kernels' own arithmetic, the stepped one keeps one float step a super-block, and a run over a
random GGUF gives each rule its row."""

from __future__ import annotations

import gc
import json
import math
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specextend.bench import emulate, gguf_files, quality
from specextend.common.errors import UserError
from specextend.runtime import kernels
from test_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize(("rule", "mask"), [("p32", 0), ("k256", 1)])
def test_a_built_rule_is_what_the_kernels_compute(rule: str, mask: int) -> None:
    """The kernels' product is the emulated input times the dequantized weight (up to float32 sums):
    the emulation scores the arithmetic the kernels have, not a neighbour of it."""
    from test_k256 import ext
    from test_kernel_paths import product, weight

    w = weight("Q4_K", 48, 512)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)) * 3
    x[1, 32:64] *= 0.01  # a small group, where per 32 and per 256 part
    want = emulate._RULE[rule](x).double() @ w.dequantize().double().T
    other = emulate._RULE["k256" if rule == "p32" else "p32"](x).double() @ w.dequantize().double().T
    ext.set_k256(mask and sum(1 << b for b in kernels.K256_FORMATS.values()))
    try:
        got = product(w, x, "portable").double()
    finally:
        ext.set_k256(kernels.k256())
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale < (other - want).abs().max()


def test_the_stepped_rule_keeps_a_small_groups_precision_on_one_grid_a_super_block() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 512, generator=g)
    x[:, 32:64] /= 20  # a group 1/20 of its super-block's largest: e = 3 (2^4 > 20 / ~1.2 would exceed the cap)
    x[2, 256:512] = 0
    y, flat = emulate.stepped(x), emulate.per_group(x, 256)
    d = x.reshape(4, 2, 256).abs().amax(-1, keepdim=True) / 127.0
    finest = torch.where(d > 0, (y.reshape(4, 2, 256) / (d / 2**emulate.MAX_STEP)), torch.zeros_like(d))
    # integer codes on the finest step (up to the float division's rounding), within int8 shifted by MAX_STEP
    assert (finest - finest.round()).abs().max() < 1e-3 and finest.abs().max() <= 127 * 2**emulate.MAX_STEP + 1e-3
    small = (y - x)[:, 32:64].abs().max(), (flat - x)[:, 32:64].abs().max()
    assert small[0] <= small[1] / 4
    assert torch.equal(y[:, :32], flat[:, :32])  # the group with the super-block's largest value: the same codes
    assert torch.equal(y[2, 256:], x[2, 256:])


def test_a_scheme_names_a_rule_and_k_quant_types_or_is_refused() -> None:
    assert emulate.parse("gguf@kv-q8") is None
    assert emulate.parse("act-k256s:Q4_K+Q6_K") == ("k256s", ("Q4_K", "Q6_K"))
    assert emulate.parse("act-p32") == ("p32", emulate.K_FAMILY)
    with pytest.raises(UserError, match="unknown activation rule"):
        emulate.parse("act-p64")
    with pytest.raises(UserError, match="Q8_0 is not a K-quant type"):
        emulate.parse("act-k256:Q8_0")
    assert quality._load_options("act-k256") == {"dtype": "float32", "weights": "float32", "kv_cache": "bf16"}


def quality_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A random 2-layer Q4_K_M GGUF (Q4_K and Q6_K tensors) and a JSONL of four short texts for bench.quality."""
    write_tiny_gguf(tmp_path / "tok.gguf")
    config = {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}
    target = gguf_files.write_random(tmp_path / "r.gguf", config, "Q4_K_M", tmp_path / "tok.gguf", progress=False)
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"the {i} report says " * 30}) for i in range(4)) + "\n")
    return target, data


def test_the_quality_bench_scores_each_rule_on_a_gguf(tmp_path, capsys) -> None:
    target, data = quality_inputs(tmp_path)
    types = emulate.gguf_types(target)
    assert {"Q4_K", "Q6_K"} <= set(types.values())
    schemes = "act-p32,act-k256,act-k256s:Q4_K+Q6_K"
    argv = ["--target", str(target), "--data", str(data), "--ctx", "64", "--chunks", "2", "--weights", schemes,
            "--out", str(tmp_path / "q")]
    assert quality.main(argv) == 0
    rows = {r["weights"]: r for r in json.loads((tmp_path / "q" / "quality.json").read_text())["rows"]}
    assert set(rows) == set(schemes.split(","))
    assert all(math.isfinite(r["perplexity"]) and 0 < r["top1_agreement"] <= 1 for r in rows.values())
    assert rows["act-p32"]["perplexity"] != rows["act-k256"]["perplexity"]  # the K slices' rule is used
    assert all(r["top1_stderr"] >= 0 for r in rows.values()) and " ± " in (tmp_path / "q" / "quality.md").read_text()
    got = quality.top1_agreement(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 3, 0]))
    assert got == {"top1_agreement": 0.75, "top1_stderr": pytest.approx(math.sqrt(0.75 * 0.25 / 4))}
    argv[argv.index("--weights") + 1] = "float32"  # an emulated reference, the others not
    assert quality.main([*argv, "--reference", "act-p32"]) == 0
    assert quality.main([*argv[:-4], "--weights", "act-k256:Q8_0", "--out", str(tmp_path / "e")]) == 2
    assert "not a K-quant type" in capsys.readouterr().err
    # A dropped emulated model is freed at once (the bench loads one scheme's float32 model after another).
    from specextend import api

    model = api.load(target, load_draft=False, progress=False, dtype="float32", weights="float32").target
    emulate.apply(model, "act-k256s", types)
    gone = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert gone() is None
    finally:
        gc.enable()


def test_int8_scores_quantize_queries_and_keys_less_the_offset_per_32_dimensions() -> None:
    torch.manual_seed(0)
    block = SimpleNamespace(k_offset=torch.randn(2, 64) * 4)
    q, k = torch.randn(4, 3, 64), (block.k_offset.unsqueeze(1) + 0.1 * torch.randn(2, 5, 64)).bfloat16()
    v = torch.randn(2, 5, 64).bfloat16()
    gq, gk, gv = emulate.scores_q8(block, q, k, v)
    assert gq.dtype == gk.dtype == gv.dtype == torch.float32 and torch.equal(gv, v.float())
    for x, got in ((q, gq), (k.float() - block.k_offset.unsqueeze(1), gk - block.k_offset.unsqueeze(1))):
        groups = x.reshape(-1, 32)
        step = groups.abs().amax(-1, keepdim=True) / 127
        codes = got.reshape(-1, 32) / step
        assert torch.allclose(codes, codes.round(), atol=1e-3) and codes.abs().max() <= 127 + 1e-3
        assert (got.reshape(-1, 32) - groups).abs().max() <= step.max() / 2 + 1e-6
    # Without the offset the keys' shared part would take each group's scale: 30x coarser here.
    assert (gk - k.float()).abs().max() < (emulate._along_dims(k.float()) - k.float()).abs().max() / 10
    assert emulate.split_scores("act-p32@scores-q8") == ("act-p32", True)
    assert emulate.split_scores("gguf@kv-q8") == ("gguf@kv-q8", False)


def test_the_quality_bench_emulates_int8_scores_on_float_models(tmp_path, capsys) -> None:
    target, data = quality_inputs(tmp_path)
    argv = ["--target", str(target), "--data", str(data), "--ctx", "64", "--chunks", "2", "--baseline", "float32",
            "--weights", "float32,float32@scores-q8,act-p32@scores-q8", "--out", str(tmp_path / "q")]
    assert quality.main(argv) == 0
    rows = {r["weights"]: r for r in json.loads((tmp_path / "q" / "quality.json").read_text())["rows"]}
    assert rows["float32@scores-q8"]["perplexity"] != rows["float32"]["perplexity"]
    assert rows["float32@scores-q8"]["paired"]["perplexity_ratio"] != 1.0
    assert rows["act-p32@scores-q8"]["perplexity"] != rows["float32@scores-q8"]["perplexity"]
    argv[argv.index("--weights") + 1] = "gguf@scores-q8"
    assert quality.main([*argv[:-2], "--out", str(tmp_path / "e")]) == 2
    assert "emulated on float32, float64 and act- schemes only" in capsys.readouterr().err
