"""The bench's prompts: a task's conversations (:class:`Prompt`), read from one JSONL file per task
(:func:`load_prompts`; the built-in ones in ``verispec/data/tasks/``, :func:`builtin_tasks`), each line
checked, its number in any error."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from verispec.bench.agent import Agent
from verispec.bench.methods import TASKS
from verispec.bench.workloads import turns
from verispec.errors import UsageError
from verispec.grammar.constraint import Constraint

__all__ = ["Prompt", "builtin_tasks", "load_prompts"]

_ROLES = ("system", "user", "assistant")
_TASK_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task: a conversation ending with a user turn (a plain prompt is one user turn)."""

    task: str
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, content)
    follow_ups: tuple[str, ...] = ()  # a sequence's later user turns (:mod:`verispec.bench.workloads`)
    constraint: Constraint | None = None  # the schema a constrained method holds the output to
    agent: Agent | None = None  # an agent loop's tools and turns (a tool task's: :mod:`verispec.bench.agent`)

    def turn(self, replies: Sequence[str]) -> Prompt:
        """Request ``len(replies)`` of this sequence, after those replies (:func:`workloads.turns`)."""
        if not replies:
            return self
        messages = turns(self.messages, self.follow_ups, replies)
        return Prompt(self.task, f"{self.id}#{len(replies)}", messages, constraint=self.constraint)

    def for_model(self, chat: bool) -> str | list[dict[str, str]]:
        """What the speculator encodes: the messages for a chat template, else their contents as plain text,
        separated by blank lines."""
        if chat:
            return [{"role": role, "content": content} for role, content in self.messages]
        return "\n\n".join(content for _, content in self.messages)


def _parse_prompt(line: str, where: str, task: str, index: int) -> Prompt:
    """One JSONL line: {"prompt": str} or {"messages": [{"role", "content"}, ...]}, optional "id", "task",
    "follow_ups" (a sequence's later user turns, non-empty strings) and "schema" (a JSON schema, the output's
    for the constrained methods), or an agent loop's "tools", "tool_choice", "parallel_tool_calls" and
    "max_turns" (:class:`~verispec.bench.agent.Agent`)."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as err:
        raise UsageError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(data, dict) or ("prompt" in data) == ("messages" in data):
        raise UsageError(f'{where}: expected an object with either "prompt" or "messages"')
    if "prompt" in data:
        messages = [{"role": "user", "content": data["prompt"]}]
    else:
        messages = data["messages"]
    if not isinstance(messages, list) or not messages:
        raise UsageError(f'{where}: "messages" must be a non-empty list')
    pairs = []
    for m in messages:
        ok = isinstance(m, dict) and m.get("role") in _ROLES and isinstance(m.get("content"), str)
        if not ok or not m["content"].strip():
            raise UsageError(
                f"{where}: each message needs a role ({', '.join(_ROLES)}) and non-empty content"
            )
        pairs.append((m["role"], m["content"]))
    if pairs[-1][0] != "user":
        raise UsageError(f"{where}: the last message must be the user's")
    task = data.get("task", task)
    if not isinstance(task, str) or not _TASK_NAME.fullmatch(task):
        raise UsageError(f"{where}: \"task\" must be a name of letters, digits, '_', '.', '-'")
    prompt_id = data.get("id", f"{task}-{index}")
    if not isinstance(prompt_id, str) or not prompt_id:
        raise UsageError(f'{where}: "id" must be a non-empty string')
    follow_ups = data.get("follow_ups", [])
    if not isinstance(follow_ups, list) or not all(isinstance(f, str) and f.strip() for f in follow_ups):
        raise UsageError(f'{where}: "follow_ups" must be a list of non-empty strings')
    schema = data.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise UsageError(f'{where}: "schema" must be a JSON schema (an object)')
    try:
        constraint = Constraint.of(json_schema=schema)
    except UsageError as err:
        raise UsageError(f"{where}: {err}") from None
    agent = Agent.of(data, where)
    if agent is not None and (follow_ups or constraint is not None):
        raise UsageError(f'{where}: an agent item takes no "follow_ups" or "schema" beside "tools"')
    return Prompt(task, prompt_id, tuple(pairs), tuple(follow_ups), constraint, agent)


def load_prompts(path: str | os.PathLike, default_task: str | None = None) -> list[Prompt]:
    """The prompts of a JSONL file: one JSON object per line, ``{"prompt": "..."}`` or
    ``{"messages": [{"role": "user", "content": "..."}, ...]}`` (roles system/user/assistant, ending with the
    user's), with an optional ``"id"`` and ``"task"`` (default: the file's stem). Blank lines are skipped.
    UsageError naming the file and line for anything else."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(
            f"cannot read the prompts file {path}: {getattr(err, 'strerror', None) or err}"
        ) from None
    task = default_task or path.stem
    prompts = [_parse_prompt(line, f"{path}:{n}", task, n) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise UsageError(f"the prompts file {path} holds no prompts")
    ids = [(p.task, p.id) for p in prompts]
    if len(set(ids)) != len(ids):
        raise UsageError(f"{path}: prompt ids repeat within a task")
    return prompts


def builtin_tasks() -> dict[str, list[Prompt]]:
    """The task suite shipped with verispec: :data:`TASKS` → its prompts."""
    folder = resources.files("verispec") / "data" / "tasks"
    tasks = {}
    for name in TASKS:
        with resources.as_file(folder / f"{name}.jsonl") as path:
            tasks[name] = load_prompts(path, name)
    return tasks
