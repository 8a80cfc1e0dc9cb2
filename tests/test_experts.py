"""Mixture-of-experts families (runtime/experts.py): Qwen3-MoE, Qwen2-MoE (a shared expert under a
sigmoid gate), Mixtral (llama.cpp's `llama` with experts), OLMoE, Granite MoE and ERNIE 4.5's MoE (a
dense first layer, a selection bias, ungated shared experts), each a tiny random model of
transformers' own class written as GGUF the way llama.cpp's converter writes it (each layer's
experts stacked into 3-D `ffn_*_exps` tensors, the family's `expert_*` keys), in float32, Q8_0 and
a K-quant; converted by our loader and compared with transformers on the same weights; greedy over
32 tokens; `sd` / `specextend` against `ar`; a batch of different prompts against each alone; and
the expert layer's rows independent of each other on every kernel path."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from specextend.common.settings import Settings
from specextend.models import gguf as conv
from specextend.models.loader import load_model
from specextend.runtime import experts as experts_mod
from specextend.runtime import fused_step, kernels
from specextend.runtime.layers import Rows
from specextend.speculation.decoder import SpecEngine
from test_families import SMALL, hf_logits, ours_logits, scaled_blocks
from test_gguf import llama_cpp_permute
from test_quantized_runtime import tree
from test_step import run as step_run

ARCHS = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "granitemoe", "ernie4_5-moe", "lfm2moe", "granitemoe_swa"]
GGUF_ARCH = {"mixtral": "llama", "granitemoe_swa": "granite_swa"}  # llama.cpp files Mixtral under llama
PERMUTED = {"mixtral", "granitemoe", "granitemoe_swa"}  # llama.cpp converts these as Llama (Q/K rows interleaved)
TENSOR_MAP = {"granite_swa": "granitemoe"}  # gguf's name map of the family (this gguf package knows no Granite SWA)
# Widths divisible by 256 (K-quants); each expert 256 wide, 8 of them, 2 or 3 a token.
HIDDEN, FF, SHARED_FF, VOCAB, LAYERS = 256, 256, 512, 96, 2
PROMPT = torch.randint(0, 95, (24,), generator=torch.Generator().manual_seed(7)).tolist()
needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")


def hf_config(arch: str, layers: int = LAYERS):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
                  eos_token_id=VOCAB - 1, pad_token_id=None)
    if arch == "qwen3moe":  # llama.cpp renormalises Qwen3-MoE's top k (as the released models' configs say)
        return tf.Qwen3MoeConfig(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=FF, intermediate_size=512,
                                 norm_topk_prob=True, head_dim=64, rms_norm_eps=1e-6, **common)
    if arch == "qwen2moe":  # and not Qwen2-MoE's nor OLMoE's
        return tf.Qwen2MoeConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=FF, intermediate_size=512,
                                 shared_expert_intermediate_size=SHARED_FF, norm_topk_prob=False, rms_norm_eps=1e-6,
                                 **common)
    if arch == "granitemoe":  # Granite's multipliers far from 1, so a forward that drops one cannot pass
        return tf.GraniteMoeConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=FF, rms_norm_eps=1e-5,
                                   embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.25,
                                   logits_scaling=2.5, **common)
    if arch == "granitemoe_swa":  # Granite MoE's, its first layer global without rope, the second windowed (8)
        return tf.GraniteMoeSWAConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=FF,
                                      rms_norm_eps=1e-5, embedding_multiplier=4.0, residual_multiplier=0.5,
                                      attention_multiplier=0.1, logits_scaling=0.5, sliding_window=8,
                                      layer_rope_theta=[0 if i % 4 == 0 else 10_000.0 for i in range(layers)], **common)
    if arch == "ernie4_5-moe":  # a dense first layer where there are more; two shared experts as one MLP of 512
        return tf.Ernie4_5_MoeConfig(moe_num_experts=8, moe_k=3, moe_intermediate_size=FF, intermediate_size=512,
                                     moe_num_shared_experts=SHARED_FF // FF, moe_layer_start_index=int(layers > 1),
                                     rms_norm_eps=1e-5, **common)
    if arch == "lfm2moe":  # a dense first layer (attention) where there are more, then a convolution with experts
        types = ["full_attention", "conv"][-layers:] if layers <= 2 else None
        return tf.Lfm2MoeConfig(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=FF, intermediate_size=512,
                                num_dense_layers=int(layers > 1), layer_types=types, norm_eps=1e-5, rms_norm_eps=1e-5,
                                **{**common, "tie_word_embeddings": True})  # llama.cpp's lfm2moe has no output
    if arch == "mixtral":
        return tf.MixtralConfig(num_local_experts=8, num_experts_per_tok=2, intermediate_size=FF, rms_norm_eps=1e-5,
                                sliding_window=None, **common)
    return tf.OlmoeConfig(num_experts=8, num_experts_per_tok=2, intermediate_size=FF, norm_topk_prob=False,
                          rms_norm_eps=1e-5, **common)


def make_moe(arch: str, seed: int = 0, layers: int = LAYERS, dtype=torch.float32):
    """A random transformers model of the family, its weights spread so logits are not flat and the
    router's scaled up (routing decided by more than the last bits)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch, layers), dtype=dtype, attn_implementation="eager",
                                             experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.ndim >= 2:
                sharp = 4.0 if name.endswith(("mlp.gate.weight", "router.weight", "feed_forward.gate.weight")) else 1.0
                p.copy_(torch.randn_like(p) * (sharp * 0.6 / p.shape[-1] ** 0.5))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # LFM2's selection bias, a buffer: at the sigmoids' spread
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def _gguf_names(arch: str, hf: str, names) -> list[tuple[str, slice | None]]:
    """GGUF tensor names for a HF tensor (a fused expert gate_up: two, each a half of its rows)."""
    m = hf.split(".")
    if hf.endswith("experts.gate_up_proj"):  # mlp's, or Granite MoE's block_sparse_moe's
        return [(f"blk.{m[2]}.ffn_gate_exps.weight", slice(0, FF)), (f"blk.{m[2]}.ffn_up_exps.weight", slice(FF, None))]
    if hf.endswith("experts.down_proj"):
        return [(f"blk.{m[2]}.ffn_down_exps.weight", None)]
    if hf.endswith("block_sparse_moe.router.weight"):  # transformers 5's name of Granite MoE's router
        return [(f"blk.{m[2]}.ffn_gate_inp.weight", None)]
    if hf.endswith(("moe_statics.e_score_correction_bias", "feed_forward.expert_bias")):  # llama.cpp's exp_probs_b
        return [(f"blk.{m[2]}.exp_probs_b.bias", None)]
    if hf.endswith("self_attn.sinks"):  # (a name map without attention sinks)
        return [(f"blk.{m[2]}.attn_sinks.weight", None)]
    gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert gname is not None, hf
    return [(gname, None)]


def write_moe_gguf(model, path, arch: str, kind: str = "F32", seed: int = 0) -> dict[str, torch.Tensor]:
    """`model` as llama.cpp's converter writes it, matrices in `kind`; returns its HF state dict as
    the file holds it (quantized matrices as they dequantize)."""
    cfg = model.config
    garch = GGUF_ARCH.get(arch, arch)
    w = gguf.GGUFWriter(str(path), garch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    lfm2 = arch == "lfm2moe"  # 0 KV heads on a convolution's layer, the kernel's length
    w.add_head_count_kv([0 if t == "conv" else cfg.num_key_value_heads for t in cfg.layer_types] if lfm2
                        else cfg.num_key_value_heads)
    if lfm2:
        w.add_shortconv_l_cache(cfg.conv_L_cache)
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch.startswith(("qwen", "ernie", "lfm2")):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "ernie4_5-moe":  # its converter's keys
        w.add_expert_shared_count(cfg.moe_num_shared_experts)
        w.add_leading_dense_block_count(cfg.moe_layer_start_index)
        w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
    if arch == "granitemoe_swa":  # the windowed layers and the layers with rope as lists
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_array("granite_swa.attention.rope_pattern", [bool(t) for t in cfg.layer_rope_theta])
    if arch in ("granitemoe", "granitemoe_swa"):  # Granite's multipliers, as llama.cpp's converter names them
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    w.add_bos_token_id(0)
    w.add_eos_token_id(cfg.vocab_size - 1)
    w.add_pad_token_id(0)
    arch_id = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == TENSOR_MAP.get(garch, garch))
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    rng = np.random.default_rng(seed)
    stored: dict[str, torch.Tensor] = {}
    for hf, value in ((k, v.detach().float().numpy()) for k, v in model.state_dict().items()):
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:  # the embedding's (LFM2's MoE): no tensor of its own
            continue
        backs = []
        for gname, rows in _gguf_names(arch, hf, names):
            data = value if rows is None else value[:, rows]
            heads = None
            if arch in PERMUTED and hf.endswith(("q_proj.weight", "k_proj.weight")):
                heads = cfg.num_attention_heads if "q_proj" in hf else cfg.num_key_value_heads
                data = llama_cpp_permute(data, heads)
            if hf.endswith(("shared_expert_gate.weight", "e_score_correction_bias")):
                data = data.reshape(-1)  # llama.cpp's ffn_gate_inp_shexp and exp_probs_b are vectors
            if hf.endswith("conv.conv.weight"):  # LFM2's kernel, squeezed to [channels, length], kept in F32
                data = data.squeeze(1)
            router = any(r in hf for r in ("mlp.gate.", "router.", "expert_gate", "feed_forward.gate.", "conv.conv"))
            back = _add(w, gname, np.ascontiguousarray(data), kind if value.ndim >= 2 and not router else "F32", rng)
            if heads is not None:
                back = llama_cpp_permute_back(back, heads)
            backs.append(back.reshape(value[:, rows].shape if rows is not None else value.shape))
        whole = np.concatenate(backs, axis=1) if len(backs) > 1 else backs[0]
        stored[hf] = torch.from_numpy(np.ascontiguousarray(whole))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if cfg.tie_word_embeddings:
        stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    return stored


def llama_cpp_permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _add(w: gguf.GGUFWriter, gname: str, data: np.ndarray, kind: str, rng) -> np.ndarray:
    """Write one tensor in `kind` (routers and vectors stay F32, as llama.cpp keeps them); returns
    its values as the file holds them."""
    if kind == "F32":
        w.add_tensor(gname, data.astype(np.float32))
        return data
    qt = gguf.GGMLQuantizationType[kind]
    flat = data.reshape(-1, data.shape[-1])
    # gguf has no K-quant quantizer: random valid blocks at the weights' spread are the weights
    packed = gguf.quants.quantize(flat, qt) if kind == "Q8_0" else scaled_blocks(kind, flat, int(rng.integers(1 << 30)))
    back = gguf.quants.dequantize(packed, qt).astype(np.float32).reshape(data.shape)
    w.add_tensor(gname, packed.reshape(*data.shape[:-1], -1), raw_dtype=qt)
    return back


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(arch, kind, seed, layers) -> (our converted folder, the file's weights in HF names)."""
    cache: dict = {}

    def get(arch: str, kind: str = "F32", seed: int = 0, layers: int = LAYERS):
        key = (arch, kind, seed, layers)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}{kind}{seed}")
            stored = write_moe_gguf(make_moe(arch, seed, layers), d / "m.gguf", arch, kind, seed)
            cache[key] = (conv.convert_gguf(d / "m.gguf", d / "hf", progress=False, tokenizer=False), stored)
        return cache[key]

    return get


def reference(arch: str, stored: dict[str, torch.Tensor], dtype=torch.float64):
    model = make_moe(arch, 0, dtype=dtype)
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in stored.items()}, strict=True)
    assert not missing and not unexpected
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_the_gguf_rebuilds_the_expert_config(converted, arch):
    folder, _ = converted(arch)
    config = json.loads((folder / "config.json").read_text())
    cfg = load_model(folder, torch.float32, weights="float32").cfg
    ref = hf_config(arch)
    assert cfg.arch == arch and not cfg.plain
    assert (cfg.experts, cfg.experts_used, cfg.expert_ff) == (8, ref.num_experts_per_tok, FF)
    assert cfg.shared_ff == (SHARED_FF if arch in ("qwen2moe", "ernie4_5-moe") else 0)
    assert cfg.shared_gate == (arch != "ernie4_5-moe")
    assert cfg.router == {"qwen3moe": "softmax_topk_norm", "mixtral": "softmax_topk_norm",
                          "granitemoe": "topk_softmax", "granitemoe_swa": "topk_softmax",
                          "ernie4_5-moe": "softmax_biased_topk_norm",
                          "lfm2moe": "sigmoid_biased_topk_norm"}.get(arch, "softmax_topk")
    assert [cfg.expert_layer(i) for i in range(LAYERS)] == [arch not in ("ernie4_5-moe", "lfm2moe"), True]
    assert cfg.conv_layers == ((False, True) if arch == "lfm2moe" else ())
    if arch == "ernie4_5-moe":  # `models inspect`'s line says what differs
        assert "an ungated shared expert (512), 1 dense layer (512)" in cfg.describe()
    assert cfg.qk_norm == {"qwen3moe": "head", "olmoe": "full", "lfm2moe": "head"}.get(arch, "")
    assert config["model_type"] == ref.model_type


@pytest.mark.parametrize("arch", ARCHS)
def test_float_logits_and_32_greedy_tokens_equal_transformers(converted, arch):
    folder, stored = converted(arch)
    ref = reference(arch, stored)
    ours = load_model(folder, torch.float64, weights="float64")
    expect = hf_logits(ref, PROMPT)
    assert torch.allclose(ours_logits(ours, PROMPT), expect, atol=1e-5, rtol=0)
    got = SpecEngine(ours, ours, eos_ids=[]).generate(PROMPT, Settings(method="ar", max_new_tokens=32)).token_ids
    # transformers' own greedy decoding with its cache (argmax of each step, as test_families' loop)
    assert got == ref.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False)[0, len(PROMPT):].tolist()
    f32 = load_model(folder, torch.float32, weights="float32")
    assert torch.allclose(ours_logits(f32, PROMPT).double(), expect, atol=1e-3, rtol=0)


@needs_kernels
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_logits_track_transformers_with_the_files_expert_types(converted, arch, kind):
    folder, stored = converted(arch, kind)
    ours = load_model(folder, torch.float32, weights="gguf")
    assert ours.fused and not ours.cfg.plain
    moe = next(layer.moe for layer in ours.layers if layer.moe is not None)
    assert moe.q_down[0].segments[0].fmt == {"Q8_0": "q8", "Q4_K": "q4k"}[kind]  # the file's type, not expanded
    expect = hf_logits(reference(arch, stored), PROMPT)
    got = ours_logits(ours, PROMPT).double()
    # int8 activations: within ~2% a position where the routing agrees; where two experts' router
    # logits lie closer than that, the quantized runtime may pick the other (as llama.cpp's may),
    # which moves that position by tens of percent. A dropped switch moves every position.
    assert (got.argmax(-1) == expect.argmax(-1)).float().mean() >= 0.85
    off = (got - expect).norm(dim=-1) / expect.norm(dim=-1)
    assert (off < 0.05).float().mean() >= 0.75, off


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_the_quantized_expert_layer_is_the_float_one_on_the_files_weights(converted, arch):
    """Layer by layer, on the same rows: the router's logits exact to float32 rounding (its float32
    weights through the kernels as three bfloat16 parts), the same experts, the output within the
    int8 activations' ~1%; the float64 layer on the same file's weights is the reference."""
    folder, _ = converted(arch, "Q8_0")
    ours = load_model(folder, torch.float32, weights="gguf")
    ref = load_model(folder, torch.float64, weights="float64")
    x = 2 * torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(2))
    for layer, other in zip(ours.layers, ref.layers, strict=True):
        moe, norm = layer.moe, layer.mlp_norm
        if moe is None:  # a dense layer among the expert ones (ERNIE's first)
            continue
        got = moe.forward_rows(x, norm.weight, norm.eps).double()
        h = other.mlp_norm(x.double())
        logits = moe._router_rows(x, {"norm": norm.weight, "eps": norm.eps})[:, : moe.count].double()
        assert torch.allclose(logits, other.moe.router(h), atol=2e-5 * float(logits.abs().max()), rtol=0)
        assert torch.equal(moe.weighting(logits, moe.used, moe.select_bias)[0].sort(-1)[0],
                           other.moe.weighting(other.moe.router(h), moe.used, other.moe.select_bias)[0].sort(-1)[0])
        want = other.moe(h)
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.03


# Every family with the quantized runtime's sd, both methods on one, and the float32 path on one.
SPECULATIVE = [(arch, "Q8_0", "sd") for arch in ARCHS] + [("qwen2moe", "Q8_0", "specextend"), ("mixtral", "F32", "sd")]


@needs_kernels
@pytest.mark.parametrize(("arch", "kind", "method"), SPECULATIVE)
def test_speculative_output_equals_ar(converted, arch, kind, method):
    weights = "float32" if kind == "F32" else "gguf"
    target = load_model(converted(arch, kind)[0], torch.float32, weights=weights)
    draft = load_model(converted(arch, kind, seed=5, layers=1)[0], torch.float32, weights=weights)
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=32))
    extra = dict(draft_gate=False) if method == "specextend" else {}
    assert eng.generate(PROMPT, Settings(method=method, max_new_tokens=32, **SMALL, **extra)).token_ids == ar.token_ids


def _greedy_batch(model, prompts: list[list[int]], steps: int) -> list[list[torch.Tensor]]:
    """Greedy decoding of several prompts, each step one forward of all of them (`forward_many`):
    every step's logits of each."""
    caches = [model.new_cache(len(p) + steps + 1) for p in prompts]
    last = [model.prefill(torch.tensor(p), c, chunk=8) for p, c in zip(prompts, caches, strict=True)]
    out: list[list[torch.Tensor]] = [[x] for x in last]
    for _ in range(steps):
        parts = [Rows(torch.tensor([int(x[-1].argmax())]), torch.tensor([c.length]), c)
                 for x, c in zip(out, caches, strict=True)]
        for o, logits, c in zip(out, model.forward_many(parts), caches, strict=True):
            c.commit()
            o.append(logits[0])
    return out


@needs_kernels
@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_of_four_prompts_is_each_prompt_alone(converted, arch):
    model = load_model(converted(arch, "Q8_0")[0], torch.float32, weights="gguf")
    assert model.batches_rows
    prompts = [torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 9, 30)]
    batched = _greedy_batch(model, prompts, 12)
    for p, got in zip(prompts, batched, strict=True):
        alone = _greedy_batch(model, [p], 12)[0]
        assert all(torch.equal(a, b) for a, b in zip(alone, got, strict=True))


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe", "ernie4_5-moe", "lfm2moe", "granitemoe_swa"])
def test_every_kernel_path_gives_the_same_bits_and_rows_never_mix(converted, monkeypatch, arch):
    """Each path this CPU runs: a tree's rows (routed to different experts) get the bits each gets
    alone after its ancestors, and every path the portable one's logits."""
    model = load_model(converted(arch, "Q4_K")[0], torch.float32, weights="gguf")
    mask, depth = tree(9)
    n, p = len(depth), len(PROMPT)
    tokens = torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(1))
    logits = {}
    for path in kernels.cpu_paths():
        monkeypatch.setenv(kernels.CPU_ENV, path)
        cache = model.new_cache(p + n)
        model.prefill(torch.tensor(PROMPT), cache, chunk=16)
        logits[path] = model(tokens, p + torch.tensor(depth), cache, mask)
        for i in (0, n - 1):
            alone = model.new_cache(p + n)
            model.prefill(torch.tensor(PROMPT), alone, chunk=16)
            path_i = [j for j in range(n) if mask[i, j]]
            if len(path_i) > 1:
                model(tokens[path_i[:-1]], p + torch.arange(len(path_i) - 1), alone)
                alone.commit()
            assert torch.equal(model(tokens[i : i + 1], torch.tensor([p + depth[i]]), alone)[0], logits[path][i])
    assert all(torch.equal(v, logits["portable"]) for v in logits.values())


@needs_kernels
def test_the_expert_layer_reads_only_each_rows_experts_and_its_rows_stand_alone(converted, monkeypatch):
    """One row runs its k experts (2 products each), the router and nothing else; R rows run each
    expert they chose once; each row's output is the bits it gets alone. The one-call experts
    (`kernels.experts_rows`) give the per-product path's bits, in a batch and alone."""
    model = load_model(converted("mixtral", "Q8_0")[0], torch.float32, weights="gguf")
    moe, norm = model.layers[0].moe, model.layers[0].mlp_norm
    x = torch.randn(13, HIDDEN, generator=torch.Generator().manual_seed(3))
    logits = moe._router_rows(x, {"norm": norm.weight, "eps": norm.eps})[:, : moe.count]
    chosen = kernels.load().route_rows(logits, moe.used, moe.weighting_id)[0]
    assert moe._one_call
    one_call = moe.forward_rows(x, norm.weight, norm.eps)
    alone = [moe.forward_rows(x[i : i + 1], norm.weight, norm.eps)[0] for i in range(x.shape[0])]
    monkeypatch.setattr(experts_mod.Experts, "_one_call", property(lambda self: False))
    calls = []
    real = experts_mod.qlinear
    monkeypatch.setattr(experts_mod, "qlinear", lambda *a, **kw: calls.append(a[1]) or real(*a, **kw))
    rows = moe.forward_rows(x, norm.weight, norm.eps)
    assert len(calls) == 1 + 2 * len(torch.unique(chosen))
    assert torch.equal(one_call, rows)
    for i in range(x.shape[0]):
        calls.clear()
        assert torch.equal(moe.forward_rows(x[i : i + 1], norm.weight, norm.eps)[0], rows[i]), i
        assert torch.equal(alone[i], rows[i]), i
        assert len(calls) == 1 + 2 * moe.used
        assert {id(w) for w in calls[1::2]} == {id(moe.q_gate_up[e]) for e in chosen[i].tolist()}


@needs_kernels
@pytest.mark.parametrize("router", sorted(experts_mod.WEIGHTING_IDS))
def test_the_kernels_weighting_is_the_references_with_ties_to_the_lower_index(router):
    """`route_rows` (csrc/core/experts.h) picks PyTorch's experts in PyTorch's order with its weights to
    float32 rounding, row by row; equal logits go to the lower index; a bad k is refused."""
    ext, used, kind = kernels.load(), 3, experts_mod.WEIGHTING_IDS[router]
    biased = router in experts_mod.BIASED  # ERNIE's, LFM2's: a selection bias that moves the picks, not the weights
    logits = torch.randn(40, 16, generator=torch.Generator().manual_seed(4)) * 3
    bias = torch.randn(16, generator=torch.Generator().manual_seed(5)) * 0.2 if biased else None
    experts, weights = ext.route_rows(logits, used, kind, bias)
    ref_experts, ref_weights = experts_mod.WEIGHTINGS[router](logits, used, bias)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=2e-6, atol=1e-7)
    if biased:  # the bias picks other experts than the probabilities alone
        assert not torch.equal(experts, experts_mod.WEIGHTINGS[router](logits, used, torch.zeros(16))[0])
    for i in range(4):
        e, w = ext.route_rows(logits[i : i + 1], used, kind, bias)
        assert torch.equal(e[0], experts[i]) and torch.equal(w[0], weights[i])
    tied = torch.zeros(1, 8)
    tied[0, 5] = tied[0, 2] = 1.0
    assert ext.route_rows(tied, used, kind, torch.zeros(8) if biased else None)[0].tolist() == [[2, 5, 0]]
    with pytest.raises(RuntimeError, match="top-k"):
        ext.route_rows(logits, 17, 0)
    with pytest.raises(RuntimeError, match="selection bias"):  # the bias and the biased weighting come together
        ext.route_rows(logits, used, kind, None if biased else torch.zeros(16))


@needs_kernels
@pytest.mark.parametrize("path", kernels.cpu_paths())
@pytest.mark.parametrize(("arch", "kind"), [("qwen3moe", "Q4_K"), ("mixtral", "Q8_0"), ("olmoe", "Q4_K"),
                                           ("qwen2moe", "Q8_0"), ("qwen2moe", "Q4_K"), ("ernie4_5-moe", "Q4_K"),
                                           ("lfm2moe", "Q4_K"), ("granitemoe_swa", "Q4_K")])
def test_the_whole_step_runs_the_experts_with_the_per_layer_bits(converted, monkeypatch, path, arch, kind):
    """SiLU experts (Qwen2-MoE's with its shared expert under a sigmoid gate) decode through the
    whole-step call (csrc/core/step.h) with the per-layer forward's bits: logits, every K/V slot and
    the kept queries, for one row, a tree's level and 16 causal rows, on every path this CPU runs."""
    monkeypatch.setenv(kernels.CPU_ENV, path)
    model = load_model(converted(arch, kind)[0], torch.float32, weights="gguf")
    assert model.cfg.stepped and model.fused
    calls = []
    real = fused_step.run
    monkeypatch.setattr(fused_step, "run", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    python = step_run(model, 0)
    assert not calls
    whole = step_run(model, 16)
    assert calls and max(calls) == 16
    assert len(python) == len(whole)
    for i, (a, b) in enumerate(zip(python, whole, strict=True)):
        assert torch.equal(a, b), i


def test_a_shared_expert_is_described_and_stepped(converted):
    """Qwen2-MoE's shared expert: `models inspect`'s line names it, and decode steps take the
    whole-step call."""
    model = load_model(converted("qwen2moe", "Q8_0")[0], torch.float32, weights="gguf")
    assert model.cfg.stepped and model.fused
    assert "a shared expert" in model.cfg.describe() and "whole-step C++ call for decode" in model.cfg.describe()


@pytest.mark.parametrize("arch", ["qwen2moe", "mixtral", "granitemoe", "ernie4_5-moe", "lfm2moe", "granitemoe_swa"])
def test_a_hugging_face_folder_of_an_expert_model_loads(tmp_path, arch):
    """transformers' own checkpoint (one tensor an expert: `experts.{e}.gate_proj`, Mixtral's
    `block_sparse_moe.experts.{e}.w1`): float64 logits are transformers', int8 runs the kernels."""
    # LFM2's MoE of 2 layers: transformers runs no model of convolutions alone
    model = make_moe(arch, 0, 2 if arch == "lfm2moe" else 1, dtype=torch.float64)
    model.save_pretrained(tmp_path)
    expect = hf_logits(model, PROMPT)
    assert torch.allclose(ours_logits(load_model(tmp_path, torch.float64, weights="float64"), PROMPT), expect,
                          atol=1e-5, rtol=0)
    if kernels.available():
        q = load_model(tmp_path, torch.float32, weights="int8")
        assert q.fused
        got = ours_logits(q, PROMPT).double()
        assert ((got - expect).norm(dim=-1) / expect.norm(dim=-1)).median() < 0.05


def test_inspect_shows_the_experts(converted, capsys):
    from specextend.cli.main import main

    folder, _ = converted("qwen2moe", "F32")
    assert main(["models", "inspect", str(folder.parent / "m.gguf"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["experts"]
    assert got["count"] == 8 and got["used"] == 2
    assert main(["models", "inspect", str(folder.parent / "m.gguf")]) == 0
    assert "8 experts" in capsys.readouterr().out


def test_inspect_says_the_experts_stay_on_the_files_pages(converted, capsys, monkeypatch):
    """With the arena on, inspect's `pages` line names the experts' own pages (a dense model's does not)."""
    import mmap

    from specextend.cli.main import main
    from specextend.runtime import hugepages

    if not hasattr(mmap, "MADV_HUGEPAGE") or not kernels.available():
        pytest.skip("no MADV_HUGEPAGE or no kernels here")
    monkeypatch.setenv(hugepages.ENV, "1")
    monkeypatch.setattr(hugepages, "system_mode", lambda: "madvise")
    folder, _ = converted("qwen3moe", "Q8_0")
    assert main(["models", "inspect", str(folder.parent / "m.gguf")]) == 0
    pages = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("pages"))
    assert "read into 2 MB pages" in pages and "; the experts are used in place, from the file's pages" in pages


def test_the_experts_stay_on_the_files_pages_while_streamed_weights_go_to_the_arena(converted, monkeypatch):
    """A token reads k of a layer's experts: they are used in place from the file's map (resident as
    they are used), whatever `SPECEXTEND_HUGE_PAGES` says; the weights every step reads whole go into
    the arena where it is on."""
    import mmap

    from specextend.models.qstore import QuantizedFile
    from specextend.runtime import hugepages

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE here")
    monkeypatch.setenv(hugepages.ENV, "1")
    monkeypatch.setattr(hugepages, "system_mode", lambda: "madvise")
    opened: list[QuantizedFile] = []
    real_init = QuantizedFile.__init__

    def init(self, path):
        real_init(self, path)
        opened.append(self)

    monkeypatch.setattr(QuantizedFile, "__init__", init)
    model = load_model(converted("qwen3moe", "Q8_0")[0], torch.float32, weights="gguf")
    (qf,) = opened
    lo, hi = qf.whole.data_ptr(), qf.whole.data_ptr() + qf.whole.numel()

    def in_file(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() and t.data_ptr() + t.numel() <= hi

    blk = model.layers[0]
    assert all(in_file(s.blob) for s in blk.moe.q_stacked)
    assert not any(in_file(s.blob) for s in blk.qkv.qweight.segments)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2moe", "ernie4_5-moe"])
def test_the_runtime_bench_floor_counts_the_experts_a_token_reads(converted, arch):
    """bench.runtime's memory floor (`weight_bytes_per_forward`): every projection a row runs, and of each
    expert layer its router and k of its experts' bytes, not none of them (it counted only modules that hold
    a `qweight`, and a layer's experts hold segments)."""
    from specextend.bench import runtime

    model = load_model(converted(arch, "Q8_0")[0], torch.float32, weights="gguf")
    dense = [model.lm_head] + [m for blk in model.layers for m in (blk.qkv, blk.o, blk.gate_up, blk.down) if m]
    dense += [m for blk in model.layers if blk.moe is not None and blk.moe.shared
              for m in (blk.moe.shared_gate_up, blk.moe.shared_down)]
    experts = sum(blk.moe.q_router.nbytes + sum(s.nbytes for s in blk.moe.q_stacked) * blk.moe.used // blk.moe.count
                  for blk in model.layers if blk.moe is not None)
    norms = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if type(m).__name__ == "RMSNorm")
    assert experts > 0
    assert runtime.weight_bytes_per_forward(model) == sum(m.qweight.nbytes for m in dense) + experts + norms
