"""What operators need from `specextend serve`: API keys (401 before any model work, /health open,
streaming included) and `GET /metrics` (Prometheus text that parses, counters that move)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specextend.api import Pair, load
from specextend.common.errors import UserError
from specextend.serve import auth

import loopback as http
from test_serve import SMALL, client, running
from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")

KEYS = ("sk-first-key", "sk-second-key")
CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, **SMALL}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-ops")
    return {"target": save_tiny_model(root / "target", seed=0),
            "draft": save_tiny_model(root / "draft", seed=1, layers=1)}


@pytest.fixture(scope="module")
def pair(folders):
    p = load(folders["target"], folders["draft"], dtype="float64", progress=False)
    p = Pair(replace(p.spec, eos_ids=()), p.target, p.draft)  # no end token: every answer runs to its length
    p.step_costs()  # measured here, not in the server's start (which a test waits for with a deadline)
    return p


@pytest.fixture(scope="module")
def keyed(pair, folders):
    with running(pair, folders, api_keys=KEYS) as u:
        yield u


def settled(url: str, seconds: float = 30) -> dict:
    """/health once nothing runs or waits: a request's answer can reach its client before the step that ends it."""
    deadline = time.monotonic() + seconds
    while True:
        health = http.get(f"{url}/health").json()
        if (health["running"], health["waiting"]) == (0, 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.02)


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


ROUTES = [("POST", "/v1/chat/completions", CHAT), ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 4}),
          ("GET", "/v1/models", None), ("GET", "/metrics", None)]


# --------------------------------------------------------------------------- API keys


@pytest.mark.parametrize(("method", "path", "body"), ROUTES, ids=[r[1] for r in ROUTES])
def test_no_key_and_a_wrong_key_get_401_a_right_key_200(keyed, method, path, body):
    for key, status in ((None, 401), ("sk-wrong", 401), ("", 401), (KEYS[0], 200), (KEYS[1], 200)):
        r = http.request(method, f"{keyed}{path}", json=body, headers=bearer(key) if key != "" else
                          {"Authorization": "Basic abc"}, timeout=60)
        assert r.status_code == status, (key, r.text)
        if status == 401:
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert r.headers["www-authenticate"] == "Bearer"
            assert "sk-" not in r.text  # neither the key sent nor the ones expected are echoed


def test_health_stays_open(keyed):
    assert http.get(f"{keyed}/health").status_code == 200


def test_streaming_needs_the_key_too(keyed):
    body = {**CHAT, "stream": True}
    for key, status in ((None, 401), ("sk-wrong", 401), (KEYS[1], 200)):
        with http.stream("POST", f"{keyed}/v1/chat/completions", json=body, headers=bearer(key), timeout=60) as r:
            text = "".join(r.iter_text())
            assert r.status_code == status
            assert (text.rstrip().endswith("data: [DONE]")) == (status == 200)


def test_the_openai_client_sees_an_authentication_error(keyed):
    wrong = openai.OpenAI(base_url=f"{keyed}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        wrong.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    right = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEYS[0], max_retries=0, timeout=60)
    assert right.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4).choices


def test_many_wrong_key_requests_cost_no_model_work(keyed):
    """Counted, not timed: neither the scheduler nor the metrics see a generation for them."""
    health = settled(keyed)  # the last test's answer reached its client a step before the scheduler counted it
    before = (health["completed"], health["batch"]["steps"], scrape(keyed, KEYS[0])["specextend_prompt_tokens_total"])
    with http.Client(timeout=60) as h:
        for i in range(200):
            r = h.post(f"{keyed}/v1/chat/completions", json={**CHAT, "stream": i % 2 == 0},
                       headers=bearer(f"sk-wrong-{i}"))
            assert r.status_code == 401
    health = http.get(f"{keyed}/health").json()
    after = (health["completed"], health["batch"]["steps"], scrape(keyed, KEYS[0])["specextend_prompt_tokens_total"])
    assert after == before
    assert scrape(keyed, KEYS[0])['specextend_requests_total{route="/v1/chat/completions",status="401"}'] >= 200


class _App:
    """A fake app behind the middleware: counts the requests that reach it."""

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def _call(mw: auth.RequireKey, path: str, headers: list[tuple[bytes, bytes]]) -> int:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(mw({"type": "http", "path": path, "method": "POST", "headers": headers}, receive, send))
    return sent[0]["status"]


def test_the_middleware_lets_through_only_a_listed_key_and_health():
    app = _App()
    mw = auth.RequireKey(app, KEYS)
    for i in range(1000):
        assert _call(mw, "/v1/completions", [(b"authorization", f"Bearer sk-{i}".encode())]) == 401
    assert _call(mw, "/v1/completions", []) == 401
    assert _call(mw, "/v1/completions", [(b"authorization", b"sk-first-key")]) == 401  # no scheme
    assert app.calls == 0
    assert _call(mw, "/v1/completions", [(b"authorization", b"bearer  sk-second-key ")]) == 200
    assert _call(mw, "/health", []) == 200
    assert app.calls == 2


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# ops keys\nsk-file-1\n\nsk-file-2\n")
    keys = auth.load_keys(["sk-flag"], str(f), {auth.ENV: "sk-env-1, sk-env-2,sk-flag"})
    assert keys == ("sk-flag", "sk-file-1", "sk-file-2", "sk-env-1", "sk-env-2")
    assert auth.load_keys(None, None, {}) == ()
    assert auth.middleware(()) == []
    for flags, file, message in ((["has space"], None, "whitespace"), ([], str(tmp_path / "none"), "cannot read"),
                                 ([], str(tmp_path / "empty"), "no key")):
        (tmp_path / "empty").write_text("# nothing\n")
        with pytest.raises(UserError, match=message) as e:
            auth.load_keys(flags, file, {})
        assert "has space" not in str(e.value)


# --------------------------------------------------------------------------- /metrics


def scrape(url: str, key: str | None = None) -> dict[str, float]:
    r = http.get(f"{url}/metrics", headers=bearer(key))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape_when_idle(url: str, within_s: float = 10.0) -> dict[str, float]:
    """The metrics once the last request has left the batch: a stream's last chunk reaches the client
    before the scheduler frees its sequence, so a scrape at once may still count its KV."""
    deadline = time.monotonic() + within_s
    while True:
        m = scrape(url)
        if (m["specextend_requests_running"] == 0 and m["specextend_kv_cache_used_bytes"] == 0) or \
                time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_metrics_parse_and_move_as_requests_are_served(pair, folders):
    with running(pair, folders) as u:
        m0 = scrape(u)
        assert m0["specextend_requests_running"] == 0 and m0["specextend_generation_tokens_total"] == 0
        c = client(u)
        doc = "The report covers the budget of the agency. " * 4
        for q in ("Who?", "When?"):  # the second reuses the first's prefill
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"{doc}{q}"}],
                                      max_tokens=8,  # the draft runs whatever this machine's cost model says
                                      extra_body={"method": "specextend", "draft_gate": False, "cost_model": False,
                                                  **SMALL})
        chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=8, stream=True, extra_body={"method": "sd"}))
        assert chunks
        http.post(f"{u}/v1/completions", json={"prompt": "hi", "max_tokens": 0})  # a 400
        m = scrape_when_idle(u)
    assert m['specextend_requests_total{route="/v1/chat/completions",status="200"}'] == 3
    assert m['specextend_requests_total{route="/v1/completions",status="400"}'] == 1
    assert m['specextend_generations_total{finish_reason="length"}'] == 3
    assert m["specextend_generation_tokens_total"] == 24
    assert m["specextend_prompt_tokens_total"] > m["specextend_cached_prompt_tokens_total"] > 0
    assert m["specextend_time_to_first_token_seconds_count"] == 3
    assert m["specextend_inter_token_latency_seconds_count"] >= 3
    assert m["specextend_request_duration_seconds_count"] == 3
    assert m["specextend_accepted_tokens_per_step_count"] > 0
    assert m['specextend_decode_steps_total{draft="ran"}'] > 0
    assert m["specextend_prefix_cache_hits_total"] >= 1 and m["specextend_prefix_cache_entries"] >= 1
    assert m["specextend_prefix_cache_max_bytes"] == 64 << 20
    assert m["specextend_kv_cache_used_bytes"] == 0 and m["specextend_kv_cache_budget_bytes"] > 0
    assert m["specextend_batch_steps_total"] > 0


def test_metrics_of_a_front_end_come_per_replica():
    from specextend.serve.metrics import ServerMetrics

    body = {"replicas": [{"replica": "a", "running": 1, "waiting": 0, "batch": {"kv_in_use_mb": 2.0},
                          "prefix_cache": {"hits": 3}}, {"replica": "b", "running": 0, "waiting": 2}]}
    text = __import__("prometheus_client").generate_latest(ServerMetrics(lambda: body).registry).decode()
    samples = {(s.name, json.dumps(s.labels, sort_keys=True)): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("specextend_requests_running", '{"replica": "a"}')] == 1
    assert samples[("specextend_requests_waiting", '{"replica": "b"}')] == 2
    assert samples[("specextend_kv_cache_used_bytes", '{"replica": "a"}')] == 2 * 2**20
    assert samples[("specextend_prefix_cache_hits_total", '{"replica": "a"}')] == 3
