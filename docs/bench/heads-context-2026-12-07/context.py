"""The same 16 questions (verispec's chat prompt templates, numbers 9000-9047 step 3: no shipped drafter was
trained on them) asked alone, or after a 2,500-character passage (the bench's first summarization document);
SmolLM2-135M greedy, 64 new tokens, K = 1: each drafter's first-position acceptance (accepted / drafted), and
how sure the target is of its own answers (its mean top-1 probability over them, teacher-forced).

    .venv/bin/python docs/bench/heads-context-2026-12-07/context.py [EAGLE_FILE]
"""

import json
import sys
from pathlib import Path

import torch

from verispec.api import Speculator
from verispec.engine.sequence import GenerationStats
from verispec.options import GenerationOptions, SamplingParams
from verispec.training.prompts import chat_prompts

ROOT = Path(__file__).resolve().parents[3]
QUESTIONS = chat_prompts(9048, 0)[9000:9048:3]
DOCUMENT = json.loads((ROOT / "src/verispec/data/tasks/summarization.jsonl").open().readline())
PASSAGE = (DOCUMENT.get("prompt") or DOCUMENT["messages"][-1]["content"])[:2500]
WAYS = {
    "alone": lambda q: q,
    "after a passage": lambda q: f"Here is some background text:\n\n{PASSAGE}\n\nNow something else. {q}",
}
OPTIONS = GenerationOptions(k=1, sampling=SamplingParams(temperature=0), max_new_tokens=64, chat=True)


def acceptance(spec: Speculator, way) -> tuple[float, float]:
    """(mean prompt tokens, first-position acceptance) over the questions asked ``way``."""
    accepted = drafted = prompt = 0
    for question in QUESTIONS:
        stats = GenerationStats(spec.drafter_name, "1")
        spec.generate([{"role": "user", "content": way(question)}], OPTIONS, stats=stats)
        accepted, drafted = accepted + stats.accepted, drafted + stats.drafted
        prompt += stats.prompt_tokens
    return prompt / len(QUESTIONS), accepted / drafted


def sureness(spec: Speculator, way) -> float:
    """The target's mean top-1 probability over its own greedy answers to the questions asked ``way``."""
    tops = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": way(question)}]
        prompt = spec.encode_prompt(messages, True, None)
        answer = spec.tokenizer.encode(spec.generate(messages, OPTIONS).text, add_bos=False)[:64]
        ids = prompt + answer
        positions = torch.arange(len(ids))[None]  # [1, T]
        logits = spec.model.forward(torch.tensor([ids]), positions, spec.model.new_cache())[0]  # [T, V]
        tops.append(float(logits[len(prompt) - 1 : -1].softmax(-1).max(-1).values.mean()))
    return sum(tops) / len(tops)


def main() -> None:
    eagle = {"drafter_path": sys.argv[1]} if len(sys.argv) > 1 else {}
    drafters = {"eagle": Speculator(drafter="eagle", **eagle), "ngram": Speculator(drafter="ngram")}
    plain = Speculator(drafter="none")
    for label, way in WAYS.items():
        cells = []
        for name, spec in drafters.items():
            tokens, rate = acceptance(spec, way)
            cells.append(f"{name} {rate:.3f}")
        sure = sureness(plain, way)
        print(f"{label:16s} prompt {tokens:4.0f} tokens  {'  '.join(cells)}  target's top-1 {sure:.3f}")


if __name__ == "__main__":
    main()
