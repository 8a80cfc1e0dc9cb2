"""`specextend serve --replicas 2` with an API key (from the environment): the front end checks it,
answers tool calls from the replicas, and its /metrics has each replica's gauges."""

from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_toolcalls import ASK, TOOLS, valid

pytest.importorskip("ray.serve", reason="needs the cluster extra (Ray Serve): pip install -e '.[cluster]'",
                    exc_type=ImportError)

from test_cluster import folders, replicas  # noqa: F401  (the fixture and the server)

pytestmark = pytest.mark.usefixtures("isolated_home")

KEY = "sk-cluster-key"


@pytest.mark.long
def test_replicas_check_keys_call_tools_and_export_metrics(folders, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPECEXTEND_API_KEY", KEY)
    with replicas(folders, tmp_path, "--max-new-tokens", "160") as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for key in (None, "sk-wrong"):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
            assert httpx.get(f"{url}/metrics", headers=headers).status_code == 401
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
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
        text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    running = [s for s in samples if s.name == "specextend_requests_running"]
    assert len(running) == 2 and all(s.labels["replica"] for s in running)
    assert next(s.value for s in samples if s.name == "specextend_generation_tokens_total") > 0
    assert next(s.value for s in samples if s.name == "specextend_requests_total"
                and s.labels == {"route": "/v1/models", "status": "401"}) == 2
