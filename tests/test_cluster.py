"""`specextend serve --replicas 2` on a local Ray cluster with tiny models, through the official
`openai` client: each document's questions stay on one replica and reuse its prefill (round-robin
for contrast does not), every response names its replica, /health lists them; the front end checks
an API key, answers tool calls from the replicas and exports each replica's gauges; a replica killed
mid-run loses no request silently and comes back. Skipped without the cluster extra (Ray Serve);
CI installs it. Each test starts its own cluster (tens of seconds on 2 cores), so they are few and
each checks all it can on its cluster."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specextend.api import prepare
from test_toolcalls import ASK, TOOLS, valid

import loopback as http
from tiny_tokenizer import save_tiny_model

pytest.importorskip("ray.serve", reason="needs the cluster extra (Ray Serve): pip install -e '.[cluster]'",
                    exc_type=ImportError)  # ray without its serve extra's packages too

# A model cache of its own (conftest.py); the module's tests on one xdist worker, one after the other
# (`make test` runs --dist loadgroup): two local Ray clusters at once took minutes on two cores, and a
# test waiting on the other's cluster would hold its worker idle.
pytestmark = [pytest.mark.usefixtures("isolated_home"), pytest.mark.xdist_group("ray-cluster")]

START_S = 300  # a local Ray cluster and two replicas, on a busy 2-core machine
DOCS = ["The agency's budget grew by four percent, staff numbers fell, and three hearings were held. " * 3,
        "Rainfall in the northern valley doubled, flooding two towns and closing the main railway line. " * 3]
QUESTIONS = ["What happened?", "Who was affected?", "What comes next?"]
KEY = "sk-cluster-key"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@contextmanager
def one_cluster_at_a_time():
    """An exclusive lock across the test run's processes: two local Ray clusters starting at once
    on two cores took minutes (xdist runs these tests on different workers)."""
    with open(Path(tempfile.gettempdir()) / "specextend-tests-ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def replicas(folders, tmp_path, *flags: str, held: list | None = None):
    """`specextend serve --replicas 2` in a subprocess, one cluster at a time; yields its base
    URL (`held` receives the process)."""
    with one_cluster_at_a_time(), _replicas(folders, tmp_path, *flags, held=held) as url:
        yield url


@contextmanager
def _replicas(folders, tmp_path, *flags: str, held: list | None = None):
    env = {**os.environ, "SPECEXTEND_HOME": str(tmp_path / "home"), "RAY_ADDRESS": ""}
    env.pop("SPECEXTEND_API_KEY", None)
    if "--keyed" in flags:  # the front end then checks this key (from the environment)
        env["SPECEXTEND_API_KEY"] = KEY
        flags = tuple(f for f in flags if f != "--keyed")
    cmd = [sys.executable, "-m", "specextend.cli", "serve", "--replicas", "2", "--target", str(folders["target"]),
           "--draft", str(folders["draft"]), "--dtype", "float64", "--port", "0", "--cache-mb", "64",
           "--max-new-tokens", "4", "-q", *flags]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    if held is not None:
        held.append(proc)
    lines: list[str] = []
    found = threading.Event()

    def drain() -> None:  # keeps reading, so Ray's messages never fill the pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if re.search(r"serving .* on http://", line):
                found.set()

    threading.Thread(target=drain, daemon=True).start()
    try:
        deadline = time.time() + START_S
        while not found.wait(1):
            assert proc.poll() is None and time.time() < deadline, "".join(lines[-30:])
        port = re.search(r"http://127\.0\.0\.1:(\d+)/v1", "".join(lines)).group(1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, "".join(lines[-30:])


def client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def ask(url: str, d: int, q: int, key: str = "none") -> tuple[str, int]:
    """Ask question q about document d; (the replica named in the header, cached prompt tokens)."""
    raw = client(url, key).chat.completions.with_raw_response.create(
        model="x", max_tokens=4, messages=[{"role": "user", "content": f"{DOCS[d]}\n\nQuestion: {QUESTIONS[q]}"}])
    r = raw.parse()
    replica = raw.headers["x-specextend-replica"]
    assert r.usage.model_extra["speculative"]["replica"] == replica
    return replica, r.usage.prompt_tokens_details.cached_tokens


# Interleaved so that round-robin sends each document's questions to both replicas.
ORDER = [(0, 0), (1, 0), (1, 1), (0, 1), (0, 2), (1, 2)]


def doc_tokens(folders) -> list[int]:
    tok = prepare(folders["target"], folders["draft"], dtype="float64", progress=False)
    return [len(tok.encode(d)) for d in DOCS]


@pytest.mark.long(60)
def test_affinity_keeps_each_document_on_its_replica_and_a_killed_replica_loses_no_request(folders, tmp_path):
    """With an API key: the front end checks it, answers tool calls and exports the replicas' gauges."""
    n_doc = doc_tokens(folders)
    with replicas(folders, tmp_path, "--keyed") as url:
        health = http.get(f"{url}/health").json()
        assert health["routing"] == "affinity" and len(health["replicas"]) == 2
        for r in health["replicas"]:
            assert {"in_flight", "running", "waiting", "batch", "prefix_cache", "pid"} <= set(r)

        served: dict[int, set[str]] = {0: set(), 1: set()}
        for d, q in ORDER:
            replica, cached = ask(url, d, q, KEY)
            served[d].add(replica)
            if q > 0:
                assert cached >= 0.9 * n_doc[d], (d, q, cached, n_doc[d])
        assert all(len(s) == 1 for s in served.values()), served
        time.sleep(2)  # the replicas report every second
        reported = {r["replica"]: r for r in http.get(f"{url}/health").json()["replicas"]}
        assert sum(r["prefix_cache"]["entries"] for r in reported.values()) >= 2

        keys_tools_and_metrics(url)

        # A replica dies mid-run: streams that had tokens from it end with an error, requests it
        # had not started go to the other replica, nothing hangs; Ray starts a new replica.
        results: dict[str, tuple] = {}
        first = threading.Event()

        def stream(i: int) -> None:
            tokens = 0
            try:
                s = client(url, KEY).completions.create(model="x", prompt=f"Story {i}: once upon a time",
                                                   max_tokens=400, stream=True)
                for chunk in s:
                    if chunk.choices and chunk.choices[0].text:
                        tokens += 1
                        first.set()
                    if chunk.choices and chunk.choices[0].finish_reason:
                        results[f"s{i}"] = ("done", tokens)
            except openai.APIError as e:
                results[f"s{i}"] = ("error", tokens, str(e))

        def plain(i: int) -> None:
            try:
                r = client(url, KEY).completions.create(model="x", prompt=f"Afterwards {i}", max_tokens=4)
                results[f"p{i}"] = ("done", r.choices[0].finish_reason)
            except openai.APIError as e:
                results[f"p{i}"] = ("error", str(e))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert first.wait(120)
        victim = max(http.get(f"{url}/health").json()["replicas"], key=lambda r: r["in_flight"])
        os.kill(victim["pid"], signal.SIGKILL)
        late = [threading.Thread(target=plain, args=(i,)) for i in range(4)]
        for t in late:
            t.start()
        for t in threads + late:
            t.join(180)
        assert not any(t.is_alive() for t in threads + late), "a request hung"
        assert len(results) == 10, results
        for key, outcome in results.items():
            if key.startswith("p"):
                assert outcome[0] == "done", outcome  # not streamed: retried on the other replica
            elif outcome[0] == "error":
                assert outcome[1] > 0 and "was lost while streaming" in outcome[2], outcome
        deadline = time.time() + START_S
        while True:
            ids = [r["replica"] for r in http.get(f"{url}/health").json()["replicas"]]
            if len(ids) == 2 and victim["replica"] not in ids:
                break
            assert time.time() < deadline, ids
            time.sleep(1)
        seen = set()
        for i in range(40):  # new documents hash across both replicas, the new one included
            seen.add(client(url, KEY).completions.with_raw_response.create(
                model="x", prompt=f"New document {i}", max_tokens=2).headers["x-specextend-replica"])
            if set(ids) <= seen:
                break
        assert set(ids) <= seen, (ids, seen)


def keys_tools_and_metrics(url: str) -> None:
    """A keyed front end: 401 without the key or with a wrong one; a required tool call, plain and
    streamed, answered alike by the replicas; /metrics with each replica's gauges."""
    for key in (None, "sk-wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert http.get(f"{url}/v1/models", headers=headers).status_code == 401
        assert http.get(f"{url}/metrics", headers=headers).status_code == 401
    c = client(url, KEY)
    r = c.chat.completions.create(model="x", messages=ASK, tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=False, max_tokens=160)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and valid(calls[0].model_dump())
    with c.chat.completions.stream(model="x", messages=ASK, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_tokens=160) as s:
        for _ in s:
            pass
        streamed = s.get_final_completion().choices[0].message.tool_calls
    assert [(x.function.name, x.function.arguments) for x in streamed] == \
        [(x.function.name, x.function.arguments) for x in calls]
    text = http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    running = [s for s in samples if s.name == "specextend_requests_running"]
    assert len(running) == 2 and all(s.labels["replica"] for s in running)
    assert next(s.value for s in samples if s.name == "specextend_generation_tokens_total") > 0
    assert next(s.value for s in samples if s.name == "specextend_requests_total"
                and s.labels == {"route": "/v1/models", "status": "401"}) == 2


@pytest.mark.long
def test_round_robin_sends_some_follow_up_questions_where_their_document_is_not(folders, tmp_path):
    """Also the front end's bounds and draining: a body over the limit and a prompt too long are
    refused there; on SIGTERM a running stream finishes, a new request gets 503, the exit is 0."""
    n_doc = doc_tokens(folders)
    with replicas(folders, tmp_path, "--routing", "round-robin", held=(held := [])) as url:
        assert http.get(f"{url}/health").json()["routing"] == "round-robin"
        misses = []
        for d, q in ORDER:
            _, cached = ask(url, d, q)
            if q > 0:
                misses.append(cached < 0.9 * n_doc[d])
        assert any(misses), misses

        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # the headers alone: 120 MB
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 125829120\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 413 ")
        r = http.post(f"{url}/v1/completions", json={"prompt": "a" * 100_000})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"

        body = {"prompt": "Once upon a time", "max_tokens": 480, "stream": True, "method": "ar"}
        with http.Client(timeout=120) as h, h.stream("POST", f"{url}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            held[0].send_signal(signal.SIGTERM)
            deadline = time.time() + 30
            while (health := http.get(f"{url}/health")).status_code != 503:
                assert time.time() < deadline
                time.sleep(0.05)
            assert health.json()["status"] == "draining"
            refused = http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert refused.status_code == 503 and "Retry-After" in refused.headers
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        held[0].wait(120)  # the drain ends once nothing is in flight; `replicas` checks the exit status
