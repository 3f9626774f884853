"""What an agent's next turn scores (issue 55's agent loop), counted, not timed: a turn after a tool call and
its result keeps the keys and values of every position of the last turn's prompt and output that the new
prompt repeats token for token — all of it where the model wrote its call in the tokenizer's own tokens
(SmolLM2's real template), the last prompt at least where it did not (stories260K spells ``<tool_call>``
with byte tokens; the template's rendering is what the target scores, never the model's own tokens) — and
scores only the rest: the tool result and the template's glue. In the library (one speculator's kept engine)
and where other conversations come between its turns, even ones sharing its start (a continuous batch's
slots: the server's scheduler), through the ``openai`` client too. Each output equals a fresh engine's on
the same rendered prompt, greedy and sampled with a seed."""

from __future__ import annotations

import json

import pytest

from test_server import client
from test_tools import TOOLS, fallback_chat, stories  # noqa: F401  # stories: stories260K with a plain chat template
from toy import single_threaded
from verispec.api import Speculator
from verispec.bench.agent import answer
from verispec.bench.prompts import builtin_tasks
from verispec.engine.engine import SpeculativeEngine
from verispec.engine.sequence import GenerationStats
from verispec.grammar.tools import Tools, read_calls
from verispec.models.registry import load_model
from verispec.options import DEFAULT_SAMPLING, GenerationOptions, SamplingParams
from verispec.server.app import Server, ServerConfig, serving

SAMPLINGS = [DEFAULT_SAMPLING, SamplingParams(temperature=0.8, seed=7)]
ADD = {"type": "function", "function": {"name": "add"}}  # short calls: {"a": 0 to 99, "b": a boolean}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_threaded():
        yield


def conversation(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def answered(messages: list[dict], text: str, turn: int) -> list[dict]:
    """``messages`` and the assistant's message of ``text`` (its calls), each call's result after it."""
    content, calls = read_calls(text)
    assert calls, text  # a call every turn
    for index, call in enumerate(calls):
        call.id = f"call_{turn}_{index}"
    return [
        *messages,
        {"role": "assistant", "content": content, "tool_calls": [c.as_dict() for c in calls]},
        *({"role": "tool", "tool_call_id": c.id, "content": answer(c.name, c.arguments)} for c in calls),
    ]


def options(sampling: SamplingParams, tools: Tools | None = None) -> GenerationOptions:
    tools = tools or Tools.of(TOOLS, ADD, False)
    return GenerationOptions(chat=True, tools=tools, max_new_tokens=80, k=3, sampling=sampling)


def shared_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def turns(speculator: Speculator, messages: list[dict], chosen: GenerationOptions, count: int) -> list[tuple]:
    """``count`` turns of an agent on ``speculator``'s kept engine: each turn's prompt ids, what the slot
    held before it (the last prompt and output, the output's end token aside: never scored), its stats, and
    whether its output equals a fresh speculator's on the same conversation."""
    model_and_tokenizer = (speculator.model, speculator.tokenizer)
    seen, held = [], []
    for turn in range(count):
        prompt = speculator.encode_prompt(messages, True, chosen.tools)
        stats = GenerationStats(speculator.drafter_name, "3")
        result = speculator.generate(messages, chosen, stats=stats)
        fresh = Speculator(model_and_tokenizer, drafter=speculator.drafter_name).generate(messages, chosen)
        seen.append((prompt, held, stats, result.token_ids == fresh.token_ids))
        assert result.stats["stop_reason"] == "eos"  # a whole call
        held = prompt + result.token_ids[:-1]
        messages = answered(messages, result.text, turn)
    return seen


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_next_turn_keeps_what_it_repeats_token_for_token(stories, sampling):  # noqa: F811
    """Three turns on one speculator: each later turn keeps every position that its prompt shares with what
    the slot held, token for token (at least the last prompt), and scores the rest; its tokens are a fresh
    speculator's."""
    _, model, tokenizer = stories
    speculator = Speculator((model, tokenizer), drafter="ngram")
    seen = turns(speculator, conversation("Once upon a time"), options(sampling), 3)
    for turn, (prompt, held, stats, same) in enumerate(seen):
        assert same and stats.prompt_tokens == len(prompt)
        assert stats.cached_prompt_tokens == shared_start(held, prompt), turn  # 0 on the first turn
        if turn:
            last = seen[turn - 1][0]  # the last prompt: kept whole
            assert stats.cached_prompt_tokens >= len(last) and prompt[: len(last)] == last


@pytest.mark.slow
def test_smollm2_scores_only_the_tool_result_and_the_template_glue(smollm2):
    """SmolLM2's own chat template and an agent item of the bench: the model writes its call in the
    tokenizer's own tokens, so a next turn keeps all the slot held and scores only the tool result and the
    template's glue (a few dozen of its hundreds of tokens); its output is a fresh speculator's."""
    item = builtin_tasks()["agent_calls"][2]  # list_files / read_file: a call every turn
    assert item.agent is not None
    speculator = Speculator(smollm2, drafter="ngram")
    messages = [{"role": role, "content": content} for role, content in item.messages]
    chosen = GenerationOptions(chat=True, tools=item.agent.tools, max_new_tokens=48, k=3)
    seen = turns(speculator, messages, chosen, 2)
    (first, _, before, _), (prompt, held, stats, same) = seen
    assert same and before.cached_prompt_tokens == 0 and stats.cached_prompt_tokens == len(held) > len(first)
    assert stats.prompt_tokens - stats.cached_prompt_tokens < 60 < len(first)


def run(engine: SpeculativeEngine, speculator: Speculator, messages: list[dict], chosen: GenerationOptions):
    """One request through ``engine`` alone: its prompt ids, output ids and stats."""
    request, _ = speculator.request(messages, chosen)
    running = engine.submit(request)
    while not running.done:
        engine.step()
    return request.prompt, running.ids[len(request.prompt) :], request.stats


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_conversations_taking_turns_keep_their_own_slots(stories, sampling):  # noqa: F811
    """Two conversations sharing a start take turns on a two-slot engine (a server's scheduler): the
    second's first turn takes the empty slot, copying the shared start, instead of the first's, so that
    each next turn keeps what it repeats of its own conversation; every output a fresh engine's."""
    _, model, tokenizer = stories
    speculator = Speculator((model, tokenizer), drafter="ngram")
    chosen = options(sampling)
    engine = SpeculativeEngine(model, slots=2)
    talks = [conversation("Once upon a time"), conversation("Once upon a hill")]
    held: list[list[int]] = [[], []]
    last: list[list[int]] = [[], []]  # each conversation's last prompt
    for turn in range(2):
        for i, messages in enumerate(talks):
            prompt, out, stats = run(engine, speculator, messages, chosen)
            assert out == Speculator((model, tokenizer), drafter="ngram").generate(messages, chosen).token_ids
            if turn == 0 and i == 1:  # the second copies the start it shares with the first
                assert stats.cached_prompt_tokens == shared_start(prompt, held[0]) > 0
            else:
                assert stats.cached_prompt_tokens == shared_start(prompt, held[i]), (turn, i)
                assert stats.cached_prompt_tokens >= len(last[i])  # its own slot, not the other's
            held[i], last[i] = prompt + out[:-1], prompt
            talks[i] = answered(messages, speculator.tokenizer.decode(out), turn)


def test_the_server_keeps_a_conversation_across_others(stories):  # noqa: F811
    """Through the ``openai`` client on a two-slot server: a conversation's next turn, after another
    conversation's turn that shares its start, keeps at least all its last prompt
    (``usage.prompt_tokens_details.cached_tokens``)."""
    root, model, _ = stories
    tokenizer = load_model(root / "stories260K.bin", tokenizer=root / "tok512.bin")[1]
    tokenizer.chat_prompt = fallback_chat  # type: ignore[method-assign]
    config = ServerConfig(target=str(root / "stories260K.bin"), drafter="ngram", max_batch=2, k="3")
    body = dict(model="stories260K", max_tokens=80, temperature=0, tools=TOOLS, tool_choice=ADD,
                parallel_tool_calls=False)  # fmt: skip
    with serving(Server(config, loaded=(model, tokenizer))) as url:
        ask = client(url).chat.completions.create
        first = conversation("Once upon a time")
        a = ask(messages=first, **body)
        other = ask(messages=conversation("Once upon a hill"), **body)  # another conversation between
        call = a.choices[0].message.tool_calls[0].model_dump()
        result = {"role": "tool", "tool_call_id": call["id"], "content": json.dumps({"sum": 3})}
        reply = {"role": "assistant", "content": None, "tool_calls": [call]}
        again = ask(messages=[*first, reply, result], **body)
    assert 0 < other.usage.prompt_tokens_details.cached_tokens < a.usage.prompt_tokens  # the shared start
    assert again.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens
