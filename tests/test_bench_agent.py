"""The bench's agent loop of tool calls (issue 55, ``agent_calls``): the fake tools are pure functions of a
call (the calculator never runs code), the task file's items, the loop's messages as OpenAI's API defines
them (the server's own request model and the ``openai`` package's message type take them), every call
validating against its schema, the same calls for every drafter (greedy, and sampled with a seed: speculation
is exact), and ``verispec bench --tasks agent_calls`` on stories260K given a plain chat template."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionMessage

from test_bench import run
from test_tools import fallback_chat, stories  # noqa: F401  # stories: stories260K with a plain chat template
from toy import single_threaded
from verispec.api import Speculator
from verispec.bench.agent import FINISH, answer, calculate, read_reply, run_loop, valid_call
from verispec.bench.prompts import builtin_tasks, load_prompts
from verispec.drafting.suffix_cache import SuffixCache
from verispec.errors import UsageError
from verispec.grammar.tools import Tools
from verispec.models.llama2c import Llama2cTokenizer
from verispec.options import DEFAULT_SAMPLING, GenerationOptions, SamplingParams
from verispec.server.schema import ChatRequest, parse_request


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


# ---------------------------------------------------------------------------------------------- fake tools


CALLS = [
    ("search", {"query": "Alder Bridge river"}),
    ("search", {"query": "nothing matches this"}),
    ("fetch", {"url": "https://example.org/wenn"}),
    ("fetch", {"url": "https://example.org/absent"}),
    ("list_files", {}),
    ("list_files", {"folder": "notes"}),
    ("read_file", {"path": "setup.cfg"}),
    ("read_file", {"path": "../etc/passwd"}),
    ("calculator", {"expression": "(131500 - 48200) / 2"}),
    ("get_weather", {"city": "Paris", "unit": "F"}),
    ("get_weather", {"city": "Atlantis"}),
    (FINISH, {"answer": "412 metres"}),
]


def test_the_fake_tools_are_pure_functions_of_the_call():
    answers = [answer(name, json.dumps(arguments)) for name, arguments in CALLS]
    assert answers == [answer(name, json.dumps(arguments)) for name, arguments in CALLS]  # no state
    results = [json.loads(a) for a in answers]
    assert results[0][0] == {"title": "Alder Bridge", "url": "https://example.org/alder-bridge"}
    assert results[1] == [] and results[3] == {"status": 404, "text": ""}
    assert "186 km" in results[2]["text"] and results[4] == [
        "README.md",
        "notes/todo.txt",
        "setup.cfg",
        "tally.py",
    ]
    assert results[5] == ["notes/todo.txt"] and "0.3.1" in results[6]["content"] and "error" in results[7]
    assert results[8] == {"value": 41650.0} and results[9] == {"condition": "sun", "temperature": 64}
    assert "error" in results[10] and results[11] == {"ok": True}
    for bad in ("[1]", "{}", "not json"):  # arguments it cannot use: an error as the tool's answer
        assert "error" in json.loads(answer("fetch", bad))
    assert "no tool named" in json.loads(answer("shell", "{}"))["error"]


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "open('x')", "(1).real", "[1, 2]", "x + 1", "lambda: 1", "9 ** 999",
     "1 / 0", "5 % 0", "(-8) ** 0.5", "True + 1", "False", "1e308 * 10", "1 +", "1" * 201, "'a' * 3"],
)  # fmt: skip
def test_the_calculator_evaluates_arithmetic_alone(expression):
    with pytest.raises(ValueError):
        calculate(expression)


def test_the_calculator_computes():
    assert calculate("2 + 3 * 4") == 14 and calculate("-(2 ** 10) % 7") == -(2**10) % 7
    assert calculate(" 0.175 * 2480 + 36 ") == 470.0 and calculate("7 / 2") == 3.5


# ---------------------------------------------------------------------------------------------- items


def test_the_task_file_holds_agent_items():
    items = builtin_tasks()["agent_calls"]
    assert 6 <= len(items) <= 10
    for item in items:
        assert item.agent is not None and 2 <= len(item.agent.tools.functions) <= 4, item.id
        assert item.agent.tools.choice in ("auto", "required") and item.agent.turns >= 3
        assert [role for role, _ in item.messages] == ["system", "user"]
    assert {i.agent.tools.choice for i in items if i.agent} == {"auto", "required"}
    named = {f.name for i in items if i.agent for f in i.agent.tools.functions}
    assert {"search", "fetch", "calculator", FINISH} <= named
    for name in named:  # every function has a fake tool
        assert "no tool named" not in answer(name, "{}")


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"tool_choice": "auto"}, 'need "tools"'),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "mine.jsonl:1: tools: a function's"),
        ({"tools": "TOOLS", "tool_choice": "none"}, "tool_choice not none"),
        ({"tools": "TOOLS", "max_turns": 0}, '"max_turns" must be'),
        ({"tools": "TOOLS", "max_turns": True}, '"max_turns" must be'),
        ({"tools": "TOOLS", "follow_ups": ["more"]}, 'no "follow_ups"'),
        ({"tools": "TOOLS", "schema": {"type": "object"}}, 'no "follow_ups" or "schema"'),
    ],
)
def test_bad_agent_items_are_one_line(tmp_path, fields, fragment):
    tools = builtin_tasks()["agent_calls"][0]
    definitions = tools.agent.tools.definitions if tools.agent else []
    line = {"prompt": "hi", **{k: definitions if v == "TOOLS" else v for k, v in fields.items()}}
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(UsageError) as info:
        load_prompts(path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------- the loop

SEARCH_FETCH = Tools.of(builtin_tasks()["agent_calls"][0].agent.tools.definitions, "auto")  # type: ignore[union-attr]


def call(name: str, arguments: dict) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def test_the_loop_appends_messages_as_openai_defines_them():
    assert SEARCH_FETCH is not None
    script = [
        "Let me look."
        + "\n"
        + call("search", {"query": "Alder Bridge"})
        + "\n"
        + call("fetch", {"url": "x"}),
        call("fetch", {"url": "https://example.org/alder-bridge"}),
        call(FINISH, {"answer": "412 m, over the Wenn"}),
        "never asked",
    ]
    replies = iter(script)
    seen: list[list[dict]] = []

    def reply(conversation):
        seen.append(conversation)
        return next(replies)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How long?"}]
    loop = run_loop(SEARCH_FETCH, 5, messages, reply, read_reply)
    assert loop.turns == 3 and loop.conversations == seen and len(loop.calls) == 4 and loop.valid == 4
    final = seen[-1]
    assert final[:2] == messages and [m["role"] for m in final[2:]] == [
        "assistant", "tool", "tool", "assistant", "tool"
    ]  # fmt: skip
    first = final[2]
    assert first["content"] == "Let me look." and [c["id"] for c in first["tool_calls"]] == [
        "call_0_0",
        "call_0_1",
    ]
    assert first["tool_calls"][0] == {
        "id": "call_0_0", "type": "function",
        "function": {"name": "search", "arguments": json.dumps({"query": "Alder Bridge"})},
    }  # fmt: skip
    assert final[3] == {"role": "tool", "tool_call_id": "call_0_0",
                        "content": answer("search", json.dumps({"query": "Alder Bridge"}))}  # fmt: skip
    assert final[4]["tool_call_id"] == "call_0_1" and json.loads(final[4]["content"])["status"] == 404
    assert final[5]["content"] is None and final[5]["tool_calls"][0]["id"] == "call_1_0"
    # the server's own request model takes every conversation, and the openai package's message type
    # each assistant message
    for conversation in seen:
        body = {"model": "m", "messages": conversation, "tools": SEARCH_FETCH.definitions}
        assert isinstance(parse_request(ChatRequest, body), ChatRequest)
    for message in final:
        if message["role"] == "assistant":
            assert ChatCompletionMessage.model_validate(message).tool_calls


def test_the_loop_ends_without_a_call_on_a_cut_call_or_when_the_context_is_full():
    assert SEARCH_FETCH is not None
    loop = run_loop(
        SEARCH_FETCH, 4, [{"role": "user", "content": "hi"}], lambda c: "Nothing to call.", read_reply
    )
    assert loop.turns == 1 and loop.calls == [] and loop.cut == 0
    cut = call("search", {"query": "a"}) + "\n" + call("fetch", {"url": "https://exa"})[:-20]
    loop = run_loop(SEARCH_FETCH, 4, [{"role": "user", "content": "hi"}], lambda c: cut, read_reply)
    assert (
        loop.turns == 1 and [c.name for c in loop.calls] == ["search"] and loop.valid == 1 and loop.cut == 1
    )
    loop = run_loop(SEARCH_FETCH, 4, [{"role": "user", "content": "hi"}], lambda c: None, read_reply)
    assert loop.turns == 0 and loop.calls == []


def test_an_invalid_call_is_counted_invalid():
    """The check is the bench's own (jsonschema), not the grammar's: a call the grammar never makes fails."""
    from verispec.grammar.tools import ToolCall

    assert SEARCH_FETCH is not None
    assert valid_call(SEARCH_FETCH, ToolCall("1", "search", '{"query": "short"}'))
    assert not valid_call(SEARCH_FETCH, ToolCall("1", "search", json.dumps({"query": "x" * 49})))
    assert not valid_call(SEARCH_FETCH, ToolCall("1", "search", '{"q": "a"}'))
    assert not valid_call(SEARCH_FETCH, ToolCall("1", "delete", "{}"))


@pytest.mark.parametrize("sampling", [DEFAULT_SAMPLING, SamplingParams(temperature=0.7, seed=5)])
def test_every_drafter_makes_the_same_calls_and_each_validates(stories, sampling):  # noqa: F811
    """Through ``Speculator.generate`` with the item's tools (the path a user takes): none, n-gram, suffix
    from an empty cache and from a warm one make the same calls, greedy and seeded, all valid."""
    _, model, tokenizer = stories
    item = builtin_tasks()["agent_calls"][1]  # required: a call every turn
    assert item.agent is not None
    runs = {}
    warm = SuffixCache()
    warm.add([], tokenizer.encode('<tool_call>{"name": "search", "arguments": {"query": "Port Ebb"}}'))
    for name, cache in (("none", None), ("ngram", None), ("suffix", None), ("suffix-warm", warm)):
        speculator = Speculator((model, tokenizer), drafter=name.removesuffix("-warm"))
        if cache is not None:
            speculator.suffix_cache = cache
        options = GenerationOptions(
            chat=True, tools=item.agent.tools, max_new_tokens=96, k=3, sampling=sampling
        )
        messages = [{"role": role, "content": content} for role, content in item.messages]
        runs[name] = run_loop(
            item.agent.tools,
            3,
            messages,
            lambda c, s=speculator, o=options: s.generate(c, o).text,
            read_reply,
        )
    first = runs["none"]
    assert first.turns >= 2 and first.calls and first.valid == len(first.calls), first
    for name, loop in runs.items():
        assert loop.conversations == first.conversations, name
        assert [(c.name, c.arguments) for c in loop.calls] == [(c.name, c.arguments) for c in first.calls]


# ---------------------------------------------------------------------------------------------- the bench


def test_bench_runs_the_agent_task(stories, capsys, tmp_path, monkeypatch):  # noqa: F811
    root, _, _ = stories
    monkeypatch.setattr(Llama2cTokenizer, "chat_prompt", lambda self, c, tools=None: fallback_chat(c, tools))
    out = tmp_path / "out"
    argv = ["bench", "--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin"),
            "--threads", "1", "--tasks", "agent_calls", "--prompts-per-task", "1", "--repetitions", "1",
            "--max-new-tokens", "96", "--k", "3", "--temperature", "0,0.7", "--seed", "3",
            "--methods", "none,ngram,suffix,suffix-warm,none-unconstrained", "--out", str(out)]  # fmt: skip
    status, stdout, _ = run(capsys, *argv)
    assert status == 0
    results = json.loads((out / "results.json").read_text())
    table = (out / "results.md").read_text()
    cells = {(c["label"], c["temperature"]): c for c in results["cells"]}
    labels = {"none", "ngram k=3", "suffix k=3", "suffix-warm k=3", "none-unconstrained"}
    assert set(cells) == {(label, t) for label in labels for t in (0, 0.7)}
    for (label, temperature), cell in cells.items():
        [sample] = cell["samples"]
        assert sample["turns"] >= 1 and cell["metrics"]["tokens_per_second"]["median"] > 0
        scored, prompt = cell["metrics"]["prompt_scored"]  # every turn's prompt counted, later ones kept
        assert prompt == sample["prompt_tokens"] and scored == prompt - sample["cached_prompt_tokens"]
        assert (scored < prompt) == (sample["turns"] > 1) and f"{scored:.0f}/{prompt:.0f}" in table
        if label == "none-unconstrained":  # none's conversations, no grammar: no call, no check
            assert (
                sample["tool_calls"] == 0 and cell["schema_valid"] is None and cell["greedy_identity"] is None
            )
            assert sample["turns"] == cells[("none", temperature)]["samples"][0]["turns"]
            continue
        made = sample["tool_calls"]
        assert made >= 1 and sample["valid_tool_calls"] == made, label
        assert cell["schema_valid"] == {"checked": made, "valid": made, "invalid": []} | (
            {"cut": sample["cut_tool_calls"]} if sample["cut_tool_calls"] else {}
        )
        assert sample["forced"] > 0 and cell["metrics"]["forced_share"] > 0
        if temperature == 0:
            assert cell["greedy_identity"] == {"compared": 1, "differ": []}, label
    for temperature in (0, 0.7):  # speculation is exact: every method the same calls, greedy and seeded
        calling = labels - {"none-unconstrained"}
        assert len({tuple(cells[(label, temperature)]["outputs"]["agent_calls-1"]) for label in calling}) == 1
    assert (
        "## agent_calls — greedy" in table
        and "Constrained / unconstrained (`none` / `none-unconstrained`)" in table
    )
    assert f"✓ {cells[('none', 0)]['samples'][0]['tool_calls']}/" in table


def test_the_agent_task_is_refused_without_a_chat_template(stories, capsys, tmp_path):  # noqa: F811
    root, _, _ = stories  # the file's own tokenizer: llama2.c's has no chat template
    argv = ["bench", "--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin"),
            "--tasks", "agent_calls", "--methods", "none", "--out", str(tmp_path / "out")]  # fmt: skip
    status, _, err = run(capsys, *argv)
    assert status == 2 and err.count("\n") == 1 and "calls tools, rendered in the chat template" in err
