"""A server that bounds what it takes and stops cleanly (issue 47): a body past `--max-body-mb`
refused with 413 before it is read (declared or chunked) while a running stream goes on, a prompt
too long for the context refused from its characters, a hung-up stream counted as cancelled in
/metrics, and draining: on SIGTERM /health says so, new requests get 503, running ones finish (or
are cancelled after the drain's time) and the process exits with status 0."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from specextend.api import Pair, load
from specextend.serve.limits import MIN_BODY_BYTES

import loopback as http
from test_serve import Throttled, client, one_at_a_time, running, slow_steps
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-limits")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@pytest.fixture(scope="module")
def pair(folders):
    p = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    p = Pair(replace(p.spec, eos_ids=()), Throttled(p.target), p.draft)  # every answer runs to its length
    p.step_costs()
    return p


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def raw_request(url: str, head: str, chunks=()) -> tuple[int, dict[str, str], bytes, float]:
    """Send `head` (request line and headers) and then `chunks` one by one, each only once the
    server has not answered yet; (status, headers, body, seconds to the answer)."""
    host, port = url.removeprefix("http://").split(":")
    t0 = time.time()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head.encode())
        for chunk in chunks:
            if select.select([s], [], [], 0.02)[0]:
                break  # the answer is in: stop sending
            s.sendall(chunk)
        data = b""
        while b"\r\n\r\n" not in data:
            got = s.recv(65536)
            assert got, data
            data += got
        seconds = time.time() - t0
        head_part, _, body = data.partition(b"\r\n\r\n")
        lines = head_part.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(body) < int(headers.get("content-length", 0)):
            got = s.recv(65536)
            if not got:
                break
            body += got
    return int(lines[0].split()[1]), headers, body, seconds


# --------------------------------------------------------------------------- bounded requests


def test_a_120_mb_body_gets_413_at_once_and_a_running_stream_is_unharmed(pair, folders):
    with running(pair, folders, limits=one_at_a_time(4)) as u:
        slow_steps(pair, 0.02)
        body = {"prompt": "hi", "max_tokens": 40, "stream": True, "method": "ar"}
        with http.Client(timeout=60) as h, h.stream("POST", f"{u}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            before = rss_mb()
            declared = 120 * 2**20
            status, headers, answer, seconds = raw_request(u, (
                f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {declared}\r\nExpect: 100-continue\r\n\r\n"))
            # No body was sent: a server waiting for it would answer only at the socket's 30 s timeout.
            assert status == 413 and seconds < 20 and headers["connection"] == "close"
            err = json.loads(answer)["error"]
            assert err["code"] == "request_too_large" and "--max-body-mb" in err["message"]
            # A chunked upload (no length) is counted as it comes and refused past the limit.
            piece = b"x" * 65536
            chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
            head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n")
            status, _, answer, _ = raw_request(u, head, [chunk] * (4 * MIN_BODY_BYTES // len(piece)))
            assert status == 413 and json.loads(answer)["error"]["code"] == "request_too_large"
            assert rss_mb() - before < 32  # nothing of the bodies was kept
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # A body under the limit is served as before.
        assert client(u).completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


def test_the_body_limit_follows_the_flag(pair, folders):
    with running(pair, folders, max_body_bytes=200) as u:
        r = http.post(f"{u}/v1/completions", json={"prompt": "hello there " * 20, "max_tokens": 2})
        assert r.status_code == 413 and "200 bytes" in r.json()["error"]["message"]
        assert http.post(f"{u}/v1/completions", json={"prompt": "hello there", "max_tokens": 2}).status_code == 200


def test_a_prompt_too_long_by_its_characters_is_never_tokenized(pair, folders):
    with running(pair, folders, held=(held := [])) as u:
        encoder = held[0].encoder
        calls = []
        real = encoder.spec.tokenizer.encode
        encoder.spec.tokenizer.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            limit = encoder.max_prompt_chars()
            for path, body in (("/v1/completions", {"prompt": "x" * (limit + 1)}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * limit}]})):
                r = http.post(f"{u}{path}", json=body)
                assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                assert "characters" in r.json()["error"]["message"]
            assert not calls
        finally:
            encoder.spec.tokenizer.encode = real


def test_a_stream_the_client_hangs_up_on_is_counted_as_cancelled(pair, folders):
    with running(pair, folders, limits=one_at_a_time(4)) as u:
        slow_steps(pair, 0.02)
        body = {"prompt": "hi", "max_tokens": 100, "stream": True, "method": "ar"}
        with http.Client(timeout=60) as h, h.stream("POST", f"{u}/v1/completions", json=body) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))
        deadline = time.time() + 10
        while http.cancelled(u) != 1:
            assert time.time() < deadline
            time.sleep(0.05)


# --------------------------------------------------------------------------- draining


def wait_for(check, seconds: float = 20) -> None:
    deadline = time.time() + seconds
    while not check():
        assert time.time() < deadline
        time.sleep(0.02)


def test_a_draining_server_finishes_what_runs_refuses_what_comes_and_stops(pair, folders):
    with running(pair, folders, limits=one_at_a_time(4), held=(held := [])) as u:
        _, uv, thread = held
        slow_steps(pair, 0.02)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True, "method": "ar"}
        with http.Client(timeout=60) as h, h.stream("POST", f"{u}/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            uv.handle_exit(signal.SIGTERM, None)  # what the signal calls
            health = http.get(f"{u}/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            r = http.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["code"] == "server_shutdown"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        thread.join(15)  # nothing in flight: the server closes by itself
        assert not thread.is_alive()


def test_a_drain_past_its_time_cancels_with_an_error_in_the_stream(pair, folders):
    with running(pair, folders, limits=one_at_a_time(4), held=(held := [])) as u:
        server, uv, thread = held
        server.drain.seconds = 0.5
        slow_steps(pair, 0.05)
        body = {"prompt": "hi", "max_tokens": 200, "stream": True, "method": "ar"}
        waiting = {"prompt": "hi", "max_tokens": 200, "method": "ar"}
        with ThreadPoolExecutor(1) as pool, http.Client(timeout=60) as h, \
                h.stream("POST", f"{u}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            queued = pool.submit(http.post, f"{u}/v1/completions", json=waiting, timeout=60)
            wait_for(lambda: http.get(f"{u}/health").json()["waiting"] == 1)
            uv.handle_exit(signal.SIGTERM, None)
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            last = json.loads(next(line[6:] for line in reversed(rest) if line.startswith("data: {")))
            assert last["error"]["code"] == "server_shutdown"
            r = queued.result()
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutdown"
        thread.join(15)
        assert not thread.is_alive()


def test_sigterm_during_requests_lets_them_finish_and_exits_0(folders, tmp_path):
    """The command itself: SIGTERM while requests run (one at a time, so they last): each is
    answered in full, one sent during the drain gets 503, and the exit status is 0."""
    env = {**os.environ, "SPECEXTEND_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "specextend.cli", "serve", "--target", str(folders["target"]), "--draft",
           str(folders["draft"]), "--dtype", "float64", "--port", "0", "--cache-mb", "0", "--max-batch", "1",
           "--method", "ar", "--drain-s", "600", "-q"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", proc.stderr.readline())
        assert m
        u = f"http://127.0.0.1:{m.group(1)}"
        assert http.get(f"{u}/health", timeout=300).status_code == 200  # it measures its step costs first
        body = {"prompt": "hi", "max_tokens": 480}
        with ThreadPoolExecutor(3) as pool:
            answers = [pool.submit(http.post, f"{u}/v1/completions", json=body, timeout=600) for _ in range(3)]
            health = lambda: http.get(f"{u}/health", timeout=60)  # noqa: E731
            wait_for(lambda: sum(health().json()[k] for k in ("running", "waiting", "completed")) == 3, 60)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: health().status_code == 503, 60)
            refused = http.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
            done = [a.result() for a in answers]
        assert refused.status_code == 503 and "Retry-After" in refused.headers
        assert [r.status_code for r in done] == [200] * 3
        assert all(r.json()["usage"]["completion_tokens"] == 480 for r in done)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, proc.stderr.read()


# --------------------------------------------------------------------------- the soak


@pytest.mark.long
def test_a_short_soak_of_mixed_clients_finds_the_server_whole(pair, folders):
    """bench/soak.py for 15 s on the tiny models: short and long prompts, streams read and hung up
    on, bad JSON, tools, json_schema, wrong keys, prompts too long; every check of the soak holds."""
    from specextend.bench import soak

    with running(pair, folders, max_queue=64, api_keys=(soak.KEY,)) as u:
        result = soak.run(u, os.getpid(), seconds=15, clients=3, max_requests=5000, max_tokens=4, long_words=40)
    print(soak.table(result))
    assert result["sent"] >= 30 and set(result["by_kind"]) == set(soak.KINDS), result["by_kind"]
    assert result["checks"] == dict.fromkeys(result["checks"], True), (result["checks"], result["errors"],
                                                                       result["metrics"])
