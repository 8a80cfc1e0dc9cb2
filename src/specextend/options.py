"""Command-line options shared by every command that loads models or takes generation settings:
`specextend generate`, `serve`, `bench`, `needle`, `demo`, and the tools under `bench/`.

One group of model options (`add_model_arguments`, read back by `model_options` as the keyword
arguments of `api.prepare`) and one of generation settings (`add_settings_arguments`, read back
by `settings_from_args`), so a flag means the same everywhere. Nothing heavy is imported here:
`specextend --help` builds its parsers from this module without torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import MISSING, fields
from types import MappingProxyType
from typing import Any

from .common.settings import (
    ATTENTIONS,
    DRAFT_CACHES,
    DRAFT_HORIZONS,
    DRAFT_PREFILLS,
    KV_CACHES,
    METHODS,
    POSITION_MODES,
    TREES,
    Settings,
    parse_assignments,
)

WEIGHTS_HELP = (
    "weight storage and kernels: auto (default: on a CPU with AVX2, AVX-512 or NEON and --dtype float32, a GGUF "
    "target keeps its own quantization grids, a float target is quantized to int8 and a draft to int4; "
    "else --dtype), "
    "gguf (the GGUF file's grids: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q3_K, Q2_K, IQ4_NL, IQ4_XS, MXFP4, "
    "IQ3_S, IQ3_XXS, IQ2_XXS, IQ1_S, IQ2_XS, IQ2_S, IQ1_M, TQ2_0, TQ1_0, F16, BF16), "
    "int8, int4, or float32|bfloat16|float16|float64"
)
DRAFT_DTYPE_HELP = ("the draft's dtype (default: float32 with quantized draft weights; else bfloat16 on a CPU "
                    "with native bf16 if --dtype is float32; else --dtype)")


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the contract's 'one clear line'), exit 2.
    `subcommands`: the subcommands' parsers by name, where the CLI has made them."""

    subcommands: Mapping[str, argparse.ArgumentParser] = MappingProxyType({})

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --------------------------------------------------------------------------- models


def add_model_arguments(p: argparse.ArgumentParser, draft_note: str = "", draft: bool = True) -> None:
    """The `models` option group every command that loads models shares (generate, bench, needle,
    demo, serve, the sweep; the runtime benchmark, which times the target alone, with `draft=False`)."""
    g = p.add_argument_group("models")
    g.add_argument("--target", help="target model: a .gguf file, a Hugging Face folder or a known name (`specextend "
                                     "models list`) (default: the default pair, pulled on first use)")
    if draft:
        g.add_argument("--draft", help="draft model, same forms as --target, with the target's tokenizer"
                                       f"{draft_note}")
    g.add_argument("--dtype", default="float32", help="float32|float64|bfloat16|float16 (default: float32)")
    if draft:
        g.add_argument("--draft-dtype", default=None, help=DRAFT_DTYPE_HELP)
    g.add_argument("--device", default="cpu", help="cpu|cuda[:N] (default: cpu)")
    g.add_argument("--weights", default="auto", help=WEIGHTS_HELP)
    if draft:
        g.add_argument("--draft-weights", default="auto", help="the draft's --weights (default: auto)")
    g.add_argument("--kv-cache", default="bf16",
                   help=f"the target's KV cache: {'|'.join(KV_CACHES)} (default: bf16); q8 stores int8 with a bfloat16 "
                        "scale per 32 values (keys less their mean, measured on a first load and kept), about half "
                        "the bytes a long context reads per decoded token (the quantized CPU kernels only)")
    g.add_argument("--max-context", type=int, default=None,
                   help="the longest sequence (prompt + answer) the models serve, in tokens, up to what the file "
                        "allows (default: the model's own; for LongRoPE models, Phi-3.5 and Phi-4-mini, its "
                        "original window: a longer --max-context takes its long factors, as llama.cpp's -c does)")


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of `api.prepare`/`api.load` from `add_model_arguments`'s flags."""
    return {"dtype": args.dtype, "device": args.device, "draft_dtype": getattr(args, "draft_dtype", None),
            "weights": args.weights, "draft_weights": getattr(args, "draft_weights", "auto"),
            "kv_cache": getattr(args, "kv_cache", "bf16"), "max_context": getattr(args, "max_context", None)}


def check_model_options(args: argparse.Namespace) -> None:
    """Refuse bad model options (UserError) before anything slow runs; `api.prepare` applies the
    same rule (`models.resolve.LoadOptions`)."""
    from .models.resolve import LoadOptions

    LoadOptions(**model_options(args))


# --------------------------------------------------------------------------- generation settings


def _default(name: str) -> Any:
    """A Settings field's default: the single source of truth for generate's defaults."""
    for f in fields(Settings):
        if f.name == name and f.default is not MISSING:
            return f.default
    raise KeyError(name)


def _opt(group: Any, flag: str, kind: type, help_text: str, **kw: Any) -> None:
    """An option mapping onto the Settings field of the same name; None means 'not given'."""
    name = flag.lstrip("-").replace("-", "_")
    default = kw.pop("shown_default", _default(name))
    group.add_argument(flag, type=kind, default=None, dest=name,
                       help=f"{help_text} (default: {default})", **kw)


def add_settings_arguments(p: argparse.ArgumentParser, labels: bool = True) -> None:
    """The generation settings' options (method, retrieval, tree, length and sampling), shared by
    `generate` and `serve` (where they are the defaults a request's body may override): the
    common ones first, then those that tune the method."""
    add_method_arguments(p, labels)
    add_tuning_arguments(p)


def add_method_arguments(p: argparse.ArgumentParser, labels: bool = True) -> None:
    """The settings most runs set: the method, the length of the answer and sampling."""
    method = p.add_argument_group("method")
    _opt(method, "--method", str, "specextend: the draft with Cross-model Retrieval, trees sized from measured "
         "step costs and prompt lookup; ar: the target alone; sd: plain speculative decoding (fixed draft tree, "
         "full draft cache); lookup: the target with prompt lookup alone, no draft model", choices=METHODS,
         metavar="|".join(METHODS))
    _opt(method, "--draft-cache", str, "draft KV policy, overrides the preset's", choices=DRAFT_CACHES,
         metavar="|".join(DRAFT_CACHES), shown_default="the preset's")
    _opt(method, "--attention", str, "attention backend, overrides the preset's", choices=ATTENTIONS,
         metavar="|".join(ATTENTIONS), shown_default="the preset's")

    sampling = p.add_argument_group("length and sampling")
    _opt(sampling, "--max-new-tokens", int, "tokens to generate at most")
    _opt(sampling, "--temperature", float, "0 is greedy")
    _opt(sampling, "--top-p", float, "nucleus sampling mass, in (0, 1]")
    _opt(sampling, "--seed", int, "sampling seed")
    _opt(sampling, "--frequency-penalty", float, "OpenAI's: minus this times a token's count in the output, in [-2, 2]")
    _opt(sampling, "--presence-penalty", float, "OpenAI's: minus this for a token already in the output, in [-2, 2]")
    _opt(sampling, "--repetition-penalty", float, "divides a positive logit (multiplies a negative one) of a token "
         "in the prompt or output; 1 is off")
    if labels:
        sampling.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                              help="a label recorded in the JSON's config for your own bookkeeping (read by "
                                   "nothing; every setting has its own option); repeatable")


def add_tuning_arguments(p: argparse.ArgumentParser) -> None:
    """The settings that tune a method: tree sizing and prompt lookup, retrieval, the draft tree."""
    sizing = p.add_argument_group("tree sizing and prompt lookup")
    sizing.add_argument("--cost-model", action=argparse.BooleanOptionalAction, default=None,
                        help="size each step's tree from the measured step costs, down to no tree (default: the "
                             "preset's: on for specextend and lookup)")
    sizing.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                        help="propose continuations of the context's earlier occurrences of its last tokens "
                             "(default: the preset's: on for specextend and lookup)")
    sizing.add_argument("--draft-gate", action=argparse.BooleanOptionalAction, default=None,
                        help="with the cost model, start the draft only once it is expected to repay the prompt "
                             f"KV it must compute (default: {_default('draft_gate')})")
    _opt(sizing, "--draft-horizon", str, "the answer's remaining length the start decision counts on: produced "
         "(as long again as it has run, capped by --max-new-tokens) or budget (to --max-new-tokens)",
         choices=DRAFT_HORIZONS, metavar="|".join(DRAFT_HORIZONS))
    _opt(sizing, "--lookup-ngram", int, "longest suffix matched against the context")
    _opt(sizing, "--lookup-branches", int, "distinct continuations proposed per step")
    _opt(sizing, "--lookup-length", int, "tokens per continuation")

    _add_retrieval_arguments(p)

    tree = p.add_argument_group("draft tree")
    _opt(tree, "--tree", str, "tree builder", choices=TREES, metavar="|".join(TREES))
    _opt(tree, "--tree-budget", int, "draft nodes verified per step (dynamic tree; with the cost model, at most)")
    _opt(tree, "--tree-depth", int, "longest draft path (with the cost model, at most)")
    _opt(tree, "--tree-topk", int, "children considered per expanded node")
    _opt(tree, "--tree-threshold", float, "stop growing below this best frontier path probability")
    _opt(tree, "--chain-length", int, "draft tokens per step (chain builder)")


def _add_retrieval_arguments(p: argparse.ArgumentParser) -> None:
    """Cross-model retrieval's options (the streaming cache uses its budget), and the draft's prompt KV."""
    cmr = p.add_argument_group("cross-model retrieval (draft cache cmr; streaming uses the budget)")
    _opt(cmr, "--chunk-size", int, "tokens per retrieval chunk")
    _opt(cmr, "--top-k-chunks", int, "chunks kept in the draft's working cache")
    _opt(cmr, "--retrieve-every", int, "refresh the retrieval every N steps")
    _opt(cmr, "--retrieval-layer", int, "target layer whose attention ranks chunks (-1: last)")
    _opt(cmr, "--retrieval-layers-mean", int, "average the scores of this many layers ending there")
    _opt(cmr, "--retrieval-query", str, "query rows: the last accepted token or the accepted path",
         choices=("last", "path"), metavar="last|path")
    cmr.add_argument("--adaptive-refresh", action=argparse.BooleanOptionalAction, default=None,
                     help=f"also refresh when acceptance drops (default: {_default('adaptive_refresh')})")
    _opt(cmr, "--chunk-overlap", int, "extend each chosen chunk by this many neighbour tokens")
    _opt(cmr, "--cmr-min-ratio", float, "select chunks only above this many budgets of context (0: always)")
    _opt(cmr, "--positions", str, "draft working-cache positions", choices=POSITION_MODES,
         metavar="|".join(POSITION_MODES))
    _opt(cmr, "--sink-tokens", int, "streaming cache: attention-sink tokens kept at the start")
    _opt(cmr, "--draft-prefill", str, "the draft's prompt KV: selected (what the draft cache reads, chunks "
         "computed when chosen) or full (the whole prompt)", choices=DRAFT_PREFILLS, metavar="|".join(DRAFT_PREFILLS))


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Resolved Settings from the options given (the rest keep Settings' defaults)."""
    names = [f.name for f in fields(Settings) if f.name != "labels"]
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    # Every setting has its own option here, so --set holds labels only.
    own_option = {name: f"the --{name.replace('_', '-')} option" for name in names}
    labels = parse_assignments(getattr(args, "set", []), "--set", refused=own_option, labels=True)
    return Settings(**given, labels=labels).resolved()
