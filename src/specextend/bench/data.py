"""Benchmark inputs: JSONL prompt files (e.g. GovReport; read by `jsonl.read_texts`), found by
name under the data roots, and a built-in long-code set; the length and list options.

The built-in set needs no download: large modules of Python's own standard library, cut to a
token budget (1K, 2K, 4K, 8K, 16K target tokens) and wrapped in a summarisation instruction.
Its files come from a fixed, sorted list, so a given Python version and tokenizer always give the
same prompts (another Python version ships other sources, hence other prompts).

One prompt rule for every input and every method: the prompt text is an instruction, so it is
wrapped as a user turn in the target tokenizer's chat template when the tokenizer has one (as
`specextend generate --chat` does); without a template (or with `chat=False`) the raw text is
tokenised with the tokenizer's default special tokens. The token ids are computed once per
sample and fed unchanged to every method, ours and the Hugging Face baselines alike.
"""

from __future__ import annotations

import os
import re
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..common.errors import UserError
from ..common.jsonl import read_texts

DATA_ENV = "SPECEXTEND_DATA"
BUILTIN_NAMES = ("stdlib", "builtin")  # --data words that mean the built-in long-code set
BUILTIN_LENGTHS = (1024, 2048, 4096, 8192, 16384)

# Large standard-library modules (each well over 64 KB, so every length up to 16K tokens can be
# cut from its beginning), sorted by name; samples are taken in this order.
STDLIB_FILES = (
    "argparse.py",
    "datetime.py",
    "difflib.py",
    "doctest.py",
    "enum.py",
    "inspect.py",
    "logging/__init__.py",
    "mailbox.py",
    "pydoc.py",
    "subprocess.py",
    "tarfile.py",
    "typing.py",
    "zipfile.py",
)

INSTRUCTION = "Summarise what this Python module does, its main classes and functions:\n\n"
CODE_PROMPT = INSTRUCTION + "```python\n{code}\n```\n"


@dataclass
class Sample:
    """One benchmark input. `prompt_ids` are filled by `encode_samples` with the pair's tokenizer."""

    data: str  # data set name, e.g. "stdlib-4K" or "govreport-4K"
    sample: int  # index within the data set (the record's index for JSONL files)
    text: str  # the prompt text before any chat template
    prompt_ids: list[int] = field(default_factory=list)
    source: str = ""  # where the text came from (file path, stdlib module)

    @property
    def input_tokens(self) -> int:
        return len(self.prompt_ids)


# --------------------------------------------------------------------------- lengths and names


def parse_length(text: str) -> int:
    """'4K' -> 4096, '1.5K' -> 1536, '512' -> 512; UserError for anything else."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", text)
    n = float(m.group(1)) * (1024 if m.group(2) else 1) if m else None
    if n is None or not n.is_integer():
        raise UserError(f"bad length {text!r}: write a token count like 512 or 4K")
    if n <= 0:
        raise UserError(f"bad length {text!r}: must be positive")
    return int(n)


def parse_lengths(text: str) -> list[int]:
    """'2K,1k,512' -> [512, 1024, 2048]: token counts, sorted, each once."""
    return sorted({parse_length(t) for t in split_list(text, "--lengths")})


def split_list(text: str, option: str) -> list[str]:
    """A comma-separated option's items, stripped, each once, in order; UserError when empty."""
    items = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not items:
        raise UserError(f"{option} is empty")
    return items


def length_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def data_length(name: str) -> int | None:
    """The token length a data set's name ends with ('govreport-4K' -> 4096), if any."""
    m = re.search(r"[-_](\d+[kK]?)$", name)
    return parse_length(m.group(1)) if m else None


def data_family(name: str) -> str:
    """The data set's name without its length suffix ('govreport-4K' -> 'govreport')."""
    return re.sub(r"[-_]\d+[kK]?$", "", name) or name


def data_name(path: Path) -> str:
    """govreport_4K.jsonl -> govreport-4K."""
    return path.stem.replace("_", "-")


# --------------------------------------------------------------------------- prompts -> ids


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """The module's prompt rule (see the docstring); the same ids `generate --chat` would use."""
    if chat and has_chat_template(tokenizer):
        # Render to text, then tokenize: the template already holds its special tokens.
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(rendered, add_special_tokens=False)
    else:
        ids = tokenizer.encode(text)
    return [int(i) for i in ids]


def encode_samples(samples: Iterable[Sample], tokenizer: Any, chat: bool = True) -> None:
    for s in samples:
        if not s.prompt_ids:
            s.prompt_ids = encode_prompt(tokenizer, s.text, chat)


# --------------------------------------------------------------------------- JSONL files


def data_roots() -> list[Path]:
    """Where data sets are looked up by name (`bench --data govreport`, the needle test's
    haystacks): $SPECEXTEND_DATA, then the shared data folder beside the repository
    (`<repo>/../shared/data`, found from this file or, for an installed copy, from the working
    directory)."""
    roots = []
    if os.environ.get(DATA_ENV):
        roots.append(Path(os.environ[DATA_ENV]).expanduser())
    repo = Path(__file__).resolve().parents[3]
    for shared in (repo.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"):
        if shared not in roots:
            roots.append(shared)
    return roots


def resolve_data_path(item: str) -> Path:
    """A --data item as a path: as given if it exists, else a bare name under `data_roots()`."""
    path = Path(item).expanduser()
    if path.exists():
        return path
    if os.sep not in item and "/" not in item:
        for root in data_roots():
            if (root / item).exists():
                return root / item
    raise UserError(f"data path not found: {item}")


def jsonl_files(paths: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for item in paths:
        path = resolve_data_path(item)
        if path.is_dir():
            found = sorted(p for p in path.glob("*.jsonl") if p.is_file())
            if not found:
                raise UserError(f"no .jsonl files in {item}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UserError(f"data path is neither a file nor a folder: {item}")
    return files


def load_jsonl_inputs(paths: list[str], limit: int | None = None) -> list[Sample]:
    """Samples from JSONL files or folders of them (field `text`), the first `limit` of each file.
    Every record is checked, so a broken file fails before any model is loaded."""
    samples: list[Sample] = []
    names: dict[str, Path] = {}
    for path in jsonl_files(paths):
        name = data_name(path)
        if name in names and names[name].resolve() != path.resolve():
            raise UserError(f"two data files are both named {name}: {names[name]} and {path}")
        if name in names:
            continue  # the same file given twice
        names[name] = path
        texts = read_texts(path)
        if limit is not None:
            texts = texts[:limit]
        samples += [Sample(name, i, t, source=str(path)) for i, t in enumerate(texts)]
    return samples


# --------------------------------------------------------------------------- built-in code set


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_sources() -> list[tuple[str, str]]:
    """(module file, source text) of the STDLIB_FILES this Python has, in list order."""
    root = stdlib_dir()
    out = []
    for name in STDLIB_FILES:
        path = root / name
        if path.is_file():
            out.append((name, path.read_text(encoding="utf-8")))
    if not out:
        raise UserError(f"no standard-library sources found under {root} for the built-in data set")
    return out


def _cut_code(tokenizer: Any, code: str, budget: int) -> str | None:
    """The beginning of `code`, about `budget` tokens long, ended at a line break; None if the
    file is shorter than the budget."""
    # Tokenising a whole 200 KB module for a 1K cut is wasteful: code averages well under
    # 12 characters per token, so this prefix holds enough tokens (else fall back to all of it).
    head = code[: budget * 12]
    ids = tokenizer.encode(head, add_special_tokens=False)
    if len(ids) < budget and len(head) < len(code):
        ids = tokenizer.encode(code, add_special_tokens=False)
    if len(ids) < budget:
        return None
    text = tokenizer.decode(ids[:budget], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    cut = text.rfind("\n")
    if cut > len(text) // 2:  # end on a whole line unless that throws away too much
        text = text[:cut]
    return text


def builtin_code_inputs(tokenizer: Any, lengths: Sequence[int] = BUILTIN_LENGTHS, samples: int = 3,
                        chat: bool = True) -> list[Sample]:
    """The built-in set: per length, the first `samples` modules long enough, cut so the whole
    prompt (instruction and chat template included) is about that many tokens."""
    sources = stdlib_sources()
    out: list[Sample] = []
    for length in lengths:
        name = f"stdlib-{length_label(length)}"
        overhead = len(encode_prompt(tokenizer, CODE_PROMPT.format(code=""), chat))
        budget = length - overhead
        if budget <= 0:
            raise UserError(f"length {length} is too short for the instruction ({overhead} tokens)")
        for module, code in sources:
            if sum(s.data == name for s in out) >= samples:
                break
            cut = _cut_code(tokenizer, code, budget)
            if cut is None:
                continue
            text = CODE_PROMPT.format(code=cut)
            index = sum(s.data == name for s in out)
            out.append(Sample(name, index, text, encode_prompt(tokenizer, text, chat), source=f"stdlib/{module}"))
        if not any(s.data == name for s in out):
            raise UserError(f"no standard-library module is {length} tokens long for the built-in set")
    return out


def is_builtin(item: str) -> bool:
    return item in BUILTIN_NAMES and not Path(item).exists()
