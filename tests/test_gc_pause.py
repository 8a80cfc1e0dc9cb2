"""The collector pause around loads: off inside, restored after (errors included), never turned on
when the caller had turned it off."""

from __future__ import annotations

import gc

import pytest

from specextend.common.gc_pause import collector_paused


@pytest.fixture(autouse=True)
def _collector_restored():
    was = gc.isenabled()
    yield
    gc.enable() if was else gc.disable()


def test_paused_inside_and_restored_after():
    gc.enable()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # an inner block leaves the outer one's pause alone
    assert gc.isenabled()


def test_restored_after_an_error():
    gc.enable()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("load failed")
    assert gc.isenabled()


def test_a_collector_turned_off_stays_off():
    gc.disable()
    with collector_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_tokenizer_load_runs_with_the_collector_paused(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from specextend.models import resolve

    seen = []
    monkeypatch.setattr(resolve, "load_tokenizer", lambda folder: seen.append(gc.isenabled()))
    gc.enable()
    spec = resolve.ResolvedPair(SimpleNamespace(path=tmp_path), None, "cpu", None, ())
    spec.with_own_tokenizer()
    assert seen == [False] and gc.isenabled()
