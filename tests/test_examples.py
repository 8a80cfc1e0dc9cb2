"""The scripts in examples/ run as a user runs them (their own processes, their own arguments), on
tiny models: question answering over a document through the Python API and through the server
with the `openai` client, and the benchmark of a GGUF pair against llama.cpp (a stand-in server
where `make peers` has not run)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from tiny_tokenizer import save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
FAKE_SERVER = Path(__file__).with_name("fake_llama_server.py")
DOC = "The agency's budget grew by 4 percent in 2024. Its staff of 120 held 9 hearings on water. " * 4
QUESTIONS = ["What grew?", "How many hearings?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("examples")
    return {"target": save_tiny_model(root / "target", seed=0), "draft": save_tiny_model(root / "draft", seed=1,
                                                                                          layers=1)}


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    """The test's environment with a model cache of its own (nothing is pulled into the user's)."""
    return {**os.environ, "SPECEXTEND_HOME": str(tmp_path / "home")}


def model_args(models: dict[str, Path]) -> list[str]:
    # float64: the tiny models run through PyTorch, so no C++ kernels are built in the new home.
    return ["--target", str(models["target"]), "--draft", str(models["draft"]), "--dtype", "float64"]


def run_example(name: str, *args: str, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout, check=False)


def usage_lines(out: str) -> list[tuple[int, int]]:
    """(prompt tokens, of them from the cache) of each answer's usage line."""
    return [(int(a), int(b)) for a, b in re.findall(r"(\d+) prompt tokens, (\d+) of them from the cache", out)]


def test_long_document_qa_prefills_the_document_once(models, env, tmp_path):
    doc = tmp_path / "report.txt"
    doc.write_text(DOC)
    r = run_example("long_document_qa.py", *model_args(models), "--max-new-tokens", "5", str(doc), *QUESTIONS,
                    env=env)
    assert r.returncode == 0, r.stderr
    assert [q for q in QUESTIONS if f"Q: {q}" in r.stdout] == QUESTIONS
    (_, cached_first), (second, cached_second) = usage_lines(r.stdout)
    assert cached_first == 0
    # The second prompt shares everything up to its question with the first.
    assert len(DOC) < cached_second < second


def test_long_document_qa_says_what_is_wrong_in_one_line(env, tmp_path):
    r = run_example("long_document_qa.py", str(tmp_path / "missing.txt"), "why?", env=env)
    assert r.returncode == 2 and "missing.txt" in r.stderr and "Traceback" not in r.stderr


@contextmanager
def server(models: dict[str, Path], env: dict[str, str]):
    """`specextend serve` on the tiny pair and a free port; yields its /v1 URL."""
    cmd = [sys.executable, "-m", "specextend.cli", "serve", *model_args(models), "--port", "0", "-q"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.search(r"(http://127\.0\.0\.1:\d+/v1)", line)
        assert m, line
        yield m.group(1)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)


def test_server_qa_through_the_openai_client(models, env, tmp_path):
    doc = tmp_path / "report.txt"
    doc.write_text(DOC)
    with server(models, env) as url:
        r = run_example("server_qa.py", "--base-url", url, "--max-tokens", "5", str(doc), *QUESTIONS, env=env)
    assert r.returncode == 0, r.stderr
    assert [q for q in QUESTIONS if f"Q: {q}" in r.stdout] == QUESTIONS
    (_, cached_first), (second, cached_second) = usage_lines(r.stdout)
    assert cached_first == 0 and len(DOC) < cached_second < second


def test_server_qa_without_a_server_is_one_line(env, tmp_path):
    doc = tmp_path / "report.txt"
    doc.write_text(DOC)
    r = run_example("server_qa.py", "--base-url", "http://127.0.0.1:9/v1", "--wait", "0", str(doc), "why?", env=env)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


@pytest.fixture
def stand_in_peer(tmp_path) -> Path:
    """A `llama-server` that answers as llama.cpp's does (tests/fake_llama_server.py)."""
    script = tmp_path / "llama-server"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE_SERVER} \"$@\"\n")
    script.chmod(0o755)
    return script


def test_bench_against_llamacpp_compares_every_method(models, env, tmp_path, stand_in_peer):
    folder = save_tiny_model(tmp_path / "pair", seed=0)
    (folder / "model.gguf").write_bytes(b"GGUF" + bytes(60))  # what the llama.cpp methods are given
    out = tmp_path / "out"
    r = run_example("bench_against_llamacpp.py", str(folder), str(folder), "--lengths", "160", "--samples", "1",
                    "--max-new-tokens", "4", "--out", str(out),
                    env={**env, "SPECEXTEND_LLAMA_SERVER": str(stand_in_peer)})
    assert r.returncode == 0, r.stderr
    table = r.stdout[r.stdout.index("Against llama.cpp"):]
    methods = [json.loads(line)["method"] for line in (out / "results.jsonl").read_text().splitlines()]
    assert set(methods) == {"ar", "specextend", "llamacpp-ar", "llamacpp-sd", "llamacpp-lookup"}
    for m in methods:
        assert re.search(rf"^\| {m} \| [\d.]+ \| [\d.]+x \|", table, re.M), (m, table)
    assert re.search(r"^\| llamacpp-ar \| [\d.]+ \| 1\.00x \| [\d.]+ \| 1\.00x \|", table, re.M)
    assert re.search(r"^\| specextend \|.*\| 1/1 \|", table, re.M)  # ours equals ar; the stand-in does not


def test_bench_against_llamacpp_without_the_peer_names_make_peers(models, env, tmp_path):
    env = {**env, "SPECEXTEND_LLAMA_SERVER": str(tmp_path / "no-such-llama-server")}
    r = run_example("bench_against_llamacpp.py", str(models["target"]), str(models["draft"]), "--out",
                    str(tmp_path / "out"), env=env)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
