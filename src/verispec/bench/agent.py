"""The bench's agent loop with real tool calls (the ``agent_calls`` task): each item brings OpenAI ``tools``
definitions, a ``tool_choice`` and a most number of turns; a sample generates with the tools, reads the
calls, answers each with a deterministic fake tool (:func:`answer`: a pure function of the function's name
and arguments, over a small fixed corpus), appends the assistant's message with its ``tool_calls`` and one
``tool`` message per call, as OpenAI's API defines them, and goes on until the model calls nothing, calls
``finish``, or the turns run out (:func:`run_loop`). Every call is checked apart from the grammar that
made it (the standard library's JSON parser and ``jsonschema``: :func:`valid_call`).

Light to import: the loop is handed a function that generates one reply (the bench's, through
``Speculator.stream`` with ``GenerationOptions(chat=True, tools=...)``, the path a user takes)."""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from verispec.bench.schemas import valid_json
from verispec.errors import UsageError
from verispec.grammar.tools import CALL_CLOSE, ToolCall, Tools, read_calls
from verispec.inputs import is_int

__all__ = ["FINISH", "Agent", "Loop", "answer", "calculate", "read_reply", "run_loop", "valid_call"]

FINISH = "finish"  # the function whose call ends the loop
_MOST_TURNS = 8
R = TypeVar("R")  # what a loop's reply function returns: verispec's text, a peer's message

# ---------------------------------------------------------------------------------------------- fake tools

PAGES = {  # url → (title, text): what search finds and fetch reads
    "https://example.org/alder-bridge": (
        "Alder Bridge",
        "The Alder Bridge crosses the river Wenn at Halmstead. It opened in 1931, is 412 metres long and "
        "carries two rail tracks and a footpath.",
    ),
    "https://example.org/wenn": (
        "River Wenn",
        "The Wenn rises in the Corran hills and runs 186 km to the sea at Port Ebb. Its main bridges are the "
        "Alder Bridge and the Salt Ferry crossing.",
    ),
    "https://example.org/halmstead": (
        "Halmstead",
        "Halmstead is a market town of 48,200 people on the river Wenn. Its library opens 9:00 to 17:30, "
        "closed on Sundays.",
    ),
    "https://example.org/port-ebb": (
        "Port Ebb",
        "Port Ebb, at the mouth of the Wenn, has 131,500 people and a ferry to the Skerry islands twice a "
        "day.",
    ),
    "https://example.org/bread": (
        "Plain loaf",
        "A plain loaf: 500 g flour, 320 g water, 10 g salt, 7 g yeast. Rise 90 minutes, bake 35 minutes at "
        "220 C.",
    ),
    "https://example.org/skerry": (
        "Skerry islands",
        "The Skerry islands are four small islands 22 km off Port Ebb; 640 people live on the largest, Holm.",
    ),
}
FILES = {  # path → content: what list_files lists and read_file reads
    "README.md": "# tally\nA command-line counter. Run `python tally.py FILE` to count the words of FILE.\n",
    "tally.py": "import sys\n\n\ndef count(text):\n    return len(text.split())\n\n\n"
    "print(count(open(sys.argv[1]).read()))\n",
    "notes/todo.txt": "- count lines too\n- read from stdin when no FILE is given\n",
    "setup.cfg": "[metadata]\nname = tally\nversion = 0.3.1\n",
}
WEATHER = {  # city → (condition, temperature in C)
    "halmstead": ("rain", 11),
    "port ebb": ("wind", 9),
    "holm": ("fog", 7),
    "paris": ("sun", 18),
}
_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_LONGEST_EXPRESSION = 200


def calculate(expression: str) -> float:
    """The value of an arithmetic expression: numbers, ``+ - * / % **`` and brackets, nothing else (never
    evaluated as code: its syntax tree is walked). ValueError for anything else, a division by zero or a
    value too large."""
    if len(expression) > _LONGEST_EXPRESSION:
        raise ValueError("the expression is too long")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError("not an arithmetic expression") from None

    def value(node: ast.AST) -> float:
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, (int, float))
            and not isinstance(node.value, bool)
        ):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            inner = value(node.operand)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
                raise ValueError("a power too large")
            try:
                return _OPERATORS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ValueError("division by zero") from None
        raise ValueError("only numbers, + - * / % ** and brackets")

    result = value(tree.body)
    try:
        number = float(result)  # a complex power's is not one
    except (TypeError, OverflowError):
        raise ValueError("the value is not a finite number") from None
    if not math.isfinite(number):
        raise ValueError("the value is not a finite number")
    return round(number, 6)


def _search(query: str) -> list[dict[str, str]]:
    """The pages (at most 3) that share the most words with ``query``, ties by address."""
    words = {w.strip(".,?!").lower() for w in query.split()} - {""}
    scores = {
        url: len(words & {w.strip(".,").lower() for w in f"{title} {text}".split()})
        for url, (title, text) in PAGES.items()
    }
    found = sorted((url for url, score in scores.items() if score), key=lambda url: (-scores[url], url))
    return [{"title": PAGES[url][0], "url": url} for url in found[:3]]


def _result(name: str, arguments: Mapping[str, Any]) -> object:
    """What function ``name`` answers to ``arguments`` (a KeyError or a ValueError for bad arguments)."""
    if name == "search":
        return _search(str(arguments["query"]))
    if name == "fetch":
        url = str(arguments["url"])
        return {"status": 200, "text": PAGES[url][1]} if url in PAGES else {"status": 404, "text": ""}
    if name == "list_files":
        folder = str(arguments.get("folder", "")).strip("/")
        return sorted(path for path in FILES if not folder or path.startswith(folder + "/"))
    if name == "read_file":
        path = str(arguments["path"]).strip("/")
        return {"content": FILES[path]} if path in FILES else {"error": f"no file {path}"}
    if name == "calculator":
        return {"value": calculate(str(arguments["expression"]))}
    if name == "get_weather":
        city = str(arguments["city"]).strip().lower()
        if city not in WEATHER:
            return {"error": f"no weather for {arguments['city']}"}
        condition, celsius = WEATHER[city]
        fahrenheit = arguments.get("unit") == "F"
        return {"condition": condition, "temperature": round(celsius * 9 / 5 + 32) if fahrenheit else celsius}
    if name == FINISH:
        return {"ok": True}
    raise ValueError(f"no tool named {name}")


def answer(name: str, arguments: str) -> str:
    """The fake tool's result for a call of function ``name`` with ``arguments`` (JSON text), as JSON text:
    a pure function of the two (no clock, no randomness, no state), ``{"error": ...}`` for arguments it
    cannot use."""
    try:
        given = json.loads(arguments)
        if not isinstance(given, dict):
            raise ValueError("arguments must be an object")
        result = _result(name, given)
    except (ValueError, KeyError, TypeError) as err:
        result = {"error": str(err) if not isinstance(err, KeyError) else f"missing {err}"}
    return json.dumps(result)


# ---------------------------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Agent:
    """An agent-loop item's tools (its ``tool_choice`` among them) and the most turns it runs."""

    tools: Tools
    turns: int

    @classmethod
    def of(cls, data: Mapping[str, Any], where: str) -> Agent | None:
        """The agent of a task line's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``max_turns``
        (None without tools); UsageError naming ``where`` for a bad one."""
        if "tools" not in data:
            if any(key in data for key in ("tool_choice", "parallel_tool_calls", "max_turns")):
                raise UsageError(f'{where}: "tool_choice", "parallel_tool_calls", "max_turns" need "tools"')
            return None
        try:
            tools = Tools.of(data["tools"], data.get("tool_choice"), data.get("parallel_tool_calls"))
        except UsageError as err:
            raise UsageError(f"{where}: {err}") from None
        turns = data.get("max_turns", 4)
        if tools is None or tools.choice == "none":
            raise UsageError(f'{where}: an agent item needs "tools" it may call (tool_choice not none)')
        if not is_int(turns) or not 1 <= turns <= _MOST_TURNS:
            raise UsageError(f'{where}: "max_turns" must be an integer in [1, {_MOST_TURNS}]')
        return cls(tools, turns)


def valid_call(tools: Tools, call: ToolCall) -> bool:
    """Whether ``call`` names a function of ``tools`` and its arguments parse and validate against that
    function's schema (checked apart from the grammar engine: :func:`~verispec.bench.schemas.valid_json`)."""
    function = next((f for f in tools.functions if f.name == call.name), None)
    return function is not None and valid_json(call.arguments, function.parameters)


@dataclass
class Loop:
    """What one run of the loop did: the conversation each turn was generated from (OpenAI's messages),
    the calls made whole, those valid, and those a token limit cut off (never answered: the loop ends)."""

    conversations: list[list[dict[str, Any]]] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    valid: int = 0
    cut: int = 0

    @property
    def turns(self) -> int:
        return len(self.conversations)


def read_reply(text: str) -> tuple[str | None, list[ToolCall], int]:
    """verispec's reply ``text`` read: its content, its whole calls and how many a token limit cut off (the
    last, where the output ended inside it: left out)."""
    content, calls = read_calls(text)
    last = calls[-1] if calls else None
    if last is not None and not text[text.rfind(last.arguments) + len(last.arguments) :].startswith(
        "}" + CALL_CLOSE
    ):
        return content, calls[:-1], 1
    return content, calls, 0


def run_loop(
    tools: Tools,
    turns: int,
    messages: list[dict[str, Any]],
    reply: Callable[[list[dict[str, Any]]], R | None],
    read: Callable[[R], tuple[str | None, list[ToolCall], int]],
) -> Loop:
    """The agent loop from ``messages``: ``reply(conversation)`` generates the assistant's reply (verispec's:
    its text, held to ``tools``' grammar; None: the conversation no longer fits, the loop ends), ``read``
    gives its content, its calls and those cut off (:func:`read_reply`; a peer's reads its own), the calls
    are checked (:func:`valid_call`) and answered by the fake tools (:func:`answer`); the assistant's message
    with its ``tool_calls`` (content None where only calls were made; ids ``call_<turn>_<index>``, the same
    in every run) and a ``tool`` message per call are appended, and the next turn generates from there. It
    ends after ``turns`` turns, after a turn without a call or with a call of ``finish``, or after a call
    cut off by the token limit (counted apart, never answered)."""
    loop = Loop()
    conversation = list(messages)
    for turn in range(turns):
        out = reply(list(conversation))
        if out is None:
            break
        loop.conversations.append(list(conversation))
        content, calls, cut = read(out)
        loop.cut += cut
        for index, call in enumerate(calls):
            call.id = f"call_{turn}_{index}"
        loop.calls += calls
        loop.valid += sum(valid_call(tools, call) for call in calls)
        if not calls or cut:
            break
        conversation += [
            {"role": "assistant", "content": content, "tool_calls": [call.as_dict() for call in calls]},
            *({"role": "tool", "tool_call_id": c.id, "content": answer(c.name, c.arguments)} for c in calls),
        ]
        if any(call.name == FINISH for call in calls):
            break
    return loop
