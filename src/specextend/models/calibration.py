"""The text a q8 KV cache's key offsets are calibrated on (`Transformer.calibrate_key_offset`).

A q8 cache stores each key less one vector per layer and KV head, the keys' mean, so that the part
every key shares does not take a 32-value group's scale (runtime/kv_cache.py). The mean is the
model's, not a prompt's: it must be the same for every cache the model fills, so it comes from this
fixed text, read once at load. What the text holds matters little (another document's mean serves
as well as the prompt's own: docs/log/2026-12-kv-cache.md); it mixes prose, figures, a list and
code so that no one kind of input sets it. Changing it changes every q8 cache's bits (the prefix
cache's fingerprint names the offsets, so no KV written under another text is read back).

Measuring them is a prefill of the text (~540 tokens: 1.5-5 s a load for the default target), so
`calibrate` keeps them beside the model's derived weights, under a key of everything their bits
depend on: the text's tokens, the model's config and weight scheme, the kernels' arithmetic.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

if TYPE_CHECKING:
    from ..runtime.transformer import Transformer

CALIBRATION_TEXT = """\
The committee met on a grey Tuesday morning to review the third quarter's figures. Revenue had \
risen by 4.2 percent against the same period last year, mostly on the strength of the northern \
warehouses, while costs in transport grew faster than planned because two of the five trucks spent \
most of August in the repair shop. The chair opened by asking whether the new scheduling system had \
paid for itself yet. "Not yet," said the treasurer, "but the late deliveries fell from 61 to 23, and \
each one used to cost us a refund." Several members wanted to know how the savings were counted, and \
the answer took the rest of the hour.

Recommendations adopted at the meeting:
1. Replace the two oldest trucks before winter, within a budget of $180,000.
2. Publish delivery times on the website every month, with the method used to measure them.
3. Ask the auditors to check the refund figures for 2023 and 2024 before the annual report.

The river behind the old mill rises every spring when the snow melts in the hills. Children used to \
race paper boats from the bridge to the weir, and the winner was whoever's boat did not sink first. \
Nobody remembers when the mill stopped turning; the wheel is still there, green with moss, and the \
herons stand on it in the evening as if they owned the place.

def moving_average(values, width):
    \"\"\"The mean of each run of `width` consecutive values.\"\"\"
    if width <= 0 or width > len(values):
        raise ValueError("width must be between 1 and len(values)")
    total = sum(values[:width])
    out = [total / width]
    for i in range(width, len(values)):
        total += values[i] - values[i - width]
        out.append(total / width)
    return out

Question: a train leaves at 14:05 and arrives at 17:50; how long is the journey? Answer: three hours \
and forty-five minutes, or 225 minutes. If the train travels 300 kilometres, its average speed is 80 \
kilometres per hour.

Section 12(b) of the agreement provides that either party may end it with ninety days' written notice, \
provided that all outstanding invoices have been paid. The tenant argued that the notice sent on \
March 3 was valid; the landlord replied that an unpaid invoice of $2,415.60 made it void. The court \
found for the tenant, holding that a disputed amount is not an outstanding one within the meaning of \
the clause.
"""


def calibrate(model: Transformer, tokenizer: Any, folder: Path, scheme: str) -> None:
    """Give `model` (loaded from `folder` with weight `scheme`) its q8 cache's key offsets: read back
    when this model, config, scheme and arithmetic measured them before, else measured and kept."""
    from ..runtime.kernels import arithmetic_version
    from .loader import derived_path

    tokens = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)
    key = hashlib.sha256(repr((list(tokens), model.cfg, arithmetic_version())).encode()).hexdigest()[:16]
    path = derived_path(folder, f"{scheme}-key-offsets-{key}")
    stored = _read(path, len(model.layers))
    if stored is not None:
        try:
            model.set_key_offsets(stored)
            return
        except ValueError as e:
            print(f"specextend: measuring the key offsets again ({path.name}: {e})", file=sys.stderr)
    offsets = model.measure_key_offsets(tokens)  # None (nothing to keep) under soft caps or sinks
    model.set_key_offsets(offsets)
    if offsets is not None:
        _write(path, offsets)


def _read(path: Path, layers: int) -> list[torch.Tensor] | None:
    if not path.is_file():
        return None
    try:
        got = load_file(path)
        return [got[f"layer.{i}"] for i in range(layers)]
    except (SafetensorError, OSError, KeyError) as e:  # written atomically, so a bad one is another's
        print(f"specextend: measuring the key offsets again ({path.name}: {e})", file=sys.stderr)
        return None


def _write(path: Path, offsets: Sequence[torch.Tensor]) -> None:
    """Atomically (`qstore.save_tensors`); an unwritable cache measures again next time."""
    from .qstore import save_tensors

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tensors(path, {f"layer.{i}": o for i, o in enumerate(offsets)}, {})
    except OSError as e:
        print(f"specextend: could not keep the key offsets in {path}: {e.strerror}", file=sys.stderr)
