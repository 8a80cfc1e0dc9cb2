"""`specextend demo` end to end on tiny random models, and its marked streaming."""

from __future__ import annotations

import argparse
import io
from dataclasses import replace

import pytest

from specextend.cli import demo
from specextend.common.errors import UserError

from tiny_tokenizer import save_tiny_model

pytestmark = pytest.mark.usefixtures("isolated_home")  # conftest.py: a model cache of its own


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    return p.parse_args(list(argv))


def test_demo_runs_end_to_end(tmp_path, capsys, monkeypatch):
    target = save_tiny_model(tmp_path / "target", seed=0)
    # The target drafts for itself, so draft tokens are accepted and visibly marked. The draft
    # starts at once and its tree is fixed: for 8 tokens the cost model would rightly never start
    # a draft as costly as the target, and on a loaded machine it may size every tree to one row
    # (tests/test_draft_prefill.py and tests/test_sizing.py test those decisions).
    chosen = demo._settings
    monkeypatch.setattr(demo, "_settings", lambda a: {k: replace(v, draft_gate=False, cost_model=False)
                                                      for k, v in chosen(a).items()})
    args = parse("--target", str(target), "--draft", str(target), "--length", "160", "--max-new-tokens", "8",
                 "--no-color")
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert "argparse.py" in out and "prefill:" in out
    assert "[" in out.replace("[brackets]", "") and "\033[" not in out
    table = out[out.index("method "):].splitlines()
    assert [line.split()[0] for line in table[2:5]] == ["ar", "sd", "specextend"]
    for line in table[2:5]:
        cells = line.split()
        assert cells[1] == "8" and cells[8] == "yes"  # 8 new tokens each, equal to ar's
        assert float(cells[5]) >= float(cells[4]) >= 0  # total s = prefill s + decode s
    assert float(table[4].split()[7]) > 0  # specextend accepted draft tokens


def test_demo_refuses_bad_input_before_loading(tmp_path):
    with pytest.raises(UserError, match="positive"):
        demo.run(parse("--max-new-tokens", "0"))
    with pytest.raises(UserError, match="bad length"):
        demo.run(parse("--length", "two", "--target", str(tmp_path)))


def _decode(ids: list[int]) -> str:
    # Token 9 is the first half of a two-token character: it decodes to U+FFFD until 10 follows.
    text = ""
    for i, t in enumerate(ids):
        if t == 9:
            text += "é" if i + 1 < len(ids) and ids[i + 1] == 10 else "\ufffd"
        elif t == 11:
            text += "\n"
        elif t != 10:
            text += chr(ord("a") + t)
    return text


@pytest.mark.parametrize("color", [False, True])
def test_marked_stream_marks_draft_text(color):
    out = io.StringIO()
    s = demo.MarkedStream(_decode, out, color)
    s.push([0])  # the first token comes from the prefill: the target's own
    s.push([1, 2, 3])  # two accepted draft tokens + the target's token
    s.push([9, 10])  # a character split across a draft token and the target's token
    s.finish()
    text = out.getvalue()
    if color:
        assert text == f"a{demo.GREEN}bc{demo.RESET}dé\n"
    else:
        assert text == "a[bc]dé\n"
    assert s.draft_tokens == 3


@pytest.mark.parametrize("color", [False, True])
def test_marked_stream_closes_marks_before_a_line_break(color):
    """Accepted proposed text across a line break is marked line by line: a bracket (or colour)
    opened on one line never closes on the next."""
    out = io.StringIO()
    s = demo.MarkedStream(_decode, out, color)
    s.push([0])
    s.push([1, 11, 2, 3])  # accepted "b", "\n", "c", then the target's own "d"
    s.push([11, 4, 5])  # accepted "\n" (nothing to mark on either side) and "e", the target's "f"
    s.finish()
    g, r = demo.GREEN, demo.RESET
    assert out.getvalue() == (f"a{g}b{r}\n{g}c{r}d\n{g}e{r}f\n" if color else "a[b]\n[c]d\n[e]f\n")
