"""A GGUF file's types and memory: streaming conversion (same file as the safetensors library writes),
the one-line notice of expanded types, the refusal of a load that would not fit, `models inspect`,
`models list` / `clear-cache`, and random-weight files without a hub (bench/gguf_files.py)."""

from __future__ import annotations

import gc
import itertools
import json
import os
import weakref
from pathlib import Path

import pytest
import torch

from specextend.bench import gguf_files
from specextend.cli.main import main
from specextend.common.errors import UserError
from specextend.common.settings import Settings
from specextend.models import gguf as conv
from specextend.models import registry
from specextend.models.footprint import runs_float
from specextend.models.loader import load_model
from specextend.models.qstore import QuantizedFile, save_tensors, stream_tensors
from specextend.runtime import hugepages, kernels, quant
from specextend.speculation.decoder import SpecEngine
from test_gguf import write_tiny_gguf

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own

# A type the kernels do not compute with as it is (NVFP4: E2M1 codes under an E4M3 scale a 16): expanded.
EXPANDED = "NVFP4"
TINY = {"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def tokenizer_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tok.gguf"
    write_tiny_gguf(path)
    return path


def random_gguf(tmp_path: Path, tokenizer_gguf: Path, kind: str) -> Path:
    return gguf_files.write_random(tmp_path / f"r-{kind}.gguf", dict(TINY), kind, tokenizer_gguf, progress=False)


def loaded_as_file(info: dict) -> bool:
    """Whether inspect's kernel path keeps kept types at their file bytes in memory: the portable
    path (a CPU without vector kernels, or SPECEXTEND_CPU=portable) runs the model in float32."""
    return not runs_float(info["kernel_path"])


def memory_of(row: dict, info: dict) -> int:
    """What a kept type's row costs in memory under inspect's kernel path: its kernel layout's
    bytes (the converted copy's), close to the file's, or float32."""
    assert row["file_bytes"] <= row["converted_bytes"] <= 1.05 * row["file_bytes"]
    return row["converted_bytes"] if loaded_as_file(info) else row["parameters"] * 4


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --------------------------------------------------------------------------- streaming conversion


def test_the_converted_file_is_one_the_safetensors_library_reads_with_blobs_aligned_and_stacks_adjacent(
        tmp_path: Path) -> None:
    """The converter writes one tensor at a time, in an order of its own: blobs first, each on a cache
    line, the parts the loader stacks (q, k, v; gate, up) side by side in that order, so that a stack
    is one span of the file. The safetensors library reads every tensor of it as we do."""
    from safetensors import safe_open

    src = tmp_path / "tiny.gguf"
    stacked = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
    quantized = (*(f"model.layers.0.{n}.weight" for n in stacked), "lm_head.weight")
    write_tiny_gguf(src, "qwen2", tokenizer=False, quantized=quantized)
    out = conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    stored = QuantizedFile(out / conv.WEIGHTS_FILE)
    assert set(stored.formats) == set(quantized)
    with safe_open(str(out / conv.WEIGHTS_FILE), framework="pt") as lib:
        assert set(lib.keys()) == stored.names
        assert all(torch.equal(lib.get_tensor(n), stored._read(n)) for n in stored.names)
    offsets = {n: stored.data_start + int(stored.header[n]["data_offsets"][0]) for n in stored.formats}
    assert all(o % 64 == 0 for o in offsets.values())
    for stack in (quantized[:3], quantized[3:5]):
        spans = [stored.header[n]["data_offsets"] for n in stack]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


def test_stream_tensors_holds_one_tensor_at_a_time(tmp_path: Path) -> None:
    shapes = {f"t{i}": (torch.float32, (64, 32)) for i in range(4)}
    alive: list[weakref.ref] = []

    def produce(name: str) -> torch.Tensor:
        gc.collect()
        assert all(r() is None for r in alive), "an earlier tensor is still held"
        t = torch.full((64, 32), float(name[1:]))
        alive.append(weakref.ref(t))
        return t

    stream_tensors(tmp_path / "x.safetensors", shapes, {}, produce)
    stored = QuantizedFile(tmp_path / "x.safetensors")
    assert torch.equal(stored.get("t3", torch.float32), torch.full((64, 32), 3.0))


def test_stream_tensors_writes_runs_of_rows_as_they_come(tmp_path: Path) -> None:
    """A tensor given as runs of rows is written one run at a time (the earlier ones freed), and a
    quantized tensor's runs of whole 16-row panels join into the blob of the whole."""
    alive: list[weakref.ref] = []

    def runs(name: str):
        for start in range(0, 64, 16):
            gc.collect()
            assert all(r() is None for r in alive), "an earlier run is still held"
            t = torch.arange(start * 32, (start + 16) * 32, dtype=torch.float32).reshape(16, 32)
            alive.append(weakref.ref(t))
            yield t
            del t

    path = tmp_path / "x.safetensors"
    stream_tensors(path, {"a": (torch.float32, (64, 32))}, {}, runs)
    assert torch.equal(QuantizedFile(path).get("a", torch.float32), torch.arange(64 * 32.0).reshape(64, 32))
    w = torch.randn(40, 64)
    whole = quant.quantize_int8(w)
    stream_tensors(path, {}, {"w": whole}, lambda _: iter([quant.quantize_int8(w[:16]), quant.quantize_int8(w[16:])]))
    assert torch.equal(QuantizedFile(path).segment("w").blob, whole.blob)
    for parts in ([quant.quantize_int8(w[:8]), quant.quantize_int8(w[8:])],  # a run ends inside a panel
                  [quant.quantize_int8(w[:16])]):  # rows missing
        with pytest.raises(ValueError, match="planned"):
            stream_tensors(path, {}, {"w": whole}, lambda _, parts=parts: iter(parts))


def test_conversion_in_runs_of_rows_writes_the_same_bytes(tmp_path: Path, monkeypatch) -> None:
    """Tensors are repacked and expanded one run of 16-row panels at a time (the memory of a run,
    not of copies of the largest tensor), and the runs are byte for byte the tensor converted
    whole: rows that end inside a panel, Q/K rows llama.cpp permuted, kept and expanded types."""
    src = tmp_path / "tiny.gguf"
    kinds = {"model.embed_tokens.weight": "Q4_0", "lm_head.weight": "Q5_1",
             "model.layers.0.self_attn.q_proj.weight": "Q8_0", "model.layers.0.mlp.up_proj.weight": "F16",
             "model.layers.1.mlp.down_proj.weight": "BF16"}  # the rest F32, expanded (layer 1's Q and K permuted)
    write_tiny_gguf(src, "llama", tokenizer=False, quantized=kinds, vocab_rows=300)
    whole = conv.convert_gguf(src, tmp_path / "whole", progress=False, tokenizer=False)  # tiny: one run each

    repacked: list[int] = []
    expanded: list[tuple[int, ...]] = []
    real_repack, real_expand = quant.from_gguf_blocks, conv._float32

    def repack(kind, raw, n, k):
        repacked.append(n)
        return real_repack(kind, raw, n, k)

    def expand(data, tensor_type, shape):
        expanded.append(shape)
        return real_expand(data, tensor_type, shape)

    monkeypatch.setattr(quant, "from_gguf_blocks", repack)
    monkeypatch.setattr(conv, "_float32", expand)
    monkeypatch.setattr(conv, "CHUNK_WEIGHTS", 1)  # the shortest run: one panel
    runs = conv.convert_gguf(src, tmp_path / "runs", progress=False, tokenizer=False)
    assert max(repacked) == 16 and repacked.count(16) >= 300 // 16 * 2
    assert max(shape[0] for shape in expanded if len(shape) == 2) == 16  # norms and biases: whole
    assert (runs / conv.WEIGHTS_FILE).read_bytes() == (whole / conv.WEIGHTS_FILE).read_bytes()


def test_a_planned_shape_that_differs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="planned"):
        stream_tensors(tmp_path / "x.safetensors", {"a": (torch.float32, (2, 2))}, {}, lambda _: torch.zeros(3))
    assert not list(tmp_path.iterdir())  # nothing left behind


# --------------------------------------------------------------------------- never silent


def test_an_expanded_type_is_named_in_one_line_at_every_load(tmp_path, tokenizer_gguf, capsys) -> None:
    assert EXPANDED not in quant.GGUF_BLOCKS
    src = random_gguf(tmp_path, tokenizer_gguf, EXPANDED)
    capsys.readouterr()
    registry.converted_gguf(src, progress=False)
    first = [line for line in capsys.readouterr().err.splitlines() if "expanded" in line]
    assert len(first) == 1
    assert f"{src.name}: 16 tensors of {EXPANDED} are expanded to float32 (+" in first[0]
    assert "see specextend models inspect" in first[0]
    registry.converted_gguf(src, progress=False)  # converted already: said again
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if "expanded" in line] == first
    assert "random weights" in err  # a random-weight file says so at every load


def test_kept_types_say_nothing(tmp_path, capsys) -> None:
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, tokenizer=False, quantized=("lm_head.weight",))
    conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert "expanded" not in capsys.readouterr().err


def test_a_load_that_would_not_fit_is_refused_before_writing(tmp_path, tokenizer_gguf) -> None:
    src = random_gguf(tmp_path, tokenizer_gguf, EXPANDED)
    with pytest.raises(UserError, match=rf"would need about .* of memory to load \(16 tensors of {EXPANDED} "
                                        r"expanded to float32, run (requantized to 8 bits|in float32)\); "
                                        r"1.0 MB is available"):
        conv.convert_gguf(src, tmp_path / "hf", progress=False, available_mb=lambda: 1.0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hf")]
    conv.convert_gguf(src, tmp_path / "hf", progress=False, available_mb=lambda: None)  # unknown: no check


def test_the_refusal_exits_2_with_one_line(tmp_path, tokenizer_gguf, capsys, monkeypatch) -> None:
    from specextend.common import meminfo

    src = random_gguf(tmp_path, tokenizer_gguf, EXPANDED)
    monkeypatch.setattr(meminfo, "available_memory_mb", lambda: 1.0)
    code, out, err = run(capsys, "generate", "--target", str(src), "--method", "ar", "--prompt", "hi", "-q")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and lines[-1].startswith("specextend: error: r-NVFP4.gguf would need about")
    assert EXPANDED in lines[-1] and len([line for line in lines if "error" in line]) == 1


# --------------------------------------------------------------------------- inspect


def test_inspect_json(tmp_path, tokenizer_gguf, capsys) -> None:
    src = random_gguf(tmp_path, tokenizer_gguf, "Q4_K_M")
    code, out, _ = run(capsys, "models", "inspect", str(src), "--json")
    assert code == 0
    info = json.loads(out)
    assert info["architecture"] == "qwen2" and info["supported"] and info["random_weights"]
    assert info["shape"]["hidden_size"] == 256 and info["shape"]["num_hidden_layers"] == 2
    assert info["file_bytes"] == src.stat().st_size
    types = {r["type"]: r for r in info["types"]}
    assert set(types) == {"Q4_K", "Q6_K", "F32"} and info["expanded"] == []
    assert types["Q4_K"]["kept"] and types["Q4_K"]["loaded_bytes"] == memory_of(types["Q4_K"], info)
    assert types["Q6_K"]["tensors"] == 3  # the output and both layers' V and down projections of 2 layers
    assert sum(r["file_bytes"] for r in info["types"]) < info["file_bytes"]
    assert info["memory"]["loaded_bytes"] <= info["memory"]["first_load_peak_bytes"]
    assert info["kernel_path"] in (None, "portable", "avx2", "avx512", "neon", "amx")
    assert info["huge_pages"] is (None if not loaded_as_file(info) else hugepages.wanted())
    # the test tokenizer's template names no tools: a request with tools would be refused
    assert info["tool_calls"].startswith("none: its chat template does not describe tools")
    assert info["reasoning"] == "none: its chat template shows no thinking"
    assert not (Path(os.environ["SPECEXTEND_HOME"]) / "converted").exists()  # nothing converted


def test_inspect_says_where_the_weights_live(tmp_path, tokenizer_gguf, capsys, monkeypatch) -> None:
    src = random_gguf(tmp_path, tokenizer_gguf, "Q4_K_M")
    monkeypatch.setenv(hugepages.ENV, "0")
    code, out, _ = run(capsys, "models", "inspect", str(src))
    assert code == 0
    if loaded_as_file(json.loads(run(capsys, "models", "inspect", str(src), "--json")[1])):
        assert f"the weights stay on the file's pages, which are small ({hugepages.ENV}=0)" in out


def test_inspect_names_what_is_expanded(tmp_path, tokenizer_gguf, capsys) -> None:
    src = random_gguf(tmp_path, tokenizer_gguf, EXPANDED)
    code, out, _ = run(capsys, "models", "inspect", str(src))
    info = json.loads(run(capsys, "models", "inspect", str(src), "--json")[1])
    said = "expanded to float32, then requantized to 8 bits" if loaded_as_file(info) else "float32 in memory"
    assert code == 0 and said in out
    row = next(r for r in info["types"] if r["type"] == EXPANDED)
    assert info["expanded"] == [EXPANDED] and row["converted_bytes"] == row["parameters"] * 4


def test_a_q2_k_file_keeps_its_grid(tmp_path, tokenizer_gguf, capsys, monkeypatch) -> None:
    """Q2_K, once expanded, is kept: inspect and the load say nothing is expanded, the converted copy
    holds the file's bytes, and a folder converted while Q2_K was expanded is converted again."""
    from specextend.models.gguf import FOOTPRINT_FILE, is_current

    src = random_gguf(tmp_path, tokenizer_gguf, "Q2_K")
    info = json.loads(run(capsys, "models", "inspect", str(src), "--json")[1])
    row = next(r for r in info["types"] if r["type"] == "Q2_K")
    assert info["expanded"] == [] and row["kept"] and row["loaded_bytes"] == memory_of(row, info)
    folder = registry.converted_gguf(src, progress=False)
    assert "expanded" not in capsys.readouterr().err
    stored = QuantizedFile(folder / conv.WEIGHTS_FILE)
    kept = {name: stored.segment(name) for name in stored.formats}
    assert {s.fmt for s in kept.values()} == {"q2k"} and len(kept) == row["tensors"]
    assert sum(s.nbytes for s in kept.values()) == row["converted_bytes"] <= row["file_bytes"] * 1.01  # panels of 16
    model = load_model(folder, torch.float32, weights="gguf")
    tokens = {}
    for path in kernels.cpu_paths():  # random weights: the tokens mean nothing, but every path agrees
        monkeypatch.setenv(kernels.CPU_ENV, path)
        eng = SpecEngine(model, model, eos_ids=[])
        tokens[path] = eng.generate([1, 2, 3, 4], Settings(method="ar", max_new_tokens=8)).token_ids
    assert all(t == tokens["portable"] for t in tokens.values())
    # as a conversion from before Q2_K was kept records it: expanded, so converted again
    recorded = json.loads((folder / FOOTPRINT_FILE).read_text())
    for r in recorded["types"]:
        if r["type"] == "Q2_K":
            r.update(kept=False, expanded=True)
    (folder / FOOTPRINT_FILE).write_text(json.dumps({**recorded, "kept_types": ["Q4_K"]}))
    assert not is_current(folder)
    # the same record by this version (a Q2_K matrix it could not keep) is not converted again and again
    (folder / FOOTPRINT_FILE).write_text(json.dumps({**recorded, "kept_types": sorted(quant.GGUF_BLOCKS)}))
    assert is_current(folder)
    recorded.pop("kept_types")  # as a version before the record was written
    (folder / FOOTPRINT_FILE).write_text(json.dumps(recorded))
    assert not is_current(folder)
    registry.converted_gguf(src, progress=False)
    assert is_current(folder)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q8_0", "MXFP4", "IQ3_S",
                                  "IQ3_XXS", "IQ2_XXS", "IQ1_S", "IQ2_XS", "IQ2_S", "IQ1_M", "TQ2_0", "TQ1_0"])
def test_a_kept_type_holds_its_files_bytes(tmp_path, tokenizer_gguf, capsys, kind) -> None:
    """The converted copy of a file of one type holds that type's own layout, whose bytes are what
    inspect reports and about the file's (panels of 16 rows and IQ4_XS's scale bytes aside; the IQ types'
    grid indices become 3- or 4-bit table indices, 3.63-4.38 bits a weight against the files' 1.56-3.44; the
    ternary types Q2_K's 2.63 against 2.06 and 1.69)."""
    src = random_gguf(tmp_path, tokenizer_gguf, kind)
    info = json.loads(run(capsys, "models", "inspect", str(src), "--json")[1])
    row = next(r for r in info["types"] if r["type"] == kind)
    folder = registry.converted_gguf(src, progress=False)
    stored = QuantizedFile(folder / conv.WEIGHTS_FILE)
    kept = [stored.segment(name) for name in stored.formats]
    assert {s.fmt for s in kept} == {quant.KEPT_AS[kind][0]} and len(kept) == row["tensors"]
    grown = {"IQ3_S": 4.31 / 3.44, "IQ3_XXS": 4.38 / 3.06, "IQ2_XXS": 4.38 / 2.06, "IQ1_S": 4.38 / 1.56,
             "IQ2_XS": 3.63 / 2.31, "IQ2_S": 3.63 / 2.56, "IQ1_M": 3.63 / 1.75, "TQ2_0": 2.63 / 2.06,
             "TQ1_0": 2.63 / 1.69}
    grown = grown.get(kind, 1.0)
    assert sum(s.nbytes for s in kept) == row["converted_bytes"] <= row["file_bytes"] * 1.03 * grown
    assert row["kept"] and not row["expanded"]
    if loaded_as_file(info):  # the type's kernel path by name
        assert row["runs_as"] == f"{kind} as it is ({info['kernel_path']} kernels)"


def test_float16_and_bfloat16_matrices_are_kept_not_expanded(tmp_path, capsys) -> None:
    """F16 and BF16 matrices run as they are: inspect and the load say nothing is expanded, and
    each costs its file bytes in memory and on disk."""
    src = tmp_path / "f16.gguf"
    kinds = {"lm_head.weight": "F16", "model.layers.0.mlp.down_proj.weight": "BF16", "model.embed_tokens.weight": "F16"}
    write_tiny_gguf(src, tokenizer=False, quantized=kinds)
    info = json.loads(run(capsys, "models", "inspect", str(src), "--json")[1])
    types = {r["type"]: r for r in info["types"]}
    assert info["expanded"] == [] and {"F16", "BF16"} <= set(types)
    for kind in ("F16", "BF16"):
        row = types[kind]
        assert row["kept"] and not row["expanded"] and row["file_bytes"] == 2 * row["parameters"]
        assert row["loaded_bytes"] == memory_of(row, info)  # the file's bytes, rows padded to panels of 16
        assert "as it is" in row["runs_as"] or "PyTorch" in row["runs_as"]
    conv.convert_gguf(src, tmp_path / "hf", progress=False, tokenizer=False)
    assert "expanded" not in capsys.readouterr().err


def test_inspect_refusals(tmp_path, capsys) -> None:
    for ref, why in ((str(tmp_path / "nope.gguf"), "no such .gguf file"), (str(tmp_path), "is a folder"),
                     ("qwen2.5-coder-1.5b", "not pulled yet")):
        code, _, err = run(capsys, "models", "inspect", ref)
        assert code == 2 and why in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- list and clear-cache


def test_list_shows_known_models_not_the_conversion_cache(tmp_path, tokenizer_gguf, capsys) -> None:
    registry.converted_gguf(random_gguf(tmp_path, tokenizer_gguf, "Q8_0"), progress=False)
    rows = json.loads(run(capsys, "models", "list", "--json")[1])
    assert [r["name"] for r in rows] == list(registry.KNOWN_MODELS)
    assert all(not r["pulled"] and r["size_bytes"] == registry.KNOWN_MODELS[r["name"]].size for r in rows)


def test_clear_cache_keeps_pulled_files_unless_asked(tmp_path, tokenizer_gguf, capsys) -> None:
    home = Path(os.environ["SPECEXTEND_HOME"])
    converted = registry.converted_gguf(random_gguf(tmp_path, tokenizer_gguf, "Q8_0"), progress=False)
    (home / "models" / "m").mkdir(parents=True)
    (home / "models" / "m" / "w").write_bytes(b"x" * 1000)
    (home / "gguf").mkdir()
    (home / "gguf" / "m.gguf").write_bytes(b"y" * 500)
    size = registry.folder_size(converted) + 1000
    code, out, _ = run(capsys, "models", "clear-cache")
    assert code == 0 and not converted.exists() and not (home / "models" / "m").exists()
    assert (home / "gguf" / "m.gguf").is_file()
    assert out.splitlines()[-1] == f"freed {size / 1e6:.1f} MB in {home}"
    code, out, _ = run(capsys, "models", "clear-cache", "--pulled")
    assert code == 0 and not (home / "gguf" / "m.gguf").exists() and out.splitlines()[-1].startswith("freed 500 B")


# --------------------------------------------------------------------------- files without a hub


def test_random_gguf_loads_and_generates(tmp_path, tokenizer_gguf, capsys) -> None:
    from specextend import api

    src = random_gguf(tmp_path, tokenizer_gguf, "Q4_K_M")
    with api.load(str(src), load_draft=False, progress=False) as pair:
        result = pair.generate("hello", method="ar", max_new_tokens=4)
    assert result.new_tokens == 4
    assert "random weights" in capsys.readouterr().err


def test_a_random_lfm2_file_has_llama_cpps_layout_and_generates(tmp_path, tokenizer_gguf) -> None:
    """The lfm2 shapes' layout (convolutions where `full_attn_idxs` leaves a layer, 0 KV heads there, the final
    norm under token_embd_norm) is one our converter reads as the family and runs."""
    from specextend import api
    from specextend.models import gguf as conv

    shape = {**gguf_files.PRESETS["lfm2-350m"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "full_attn_idxs": [1, 3]}
    src = gguf_files.write_random(tmp_path / "lfm2.gguf", shape, "Q4_K_M", tokenizer_gguf, progress=False)
    reader = conv.open_gguf(src)
    assert list(conv.field(reader, "lfm2.attention.head_count_kv")) == [0, 2, 0, 2]
    config = conv.gguf_to_hf_config(reader)
    assert config["layer_types"] == ["conv", "full_attention", "conv", "full_attention"]
    with api.load(str(src), load_draft=False, progress=False) as pair:
        assert pair.target.cfg.conv_layers == (True, False, True, False)
        assert pair.generate("hello", method="ar", max_new_tokens=4).new_tokens == 4


def test_a_random_lfm2_moe_file_has_llama_cpps_layout_and_generates(tmp_path, tokenizer_gguf) -> None:
    """The lfm2-8b-a1b shape's layout (LFM2's, with experts and their selection bias after the dense layers) is one
    our converter reads as the family and runs."""
    from specextend import api

    shape = {**gguf_files.PRESETS["lfm2-8b-a1b"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "full_attn_idxs": [1, 3], "num_experts": 4,
             "num_experts_per_tok": 2, "moe_intermediate_size": 256}
    src = gguf_files.write_random(tmp_path / "lfm2moe.gguf", shape, "Q4_K_M", tokenizer_gguf, progress=False)
    with api.load(str(src), load_draft=False, progress=False) as pair:
        cfg = pair.target.cfg
        assert cfg.conv_layers == (True, False, True, False) and cfg.router == "sigmoid_biased_topk_norm"
        assert [cfg.expert_layer(i) for i in range(4)] == [False, False, True, True]
        assert pair.generate("hello", method="ar", max_new_tokens=4).new_tokens == 4


def test_random_blocks_have_the_spread_asked(tokenizer_gguf) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    for kind in gguf_files.RANDOM_BLOCKS:
        raw = gguf_files.random_tensor((64, 512), kind, rng, {})
        w = dequantize(raw, GGMLQuantizationType[kind])
        assert np.isfinite(w).all() and abs(w.mean()) < 0.01 and 0.01 < w.std() < 0.04, kind


def test_random_tool_refusals(tmp_path, tokenizer_gguf, capsys) -> None:
    assert gguf_files.main(["random", "--shape", "nope", "--tokenizer-from", str(tokenizer_gguf)]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert gguf_files.main(["random", "--shape", "qwen2.5-7b", "--type", "Q7_X",
                            "--tokenizer-from", str(tokenizer_gguf)]) == 2
    assert "--type Q7_X" in capsys.readouterr().err


def test_quantize_without_llama_quantize_says_make_peers(tmp_path, tokenizer_gguf, capsys, monkeypatch) -> None:
    server = tmp_path / "bin" / "llama-server"
    server.parent.mkdir()
    server.write_text("#!/bin/sh\necho 'version: 11434 (test)'\n")
    server.chmod(0o755)
    monkeypatch.setenv("SPECEXTEND_LLAMA_SERVER", str(server))
    out = str(tmp_path / "o.gguf")
    assert gguf_files.main(["quantize", "Q4_0", "--source", str(tokenizer_gguf), "--out", out]) == 2
    err = capsys.readouterr().err
    assert "no llama-quantize beside" in err and "make peers" in err and len(err.strip().splitlines()) == 1


def test_derived_weights_keep_what_was_stored_when_more_is_added(tmp_path: Path) -> None:
    from specextend.models.qstore import DerivedWeights

    a, b = torch.randn(16, 64), torch.randn(32, 64)
    first = DerivedWeights(tmp_path / "d.safetensors")
    first.get("a", lambda: quant.quantize_int8(a))
    first.save()
    second = DerivedWeights(tmp_path / "d.safetensors")
    second.get("a", lambda: pytest.fail("stored already"))
    second.get("b", lambda: quant.quantize_int4(b))
    second.save()
    stored = QuantizedFile(tmp_path / "d.safetensors")
    assert set(stored.formats) == {"a", "b"}
    assert torch.equal(stored.segment("a").blob, quant.quantize_int8(a).blob)
    assert torch.equal(stored.segment("b").blob, quant.quantize_int4(b).blob)


def test_the_estimate_follows_the_scheme_auto_picks(tmp_path: Path) -> None:
    """With a vector kernel path a kept type costs its bytes and an expanded matrix 8.5 bits a weight;
    without one (no kernels, or only the portable path) `--weights auto` runs everything in float32."""
    from specextend.models.footprint import TensorInfo, footprint

    (tmp_path / "f.gguf").write_bytes(b"x")
    kept = TensorInfo("Q8_0", (64, 32), 32 * 2 * 34)
    expanded = TensorInfo(EXPANDED, (256, 32), 32 * 66)
    norm = TensorInfo("F32", (64,), 256)
    fast = footprint(tmp_path / "f.gguf", "qwen2", [kept, expanded, norm], "avx2")
    assert fast.loaded_bytes == 32 * 2 * 34 + 256 * 32 * 34 // 32 + 256
    assert [r.type for r in fast.expanded] == [EXPANDED] and fast.largest_float_bytes == 256 * 32 * 4
    for path in ("portable", None):
        slow = footprint(tmp_path / "f.gguf", "qwen2", [kept, expanded, norm], path)
        assert slow.loaded_bytes == (64 * 32 + 256 * 32 + 64) * 4 and slow.converted_bytes == fast.converted_bytes


@pytest.mark.parametrize("preset", ["olmoe-1b-7b", "qwen3-30b-a3b", "granite-3.1-3b-a800m"])
def test_a_random_expert_file_of_each_preset_loads_with_its_experts(tmp_path, tokenizer_gguf, preset) -> None:
    """The expert presets' layouts at a tiny size: the experts' width (Qwen3-MoE's moe_intermediate_size,
    OLMoE's intermediate_size), their count and the q/k norms' widths are what the family reads."""
    config = {**gguf_files.PRESETS[preset], "hidden_size": 256, "num_hidden_layers": 1, "num_experts": 4,
              "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config["head_dim"] = 64 if "head_dim" in config else None
    config["moe_intermediate_size" if "moe_intermediate_size" in config else "intermediate_size"] = 32
    src = gguf_files.write_random(tmp_path / "e.gguf", config, "Q8_0", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    moe = model.layers[0].moe
    assert (moe.count, moe.used, moe.ff) == (4, 2, 32)
    logits = model(torch.tensor([1, 2, 3]), torch.arange(3), model.new_cache(8))
    assert torch.isfinite(logits).all()


def test_a_random_gpt_oss_file_loads_with_its_experts_in_mxfp4(tmp_path, tokenizer_gguf) -> None:
    """The gpt-oss preset at a tiny size in MXFP4_MOE (the released files' mix): experts in MXFP4 with
    their biases, the rest Q8_0, sinks, the router's bias, windows on the even layers, YaRN; the MXFP4
    bytes give weights of the preset's small spread; a prompt past the window decodes finitely."""
    import gguf

    config = {**gguf_files.PRESETS["gpt-oss-20b"], "hidden_size": 256, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4,
              "num_experts_per_tok": 2, "sliding_window": 8}
    src = gguf_files.write_random(tmp_path / "o.gguf", config, "MXFP4_MOE", tokenizer_gguf, progress=False)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(src).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.attn_q.weight"] == "Q8_0"
    assert types["blk.1.attn_sinks.weight"] == "F32" and types["blk.1.ffn_down_exps.bias"] == "F32"
    exps = next(t for t in gguf.GGUFReader(src).tensors if t.name == "blk.0.ffn_up_exps.weight")
    values = gguf.quants.dequantize(exps.data, gguf.GGMLQuantizationType.MXFP4)
    assert 0.25 * gguf_files.WEIGHT_STD < values.std() < 4 * gguf_files.WEIGHT_STD
    # inspect counts the experts' 2-D biases as the float32 vectors the model keeps, not as requantized matrices
    fp = conv.file_footprint(gguf.GGUFReader(src), src, "avx2")
    f32 = [r for r in fp.types if r.type == "F32"]
    assert f32 and all("requantized" not in r.runs_as for r in f32)
    assert sum(r.loaded_bytes for r in f32 if "routers" not in r.runs_as) == sum(
        r.file_bytes for r in f32 if "routers" not in r.runs_as)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c, moe = model.cfg, model.layers[0].moe
    assert c.arch == "gpt-oss" and c.attn_sinks and c.o_bias and c.window_layers == (True, False)
    assert (moe.count, moe.used, moe.ff) == (4, 2, 64) and moe.router.bias is not None
    assert c.rope_scaling["rope_type"] == "yarn" and c.stepped
    assert torch.isfinite(model.prefill(torch.arange(1, 21), model.new_cache(32), chunk=8)).all()


def test_a_random_gemma3_file_loads_as_the_family(tmp_path, tokenizer_gguf) -> None:
    """The Gemma 3 preset at a tiny size: sandwich norms and per-head q/k norms where llama.cpp names
    them, 5 windowed layers to 1 global, the global rope linearly scaled; logits of a prompt longer
    than the window are finite, and the windowed layers keep their window in a sliding cache."""
    config = {**gguf_files.PRESETS["gemma3-4b"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 16}
    src = gguf_files.write_random(tmp_path / "g.gguf", config, "Q4_K_M", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c = model.cfg
    assert c.arch == "gemma3" and c.window_layers == (True,) * 5 + (False,) and c.sliding_window == 16
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0} and c.qk_norm == "head"
    cache = model.new_cache(64, room=8)
    logits = model.prefill(torch.arange(1, 41), cache, chunk=8)
    assert torch.isfinite(logits).all() and cache.wk is not None and cache.wk.shape[2] == 24


def test_a_random_gemma2_file_loads_as_the_family(tmp_path, tokenizer_gguf) -> None:
    """The Gemma 2 preset at a tiny size: sandwich norms, no q/k norms, both soft caps read back
    from llama.cpp's keys, windows on alternating layers; decode steps take the whole-step call."""
    config = {**gguf_files.PRESETS["gemma2-2b"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 16}
    src = gguf_files.write_random(tmp_path / "g.gguf", config, "Q4_K_M", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c = model.cfg
    assert c.arch == "gemma2" and c.window_layers == (True, False, True, False) and c.sliding_window == 16
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0) and not c.qk_norm and c.stepped
    cache = model.new_cache(64, room=8)
    logits = model.prefill(torch.arange(1, 41), cache, chunk=8)
    assert torch.isfinite(logits).all() and logits.abs().max() <= 30.0


def test_a_random_phi4_mini_file_loads_as_the_family(tmp_path, tokenizer_gguf) -> None:
    """The Phi-4-mini preset at a tiny size: fused q/k/v and gate/up as llama.cpp names them, 48 of
    64 head dimensions rotated, LongRoPE's factors read from their tensors; finite logits."""
    config = {**gguf_files.PRESETS["phi4-mini"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    src = gguf_files.write_random(tmp_path / "p.gguf", config, "Q4_K_M", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c = model.cfg
    assert c.arch == "phi3" and c.rotary_dim == 48 and c.rope_scaling["rope_type"] == "longrope"
    assert len(c.rope_scaling["short_factor"]) == 24 and c.max_position == 4096 and c.stepped
    assert torch.isfinite(model.prefill(torch.arange(1, 21), model.new_cache(32), chunk=8)).all()


def test_a_random_qwen2moe_file_loads_with_its_shared_expert(tmp_path, tokenizer_gguf) -> None:
    """The Qwen1.5-MoE preset at a tiny size in Q8_0 (its experts' 1,408 is no K-quant width): the
    shared expert's vector gate and products as llama.cpp names them, q/k/v biases; stepped."""
    config = {**gguf_files.PRESETS["qwen1.5-moe-a2.7b"], "hidden_size": 256, "moe_intermediate_size": 96,
              "shared_expert_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "num_experts": 6, "num_experts_per_tok": 2}
    src = gguf_files.write_random(tmp_path / "m.gguf", config, "Q8_0", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c = model.cfg
    assert c.arch == "qwen2moe" and (c.experts, c.experts_used, c.expert_ff, c.shared_ff) == (6, 2, 96, 128)
    assert c.stepped and model.layers[0].moe.shared and model.layers[0].qkv.bias is not None
    assert torch.isfinite(model.prefill(torch.arange(1, 21), model.new_cache(32), chunk=8)).all()


def test_a_random_olmo3_file_loads_as_the_family(tmp_path, tokenizer_gguf) -> None:
    """The OLMo 3 preset at a tiny size, filed as llama.cpp files it (olmo2 with a window): norms after
    attention and the MLP and q/k norms over all heads where llama.cpp names them, all but every 4th layer
    windowed, YaRN with the file's attention factor on the global layers and the plain rope on the others."""
    config = {**gguf_files.PRESETS["olmo-3-7b"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 4, "num_key_value_heads": 4, "sliding_window": 16}
    src = gguf_files.write_random(tmp_path / "o.gguf", config, "Q4_K_M", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c = model.cfg
    assert c.arch == "olmo3" and c.window_layers == (True, True, True, False) and c.sliding_window == 16
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["attention_factor"] == pytest.approx(1.2079441)
    assert c.local_rope_theta == c.rope_theta == 500000.0 and c.qk_norm == "full" and c.stepped
    cache = model.new_cache(64, room=8)
    assert torch.isfinite(model.prefill(torch.arange(1, 41), cache, chunk=8)).all() and cache.wk.shape[2] == 24


def test_a_random_ministral3_file_loads_as_the_family(tmp_path, tokenizer_gguf) -> None:
    """The Ministral 3 preset at a tiny size (llama.cpp's mistral3): YaRN at magnitude 1 (the file's
    yarn_log_multiplier as transformers' mscale_all_dim) and the attention temperature's beta from the file,
    from the original window on; decode steps inside that window take the whole-step call."""
    config = {**gguf_files.PRESETS["ministral-3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
              "original_max_position_embeddings": 16}
    src = gguf_files.write_random(tmp_path / "m.gguf", config, "Q4_K_M", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c = model.cfg
    assert c.arch == "mistral3" and (c.attn_temperature, c.temperature_length) == (0.1, 16) and c.stepped
    assert c.rope_scaling["rope_type"] == "yarn" and c.rope_scaling["attention_factor"] == 1.0
    assert torch.isfinite(model.prefill(torch.arange(1, 41), model.new_cache(48), chunk=8)).all()


def test_a_random_granite_file_loads_with_its_multipliers(tmp_path, tokenizer_gguf) -> None:
    config = {**gguf_files.PRESETS["granite-3-8b"], "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    src = gguf_files.write_random(tmp_path / "g.gguf", config, "Q4_K_M", tokenizer_gguf, progress=False)
    model = load_model(registry.converted_gguf(src, progress=False), torch.float32, weights="gguf")
    c = model.cfg
    assert c.arch == "granite" and (c.embed_scale, c.residual_scale, c.attn_scale) == (12.0, 0.22, 0.0078125)
    assert c.logit_divisor == 16.0
    assert torch.isfinite(model(torch.tensor([1, 2, 3]), torch.arange(3), model.new_cache(8))).all()


def test_stacked_parts_are_read_into_one_blob_as_concat_would_stack_them(tmp_path: Path) -> None:
    """q, k and v (or gate and up) read straight into their places: the same segments, bit for bit,
    as reading each part and stacking them with `QWeight.concat` (which merges adjacent parts of one
    format while the rows so far fill whole panels); a part stored as float stacks nothing."""
    g = torch.Generator().manual_seed(0)
    parts = {"q": quant.quantize_int8(torch.randn(32, 64, generator=g)),
             "k": quant.quantize_int8(torch.randn(16, 64, generator=g)),
             "v": quant.quantize(torch.randn(16, 64, generator=g), 4).segments[0],  # another format
             "odd": quant.quantize_int8(torch.randn(24, 64, generator=g)),  # ends inside a panel
             "after": quant.quantize_int8(torch.randn(16, 64, generator=g))}
    path = tmp_path / "x.safetensors"
    save_tensors(path, {"f": torch.randn(16, 64, generator=g)}, parts)
    stored = QuantizedFile(path)
    for names in (["q", "k", "v"], ["q", "k"], ["odd", "after", "q"], ["v", "odd", "after"]):
        got = stored.stacked_segments(names)
        want = quant.QWeight.concat([quant.QWeight(64, [stored.segment(n)]) for n in names]).segments
        assert [(s.fmt, s.n, s.offset, s.k, s.groups) for s in got] == [(s.fmt, s.n, s.offset, s.k, s.groups)
                                                                         for s in want], names
        assert all(torch.equal(a.blob, b.blob) for a, b in zip(got, want, strict=True)), names
    assert len(stored.stacked_segments(["q", "k"])) == 1 and len(stored.stacked_segments(["odd", "after"])) == 2
    assert stored.stacked_segments(["q", "f"]) is None
