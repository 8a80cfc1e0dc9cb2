"""SpecExtend: fast speculative decoding on long inputs for Llama-family model pairs.

`import specextend` stays cheap (no torch, no transformers): `load`, `Pair`, `Result` and
`Settings` are imported on first use.

The package by layer, each importing only from those below it (pyproject.toml's import contracts):
`cli` > `serve`, `bench` > `api`, `options` > `batching` > `requests` > `speculation`, `models` >
`runtime`, `sampling` > `common`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Pair", "Result", "Settings", "UserError", "load"]

if TYPE_CHECKING:
    from .api import Pair, Result, load
    from .common.errors import UserError
    from .common.settings import Settings

_LAZY = {
    "load": "api",
    "Pair": "api",
    "Result": "api",
    "Settings": "common.settings",
    "UserError": "common.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
