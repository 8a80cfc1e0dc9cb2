"""`specextend` on the command line: generate, models, and (delegated) bench, needle and demo.

Exit status (the contract): 0 success; 2 bad input or settings, one line on stderr and no
traceback; 1 an unexpected internal error; 130 interrupted. Heavy imports (torch,
transformers) happen inside the commands so `specextend --help` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TextIO

from .draft_policy import DRAFT_POLICIES
from .errors import UserError
from .jsonl import text_at
from .models.loader import add_model_arguments, model_options
from .settings import ATTENTIONS, METHODS, POSITION_MODES, TREES, Settings, parse_assignments

PROG = "specextend"
DEBUG_ENV = "SPECEXTEND_DEBUG"

# Commands implemented elsewhere: module, one-line help. Imported only when run.
DELEGATED: dict[str, tuple[str, str]] = {
    "bench": ("specextend.bench.runner", "time methods over a data set; writes results.jsonl, summary.md"),
    "needle": ("specextend.needle", "draft-only needle retrieval accuracy per draft cache policy"),
    "demo": ("specextend.demo", "the side-by-side demonstration that `make demo` runs"),
    "serve": ("specextend.serve.command", "an OpenAI-compatible HTTP server that keeps long prompts prefilled"),
}


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the contract's 'one clear line'), exit 2."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, draft_note=" (unused with --method ar)")

    prompt = p.add_argument_group("prompt (exactly one source)")
    src = prompt.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    src.add_argument("--jsonl", help="read the prompt from field `text` of a JSONL record (see --index)")
    prompt.add_argument("--index", type=int, default=None, help="0-based record of --jsonl (default: 0)")
    prompt.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")

    add_settings_arguments(p)

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object (the contract's fields) to stdout")
    out.add_argument("-q", "--quiet", action="store_true", help="no loading messages or summary on stderr")


def add_settings_arguments(p: argparse.ArgumentParser, labels: bool = True) -> None:
    """The generation settings' options (method, retrieval, tree, length and sampling), shared by
    `generate` and `serve` (where they are the defaults a request's body may override)."""
    method = p.add_argument_group("method")
    _opt(method, "--method", str, "ar: target alone, sd: speculative decoding, specextend: + CMR, sized "
         "trees and prompt lookup, lookup: the target with prompt lookup alone", choices=METHODS,
         metavar="|".join(METHODS))
    _opt(method, "--draft-cache", str, "draft KV policy, overrides the preset's", choices=tuple(DRAFT_POLICIES),
         metavar="|".join(DRAFT_POLICIES), shown_default="the preset's")
    _opt(method, "--attention", str, "attention backend, overrides the preset's", choices=ATTENTIONS,
         metavar="|".join(ATTENTIONS), shown_default="the preset's")

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

    sizing = p.add_argument_group("tree sizing and prompt lookup")
    sizing.add_argument("--cost-model", action=argparse.BooleanOptionalAction, default=None,
                        help="size each step's tree from the measured step costs, down to no tree (default: the "
                             "preset's: on for specextend and lookup)")
    sizing.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                        help="propose continuations of the context's earlier occurrences of its last tokens "
                             "(default: the preset's: on for specextend and lookup)")
    _opt(sizing, "--lookup-ngram", int, "longest suffix matched against the context")
    _opt(sizing, "--lookup-branches", int, "distinct continuations proposed per step")
    _opt(sizing, "--lookup-length", int, "tokens per continuation")

    tree = p.add_argument_group("draft tree")
    _opt(tree, "--tree", str, "tree builder", choices=TREES, metavar="|".join(TREES))
    _opt(tree, "--tree-budget", int, "draft nodes verified per step (dynamic tree; with the cost model, at most)")
    _opt(tree, "--tree-depth", int, "longest draft path (with the cost model, at most)")
    _opt(tree, "--tree-topk", int, "children considered per expanded node")
    _opt(tree, "--tree-threshold", float, "stop growing below this best frontier path probability")
    _opt(tree, "--chain-length", int, "draft tokens per step (chain builder)")

    sampling = p.add_argument_group("length and sampling")
    _opt(sampling, "--max-new-tokens", int, "tokens to generate at most")
    _opt(sampling, "--temperature", float, "0 is greedy")
    _opt(sampling, "--top-p", float, "nucleus sampling mass, in (0, 1]")
    _opt(sampling, "--seed", int, "sampling seed")
    if labels:
        sampling.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                              help="a label recorded in the JSON's config for your own bookkeeping (read by "
                                   "nothing; every setting has its own option above); repeatable")


def build_parser(command: str | None = None) -> _Parser:
    """The full parser. A delegated command's own options are added only when it is `command`,
    so other commands never import (or need) its module."""
    parser = _Parser(prog=PROG, description="Fast speculative decoding on long inputs (SpecExtend).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser("generate", help="generate text after a prompt",
                         description="Generate after a prompt with ar, sd or specextend decoding.")
    add_generate_arguments(gen)
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list or pull the known models")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    mlist = msub.add_parser("list", help="known models: name, role, installed, size, path")
    mlist.add_argument("--json", action="store_true", help="one JSON list on stdout")
    mlist.set_defaults(func=cmd_models_list)
    mpull = msub.add_parser("pull", help="fetch a known model (no NAME: both defaults)")
    mpull.add_argument("name", nargs="?", help="a known short name (see `models list`)")
    mpull.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    mpull.set_defaults(func=cmd_models_pull)

    for name, (module_name, help_text) in DELEGATED.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            module = _delegate(name, module_name)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def _version() -> str:
    from . import __version__

    return __version__


def _delegate(name: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # Only the module itself missing means 'not available'; a missing dependency inside it
        # is a real error and propagates.
        if e.name and module_name.startswith(e.name):
            raise UserError(f"`{PROG} {name}` is not available in this installation ({module_name} missing)"
                            ) from None
        raise


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand word, found before parsing (top-level options take no values)."""
    return next((a for a in argv if not a.startswith("-")), None)


# --------------------------------------------------------------------------- generate


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Resolved Settings from the options given (the rest keep Settings' defaults)."""
    names = [f.name for f in fields(Settings) if f.name != "labels"]
    given = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    # Every setting has its own option here, so --set holds labels only.
    own_option = {name: f"the --{name.replace('_', '-')} option" for name in names}
    labels = parse_assignments(getattr(args, "set", []), "--set", refused=own_option, labels=True)
    return Settings(**given, labels=labels).resolved()


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text from --prompt, --prompt-file or --jsonl/--index; UserError when unusable."""
    if args.index is not None and args.jsonl is None:
        raise UserError("--index needs --jsonl")
    if args.prompt is not None:
        text = args.prompt
    elif args.prompt_file is not None:
        text = _read_text_file(args.prompt_file)
    elif args.jsonl is not None:
        text = text_at(args.jsonl, 0 if args.index is None else args.index)
    else:
        raise UserError("no prompt: give --prompt TEXT, --prompt-file PATH or --jsonl PATH --index I")
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def _read_text_file(name: str) -> str:
    if name == "-":
        return sys.stdin.read()
    path = Path(name).expanduser()
    if not path.exists():
        raise UserError(f"prompt file not found: {name}")
    if not path.is_file():
        raise UserError(f"prompt file is not a file: {name}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"prompt file {name} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except OSError as e:
        raise UserError(f"cannot read prompt file {name}: {e.strerror}") from None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[TextIO]:
    """Send everything printed meanwhile to stderr, yielding the real stdout for the result.

    Python-level prints are redirected; when stdout is the process's own, file descriptor 1 is
    too, so native libraries cannot write into the JSON stream either.
    """
    real = sys.stdout
    saved_fd = None
    if real is sys.__stdout__:
        try:
            real.flush()
            saved_fd = os.dup(1)
            os.dup2(2, 1)
        except (OSError, ValueError, AttributeError):
            saved_fd = None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield real
    finally:
        if saved_fd is not None:
            with contextlib.suppress(OSError, ValueError):
                real.flush()
            os.dup2(saved_fd, 1)
            os.close(saved_fd)


def cmd_generate(args: argparse.Namespace) -> int:
    from .models.loader import parse_device, parse_dtype

    # Everything the user typed is checked before any model is fetched or loaded.
    settings = settings_from_args(args)
    parse_dtype(args.dtype)
    if args.draft_dtype is not None:
        parse_dtype(args.draft_dtype)
    parse_device(args.device)
    prompt = read_prompt(args)

    if args.json:
        with _stdout_to_stderr() as out:
            result = _run_generate(args, settings, prompt, on_text=None)
        out.write(json.dumps(result.to_json(), ensure_ascii=not _utf8(out)) + "\n")
        out.flush()
        return 0

    if not _utf8(sys.stdout) and hasattr(sys.stdout, "reconfigure"):
        # Generated text may hold any character; a narrow terminal encoding must not abort the run.
        sys.stdout.reconfigure(errors="replace")

    def on_text(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = _run_generate(args, settings, prompt, on_text=on_text)
    if result.text and not result.text.endswith("\n") and sys.stdout.isatty():
        sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        print(summary_line(result), file=sys.stderr)
    return 0


def _utf8(stream: TextIO) -> bool:
    return (getattr(stream, "encoding", None) or "").lower().replace("-", "") == "utf8"


def _run_generate(args: argparse.Namespace, settings: Settings, prompt: str,
                  on_text: Callable[[str], None] | None) -> Any:
    from .api import prepare

    prepared = prepare(args.target, args.draft, **model_options(args), load_draft=settings.uses_draft,
                       progress=not args.quiet)
    # Tokenize and check the length before the (slow) weights are read.
    ids = prepared.encode(prompt, chat=args.chat)
    prepared.check_fits(len(ids), settings)
    return prepared.load().generate(ids, settings=settings, on_text=on_text)


def summary_line(r: Any) -> str:
    parts = [
        f"{r.new_tokens} tokens after a {r.prompt_tokens}-token prompt ({r.method}, stop: {r.stop_reason})",
        f"prefill {r.prefill_s:.2f} s",
        f"decode {r.decode_s:.2f} s = {r.decode_tokens_per_s:.2f} tok/s",
    ]
    if r.method != "ar":  # a speculative method, with or without a draft
        parts.append(f"τ {r.accepted_per_step:.2f} over {r.steps} steps")
    return f"{PROG}: " + " | ".join(parts)


# --------------------------------------------------------------------------- models


def _size(n: int) -> str:
    if n <= 0:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def cmd_models_list(args: argparse.Namespace) -> int:
    from .models.registry import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows))
        return 0
    table = [("NAME", "ROLE", "INSTALLED", "SIZE", "PATH")]
    table += [
        (str(r["name"]), str(r.get("role") or "-"), "yes" if r["installed"] else "no",
         _size(int(r.get("size_bytes") or 0)), str(r["path"]))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[4])
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from .models.pull import pull, pull_default_pair

    progress = not args.quiet
    paths = [pull(args.name, progress=progress)] if args.name else list(pull_default_pair(progress))
    for path in paths:
        print(path)
    return 0


# --------------------------------------------------------------------------- main


def _one_line(message: str) -> str:
    return " ".join(str(message).split()) or "(no message)"


def _main(argv: list[str]) -> int:
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """The `specextend` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get(DEBUG_ENV))
    try:
        return _main(argv)
    except SystemExit as e:  # argparse (usage errors: 2, --help: 0) and delegated commands
        return e.code if isinstance(e.code, int) else (0 if e.code is None else _fail_exit(e.code))
    except UserError as e:
        if debug:
            traceback.print_exc()
        print(f"{PROG}: error: {_one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python's exit-time flush quiet.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception as e:
        if debug:
            traceback.print_exc()
        print(
            f"{PROG}: internal error: {type(e).__name__}: {_one_line(str(e))} "
            f"(run with {DEBUG_ENV}=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


def _fail_exit(code: object) -> int:
    """`sys.exit("message")` from a delegated command: print it, status 1 as Python does."""
    print(f"{PROG}: {_one_line(str(code))}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
