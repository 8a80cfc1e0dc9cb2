"""The q8 KV cache (`--kv-cache q8`): rows quantized as the C++ writes store them, attention over them
with the same bits on every kernel path (and the bits of attention over their bfloat16 conversion),
and the model-level contracts kept: greedy speculation equals `ar`, a token's logits do not depend
on the other rows of its forward, and a prompt's KV survives a snapshot and a file."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from specextend.common.errors import UserError
from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.models.resolve import LoadOptions
from specextend.requests import kv_file
from specextend.requests.prefix_cache import fingerprint
from specextend.runtime import fused_step, kernels
from specextend.runtime.kv_cache import KVCache, PrefixKV, bf16_rows, row_width
from specextend.runtime.layers import Rows
from specextend.speculation.decoder import SpecEngine
from test_kernel_paths import PATHS, PORTABLE, VECTOR, tree_mask
from test_quantized_runtime import METHODS, PROMPT, SHAPE, SMALL, tree

from conftest import make_tiny_hf
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

ext = kernels.load()


def q8_rows(x: torch.Tensor, offset: torch.Tensor | None = None, dtype: torch.dtype = torch.int8
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [Hkv, S, D] float32 stored as rows of `dtype` by the kernels' own write (rope_store, no
    rotation), keys less `offset` [Hkv, D]: (keys, values)."""
    kv, s, d = x.shape
    k = torch.zeros(kv, s, row_width(d, dtype), dtype=dtype)
    v = torch.zeros_like(k)
    h = torch.cat([torch.zeros(s, d), x.transpose(0, 1).reshape(s, kv * d), x.transpose(0, 1).reshape(s, kv * d)], 1)
    ext.rope_store(h.contiguous(), torch.ones(s, d), torch.zeros(s, d), 1, None, None, 1e-6, k, v, 0, offset)
    return k, v


def reference_q8(x: torch.Tensor) -> torch.Tensor:
    """The write's arithmetic in torch (csrc/core/kv_q8.h): per 32 values a bfloat16 scale max|x|/127,
    values rounded half to even into [-127, 127], then the scales' bytes."""
    g = x.unflatten(-1, (-1, 32))
    scale = (g.abs().amax(-1, keepdim=True) / 127).bfloat16()
    q = torch.where(scale.float() > 0, torch.round(g / scale.float()), 0).clamp(-127, 127).to(torch.int8)
    return torch.cat([q.flatten(-2), scale.squeeze(-1).contiguous().view(torch.int8)], -1)


def test_the_write_quantizes_per_32_values_and_reads_back_close() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 70, 128, generator=g) * torch.logspace(-3, 2, 128)  # groups of very different sizes
    x[0, 3, :32] = 0.0  # an all-zero group: scale 0, values 0
    rows, values = q8_rows(x)
    assert torch.equal(rows, values)
    assert rows.shape[-1] == 136 and torch.equal(rows, reference_q8(x))
    back = bf16_rows(rows).float()
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True)
    err = (back - x).unflatten(-1, (-1, 32)).abs()
    assert bool((err <= amax / 127 * 0.51 + back.unflatten(-1, (-1, 32)).abs() / 256 + 1e-30).all())
    assert torch.equal(back[0, 3, :32], torch.zeros(32))


def test_the_write_stores_keys_less_the_offset_values_as_they_are_and_bf16_ignores_it() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 40, 64, generator=g) + torch.randn(2, 1, 64, generator=g) * 50  # a large common part
    offset = x.mean(1)
    k, v = q8_rows(x, offset)
    assert torch.equal(k, reference_q8(x - offset[:, None])) and torch.equal(v, reference_q8(x))
    assert not torch.equal(k, q8_rows(x)[0])
    assert torch.equal(q8_rows(x, offset, torch.bfloat16)[0], q8_rows(x, None, torch.bfloat16)[0])
    # a query's scores over the stored keys shift by q.offset alone, which softmax ignores
    q, values = torch.randn(4, 3, 64, generator=g) / 8, torch.randn(2, 40, 64, generator=g).bfloat16()
    exact = ext.attend(q, x.bfloat16(), values, None, PORTABLE)
    less = ext.attend(q, bf16_rows(k), values, None, PORTABLE)
    plain = ext.attend(q, bf16_rows(q8_rows(x)[0]), values, None, PORTABLE)
    assert (less - exact).norm() < (plain - exact).norm() / 3
    with pytest.raises(RuntimeError, match="k_offset float32"):
        q8_rows(x, offset[:1])


@pytest.mark.skipif(not VECTOR, reason="this CPU has only the portable path")
@pytest.mark.parametrize("path", VECTOR)
@pytest.mark.parametrize(("d", "heads", "kv", "t", "prefix"), [(128, 12, 2, 1, 100), (64, 12, 2, 9, 700),
                                                               (32, 4, 1, 20, 45)])
def test_attention_over_q8_rows_equals_the_portable_bits_and_their_bf16_conversion(path, d, heads, kv, t, prefix):
    g = torch.Generator().manual_seed(d + t)
    capacity = prefix + t + 7  # a view of a larger cache, as the model passes it
    k = q8_rows(torch.randn(kv, capacity, d, generator=g) * 3)[0][:, : prefix + t]
    v = q8_rows(torch.randn(kv, capacity, d, generator=g))[0][:, : prefix + t]
    q = torch.randn(heads, t, d, generator=g) * 2
    for mask in (None, tree_mask(t, seed=t)):
        ours = ext.attend(q, k, v, mask, kernels.path_index(path))
        assert torch.equal(ours, ext.attend(q, k, v, mask, PORTABLE))
        assert torch.equal(ours, ext.attend(q, bf16_rows(k), bf16_rows(v), mask, PORTABLE))


@pytest.mark.parametrize("path", PATHS[:1] + VECTOR[:1])
def test_a_long_q8_cache_read_in_pieces_gives_every_thread_count_the_same_bits(path: str) -> None:
    g = torch.Generator().manual_seed(5)
    prefix, t, d = 2600, 5, 64
    k = q8_rows(torch.randn(2, prefix + t, d, generator=g))[0]
    v = q8_rows(torch.randn(2, prefix + t, d, generator=g))[0]
    q = torch.randn(14, t, d, generator=g) * 2
    mask = tree_mask(t, seed=3)
    pid = kernels.path_index(path)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ext.attend(q, k, v, mask, pid)
        torch.set_num_threads(2)
        assert torch.equal(ext.attend(q, k, v, mask, pid), one)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, ext.attend(q, bf16_rows(k), bf16_rows(v), mask, pid))


# ------------------------------------------------------------------ the model with a q8 cache


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for seed, layers in ((0, 2), (5, 1)):
        d = tmp_path_factory.mktemp(f"kvq8{seed}")
        make_tiny_hf("qwen2", seed, dtype=torch.float32, **dict(SHAPE, layers=layers)).save_pretrained(d)
        out[seed] = d
    return out


CALIBRATION = torch.randint(0, 95, (50,), generator=torch.Generator().manual_seed(9)).tolist()


def q8_model(folder, weights: str = "int4", calibrate: bool = True):
    """A q8-cache model whose keys are stored less offsets calibrated on a fixed text (as loaded)."""
    m = load_model(folder, torch.float32, weights=weights)
    m.kv_cache = "q8"
    assert m.new_cache(8).q8
    if calibrate:
        m.calibrate_key_offset(CALIBRATION)
        assert all(layer.k_offset is not None for layer in m.layers)
    return m


@pytest.mark.parametrize("name", ["sd", "specextend", "sd+chain"])
def test_greedy_speculation_equals_ar_over_a_q8_cache(folders, name):
    target = q8_model(folders[0])
    draft = target if name == "sd+chain" else load_model(folders[5], torch.float32, weights="int4")
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=32))
    r = eng.generate(PROMPT, Settings(max_new_tokens=32, **SMALL, **METHODS[name]))
    assert r.token_ids == ar.token_ids


def test_every_path_gives_the_same_logits_and_the_cache_is_not_bf16(folders, monkeypatch):
    model = q8_model(folders[0])
    ids = torch.tensor(PROMPT)
    logits = {}
    for path in kernels.cpu_paths():
        monkeypatch.setenv(kernels.CPU_ENV, path)
        logits[path] = model(ids, torch.arange(len(ids)), model.new_cache(len(ids)))
    assert all(torch.equal(v, logits["portable"]) for v in logits.values())
    model.kv_cache = "bf16"
    assert not torch.equal(model(ids, torch.arange(len(ids)), model.new_cache(len(ids))), logits["portable"])


def test_a_token_alone_inside_a_tree_and_inside_a_batch_gets_the_same_logits(folders):
    model = q8_model(folders[0])
    n = 9
    mask, depth = tree(n)
    tokens = torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor(PROMPT)
    cache = model.new_cache(len(PROMPT) + 2 * n)
    model.prefill(prompt, cache)
    p = cache.length
    other = model.new_cache(40)
    model.prefill(prompt[:30], other)
    tree_logits, _ = model.forward_many([Rows(tokens, p + torch.tensor(depth), cache, mask),
                                         Rows(tokens[:3], torch.arange(30, 33), other)])
    cache.discard()
    for i in (0, 4, 8):
        path = [j for j in range(n) if mask[i, j]]  # ancestors then i, in order
        alone = model.new_cache(len(PROMPT) + n)
        model.prefill(prompt, alone)
        if len(path) > 1:
            model(tokens[path[:-1]], p + torch.arange(len(path) - 1), alone)
            alone.commit()
        assert torch.equal(model(tokens[i : i + 1], torch.tensor([p + depth[i]]), alone)[0], tree_logits[i]), i


def _common_keys(model, size: float) -> None:
    """Give every layer's keys a large common part (as Qwen2's key bias gives layer 0's), in the
    dimensions rope turns slowest (the second half of each rotated half), which it leaves in place."""
    for layer in model.layers:
        q_out, d = layer.n_heads * layer.head_dim, layer.head_dim
        slow = (torch.arange(layer.n_kv * d) % (d // 2)) >= d // 4
        bias = layer.qkv.bias.detach()
        bias[q_out:q_out + layer.n_kv * d] += size * slow * torch.linspace(-1, 1, layer.n_kv * d)


def test_the_offsets_cut_the_q8_keys_error_where_keys_share_a_large_part(folders):
    ids = torch.tensor(PROMPT)
    keys = {}
    for name in ("bf16", "q8", "q8 less offsets"):
        model = q8_model(folders[5], calibrate=False)  # one layer: its keys' inputs are the embeddings
        _common_keys(model, 60.0)
        if name == "bf16":
            model.kv_cache = "bf16"
        if name == "q8 less offsets":
            model.calibrate_key_offset(CALIBRATION)
        cache = model.new_cache(len(ids))
        model.prefill(ids, cache)
        offset = model.layers[0].k_offset
        keys[name] = cache.keys(0, len(ids)).float() + (0 if offset is None else offset[:, None])
    err = {k: float((v - keys["bf16"]).norm()) for k, v in keys.items() if k != "bf16"}
    assert err["q8 less offsets"] < err["q8"] / 2, err


def test_the_whole_step_and_the_per_layer_forward_store_the_same_keys_less_the_offsets(folders):
    model = q8_model(folders[0])
    ids = torch.tensor(PROMPT[:12])  # within a whole step's rows
    caches = {}
    for rows in (fused_step.STEP_ROWS, 0):  # 0: every layer driven from Python (rope_store)
        model.step_rows = rows
        caches[rows] = model.new_cache(len(ids))
        model.prefill(ids, caches[rows])
    assert torch.equal(caches[0].k, caches[fused_step.STEP_ROWS].k)
    plain = q8_model(folders[0], calibrate=False)
    unshifted = plain.new_cache(len(ids))
    plain.prefill(ids, unshifted)
    assert not torch.equal(unshifted.k, caches[0].k)
    assert torch.equal(unshifted.v[0], caches[0].v[0])  # layer 0's values: the same input


def test_no_offsets_where_softmax_does_not_ignore_a_shift_and_the_fingerprint_names_them(folders):
    model = q8_model(folders[0])
    digest = model.key_offset_digest
    assert digest is not None
    with_offsets = fingerprint([(folders[0], model)])
    for change in ({"attn_softcap": 30.0}, {"attn_sinks": True}):
        cfg = model.cfg
        model.cfg = dataclasses.replace(cfg, **change)
        model.calibrate_key_offset(CALIBRATION)
        model.cfg = cfg
        assert model.key_offset_digest is None and all(layer.k_offset is None for layer in model.layers)
    assert fingerprint([(folders[0], model)]) != with_offsets
    model.calibrate_key_offset(CALIBRATION)
    assert model.key_offset_digest == digest and fingerprint([(folders[0], model)]) == with_offsets
    model.calibrate_key_offset(CALIBRATION[:20])
    assert fingerprint([(folders[0], model)]) not in (with_offsets, fingerprint([(folders[0], q8_model(folders[0],
                                                                                                  calibrate=False))]))


def test_a_q8_snapshot_and_kv_file_round_trip_and_a_bf16_cache_refuses_it(folders, tmp_path):
    model = q8_model(folders[0])
    prompt = torch.tensor(PROMPT)
    cache = model.new_cache(len(PROMPT) + 4)
    model.prefill(prompt[:-1], cache)
    want = model(prompt[-1:], torch.tensor([len(PROMPT) - 1]), cache)
    cache.discard()
    snap = cache.snapshot()
    path = tmp_path / "p.kv"
    kv_file.write(path, PROMPT[:-1], PrefixKV(snap, None), "fp", "t", None)
    _, back = kv_file.read(path)
    assert back.target_kv.k.dtype == torch.int8 and torch.equal(back.target_kv.k, snap.k)
    fresh = model.new_cache(len(PROMPT) + 4)
    fresh.load(back.target_kv)
    assert torch.equal(model(prompt[-1:], torch.tensor([len(PROMPT) - 1]), fresh), want)
    c = model.cfg
    plain = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, len(PROMPT), torch.bfloat16)
    with pytest.raises(ValueError, match="KV kinds q8 and bf16"):
        plain.load(snap)


def test_a_bad_kind_or_a_model_without_the_kernels_is_one_clear_error(tmp_path):
    with pytest.raises(UserError, match="unknown --kv-cache 'q4'"):
        LoadOptions(kv_cache="q4")
    from specextend import api

    folder = save_tiny_model(tmp_path / "m", seed=5, layers=1, **{k: v for k, v in SHAPE.items() if k != "vocab"})
    with pytest.raises(UserError, match="--kv-cache q8 needs the quantized CPU kernels"):
        api.load(folder, load_draft=False, weights="float32", kv_cache="q8", progress=False)
    pair = api.load(folder, load_draft=False, weights="int4", kv_cache="q8", progress=False)
    assert pair.target.kv_dtype == torch.int8 and pair.generate("ab", max_new_tokens=4, method="ar").new_tokens == 4
    assert pair.target.key_offset_digest is not None  # calibrated at load (models/calibration.py)
    assert api.load(folder, load_draft=False, weights="int4", progress=False).target.key_offset_digest is None


def test_the_key_offsets_are_measured_once_then_read_back_and_a_bad_file_measured_again(tmp_path, isolated_home):
    from safetensors.torch import load_file, save_file

    from specextend import api

    folder = save_tiny_model(tmp_path / "m", seed=5, layers=1, **{k: v for k, v in SHAPE.items() if k != "vocab"})

    def load(weights: str = "int4"):
        return api.load(folder, load_draft=False, weights=weights, kv_cache="q8", progress=False).target

    measured = load().key_offset_digest
    kept = list(isolated_home.rglob("*key-offsets-*.safetensors"))
    assert measured is not None and len(kept) == 1
    assert load().key_offset_digest == measured
    # What the file holds is what a load takes: another (valid) offset there is read back as it is.
    save_file({k: 2 * v for k, v in load_file(kept[0]).items()}, kept[0])
    doubled = load().key_offset_digest
    assert doubled not in (None, measured)
    kept[0].write_bytes(b"not a safetensors file")  # a damaged file is measured again and replaced
    assert load().key_offset_digest == measured
    assert load().key_offset_digest == measured and load_file(kept[0])
    assert load("int8").key_offset_digest not in (None, measured)  # another scheme, its own offsets
    assert len(list(isolated_home.rglob("*key-offsets-*.safetensors"))) == 2


def test_the_long_decode_bench_times_both_kinds_over_one_prefill(tmp_path, monkeypatch, capsys):
    from specextend.bench import long_decode, quality

    folder = save_tiny_model(tmp_path / "m", seed=5, layers=1, **{k: v for k, v in SHAPE.items() if k != "vocab"})
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": "abc " * 40 + str(i)}) for i in range(3)) + "\n")
    samples: list[float] = []

    class Rate:  # the memory's read rate, sampled beside each decode: 50 GB/s, then 40
        def sample(self) -> float:
            samples.append(50.0 if not samples else 40.0)
            return samples[-1]

        @property
        def span(self) -> tuple[float, float]:
            return min(samples), max(samples)

    monkeypatch.setattr(long_decode, "ReadRate", Rate)
    args = ["--target", str(folder), "--weights", "int4", "--data", str(data), "--lengths", "16,48",
            "--new-tokens", "3", "--repeats", "1"]
    assert long_decode.main([*args, "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["decode_tokens_per_s"]) == {"bf16@16", "q8@16", "bf16@48", "q8@48"}
    assert res["kv_bytes"]["q8@48"] / res["kv_bytes"]["bf16@48"] == 68 / 128  # head_dim 64: 68 bytes a row
    assert res["read_bandwidth_gbs_span"] == [40.0, 50.0] and res["read_bandwidth_gbs"] == 50.0  # floors at the best
    assert len(samples) == 1 + 4  # before the decodes, and after each
    with pytest.raises(SystemExit) as e:
        long_decode.main([*args[:-6], "--kv-caches", "q4"])
    assert e.value.code == 2
    assert quality._load_options("gguf@kv-q8") == {"dtype": "float32", "weights": "gguf", "kv_cache": "q8"}


def test_llamacpp_perplexity_runs_each_kv_type_against_the_first_and_reads_its_top1(tmp_path, capsys):
    from specextend.bench import quality

    base = quality.llamacpp_args(Path("m.gguf"), "t.txt", 8192, 2, 2, "f16", "b.kld", base=True)
    assert base[-2:] == ["--kl-divergence-base", "b.kld"] and "-ctk" not in base
    q8 = quality.llamacpp_args(Path("m.gguf"), "t.txt", 8192, 2, 2, "q8_0", "b.kld", base=False)
    assert q8[q8.index("-ctk") + 1] == q8[q8.index("-ctv") + 1] == "q8_0" and q8[q8.index("-fa") + 1] == "on"
    assert q8[-1] == "--kl-divergence" and q8[q8.index("-b") + 1] == "8192"  # a chunk in one pass, as ours
    assert "--kl-divergence-base" not in quality.llamacpp_args(Path("m"), "t", 64, 1, 2, "f16", None, base=True)
    # what llama-perplexity b11434 prints: a plain run's final estimate, a --kl-divergence run's statistics
    # (its per-chunk table's "Same top p" column is not the summary)
    plain = ("0.02.717006 I perplexity: tokenizing the input ..\n0.02.741308 I perplexity: tokenization took 24.3 ms\n"
             "[1]33.7716,[2]25.1120,\n0.14.956791 I Final estimate: PPL = 25.1120 +/- 5.13211\n")
    assert quality.parse_llamacpp_log(plain) == {"perplexity": 25.112, "stderr": 5.13211, "tokens": None}
    kl = ("chunk    PPL    ln(PPL(Q)/PPL(base))    KL Divergence    Δp RMS    Same top p\n"
          "   1      34.0215 ±   10.0552       0.02719 ±    0.02228       0.00501 ±    0.00065     1.448 ±  0.269 %"
          "    94.488 ±  2.033 %\n\n====== Perplexity statistics ======\n"
          "Mean PPL(Q)                   :  25.272611 ±   5.170916\n"
          "Mean PPL(base)                :  24.864350 ±   5.007384\n"
          "Mean PPL(Q)/PPL(base)         :   1.016420 ±   0.011986\n\n====== KL divergence statistics ======\n"
          "RMS Δp    :  1.130 ± 0.175 %\nSame top p: 95.669 ± 1.280 %\n")
    got = quality.parse_llamacpp_log(kl)
    assert got["perplexity"] == 25.272611 and got["perplexity_ratio_to_base"] == 1.01642
    assert got["top1_agreement"] == pytest.approx(0.95669) and got["top1_stderr"] == pytest.approx(0.0128)
    assert "top1_agreement" not in quality.parse_llamacpp_log(kl.split("\n====== KL")[0])
    assert quality.parse_llamacpp_log("main: error: failed to load model") == {}
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"text": "abc"}) + "\n")
    assert quality.main(["--data", str(data), "--llamacpp", "--llamacpp-kv", "f16,q3", "--out", str(tmp_path)]) == 2
    assert "unknown --llamacpp-kv q3; choose from f16" in capsys.readouterr().err
