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
    """Pair keeps its SpecEngine private and the batch module builds the batched one: every other
    module goes through prefill/decode/remember or runs a Generation on the engine it is handed."""
    found = []
    for path in python_files():
        if path.name in ("api.py", "batching.py") and path.parent == SRC:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("_engine", "engine"):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert found == []


@pytest.mark.parametrize("code", [
    "import specextend.cli",
    "from specextend.cli import build_parser; build_parser('generate').parse_args(['generate', '--prompt', 'x'])",
])
def test_the_command_line_parser_needs_no_torch(code):
    """`specextend --help` and argument parsing answer without importing torch or transformers."""
    check = f"{code}; import sys; heavy = {{'torch', 'transformers'}} & set(sys.modules); assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", check], check=True, timeout=60)


def test_every_draft_cache_name_has_its_policy():
    from specextend.draft_policy import DRAFT_POLICIES
    from specextend.settings import DRAFT_CACHES

    assert tuple(DRAFT_POLICIES) == DRAFT_CACHES


def test_the_production_kernels_do_not_carry_the_peak_probes():
    """The roofline's register-only loops are an extension of their own (roofline.probes): the
    kernels every generation loads are built without them."""
    from specextend import kernels, roofline

    assert not any("peak" in name for name in kernels._SOURCES)
    assert {"peak_ops.cpp", "core/peak.cpp"} <= set(roofline.PROBE_SOURCES)
    assert kernels.build_dir(roofline.PROBE_SOURCES) != kernels.build_dir()
