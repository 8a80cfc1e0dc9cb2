"""The amx path (Intel AMX tiles for products of 16+ rows): exact end to end, chosen only where it
runs, refused in one line where it cannot.

Its code runs on every CPU on emulated tiles (`SPECEXTEND_CPU=amx-emulated`, a test switch): a
model's prefill (whole, in chunks, token by token) gives the portable path's bits, greedy
speculative decoding equals target-only decoding, and shapes that are not multiples of the tiles
(row counts, widths) change nothing. Detection: where CPUID, XCR0 or Linux's permission request
deny AMX (made to fail by SPECEXTEND_TEST_AMX_PERMISSION=deny), `auto` falls back, `specextend
kernels` says why, and SPECEXTEND_CPU=amx exits 2 with one line. The per-product comparison with
every other path is in test_kernel_paths.py; the detection's steps one by one in the core's
exactness program (csrc/test/exactness.cpp)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from specextend.common.errors import UserError
from specextend.common.settings import Settings
from specextend.models.loader import load_model
from specextend.runtime import kernels
from specextend.speculation.decoder import SpecEngine

from conftest import make_tiny_hf
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="the C++ kernels cannot be built here")

EMULATED = kernels.EMULATED_AMX
CLI = Path(os.sys.executable).with_name("specextend")
# Widths that are no multiple of 16, 64 or 256: 224 inputs (Q4K super-blocks of 7 groups), 480 in
# the MLP, 97 logits (a partial panel of 16).
SHAPE = dict(hidden_size=224, intermediate_size=480, num_attention_heads=4, num_key_value_heads=2, vocab=97)
PROMPT = torch.randint(0, 96, (53,), generator=torch.Generator().manual_seed(5)).tolist()
SMALL = dict(chunk_size=4, top_k_chunks=3, retrieve_every=2, tree_budget=6, tree_depth=4, tree_topk=2,
             cmr_min_ratio=0.0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for seed, layers in ((0, 2), (5, 1)):
        d = tmp_path_factory.mktemp(f"amx{seed}")
        make_tiny_hf("qwen2", seed, dtype=torch.float32, layers=layers, **SHAPE).save_pretrained(d)
        out[seed] = d
    return out


def prefill(model, chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cache = model.new_cache(len(PROMPT) + 8)
    logits = model.prefill(torch.tensor(PROMPT), cache, chunk=chunk)
    return logits, cache.k[..., : cache.length, :].clone(), cache.v[..., : cache.length, :].clone()


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_prefill_whole_chunked_and_token_by_token_equal_the_portable_bits(folders, monkeypatch, weights):
    monkeypatch.setenv(kernels.CPU_ENV, "portable")
    model = load_model(folders[0], torch.float32, weights=weights)
    ref = prefill(model, chunk=512)
    monkeypatch.setenv(kernels.CPU_ENV, EMULATED)
    for chunk in (512, 17, 2, 1):  # 53 rows at once, tiles of 16 + a tail, pairs, one row (vector path)
        got = prefill(model, chunk)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), chunk


@pytest.mark.parametrize("name", ["sd", "specextend"])
def test_greedy_speculation_equals_ar_on_the_amx_code(folders, monkeypatch, name):
    monkeypatch.setenv(kernels.CPU_ENV, EMULATED)
    target = load_model(folders[0], torch.float32, weights="int4")
    draft = load_model(folders[5], torch.float32, weights="int4")
    eng = SpecEngine(target, draft, eos_ids=[])
    ar = eng.generate(PROMPT, Settings(method="ar", max_new_tokens=20))
    extra = dict(draft_gate=False) if name == "specextend" else {}
    r = eng.generate(PROMPT, Settings(method=name, max_new_tokens=20, **SMALL, **extra))
    assert r.token_ids == ar.token_ids
    monkeypatch.setenv(kernels.CPU_ENV, "portable")
    assert eng.generate(PROMPT, Settings(method="ar", max_new_tokens=20)).token_ids == ar.token_ids


def test_the_cpu_variable_and_the_amx_paths(monkeypatch):
    monkeypatch.setenv(kernels.CPU_ENV, EMULATED)
    assert kernels.path() == EMULATED and kernels.has_fast_path()  # a test switch: runs on any CPU
    assert EMULATED not in kernels.cpu_paths()  # never what `auto` picks
    why = kernels.amx_refusal()
    assert ("amx" in kernels.cpu_paths()) == (why is None)
    if why is not None:
        monkeypatch.setenv(kernels.CPU_ENV, "amx")
        with pytest.raises(UserError, match=f"this CPU cannot run the amx kernels: {why}"):
            kernels.path()
        monkeypatch.setenv(kernels.CPU_ENV, "auto")
        assert kernels.path() == kernels.cpu_paths()[-1] != "amx"


@pytest.mark.parametrize(("amx_s", "choice"), [(0.5, "amx"), (0.98, "avx512"), (2.0, "avx512")])
def test_auto_takes_amx_only_where_it_measured_clearly_faster(tmp_path, monkeypatch, amx_s, choice):
    """On a CPU with AMX, `auto` times a many-row product on amx and avx512 once per machine and
    kernel build, and keeps the faster; the record is read back, not measured again."""
    timed: list[str] = []

    def seconds(path: str) -> float:
        timed.append(path)
        return amx_s if path == "amx" else 1.0

    monkeypatch.setattr(kernels, "cpu_paths", lambda: ["portable", "avx2", "avx512", "amx"])
    monkeypatch.setattr(kernels, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "_many_row_seconds", seconds)
    monkeypatch.setenv(kernels.CPU_ENV, "auto")
    once = 2 * kernels.AMX_ROUNDS
    assert kernels.path() == choice and sorted(set(timed)) == ["amx", "avx512"] and len(timed) == once
    assert timed[:4] == ["avx512", "amx", "avx512", "amx"]  # alternated: a burst of other work slows both
    assert kernels.path() == choice and len(timed) == once  # read back
    assert f"measured {1 / amx_s:.2f}x avx512's speed" in kernels.amx_choice()  # what `specextend kernels` says
    assert kernels.auto_path(["portable", "avx2", "avx512"]) == "avx512"  # no amx: nothing to measure
    monkeypatch.setattr(kernels, "cpu_name", lambda: "another CPU")  # a record from another machine
    assert kernels.path() == choice and len(timed) == 2 * once
    monkeypatch.setenv(kernels.K256_ENV, "q4k")  # another arithmetic: the tiles' speed differs, measured again
    assert kernels.path() == choice and len(timed) == 3 * once
    assert kernels.path() == choice and len(timed) == 3 * once


def test_auto_is_not_swayed_by_a_burst_of_other_work(tmp_path, monkeypatch):
    """Where amx runs 2% slower, a burst that slows avx512's runs in one round (as a test suite
    started beside the first measurement once did) leaves `auto` on avx512: the median round
    decides. Timing each path once, one after the other, took amx here."""
    calls: list[str] = []

    def seconds(path: str) -> float:
        calls.append(path)
        if len(calls) == 1:  # the first round's avx512 run: under the burst
            return 2.0
        return 1.02 if path == "amx" else 1.0

    monkeypatch.setattr(kernels, "cpu_paths", lambda: ["portable", "avx2", "avx512", "amx"])
    monkeypatch.setattr(kernels, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "_many_row_seconds", seconds)
    monkeypatch.setenv(kernels.CPU_ENV, "auto")
    assert kernels.path() == "avx512"
    assert "measured 0.98x avx512's speed" in kernels.amx_choice()


def test_a_record_from_the_one_shot_timing_is_measured_again(tmp_path, monkeypatch):
    """Records written before the alternated rounds (no ratio in them) are not trusted."""
    monkeypatch.setattr(kernels, "cpu_paths", lambda: ["portable", "avx2", "avx512", "amx"])
    monkeypatch.setattr(kernels, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "_many_row_seconds", lambda path: 1.02 if path == "amx" else 1.0)
    monkeypatch.setenv(kernels.CPU_ENV, "auto")
    (tmp_path / "auto-path.json").write_text(json.dumps({
        "cpu": kernels.cpu_name(), "arithmetic": kernels.arithmetic_version(), "choice": "amx",
        "seconds": {"avx512": 0.00158, "amx": 0.00146}}))
    assert kernels.path() == "avx512"
    assert json.loads((tmp_path / "auto-path.json").read_text())["rounds"] == kernels.AMX_ROUNDS


def test_the_many_row_timing_runs_on_every_path_it_may_compare():
    """The product `auto` times is a valid one (here on the paths this CPU has, amx-emulated for amx)."""
    for path in [*kernels.cpu_paths(), EMULATED]:
        assert 0 < kernels._many_row_seconds(path, rows=16, repeats=1) < 60


def run_cli(tmp_path: Path, *argv: str, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, SPECEXTEND_HOME=str(tmp_path / "home"), **env)
    return subprocess.run([str(CLI), *argv], capture_output=True, text=True, env=environ, timeout=600)


def notice_free(stderr: str) -> list[str]:
    return [x for x in stderr.strip().splitlines() if "building the CPU kernels" not in x]


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="AMX is x86-64's")
def test_a_denied_permission_falls_back_and_says_why(tmp_path):
    """With the permission request made to fail (as a VM or container that forbids AMX does), the
    process never runs a tile instruction: `auto` takes the next path, `specextend kernels` names
    the refusal, and SPECEXTEND_CPU=amx is one line and exit 2, never SIGILL."""
    deny = {"SPECEXTEND_TEST_AMX_PERMISSION": "deny"}
    out = run_cli(tmp_path, "kernels", **deny)
    assert out.returncode == 0, out.stderr
    assert "amx" not in out.stdout.split("paths this CPU runs:")[1].split(";")[0]
    assert "no amx: " in out.stdout
    if "amx_int8" in Path("/proc/cpuinfo").read_text() and "avx512_vnni" in Path("/proc/cpuinfo").read_text():
        assert "arch_prctl" in out.stdout  # the CPU has it: the refusal is the permission's
    model = save_tiny_model(tmp_path / "model", seed=0)
    gen = run_cli(tmp_path, "generate", "--target", str(model), "--prompt", "x", "--weights", "int8", "--method", "ar",
                  SPECEXTEND_CPU="amx", **deny)
    assert gen.returncode == 2, gen.stderr
    lines = notice_free(gen.stderr)
    assert len(lines) == 1 and "this CPU cannot run the amx kernels: " in lines[0], gen.stderr


def _linux_grants_tile_data() -> bool:
    """Asks Linux for the tile-data permission directly (arch_prctl, in a child process so this
    one's state is untouched): True where the CPU, XCR0 and the kernel all allow AMX."""
    code = ("import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); "
            "sys.exit(0 if libc.syscall(158, 0x1023, 18) == 0 else 1)")  # SYS_arch_prctl, REQ_XCOMP_PERM, XTILEDATA
    return subprocess.run([os.sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.skipif(os.uname().machine != "x86_64" or "amx_int8" not in Path("/proc/cpuinfo").read_text(),
                    reason="needs a CPU whose flags show AMX")
def test_amx_runs_where_linux_grants_it():
    """Where the CPU shows AMX and Linux grants the permission when asked, the amx path is among
    the paths this CPU runs (its probe once judged the permission before asking for it, so AMX
    never ran on an AMX machine)."""
    if not _linux_grants_tile_data():
        pytest.skip("Linux refuses the tile-data permission here")
    refusal = kernels.amx_refusal()
    assert refusal is None or "arch_prctl" not in refusal
    if "avx512_vnni" in Path("/proc/cpuinfo").read_text():
        assert "amx" in kernels.cpu_paths(), refusal


def test_a_record_taken_while_other_work_held_the_cores_is_measured_again(tmp_path, monkeypatch):
    """A load that lasts the whole measurement (a build beside it) is not cancelled by alternating:
    the process's CPU time against its wall time shows it, and the next process measures again."""
    calls: list[str] = []

    def held(path: str) -> float:  # wall time passes without CPU time: other work has the cores
        calls.append(path)
        time.sleep(0.005)
        return 0.9 if path == "amx" else 1.0

    monkeypatch.setattr(kernels, "cpu_paths", lambda: ["portable", "avx2", "avx512", "amx"])
    monkeypatch.setattr(kernels, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(kernels, "_many_row_seconds", held)
    assert kernels.auto_path() == "amx"  # this process runs what it measured
    assert json.loads((tmp_path / "auto-path.json").read_text())["cpu_share"] < kernels.QUIET_SHARE
    monkeypatch.setattr(kernels, "_many_row_seconds", lambda path: calls.append(path) or (1.02 if path == "amx"
                                                                                          else 1.0))
    measured = len(calls)
    assert kernels.auto_path() == "avx512" and len(calls) == measured + 2 * kernels.AMX_ROUNDS
    assert kernels.auto_path() == "avx512" and len(calls) == measured + 2 * kernels.AMX_ROUNDS  # a quiet record stands
