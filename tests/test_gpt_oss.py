"""gpt-oss's pieces over the shared forward, against transformers' own GptOss code: attention sinks
(the eager reference and the row-wise kernel), YaRN rope with its attention factor, the clamped
SwiGLU, biases on q/k/v/o and sliding-window layers; a whole tiny GptOssForCausalLM with its
experts zeroed (its MLPs then add nothing, so every other piece is compared: the expert layer is
runtime/experts.py's, tested there), in float64 and on the quantized runtime."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from specextend.runtime import kernels, quant
from specextend.runtime.attention import eager_attention
from specextend.runtime.config import ModelConfig
from specextend.runtime.layers import clamped_swiglu, rope_inv_freq
from specextend.runtime.transformer import Transformer

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
WINDOW = 6


def tiny_config(truncate: bool = False, **kw) -> tf.GptOssConfig:
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": truncate, "original_max_position_embeddings": 128}
    return tf.GptOssConfig(vocab_size=96, hidden_size=128, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=4096,
                           rope_parameters=rope, **kw)


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
    out = ext.attend(q, k, v, None, kernels.path_index(path), sinks)
    assert torch.equal(out, ext.attend(q, k, v, None, kernels.path_index("portable"), sinks))
    qb = q.to(torch.bfloat16).double()  # the kernel's own rounding of q (after the scale) aside
    ref = _hf_attention(qb, k.double(), v.double(), sinks.double(), _causal(t, s))
    assert torch.allclose(out.double(), ref, atol=2e-2)
    for i in (0, 4, t - 1):  # token i alone over the keys it sees
        alone = ext.attend(q[:, i : i + 1], k[:, : s - t + i + 1], v[:, : s - t + i + 1], None,
                           kernels.path_index(path), sinks)
        assert torch.equal(alone, out[:, i : i + 1]), i


def tiny_pair(seed: int = 0) -> tuple[torch.nn.Module, Transformer]:
    """A random GptOssForCausalLM (float64, eager) with its experts and router zeroed, and our model
    of its config holding the same weights (its MLPs zero: both add nothing after attention)."""
    torch.manual_seed(seed)
    hf_model = tf.AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float64, attn_implementation="eager",
                                                   experts_implementation="eager")
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if ".mlp." in name:
                p.zero_()
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim == 2:
                p.copy_(torch.randn_like(p) * (0.6 / p.shape[1] ** 0.5))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    hf_model.eval()
    cfg = ModelConfig.from_hf(hf_model.config.to_dict())
    ours = Transformer(cfg).to(torch.float64)
    sd = hf_model.state_dict()
    with torch.no_grad():
        ours.embed.weight.copy_(sd["model.embed_tokens.weight"])
        ours.norm.weight.copy_(sd["model.norm.weight"])
        ours.lm_head.weight.copy_(sd["lm_head.weight"])
        for i, blk in enumerate(ours.layers):
            a = f"model.layers.{i}.self_attn."
            blk.qkv.weight.copy_(torch.cat([sd[a + f"{n}_proj.weight"] for n in "qkv"]))
            blk.qkv.bias.copy_(torch.cat([sd[a + f"{n}_proj.bias"] for n in "qkv"]))
            blk.o.weight.copy_(sd[a + "o_proj.weight"])
            blk.o.bias.copy_(sd[a + "o_proj.bias"])
            blk.sinks.copy_(sd[a + "sinks"])
            blk.attn_norm.weight.copy_(sd[f"model.layers.{i}.input_layernorm.weight"])
            blk.mlp_norm.weight.copy_(sd[f"model.layers.{i}.post_attention_layernorm.weight"])
            blk.gate_up.weight.zero_()
            blk.down.weight.zero_()
    return hf_model, ours.eval()


TOKENS = torch.randint(0, 95, (20,), generator=torch.Generator().manual_seed(3))  # past the window of 6


def test_a_tiny_gpt_oss_without_experts_gives_transformers_logits() -> None:
    """Sinks, YaRN, biases on q/k/v/o and the alternating windowed layers, in float64 (prefill in
    chunks that cross the window, so cached keys leave it as transformers' mask drops them)."""
    hf_model, ours = tiny_pair()
    with torch.no_grad():
        ref = hf_model(TOKENS[None]).logits[0]
        cache = ours.new_cache(32)
        got = []
        for s in range(0, len(TOKENS), 7):
            piece = TOKENS[s : s + 7]
            got.append(ours(piece, torch.arange(s, s + len(piece)), cache, backend="eager"))
            cache.commit()
    # transformers' gpt-oss norms compute in float32 even in a float64 model (about 2e-7 here); a
    # missing sink, bias or window, or another rope, moves the logits by 1e-3 and more
    assert torch.allclose(torch.cat(got), ref, rtol=0, atol=1e-6)


@needs_kernels
def test_the_quantized_runtime_runs_the_switches_row_by_row() -> None:
    """On the quantized runtime (8-bit weights, the row-wise kernel with sinks, o's bias in its
    product): a prompt's logits track the float model on the same weights, and each token decoded
    alone gets the bits it gets inside the prompt's forward."""
    _, ours = tiny_pair(1)
    ours = ours.float()
    ref_model = Transformer(ours.cfg)
    ref_model.load_state_dict(ours.state_dict())
    for mod in [*(m for blk in ours.layers for m in (blk.qkv, blk.o, blk.gate_up, blk.down)), ours.lm_head]:
        mod.quantize(quant.quantize(mod.weight.float(), 8))
    for p, q in zip(ref_model.modules(), ours.modules(), strict=True):
        if getattr(q, "qweight", None) is not None and hasattr(p, "weight"):
            p.weight.data = q.qweight.dequantize()  # the float reference multiplies the same weights
    ours.rowwise_attention = True
    assert ours.fused
    with torch.no_grad():
        cache = ours.new_cache(32)
        whole = ours(TOKENS, torch.arange(len(TOKENS)), cache)
        ref = ref_model(TOKENS, torch.arange(len(TOKENS)), ref_model.new_cache(32), backend="eager")
        assert torch.allclose(whole, ref, atol=0.05 * ref.abs().max().item())
        cache = ours.new_cache(32)
        for i, tok in enumerate(TOKENS.tolist()):
            one = ours(torch.tensor([tok]), torch.tensor([i]), cache)
            cache.commit()
            assert torch.equal(one[0], whole[i]), i
