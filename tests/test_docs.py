"""The documentation, checked against the code: the README's shape and its quick start run as
written (on tiny models), docs/cli.md equal to what the parsers generate, every command line in
README.md and docs/ accepted by today's parsers, and every relative link and anchor resolving."""

from __future__ import annotations

import difflib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specextend.cli import doc as clidoc
from specextend.cli import main as cli

from tiny_tokenizer import prose_tokenizer, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CLI_MD = ROOT / "docs" / "cli.md"
SERVING_MD = ROOT / "docs" / "serving.md"  # the document of the quick start
MAX_README_LINES = 250
README_SECTIONS = ["Quick start", "How fast", "Models", "Limitations", "Documentation"]


# --------------------------------------------------------------------------- markdown helpers


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, re.M | re.S)]


def section(text: str, title: str) -> str:
    """The body of the `## title` section."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"no section '## {title}'"
    return m.group(1)


def command_lines(body: str) -> list[str]:
    """The shell lines of a code block, continuation lines joined."""
    return [line.strip() for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    body = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for m in re.finditer(r"^#{1,6} (.+)$", body, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


# --------------------------------------------------------------------------- the README's shape


def test_readme_is_short_starts_with_the_two_commands_and_keeps_its_order():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    first = fenced_blocks(text)[0][1].splitlines()
    assert [line.split("#")[0].strip() for line in first] == ["make demo", "make test"]
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == README_SECTIONS


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for doc in [README, *DOCS]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert broken == []


# --------------------------------------------------------------------------- cli.md and the parsers


def test_cli_md_is_what_the_parsers_generate():
    document = CLI_MD.read_text()
    expected = clidoc.splice(document, clidoc.render())
    if document != expected:
        diff = "\n".join(list(difflib.unified_diff(document.splitlines(), expected.splitlines(), "docs/cli.md",
                                                   "generated", lineterm=""))[:40])
        pytest.fail(f"docs/cli.md disagrees with the argparse parsers: run `{clidoc.REGENERATE}` and commit "
                    f"docs/cli.md\n{diff}")


def test_every_bench_tool_is_in_the_reference():
    tools = {f"specextend.bench.{p.stem}" for p in (ROOT / "src" / "specextend" / "bench").glob("*.py")
             if re.search(r"^def main\(", p.read_text(), re.M)}
    tools -= {module for module, _ in cli.DELEGATED.values()}  # `specextend needle` and the like: commands
    assert tools - set(clidoc.TOOLS) == set(), f"add the tool to clidoc.TOOLS and run `{clidoc.REGENERATE}`"


def test_the_generator_refuses_a_file_without_its_markers(tmp_path, capsys):
    f = tmp_path / "cli.md"
    f.write_text("# no markers\n")
    assert clidoc.main([str(f)]) == 2
    assert "no generated part" in capsys.readouterr().err


def documented_commands() -> list[tuple[str, str]]:
    """(file, line) of every `specextend ...` and `python -m specextend...` line in a code block."""
    out = []
    for doc in [README, *DOCS]:
        for _, body in fenced_blocks(doc.read_text()):
            for line in command_lines(body):
                m = re.match(r"(?:[A-Z_]+=\S+ +)*(?:\.venv/bin/)?((?:specextend|python -m specextend)\b.*)", line)
                if m:  # SPECEXTEND_CPU=avx2 specextend ... is the command after the assignment
                    out.append((doc.name, m.group(1)))
    return out


@pytest.mark.parametrize(("doc", "line"), documented_commands())
def test_documented_command_lines_parse(doc, line):
    """A flag renamed or removed in the code shows up here, wherever the docs still use it."""
    words = [w for w in shlex.split(line, comments=True) if w not in ("&", "|")]
    words = words[:next((i for i, w in enumerate(words) if w.startswith(">")), len(words))]
    if words[0] == "specextend":
        argv = words[1:]
        try:
            cli.build_parser(cli._command_of(argv)).parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{doc}: `{line}` is refused by today's parser (exit {e.code})")
    else:  # python -m specextend.bench.TOOL: every option it uses is in the tool's --help
        module, args = words[2], words[3:]
        argvs = clidoc.TOOLS[module]
        sub = [a for a in args if [a] in argvs]
        known = clidoc.tool_help(module, sub)
        flags = [a.split("=")[0] for a in args if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", a)]
        unknown = [f for f in flags if not re.search(rf"{re.escape(f)}\b", known)]
        assert unknown == [], f"{doc}: `{line}` uses options `{module}` does not have"


# --------------------------------------------------------------------------- the quick start, run


@pytest.fixture(scope="module")
def long_models(tmp_path_factory) -> list[str]:
    """Tiny models whose context holds docs/serving.md, and the flags that select them."""
    root = tmp_path_factory.mktemp("readme")
    tok = prose_tokenizer([p.read_text() for p in [README, *DOCS]])
    shape = dict(vocab=len(tok), tokenizer=tok, max_position_embeddings=16384)
    # serving.md (36K tokens of single bytes) must fit the tiny models' context with its chat template and
    # an answer; the prose tokenizer is learned from all the docs, so any docs edit moves this count a little
    assert len(tok(SERVING_MD.read_text())["input_ids"]) < 14000
    target = save_tiny_model(root / "target", seed=0, **shape)
    draft = save_tiny_model(root / "draft", seed=1, layers=1, **shape)
    return ["--target", str(target), "--draft", str(draft), "--dtype", "float64"]


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)  # `specextend` and `python` of this venv, as after `activate`
    return {**os.environ, "SPECEXTEND_HOME": str(tmp_path / "home"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def quick_start() -> str:
    return section(README.read_text(), "Quick start")


def quick_start_lines(starts: str) -> list[list[str]]:
    return [shlex.split(line, comments=True) for lang, body in fenced_blocks(quick_start()) if lang == "bash"
            for line in command_lines(body) if line.startswith(starts)]


def test_every_quick_start_line_is_one_the_tests_run():
    lines = [line for lang, body in fenced_blocks(quick_start()) if lang == "bash" for line in command_lines(body)]
    handled = ("source .venv/bin/activate", "specextend generate ", "specextend serve", "python examples/")
    assert [line for line in lines if not line.startswith(handled)] == []


@pytest.mark.long
def test_quick_start_command_line(long_models, env):
    """Each `specextend generate` line as written, on tiny models; the default method's text is
    the target's alone (`--method ar`), as the README says."""
    outs = []
    for words in quick_start_lines("specextend generate"):
        r = subprocess.run([*words, *long_models, "--max-new-tokens", "6"], capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=300, check=False)
        assert r.returncode == 0, (words, r.stderr)
        outs.append((words, r.stdout))
    assert len(outs) == 3
    assert outs[0][1] == outs[1][1] and "--method" in outs[1][0]  # specextend's text = ar's
    assert outs[2][1].lstrip().startswith("{")  # --json: one object


def test_quick_start_python_api(long_models, monkeypatch, capsys, isolated_home):
    """The README's Python block, executed as written with `specextend.load()` giving the tiny pair."""
    import specextend
    from specextend.api import load

    code = [body for lang, body in fenced_blocks(quick_start()) if lang == "python"]
    assert len(code) == 1
    target, draft = long_models[1], long_models[3]
    monkeypatch.setattr(specextend, "load", lambda *a, **k: load(target, draft, dtype="float64", progress=False))
    monkeypatch.chdir(ROOT)
    exec(compile(code[0], "README.md", "exec"), {"__name__": "readme"})
    cached = [int(n) for n in re.findall(r"\((\d+) prompt tokens from the cache\)", capsys.readouterr().out)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0


def test_quick_start_server(long_models, env):
    """`specextend serve &` (on tiny models and a free port), then the example line against it."""
    (serve,), (example,) = quick_start_lines("specextend serve"), quick_start_lines("python examples/")
    serve = [w for w in serve if w != "&"]
    proc = subprocess.Popen([*serve, *long_models, "--port", "0", "-q"], env=env, cwd=ROOT,
                            stderr=subprocess.PIPE, text=True)
    try:
        m = re.search(r"(http://127\.0\.0\.1:\d+/v1)", proc.stderr.readline())
        assert m, "the server did not say where it listens"
        r = subprocess.run([*example, "--base-url", m.group(1), "--max-tokens", "6"], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=300, check=False)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert r.returncode == 0, r.stderr
    cached = [int(n) for n in re.findall(r"(\d+) of them from the cache", r.stdout)]
    assert len(cached) == 2 and cached[0] == 0 and cached[1] > 0
