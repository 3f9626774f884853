"""The OpenAI API's request bodies as verispec reads them, and its response objects as verispec writes them.

Requests are validated with pydantic in strict mode (a string where a number belongs is refused, not
converted). A field verispec does not implement is refused with a 400 naming it, never silently ignored
(:data:`NOT_IMPLEMENTED`: OpenAI's fields, which pass only with the value that asks for nothing, such as
``presence_penalty: 0``), as is a field nobody defines. verispec's own options ride in the body beside
OpenAI's: ``top_k``, ``min_p``, ``drafter``, ``k`` and ``invariant`` (by default: invariant draws exactly when
a ``seed`` is given). A message's ``name`` (OpenAI's participant name) is accepted and not used: the chat
templates have no place for it. ``max_tokens`` and ``max_completion_tokens`` (chat's newer name for it) may
both be given only with one value (:attr:`ApiRequest.limit`). ``response_format`` (``text``, ``json_object``,
or ``json_schema`` with its ``name``, ``schema`` and ``strict``) constrains the output through
:class:`~verispec.grammar.Constraint`, exactly and whatever ``strict`` says (the schema is enforced either
way). Chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are read by
:meth:`~verispec.grammar.tools.Tools.of` (every bad shape a 400 naming its field), an assistant's message may
carry ``tool_calls`` (content null) and a ``tool`` message answers one of them by ``tool_call_id``; the
answer's calls end it with finish_reason ``tool_calls``; the legacy ``functions`` and ``function_call`` stay
refused. Every refusal is an :class:`ApiError`: an HTTP status and one line, written in OpenAI's error format
by :func:`error_body`.

Log-probabilities (chat: ``logprobs: true`` and ``top_logprobs: N``; completions: ``logprobs: N``; N ≤
:data:`~verispec.options.MAX_LOGPROBS`) are the engine's (:class:`~verispec.engine.sequence.TokenLogprob`):
the log-softmax of the target's own logits at each token's prefix, before the sampling transform, read from
the forward that verified the token.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from verispec.engine.sequence import GenerationStats, TokenLogprob
from verispec.errors import UsageError
from verispec.grammar.constraint import Constraint, InvalidConstraint
from verispec.grammar.tools import InvalidTools, ToolCall, Tools
from verispec.inputs import parse_json
from verispec.models.base import SpelledTokenizer, Tokenizer
from verispec.options import MAX_LOGPROBS, SamplingParams

__all__ = [
    "ApiError",
    "ApiRequest",
    "ChatRequest",
    "CompletionRequest",
    "chat_logprobs",
    "completion_logprobs",
    "error_body",
    "finish_reason",
    "parse_request",
    "spelling",
    "usage",
]

MAX_STOP = 4  # stop strings per request, as OpenAI allows
# the longest JSON schema a request may constrain by (its JSON text in UTF-8 bytes; its tools' together):
# llguidance's lexer takes about 250 bytes of memory per byte of a long literal (a 500 KB ``const``: 120-180
# MB for one request); OpenAI itself takes schemas of at most 120,000 characters of names, enums and consts
MAX_SCHEMA_BYTES = 128 * 1024

NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    # OpenAI's fields that verispec does not implement → the values that ask for nothing (passed, unused)
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
    "service_tier": (None, "auto", "default"),
    "store": (None, False),
    "metadata": (None, {}),
}


class ApiError(Exception):
    """A request refused: ``status`` and a one-line ``message``; ``kind`` is OpenAI's error type."""

    def __init__(
        self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(error: ApiError) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": error.message, "type": error.kind, "param": error.param, "code": None}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` or not, it is enforced)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text (no constraint), any JSON object, or JSON of a schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> Constraint | None:
        """The constraint it asks for; ApiError 400 for a schema llguidance refuses."""
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ApiError(
                400, "response_format: json_schema goes with type json_schema", param="response_format"
            )
        if self.json_schema is None:
            return Constraint("json_object") if self.type == "json_object" else None
        text = bounded_json(self.json_schema.schema_, "response_format")
        try:
            return Constraint("json_schema", text)
        except InvalidConstraint as err:
            raise refused_format(err) from None


def bounded_json(value: Any, field: str) -> str:
    """The JSON text of ``field``'s ``value``, a grammar's source; ApiError 400 naming ``field`` when it is
    over :data:`MAX_SCHEMA_BYTES` of UTF-8."""
    text = json.dumps(value)
    size = len(text.encode())
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(
            400,
            f"{field}: {size:,} bytes of JSON schema is over this server's {MAX_SCHEMA_BYTES:,} (its "
            "grammar's memory grows with it)",
            param=field,
        )
    return text


def refused_format(error: InvalidConstraint) -> ApiError:
    """The 400 of a response_format whose constraint cannot be generated from (refused on construction, or
    when its state is made for the request, before anything is answered)."""
    return ApiError(400, f"response_format: {error}", param="response_format")


class ApiRequest(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: Annotated[int, Field(ge=1, lt=2**63)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, lt=2**63)] | None = None  # chat's newer name of it
    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # verispec's own
    top_k: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    drafter: str | None = None
    k: Annotated[int, Field(ge=0)] | str | None = None
    invariant: bool | None = None  # None: invariant draws exactly when a seed is given
    user: str | None = None  # an end user's id, for OpenAI's abuse monitoring: no effect on the answer
    response_format: ResponseFormat | None = None  # structured output, exact under speculation

    @field_validator("n")
    @classmethod
    def _one(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n = 1 is served")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"at most {MAX_STOP} stop strings, none empty")
        return stop

    @property
    def limit(self) -> int | None:
        """The most tokens to generate: ``max_completion_tokens`` or ``max_tokens`` (None: neither given).
        OpenAI documents no rule for a body giving both (``max_tokens`` is the older name of the same
        bound): with the same value it is that value, with two values a 400 naming both, never one of
        them silently winning."""
        both = (self.max_tokens, self.max_completion_tokens)
        if None not in both and both[0] != both[1]:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: give one of them",
                           param="max_completion_tokens")  # fmt: skip
        return self.max_completion_tokens or self.max_tokens

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def alternatives(self) -> int | None:
        """None when no log-probabilities are asked for, else how many likeliest alternatives per token."""
        raise NotImplementedError  # each endpoint asks its own way

    def sampling(self) -> SamplingParams:
        try:
            return SamplingParams.of(self)
        except UsageError as err:
            raise ApiError(400, str(err)) from None


class CompletionRequest(ApiRequest):
    """``POST /v1/completions``: one prompt: a string or token ids of the served model's vocabulary, or a list
    holding one of them (as OpenAI's API takes them)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # N: each token's and N likeliest

    @property
    def alternatives(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _single(cls, prompt: str | list[str] | list[int] | list[list[int]]) -> object:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and not isinstance(prompt[0], int) and len(prompt) != 1:
            raise ValueError("one prompt per request (n = 1, no batches of prompts)")
        return prompt

    @property
    def one_prompt(self) -> str | list[int]:
        """The prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and not isinstance(prompt[0], int):
            return prompt[0]
        return prompt  # text, or token ids


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str  # JSON text

    @field_validator("arguments")
    @classmethod
    def _json(cls, arguments: str) -> str:
        parse_json(arguments)  # UsageError, a ValueError: pydantic's error, one line
        return arguments


class MessageToolCall(BaseModel):
    """A call an assistant's message made (an earlier answer's ``tool_calls``)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: CalledFunction


class Message(BaseModel):
    """A chat message: ``content`` (None only in an assistant's message that makes ``tool_calls``), a
    ``tool`` message the result of the call its ``tool_call_id`` names."""

    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # OpenAI's participant name: accepted, not used (the chat templates take none)
    tool_calls: Annotated[list[MessageToolCall], Field(min_length=1)] | None = None
    tool_call_id: str | None = None
    # what OpenAI's client gives back with an answer's message (``message.model_dump()``), taken empty only
    refusal: None = None
    audio: None = None
    function_call: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant's message makes tool_calls")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content is missing (only an assistant's message with tool_calls may omit it)")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message, and only a tool message, has a tool_call_id")
        return self

    def as_dict(self) -> dict[str, Any]:
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls is not None:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatRequest(ApiRequest):
    """``POST /v1/chat/completions``: a conversation, rendered with the model's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    logprobs: bool | None = None  # each token's log-probability
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None  # and its N likeliest
    tools: list[Any] | None = None  # OpenAI's function definitions: read by Tools.of
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, messages: list[Message]) -> list[Message]:
        made: set[str] = set()
        answered: set[str] = set()
        for i, message in enumerate(messages):
            for call in message.tool_calls or ():
                if call.id in made:
                    raise ValueError(f"message {i} makes a second tool call of id {call.id[:40]!r}")
                made.add(call.id)
            answer = message.tool_call_id
            if answer is None:
                continue
            if answer not in made:
                raise ValueError(f"message {i}'s tool_call_id {answer[:40]!r} answers no earlier tool call")
            if answer in answered:
                raise ValueError(f"message {i}'s tool_call_id {answer[:40]!r} answers a call answered before")
            answered.add(answer)
        return messages

    def tool_spec(self) -> Tools | None:
        """The tools the request gives (None: none); ApiError 400 naming the field at fault."""
        if self.tools is not None:
            bounded_json(self.tools, "tools")
        try:
            return Tools.of(self.tools, self.tool_choice, self.parallel_tool_calls)
        except InvalidTools as err:
            raise ApiError(400, str(err), param=err.field) from None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return top

    @property
    def alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]


def parse_request(kind: type[ApiRequest], body: Any) -> ApiRequest:
    """The validated request, or ApiError 400 naming the first problem in one line (a field verispec does
    not implement: by name, unless it has a value that asks for nothing)."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    body = dict(body)
    for name in [n for n in body if n not in kind.model_fields]:
        value = body[name]
        if any(type(value) is type(ok) and value == ok for ok in NOT_IMPLEMENTED.get(name, ())):
            del body[name]  # asks for nothing
        elif name in NOT_IMPLEMENTED:
            raise ApiError(400, f"{name}: not implemented by verispec (refused, not ignored)", param=name)
        else:
            raise ApiError(400, f"{name[:60]!r}: not a field of this endpoint", param=name[:60])
    try:
        return kind.model_validate(body)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        loc = first["loc"]
        union = _union_branches(errors)
        if union is not None:  # a value that fits no type of a union: name the types, not one type's error
            where, kinds = union
            raise ApiError(
                400, f"{where}: should be {', '.join(kinds[:-1])} or {kinds[-1]}", param=where
            ) from None
        same = [
            e for e in errors if e["loc"][:1] == loc[:1]
        ]  # the first field's, a union's branches among them
        first = next((e for e in same if not e["type"].endswith("_type")), first)  # the type the value fits
        where = ".".join(str(part) for part in first["loc"] if not _is_type_name(part)) or "body"
        message = str(first["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {message}", param=where) from None


def _union_branches(errors: list[Any]) -> tuple[str, list[str]] | None:
    """Where the first error's value fits none of a union's types (pydantic's error per type, each located by
    the type's name after the field's, each a type mismatch: "..._type"): (the field's location, the types'
    names); None for another error."""
    loc = errors[0]["loc"]
    for i in range(1, len(loc)):
        kinds = list(
            dict.fromkeys(e["loc"][i] for e in errors if e["loc"][:i] == loc[:i] and len(e["loc"]) > i)
        )
        if len(kinds) > 1 and all(_is_type_name(k) for k in kinds):
            if any(not e["type"].endswith("_type") for e in errors):  # it fits a type, not its constraint
                return None
            return ".".join(str(part) for part in loc[:i]), [k.removeprefix("constrained-") for k in kinds]
    return None


def _is_type_name(part: object) -> bool:
    """Whether a part of pydantic's error location names one type of a union ("str", "list[int]",
    "constrained-int"), not a field (whose names have no brackets and no hyphens)."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_NAMES)


_TYPE_NAMES = frozenset(("str", "int", "float", "bool", "none"))  # how pydantic names a union's simple types


def spelling(tokenizer: Tokenizer) -> Callable[[int], bytes]:
    """Each token id's bytes: as the tokenizer spells them (a piece of a UTF-8 character is those bytes
    alone), else its decoded text's."""
    if isinstance(tokenizer, SpelledTokenizer):
        spelled = tokenizer.token_bytes()
        return spelled.__getitem__
    return lambda token: tokenizer.decode([token]).encode()


def _text(spelled: bytes) -> str:
    return spelled.decode("utf-8", errors="replace")


def chat_logprobs(entries: Sequence[TokenLogprob], spell: Callable[[int], bytes]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs`` object: each token's text, logprob, bytes and likeliest alternatives."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        return {"token": _text(spell(token)), "logprob": logprob, "bytes": list(spell(token))}

    return {
        "content": [
            {**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    entries: Sequence[TokenLogprob], spell: Callable[[int], bytes], offset: int
) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object: tokens, token_logprobs, top_logprobs (text → logprob; tokens
    spelled alike share an entry) and text_offset, each token's text counted from ``offset`` (the length of
    the tokens' texts before them)."""
    texts = [_text(spell(e.token)) for e in entries]
    offsets = list(accumulate([len(t) for t in texts], initial=offset))[:-1]
    return {
        "tokens": texts,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{_text(spell(t)): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


def finish_reason(stats: GenerationStats, calls: Sequence[ToolCall] = ()) -> str:
    """OpenAI's finish_reason for verispec's stop reason: "tool_calls" at an end-of-sequence token after
    ``calls``, else "stop" there or at a stop string, "length" at max_tokens or the end of the context."""
    if stats.stop_reason == "eos" and calls:
        return "tool_calls"
    return "stop" if stats.stop_reason in ("eos", "stop_string") else "length"


def usage(prompt_tokens: int, stats: GenerationStats) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: the prompt's first tokens whose keys and values the slot
    still held (not scored again)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": stats.new_tokens,
        "total_tokens": prompt_tokens + stats.new_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens},
    }


def speculation(stats: GenerationStats) -> dict[str, Any]:
    """What speculation did for one request: the ``verispec`` object of every response."""
    return {
        "drafter": stats.drafter,
        "k": stats.k,
        "target_calls": stats.target_calls,
        "tokens_per_target_call": stats.tokens_per_target_call,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_by_position": stats.acceptance_per_position,
        "draft_seconds": stats.draft_seconds,
        "target_seconds": stats.target_seconds,
        "prefill_seconds": stats.prefill_seconds,
    }


def new_id(prefix: str) -> tuple[str, int]:
    """A response id and its creation time (Unix seconds)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
