"""gpt-oss (runtime/families.py over the shared forward and runtime/experts.py's expert layer) against
transformers' own GptOss code: attention sinks (the eager reference and the row-wise kernel), YaRN
rope with its attention factor, the clamped SwiGLU; then a tiny random GptOssForCausalLM written as
GGUF the way llama.cpp's converter writes it (each layer's experts stacked into `ffn_*_exps`, with
their biases, in MXFP4 from `gguf`'s own quantizer; attention sinks, biases, the router's bias):
logits against transformers on the file's weights, 32 greedy tokens, `sd` / `specextend` equal to
`ar`, every kernel path the same bits."""

from __future__ import annotations

import json
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from specextend.common.settings import Settings
from specextend.models import gguf as conv
from specextend.models.loader import load_model
from specextend.runtime import kernels
from specextend.runtime.attention import eager_attention
from specextend.runtime.config import ModelConfig
from specextend.runtime.experts import clamped_swiglu
from specextend.runtime.layers import rope_inv_freq
from specextend.runtime.transformer import Transformer
from specextend.speculation.decoder import SpecEngine
from test_families import SMALL, assert_every_path_gives_the_same_bits, hf_greedy, hf_logits, ours_logits

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
WINDOW = 6


def tiny_config(truncate: bool = False, layers: int = 4) -> tf.GptOssConfig:
    """gpt-oss's shape in small: experts 64 wide (MXFP4's blocks of 32, panels of 16), 4 of them, 2 a
    token; YaRN over an original window of 128; windows of 6 on the even layers."""
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 128}
    return tf.GptOssConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=4096,
                           rope_parameters=rope, bos_token_id=0, eos_token_id=95, pad_token_id=None)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_are_transformers_bits(truncate: bool) -> None:
    hf_cfg = tiny_config(truncate)
    cfg = ModelConfig.from_hf(hf_cfg.to_dict())
    inv, factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    assert torch.equal(rope_inv_freq(cfg), inv) and cfg.rope_scaling["attention_factor"] == factor
    # cos and sin scaled by the attention factor, as HF's rotary embedding returns them (its halves)
    model = Transformer(cfg)
    pos = torch.tensor([0, 1, 5, 127, 128, 1000, 4000])
    cos, sin = model.rope(pos)
    ref_cos, ref_sin = hf.GptOssRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), pos[None])
    half = cfg.head_dim // 2
    assert torch.equal(cos[:, :half], ref_cos[0]) and torch.equal(sin[:, :half], ref_sin[0])


def test_the_clamped_swiglu_is_the_experts_gate_of_transformers() -> None:
    gate_up = torch.randn(5, 64, dtype=torch.float64) * 6  # beyond the limit both ways
    ref = hf.GptOssExperts._apply_gate(SimpleNamespace(alpha=1.702, limit=7.0), gate_up)  # gate, up interleaved
    assert torch.equal(clamped_swiglu(gate_up[:, ::2], gate_up[:, 1::2]), ref)


def _hf_attention(q, k, v, sinks, allowed):
    """transformers' gpt-oss eager attention on [H, T, D] queries and [Hkv, S, D] keys and values."""
    module = SimpleNamespace(num_key_value_groups=q.shape[0] // k.shape[0], sinks=sinks, training=False)
    mask = torch.zeros(allowed.shape, dtype=q.dtype).masked_fill(~allowed, float("-inf"))
    out, _ = hf.eager_attention_forward(module, q[None], k[None], v[None], mask[None, None], q.shape[-1] ** -0.5)
    return out[0].transpose(0, 1)  # [H, T, D]


def _causal(t: int, s: int) -> torch.Tensor:
    return torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]


def test_sinks_join_the_softmax_as_transformers_adds_them() -> None:
    g = torch.Generator().manual_seed(0)
    h, kv, t, s, d = 4, 2, 5, 12, 32
    q, k, v = (torch.randn(n, m, d, generator=g, dtype=torch.float64) for n, m in ((h, t), (kv, s), (kv, s)))
    sinks = torch.randn(h, generator=g, dtype=torch.float64) * 2
    ref = _hf_attention(q, k, v, sinks, _causal(t, s))
    assert torch.allclose(eager_attention(q, k, v, None, None, None, sinks), ref, rtol=1e-12, atol=1e-12)
    # a sink is a logit no key matches: the probabilities no longer sum to one
    assert not torch.allclose(eager_attention(q, k, v), ref, atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("path", [*kernels.cpu_paths(), kernels.EMULATED_AMX])
def test_the_rowwise_kernel_takes_sinks_with_each_rows_own_bits(path: str) -> None:
    """The row-wise kernel with sinks: close to transformers on the same bfloat16 values, the
    portable path's bits on every path, and a token alone the bits it has among others."""
    ext = kernels.load()
    g = torch.Generator().manual_seed(1)
    h, kv, t, s, d = 8, 2, 9, 70, 64
    q = torch.randn(h, t, d, generator=g)
    k, v = (torch.randn(kv, s, d, generator=g).to(torch.bfloat16) for _ in range(2))
    sinks = torch.randn(h, generator=g) * 2
    out = ext.attend(q, k, v, None, kernels.path_index(path), sinks=sinks)
    assert torch.equal(out, ext.attend(q, k, v, None, kernels.path_index("portable"), sinks=sinks))
    qb = q.to(torch.bfloat16).double()  # the kernel's own rounding of q (after the scale) aside
    ref = _hf_attention(qb, k.double(), v.double(), sinks.double(), _causal(t, s))
    assert torch.allclose(out.double(), ref, atol=2e-2)
    for i in (0, 4, t - 1):  # token i alone over the keys it sees
        alone = ext.attend(q[:, i : i + 1], k[:, : s - t + i + 1], v[:, : s - t + i + 1], None,
                           kernels.path_index(path), sinks=sinks)
        assert torch.equal(alone, out[:, i : i + 1]), i


def make_gpt_oss(seed: int = 0, layers: int = 4, dtype=torch.float32):
    """A random GptOssForCausalLM, its weights spread so logits are not flat, its router and its
    queries and keys scaled up (routing and windows decided by more than the last bits)."""
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(layers=layers), dtype=dtype, attn_implementation="eager",
                                                experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                fan_in = p.shape[1] if p.ndim == 3 else p.shape[-1]  # experts: [experts, in, out]
                sharp = 4.0 if "router" in name else 1.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 1.0
                p.copy_(torch.randn_like(p) * (sharp * 0.6 / fan_in ** 0.5))
            else:
                p.copy_((1.0 if name.endswith("sinks") else 0.1) * torch.randn_like(p))
    return model.eval()


# transformers' gpt-oss tensors -> llama.cpp's (the experts' below, in `_experts`)
GGUF_NAMES = {"input_layernorm.weight": "attn_norm.weight",
              "post_attention_layernorm.weight": "post_attention_norm.weight",
              "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
              "mlp.router.bias": "ffn_gate_inp.bias",
              **{f"self_attn.{p}_proj.{s}": f"attn_{g}.{s}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"),
                                                                          ("o", "output")) for s in ("weight", "bias")}}


def _add(w: gguf.GGUFWriter, name: str, data: np.ndarray, kind: str) -> np.ndarray:
    """One tensor in `kind` (gguf's own quantizer, MXFP4 included); its values as the file holds them."""
    if kind == "F32":
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        return data
    qt = gguf.GGMLQuantizationType[kind]
    packed = gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), qt)
    w.add_tensor(name, packed, raw_dtype=qt)
    return gguf.quants.dequantize(packed, qt).astype(np.float32).reshape(data.shape)


def write_gpt_oss_gguf(model, path, kind: str = "MXFP4") -> dict[str, torch.Tensor]:
    """`model` as llama.cpp's converter writes gpt-oss: its keys (experts, the window, YaRN), the
    experts' fused, interleaved gate_up split into gate and up stacks [experts, out, in] (with their
    biases) in `kind`, the rest in float32; returns its HF state dict as the file holds it."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_bos_token_id(0)
    w.add_eos_token_id(cfg.vocab_size - 1)
    w.add_pad_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    stored: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.startswith("model.layers."):
            i, rest = key.split(".")[2], ".".join(key.split(".")[3:])
            if rest.startswith("mlp.experts."):
                continue
            back = _add(w, f"blk.{i}.{GGUF_NAMES[rest]}", value, "F32")
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[key]
            back = _add(w, name, value, "F32")
        stored[key] = torch.from_numpy(np.ascontiguousarray(back))
    for i in range(cfg.num_hidden_layers):
        stored.update(_experts(w, sd, i, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def _experts(w: gguf.GGUFWriter, sd: dict[str, np.ndarray], i: int, kind: str) -> dict[str, torch.Tensor]:
    p = f"model.layers.{i}.mlp.experts."
    gate_up, gu_bias = sd[p + "gate_up_proj"], sd[p + "gate_up_proj_bias"]  # [E, in, 2 ff], gate and up interleaved
    gate = _add(w, f"blk.{i}.ffn_gate_exps.weight", gate_up[..., ::2].transpose(0, 2, 1), kind)
    up = _add(w, f"blk.{i}.ffn_up_exps.weight", gate_up[..., 1::2].transpose(0, 2, 1), kind)
    down = _add(w, f"blk.{i}.ffn_down_exps.weight", sd[p + "down_proj"].transpose(0, 2, 1), kind)
    _add(w, f"blk.{i}.ffn_gate_exps.bias", gu_bias[:, ::2], "F32")
    _add(w, f"blk.{i}.ffn_up_exps.bias", gu_bias[:, 1::2], "F32")
    _add(w, f"blk.{i}.ffn_down_exps.bias", sd[p + "down_proj_bias"], "F32")
    back = np.empty_like(gate_up)
    back[..., ::2], back[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
    return {p + "gate_up_proj": torch.from_numpy(back), p + "gate_up_proj_bias": torch.from_numpy(gu_bias.copy()),
            p + "down_proj": torch.from_numpy(np.ascontiguousarray(down.transpose(0, 2, 1))),
            p + "down_proj_bias": torch.from_numpy(sd[p + "down_proj_bias"].copy())}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(kind, seed, layers) -> (our converted folder, the file's weights in HF names)."""
    cache: dict = {}

    def get(kind: str = "MXFP4", seed: int = 0, layers: int = 4):
        if (kind, seed, layers) not in cache:
            d = tmp_path_factory.mktemp(f"gptoss{kind}{seed}")
            stored = write_gpt_oss_gguf(make_gpt_oss(seed, layers), d / "m.gguf", kind)
            cache[kind, seed, layers] = (conv.convert_gguf(d / "m.gguf", d / "hf", progress=False, tokenizer=False),
                                         stored)
        return cache[kind, seed, layers]

    return get


def reference(stored: dict[str, torch.Tensor], dtype=torch.float64):
    model = make_gpt_oss(0, dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in stored.items()}, strict=True)
    assert not missing and not unexpected
    return model


PROMPT = torch.randint(0, 95, (24,), generator=torch.Generator().manual_seed(7)).tolist()  # past the window


def test_the_gguf_rebuilds_gpt_oss_config(converted) -> None:
    folder, _ = converted()
    config = json.loads((folder / "config.json").read_text())
    ref = tiny_config()
    assert config["model_type"] == "gpt_oss" and config["layer_types"] == ref.layer_types
    for k in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "sliding_window"):
        assert config[k] == getattr(ref, k), k
    cfg = ModelConfig.from_hf(config)
    assert cfg.rope_scaling["truncate"] is False and cfg.router == "topk_softmax" and cfg.expert_act == "swiglu_oai"
    assert torch.equal(rope_inv_freq(cfg), ROPE_INIT_FUNCTIONS["yarn"](ref, "cpu")[0])


def test_float_logits_and_32_greedy_tokens_equal_transformers(converted) -> None:
    """The file's weights (the experts' MXFP4 as gguf dequantizes them) in float64: transformers'
    logits (its norms compute in float32, about 1e-6 here; a missing sink, bias or window moves
    them by 1e-2 and more) and its greedy tokens."""
    folder, stored = converted()
    ref = reference(stored)
    ours = load_model(folder, torch.float64, weights="float64")
    expect = hf_logits(ref, PROMPT)
    assert torch.allclose(ours_logits(ours, PROMPT), expect, atol=2e-5, rtol=0)
    eng = SpecEngine(ours, ours, eos_ids=[])
    assert eng.generate(PROMPT, Settings(method="ar", max_new_tokens=32)).token_ids == hf_greedy(ref, PROMPT, 32)


@needs_kernels
def test_quantized_logits_track_transformers_with_the_experts_in_mxfp4(converted) -> None:
    """The quantized runtime on the file: the experts kept in MXFP4 (the kernels' mxfp4), the rest
    8-bit."""
    folder, stored = converted()
    ours = load_model(folder, torch.float32, weights="gguf")
    assert ours.fused and {s.fmt for m in ours.layers for q in m.moe.q_down for s in q.segments} == {"mxfp4"}
    expect = hf_logits(reference(stored), PROMPT)
    got = ours_logits(ours, PROMPT).double()
    # int8 activations, bfloat16 keys and values: within ~5% here (relative RMS); a dropped sink, bias
    # or window, or experts read in the wrong order, move them by 20% and more
    assert (got.argmax(-1) == expect.argmax(-1)).float().mean() >= 0.85
    assert (got - expect).norm() < 0.1 * expect.norm()


@needs_kernels
@pytest.mark.parametrize("method", ["sd", "specextend"])
def test_speculative_output_equals_ar(converted, method: str) -> None:
    """On the quantized runtime with the experts in MXFP4, a one-layer draft of the family."""
    target = load_model(converted()[0], torch.float32, weights="gguf")
    draft = load_model(converted(seed=5, layers=1)[0], torch.float32, weights="gguf")
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40))
    extra = dict(draft_gate=False) if method == "specextend" else {}
    assert eng.generate(PROMPT, Settings(method=method, max_new_tokens=40, **SMALL, **extra)).token_ids == ar.token_ids


@needs_kernels
def test_every_kernel_path_gives_the_same_bits(converted, monkeypatch) -> None:
    """SPECEXTEND_CPU forces each path this CPU runs: the same logits, and sd equal to ar on each."""
    assert_every_path_gives_the_same_bits(converted()[0], converted(seed=5, layers=1)[0], monkeypatch,
                                          PROMPT)


@needs_kernels
def test_a_batch_of_four_prompts_is_each_prompt_alone_and_inspect_names_mxfp4s_path(converted, capsys) -> None:
    from specextend.cli.main import main
    from test_experts import _greedy_batch

    folder, _ = converted()
    model = load_model(folder, torch.float32, weights="gguf")
    assert model.batches_rows
    prompts = [torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 9, 30)]
    batched = _greedy_batch(model, prompts, 12)
    for p, got in zip(prompts, batched, strict=True):
        alone = _greedy_batch(model, [p], 12)[0]
        assert all(torch.equal(a, b) for a, b in zip(alone, got, strict=True))
    assert main(["models", "inspect", str(folder.parent / "m.gguf")]) in (0, None)
    out = capsys.readouterr().out
    assert f"MXFP4 as it is ({kernels.path()} kernels)" in out and "attn_sinks" in out and "yarn" in out


@needs_kernels
def test_the_one_call_experts_take_the_biases_and_the_clamped_swiglu_with_the_per_product_bits(converted,
                                                                                            monkeypatch) -> None:
    """gpt-oss's experts (biases on each projection, the clamped SwiGLU) run in one C++ call with the
    bits of a kernel call per product, for 11 rows together and each alone; the kernels' SwiGLU is
    transformers' to float32 rounding."""
    from specextend.runtime import experts as experts_mod

    model = load_model(converted("MXFP4")[0], torch.float32, weights="gguf")
    moe, norm = model.layers[1].moe, model.layers[1].mlp_norm
    assert moe._one_call and moe.q_stacked_bias[0] is not None
    x = torch.randn(11, 128, generator=torch.Generator().manual_seed(5))
    one_call = moe.forward_rows(x, norm.weight, norm.eps)
    monkeypatch.setattr(experts_mod.Experts, "_one_call", property(lambda self: False))
    per_product = moe.forward_rows(x, norm.weight, norm.eps)
    assert torch.equal(one_call, per_product)
    for i in (0, 10):
        assert torch.equal(moe.forward_rows(x[i : i + 1], norm.weight, norm.eps)[0], one_call[i])
    gu = torch.randn(7, 2 * 64, generator=torch.Generator().manual_seed(6)) * 4
    torch.testing.assert_close(kernels.load().swiglu_oai(gu), clamped_swiglu(*gu.chunk(2, dim=-1)), rtol=3e-6,
                               atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("path", kernels.cpu_paths())
def test_the_whole_step_runs_gpt_oss_with_the_per_layer_bits(converted, monkeypatch, path) -> None:
    """gpt-oss decodes through the whole-step call (csrc/core/step.h: sinks, the output bias, windowed
    layers, the experts' biases and clamped SwiGLU) with the per-layer forward's bits: logits, K/V and
    kept queries for one row, a tree's level and 16 causal rows past the window."""
    from specextend.runtime import fused_step
    from test_step import run as step_run

    monkeypatch.setenv(kernels.CPU_ENV, path)
    model = load_model(converted("MXFP4")[0], torch.float32, weights="gguf")
    assert model.cfg.stepped
    calls = []
    real = fused_step.run
    monkeypatch.setattr(fused_step, "run", lambda *a, **kw: calls.append(a[1].shape[0]) or real(*a, **kw))
    python = step_run(model, 0)
    assert not calls
    whole = step_run(model, 16)
    assert calls and max(calls) == 16
    for i, (a, b) in enumerate(zip(python, whole, strict=True)):
        assert torch.equal(a, b), i


def test_a_hugging_face_gpt_oss_folder_is_refused_in_one_line(tmp_path) -> None:
    from specextend.common.errors import UserError

    make_gpt_oss(0, layers=1).save_pretrained(tmp_path)
    with pytest.raises(UserError, match="load the model's GGUF"):
        load_model(tmp_path, torch.float32, weights="float32")
