"""The package's shape, checked: what `lint-imports` cannot see (the import layers themselves are
its contracts in pyproject.toml, run by `make test`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "specextend"
MAX_FUNCTION_LINES = 60


def python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def test_the_package_root_holds_the_api_and_the_layers():
    """At most six modules at the root (the API, the options, the package's face); everything else
    lives in its layer's folder, each folder a package that says what it holds."""
    root = sorted(p.name for p in SRC.glob("*.py"))
    assert len(root) <= 6, root
    for folder in (p for p in SRC.iterdir() if p.is_dir() and not p.name.startswith("__")):
        if any(folder.glob("*.py")):
            init = folder / "__init__.py"
            assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), f"{folder.name}/ says nothing"


def test_no_two_modules_of_a_layer_differ_by_a_suffix():
    """`batch.py` beside `batching.py` read as one job told twice: names say what differs."""
    clashes = []
    for folder in {p.parent for p in python_files()}:
        stems = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("__"))
        clashes += [f"{folder.name}/{a} ~ {b}" for a in stems for b in stems if a != b and b.startswith(a)
                    and b[len(a):] in ("s", "es", "ing", "er", "ed")]
    assert clashes == []


def test_no_function_is_longer_than_60_lines():
    long = []
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_only_the_api_drives_a_pairs_engine():
    """Pair keeps its SpecEngine private and the batch runner builds the batched one: every other
    module goes through prefill/decode/remember or runs a Generation on the engine it is handed."""
    found = []
    for path in python_files():
        if path.relative_to(SRC).as_posix() in ("api.py", "batching/runner.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_engine", "engine"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


@pytest.mark.parametrize("code", [
    "import specextend.cli.main",
    "from specextend.cli.main import build_parser; build_parser('generate').parse_args(['generate', '--prompt', 'x'])",
])
def test_the_command_line_parser_needs_no_torch(code):
    """`specextend --help` and argument parsing answer without importing torch or transformers."""
    check = f"{code}; import sys; heavy = {{'torch', 'transformers'}} & set(sys.modules); assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


def test_every_draft_cache_name_has_its_policy():
    from specextend.common.settings import DRAFT_CACHES
    from specextend.speculation.draft_policy import DRAFT_POLICIES

    assert tuple(DRAFT_POLICIES) == DRAFT_CACHES


def test_the_production_kernels_do_not_carry_the_peak_probes():
    """The roofline's register-only loops are a library of their own (roofline.probes): the
    kernels every generation loads are built without them."""
    from specextend.bench import roofline
    from specextend.runtime import kernels

    assert not any("peak" in name for name in kernels._SOURCES)
    assert {"peak_lib.cpp", "core/peak.cpp"} <= set(roofline.PROBE_SOURCES)
    assert kernels.build_dir(roofline.PROBE_SOURCES) != kernels.build_dir()


@pytest.mark.parametrize("contract", ["layers", "acyclic"])
def test_the_contracts_catch_an_import_made_only_for_type_checking(tmp_path, contract):
    """A `TYPE_CHECKING` import from the runtime back up into the server (a type-only circle, as
    four were before the layout) breaks both the layer and the cycle contract: lint-imports counts
    type-only imports, so no circle can hide behind one."""
    import shutil

    lint = Path(sys.executable).with_name("lint-imports")
    copy = tmp_path / "src" / "specextend"
    shutil.copytree(SRC, copy, ignore=shutil.ignore_patterns("__pycache__", "csrc", "static"))
    config = copy / "runtime" / "config.py"
    config.write_text(config.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                      "    from ..serve.app import Server  # noqa: F401\n")
    pyproject = (SRC.parents[1] / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(pyproject)
    out = subprocess.run([str(lint), "--no-cache", "--contract", contract], cwd=tmp_path, capture_output=True,
                         text=True, env={"PYTHONPATH": str(tmp_path / "src"), "PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "BROKEN" in out.stdout.upper(), out.stdout + out.stderr
    if contract == "layers":
        assert "specextend.runtime.config" in out.stdout
    else:  # the copy differs from the (kept) package by this import alone; the report names a heuristic's
        # smallest set of package edges to cut, five of them in sorted order, which need not show this one
        assert "No cycles are allowed in specextend." in out.stdout
