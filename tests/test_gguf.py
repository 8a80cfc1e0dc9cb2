"""GGUF -> Hugging Face folder conversion, on tiny random models written with `gguf.GGUFWriter`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from specextend.common.errors import UserError
from specextend.models import gguf as conv
from specextend.models.qstore import QuantizedFile

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, CONTEXT = 64, 2, 4, 2, 96, 256
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# --------------------------------------------------------------------------- builders


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def tiny_vocab() -> list[str]:
    tokens = byte_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens + SPECIALS


def hf_state_dict(arch: str, vocab: int, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face names, as the original model would have them."""
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    sd = {"model.embed_tokens.weight": r(vocab, HIDDEN), "model.norm.weight": r(HIDDEN)}
    if not tied:
        sd["lm_head.weight"] = r(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = r(HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.k_proj.weight"] = r(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.v_proj.weight"] = r(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[p + "self_attn.o_proj.weight"] = r(HIDDEN, HEADS * HEAD_DIM)
        if arch == "qwen2":
            sd[p + "self_attn.q_proj.bias"] = r(HEADS * HEAD_DIM)
            sd[p + "self_attn.k_proj.bias"] = r(KV_HEADS * HEAD_DIM)
            sd[p + "self_attn.v_proj.bias"] = r(KV_HEADS * HEAD_DIM)
        if arch == "qwen3":
            sd[p + "self_attn.q_norm.weight"] = r(HEAD_DIM)
            sd[p + "self_attn.k_norm.weight"] = r(HEAD_DIM)
        sd[p + "mlp.gate_proj.weight"] = r(FFN, HIDDEN)
        sd[p + "mlp.up_proj.weight"] = r(FFN, HIDDEN)
        sd[p + "mlp.down_proj.weight"] = r(HIDDEN, FFN)
        sd[p + "input_layernorm.weight"] = r(HIDDEN)
        sd[p + "post_attention_layernorm.weight"] = r(HIDDEN)
    return sd


GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def gguf_name(hf: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in fixed:
        return fixed[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to llama Q/K rows (written out independently)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "qwen2",
    *,
    tied: bool = False,
    tokenizer: bool = True,
    quantized: tuple[str, ...] | dict[str, str] = (),
    vocab_rows: int | None = None,
    rope_freqs: np.ndarray | None = None,
    name: str | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny model as llama.cpp would; returns the original HF-named fp32 weights.

    Tensors whose HF name is in `quantized` are stored as Q8_0 (or, for a dict, as the GGUF type it
    names: quantized by `gguf` where it can, else random valid blocks); the returned dict then holds
    what dequantising them gives, which is what the converter can at best reproduce.
    """
    kinds = quantized if isinstance(quantized, dict) else dict.fromkeys(quantized, "Q8_0")
    tokens = tiny_vocab()
    vocab = vocab_rows or len(tokens)
    sd = hf_state_dict(arch, vocab, tied, seed)
    w = gguf.GGUFWriter(str(path), arch)
    if name:
        w.add_name(name)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    if arch == "qwen3":
        w.add_key_length(HEAD_DIM)
        w.add_value_length(HEAD_DIM)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
        w.add_token_merges(MERGES)
        w.add_add_bos_token(False)
        w.add_chat_template(CHAT_TEMPLATE)
    for hf, value in sd.items():
        data = value
        if arch == "llama" and hf.endswith("q_proj.weight"):
            data = llama_cpp_permute(value, HEADS)
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            data = llama_cpp_permute(value, KV_HEADS)
        if hf in kinds:
            qt = gguf.GGMLQuantizationType[kinds[hf]]
            try:
                packed = gguf.quants.quantize(data, qt)
                # Blocks run along rows, and the permutation moves whole rows, so this commutes.
                sd[hf] = gguf.quants.dequantize(gguf.quants.quantize(value, qt), qt).astype(np.float32)
            except NotImplementedError:  # gguf has no quantizer for this type
                from test_quant import random_blocks

                assert data is value, "random blocks only for tensors llama.cpp does not permute"
                packed = random_blocks(kinds[hf], *value.shape, seed=value.shape[0])
                sd[hf] = gguf.quants.dequantize(packed, qt).astype(np.float32).reshape(value.shape)
            w.add_tensor(gguf_name(hf), packed, raw_dtype=qt)
        else:
            w.add_tensor(gguf_name(hf), data)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a converted folder as float32 (kept quantization grids dequantised)."""
    stored = QuantizedFile(folder / conv.WEIGHTS_FILE)
    return {name: stored.get(name, torch.float32) for name in stored.names}


def assert_same_weights(folder: Path, expected: dict[str, np.ndarray]) -> None:
    got = load_folder(folder)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32, name
        assert tuple(got[name].shape) == value.shape, name
        assert torch.equal(got[name], torch.from_numpy(value)), name


# --------------------------------------------------------------------------- tests


def test_qwen2_converts_exactly_with_tokenizer(tmp_path: Path) -> None:
    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, "qwen2", tied=True, vocab_rows=288)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False)

    assert conv.is_complete(out)
    assert_same_weights(out, expected)
    config = json.loads((out / "config.json").read_text())
    tokens = tiny_vocab()
    assert config["model_type"] == "qwen2"
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == 288  # the embedding's rows, not the (shorter) token list
    assert (config["hidden_size"], config["intermediate_size"]) == (HIDDEN, FFN)
    assert (config["num_hidden_layers"], config["num_attention_heads"]) == (LAYERS, HEADS)
    assert (config["num_key_value_heads"], config["head_dim"]) == (KV_HEADS, HEAD_DIM)
    assert config["rms_norm_eps"] == 1e-6
    assert config["rope_theta"] == 1000000.0
    assert config["max_position_embeddings"] == CONTEXT
    assert config["tie_word_embeddings"] is True
    assert config["attention_bias"] is True
    assert config["torch_dtype"] == "float32"
    assert config["bos_token_id"] == tokens.index("<|endoftext|>")
    assert config["eos_token_id"] == tokens.index("<|im_end|>")

    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")]

    from transformers import AutoTokenizer

    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok.encode("hello world")
    assert ids == [tokens.index("hello"), tokens.index("Ġworld")]
    assert tok.decode(ids) == "hello world"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") == tokens.index("<|im_end|>")


def test_llama_qk_permutation_is_undone(tmp_path: Path) -> None:
    src = tmp_path / "tiny-llama.gguf"
    expected = write_tiny_gguf(src, "llama", tied=False, tokenizer=False)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)

    assert_same_weights(out, expected)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["attention_bias"] is False
    assert config["num_key_value_heads"] == KV_HEADS


def test_mistral_is_recognised_by_name(tmp_path: Path) -> None:
    src = tmp_path / "tiny-mistral.gguf"
    expected = write_tiny_gguf(src, "llama", tokenizer=False, name="Mistral 7B Instruct v0.3")
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert_same_weights(out, expected)  # still un-permuted: the file says "llama"
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("mistral", ["MistralForCausalLM"])


def test_quantized_tensors_dequantize_in_hf_layout(tmp_path: Path) -> None:
    src = tmp_path / "q.gguf"
    quantized = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight")
    quantized += ("model.layers.0.mlp.down_proj.weight", "lm_head.weight")
    expected = write_tiny_gguf(src, "llama", tokenizer=False, quantized=quantized)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert_same_weights(out, expected)


def test_qwen3_norms_and_head_dim(tmp_path: Path) -> None:
    src = tmp_path / "q3.gguf"
    expected = write_tiny_gguf(src, "qwen3", tokenizer=False)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert_same_weights(out, expected)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["head_dim"] == HEAD_DIM
    assert config["attention_bias"] is False
    assert "model.layers.1.self_attn.q_norm.weight" in expected


def test_converted_folder_loads_in_transformers(tmp_path: Path) -> None:
    from specextend.bench.hf_baselines import hf_model

    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, "qwen2", tied=False, tokenizer=False, quantized=("lm_head.weight",))
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    model = hf_model(out, torch.float32)  # refuses missing or unexpected tensors
    assert model.config.rope_parameters["rope_theta"] == 1000000.0
    assert torch.equal(model.lm_head.weight, torch.from_numpy(expected["lm_head.weight"]))


def test_quantized_tensors_keep_their_grid_on_disk(tmp_path: Path) -> None:
    """Q8_0 tensors are stored in the kernels' layout (about 8.5 bits a weight), not as float32."""
    src = tmp_path / "tiny.gguf"
    quantized = ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight")
    write_tiny_gguf(src, "qwen2", tokenizer=False, quantized=quantized)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert sorted(out.glob("*.safetensors")) == [out / conv.WEIGHTS_FILE]
    stored = QuantizedFile(out / conv.WEIGHTS_FILE)
    assert set(stored.formats) == set(quantized)
    for name in quantized:
        seg = stored.segment(name)
        assert seg is not None and seg.fmt == "q8" and seg.offset == 128 and seg.blob.dtype == torch.uint8
        assert seg.blob.numel() < seg.n * seg.k * 4 / 3  # under 11 bits a weight, with panel padding
    assert stored.segment("model.norm.weight") is None


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    src = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(src), "falcon")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UserError, match="unsupported GGUF architecture 'falcon'"):
        conv.convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("damage", ["truncated-header", "truncated-data", "random", "empty"])
def test_corrupt_files_raise_user_error(tmp_path: Path, damage: str) -> None:
    src = tmp_path / "bad.gguf"
    write_tiny_gguf(src, "qwen2", tokenizer=False)
    raw = src.read_bytes()
    if damage == "truncated-header":
        src.write_bytes(raw[:200])
    elif damage == "truncated-data":
        src.write_bytes(raw[:-1000])
    elif damage == "random":
        src.write_bytes(np.random.default_rng(1).bytes(4096))
    else:
        src.write_bytes(b"")
    with pytest.raises(UserError, match="is not a valid GGUF file: "):
        conv.convert_gguf(src, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_missing_file_raises_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        conv.convert_gguf(tmp_path / "nope.gguf", tmp_path / "hf", progress=False)


def test_failed_conversion_leaves_nothing_and_marker_comes_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "qwen2", tokenizer=False)
    out = tmp_path / "hf"
    seen: dict[str, bool] = {}

    def boom(reader: object, config: dict) -> dict:
        tmp = out.with_name(f"hf.tmp-{os.getpid()}")
        seen["weights written"] = any(tmp.glob("*.safetensors"))
        seen["marker"] = (tmp / conv.COMPLETE_MARKER).exists()
        raise RuntimeError("killed")

    monkeypatch.setattr(conv, "generation_config", boom)
    with pytest.raises(RuntimeError, match="killed"):
        conv.convert_gguf(src, out, progress=False, tokenizer=False)
    assert seen == {"weights written": True, "marker": False}
    assert not out.exists()
    assert list(tmp_path.glob("hf.tmp-*")) == []

    monkeypatch.undo()
    conv.convert_gguf(src, out, progress=False, tokenizer=False)
    assert conv.is_complete(out)


def test_stale_temp_dirs_of_dead_processes_are_removed(tmp_path: Path) -> None:
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, "qwen2", tokenizer=False)
    stale = tmp_path / "hf.tmp-999999999"  # no such pid
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert not stale.exists()
    assert conv.is_complete(out)


def test_incomplete_existing_folder_is_replaced(tmp_path: Path) -> None:
    src = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(src, "qwen2", tokenizer=False)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert not conv.is_complete(out)
    conv.convert_gguf(src, out, progress=False, tokenizer=False)
    assert conv.is_complete(out)
    assert_same_weights(out, expected)


def test_permutation_round_trip() -> None:
    w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    assert np.array_equal(conv.unpermute_qk(llama_cpp_permute(w, 2), 2), w)
    assert np.array_equal(conv.permute_qk(w, 2), llama_cpp_permute(w, 2))
    bias = np.arange(8, dtype=np.float32)
    assert np.array_equal(conv.unpermute_qk(llama_cpp_permute(bias, 2), 2), bias)


def test_llama3_rope_factors_become_rope_scaling(tmp_path: Path) -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    factors = conv.llama3_rope_factors(1000000.0, HEAD_DIM, scaling)
    assert factors.max() == 32.0 and factors.min() == 1.0
    src = tmp_path / "l3.gguf"
    expected = write_tiny_gguf(src, "llama", tokenizer=False, rope_freqs=factors)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert_same_weights(out, expected)  # rope_freqs is not a weight
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == scaling
    assert config["rope_parameters"] == {**scaling, "rope_theta": 1000000.0}


def test_file_without_tokenizer_converts_weights_only(tmp_path: Path) -> None:
    src = tmp_path / "notok.gguf"
    expected = write_tiny_gguf(src, "qwen2", tokenizer=False)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False)  # tokenizer=True by default
    assert_same_weights(out, expected)
    assert not (out / "tokenizer.json").exists()
    assert conv.is_complete(out)


def test_our_reader_reads_what_ggufs_reader_reads(tmp_path: Path) -> None:
    """The header read through a plain array (`gguf._reader_class`, for speed) gives every field's
    parts and types and every tensor's name, type, shape and data as gguf's own reader does."""
    from gguf import GGUFReader

    from specextend.models.gguf import open_gguf

    src = tmp_path / "m.gguf"
    write_tiny_gguf(src, "qwen2", quantized=("model.layers.0.mlp.up_proj.weight",))
    ours, theirs = open_gguf(src), GGUFReader(src)
    assert list(ours.fields) == list(theirs.fields)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.name, g.data, g.types) == (f.offset, f.name, f.data, f.types), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(g.parts, f.parts, strict=True)), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))


@pytest.mark.parametrize("values", [
    ["a", "", "ünïcode", "x" * 300], ["only"], [3, -1, 2**31 - 1], [0.5, -2.25], [True, False, True],
    [[1, 2], [3]], [["a", "b"], ["c"]],
], ids=["strings", "one-string", "int32", "float32", "bool", "nested-ints", "nested-strings"])
def test_our_reader_reads_every_kind_of_array_as_ggufs_reader(tmp_path: Path, values: list) -> None:
    """The arrays our reader walks in one loop (strings, numbers) and the ones it leaves to gguf
    (nested): the same parts, data indices, types and contents as gguf's own reader."""
    from gguf import GGUFReader

    src = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(src), "qwen2")
    w.add_array("test.values", values)
    w.add_array("test.after", ["the next field", "is read from the right offset"])
    w.add_tensor("t", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = conv.open_gguf(src), GGUFReader(src)
    for name, f in theirs.fields.items():
        g = ours.fields[name]
        assert (g.offset, g.data, g.types) == (f.offset, f.data, f.types), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(g.parts, f.parts, strict=True)), name
        if f.types and f.types[-1] != gguf.GGUFValueType.ARRAY:
            assert g.contents() == f.contents(), name
    assert conv.field(ours, "test.after") == ["the next field", "is read from the right offset"]
    assert np.array_equal(ours.tensors[0].data, np.arange(32, dtype=np.float32))


def test_a_big_endian_file_reads_as_ggufs_reader_reads_it(tmp_path: Path) -> None:
    """Our array walk reads little-endian headers; a big-endian file's arrays go to gguf's own code."""
    from gguf import GGUFReader

    src = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(src), "qwen2", endianess=gguf.GGUFEndian.BIG)
    w.add_array("test.tokens", ["a", "bc", "déf"])
    w.add_array("test.ids", [1, 2, 3])
    w.add_tensor("t", np.arange(32, dtype=np.float32).byteswap().view(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, theirs = conv.open_gguf(src), GGUFReader(src)
    assert conv.field(ours, "test.tokens") == ["a", "bc", "déf"] == theirs.fields["test.tokens"].contents()
    assert conv.field(ours, "test.ids") == [1, 2, 3] == theirs.fields["test.ids"].contents()


@pytest.mark.parametrize("kind", ["strings", "numbers"])
def test_an_array_longer_than_the_file_is_a_clear_error(tmp_path: Path, kind: str) -> None:
    """A damaged array length (2^40 elements) is refused at once, not walked element by element
    past the end of the file."""
    src = tmp_path / "long.gguf"
    w = gguf.GGUFWriter(str(src), "qwen2")
    w.add_array("test.values", ["a", "b"] if kind == "strings" else [1, 2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    raw = bytearray(src.read_bytes())
    at = raw.index(b"test.values") + len("test.values") + 8  # past the value type and the element type
    raw[at : at + 8] = (1 << 40).to_bytes(8, "little")
    src.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="is not a valid GGUF file"):
        conv.open_gguf(src)
