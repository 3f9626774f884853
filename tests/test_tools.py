"""Tool calls (issue 55, item 1): ``Tools`` read from OpenAI's JSON and every bad shape refused in one line,
the grammar of each ``tool_choice``, the calls read back streamed == whole, the chat template's rendering
(native where it references ``tools``, the fallback otherwise), exactness on stories260K (speculative greedy
== plain greedy for n-gram, suffix and a model draft; a seed's tokens alone == batched), the server through
the ``openai`` client (every choice whole and streamed, the calls validating against their schemas, the
400s, the round trip of calls and results) and ``generate --tools``."""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import openai
import pytest

from test_grammar import GREEDY
from test_grammar import generate as engine_generate
from test_hf_adapter import save_tokenizer
from test_server import client, raw
from toy import single_threaded
from verispec import cli
from verispec.api import Speculator
from verispec.drafting.base import NoDrafter
from verispec.drafting.draft_model import ModelDrafter
from verispec.drafting.ngram import NGramDrafter
from verispec.errors import UsageError
from verispec.grammar.tools import CallDelta, CallReader, InvalidTools, Tools, read_calls, template_messages
from verispec.models.hf import HFTokenizer
from verispec.models.llama2c import Llama2cTokenizer
from verispec.models.registry import load_model
from verispec.options import GenerationOptions, SamplingParams
from verispec.server.app import Server, ServerConfig, serving

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function",
     "function": {"name": "get_weather", "description": "A city's weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD, "strict": True}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = [{"role": "user", "content": "Once upon a time"}]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


def fallback_chat(conversation, tools=None) -> str:
    """A plain chat template for stories260K (it has none): the fallback's messages, one per line, but for
    the tools' instructions (more than its context of 512 tokens)."""
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    messages = template_messages(conversation, tools, native=False)[1 if tools else 0 :]  # 512 tokens
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


@pytest.fixture(scope="module")
def stories(shared_model):
    """(root, model, tokenizer): stories260K, its tokenizer given :func:`fallback_chat`."""
    root = shared_model("stories260K", "stories260K.bin", "tok512.bin")
    model, tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")
    tokenizer.chat_prompt = fallback_chat  # type: ignore[method-assign]
    return root, model, tokenizer


def valid(call: dict) -> bool:
    """Whether OpenAI's call object names a function given and its arguments validate against its schema."""
    function = call["function"]
    jsonschema.validate(json.loads(function["arguments"]), SCHEMAS[function["name"]])
    return call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) > 10


# ---------------------------------------------------------------------------------------------- Tools


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "field", "fragment"),
    [
        ({"type": "function"}, None, None, "tools", "must be a list"),
        ([{"type": "retrieval", "function": {}}], None, None, "tools",
         'tools[0]: must be {"type": "function"'),
        ([{"type": "function", "function": {"description": "x"}}], None, None, "tools", "with a name"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools", "1 to 64 of a-z"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": 1}}}}}],
         None, None, "tools", "function f's parameters: invalid JSON schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None, None,
         "tools", "an object's JSON schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "tools",
         "must be a JSON schema object"),
        ([{"type": "function", "function": {"name": "f", "args": {}}}], None, None, "tools",
         "'args' is not a field"),
        ([{"type": "function", "function": {"name": "f", "strict": "yes"}}], None, None, "tools", "strict"),
        (TOOLS + TOOLS[:1], None, None, "tools", "'get_weather' is given twice"),
        (TOOLS, {"type": "function", "function": {"name": "get_wether"}}, None, "tool_choice",
         "did you mean get_weather"),
        (TOOLS, "add", None, "tool_choice", 'must be "none", "auto", "required"'),
        (TOOLS, {"type": "function", "name": "add"}, None, "tool_choice", "an object must be"),
        (None, "required", None, "tool_choice", "needs tools"),
        (TOOLS, None, "yes", "parallel_tool_calls", "true or false"),
        # arguments are an object whatever the schema leaves out: one that no object satisfies is refused
        ([{"type": "function", "function": {"name": "f", "parameters": {"const": "x"}}}], None, None, "tools",
         "function f's parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"enum": [1, 2]}}}], None, None,
         "tools", "function f's parameters"),
        ([{"type": "function", "function": {"name": "f", "description": []}}], None, None, "tools",
         "description must be text"),
    ],
)  # fmt: skip
def test_bad_tools_are_one_line_naming_the_field(tools, choice, parallel, field, fragment):
    with pytest.raises(InvalidTools) as info:
        Tools.of(tools, choice, parallel)
    assert info.value.field == field and fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_tools_read_from_openai_json():
    assert Tools.of(None) is None and Tools.of([], "none") is None
    tools = Tools.of(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert tools is not None and (tools.choice, tools.parallel) == ("add", False)
    assert [f.name for f in tools.functions] == ["get_weather", "add"]
    assert tools.definitions[0] == TOOLS[0] and "strict" not in tools.definitions[1]["function"]
    none = Tools.of(TOOLS, "none")
    assert none is not None and none.constraint is None  # rendered only
    no_parameters = Tools.of([{"type": "function", "function": {"name": "now"}}], "required")
    assert no_parameters is not None
    assert json.loads(no_parameters.functions[0].parameters)["additionalProperties"] is False  # only {}


# ---------------------------------------------------------------------------------------------- reading


CALLS = (
    'Let me look.  \n<tool_call>{"name": "get_weather", "arguments": {"city":"a}</tool_call>\\"{","days":3}}'
    '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a":[1,{"b":"]"}],"b":true}}</tool_call>'
)


@pytest.mark.parametrize("size", [1, 2, 5, len(CALLS)])
def test_calls_read_streamed_in_any_pieces_equal_them_read_whole(size):
    reader = CallReader()
    pieces = [p for i in range(0, len(CALLS), size) for p in reader.feed(CALLS[i : i + size])]
    pieces += reader.close()
    content, calls = read_calls(CALLS)
    assert content == "Let me look." == "".join(p for p in pieces if isinstance(p, str))
    arguments = ['{"city":"a}</tool_call>\\"{","days":3}', '{"a":[1,{"b":"]"}],"b":true}']
    assert [(c.name, c.arguments) for c in calls] == list(zip(["get_weather", "add"], arguments, strict=True))
    deltas = [p for p in pieces if isinstance(p, CallDelta)]
    starts = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name, d.arguments) for d in starts] == [(0, "get_weather", ""), (1, "add", "")]
    for index, expected in enumerate(arguments):
        assert "".join(d.arguments for d in deltas if d.index == index) == expected
    assert {c.id for c in reader.calls}.isdisjoint(c.id for c in calls)  # ids are random


def test_text_without_calls_is_all_content():
    for text in ("", "plain text  \n", "a <tool_ca", "a <tool_call"):
        assert read_calls(text) == (text, [])
    content, calls = read_calls('<tool_call>{"name": "add", "arguments": {"a"')  # cut short
    assert content is None and [(c.name, c.arguments) for c in calls] == [("add", '{"a"')]


# ---------------------------------------------------------------------------------------------- prompts

ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Oslo","days":1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":true}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "2"},
]  # fmt: skip


def test_the_fallback_renders_tools_calls_and_results():
    tools = Tools.of(TOOLS)
    messages = template_messages(ROUND_TRIP, tools, native=False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nYou may call functions.")
    assert json.dumps(TOOLS[0]) in messages[0]["content"]
    assert messages[2]["content"] == (
        '<tool_call>{"name": "get_weather", "arguments": {"city":"Oslo","days":1}}</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a":1,"b":true}}</tool_call>'
    )  # what the grammar makes the model write: the next turn's prompt begins with the last one's output
    assert messages[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>\n"
                                                      "<tool_response>\n2\n</tool_response>"}  # fmt: skip
    plain = template_messages(QUESTION, tools, native=False)
    assert plain[0] == {"role": "system", "content": tools.instructions} and plain[1:] == QUESTION
    with pytest.raises(UsageError, match="message 0's tool call 0: its arguments are"):
        bad = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}
        template_messages([bad], None, native=False)


NATIVE = (
    "{% if tools %}<|user|>TOOLS {{ tools | tojson }}<|end|>{% endif %}{% for m in messages %}<|user|>"
    "{{ m['role'] }}:{{ m['content'] }}{% for c in m.get('tool_calls') or [] %}"
    "[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}<|end|>{% endfor %}"
)


def test_a_template_that_renders_tools_gets_them_and_any_other_the_fallback(tmp_path):
    tools = Tools.of(TOOLS)
    native = HFTokenizer.from_pretrained(save_tokenizer(tmp_path / "native", False, NATIVE))
    prompt = native.chat_prompt(ROUND_TRIP, tools=tools)
    assert prompt.startswith("<|user|>TOOLS [") and '"name": "get_weather"' in prompt.split("<|end|>")[0]
    assert '[get_weather {"city": "Oslo", "days": 1}]' in prompt  # arguments as an object
    assert "tool:sunny" in prompt and "<tool_call>" not in prompt
    plain = HFTokenizer.from_pretrained(save_tokenizer(tmp_path / "plain", False))  # no "tools" in it
    prompt = plain.chat_prompt(ROUND_TRIP, tools=tools)
    assert "You may call functions." in prompt and "<tool_response>\nsunny" in prompt
    assert plain.chat_prompt("hi") == "<s><|user|>hi<|end|>"  # without tools: as before


# ---------------------------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("choice", ["required", "add", "auto"])
def test_speculative_greedy_with_tools_equals_plain_greedy(stories, choice):
    """The tools' grammar through the engine: n-gram and a model draft (the target's first layer) ==
    constrained greedy without drafts, alone and batched; through the library (chat, the tools rendered):
    n-gram and suffix == none, every call validating."""
    _, model, tokenizer = stories
    named = {"type": "function", "function": {"name": choice}} if choice == "add" else choice
    tools = Tools.of(TOOLS, named, False)
    assert tools is not None and tools.constraint is not None
    [(expected, _)] = engine_generate(stories[1:], [(NoDrafter(), tools.constraint, GREEDY, 0)])
    draft = ModelDrafter(model.first_layers(1), GREEDY, model.vocab_size)
    requests = [(NGramDrafter(), tools.constraint, GREEDY, 4), (draft, tools.constraint, GREEDY, 3)]
    assert [ids for ids, _ in engine_generate(stories[1:], requests)] == [expected] * 2
    assert [ids for ids, _ in engine_generate(stories[1:], requests, slots=2)] == [expected] * 2
    options = GenerationOptions(chat=True, tools=tools, max_new_tokens=60, k=4)
    texts = {name: Speculator((model, tokenizer), drafter=name).generate(QUESTION, options).text
             for name in ("none", "ngram", "suffix")}  # fmt: skip
    assert len(set(texts.values())) == 1, texts
    content, calls = read_calls(texts["none"])
    if choice != "auto":
        assert content is None and len(calls) == 1 and valid(calls[0].as_dict())
        assert choice == "required" or calls[0].name == "add"


def test_a_named_function_is_called_once_and_arguments_are_an_object(stories):
    """A named tool_choice makes its one call, parallel calls allowed or not (OpenAI's); a schema that leaves
    out "type" still gets an object of arguments."""
    _, model, tokenizer = stories
    speculator = Speculator((model, tokenizer), drafter="ngram")
    untyped = {"properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
               "additionalProperties": False}  # fmt: skip
    functions = [*TOOLS, {"type": "function", "function": {"name": "count", "parameters": untyped}}]
    for choice, parallel in [({"type": "function", "function": {"name": "add"}}, True), ("required", False)]:
        tools = Tools.of(functions if choice == "required" else TOOLS, choice, parallel)
        options = GenerationOptions(chat=True, tools=tools, max_new_tokens=120, k=3)
        for seed in (1, 2):
            sampled = dataclasses.replace(options, sampling=SamplingParams(temperature=1.0, seed=seed))
            content, calls = read_calls(speculator.generate(QUESTION, sampled).text)
            assert content is None and len(calls) == 1, calls
            arguments = json.loads(calls[0].arguments)
            assert isinstance(arguments, dict)
            if calls[0].name == "count":
                jsonschema.validate(arguments, untyped)


def test_stop_strings_never_cut_a_call(stories):
    """With tools, a stop string ends the text before the first call only: a call and the calls after it are
    never cut, whatever the stop strings (here every piece of the call syntax)."""
    _, model, tokenizer = stories
    speculator = Speculator((model, tokenizer), drafter="ngram")
    tools = Tools.of(TOOLS, "required", True)
    plain = GenerationOptions(chat=True, tools=tools, max_new_tokens=80, k=3)
    reference = speculator.generate(QUESTION, plain)
    _, calls = read_calls(reference.text)
    assert calls
    stopped = dataclasses.replace(plain, stop=("}", "\n", '"', "<tool_call>", "add", "call"))
    result = speculator.generate(QUESTION, stopped)
    assert result.text == reference.text and result.token_ids == reference.token_ids
    free = Tools.of(TOOLS, "none")
    text = speculator.generate(QUESTION, GenerationOptions(chat=True, tools=free, max_new_tokens=40)).text
    word = text.split()[1]  # without calls (tool_choice none), a stop string ends the text as ever
    cut = speculator.generate(
        QUESTION, GenerationOptions(chat=True, tools=free, max_new_tokens=40, stop=(word,))
    )
    assert cut.text == text[: text.index(word)]


def test_a_seed_samples_the_same_calls_alone_and_batched(stories):
    _, model, tokenizer = stories
    speculator = Speculator((model, tokenizer), drafter="ngram")
    tools = Tools.of(TOOLS, "required", True)
    options = [
        GenerationOptions(chat=True, tools=tools, max_new_tokens=80, k=3,
                          sampling=SamplingParams(temperature=1.0, seed=seed))
        for seed in (1, 2, 3)
    ]  # fmt: skip
    alone = [speculator.generate(QUESTION, o).token_ids for o in options]
    batched = speculator.generate_batch([QUESTION] * 3, options, slots=2)
    assert [r.token_ids for r in batched] == alone
    for result in batched:
        content, calls = read_calls(result.text)
        assert content is None and calls
        finished = calls if result.stats["stop_reason"] == "eos" else calls[:-1]  # the last one may be cut
        assert all(valid(c.as_dict()) for c in finished)


def test_tools_that_overflow_the_context_are_named_in_its_refusal(stories):
    """The fallback's tool instructions alone are longer than stories260K's context: the one-line refusal says
    how many of the prompt's tokens the tools' definitions are; the conversation without them is answered."""
    root, model, _ = stories
    tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")[1]
    tokenizer.chat_prompt = lambda conversation, tools=None: "".join(  # type: ignore[method-assign]
        f"{m['role']}: {m['content']}\n" for m in template_messages(conversation, tools, native=False)
    )
    speculator = Speculator((model, tokenizer), drafter="none")
    alone = len(speculator.encode_prompt(QUESTION, chat=True))
    with pytest.raises(UsageError) as info:
        speculator.generate(QUESTION, GenerationOptions(chat=True, tools=Tools.of(TOOLS), max_new_tokens=4))
    match = re.fullmatch(r"the prompt has (\d+) tokens, (\d+) of them the tools' definitions; "
                         r"the context holds 512", str(info.value))  # fmt: skip
    assert match and int(match[1]) >= 512 and int(match[1]) - int(match[2]) == alone, info.value
    assert speculator.generate(QUESTION, GenerationOptions(chat=True, max_new_tokens=4)).token_ids


def test_options_refuse_tools_without_chat_or_beside_a_constraint():
    from verispec.grammar import Constraint

    tools = Tools.of(TOOLS)
    with pytest.raises(UsageError, match="give chat=True"):
        GenerationOptions(tools=tools)
    with pytest.raises(UsageError, match="not both"):
        GenerationOptions(chat=True, tools=tools, constraint=Constraint("json_object"))
    GenerationOptions(chat=True, tools=Tools.of(TOOLS, "none"), constraint=Constraint("json_object"))


# ---------------------------------------------------------------------------------------------- server


@pytest.fixture(scope="module")
def served(stories):
    root, model, tokenizer = stories
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="ngram", max_batch=2, k="3")
    rendered: list[str] = []

    def recorded(conversation, tools=None):
        rendered.append(fallback_chat(conversation, tools))
        return rendered[-1]

    served_tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")[1]
    served_tokenizer.chat_prompt = recorded  # type: ignore[method-assign]
    with serving(Server(config, loaded=(model, served_tokenizer))) as url:
        yield url, Speculator((model, tokenizer), drafter="ngram"), rendered


def ask(url: str, stream: bool, **fields):
    body = dict(model="stories260K", messages=QUESTION, max_tokens=80, temperature=0, tools=TOOLS) | fields
    answer = client(url).chat.completions.create(**body, stream=stream)
    if not stream:
        choice = answer.choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    chunks = [c for c in answer if c.choices]
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            if part.id is not None:  # a call's first delta: its id, type and name, its arguments ""
                assert part.index not in calls and part.function.arguments == "" and part.type == "function"
                calls[part.index] = {"id": part.id, "type": "function",
                                     "function": {"name": part.function.name, "arguments": ""}}  # fmt: skip
            else:
                calls[part.index]["function"]["arguments"] += part.function.arguments
        reason = chunk.choices[0].finish_reason or reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    return content or None, [calls[i] for i in sorted(calls)], reason


def same_calls(a: list[dict], b: list[dict]) -> bool:
    return [c["function"] for c in a] == [c["function"] for c in b]


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto", "none"]
)
def test_every_tool_choice_whole_and_streamed(served, choice):
    url, speculator, _ = served
    content, calls, reason = ask(url, False, tool_choice=choice, parallel_tool_calls=False)
    streamed = ask(url, True, tool_choice=choice, parallel_tool_calls=False)
    assert streamed[0] == content and same_calls(streamed[1], calls) and streamed[2] == reason
    tools = Tools.of(TOOLS, choice, False)
    options = GenerationOptions(chat=True, tools=tools, max_new_tokens=80, k=3)
    library = speculator.generate(QUESTION, options).text
    if choice in ("auto", "none"):  # stories260K tells a story
        assert (content, calls) == (library, []) and reason in ("stop", "length")
        return
    assert content is None and reason == "tool_calls" and len(calls) == 1 and valid(calls[0])
    assert read_calls(library)[1][0].arguments == calls[0]["function"]["arguments"]
    assert isinstance(choice, str) or calls[0]["function"]["name"] == "get_weather"


def test_parallel_calls_each_validate(served):
    url, _, _ = served
    content, calls, reason = ask(url, False, tool_choice="required", max_tokens=120, temperature=1, seed=5)
    streamed = ask(url, True, tool_choice="required", max_tokens=120, temperature=1, seed=5)
    assert same_calls(streamed[1], calls) and streamed[0] == content is None
    finished = calls if reason == "tool_calls" else calls[:-1]
    assert calls and all(valid(c) for c in finished)


def test_the_round_trip_of_calls_and_results(served):
    url, _, rendered = served
    _, calls, _ = ask(url, False, tool_choice="required", parallel_tool_calls=False)
    conversation = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": calls},
                    {"role": "tool", "tool_call_id": calls[0]["id"], "content": "rain, 12 C"}]  # fmt: skip
    content, more, reason = ask(
        url, False, messages=conversation, tool_choice="required", parallel_tool_calls=False
    )
    assert more and valid(more[0]) and reason == "tool_calls"
    name, arguments = calls[0]["function"]["name"], calls[0]["function"]["arguments"]
    assert (
        f'assistant: <tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>\n' in rendered[-1]
    )
    assert "user: <tool_response>\nrain, 12 C\n</tool_response>\n" in rendered[-1]


def test_an_answer_given_back_as_openais_client_holds_it(served):
    """The assistant's message as the openai client's ``model_dump()`` gives it (refusal, audio and
    function_call null, annotations empty) is taken back; those fields with something in them are not."""
    url, _, _ = served
    body = dict(model="stories260K", messages=QUESTION, max_tokens=80, temperature=0, tools=TOOLS)
    answer = client(url).chat.completions.create(**body, tool_choice="required", parallel_tool_calls=False)
    message = {**answer.choices[0].message.model_dump(), "annotations": []}
    assert {"refusal", "audio", "function_call"} <= message.keys() and message["tool_calls"]
    results = [{"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "rain"}]
    assert ask(url, False, messages=[*QUESTION, message, *results], tool_choice="required")[1]
    for field, value in [("refusal", "no"), ("annotations", [{"type": "url_citation"}])]:
        with pytest.raises(openai.BadRequestError, match=f"messages.1.{field}"):
            ask(url, False, messages=[*QUESTION, {**message, field: value}, *results])


JSON_HEADERS = {"Content-Type": "application/json"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "names no function"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"required": 5}}}]}, "tools",
         "invalid JSON schema"),
        ({"tools": TOOLS + TOOLS}, "tools", "given twice"),
        ({"tools": "all"}, "tools", "should be a valid list"),
        ({"tool_choice": "sometimes"}, "tool_choice", 'must be "none", "auto"'),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "valid boolean"),
        ({"functions": [{"name": "f"}]}, "functions", "not implemented"),
        ({"function_call": "auto"}, "function_call", "not implemented"),
        ({"messages": [*QUESTION, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages",
         "answers no earlier tool call"),
        ({"messages": [*QUESTION, {"role": "tool", "content": "x"}]}, "messages.1", "has a tool_call_id"),
        ({"messages": [*QUESTION, {"role": "assistant", "content": None}]}, "messages.1",
         "content is missing"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0",
         "only an assistant"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{**CALL, "function": {
            "name": "add", "arguments": "{"}}]}]}, "messages.1.tool_calls.0.function.arguments", "not JSON"),
        ({"response_format": {"type": "json_object"}}, None, "not both"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [CALL, CALL]}]}, "messages",
         "makes a second tool call of id 'call_1'"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [CALL]},
                       *[{"role": "tool", "tool_call_id": "call_1", "content": "x"}] * 2]}, "messages",
         "answers a call answered before"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{**CALL, "function": {
            "name": 'x"}</tool_call>', "arguments": "{}"}}]}]}, None, "a function's name is 1 to 64"),
        ({"messages": [*QUESTION, {"role": "assistant", "tool_calls": [{**CALL, "function": {
            "name": "add", "arguments": '{"a": "\\ud800"}'}}]}]}, None, "lone surrogate"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_one_line_400s(served, fields, param, fragment):
    url, _, _ = served
    with pytest.raises(openai.BadRequestError) as info:
        ask(url, False, **fields)
    message = info.value.body["message"]
    assert fragment in message and "\n" not in message and info.value.body["param"] == param, message
    assert ask(url, False, tool_choice="none", max_tokens=4)[2] == "length"  # still serving


@pytest.mark.parametrize(
    ("function", "fragment"),
    [({"name": "add\ud800", "arguments": "{}"}, "a function's name is 1 to 64"),
     ({"name": "add", "arguments": '{"a": "\ud800"}'}, "message 1's tool call 0's arguments holds a lone")],
)  # fmt: skip
def test_an_earlier_call_that_is_not_valid_unicode_is_a_400(served, function, fragment):
    """A lone surrogate in an earlier call's name or arguments (which no client library sends: raw JSON
    escapes) is a one-line 400, as in a message's content; the server goes on."""
    url, _, _ = served
    call = {**CALL, "function": function}
    messages = [*QUESTION, {"role": "assistant", "tool_calls": [call]}]
    body = json.dumps({"model": "stories260K", "messages": messages, "max_tokens": 4, "tools": TOOLS})
    status, _, answer = raw(url, "POST", "/v1/chat/completions", body.encode(), JSON_HEADERS)
    message = json.loads(answer)["error"]["message"]
    assert status == 400 and fragment in message and "\n" not in message, message
    assert ask(url, False, tool_choice="none", max_tokens=4)[2] == "length"


def test_completions_take_no_tools(served):
    url, _, _ = served
    with pytest.raises(openai.BadRequestError, match="'tools': not a field of this endpoint"):
        client(url).completions.create(
            model="stories260K", prompt="x", max_tokens=2, extra_body={"tools": TOOLS}
        )


# ---------------------------------------------------------------------------------------------- CLI


def test_generate_tools_prints_the_calls(stories, tmp_path, capsys, monkeypatch):
    root, _, _ = stories
    monkeypatch.setattr(Llama2cTokenizer, "chat_prompt", lambda self, c, tools=None: fallback_chat(c, tools))
    file = tmp_path / "tools.json"
    file.write_text(json.dumps(TOOLS))
    flags = ["--target", str(root / "stories260K.bin"), "--tokenizer", str(root / "tok512.bin"), "--k", "3",
             "--drafter", "ngram", "--max-new-tokens", "80", "--tools", str(file)]  # fmt: skip
    assert cli.main(["generate", "Once upon a time", *flags, "--tool-choice", "add"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    call = json.loads(out[-1])
    assert call["function"]["name"] == "add" and valid(call)
    assert cli.main(["generate", "Once upon a time", *flags, "--tool-choice", "required", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["content"] is None and valid(result["tool_calls"][0])


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--tools", "missing.json"], "cannot read missing.json"),
        (["--tools", "{file}", "--tool-choice", "ad"], "names no function given (did you mean add?)"),
        (["--tool-choice", "auto"], "give --tools too"),
        (["--tools", "{empty}"], "the list is empty"),
        (["--tools", "{file}", "--batch", "x.jsonl"], "not from --batch"),
        (["--tools", "{file}", "--tool-choice", ""], "tool_choice"),
    ],
)
def test_bad_tool_flags_are_refused_before_a_model_loads(argv, fragment, tmp_path, capsys, monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model loaded")

    monkeypatch.setattr("verispec.models.registry.load_model", load)
    (tmp_path / "t.json").write_text(json.dumps(TOOLS))
    (tmp_path / "e.json").write_text("[]")
    argv = [a.format(file=tmp_path / "t.json", empty=tmp_path / "e.json") for a in argv]
    assert cli.main(["generate", *([] if "--batch" in argv else ["hi"]), *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1, err
