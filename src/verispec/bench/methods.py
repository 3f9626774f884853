"""The bench's names, light to import (no torch): the task suite, the methods ``verispec bench`` and
``verispec bench-load`` run, and the peers among them (the command line's help lists them from here); where
a measuring command writes unless told (:func:`results_dir`)."""

from __future__ import annotations

import datetime

from verispec.drafting.registry import CROSS_TOKENIZER, DRAFT_MODEL, DRAFTERS

__all__ = [
    "CONSTRAINED",
    "CONSTRAINED_METHODS",
    "CROSS_METHODS",
    "LLAMACPP_PEERS",
    "LOAD_METHODS",
    "METHODS",
    "PEERS",
    "SHARED_CACHE",
    "TASKS",
    "TOOLS_FREE",
    "TRANSFORMERS_PEERS",
    "TREE_METHODS",
    "VERISPEC_METHODS",
    "WARM_METHODS",
    "results_dir",
]

TASKS = (
    "chat",
    "summarization",
    "rag",
    "math",
    "code_completion",
    "code_editing",
    "translation",
    "agent_tools",  # the agentic ones: sequences of requests, each fed the earlier outputs
    "code_edit_loop",
    "chat_quoting",
    "agent_calls",  # an agent loop of real tool calls, answered by fake tools (:mod:`verispec.bench.agent`)
    "json",  # extraction into a JSON object: each prompt brings its schema (the constrained methods')
)
TRANSFORMERS_PEERS = ("transformers", "transformers-assisted", "transformers-lookup")
"""plain ``generate``; assisted generation with a draft model; prompt lookup decoding."""
CONSTRAINED = "-json"  # a method's constrained variant: each prompt's output held to the prompt's schema
LLAMACPP_PEERS = ("llamacpp", "llamacpp-lookup", f"llamacpp{CONSTRAINED}")
"""llama.cpp's plain decoding; its prompt lookup decoding; its decoding held to a schema by a grammar."""
PEERS = (*TRANSFORMERS_PEERS, *LLAMACPP_PEERS)
VERISPEC_METHODS = tuple(DRAFTERS)  # none first, then every drafter
# a drafter with a cache shared across requests, starting each sample from the workload's first pass
WARM_METHODS = tuple(f"{name}-warm" for name, kind in DRAFTERS.items() if kind.shared_cache)
TREE_METHODS = tuple(f"{name}-tree" for name, kind in DRAFTERS.items() if kind.takes_trees)  # with --trees
# the draft model through one cross-tokenizer algorithm each (its tokenizer differs from the target's)
CROSS_METHODS = {f"model-{algorithm}": algorithm for algorithm in CROSS_TOKENIZER if algorithm != "auto"}
# drafters constrained to the prompts' schemas (on tasks whose prompts bring one: json), and llama.cpp
CONSTRAINED_METHODS = (
    *(f"{name}{CONSTRAINED}" for name in ("none", "ngram", "suffix", "eagle")),
    LLAMACPP_PEERS[-1],
)
# none with tool_choice "none" on a tool task's conversations (the tools rendered, no grammar): the
# unconstrained baseline of the constrained methods there
TOOLS_FREE = "none-unconstrained"
METHODS = (
    *VERISPEC_METHODS,
    *CONSTRAINED_METHODS[:-1],
    TOOLS_FREE,
    *WARM_METHODS,
    *CROSS_METHODS,
    *TREE_METHODS,
    *PEERS,
)
SHARED_CACHE = tuple(name for name, kind in DRAFTERS.items() if kind.shared_cache)  # suffix: cold and warm
# bench-load: auto, the drafter auto picks; a shared cache's drafter from an empty cache and a warm one;
# model, the draft model of --draft
LOAD_METHODS = ("none", "ngram", *SHARED_CACHE, *WARM_METHODS, "eagle", DRAFT_MODEL, "auto", "transformers")


def results_dir(command: str) -> str:
    """``results/COMMAND-YYYYmmdd-HHMMSS``: where ``command`` (bench, bench-load, …) writes its results
    unless given --out."""
    return f"results/{command}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
