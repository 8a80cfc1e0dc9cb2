"""HTTP to the tests' own loopback servers, every client sharing one SSL context.

httpx builds a fresh SSL context for each client (reading the CA bundle: ~20 ms of CPU) and its
`get`/`post` make a client a call, so the suite's polling loops spent CPU seconds on certificates
that a plain `http://` request to 127.0.0.1 never uses. Same calls and defaults as httpx's."""

from __future__ import annotations

import ssl
from typing import Any

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

HTTPError = httpx.HTTPError
CONTEXT = ssl.create_default_context()


def Client(**kw: Any) -> httpx.Client:
    kw.setdefault("verify", CONTEXT)
    return httpx.Client(**kw)


def request(method: str, url: str, **kw: Any) -> httpx.Response:
    kw.setdefault("verify", CONTEXT)
    return httpx.request(method, url, **kw)


def get(url: str, **kw: Any) -> httpx.Response:
    return request("GET", url, **kw)


def post(url: str, **kw: Any) -> httpx.Response:
    return request("POST", url, **kw)


def stream(method: str, url: str, **kw: Any):
    kw.setdefault("verify", CONTEXT)
    return httpx.stream(method, url, **kw)


def cancelled(url: str) -> float:
    """/metrics' count of generations that ended cancelled."""
    text = get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "specextend_generations_total" and s.labels.get("finish_reason") == "cancelled")
