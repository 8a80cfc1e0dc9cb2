"""Showing the wait: a prefill reports its progress chunk by chunk (`on_progress`), a cached prefix
counting as done; `progress.Bar` draws it on stderr only once it has taken a while; the "loaded"
line counts the whole wait."""

from __future__ import annotations

import io
from dataclasses import replace

import pytest

from specextend.api import Pair, prepare
from specextend.common import progress

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    target = save_tiny_model(root / "target", seed=0, max_position_embeddings=2048)
    p = prepare(target, None, dtype="float64", load_draft=False, progress=False).load()
    return Pair(replace(p.spec, eos_ids=()), p.target, p.draft)


def test_a_long_prefill_reports_each_chunk_and_a_cached_prefix_counts_as_done(pair):
    prompt = [5 + i % 200 for i in range(1300)]  # 1300 tokens: three chunks of the prefill
    heard: list[tuple[int, int]] = []
    pair.generate(prompt, method="ar", max_new_tokens=2, on_progress=lambda d, t: heard.append((d, t)))
    assert heard == [(512, 1300), (1024, 1300), (1300, 1300)]
    pair.enable_prefix_cache(64)
    try:
        pair.generate(prompt, method="ar", max_new_tokens=2)
        heard.clear()
        pair.generate([*prompt, 7, 8], method="ar", max_new_tokens=2, on_progress=lambda d, t: heard.append((d, t)))
        assert heard and heard[0][0] > 1000 and heard[-1] == (1302, 1302)  # only the rest was prefilled
    finally:
        pair.prefix_cache = None


def test_the_bar_shows_only_a_slow_prefill(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    quick = progress.Bar("prefill")
    for done in (512, 1024, 1300):
        quick(done, 1300)
    assert err.getvalue() == ""  # done within BAR_DELAY_S: nothing drawn
    monkeypatch.setattr(progress, "BAR_DELAY_S", 0.0)
    slow = progress.Bar("prefill")
    slow(512, 1300)
    assert "specextend: prefill" in err.getvalue() and "/1300" in err.getvalue()
    slow(1300, 1300)  # done: the bar closes
    silent = progress.Bar("prefill", progress=False)
    before = err.getvalue()
    silent(1, 2)
    assert err.getvalue() == before


def test_the_loaded_line_counts_the_whole_wait(pair, capsys):
    spec = replace(pair.spec, asked_at=pair.spec.asked_at - 30.0)  # as if resolving had taken 30 s
    spec.load(progress=True)
    line = capsys.readouterr().err
    waited = float(line.split(" in ")[1].split(" s")[0])
    assert waited >= 30.0 and "reading the weights" in line
