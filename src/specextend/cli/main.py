"""`specextend` on the command line: generate, models, and (delegated) bench, needle, demo and serve.

The options shared with other commands are in options.py; a command's work goes through the API
(`api.prepare`, `Pair`). Exit status (the contract): 0 success; 2 bad input or settings, one line
on stderr and no traceback; 1 an unexpected internal error; 130 interrupted. Heavy imports (torch,
transformers) happen inside the commands so `specextend --help` answers at once (tested).
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
from pathlib import Path
from typing import Any, TextIO

from ..common.errors import UserError
from ..common.jsonl import read_requests, text_at
from ..common.plural import count
from ..common.progress import Bar
from ..common.settings import Settings, make_settings
from ..options import (
    OneLineParser,
    add_method_arguments,
    add_model_arguments,
    add_tuning_arguments,
    check_model_options,
    model_options,
    settings_from_args,
)

PROG = "specextend"
DEBUG_ENV = "SPECEXTEND_DEBUG"

# Commands implemented elsewhere: module, one-line help. Imported only when run.
DELEGATED: dict[str, tuple[str, str]] = {
    "bench": ("specextend.bench.runner", "time methods side by side on the same prompts, llama.cpp included"),
    "needle": ("specextend.bench.needle", "draft-only needle retrieval accuracy per draft cache policy"),
    "demo": ("specextend.cli.demo", "the side-by-side demonstration that `make demo` runs"),
    "serve": ("specextend.serve.command", "an OpenAI-compatible HTTP server that keeps long prompts prefilled"),
}
# The order `specextend --help` lists the commands in: the most used first.
ORDER = ("generate", "serve", "bench", "models", "demo", "needle", "kernels")

DESCRIPTION = """\
Speculative decoding that stays fast on long prompts, on CPUs. A small draft model and prompt
lookup propose tokens, the target model checks them all in one forward pass, and the output is
exactly the target's own. Reads GGUF files and runs its own quantized CPU kernels."""

EPILOG = """\
examples:
  specextend generate --chat --prompt "Write a Python function that parses an ISO date."
  specextend generate --chat --prompt-file question.txt --max-new-tokens 200 --json
  specextend serve --port 8000       # OpenAI-compatible API at http://127.0.0.1:8000/v1
  specextend bench --data govreport --methods ar,specextend,llamacpp-ar --out results/mine
  specextend models pull             # the default model pair, once (about 1.6 GB)

`specextend COMMAND --help` lists a command's options; docs/cli.md lists every command's."""

# What each command's own --help says first (its one-line help otherwise).
DESCRIPTIONS = {
    "generate": """\
Generate after a prompt, streaming the text to stdout as it is accepted (a one-line summary goes
to stderr; --json prints one JSON object instead). The default method, specextend, is lossless:
greedy output equals the target's alone (--method ar).

examples:
  specextend generate --chat --prompt "Write a Python function that parses an ISO date."
  specextend generate --chat --prompt-file report.txt --max-new-tokens 200 --json
  specextend generate --target my-target.gguf --draft my-draft.gguf --prompt 'def fib(n):'""",
    "serve": """\
An OpenAI-compatible HTTP server over one loaded model pair: /v1/chat/completions and
/v1/completions (streaming or not), /v1/models, /health. A prompt that starts like an earlier
one (the same document, another question) reuses its prefilled KV. The method, sampling and
tuning options below are the defaults a request's body may override.""",
    "bench": """\
Time decoding methods side by side on the same prompts from one prefill each: the presets, any
ablation (sd+cmr, specextend+retrieve_every=4), transformers' baselines and llama.cpp on the same
GGUF files (make peers). Every row says whether its output equals ar's. Writes results.jsonl,
summary.md and speedup.png into --out; running again with the same --out resumes.""",
}


# --------------------------------------------------------------------------- parser


_Parser = OneLineParser


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    """generate's options, the most used first: the prompt, the method and length, the output;
    then the models and the settings that tune the method."""
    prompt = p.add_argument_group("prompt (exactly one source)")
    src = prompt.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    src.add_argument("--jsonl", help="read the prompt from field `text` of a JSONL record (see --index)")
    src.add_argument("--prompts-file", metavar="PATH.jsonl",
                     help="run every prompt of this JSON Lines file (field `prompt`, optional `id` and per-line "
                          "settings) in one continuous batch; each answer under its label (`=== line N (id ID) "
                          "===`), or with --json one object a line, in input order")
    prompt.add_argument("--index", type=int, default=None, help="0-based record of --jsonl (default: 0)")
    prompt.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")

    add_method_arguments(p)

    fmt = p.add_argument_group("structured output (one at most; speculation stays exact under it)")
    shape = fmt.add_mutually_exclusive_group()
    shape.add_argument("--json-object", action="store_true", help="the output is one JSON object")
    shape.add_argument("--json-schema", metavar="PATH", help="the output is JSON valid under this JSON schema file")
    shape.add_argument("--regex", help="the output matches this regular expression")
    shape.add_argument("--grammar", metavar="PATH", help="the output follows this grammar file (Lark or GBNF)")
    shape.add_argument("--tools", metavar="PATH",
                       help="a JSON file of OpenAI tools the answer may call (implies --chat; calls in --json's "
                            "tool_calls)")
    fmt.add_argument("--tool-choice", default=None, metavar="CHOICE",
                     help="with --tools: auto (default), none, required, or the name of the function to call")
    fmt.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="record each token's log-probability and N alternatives (0-20; in the JSON output)")

    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object (its fields: docs/cli.md) to stdout")
    out.add_argument("-q", "--quiet", action="store_true", help="no loading messages or summary on stderr")

    add_model_arguments(p, draft_note=" (unused with --method ar or lookup)")
    add_tuning_arguments(p)


def build_parser(command: str | None = None) -> _Parser:
    """The full parser. A delegated command's own options are added only when it is `command`,
    so other commands never import (or need) its module."""
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parser.subcommands = sub.choices
    own = {"generate": _add_generate, "models": _add_models, "kernels": _add_kernels}
    for name in [*ORDER, *(n for n in DELEGATED if n not in ORDER)]:
        if name in own:
            own[name](sub)
        elif name in DELEGATED:
            _add_delegated(sub, name, command)
    return parser


def _add_generate(sub: Any) -> None:
    generate = sub.add_parser("generate", help="generate text after a prompt", description=DESCRIPTIONS["generate"],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_generate_arguments(generate)
    generate.set_defaults(func=cmd_generate)


def _add_models(sub: Any) -> None:
    models = sub.add_parser("models", help="list, pull and inspect models; clear the cache of converted copies",
                            description="List the known models, pull one (no NAME: the default pair) into the "
                                        "model cache ($SPECEXTEND_HOME, default ~/.cache/specextend), inspect a "
                                        "GGUF file's types and memory, or clear the converted copies.")
    msub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    models.subcommands = msub.choices
    mlist = msub.add_parser("list", help="known models: name, role, pulled, GGUF size, description")
    mlist.add_argument("--json", action="store_true", help="one JSON list on stdout")
    mlist.set_defaults(func=cmd_models_list)
    mpull = msub.add_parser("pull", help="fetch a known model (no NAME: both defaults)")
    mpull.add_argument("name", nargs="?", help="a known short name (see `models list`)")
    mpull.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    mpull.set_defaults(func=cmd_models_pull)
    minspect = msub.add_parser(
        "inspect", help="a GGUF file's architecture, tensor types, memory and kernel paths (nothing converted)",
        description="What a GGUF file holds and what it costs once loaded, read from its header (memory-mapped, "
                    "nothing converted): the architecture and shape, each tensor type with its count and bytes, how "
                    "the loaded model computes with it (its own grid on this CPU's kernel path, or expanded to "
                    "float32 and requantized to 8 bits), and the memory once loaded.")
    minspect.add_argument("file", metavar="FILE", help="a .gguf file or a pulled known model's name")
    minspect.add_argument("--json", action="store_true", help="one JSON object on stdout")
    minspect.set_defaults(func=cmd_models_inspect)
    mclear = msub.add_parser(
        "clear-cache", help="delete the converted copies (the pulled GGUF files stay unless --pulled)",
        description="Delete the converted copies in the model cache: the known models' converted folders, "
                    "conversions of your .gguf files and weights derived for other schemes (the next load "
                    "converts again). The pulled GGUF files stay unless --pulled. Prints the bytes freed.")
    mclear.add_argument("--pulled", action="store_true",
                        help="also delete the pulled GGUF files (the next use pulls them again)")
    mclear.set_defaults(func=cmd_models_clear_cache)


def _add_kernels(sub: Any) -> None:
    kern = sub.add_parser("kernels", help="build the C++ CPU kernels (once) and name the paths this CPU runs",
                          description="Build (or find) the C++ CPU kernels and name the instruction-set paths "
                                      "this CPU runs (SPECEXTEND_CPU forces one). --peak measures each path's "
                                      "int8 and bfloat16 multiply-add peak on all threads (a few seconds).")
    kern.add_argument("--peak", action="store_true",
                      help="measure each path's multiply-add peaks (register-only loops of its instructions)")
    kern.add_argument("--json", action="store_true", help="with --peak: one JSON object on stdout")
    kern.add_argument("--seconds", type=float, default=0.5, help="with --peak: seconds per loop (default 0.5)")
    kern.add_argument("--repeats", type=int, default=5,
                      help="with --peak: timed runs per loop; each figure is the best (default 5)")
    kern.set_defaults(func=cmd_kernels)


def _add_delegated(sub: Any, name: str, command: str | None) -> None:
    module_name, help_text = DELEGATED[name]
    p = sub.add_parser(name, help=help_text, description=DESCRIPTIONS.get(name, help_text),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    if name == command:
        module = _delegate(name, module_name)
        module.add_arguments(p)
        p.set_defaults(func=module.run)


def _version() -> str:
    from .. import __version__

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
        raise UserError("no prompt: give --prompt TEXT, --prompt-file PATH, --jsonl PATH --index I, or --prompts-file "
                        "PATH for several")
    if not text.strip():
        raise UserError("the prompt is empty")
    return text


def _read_text_file(name: str, what: str = "prompt file") -> str:
    if name == "-":
        return sys.stdin.read()
    path = Path(name).expanduser()
    if not path.exists():
        raise UserError(f"{what} not found: {name}")
    if not path.is_file():
        raise UserError(f"{what} is not a file: {name}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{what} {name} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except OSError as e:
        raise UserError(f"cannot read {what} {name}: {e.strerror}") from None


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
    # Everything the user typed is checked before any model is fetched or loaded.
    settings = settings_from_args(args)
    check_model_options(args)
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        raise UserError(f"--logprobs must be in 0..20, got {args.logprobs}")
    if args.prompts_file is not None:
        if args.tools is not None:
            raise UserError("--tools applies to one prompt; give a prompts file's lines their own settings instead")
        return _generate_many(args, settings, read_requests(args.prompts_file))
    prompt = read_prompt(args)
    tools = tool_options(args)

    if args.json:
        with _stdout_to_stderr() as out:
            result = _run_generate(args, settings, prompt, None, tools)
        out.write(json.dumps(result.to_json(), ensure_ascii=not _utf8(out)) + "\n")
        out.flush()
        return 0

    if not _utf8(sys.stdout) and hasattr(sys.stdout, "reconfigure"):
        # Generated text may hold any character; a narrow terminal encoding must not abort the run.
        sys.stdout.reconfigure(errors="replace")

    def on_text(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    result = _run_generate(args, settings, prompt, on_text, tools)
    if result.text and not result.text.endswith("\n") and sys.stdout.isatty():
        sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        print(summary_line(result), file=sys.stderr)
    return 0


def _utf8(stream: TextIO) -> bool:
    return (getattr(stream, "encoding", None) or "").lower().replace("-", "") == "utf8"


def _run_generate(args: argparse.Namespace, settings: Settings, prompt: str,
                  on_text: Callable[[str], None] | None, tools: dict[str, Any]) -> Any:
    from .. import api
    from ..requests.toolcalls import ToolSpec

    prepared = api.prepare(args.target, args.draft, **model_options(args), load_draft=settings.uses_draft,
                       progress=not args.quiet)
    # Tokenize, check the length and compile the grammar before the (slow) weights are read.
    if tools:
        spec = ToolSpec.parse(tools["tools"], tools["tool_choice"])
        ids = prepared.prompt_ids(prompt, chat=True, tools=spec)
        if spec is not None:
            prepared.grammar(spec.grammar(prepared.tokenizer))  # compiled (and cached) before loading
    else:
        ids = prepared.encode(prompt, chat=args.chat)
    prepared.check_fits(len(ids), settings)
    grammar = prepared.grammar(response_format(args))
    bar = Bar("prefill", progress=not args.quiet)  # drawn only for a prefill that takes a while
    try:
        return prepared.load().generate(ids, settings=settings, on_text=on_text, response_format=grammar,
                                        logprobs=args.logprobs, on_progress=bar, **tools)
    finally:
        bar.close()


def tool_options(args: argparse.Namespace) -> dict[str, Any]:
    """generate's --tools and --tool-choice as `Pair.generate`'s keywords ({} without tools),
    checked (UserError) before anything loads."""
    from ..requests.toolcalls import CHOICES, ToolSpec

    if args.tools is None:
        if args.tool_choice is not None:
            raise UserError("--tool-choice needs --tools")
        return {}
    try:
        tools = json.loads(_read_text_file(args.tools, "tools file"))
    except ValueError as e:
        raise UserError(f"--tools {args.tools}: not JSON: {e}") from None
    choice: Any = args.tool_choice
    if choice is not None and choice not in CHOICES:
        choice = {"type": "function", "function": {"name": choice}}
    ToolSpec.parse(tools, choice)
    return {"tools": tools, "tool_choice": choice}


def _generate_many(args: argparse.Namespace, settings: Settings, requests: list[dict[str, Any]]) -> int:
    """Every request of a prompts file in one batch: one JSON object (or the text) a line, in order."""
    from .. import api

    uses_draft = settings.uses_draft or any(make_settings(settings, **_settings_of(r)).uses_draft
                                            for r in requests)
    prepared = api.prepare(args.target, args.draft, **model_options(args), load_draft=uses_draft,
                           progress=not args.quiet)
    common = dict(chat=args.chat, settings=settings, response_format=prepared.grammar(response_format(args)),
                  logprobs=args.logprobs)
    for r in requests:  # bad lines fail before the weights are read
        try:
            prepared.check_fits(len(prepared.prompt_ids(r["prompt"], r.get("chat", args.chat))),
                                make_settings(settings, **_settings_of(r)))
        except UserError as e:
            raise UserError(f"{args.prompts_file} line {r['_line']}: {e}") from None
    with _stdout_to_stderr() as out, prepared.load() as pair:  # closing the pair joins the batch's thread
        results = pair.generate([{k: v for k, v in r.items() if k not in ("_line", "id")} for r in requests],
                                **common)
    for i, (r, result) in enumerate(zip(requests, results, strict=True)):
        assert result is not None  # none is cancelled
        if args.json:
            obj = result.to_json() if "id" not in r else {"id": r["id"], **result.to_json()}
            out.write(json.dumps(obj, ensure_ascii=not _utf8(out)) + "\n")
        else:  # a person reads these: each answer under its label, a blank line between them
            out.write(("\n" if i else "") + f"=== {_label(r)} ===\n{result.text}\n")
    out.flush()
    if not args.quiet and not args.json:
        for r, result in zip(requests, results, strict=True):
            print(f"{_label(r)}: {summary_line(result)}", file=sys.stderr)
    return 0


def _label(request: dict[str, Any]) -> str:
    """A prompts file's record as its answer is labelled: its `id` if it has one, else its line."""
    return f"line {request['_line']}" + (f" (id {request['id']})" if "id" in request else "")


def _settings_of(request: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in request.items()
            if k not in ("prompt", "_line", "id", "chat", "response_format", "logprobs")}


def response_format(args: argparse.Namespace) -> dict[str, Any] | None:
    """The OpenAI-style response_format of generate's structured-output options."""
    if args.json_object:
        return {"type": "json_object"}
    if args.json_schema is not None:
        try:
            schema = json.loads(_read_text_file(args.json_schema, "schema file"))
        except ValueError as e:
            raise UserError(f"--json-schema {args.json_schema}: not JSON: {e}") from None
        return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}
    if args.regex is not None:
        return {"type": "regex", "regex": args.regex}
    if args.grammar is not None:
        return {"type": "grammar", "grammar": _read_text_file(args.grammar, "grammar file")}
    return None


def summary_line(r: Any) -> str:
    parts = [
        f"{count(r.new_tokens, 'token')} after a {r.prompt_tokens}-token prompt ({r.method}, stop: {r.stop_reason})",
        f"prefill {r.prefill_s:.2f} s",
        f"decode {r.decode_s:.2f} s = {r.decode_tokens_per_s:.2f} tok/s",
    ]
    if r.method != "ar":  # a speculative method, with or without a draft
        parts.append(f"τ {r.accepted_per_step:.2f} over {count(r.steps, 'step')}")
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


def _table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned columns, the last one unpadded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[-1]
                     for row in rows)


def cmd_models_list(args: argparse.Namespace) -> int:
    from ..models.registry import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows))
        return 0
    table = [("NAME", "ROLE", "PULLED", "SIZE", "DESCRIPTION")]
    table += [(str(r["name"]), str(r["role"]), "yes" if r["pulled"] else "no", _size(int(r["size_bytes"])),
               str(r["description"])) for r in rows]
    print(_table(table))
    return 0


def cmd_models_inspect(args: argparse.Namespace) -> int:
    from ..models.footprint import gb, notice, runs_float
    from ..models.registry import inspect_model
    from ..requests.callmarkup import describe as describe_calls
    from ..requests.reasoning import describe as describe_reasoning

    fp = inspect_model(args.file)
    if args.json:
        kv = None if fp.config is None else _kv(fp.config)
        ctx = None if fp.config is None else _context(fp.config)
        print(json.dumps({**fp.as_json(), "family": None if fp.config is None else _family_line(fp.config),
                          "kv_bytes_per_token": None if kv is None else kv[0],
                          "kv_bytes_32k": None if kv is None else kv[1],
                          "context": None if ctx is None else ctx[0],
                          "context_limit": None if ctx is None else ctx[1],
                          "huge_pages": _huge_pages(fp.kernel_path, fp.file, bool(fp.experts))[0],
                          "tool_calls": describe_calls(fp.chat_template),
                          "reasoning": describe_reasoning(fp.chat_template)}))
        return 0
    print(f"file          {fp.file} ({gb(fp.file_bytes)})")
    c = fp.config
    if c is None:
        print(f"architecture  {fp.architecture}: {fp.unsupported}")
    else:
        print(f"architecture  {fp.architecture} ({c['architectures'][0]}): {c['num_hidden_layers']} layers, hidden "
              f"{c['hidden_size']}, FFN {c['intermediate_size']}, {c['num_attention_heads']} heads "
              f"({c['num_key_value_heads']} KV) of {c['head_dim']}, vocabulary {c['vocab_size']}; "
              f"{fp.parameters / 1e6:,.0f} M parameters")
        print(f"family        {_family_line(c)}")
        kv = _kv(c)
        if kv is not None:
            print(f"kv cache      {kv[0] / 1024:,.0f} KB a token of context (bfloat16{kv[2]}); a 32K-token "
                  f"document {gb(kv[1])}")
        ctx = _context(c)
        if ctx is not None:
            print(f"context       {ctx[0]:,} tokens{'; ' + ctx[2] if ctx[2] else ''}")
    if fp.tokenizer:
        print(f"tokenizer     {fp.tokenizer}")
        print(f"tool calls    {describe_calls(fp.chat_template)}")
        print(f"reasoning     {describe_reasoning(fp.chat_template)}")
    if fp.experts:
        e = fp.experts
        print(f"experts       {e['count']} experts, {e['used']} a token: {e['active_parameters'] / 1e6:,.0f} M of "
              f"{e['parameters'] / 1e6:,.0f} M parameters active, {gb(e['active_bytes'])} of weights read a token")
    note = " (--weights auto runs float32 through PyTorch)" if runs_float(fp.kernel_path) else ""
    print(f"kernels       {fp.kernel_path or 'none'}{note}")
    table = [("TYPE", "TENSORS", "PARAMETERS", "FILE", "LOADED", "RUNS AS")]
    table += [(r.type, str(r.tensors), f"{r.parameters / 1e6:.1f} M", gb(r.file_bytes), gb(r.loaded_bytes),
               r.runs_as) for r in fp.types]
    print(_table(table))
    print(f"memory        {gb(fp.loaded_bytes)} once loaded (the first load peaks near {gb(fp.first_load_bytes)}); "
          f"converted copy on disk {gb(fp.converted_bytes)}; all in float32 {gb(fp.float32_bytes)}")
    print(f"expanded      {notice(fp) or 'nothing: every matrix keeps its own grid or is float32 in the file'}")
    pages = _huge_pages(fp.kernel_path, fp.file, bool(fp.experts))[1]
    if pages:
        print(f"pages         {pages}")
    return 0


def _huge_pages(kernel_path: str | None, file: str | os.PathLike[str],
                experts: bool = False) -> tuple[bool | None, str | None]:
    """Whether a load here runs the quantized weights from 2 MB pages (runtime/hugepages.py), and how
    in words; None where the model would run in float32 through PyTorch. The file's own pages are
    judged on `file`: the model's converted copy lies in the cache, most often on the same disk. An
    expert model's experts (a token reads k of them) are used in place whatever the switch says."""
    from ..models.footprint import runs_float
    from ..runtime import hugepages

    if runs_float(kernel_path):
        return None, None
    why = hugepages.refusal()
    if why is not None or experts:  # the file's pages are asked about only where they are used
        file_huge = hugepages.huge_file_pages(hugepages.map_file(file), file)
        on_file = f"the file's pages, which {'this system maps 2 MB each' if file_huge else 'are small'}"
    if why is None:
        experts_too = f"; the experts are used in place, from {on_file}" if experts else ""
        return True, (f"the weights are read into 2 MB pages (transparent huge pages: {hugepages.system_mode()})"
                      f"{experts_too}")
    if file_huge:
        return True, f"the weights are used in place, from {on_file} ({why})"
    return False, f"the weights stay on {on_file} ({why})"


def _kv(hf_config: dict[str, Any]) -> tuple[int, int, str] | None:
    """A target's KV cache: bytes a token of context, for a 32K-token document (with a short answer's
    room), and what its windowed layers keep."""
    from ..runtime.config import ModelConfig
    from ..speculation.decoder import window_room

    try:
        c = ModelConfig.from_hf(hf_config)
    except UserError:
        return None
    room = window_room(c, 256)
    what = f"short convolutions keep the inputs of their last {c.conv_kernel} tokens" if c.conv_layers else \
        f"windowed layers keep their window of {c.sliding_window:,}"
    kept = "" if not c.windowed_layers or room is None else f"; the {c.windowed_layers} {what} and {room:,} more"
    return c.kv_bytes_per_token(), c.kv_bytes(32768, room), kept or ", every layer"


def _context(hf_config: dict[str, Any]) -> tuple[int, int, str] | None:
    """The default context, the most `--max-context` allows, and how to reach it."""
    from ..runtime.config import ModelConfig

    try:
        c = ModelConfig.from_hf(hf_config)
    except UserError:
        return None
    return c.max_position, c.longest, c.context_note()


def _family_line(hf_config: dict[str, Any]) -> str:
    from ..runtime.config import ModelConfig

    try:
        return ModelConfig.from_hf(hf_config).describe()
    except UserError as e:
        return str(e)


def cmd_models_clear_cache(args: argparse.Namespace) -> int:
    from ..models.pull import specextend_home
    from ..models.registry import clear_cache

    freed, removed = clear_cache(pulled=args.pulled)
    for path in removed:
        print(f"removed {path}")
    print(f"freed {_size(freed) if freed else '0 B'} in {specextend_home()}")
    return 0


def cmd_kernels(args: argparse.Namespace) -> int:
    from ..runtime import kernels

    if not args.peak:
        if args.json:
            raise UserError("--json goes with --peak")
        print(kernels.describe())
        return 0
    if not (0 < args.seconds <= 60) or args.repeats < 1:
        raise UserError("--seconds must be above 0 and at most 60, --repeats at least 1")
    from ..bench import roofline

    measured = roofline.measure(seconds=args.seconds, repeats=args.repeats)
    print(json.dumps(measured, indent=2) if args.json else f"{kernels.describe()}\n{roofline.table(measured)}")
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from ..models.pull import pull, pull_default_pair

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
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, so the message points at its --help
        own: argparse.ArgumentParser = parser
        while isinstance(own, OneLineParser) and (name := next((a for a in argv if a in own.subcommands), None)):
            own = own.subcommands[name]
        own.error(f"unrecognized arguments: {' '.join(unknown)}")
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
