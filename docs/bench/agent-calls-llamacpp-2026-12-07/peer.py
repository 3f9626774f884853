"""Issue 55's peer measurement: llama-cpp-python's own tool-calling chat handler (``chatml-function-calling``,
the one of its handlers that takes OpenAI ``tools`` for a ChatML model such as SmolLM2) on the bench's
``agent_calls`` items, in the bench's agent loop: each call checked as the bench checks verispec's
(``verispec.bench.agent.valid_call``: the function exists, its arguments parse and validate against its
schema with ``jsonschema``), answered by the same fake tools, the assistant's ``tool_calls`` and a ``tool``
message per call appended, until no call, ``finish``, or the item's turns run out.

    .venv/bin/python docs/bench/agent-calls-llamacpp-2026-12-07/peer.py [--runs 3] > results.json

Needs ``make peers`` (llama-cpp-python). Greedy once, temperature 0.7 with seeds 0..runs-1. An item's
``tool_choice`` is passed as given; where the handler refuses it the item is run again with ``auto`` (what
a user of that handler can do) and both are reported.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from importlib import resources

from llama_cpp.llama_chat_format import chatml_function_calling

from verispec.bench.agent import run_loop, valid_call
from verispec.bench.peers import llamacpp_model
from verispec.grammar.tools import ToolCall, Tools
from verispec.models.registry import gguf_file


def loop(llm, item: dict, choice, temperature: float, seed: int) -> dict:
    """One run of the bench's agent loop (``verispec.bench.agent.run_loop``) on ``item`` with the handler;
    what it did."""
    tools = Tools.of(item["tools"], item["tool_choice"], item.get("parallel_tool_calls"))
    errors: list[str] = []

    def reply(conversation: list[dict]) -> dict | None:
        try:
            answered = chatml_function_calling(
                llama=llm,
                messages=conversation,
                tools=item["tools"],
                tool_choice=choice,
                temperature=temperature,
                max_tokens=128,
            )
        except Exception as err:  # noqa: BLE001 - what the handler raises is the finding
            errors.append(f"{type(err).__name__}: {err}"[:120])
            return None
        return answered["choices"][0]["message"]

    def read(message: dict) -> tuple[str | None, list[ToolCall], int]:  # its calls, parsed by the handler
        made = message.get("tool_calls") or []
        return (
            message.get("content"),
            [ToolCall("", c["function"]["name"], c["function"]["arguments"]) for c in made],
            0,
        )

    llm.set_seed(seed)
    done = run_loop(tools, item["max_turns"], list(item["messages"]), reply, read)
    invalid = [f"{c.name}({c.arguments})"[:200] for c in done.calls if not valid_call(tools, c)]
    return {
        "turns": done.turns,
        "calls": len(done.calls),
        "valid": done.valid,
        "errors": errors,
        "invalid": invalid,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    path = resources.files("verispec") / "data" / "tasks" / "agent_calls.jsonl"
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    llm = llamacpp_model(gguf_file("smollm2-135m"), threads=2, context=2048)
    settings = [(0.0, 0)] + [(0.7, seed) for seed in range(args.runs)]
    rows = []
    for item in items:
        for temperature, seed in settings:
            for choice in dict.fromkeys([item["tool_choice"], "auto"]):
                run = loop(llm, item, choice, temperature, seed)
                rows.append(
                    {"id": item["id"], "tool_choice": choice, "temperature": temperature, "seed": seed} | run
                )
                print(json.dumps(rows[-1]), file=sys.stderr)
                if not run["errors"]:
                    break
    total = Counter()
    for row in rows:
        if not row["errors"]:
            total.update({"runs": 1, "calls": row["calls"], "valid": row["valid"], "turns": row["turns"]})
    print(json.dumps({"rows": rows, "total": dict(total)}, indent=1))


if __name__ == "__main__":
    main()
