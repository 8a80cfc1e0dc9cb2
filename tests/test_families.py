"""The families beyond Llama/Qwen (runtime/families.py), each from a GGUF written the way llama.cpp's
converter writes it: a tiny random model of transformers' own class for the family, its tensors
named by gguf's own name map, Q/K rows permuted and norm offsets added where the converter does,
the family's metadata under its keys; converted by our loader and compared with transformers on
the same weights (float64, float32, Q8_0 and a K-quant, Q6_K), greedy over 32 tokens, and `sd` /
`specextend` against `ar` with a tiny draft of the same family, on every kernel path."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specextend.common.errors import UserError
from specextend.common.settings import Settings
from specextend.models import gguf as conv
from specextend.models.loader import load_model
from specextend.runtime import fused_step, kernels
from specextend.runtime.families import FAMILIES
from specextend.speculation.decoder import SpecEngine
from test_gguf import CHAT_TEMPLATE, MERGES, SPECIALS, llama_cpp_permute, tiny_vocab
from test_quant import F16_FIELDS, random_blocks
from test_quantized_runtime import tree

from conftest import FAMILY_ARCHS, make_tiny_hf

# head_dim 64 (the attention kernel's fast path), widths divisible by 256 (K-quants); 4 layers, so
# SmolLM3's every-4th-layer NoPE (what llama.cpp assumes for the family) has a layer.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab=96)
LAYERS = 4
WINDOW = 16  # Gemma's sliding window here: the prompts are longer
PROMPT = torch.randint(0, 95, (40,), generator=torch.Generator().manual_seed(7)).tolist()
SMALL = dict(chunk_size=4, top_k_chunks=3, retrieve_every=2, tree_budget=6, tree_depth=4, tree_topk=2,
             cmr_min_ratio=0.0)
# llama.cpp converts these as Llama (LlamaModel subclasses)
PERMUTED = {"granite", "smollm3", "mistral3", "granite_swa"}
TENSOR_MAP = {"granite_swa": "granite"}  # gguf's name map of the family (this gguf package knows no Granite SWA)
NORM_SHIFT = {"gemma3": 1.0, "gemma2": 1.0}  # what llama.cpp adds to `*norm.weight` (Gemma's norms scale by 1 + w)
GGUF_ARCH = {"olmo3": "olmo2"}  # llama.cpp files OLMo 3 under olmo2


def ref_tol(arch: str) -> float:
    """How close float64 logits come to transformers': Gemma's norms compute in float32 there even
    in a float64 model (about 3e-5 from its own float32 run here); a wrong window, rope or norm moves
    them by 1e-3 and more."""
    return 5e-5 if arch.startswith("gemma") else 1e-5


def family_kw(arch: str, layers: int | None = None) -> dict:
    """The tiny model's shape, in the layout llama.cpp assumes for the family."""
    n = layers or (6 if arch == "gemma3" else LAYERS)
    kw = dict(SHAPE, layers=n)
    if arch == "smollm3":  # rope dropped on every 4th layer
        kw["no_rope_layers"] = [int((i + 1) % 4 != 0) for i in range(n)]
    if arch == "phi3":  # Phi-4-mini's partial rotary (48 of 64 dimensions)
        kw["head_dim"] = 64
    if arch == "glm4":  # GLM-4's partial rotary (32 of 64 dimensions)
        kw["head_dim"] = 64
    if arch == "gemma2":  # alternating windowed layers; the query scale from head_dim (64)
        kw.update(head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW)
    if arch == "olmo3":  # 3 windowed layers to 1 global
        kw.update(sliding_window=WINDOW)
    if arch == "granite_swa":  # 3 windowed layers to 1 global, which takes no rope
        kw.update(sliding_window=WINDOW)
    if arch == "cohere2":  # 3 windowed layers to 1 global (transformers' default, llama.cpp's fixed pattern)
        kw.update(sliding_window=WINDOW)
    if arch == "gemma3":  # 5 windowed layers to 1 global; the query scale from head_dim (64)
        kw.update(head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW,
                  layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)])
    return kw


def _metadata(w: gguf.GGUFWriter, arch: str, cfg) -> None:
    """The family's own keys, as the converter writes them."""
    if arch == "phi3":
        rope = cfg.rope_parameters
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(cfg.original_max_position_embeddings)))
        w.add_sliding_window(0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        glob = cfg.rope_parameters["full_attention"]
        if glob.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(glob["factor"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
        w.add_sliding_window(cfg.sliding_window)
    if arch == "olmo3":  # its converter's keys: the window, the windowed layers, YaRN (HF's attention factor)
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        glob, local = cfg.rope_parameters["full_attention"], cfg.rope_parameters["sliding_attention"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(glob["factor"])
        w.add_rope_scaling_attn_factors(glob["attention_factor"])
        w.add_rope_scaling_orig_ctx_len(glob["original_max_position_embeddings"])
        w.add_rope_freq_base_swa(local["rope_theta"])
    if arch == "mistral3":  # LlamaModel's YaRN keys, then Ministral 3's own: mscale_all_dim, the temperature
        rope = cfg.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch == "glm4":  # the rotated dimensions a head
        w.add_rope_dimension_count(int(cfg.rope_parameters["partial_rotary_factor"] * cfg.head_dim))
    if arch == "lfm2":  # its converter's keys: 0 KV heads on a convolution's layer, the kernel's length
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    if arch in ("command-r", "cohere2"):  # the logit scale; Command R7B's window (llama.cpp fixes its pattern)
        w.add_logit_scale(cfg.logit_scale)
        if arch == "cohere2":
            w.add_sliding_window(cfg.sliding_window)
    if arch == "granite_swa":  # the windowed layers and the layers with rope as lists
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_array("granite_swa.attention.rope_pattern", [bool(t) for t in cfg.layer_rope_theta])
    if arch in ("granite", "granite_swa"):
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)


def write_like_llama_cpp(model, path: Path, arch: str, kind: str = "F32", seed: int = 0,
                         tokenizer: bool = False, window: int = 0) -> dict[str, torch.Tensor]:
    """Write `model` (transformers) as llama.cpp's converter would, its matrices in `kind`; returns
    the HF state dict of what the file holds (quantized matrices as they dequantize), to load the
    reference with."""
    cfg = model.config
    n = cfg.num_hidden_layers
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    garch = GGUF_ARCH.get(arch, arch)
    w = gguf.GGUFWriter(str(path), garch)
    cohere = arch in ("command-r", "cohere2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(n)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([0 if t == "conv" else cfg.num_key_value_heads for t in cfg.layer_types] if arch == "lfm2"
                        else cfg.num_key_value_heads)
    if cohere:  # LayerNorms: their eps under the LayerNorm key
        w.add_layer_norm_eps(cfg.layer_norm_eps)
    else:
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)  # Gemma 3: the global layers'
    w.add_rope_freq_base(rope["rope_theta"])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    _metadata(w, arch, cfg)
    if window:
        w.add_sliding_window(window)
    w.add_pad_token_id(0)  # the families' own defaults lie outside a tiny vocabulary
    if not tokenizer:
        w.add_bos_token_id(0)
        w.add_eos_token_id(cfg.vocab_size - 1)
    else:  # test_gguf's byte-level BPE vocabulary with its chat template
        tokens = tiny_vocab()
        assert len(tokens) <= cfg.vocab_size
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|endoftext|>"))
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges(MERGES)
        w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, TENSOR_MAP.get(arch, garch).upper().replace("-", "_")), n)
    stored: dict[str, torch.Tensor] = {}
    rng = np.random.default_rng(seed)
    for name, value in sd.items():
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if name.endswith("self_attn.sinks"):  # (a name map without attention sinks)
            gname = gname or f"blk.{name.split('.')[2]}.attn_sinks.weight"
        assert gname is not None, name
        heads = None
        if arch in PERMUTED and name.endswith("q_proj.weight"):
            heads = cfg.num_attention_heads
        elif arch in PERMUTED and name.endswith("k_proj.weight"):
            heads = cfg.num_key_value_heads
        data = value if heads is None else llama_cpp_permute(value, heads)
        if name.endswith("conv.conv.weight"):  # the converter squeezes the depthwise kernel to [channels, length]
            data = value.squeeze(1)
        if name.endswith("norm.weight") and arch in NORM_SHIFT:
            data = (data + np.float32(NORM_SHIFT[arch])).astype(np.float32)
            value = data - np.float32(NORM_SHIFT[arch])
        if kind == "F32" or value.ndim != 2:
            w.add_tensor(gname, data)
            stored[name] = torch.from_numpy(value.copy())
            continue
        qt = gguf.GGMLQuantizationType[kind]
        if kind == "Q8_0":
            packed = gguf.quants.quantize(data, qt)
        else:  # gguf has no K-quant quantizer: random valid blocks, scaled to the model's weights, are the weights
            packed = scaled_blocks(kind, data, int(rng.integers(1 << 30)))
        back = gguf.quants.dequantize(packed, qt).astype(np.float32).reshape(data.shape)
        if heads is not None:  # the reference holds the HF row order
            back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
        w.add_tensor(gname, packed, raw_dtype=qt)
        stored[name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def scaled_blocks(kind: str, like: np.ndarray, seed: int) -> np.ndarray:
    """Random valid `kind` blocks for a matrix shaped `like`, their float16 scales multiplied so the
    weights have `like`'s spread (random scales alone make weights in the tens: the logits would
    then say nothing about the layers)."""
    qt = gguf.GGMLQuantizationType[kind]
    raw = random_blocks(kind, *like.shape, seed=seed)
    factor = float(like.std()) / float(gguf.quants.dequantize(raw, qt).std())
    size = gguf.GGML_QUANT_SIZES[qt][1]
    blocks = raw.reshape(like.shape[0], -1, size)
    for lo in F16_FIELDS[kind]:
        scales = blocks[..., lo : lo + 2].copy().view(np.float16).astype(np.float32) * factor
        blocks[..., lo : lo + 2] = scales.astype(np.float16).view(np.uint8).reshape((*blocks.shape[:-1], 2))
    return blocks.reshape(raw.shape)


def reference(arch: str, stored: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64, seed: int = 0):
    """transformers' model of the family holding exactly the file's weights."""
    model = make_tiny_hf(arch, seed, dtype=dtype, **family_kw(arch))
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in stored.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """(arch, kind, seed) -> (our converted folder, the file's weights in HF names)."""
    return converter(tmp_path_factory)


def converter(tmp_path_factory):
    """`converted`'s function (another module's fixture can return one)."""
    cache: dict = {}

    def get(arch: str, kind: str = "F32", seed: int = 0, layers: int | None = None, context: int | None = None):
        key = (arch, kind, seed, layers, context)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"{arch}{kind}{seed}")
            kw = family_kw(arch, layers) | ({"max_position_embeddings": context} if context else {})
            model = sharp(make_tiny_hf(arch, seed, dtype=torch.float32, **kw))
            stored = write_like_llama_cpp(model, d / "m.gguf", arch, kind, seed)
            out = conv.convert_gguf(d / "m.gguf", d / "hf", progress=False, tokenizer=False)
            cache[key] = (out, stored)
        return cache[key]

    return get


def sharp(model):
    """The model with its queries and keys scaled up: a tiny random model's attention is otherwise
    nearly uniform, and a wrong rotation or window would hardly move the quantized logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(3.0)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(hf_logits(model, out)[-1].argmax()))
    return out[len(ids):]


def ours_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor(ids), torch.arange(len(ids)), model.new_cache(len(ids)))


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_the_gguf_names_the_family_and_its_config_rebuilds(converted, arch):
    folder, _ = converted(arch)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == FAMILIES[arch].model_type
    ref = make_tiny_hf(arch, 0, dtype=torch.float32, **family_kw(arch)).config
    if arch == "granite":
        for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            assert config[k] == getattr(ref, k)
    if arch == "smollm3":
        assert config["no_rope_layers"] == ref.no_rope_layers
    if arch == "phi3":
        rope = config["rope_parameters"]
        assert rope["rope_type"] == "longrope" and rope["partial_rotary_factor"] == 0.75
        assert rope["short_factor"] == pytest.approx(ref.rope_parameters["short_factor"])
        assert config["original_max_position_embeddings"] == ref.original_max_position_embeddings
    if arch == "gemma2":
        for k in ("layer_types", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
                  "final_logit_softcapping"):
            assert config[k] == getattr(ref, k), k
    if arch == "gemma3":
        for k in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
            assert config[k] == getattr(ref, k), k
    if arch == "lfm2":
        for k in ("layer_types", "conv_L_cache", "norm_eps", "intermediate_size", "tie_word_embeddings"):
            assert config[k] == getattr(ref, k), k
        from safetensors import safe_open

        with safe_open(str(folder / "model.safetensors"), "pt") as f:  # HF's Conv1d kernel, as transformers holds it
            assert f.get_slice("model.layers.0.conv.conv.weight").get_shape() == [256, 1, 3]


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_float_logits_and_32_greedy_tokens_equal_transformers(converted, arch):
    folder, stored = converted(arch)
    ref = reference(arch, stored)
    ours = load_model(folder, torch.float64, weights="float64")
    expect = hf_logits(ref, PROMPT)
    assert torch.allclose(ours_logits(ours, PROMPT), expect, atol=ref_tol(arch), rtol=0)
    eng = SpecEngine(ours, ours, eos_ids=[])
    got = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=32)).token_ids
    assert got == hf_greedy(ref, PROMPT, 32)
    f32 = load_model(folder, torch.float32, weights="float32")
    assert torch.allclose(ours_logits(f32, PROMPT).double(), expect, atol=1e-3, rtol=0)


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K"])
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_quantized_logits_track_transformers_on_the_files_weights(converted, arch, kind):
    folder, stored = converted(arch, kind)
    ref = reference(arch, stored)
    ours = load_model(folder, torch.float32, weights="gguf")
    # the quantized kernels; the whole-step call too where the switches are per-layer ropes only
    assert ours.fused and ours.cfg.plain == (arch in ("smollm3", "ernie4_5", "seed_oss"))
    expect = hf_logits(ref, PROMPT)
    got = ours_logits(ours, PROMPT).double()
    # int8 activations over sharpened attention: within ~6% here (relative RMS); a dropped switch
    # (rope on a NoPE layer, a missing multiplier or norm) moves them by 30% and more.
    assert (got.argmax(-1) == expect.argmax(-1)).float().mean() >= 0.85
    assert (got - expect).norm() < 0.1 * expect.norm()


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("method", ["sd", "specextend"])
@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_speculative_output_equals_ar_with_a_draft_of_the_family(converted, arch, kind, method):
    target_dir, _ = converted(arch, kind)
    draft_dir, _ = converted(arch, kind, seed=5, layers=1)
    weights = "float32" if kind == "F32" else "gguf"
    target = load_model(target_dir, torch.float32, weights=weights)
    draft = load_model(draft_dir, torch.float32, weights=weights)
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40))
    extra = dict(draft_gate=False) if method == "specextend" else {}
    r = eng.generate(PROMPT, Settings(method=method, max_new_tokens=40, **SMALL, **extra))
    assert r.token_ids == ar.token_ids


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_every_kernel_path_gives_the_same_bits(converted, monkeypatch, arch):
    """SPECEXTEND_CPU forces each path this CPU runs: the same logits, and sd equal to ar on each."""
    folder, _ = converted(arch, "Q6_K")
    draft_dir, _ = converted(arch, "Q6_K", seed=5, layers=1)
    assert_every_path_gives_the_same_bits(folder, draft_dir, monkeypatch)


def assert_every_path_gives_the_same_bits(folder: Path, draft_dir: Path, monkeypatch, prompt: list[int] = PROMPT
                                          ) -> None:
    """Each path this CPU runs (SPECEXTEND_CPU) gives the portable path's logits and greedy tokens,
    and sd equals ar on each."""
    model = load_model(folder, torch.float32, weights="gguf")
    draft = load_model(draft_dir, torch.float32, weights="gguf")
    logits, tokens = {}, {}
    for path in kernels.cpu_paths():
        monkeypatch.setenv(kernels.CPU_ENV, path)
        logits[path] = ours_logits(model, prompt)
        eng = SpecEngine(model, draft, eos_ids=[])
        ar = eng.generate(prompt, Settings(method="ar", max_new_tokens=16)).token_ids
        assert eng.generate(prompt, Settings(method="sd", max_new_tokens=16, **SMALL)).token_ids == ar
        tokens[path] = ar
    assert all(torch.equal(v, logits["portable"]) for v in logits.values())
    assert all(v == tokens["portable"] for v in tokens.values())


def test_an_unknown_architecture_is_refused_naming_the_families(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "bloom")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="unsupported GGUF architecture 'bloom'") as e:
        conv.gguf_architecture(conv.open_gguf(tmp_path / "x.gguf"))
    for arch in FAMILY_ARCHS:
        assert arch in str(e.value)
    assert "\n" not in str(e.value)


def test_a_prompt_longer_than_the_window_is_masked_as_transformers_masks(converted):
    """Gemma 3's windowed layers over 6 windows of prompt, fed in chunks (the cache holds keys that
    fell out of the window): transformers' logits at every position."""
    folder, stored = converted("gemma3")
    ref = reference("gemma3", stored)
    ours = load_model(folder, torch.float64, weights="float64")
    ids = torch.randint(0, 95, (6 * WINDOW,), generator=torch.Generator().manual_seed(11)).tolist()
    expect = hf_logits(ref, ids)
    cache = ours.new_cache(len(ids))
    got = []
    for s in range(0, len(ids), 7):
        piece = ids[s : s + 7]
        got.append(ours(torch.tensor(piece), torch.arange(s, s + len(piece)), cache))
        cache.commit()
    assert torch.allclose(torch.cat(got), expect, atol=ref_tol("gemma3"), rtol=0)
    unwindowed = reference("gemma3", stored)
    unwindowed.config.sliding_window = 10 * WINDOW
    for layer in unwindowed.model.layers:
        layer.self_attn.sliding_window = 10 * WINDOW
    assert not torch.allclose(hf_logits(unwindowed, ids), expect, atol=1e-3, rtol=0)  # the window matters


# Gemma files carry a SentencePiece vocabulary, which transformers rebuilds with Gemma's own class
# (its GGUF loader reads both Gemma families); test_gguf's tiny vocabulary is byte-level BPE.
@pytest.mark.parametrize("arch", [a for a in FAMILY_ARCHS if not a.startswith("gemma")])
def test_the_tokenizer_chat_template_and_turn_ends_come_from_the_file(tmp_path, arch):
    """Including the families transformers' GGUF loader refuses (its tokenizer is read as a Llama
    file's): the tokenizer, the file's chat template, and the family's turn-end tokens as EOS."""
    from specextend.models.loader import load_tokenizer

    model = make_tiny_hf(arch, 0, dtype=torch.float32, **dict(family_kw(arch, 1), vocab=300))
    write_like_llama_cpp(model, tmp_path / "m.gguf", arch, tokenizer=True)
    folder = conv.convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    tok = load_tokenizer(folder)
    assert tok.decode(tok.encode("hello world", add_special_tokens=False)) == "hello world"
    assert "<|im_start|>assistant" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                               add_generation_prompt=True)
    eos = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    for token in FAMILIES[arch].eos_tokens:
        if token in tiny_vocab():
            assert tiny_vocab().index(token) in eos, token


@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_the_converted_folder_is_the_model_for_transformers_too(converted, arch):
    """Our converter's config.json and tensors (norm offsets taken off, Q/K rows back in HF order)
    make transformers build the model the file holds: its logits are the reference's."""
    from specextend.bench.hf_baselines import hf_model

    folder, stored = converted(arch)
    model = hf_model(folder, torch.float64)  # refuses missing or unexpected tensors
    model.set_attn_implementation("eager")  # as the reference
    diff = (hf_logits(model, PROMPT) - hf_logits(reference(arch, stored), PROMPT)).abs().max()
    assert diff < 1e-9, float(diff)


def inspected(folder: Path, capsys) -> tuple[str, str, dict]:
    """`models inspect` of the folder's source file: its family line, its kv line and its --json."""
    from specextend.cli.main import main

    assert main(["models", "inspect", str(folder.parent / "m.gguf")]) == 0
    lines = capsys.readouterr().out.splitlines()
    family, kv = (next(x for x in lines if x.startswith(key)) for key in ("family", "kv"))
    assert main(["models", "inspect", str(folder.parent / "m.gguf"), "--json"]) == 0
    return family, kv, json.loads(capsys.readouterr().out)


@pytest.mark.usefixtures("isolated_home")
def test_inspect_names_the_family_and_what_runs(converted, capsys):
    line, kv, out = inspected(converted("gemma3")[0], capsys)
    assert "gemma3" in line and "5 of 6 layers windowed (16)" in line and "whole-step C++ call" in line
    assert "the 5 windowed layers keep their window of 16 and 512 more" in kv
    assert out["family"].startswith("gemma3:")
    row = 2 * 2 * 64 * 2  # a layer's K and V x KV heads x head_dim x bfloat16
    assert out["kv_bytes_per_token"] == row  # the global layer's: the windowed ones keep a window
    assert out["kv_bytes_32k"] == row * 32768 + 5 * row * (16 + 512)


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_a_token_gets_the_same_bits_alone_inside_a_tree_and_in_a_batch(converted, arch):
    """What makes speculative output equal `ar` on the quantized runtime, switch by switch (windows,
    soft-capped attention, partial rotary, NoPE): a tree node's logits are the bits the token gets
    decoded alone after its ancestors, and a sequence's rows batched with another's are its own."""
    from specextend.runtime.layers import Rows

    folder, _ = converted(arch, "Q8_0")
    model = load_model(folder, torch.float32, weights="gguf")
    mask, depth = tree(9)
    n = len(depth)
    tokens = torch.randint(0, 95, (n,), generator=torch.Generator().manual_seed(1))
    prompt = torch.tensor(PROMPT)
    p = len(PROMPT)
    cache = model.new_cache(p + 2 * n)
    model.prefill(prompt, cache, chunk=16)
    tree_logits = model(tokens, p + torch.tensor(depth), cache, mask)
    cache.discard()
    for i in range(n):
        path = [j for j in range(n) if mask[i, j]]
        alone = model.new_cache(p + n)
        model.prefill(prompt, alone, chunk=16)
        if len(path) > 1:
            model(tokens[path[:-1]], p + torch.arange(len(path) - 1), alone)
            alone.commit()
        assert torch.equal(model(tokens[i : i + 1], torch.tensor([p + depth[i]]), alone)[0], tree_logits[i]), i
    other = model.new_cache(p + n)
    model.prefill(prompt[: p // 2], other)
    parts = [Rows(tokens, p + torch.tensor(depth), cache, mask), Rows(tokens[:3], torch.arange(3) + p // 2, other)]
    batched = model.forward_many(parts)
    assert torch.equal(batched[0], tree_logits)
    other.discard()
    assert torch.equal(batched[1], model(tokens[:3], torch.arange(3) + p // 2, other))


def test_an_olmo_3_file_of_the_older_converter_takes_every_4th_layer_as_global():
    """llama.cpp's first OLMo 3 files say only the window (no per-layer pattern, no rope base of the windowed
    layers): llama.cpp then windows all but every 4th layer, on the global rope base unscaled; so do we."""
    key = lambda name, default=None: {"attention.sliding_window": WINDOW}.get(name, default)  # noqa: E731
    glob = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 8.0}
    cfg = FAMILIES["olmo3"].gguf_config(key, {"num_hidden_layers": 8, "rope_parameters": glob})
    assert cfg["layer_types"] == [("full" if i % 4 == 3 else "sliding") + "_attention" for i in range(8)]
    assert cfg["sliding_window"] == WINDOW
    assert cfg["rope_parameters"] == {"full_attention": glob,
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}


def test_a_64_layer_exaone4_file_windows_and_drops_rope_on_its_global_layers_as_transformers_does(tmp_path):
    """llama.cpp windows an EXAONE 4.0 file only at the 32B's 64 layers (all but every 4th, 4,096 tokens unless the
    file says): a 64-layer tiny model with a window shorter than the prompt, its global layers without rope."""
    kw = dict(SHAPE, hidden_size=64, intermediate_size=128, layers=64, sliding_window=WINDOW)
    model = sharp(make_tiny_hf("exaone4", 0, dtype=torch.float32, **kw))
    stored = write_like_llama_cpp(model, tmp_path / "m.gguf", "exaone4", window=WINDOW)
    folder = conv.convert_gguf(tmp_path / "m.gguf", tmp_path / "hf", progress=False, tokenizer=False)
    ours = load_model(folder, torch.float64, weights="float64")
    assert ours.cfg.window_layers == ours.cfg.rope_layers == tuple((i + 1) % 4 != 0 for i in range(64))
    ref = make_tiny_hf("exaone4", 0, dtype=torch.float64, **kw)
    assert not set(ref.load_state_dict({k: v.double() for k, v in stored.items()}, strict=False).unexpected_keys)
    assert torch.allclose(ours_logits(ours, PROMPT), hf_logits(ref, PROMPT), atol=1e-5, rtol=0)


def test_published_olmo3_and_ministral3_configs_read_as_their_rope_says():
    """Hugging Face config.json files as the checkpoints publish them (top-level rope keys, and transformers 5's rope
    a layer type): OLMo 3's windowed layers on the global base unscaled, its global ones on YaRN; Ministral 3's
    temperature from its original window, none where the config sets no beta."""
    from specextend.runtime.config import ModelConfig

    sizes = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    yarn = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "attention_factor": 1.2}
    old = ModelConfig.from_hf({**sizes, "architectures": ["Olmo3ForCausalLM"], "rope_theta": 500000.0,
                               "rope_scaling": yarn, "sliding_window": 4096, "max_position_embeddings": 65536})
    new = ModelConfig.from_hf({**sizes, "architectures": ["Olmo3ForCausalLM"], "sliding_window": 4096,
                               "max_position_embeddings": 65536, "rope_parameters": {
                                   "full_attention": {**yarn, "rope_theta": 500000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}})
    for c in (old, new):
        assert c.window_layers == (True, True, True, False) and c.local_rope_theta == c.rope_theta == 500000.0
        assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["attention_factor"] == 1.2
    rope = {"type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 16384,
            "mscale": 1.0, "mscale_all_dim": 1.0}
    mini = ModelConfig.from_hf({**sizes, "architectures": ["Ministral3ForCausalLM"], "max_position_embeddings": 262144,
                                "rope_parameters": {**rope, "llama_4_scaling_beta": 0.1}})
    assert (mini.attn_temperature, mini.temperature_length) == (0.1, 16384)
    assert mini.rope_scaling["rope_type"] == "yarn" and mini.rope_scaling["attention_factor"] == 1.0
    plain = ModelConfig.from_hf({**sizes, "architectures": ["Ministral3ForCausalLM"], "rope_parameters": rope})
    assert plain.attn_temperature == 0.0 and plain.rope_scaling["factor"] == 16.0
    from specextend.runtime.layers import query_temperature

    assert query_temperature(0.1, 16, torch.arange(16)) is None and query_temperature(0.1, 16, torch.arange(0)) is None
    assert torch.equal(query_temperature(0.1, 16, torch.tensor([15, 16, 48])),
                       1 + 0.1 * torch.log(torch.tensor([1.0, 2.0, 4.0])))


@pytest.mark.parametrize("pattern", [[True, False], [True, False, True, True, False]])
def test_an_olmo_3_pattern_of_the_wrong_length_is_refused_in_one_line(pattern):
    key = lambda name, default=None: {"attention.sliding_window_pattern": pattern,  # noqa: E731
                                      "attention.sliding_window": 8}.get(name, default)
    with pytest.raises(UserError, match="sliding_window_pattern has") as e:
        FAMILIES["olmo3"].gguf_config(key, {"num_hidden_layers": 4, "rope_parameters": {"rope_theta": 1.0}})
    assert "\n" not in str(e.value)


def test_granite_swa_layers_with_rope_bases_of_their_own_match_transformers(tmp_path):
    """A Granite SWA checkpoint whose windowed and global layers rotate with bases of their own (`layer_rope_theta`;
    llama.cpp's files hold one base and say which layers rotate): our model of its folder gives transformers' float64
    logits, the windowed layers on their own base; several bases among one kind of layer are refused in one line."""
    from specextend.runtime.config import ModelConfig

    kw = dict(family_kw("granite_swa"), layer_rope_theta=[50_000.0, 10_000.0, 10_000.0, 10_000.0])
    model = sharp(make_tiny_hf("granite_swa", 0, **kw))
    model.save_pretrained(tmp_path)
    ours = load_model(tmp_path, torch.float64)
    assert (ours.cfg.rope_theta, ours.cfg.local_rope_theta, ours.cfg.rope_layers) == (50_000.0, 10_000.0, ())
    assert torch.allclose(ours_logits(ours, PROMPT), hf_logits(model, PROMPT), atol=ref_tol("granite_swa"), rtol=0)
    d = model.config.to_dict()
    d["layer_rope_theta"] = [50_000.0, 10_000.0, 20_000.0, 10_000.0]
    with pytest.raises(UserError, match="several rope bases") as e:
        ModelConfig.from_hf(d)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cap", [-50.0, float("inf"), "50"])
def test_a_soft_cap_that_is_no_positive_number_is_refused_in_one_line(cap):
    """The kernels cap scores at a finite positive number (0 or absent: none); a file or config
    with anything else is refused by name, not run into a kernel's check."""
    from specextend.runtime.config import ModelConfig

    d = make_tiny_hf("gemma2", 0, dtype=torch.float32, **family_kw("gemma2", 1)).config.to_dict()
    d["attn_logit_softcapping"] = cap
    with pytest.raises(UserError, match="attn_logit_softcapping must be a positive number") as e:
        ModelConfig.from_hf(d)
    assert "\n" not in str(e.value)


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("path", kernels.cpu_paths())
@pytest.mark.parametrize("arch", FAMILY_ARCHS)
def test_the_whole_step_call_gives_the_per_layer_bits(converted, monkeypatch, arch, path):
    """Every family's switches in the whole-step C++ call (sandwich and post norms, GeGLU, the
    multipliers and logit divisor, whole-row q/k norms, per-layer ropes and NoPE, partial rotary,
    windowed layers seen from tree rows at start + depth, Gemma 2's soft-capped scores): the
    per-layer kernels' bits (logits, K/V, kept queries) over prefill chunks, one-row steps, a tree
    level and a verification longer than the window."""
    from test_step import run

    monkeypatch.setenv(kernels.CPU_ENV, path)
    folder, _ = converted(arch, "Q8_0")
    model = load_model(folder, torch.float32, weights="gguf")
    assert model.cfg.stepped
    assert model.cfg.rope_layers == ((True, True, True, False) if arch in ("smollm3", "cohere2") else
                                     (False, True, True, True) if arch == "granite_swa" else ())
    calls = []
    step = fused_step.run
    monkeypatch.setattr(fused_step, "run", lambda *a: calls.append(1) or step(*a))
    python, whole = run(model, 0), run(model, 16)
    assert bool(calls) == model.cfg.stepped  # the whole-step call ran (where the family takes it)
    assert len(python) == len(whole)
    for i, (a, b) in enumerate(zip(python, whole, strict=True)):
        assert torch.equal(a, b), i


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
def test_the_family_row_operations_track_torch():
    """csrc/core/family.h's row operations, which both the per-layer kernels and the whole-step call
    run (GeGLU with its own tanh, whole-row RMSNorm, the post-norm residual add), against PyTorch's
    float64 formulas: within float32 rounding, saturating where tanh does."""
    ext = kernels.load()
    g = torch.cat([torch.linspace(-12, 12, 2001), torch.tensor([-60.0, -30.0, 0.0, 1e-8, 30.0, 60.0, 0.0])])
    u = torch.randn(g.shape[0], generator=torch.Generator().manual_seed(2))
    gu = torch.stack([torch.cat([g, u]), torch.cat([-g, u])])
    got = ext.gelu_mul(gu).double()
    g64, u64 = gu[:, : g.shape[0]].double(), gu[:, g.shape[0] :].double()
    expect = torch.nn.functional.gelu(g64, approximate="tanh") * u64
    assert (got - expect).abs().max() < 1e-5 * (1 + expect.abs().max())
    x, y = torch.randn(3, 96, dtype=torch.float64), torch.randn(3, 96, dtype=torch.float64)
    w = torch.rand(96, dtype=torch.float64) + 0.5

    def rms(t: torch.Tensor) -> torch.Tensor:
        return w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)

    assert torch.allclose(ext.rms_rows(x.float(), w.float(), 1e-6).double(), rms(x), atol=1e-5)
    post = ext.post_residual(x.float(), y.float(), w.float(), 1e-6, 0.25).double()
    assert torch.allclose(post, x + 0.25 * rms(y), atol=1e-5)
    assert torch.equal(ext.post_residual(x.float(), y.float(), None, 1e-6, 1.0), x.float() + y.float())


@pytest.fixture(scope="module")
def long_phi(tmp_path_factory):
    """A Phi-3 file whose LongRoPE window (32) the tests' prompts pass, of a 256-token context:
    (converted folder, the file's weights, transformers' model of them)."""
    d = tmp_path_factory.mktemp("longphi")
    kw = family_kw("phi3") | dict(max_position_embeddings=256, original_max_position_embeddings=32)
    model = sharp(make_tiny_hf("phi3", 0, dtype=torch.float32, **kw))
    stored = write_like_llama_cpp(model, d / "m.gguf", "phi3", "Q8_0")
    folder = conv.convert_gguf(d / "m.gguf", d / "hf", progress=False, tokenizer=False)
    ref = make_tiny_hf("phi3", 0, dtype=torch.float64, **kw)
    ref.load_state_dict({k: v.double() for k, v in stored.items()}, strict=False)
    return folder, ref


def test_a_longrope_context_beyond_its_window_takes_the_long_factors_as_transformers_does(long_phi):
    """By default the context is LongRoPE's window (its short factors); `--max-context` up to the file's
    own takes the long ones, which transformers also runs on a sequence longer than the window."""
    folder, ref = long_phi
    short = load_model(folder, torch.float64, weights="float64")
    assert (short.cfg.max_position, short.cfg.longest, short.cfg.long_rope) == (32, 256, False)
    with pytest.raises(UserError, match=r"context of 32 tokens .*allows up to 256 with --max-context"):
        SpecEngine(short, None, eos_ids=[]).check_fits(len(PROMPT), Settings(method="ar").resolved())
    with pytest.raises(UserError, match="beyond the model's 256 positions"):
        load_model(folder, torch.float64, weights="float64", context=257)
    ours = load_model(folder, torch.float64, weights="float64", context=256)
    assert ours.cfg.long_rope and ours.cfg.max_position == 256
    expect = hf_logits(ref, PROMPT)  # 40 tokens: past the window, so transformers' long factors
    assert torch.allclose(ours_logits(ours, PROMPT), expect, atol=1e-5, rtol=0)
    assert not torch.allclose(ours_logits(short, PROMPT[:32]), expect[:32], atol=1e-3, rtol=0)
    got = SpecEngine(ours, ours, eos_ids=[]).generate(PROMPT, Settings(method="ar", max_new_tokens=32)).token_ids
    assert got == hf_greedy(ref, PROMPT, 32)


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
@pytest.mark.parametrize("method", ["sd", "specextend"])
def test_speculation_over_long_rope_equals_ar(long_phi, method):
    folder, _ = long_phi
    target = load_model(folder, torch.float32, weights="gguf", context=256)
    draft = load_model(folder, torch.float32, weights="gguf", context=256, draft=True)
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=40))
    extra = dict(draft_gate=False) if method == "specextend" else {}
    assert eng.generate(PROMPT, Settings(method=method, max_new_tokens=40, **SMALL, **extra)).token_ids == ar.token_ids


@pytest.mark.usefixtures("isolated_home")
def test_inspect_tells_the_default_context_and_how_far_context_goes(long_phi, capsys):
    from specextend.cli.main import main
    from specextend.models.resolve import LoadOptions

    folder, _ = long_phi
    assert main(["models", "inspect", str(folder.parent / "m.gguf")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("context"))
    assert line.split(None, 1)[1] == "32 tokens; the file allows up to 256 with --max-context (LongRoPE's long factors)"
    assert main(["models", "inspect", str(folder.parent / "m.gguf"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["context"], out["context_limit"]) == (32, 256)
    for bad in (0, -5, 2.5, True):
        with pytest.raises(UserError, match="--max-context must be a whole number"):
            LoadOptions(max_context=bad)


def test_lfm2_convolution_state_keeps_its_window_through_chunks_snapshots_and_files(converted, tmp_path):
    """LFM2's short convolutions keep only their last tokens' inputs in a cache made with room (as a windowed
    layer's keys), fed in chunks: transformers' logits at every position; a snapshot of the prompt, written to a
    prefix-cache file and read back into a fresh cache, continues with the same bits as the cache it came from."""
    from specextend.requests import kv_file
    from specextend.runtime.kv_cache import PrefixKV

    folder, stored = converted("lfm2")
    ref = reference("lfm2", stored)
    ours = load_model(folder, torch.float64, weights="float64")
    ids = PROMPT + PROMPT[:8]
    expect = hf_logits(ref, ids)
    cache = ours.new_cache(len(ids) + 4, room=4)
    got = []
    for s in range(0, len(PROMPT), 5):
        piece = ids[s : min(s + 5, len(PROMPT))]
        got.append(ours(torch.tensor(piece), torch.arange(s, s + len(piece)), cache))
        cache.commit()
    assert cache.wk.shape[2] <= 3 + 5 and cache.woffset > 0  # the kernel's 3 tokens and a chunk, not the prompt
    path = tmp_path / "p.kv"
    kv_file.write(path, PROMPT, PrefixKV(cache.snapshot(), None), "f", "float64", None)
    fresh = ours.new_cache(len(ids) + 4, room=4)
    fresh.load(kv_file.read(path)[1].target_kv)
    rest, pos = torch.tensor(ids[len(PROMPT):]), torch.arange(len(PROMPT), len(ids))
    tail = ours(rest, pos, cache)
    assert torch.allclose(torch.cat([*got, tail]), expect, atol=ref_tol("lfm2"), rtol=0)
    assert torch.equal(ours(rest, pos, fresh), tail)
    unconvolved = reference("lfm2", {k: (v * 0 if k.endswith("conv.conv.weight") else v) for k, v in stored.items()})
    assert not torch.allclose(hf_logits(unconvolved, ids), expect, atol=1e-3, rtol=0)  # the convolution matters


@pytest.mark.usefixtures("isolated_home")
def test_inspect_names_lfm2s_convolutions_and_their_state(converted, capsys):
    line, kv, out = inspected(converted("lfm2")[0], capsys)
    assert "lfm2" in line and "2 of 4 layers short convolutions (3 tokens)" in line and "whole-step C++ call" in line
    assert "the 2 short convolutions keep the inputs of their last 3 tokens and 512 more" in kv
    row = 2 * 2 * 64 * 2  # a layer's K and V x KV heads x head_dim x bfloat16
    assert out["kv_bytes_per_token"] == 2 * row  # the two attention layers'
    assert out["kv_bytes_32k"] == 2 * row * 32768 + 2 * 256 * 4 * (3 + 512)  # and a float32 row a kept token
    # the convolutions' kernels run in float32 as they are, with the 9 norms and 4 q/k norms (not requantized)
    assert next(r for r in out["types"] if r["runs_as"] == "float32")["tensors"] == 9 + 4 + 2


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
def test_the_convolution_kernel_gives_the_pytorch_operations_bits():
    """csrc/core/family.h's conv_row (the quantized runtime's) and layers.py's PyTorch operations (float64 and other
    devices) are one arithmetic: the same bits on float32 rows, taps of a tree with missing ones included."""
    from specextend.runtime.layers import conv_taps

    gen = torch.Generator().manual_seed(3)
    hidden, kernel, slots = 40, 3, 12
    h = torch.randn(5, 3 * hidden, generator=gen)
    w = torch.randn(hidden, kernel, generator=gen)
    state = torch.randn(slots, hidden, generator=gen)
    mask, _ = tree(5)
    taps = conv_taps(5, 1, mask, kernel)  # one token before the tree: its first rows reach past the sequence's start
    assert (taps == -1).any()
    ours = state.clone()
    got = kernels.load().conv_rows(h, ours, taps, w)
    b, c, xs = h.chunk(3, dim=-1)
    state[taps[:, -1]] = b * xs
    seen = torch.where((taps >= 0)[..., None], state[taps.clamp(min=0)], 0)
    acc = w[:, 0] * seen[:, 0]
    for j in range(1, kernel):
        acc = acc + w[:, j] * seen[:, j]
    assert torch.equal(ours, state) and torch.equal(got, c * acc)


@pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")
def test_lfm2_over_a_q8_cache_calibrates_its_attention_keys_and_speculates_as_ar(converted):
    """A q8 KV cache holds LFM2's attention layers' K/V as q8 rows and its convolutions' state in float32: the key
    offsets are measured on the attention layers (none to measure on a convolution), the whole-step call and the
    per-layer kernels agree, and `sd` equals `ar`."""
    from test_kv_q8 import CALIBRATION

    folder, _ = converted("lfm2", "Q8_0")
    model = load_model(folder, torch.float32, weights="gguf")
    model.kv_cache = "q8"
    model.calibrate_key_offset(CALIBRATION)
    cache = model.new_cache(64)
    assert cache.q8 and cache.wk.dtype == torch.float32
    assert all((layer.k_offset.abs().sum() > 0) != model.cfg.conv(i) for i, layer in enumerate(model.layers))
    draft = load_model(converted("lfm2", "Q8_0", seed=5, layers=1)[0], torch.float32, weights="gguf")
    eng = SpecEngine(model, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=24)).token_ids
    assert eng.generate(PROMPT, Settings(method="sd", max_new_tokens=24, **SMALL)).token_ids == ar
    model.step_rows = 0
    assert eng.generate(PROMPT, Settings(method="ar", max_new_tokens=24)).token_ids == ar


@pytest.mark.parametrize(("block_ff", "hidden", "ff"), [(12288, 2048, 8192), (6656, 1024, 4608)])
def test_a_published_lfm2_config_reads_as_transformers_builds_it(block_ff, hidden, ff):
    """LFM2-1.2B's and 350M's published config.json keys (`block_ff_dim` adjusted by `block_auto_adjust_ff_dim`,
    `full_attn_idxs`, `tie_embedding`): the MLP width transformers' Lfm2MLP builds, 10 convolutions, tied."""
    import transformers as tf

    from specextend.runtime.config import ModelConfig

    d = dict(vocab_size=65536, hidden_size=hidden, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
             block_ff_dim=block_ff, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0, block_multiple_of=256,
             full_attn_idxs=[2, 5, 8, 10, 12, 14], norm_eps=1e-5, conv_L_cache=3, tie_embedding=True)
    ours = ModelConfig.from_hf({"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", **d})
    mlp = tf.models.lfm2.modeling_lfm2.Lfm2MLP(tf.Lfm2Config(**d))
    assert ours.intermediate_size == mlp.w1.out_features == ff
    assert ours.conv_layers.count(True) == 10 and not ours.conv(2) and ours.tie_word_embeddings
