"""The OpenAI wire format: request bodies checked into settings, and the response, chunk, usage and
error objects.

Bodies are validated by pydantic in strict mode (a string is not a number, 1.0 is not an
integer) and unknown fields are refused, as OpenAI does. Beyond OpenAI's fields a body may carry
any generation setting of the Python API by its keyword (`method`, `draft_cache`, `attention`,
`chunk_size`, `top_k_chunks`, `retrieve_every`, `tree_budget`, ...); OpenAI's own names stand for
the rest (`max_tokens` for max_new_tokens, `temperature`, `top_p`, `seed`, `frequency_penalty`,
`presence_penalty`). `response_format` (text, json_object, json_schema, and the extensions regex
and grammar) constrains the output on both endpoints; `logprobs` / `top_logprobs` (chat) and
`logprobs` (completions) return log-probabilities; `tools` / `tool_choice` / `parallel_tool_calls`
(chat) are checked by requests/toolcalls.py. Fields that OpenAI has but this server cannot honour (several
choices, logit_bias) are accepted only at their neutral values, so no request is silently
answered as another one.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import MISSING, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from ..common.errors import UserError
from ..common.settings import SEED_MAX, Settings, value_type
from ..requests.prompts import check_template_kwargs
from ..requests.toolcalls import ToolError, ToolSpec

# Settings that the body sets through OpenAI's names, not their own.
OPENAI_NAMED = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
                "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty"}
MAX_STOPS = 4


class APIError(Exception):
    """An error answered as OpenAI's {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# --------------------------------------------------------------------------- request bodies


def json_body(raw: bytes) -> Any:
    """A request body's JSON, or a 400 that says why it is not (nesting too deep for the parser too)."""
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON here: it nests arrays or objects too deeply") from None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def _setting_fields() -> dict[str, Any]:
    """Every Settings field not named by OpenAI, typed as its values are (settings.value_type)."""
    out: dict[str, Any] = {}
    for f in fields(Settings):
        if f.name in OPENAI_NAMED or f.name == "labels" or f.default is MISSING:
            continue
        out[f.name] = (value_type(f.name) | None, None)
    return out


# The extension fields are Settings' own (one rule: a setting is a request field), so the class is
# built at run time; a type checker sees its static base.
if TYPE_CHECKING:
    _Extensions = _Strict
else:
    _Extensions = create_model("_Extensions", __base__=_Strict, **_setting_fields())
EXTENSION_FIELDS = tuple(_setting_fields())


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Extensions):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, le=SEED_MAX)
    stop: Any = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and len(v) <= MAX_STOPS and all(isinstance(s, str) for s in v):
            return v
        raise ValueError(f"must be a string or a list of up to {MAX_STOPS} strings")

    def stops(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]

    def check_supported(self) -> None:
        """Refuse what would change the answer in a way this server does not implement."""
        if self.n != 1:
            raise APIError(400, "only n=1 is supported (one choice per request)", param="n")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options needs stream: true", param="stream_options")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers
    refusal: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for an assistant's message with tool_calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> str | None:
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list):
            try:
                return "".join(TextPart.model_validate(p).text for p in v)
            except ValidationError:
                pass
        raise ValueError("must be a string or a list of {\"type\": \"text\", \"text\": ...} parts")

    def as_template(self) -> dict[str, Any]:
        # Chat templates know system, user and assistant; OpenAI's developer role is the system's.
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    tool_call_recovery: bool | None = None  # false: a bare JSON answer under `auto` stays text (requests/toolcalls.py)
    # Variables for the chat template (vLLM's and llama.cpp's field): {"enable_thinking": false} for Qwen3's
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's field for reasoning models: the template variable of that name (gpt-oss's template reads
    # it); a template that does not is refused it (requests/prompts.py), as OpenAI refuses it for a model
    # that does not reason.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        try:
            check_template_kwargs(self.chat_template_kwargs)
        except UserError as e:
            raise APIError(400, str(e), param="chat_template_kwargs") from None
        asked = (self.chat_template_kwargs or {}).get("reasoning_effort", self.reasoning_effort)
        if self.reasoning_effort is not None and asked != self.reasoning_effort:
            raise APIError(400, f"reasoning_effort {self.reasoning_effort!r} and chat_template_kwargs' "
                                f"{asked!r} disagree; send one", param="reasoning_effort")

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables the request sets: chat_template_kwargs and reasoning_effort."""
        out = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out or None

    def tool_spec(self) -> ToolSpec | None:
        """The request's tools (requests/toolcalls.py), None when none may be called; APIError(400) otherwise."""
        try:
            spec = ToolSpec.parse(self.tools, self.tool_choice, self.parallel_tool_calls, self.tool_call_recovery)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_tools") from None
        if spec is not None and (self.response_format or {}).get("type", "text") != "text":
            raise APIError(400, "tools and a response_format cannot be combined (a call is already constrained to "
                                "its schema)", param="response_format")
        return spec

    def wanted_logprobs(self) -> int | None:
        """Alternatives per position when log-probabilities are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(_Common):
    prompt: Any
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> str | list[int]:
        # OpenAI also takes a batch (a list of prompts); one prompt per request here.
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise ValueError("must be a string, or a list of token ids (one prompt per request)")

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "only best_of=1 is supported", param="best_of")

    def wanted_logprobs(self) -> int | None:
        return self.logprobs


# --------------------------------------------------------------------------- request -> settings


@dataclass
class Request:
    """A checked request, not yet tokenized."""

    kind: Literal["chat", "completion"]
    messages: list[dict[str, Any]] | None
    prompt: str | list[int] | None
    settings: Settings
    stops: list[str]
    stream: bool
    include_usage: bool
    response_format: dict[str, Any] | None = None  # as sent; compiled by the server (app.py)
    logprobs: int | None = None  # alternatives per position; None: no log-probabilities
    tools: ToolSpec | None = None  # the tools the answer may call (chat)
    template_kwargs: dict[str, Any] | None = None  # the chat template's variables (chat_template_kwargs)


def parse(kind: Literal["chat", "completion"], body: Any, defaults: Settings, tool_call_recovery: bool = True
          ) -> Request:
    """Check a decoded JSON body against the endpoint's schema and the generation settings; raises
    APIError(400) naming the offending field. `tool_call_recovery`: the server's default for a
    request that does not set the field (`serve --no-tool-call-recovery`)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = ChatBody if kind == "chat" else CompletionBody
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        raise _validation_error(e) from None
    req.check_supported()
    if isinstance(req, ChatBody) and req.tool_call_recovery is None:
        req.tool_call_recovery = tool_call_recovery
    overrides = {name: getattr(req, name) for name in EXTENSION_FIELDS if getattr(req, name) is not None}
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    for name, value in (("max_new_tokens", max_tokens), ("temperature", req.temperature), ("top_p", req.top_p),
                        ("seed", req.seed), ("frequency_penalty", req.frequency_penalty),
                        ("presence_penalty", req.presence_penalty)):
        if value is not None:
            overrides[name] = value
    settings = settings_from(defaults, overrides)
    usage_too = bool(req.stream_options and req.stream_options.include_usage)
    if isinstance(req, ChatBody):
        return Request("chat", [m.as_template() for m in req.messages], None, settings, req.stops(), req.stream,
                       usage_too, req.response_format, req.wanted_logprobs(), req.tool_spec(),
                       req.template_kwargs())
    return Request("completion", None, req.prompt, settings, req.stops(), req.stream, usage_too,
                   req.response_format, req.wanted_logprobs())


def settings_from(defaults: Settings, overrides: dict[str, Any]) -> Settings:
    """The server's settings with the request's on top; a bad value is a 400 naming its field."""
    for name, value in overrides.items():
        try:
            replace(defaults, **{name: value}).resolved()
        except UserError as e:
            raise APIError(400, _api_names(str(e)), param=OPENAI_NAMED.get(name, name)) from None
    try:
        return replace(defaults, **overrides).resolved()
    except UserError as e:
        raise APIError(400, _api_names(str(e))) from None


def _api_names(message: str) -> str:
    """Settings' messages name command-line flags (--top-k-chunks); a request names fields."""
    names = {f"--{n.replace('_', '-')}": OPENAI_NAMED.get(n, n) for n in (f.name for f in fields(Settings))}
    return re.sub(r"--[a-z][a-z-]*", lambda m: names.get(m.group(0), m.group(0)), message)


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = [p for p in err["loc"] if isinstance(p, int) or p.isidentifier()]
    param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc)) or None
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unrecognized request argument"
    elif err["type"] == "missing":
        msg = "required"
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


# --------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(result: Any, queue_s: float, replica: str | None = None) -> dict[str, Any]:
    """OpenAI's token counts (cached prompt tokens as OpenAI reports them) and the speculative
    decoding statistics of this one request (with `replica`, the replica that served it)."""
    phases = result.phases
    out = {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.new_tokens,
        "total_tokens": result.prompt_tokens + result.new_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens},
        "speculative": {
            "method": result.method,
            "steps": result.steps,
            "accepted_per_step": result.accepted_per_step,
            "prefill_s": result.prefill_s,
            "decode_s": result.decode_s,
            "total_s": result.total_s,
            "draft_s": phases.get("draft_s", 0.0),
            "verify_s": phases.get("verify_s", 0.0),
            "retrieval_s": phases.get("retrieval_s", 0.0),
            "cached_prompt_tokens": result.cached_prompt_tokens,
            "queue_s": queue_s,
            # What the step sizing saw and chose (generate --json's `extra`): why a request's steps cost what they did.
            "stats": dict(result.extra or {}),
        },
    }
    if replica is not None:
        out["speculative"]["replica"] = replica
    return out


REPLICA_HEADER = "x-specextend-replica"


def replica_header(replica: str | None) -> dict[str, str] | None:
    """The response header that names the replica that served it (served by replicas only)."""
    return {REPLICA_HEADER: replica} if replica is not None else None


def logprobs_object(kind: str, entries: list[dict[str, Any]] | None, offset: int = 0) -> dict[str, Any] | None:
    """Log-probabilities in the endpoint's shape: chat's {"content": [...]} or the completions'
    {tokens, token_logprobs, top_logprobs, text_offset} (`offset`: the text sent before these)."""
    if entries is None:
        return None
    if kind == "chat":
        return {"content": [{k: e[k] for k in ("token", "logprob", "bytes")}
                            | {"top_logprobs": [{k: t[k] for k in ("token", "logprob", "bytes")}
                                                for t in e["top_logprobs"]]} for e in entries], "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def response(kind: str, rid: str, created: int, model: str, text: str | None, finish: str, use: dict[str, Any],
             logprobs: list[dict[str, Any]] | None = None, tool_calls: list[dict[str, Any]] | None = None,
             reasoning: str | None = None) -> dict[str, Any]:
    """A whole answer; `reasoning`: a reasoning model's thoughts, kept out of `content` (an extension of
    OpenAI's message: `reasoning_content`, as other servers name it; requests/harmony.py)."""
    lp = logprobs_object(kind, logprobs)
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": lp}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": use,
            "system_fingerprint": None}


def chunk(kind: str, rid: str, created: int, model: str, text: str | None, finish: str | None = None,
          role: bool = False, logprobs: dict[str, Any] | None = None, delta: dict[str, Any] | None = None
          ) -> dict[str, Any]:
    """One streamed piece: new text (and its tokens' `logprobs_object`), or (text None) the
    closing chunk with its finish reason; chat's `delta` given whole (a tool call's) instead."""
    if kind == "chat":
        if delta is None:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "system_fingerprint": None}


def usage_chunk(kind: str, rid: str, created: int, model: str, use: dict[str, Any]) -> dict[str, Any]:
    """The last chunk when the client asked for stream_options.include_usage (no choices)."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use,
            "system_fingerprint": None}
