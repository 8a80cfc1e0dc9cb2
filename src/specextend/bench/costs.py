"""The step costs the tree sizing uses, per model of a pair: shown, or measured again.

    python -m specextend.bench.costs [--target REF] [--draft REF] [--attention efficient] [--remeasure]

Each model's curve (milliseconds of one forward, by new rows and cached tokens) comes from the
cost cache (`costmodel.cached_curve`), measured there first when absent; `--remeasure` replaces it.
"""

from __future__ import annotations

import argparse
import sys

from ..common.errors import UserError
from ..options import add_model_arguments, model_options
from ..runtime.costmodel import cache_dir, cached_curve, curve_key


def main(argv: list[str] | None = None) -> int:
    """`python -m specextend.bench.costs`: the pair's measured curves (milliseconds per forward)."""
    from .. import api

    ap = argparse.ArgumentParser(description="Show (or re-measure) the step costs the tree sizing uses.")
    add_model_arguments(ap)
    ap.add_argument("--attention", default="efficient", choices=("efficient", "eager"))
    ap.add_argument("--remeasure", action="store_true", help="measure again and replace the cached curves")
    a = ap.parse_args(argv)
    try:
        pair = api.load(a.target, a.draft, **model_options(a))
    except UserError as e:
        print(f"specextend costs: error: {e}", file=sys.stderr)
        return 2
    for name, model in (("target", pair.target), ("draft", pair.draft)):
        if model is None:
            continue
        curve = cached_curve(model, a.attention, remeasure=a.remeasure)
        print(f"{name}: {cache_dir() / (curve_key(model, a.attention) + '.json')}")
        print("  cached \\ rows " + "".join(f"{r:>8d}" for r in curve.rows))
        for ctx, line in zip(curve.contexts, curve.seconds, strict=True):
            print(f"  {ctx:>13d} " + "".join(f"{1000 * s:8.1f}" for s in line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
