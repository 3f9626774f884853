"""Tool calls (OpenAI's function calling), well formed by construction and exact under speculation.

:class:`Tools` is what a generation may call and how, parsed once from OpenAI's JSON (``tools``,
``tool_choice``, ``parallel_tool_calls``) by :meth:`Tools.of`, the one door of the server, the command line
and the library. A call is written in one syntax, the Hermes/Qwen convention, the same for every model::

    <tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call>

(parallel calls one per line), and :attr:`Tools.constraint` is the llguidance grammar of what a choice
allows: ``required``, one call (several with ``parallel``) and nothing else; a function's name, that
function's call; ``auto``, free text that holds no ``<tool_call>``, or text followed by calls; ``none``, no
grammar (the tools only rendered). Each function's arguments are ``%json`` of its ``parameters`` schema
(compact JSON unless the schema's ``"x-guidance"`` says otherwise), so a call always parses and its
arguments validate. It is just another :class:`~verispec.grammar.Constraint`: the output stays exactly the
target's constrained distribution under every drafter (:mod:`verispec.grammar`), and the text a choice
forces (``<tool_call>{"name": "``, a lone function's name) is proposed as free drafts.

The prompt: a chat template that references ``tools`` renders them itself (transformers'
``apply_chat_template(..., tools=...)``, calls' arguments as objects); any other gets the fallback
(:func:`template_messages`): the tools as JSON lines in the system message with the call syntax, an
assistant's calls written in that syntax after its content, tool results as a user turn of
``<tool_response>`` blocks. :class:`CallReader` reads the calls back from the output, streamed or whole.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from verispec.errors import UsageError
from verispec.grammar.constraint import COMPACT_JSON, Constraint, InvalidConstraint
from verispec.inputs import check_text, did_you_mean, parse_json

__all__ = [
    "CHOICES",
    "CallDelta",
    "CallReader",
    "Function",
    "InvalidTools",
    "ToolCall",
    "Tools",
    "read_calls",
    "template_messages",
]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")  # tool_choice by word; else a function's name
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function names
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
_HEAD = '{"name": "'
_ARGUMENTS = '", "arguments": '
INSTRUCTIONS = (
    "You may call functions. Their definitions, one JSON object per line:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, write its name and arguments as a JSON object within <tool_call></tool_call> "
    'tags:\n<tool_call>{{"name": <function-name>, "arguments": <arguments-json-object>}}</tool_call>'
)
"""The fallback's system text (``{tools}``: one JSON definition per line)."""


class InvalidTools(UsageError):
    """Tools that cannot be called: ``field`` names the part of the request at fault (``tools``,
    ``tool_choice``, ``parallel_tool_calls``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}{message}")
        self.field = field.split("[")[0].split(".")[0]


@dataclass(frozen=True)
class Function:
    """One callable function: its ``name`` (1-64 letters, digits, ``_``, ``-``), ``description`` and
    ``parameters``, the JSON text of an object schema (checked on construction: InvalidTools)."""

    name: str
    description: str = ""
    parameters: str = json.dumps(_NO_PARAMETERS)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise InvalidTools("tools", f": a function's name is 1 to 64 of a-z, A-Z, 0-9, _ and -, "
                                        f"not {str(self.name)[:70]!r}")  # fmt: skip
        whose = f": function {self.name}'s"
        if not isinstance(self.description, str):
            raise InvalidTools("tools", f"{whose} description must be text")
        try:
            schema = parse_json(self.parameters) if isinstance(self.parameters, str) else None
        except UsageError as err:
            raise InvalidTools("tools", f"{whose} parameters: {err}") from None
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise InvalidTools("tools", f"{whose} parameters must be an object's JSON schema")
        try:
            Constraint("json_schema", json.dumps(self.arguments))
        except InvalidConstraint as err:
            raise InvalidTools("tools", f"{whose} parameters: {err}") from None

    @property
    def definition(self) -> dict[str, Any]:
        """OpenAI's definition of it (what chat templates render)."""
        own = (
            {"name": self.name, "description": self.description} if self.description else {"name": self.name}
        )
        return {"type": "function", "function": {**own, "parameters": json.loads(self.parameters)}}

    @property
    def arguments(self) -> dict[str, Any]:
        """The schema its arguments are held to: ``parameters``, an object's (``"type": "object"`` where
        the schema leaves the type out: a call's arguments are an object, whatever else the schema says)."""
        return {**json.loads(self.parameters), "type": "object"}

    @property
    def rule(self) -> str:
        """Its call's body in Lark: the head naming it, its arguments' ``%json``, the call's end."""
        arguments = json.dumps({"x-guidance": COMPACT_JSON, **self.arguments})
        return (
            f"{json.dumps(_HEAD + self.name + _ARGUMENTS)} %json {arguments} {json.dumps('}' + CALL_CLOSE)}"
        )


@dataclass(frozen=True)
class Tools:
    """The functions a generation may call (``functions``, names distinct), ``choice`` (one of
    :data:`CHOICES` or a function's name) and whether ``parallel`` calls may follow one another; checked on
    construction (:class:`InvalidTools`)."""

    functions: tuple[Function, ...]
    choice: str = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.functions, tuple) or not self.functions:
            raise InvalidTools("tools", ": give at least one function")
        if not all(isinstance(f, Function) for f in self.functions):
            raise InvalidTools("tools", ": each must be a Function")
        names = [f.name for f in self.functions]
        twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
        if twice is not None:
            raise InvalidTools("tools", f": the function name {twice!r} is given twice")
        if not isinstance(self.choice, str) or self.choice not in (*CHOICES, *names):
            close = did_you_mean(str(self.choice), names) if isinstance(self.choice, str) else ""
            raise InvalidTools("tool_choice", f": {str(self.choice)[:70]!r} names no function given{close}; "
                               f"choose none, auto, required or one of {', '.join(names)}")  # fmt: skip
        if not isinstance(self.parallel, bool):
            raise InvalidTools("parallel_tool_calls", ": must be true or false")
        try:
            self.constraint  # noqa: B018  # compiled and checked now, not when a request runs
        except InvalidConstraint as err:
            raise InvalidTools("tools", f": {err}") from None

    @classmethod
    def of(
        cls, tools: object, tool_choice: object = None, parallel_tool_calls: object = None
    ) -> Tools | None:
        """The tools of OpenAI's ``tools`` list (``{"type": "function", "function": {"name", "description",
        "parameters", "strict"}}`` each), ``tool_choice`` (``"none"``, ``"auto"``, ``"required"``, or
        ``{"type": "function", "function": {"name": ...}}``; default auto) and ``parallel_tool_calls``
        (default true); None for no tools (None or an empty list, with no choice but none). Every bad shape
        is a one-line :class:`InvalidTools` naming where."""
        if tool_choice is not None and not (tool_choice in CHOICES or isinstance(tool_choice, dict)):
            raise InvalidTools("tool_choice", ': must be "none", "auto", "required" or a function object')
        if isinstance(tool_choice, dict):
            tool_choice = _named_choice(tool_choice)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise InvalidTools("parallel_tool_calls", ": must be true or false")
        if tools is None or tools == []:
            if tool_choice not in (None, "none"):
                raise InvalidTools("tool_choice", ": needs tools to choose from")
            return None
        if not isinstance(tools, list):
            raise InvalidTools("tools", ": must be a list of function definitions")
        functions = tuple(_function(i, tool) for i, tool in enumerate(tools))
        return cls(functions, "auto" if tool_choice is None else tool_choice,
                   True if parallel_tool_calls is None else parallel_tool_calls)  # fmt: skip

    @property
    def definitions(self) -> list[dict[str, Any]]:
        """OpenAI's definitions of the functions (what a chat template renders)."""
        return [f.definition for f in self.functions]

    @property
    def instructions(self) -> str:
        """The fallback's system text: the definitions and the call syntax."""
        return INSTRUCTIONS.format(tools="\n".join(json.dumps(d) for d in self.definitions))

    @cached_property
    def constraint(self) -> Constraint | None:
        """The grammar of what the choice allows (None for ``none``)."""
        if self.choice == "none":
            return None
        chosen = [f for f in self.functions if self.choice in ("auto", "required", f.name)]
        rules = [f"call_{i}: {f.rule}" for i, f in enumerate(chosen)]
        several = self.parallel and self.choice in ("auto", "required")  # a named function: its one call
        more = f'("\\n" {json.dumps(CALL_OPEN)} call)*' if several else ""
        calls = ["call: " + " | ".join(f"call_{i}" for i in range(len(chosen))), *rules]
        if self.choice != "auto":
            return Constraint("grammar", "\n".join([f"start: {json.dumps(CALL_OPEN)} call {more}", *calls]))
        text = [  # free text in which no call begins, or text up to the first call's start and the calls
            f"start: FREE | head call {more}",
            f"head[lazy]: TEXT {json.dumps(CALL_OPEN)}",
            r"TEXT: /(.|\n)*/",
            rf"FREE: /(.|\n)*/ & ~/(.|\n)*{re.escape(CALL_OPEN)}(.|\n)*/",
        ]
        return Constraint("grammar", "\n".join(["%llguidance {}", *text, *calls]))


def _named_choice(choice: dict[str, Any]) -> str:
    """The name of OpenAI's ``{"type": "function", "function": {"name": ...}}`` tool_choice."""
    function = choice.get("function")
    if set(choice) != {"type", "function"} or choice["type"] != "function" or not isinstance(function, dict) \
            or set(function) != {"name"} or not isinstance(function["name"], str):  # fmt: skip
        raise InvalidTools(
            "tool_choice", ': an object must be {"type": "function", "function": {"name": ...}}'
        )
    return function["name"]


def _function(index: int, tool: object) -> Function:
    """The function of OpenAI's tool definition number ``index``."""
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or set(tool) != {"type", "function"} or tool["type"] != "function":
        raise InvalidTools(where, ': must be {"type": "function", "function": {...}}')
    function = tool["function"]
    if not isinstance(function, dict) or "name" not in function:
        raise InvalidTools(f"{where}.function", ": must be an object with a name")
    unknown = set(function) - {"name", "description", "parameters", "strict"}
    if unknown:
        raise InvalidTools(f"{where}.function", f": {sorted(unknown)[0][:60]!r} is not a field of a function")
    if not isinstance(function.get("strict"), bool | None):
        raise InvalidTools(
            f"{where}.function.strict", ": must be true or false (the schema is enforced either way)"
        )
    parameters = function.get("parameters", _NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise InvalidTools(f"{where}.function.parameters", ": must be a JSON schema object")
    description = function.get("description")
    return Function(function["name"], "" if description is None else description, json.dumps(parameters))


# ---------------------------------------------------------------------------------------------- prompts


def template_messages(
    conversation: Sequence[Mapping[str, Any]], tools: Tools | None, native: bool
) -> list[dict[str, Any]]:
    """``conversation``'s messages as a chat template takes them. ``native`` (the template renders
    ``tools`` itself): an assistant's calls with their arguments as objects (transformers' convention),
    tool messages kept. Otherwise the fallback: ``tools``' :attr:`~Tools.instructions` in the system
    message (after its own text), an assistant's calls in the call syntax after its content, and each run
    of tool results one user turn of ``<tool_response>`` blocks. UsageError for a message of a bad shape."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(conversation):
        role, content = message.get("role"), message.get("content") or ""
        calls = [_call_of(i, j, call) for j, call in enumerate(message.get("tool_calls") or ())]
        if native:
            own = {**message, "content": content}
            if calls:
                own["tool_calls"] = [{"type": "function", "id": ident,
                                      "function": {"name": name, "arguments": json.loads(arguments)}}
                                     for ident, name, arguments in calls]  # fmt: skip
            out.append(own)
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            written = "\n".join(f"{CALL_OPEN}{_HEAD}{name}{_ARGUMENTS}{arguments}}}{CALL_CLOSE}"
                                for _, name, arguments in calls)  # fmt: skip
            text = f"{content}\n{written}" if content and written else content or written
            own = {key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id")}
            out.append({**own, "content": text})
    for message in out:
        message.pop("tool_results", None)
    if tools is not None and not native:
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools.instructions}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": tools.instructions})
    return out


def _call_of(message: int, index: int, call: object) -> tuple[str, str, str]:
    """(id, name, arguments' JSON text) of an assistant's call in OpenAI's shape."""
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise UsageError(f"message {message}'s tool call {index} must be {{\"id\", \"type\": \"function\", "
                         '"function": {"name", "arguments": JSON text}}')  # fmt: skip
    if not _NAME.fullmatch(name):
        raise UsageError(f"message {message}'s tool call {index}: a function's name is 1 to 64 of a-z, A-Z, "
                         f"0-9, _ and -, not {name[:70]!r}")  # fmt: skip
    try:
        value = parse_json(arguments)
    except UsageError as err:
        raise UsageError(f"message {message}'s tool call {index}: its arguments are {err}") from None
    check_text(json.dumps(value, ensure_ascii=False), f"message {message}'s tool call {index}'s arguments")
    return str(call.get("id", "")), name, arguments  # type: ignore[attr-defined]  # a Mapping: it has a name


# ---------------------------------------------------------------------------------------------- reading


@dataclass
class ToolCall:
    """A call read from the output: OpenAI's ``id`` (``call_`` and random hex), the function's ``name``,
    its ``arguments`` as generated (JSON text; cut short only where the output was)."""

    id: str
    name: str
    arguments: str = ""

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's object of it."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class CallDelta:
    """A piece of call ``index``: its start (``id`` and ``name``, ``arguments`` "") or more of its
    arguments' text (``id`` and ``name`` None), as OpenAI streams them."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip


@dataclass
class CallReader:
    """Reads the calls out of an output in the call syntax as its text arrives (:meth:`feed`, then
    :meth:`close`): content (the text before the first call, its trailing whitespace dropped where a call
    follows; a prefix that may begin a call held back) as text, the calls as :class:`CallDelta`. The
    grammar guarantees the syntax; an output cut short (a token limit, a stop string) ends where it does."""

    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""  # the content answered so far
    _state: str = "text"  # text, head, arguments, end, between
    _buffer: str = ""  # text read and not yet answered
    _depth: int = 0  # the arguments' JSON nesting at the buffer's start
    _string: bool = False  # inside a JSON string there
    _escape: bool = False  # after its backslash

    def feed(self, text: str) -> list[str | CallDelta]:
        self._buffer += text
        out: list[str | CallDelta] = []
        while (step := self._step()) is not None:
            if step:
                out.append(step)
        return out

    def close(self) -> list[str | CallDelta]:
        out = self.feed("")
        if self._state == "text" and self._buffer:
            out.append(self._buffer)
            self.content += self._buffer
            self._buffer = ""
        return out

    def _step(self) -> str | CallDelta | None:
        """One piece answered ("" for a move that answers nothing), None when the buffer needs more."""
        buffer = self._buffer
        if self._state == "text":
            start = buffer.find(CALL_OPEN)
            if start >= 0:
                self._state, self._buffer = "head", buffer[start + len(CALL_OPEN) :]
                return self._content(buffer[:start].rstrip())
            held = next((n for n in range(len(CALL_OPEN) - 1, 0, -1) if buffer.endswith(CALL_OPEN[:n])), 0)
            ready = buffer[: len(buffer) - held].rstrip()
            return self._content(ready) if ready else None
        if self._state == "head":
            end = buffer.find(_ARGUMENTS)
            if end < 0:
                return None
            call = ToolCall(f"call_{secrets.token_hex(12)}", buffer[len(_HEAD) : end])
            self.calls.append(call)
            self._state, self._buffer = "arguments", buffer[end + len(_ARGUMENTS) :]
            return CallDelta(len(self.calls) - 1, "", call.id, call.name)
        if self._state == "arguments":
            cut = self._arguments_end(buffer)
            piece = buffer if cut is None else buffer[:cut]
            self._buffer = "" if cut is None else buffer[cut:]
            if cut is not None:
                self._state = "end"
            if not piece:
                return "" if cut is not None else None
            self.calls[-1].arguments += piece
            return CallDelta(len(self.calls) - 1, piece)
        closing = "}" + CALL_CLOSE if self._state == "end" else "\n" + CALL_OPEN
        if len(buffer) < len(closing):
            return None
        self._state = "between" if self._state == "end" else "head"
        self._buffer = buffer[len(closing) :]
        return ""

    def _content(self, text: str) -> str:
        """Answer the content's text up to the end of ``text`` (what the buffer began with)."""
        self._buffer = self._buffer[len(text) :] if self._state == "text" else self._buffer
        self.content += text
        return text

    def _arguments_end(self, text: str) -> int | None:
        """Where the arguments' JSON value ends in ``text`` (the characters after the buffer's start), its
        nesting carried over from the text before; None when it does not end there."""
        for i, char in enumerate(text):
            if self._string:
                self._escape, self._string = (False, True) if self._escape else (char == "\\", char != '"')
            elif char == '"':
                self._string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None


def read_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content and the calls of a whole output in the call syntax, as :class:`CallReader` reads them
    streamed: the content None where only calls were made, the whole text where none was."""
    reader = CallReader()
    reader.feed(text)
    reader.close()
    return (reader.content if reader.content or not reader.calls else None), reader.calls
