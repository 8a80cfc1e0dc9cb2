"""`specextend serve` on tiny models, through the official `openai` client and plain HTTP: chat,
completions, streaming, usage, extension settings, the prefix cache, 400s for bad requests, 429
past the queue, a disconnecting stream that frees the slot, and the command itself."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace

import openai
import pytest
import uvicorn

from specextend.api import Pair, load, prepare
from specextend.batching.scheduler import Limits
from specextend.common.settings import Settings
from specextend.serve.app import Server
from specextend.serve.command import listen
from specextend.serve.drain import DrainingServer
from specextend.serve.local import LocalBackend

import loopback as http
from tiny_tokenizer import save_tiny_model

SMALL = dict(chunk_size=4, top_k_chunks=2, cmr_min_ratio=0.0)
QUESTION = "What does the report say about the budget?"
DOC = "The report covers the budget of the agency, its staff and the hearings held. " * 6


pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


class Throttled:
    """The target model with something run before each of its batched forwards (a batch step):
    tests slow the steps, hold them, or make them fail."""

    def __init__(self, model) -> None:
        self.model = model
        self.before = None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def forward_many(self, parts):
        if self.before is not None:
            self.before()
        return self.model.forward_many(parts)


@pytest.fixture(scope="module")
def pair(folders):
    p = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    # Random weights: no end token, so every generation runs to max_tokens.
    p = Pair(replace(p.spec, eos_ids=()), Throttled(p.target), p.draft)
    p.step_costs()  # measured here (once per machine and model), not inside a server's start-up deadline
    return p


def steps(pair) -> Throttled:
    """The target whose batched forwards the server's steps run (tests slow, hold or break them)."""
    return pair.target


@contextmanager
def running(pair, folders, *, max_queue=4, cache_mb=64.0, cache_dir=None, limits=None, api_keys=(), held=None,
            max_body_bytes=None, **defaults):
    """The server's app on a free port, in a thread; yields its base URL. `held`, a list, receives
    the `Server`, its uvicorn server (tests of draining call its signal handler) and its thread."""
    encoder = prepare(folders["target"], folders["draft"], dtype="float64", progress=False)
    pair.prefix_cache = None
    if cache_mb:
        pair.enable_prefix_cache(cache_mb, cache_dir)
    server = Server(LocalBackend(pair, max_queue, limits=limits), encoder,
                    Settings(**{"max_new_tokens": 16, **SMALL, **defaults}).resolved(), "tiny")
    server.api_keys = tuple(api_keys)
    server.max_body_bytes = max_body_bytes
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = DrainingServer(uvicorn.Config(server.app(), log_level="warning"), server.drain)
    if held is not None:
        held += [server, uv]
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    if held is not None:
        held.append(thread)
    deadline = time.time() + 120  # the first start measures the step and prefill costs (once per process)
    while not uv.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        steps(pair).before = None
        uv.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def url(pair, folders):
    with running(pair, folders) as u:
        yield u


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def expected(pair, prompt, chat: bool, **settings) -> list[int]:
    """What the engine decodes cold, with no prefix cache."""
    ids = pair.encode_chat([{"role": "user", "content": prompt}]) if chat else pair.encode(prompt)
    return pair._engine.generate(ids, Settings(**{"max_new_tokens": 16, **SMALL, **settings})).token_ids


def speculative(usage) -> dict:
    return usage.model_extra["speculative"] if hasattr(usage, "model_extra") else usage["speculative"]


# --------------------------------------------------------------------------- the OpenAI client


def test_chat_completion_equals_generate(pair, url):
    r = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=12)
    assert r.object == "chat.completion" and r.model == "tiny"
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    want = expected(pair, QUESTION, chat=True, max_new_tokens=12)
    assert r.choices[0].message.content == pair.detokenize(want)
    u = r.usage
    assert u.completion_tokens == 12
    assert u.prompt_tokens == len(pair.encode_chat([{"role": "user", "content": QUESTION}]))
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    spec = speculative(u)
    assert set(spec) >= {"method", "steps", "accepted_per_step", "prefill_s", "decode_s", "total_s", "draft_s",
                         "verify_s", "retrieval_s", "cached_prompt_tokens"}
    assert spec["method"] == "specextend" and spec["steps"] >= 1
    assert "verified_nodes_per_step" in spec["stats"]  # what the sizing chose, as generate --json's extra
    assert spec["total_s"] == pytest.approx(spec["prefill_s"] + spec["decode_s"])


def test_completion_and_extension_settings(pair, url):
    c = client(url)
    r = c.completions.create(model="tiny", prompt="def parse(s):", max_tokens=10, extra_body={"method": "sd"})
    assert r.object == "text_completion"
    assert r.choices[0].text == pair.detokenize(expected(pair, "def parse(s):", chat=False, max_new_tokens=10))
    assert speculative(r.usage)["method"] == "sd"
    ar = c.completions.create(model="tiny", prompt="def parse(s):", max_tokens=10, extra_body={"method": "ar"})
    assert ar.choices[0].text == r.choices[0].text and speculative(ar.usage)["method"] == "ar"
    ids = pair.encode("def parse(s):")
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=10)
    assert by_ids.choices[0].text == r.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_streaming_chat_sends_chunks_then_usage(pair, url):
    stream = client(url).chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}],
        max_tokens=16, stream=True, stream_options={"include_usage": True}, extra_body={"method": "sd"})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed, not one lump
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    ids = pair.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}])
    assert text == pair.detokenize(pair._engine.generate(ids, Settings(method="sd", max_new_tokens=16)).token_ids)
    assert speculative(chunks[-1].usage)["steps"] >= 1


def _stream_text(url: str, content: str, method: str, max_tokens: int) -> str:
    stream = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}],
                                                 max_tokens=max_tokens, stream=True, extra_body={"method": method})
    return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_concurrent_streams_answer_what_one_at_a_time_answers(url):
    """Requests of every method and length, streamed at once, each answer what it answers alone."""
    asks = [(f"{DOC[: 150 * (i % 3)]} Question {i}: {QUESTION}", m, 8 + 4 * i)
            for i, m in enumerate(["ar", "sd", "specextend", "lookup", "sd", "ar", "specextend", "lookup"])]
    alone = [_stream_text(url, *a) for a in asks]
    with ThreadPoolExecutor(len(asks)) as pool:
        together = list(pool.map(lambda a: _stream_text(url, *a), asks))
    assert together == alone
    # A stream's last chunk reaches the client before the scheduler's next step retires its
    # sequence: the server settles within moments (on a loaded machine, not at once).
    deadline = time.time() + 20
    while (h := http.get(f"{url}/health").json())["running"] or h["waiting"]:
        assert time.time() < deadline, h
        time.sleep(0.05)
    assert h["batch"]["kv_in_use_mb"] == 0


def test_streaming_completion_and_stop_strings(pair, url):
    c = client(url)
    full = c.completions.create(model="tiny", prompt="hello", max_tokens=16).choices[0].text
    pieces = [ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="hello", max_tokens=16,
                                                                 stream=True)]
    assert "".join(pieces) == full
    stop = full[5:7]
    cut = full[: full.index(stop)]
    r = c.completions.create(model="tiny", prompt="hello", max_tokens=16, stop=[stop])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="hello", max_tokens=16, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut


def test_a_stop_inside_a_speculative_batch_ends_where_ar_ends(url):
    """A stop string met inside a batch of accepted tokens (here the regex's forced tokens, proposed
    many at a time): the answer's tokens end where `ar`'s end, one at a time, not at the batch's
    end: the same text, completion_tokens and log-probabilities for every method, alone or served
    together."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 60, "stop": ["always"], "logprobs": 0,
            "response_format": {"type": "regex", "regex": "The answer is forty-two, as it always was and will be."}}
    runs = {m: http.post(f"{url}/v1/completions", json={**body, "method": m}).json()
            for m in ("ar", "sd", "specextend")}
    ar = runs["ar"]
    assert ar["choices"][0]["text"] == "The answer is forty-two, as it " and ar["choices"][0]["finish_reason"] == "stop"
    for m, r in runs.items():
        assert r["choices"][0]["text"] == ar["choices"][0]["text"], m
        assert r["usage"]["completion_tokens"] == ar["usage"]["completion_tokens"], m
        assert len(r["choices"][0]["logprobs"]["tokens"]) == ar["usage"]["completion_tokens"], m
    use = runs["specextend"]["usage"]["speculative"]
    assert use["steps"] < ar["usage"]["completion_tokens"]  # batches of several tokens, one held the stop
    # served together, in one batch, each answer is the one it got alone
    with ThreadPoolExecutor(3) as pool:
        together = dict(zip(runs, pool.map(
            lambda m: http.post(f"{url}/v1/completions", json={**body, "method": m}).json(), runs), strict=True))
    for m, r in together.items():
        assert (r["choices"][0]["text"], r["usage"]["completion_tokens"]) == (
            runs[m]["choices"][0]["text"], runs[m]["usage"]["completion_tokens"]), m


def test_models_and_health(url):
    models = client(url).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = http.get(f"{url}/health").json()
    assert h["status"] == "ok" and h["busy"] is False and h["prefix_cache"]["max_bytes"] == 64 << 20
    budget = h["batch"]["budget"]  # the measured step budget and why (batching/budget.py)
    # Beside a stream the chunk is at most the chunk alone at the same context (step_tokens is
    # reported at a 2,048-token context, where the chunk alone may have grown past the empty cache's).
    assert budget["alone_rows"] == h["batch"]["idle_step_tokens"]
    assert budget["alone_rows_by_context"]["2048"] >= h["batch"]["step_tokens"] - 1
    assert budget["why"] and set(budget["prefill_ms_per_token"]) == {"16", "32", "64", "128", "256", "512"}


# --------------------------------------------------------------------------- the prefix cache


@pytest.mark.parametrize("method", ["ar", "sd", "specextend"])
def test_a_second_question_on_the_same_document_reuses_its_prefill(pair, folders, method):
    with running(pair, folders) as u:
        c = client(u)
        answers = []
        for q in ("Who wrote it?", "When was it held?"):
            prompt = f"{DOC}\n\n{q}"
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=12, extra_body={"method": method})
            assert r.choices[0].message.content == pair.detokenize(expected(pair, prompt, True, method=method,
                                                                         max_new_tokens=12))
            answers.append(r)
        first, second = (speculative(a.usage)["cached_prompt_tokens"] for a in answers)
        doc_tokens = len(pair.encode_chat([{"role": "user", "content": DOC}]))
        assert first == 0 and second >= doc_tokens - 8
        assert answers[1].usage.prompt_tokens_details.cached_tokens == second


def test_a_restarted_server_finds_its_prefill_on_disk(pair, folders, tmp_path):
    prompt = f"{DOC}\n\nWho wrote it?"
    for round_ in range(2):
        with running(pair, folders, cache_dir=tmp_path / "kv") as u:
            r = client(u).chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=8)
            cached = speculative(r.usage)["cached_prompt_tokens"]
            assert cached == (0 if round_ == 0 else r.usage.prompt_tokens - 1)
            assert http.get(f"{u}/health").json()["prefix_cache"]["disk_entries"] == 1


# --------------------------------------------------------------------------- refusals


BAD = [
    ("chat", b"{not json", None),
    ("chat", b"[1, 2]", None),
    ("chat", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # deeper than the parser goes
    ("chat", {"model": "tiny"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": "hello"}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, "max_tokens"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 600}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, "top_p"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "method": "magic"}, "method"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "method": 3}, "method"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "chunk_size": 0}, "chunk_size"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "bogus": 1}, "bogus"),
    ("chat", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),  # a generator's 64 bits
    ("chat", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),  # a lone surrogate, escaped
    ("completion", {"model": "tiny"}, "prompt"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": [1, "a"]}, "prompt"),
    ("completion", {"prompt": [99999]}, "prompt"),
    ("completion", {"prompt": "hi \udcff"}, "prompt"),
    ("completion", {"prompt": "hi " * 300, "max_tokens": 300}, "prompt"),
    ("completion", {"prompt": "hi " * 600}, "prompt"),  # longer than the context by itself
    ("completion", {"prompt": "x" * 100_000}, "prompt"),  # refused from its characters, untokenized
    ("chat", {"messages": [{"role": "user", "content": "hi " * 600}]}, "messages"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_shaped_400s(url, endpoint, body, param):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    r = http.post(f"{url}{path}", content=body if isinstance(body, bytes) else json.dumps(body),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and err["message"] and "Traceback" not in r.text
    if isinstance(body, dict) and (body.get("max_tokens") in (300, 600) or len(json.dumps(body)) > 1000):
        assert err["code"] == "context_length_exceeded"  # the prompt alone, or with max_tokens: one code


def test_the_openai_client_sees_a_bad_request_error(url):
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_p=2.0)
    assert e.value.status_code == 400 and e.value.body["param"] == "top_p"


def test_unknown_routes_and_internal_errors_are_json(pair, url, monkeypatch):
    r = http.get(f"{url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.get(f"{url}/v1/chat/completions").status_code == 405

    def broken(*a, **k):
        raise RuntimeError("the kernel fell over")

    monkeypatch.setattr(steps(pair), "before", broken)
    r = http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "Traceback" not in r.text
    monkeypatch.undo()
    assert http.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200


# --------------------------------------------------------------------------- the queue


def one_at_a_time(max_queue: int) -> Limits:
    return Limits(max_batch=1, max_queue=max_queue, step_tokens=64, kv_bytes=2**30)


def slow_steps(pair, seconds: float = 0.05) -> None:
    steps(pair).before = lambda: time.sleep(seconds)


def first_content_chunk(lines) -> None:
    for line in lines:
        if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
            return
    raise AssertionError("the stream ended without content")


def test_past_the_queue_requests_get_429_with_retry_after(pair, folders):
    with running(pair, folders, max_queue=1, limits=one_at_a_time(1)) as u:
        gate = threading.Event()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True,
                "method": "sd"}
        with http.Client(timeout=60) as h, h.stream("POST", f"{u}/v1/chat/completions", json=body) as running_:
            lines = running_.iter_lines()  # kept: dropping it would close the connection
            first_content_chunk(lines)
            steps(pair).before = lambda: gate.wait(60)  # the first request holds the slot until released
            waiting = threading.Thread(target=http.post, args=(f"{u}/v1/completions",),
                                       kwargs={"json": {"prompt": "hi", "max_tokens": 2}, "timeout": 60})
            waiting.start()
            deadline = time.time() + 10
            while http.get(f"{u}/health").json()["waiting"] < 1:
                assert time.time() < deadline
                time.sleep(0.02)
            r = http.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == "queue_full"
            with pytest.raises(openai.RateLimitError):
                client(u).completions.create(model="tiny", prompt="hi", max_tokens=2)
            gate.set()
        waiting.join(60)
        assert http.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_disconnecting_stream_frees_the_slot(pair, folders):
    with running(pair, folders, max_queue=0, limits=one_at_a_time(0)) as u:
        slow_steps(pair)  # 200 tokens would take many seconds
        body = {"prompt": "hi", "max_tokens": 200, "stream": True, "method": "sd"}
        with http.Client(timeout=60) as h, h.stream("POST", f"{u}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break
        # The connection is closed; the generation stops at its next step and the next request runs.
        deadline = time.time() + 60  # a hang's bound, not a speed: what ended it is checked below
        while True:
            r = http.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 2, "method": "ar"})
            if r.status_code == 200:
                break
            assert r.status_code == 429 and time.time() < deadline
            time.sleep(0.05)
        assert http.cancelled(u) == 1  # withdrawn, not run to its 200 tokens
        assert http.get(f"{u}/health").json()["busy"] is False


# --------------------------------------------------------------------------- the command


def test_the_serve_command_starts_answers_and_stops(folders, tmp_path):
    env = {**os.environ, "SPECEXTEND_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-m", "specextend.cli", "serve", "--target", str(folders["target"]), "--draft",
           str(folders["draft"]), "--dtype", "float64", "--port", "0", "--cache-mb", "16", "-q"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line
        base = f"http://127.0.0.1:{m.group(1)}"
        r = client(base).chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
        assert r.usage.completion_tokens <= 4
        assert http.get(f"{base}/health").json()["prefix_cache"]["max_bytes"] == 16 << 20
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0


@pytest.mark.parametrize("args", [["--port", "70000"], ["--max-queue", "-1"], ["--cache-mb", "-5"],
                                  ["--method", "magic"]])
def test_the_serve_command_refuses_bad_flags_in_one_line(args, tmp_path):
    env = {**os.environ, "SPECEXTEND_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "specextend.cli", "serve", *args], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


# --------------------------------------------------------------------------- the load measurement


def test_the_load_measurement_counts_every_outcome():
    """bench/serve.py's load run against a fake client: short requests, abandoned streams, errors."""
    from types import SimpleNamespace

    from specextend.bench import serve as measure

    class Stream:
        def __iter__(self):
            return iter([SimpleNamespace(choices=[SimpleNamespace(delta=SimpleNamespace(content="x"))])] * 3)

        def close(self):
            pass

    def fake_create(messages, stream=False, **kw):
        if "Request 3:" in messages[0]["content"]:
            raise RuntimeError("the server fell over")
        if stream:
            return Stream()
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content="ok"))])

    client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=fake_create)))
    outcomes = measure._Outcomes()
    args = SimpleNamespace(requests=8, abandoned=2, clients=3, max_tokens=4)
    measure._send_all(client, args, outcomes)
    assert dict(outcomes.counts) == {"ok": 7, "error": 1, "abandoned": 2}
    assert outcomes.errors == ["RuntimeError: the server fell over"]


def test_the_single_request_comparison_reports_ratios_and_equality(pair, url, tmp_path, monkeypatch):
    """bench/serve.py's `single`: the real (tiny) server against a stand-in for `generate` that
    answers what the pair answers alone, in the same number of tokens."""
    from types import SimpleNamespace

    from specextend.bench import serve as measure

    data = tmp_path / "doc.jsonl"
    data.write_text(json.dumps({"text": DOC}) + "\n")
    settings = Settings(**{"max_new_tokens": 6, **SMALL}).resolved()

    def generate_once(doc, args):
        r = pair.generate(doc, settings=settings)
        return {"prefill_s": 2 * r.prefill_s + 1e-3, "decode_s": 2 * r.decode_s + 1e-3, "new_tokens": r.new_tokens,
                "prompt_tokens": r.prompt_tokens, "text": r.text}

    monkeypatch.setattr(measure, "_generate_once", generate_once)
    args = SimpleNamespace(data=str(data), index=0, rounds=2, max_tokens=6, url=url, start=None, generate_args="",
                           request_fields="{}", warm_rounds=0)
    out = measure.single(args)
    assert out["summary"]["rounds"] == 2 and out["summary"]["all_same_text"]
    assert out["summary"]["prefill_ratio"] > 0 and out["summary"]["decode_ratio"] > 0


def test_the_warm_single_request_comparison_decodes_both_sides_from_their_caches(pair, url, folders, monkeypatch):
    """bench/serve.py's `single --warm-rounds`: the real (tiny) server and a library pair of the
    same models, each answering from its own prefix cache after a first request fills it, the same
    text on both sides in every round."""
    from types import SimpleNamespace

    from specextend.bench import serve as measure

    own = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    own = Pair(replace(own.spec, eos_ids=()), own.target, own.draft)
    monkeypatch.setattr(measure, "_library", lambda args: (own, Settings(**{"max_new_tokens": 6, **SMALL}).resolved()))
    args = SimpleNamespace(max_tokens=6, start=None, url=url, request_fields="{}", warm_rounds=3)
    out = measure._warm_with_server(DOC, args)
    assert [r["round"] for r in out["rounds"]] == [0, 1, 2]
    assert out["summary"]["all_same_text"] and out["summary"]["all_cached"]
    assert out["summary"]["decode_ratio"] > 0 and own.prefix_cache is not None


def test_the_server_is_healthy_after_200_requests_and_abandoned_streams(pair, folders):
    """bench/serve.py's load run against the real (tiny) server: every request answered or
    abandoned, nothing left running or holding KV, and the server still answers."""
    from types import SimpleNamespace

    from specextend.bench import serve as measure

    with running(pair, folders, max_queue=256, method="ar") as u:
        outcomes = measure._Outcomes()
        args = SimpleNamespace(requests=200, abandoned=20, clients=8, max_tokens=2)
        measure._send_all(client(u), args, outcomes)
        assert dict(outcomes.counts) == {"ok": 200, "abandoned": 20}, outcomes.errors
        deadline = time.time() + 20
        while (h := http.get(f"{u}/health").json())["running"] or h["waiting"]:
            assert time.time() < deadline, h
            time.sleep(0.05)
        assert h["batch"]["kv_in_use_mb"] == 0 and h["completed"] >= 220
        assert client(u).completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].text is not None


def test_the_concurrent_measurement_summarises_streams(tmp_path):
    """bench/concurrent.py's figures from recorded streams: time to the last answer, tokens per
    second, chunk gaps, the gaps of running streams while a document prefills, equality to alone."""
    from specextend.bench import concurrent as cc

    def stream(i, sent, chunks, text, tokens, error=None):
        return cc.Stream(i, sent, chunks[0] if chunks else None, (chunks or [sent])[-1] + 0.1, chunks, text, tokens,
                         error)

    running = [stream(0, 0.0, [0.5, 1.0, 3.0, 3.5], "a", 4), stream(1, 0.0, [0.6, 1.1, 2.9], "b", 3)]
    doc, short = stream(2, 1.0, [4.0], "c", 1), stream(3, 2.0, [2.5], "d", 1)
    streams = [*running, doc, short]
    s = cc.summarise(streams)
    assert s["answered"] == 4 and s["tokens"] == 9 and abs(s["time_to_last_s"] - 4.1) < 1e-9
    d = cc.during(streams, (2, 2))
    assert d["short_ttft_s"] == 0.5 and d["document_ttft_s"] == 3.0
    assert d["running_gap_max_s"] == 2.0 and d["running_gaps"] == 5  # gaps ending within [1.0, 4.0]
    alone = [stream(0, 0, [1], "a", 4), stream(1, 0, [1], "x", 3), stream(2, 0, [1], "c", 1),
             stream(3, 0, [1], "d", 1, error="429")]
    assert cc.equal_to(alone, streams) == [True, False, True, None]
    result = {"scenario": "t", "serve_args": "", "prompt_tokens": [5] * 4, "max_tokens": [4] * 4,
              "servers": {k: {"summary": {**s, **d, "equal_to_alone": [True] * 4}, "streams":
                              [vars(x) for x in streams]} for k in ("ours", "llama")}}
    md = cc.table(result)
    assert "| ours |" in md and "4/4" in md and "ours / llama: time to last answer 1.00x" in md
    cc.plot(result, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
