"""``verispec generate`` (one prompt, ``--batch`` a file of them, traces) and ``verispec demo``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from verispec.cli.common import (
    DEFAULT_MAX_BATCH,
    add_constraint_arguments,
    add_generation_arguments,
    add_model_arguments,
    k_flag,
    model_fields,
    option_fields,
    read_text,
    suffix_fields,
    tree_shape_of,
    warn,
)
from verispec.drafting.registry import AUTO as AUTO_DRAFTER
from verispec.drafting.registry import DRAFTERS, PLAIN, auto_candidates, drafter_names
from verispec.errors import UsageError
from verispec.files import check_writable
from verispec.inputs import check_prompt, is_int, parse_json

if TYPE_CHECKING:  # the modules that load torch (and transformers) are imported by the commands that run
    from verispec.api import GenerationResult
    from verispec.engine.sequence import GenerationStats
    from verispec.grammar.tools import Tools
    from verispec.trace import Trace

__all__ = [
    "DEMO_PROMPT",
    "add_demo_parser",
    "add_generate_parser",
    "busy_machine",
    "run_demo",
    "run_generate",
    "tools_of",
    "why_slower",
]


def add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec generate``."""
    parser = subparsers.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate text from PROMPT (or standard input) with speculative decoding; the text "
        "streams to stdout and a one-line summary goes to stderr (--json: one JSON object on stdout).",
    )
    parser.add_argument(
        "prompt", nargs="?", metavar="PROMPT", help="the prompt (default: read standard input)"
    )
    add_generation_arguments(
        parser,
        seed_help="seed of all sampling (default: random)",
        chat_help="wrap the prompt in the model's chat template",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    add_constraint_arguments(parser)
    tools = parser.add_argument_group(
        "tool calls",
        "functions the model may call (implies --chat; see docs/tools.md): the answer's text, "
        "then each call as one JSON line (OpenAI's object)",
    )
    tools.add_argument("--tools", metavar="FILE", help="a JSON file holding OpenAI's tools list")
    tools.add_argument(
        "--tool-choice",
        metavar="auto|required|none|NAME",
        help="auto (default): text or calls; required: calls only; none: no call; NAME: that function's call",
    )
    parser.add_argument(
        "--batch",
        metavar="FILE.jsonl",
        help='generate for every request of a JSONL file ({"id", "prompt"} or {"id", "messages"} per line; '
        "messages are a chat) in a continuous batch; --json: one JSON line per request",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        metavar="N",
        help=f"sequences decoded at once with --batch (default: {DEFAULT_MAX_BATCH})",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE.html",
        help="write a token-fate trace: one self-contained HTML file, each token coloured by its fate",
    )
    parser.add_argument(
        "--show-trace",
        action="store_true",
        help="print the text as a token-fate trace (ANSI colours on a terminal, else [recovered] {bonus} "
        "~rejected~ markers) instead of streaming it",
    )
    tree = parser.add_argument_group(
        "token trees",
        f"the {drafter_names(lambda kind: kind.takes_trees)} drafter proposes a tree of alternatives each "
        "round, scored by the target in one forward (give no --k with one)",
    )
    tree.add_argument("--tree-width", type=int, metavar="W", help="children of every tree node")
    tree.add_argument("--tree-depth", type=int, metavar="D", help="draft tokens on each root-to-leaf path")
    tree.add_argument(
        "--tree-shape",
        metavar="FILE",
        help="a JSON tree shape: a list of paths of child ranks, e.g. [[0], [1], [0, 0]]",
    )
    tree.add_argument(
        "--tree-nodes",
        metavar="N|auto",
        help="a dynamic tree (eagle drafter, EAGLE-2): each round expands the likeliest nodes of the shape "
        "and verifies its N likeliest draft nodes, or with auto as many as this machine's calibrated costs "
        "pay for",
    )
    parser.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    """Run ``verispec generate``."""
    from verispec.drafting.tree import AUTO
    from verispec.options import GenerationOptions

    if args.batch is not None:
        return _run_batch(args)
    if args.max_batch is not None:
        raise UsageError("--max-batch sets how many requests of --batch FILE run at once: give --batch too")
    tools = tools_of(args)  # every argument checked before a model loads
    prompt = check_prompt(args.prompt if args.prompt is not None else _read_stdin())
    args.chat = args.chat or tools is not None  # --tools implies --chat
    options = GenerationOptions(**option_fields(args), tools=tools)
    sampling = options.sampling
    if args.show_trace and args.json:
        raise UsageError("--show-trace and --json both write to standard output: choose one")
    if args.trace is not None:
        check_writable(args.trace)
    tree = tree_shape_of(args)
    if tree is not None and args.k is not None:
        raise UsageError(
            "--k is not used with a token tree (its shape sets what each round drafts): leave it out"
        )
    tracing = args.trace is not None or args.show_trace
    if tree is not None and tracing:
        raise UsageError("token-fate traces record chain rounds only, not token trees")
    if tracing and sampling.invariant and not sampling.greedy:
        raise UsageError(
            "token-fate traces show rejection sampling's odds, not invariant draws (a seed's default): "
            "add --no-invariant"
        )
    if tree is None and args.k is None and not tracing:
        tree = AUTO  # the learned drafter's tree, where it drafts
    from verispec.choice import ModelChoice

    choice = ModelChoice(**model_fields(args), **suffix_fields(args))
    choice.check_models()  # before torch loads
    from verispec.api import Speculator  # loads torch: once every argument is checked
    from verispec.resolve import Target

    speculator = Speculator.on(Target.load(choice), tree=tree)
    try:
        return _generate(args, speculator, prompt, options, tracing)
    finally:  # Ctrl-C too
        choice.save_suffix_cache(speculator.suffix_cache)


def _generate(args: argparse.Namespace, speculator, prompt: str, options, tracing: bool) -> int:
    """``verispec generate`` of one prompt by ``speculator``: the text streamed (or --json), the summary."""
    from verispec.engine.sequence import GenerationStats
    from verispec.trace import TraceRecorder

    room = speculator.model.max_context - len(speculator.encode_prompt(prompt, options.chat, options.tools))
    if 0 < room < args.max_new_tokens:  # no room at all: generation refuses the prompt, in one line
        warn(
            f"--max-new-tokens {args.max_new_tokens} is more than the target's context of "
            f"{speculator.model.max_context} tokens leaves after this prompt: at most {room} new tokens"
        )
    recorder = TraceRecorder() if tracing else None
    calls = options.tools is not None and options.tools.constraint is not None  # calls to read and print
    if args.json:
        result = speculator.generate(prompt, options, trace=recorder)
        out = {"text": result.text, "token_ids": result.token_ids, "stats": result.stats}
        if calls:
            from verispec.grammar.tools import read_calls

            content, made = read_calls(result.text)
            out |= {"content": content, "tool_calls": [call.as_dict() for call in made]}
        print(json.dumps(out))
        stats = result.stats
    else:
        from verispec.grammar.tools import CallReader

        live = GenerationStats(speculator.drafter_name, speculator.k_label(options.k))
        reader = CallReader()
        wrote = False  # any text: its line is ended (an answer of calls alone prints no empty line first)
        for chunk in speculator.stream(prompt, options, stats=live, trace=recorder):
            if not args.show_trace:  # the trace shows the text instead
                text = (
                    "".join(p for p in reader.feed(chunk.text) if isinstance(p, str)) if calls else chunk.text
                )
                wrote = wrote or bool(text)
                print(text, end="", flush=True)
        if not args.show_trace:
            tail = "".join(p for p in reader.close() if isinstance(p, str)) if calls else ""
            if wrote or tail or not reader.calls:
                print(tail)
            for call in reader.calls:
                print(json.dumps(call.as_dict()))
        print(_summary(live), file=sys.stderr)
        stats = live.as_dict()
    if recorder is not None:
        _output_trace(args, recorder.finish(speculator.tokenizer, stats, prompt, _trace_settings(args)))
    _chat_hint(args, speculator, stats)
    return 0


def _chat_hint(args: argparse.Namespace, speculator, stats: Mapping[str, Any]) -> None:
    """A warning when an instruct model (one with a chat template) ended at once on a plain prompt: what it
    does with text that is not a turn of its chat, which --chat makes one."""
    from verispec.models.base import has_chat_template

    count = stats["new_tokens"]
    ended = stats["stop_reason"] == "eos" and count <= 2
    if ended and not args.chat and has_chat_template(speculator.tokenizer):
        tokens = f"{count} token{'s' if count != 1 else ''}"
        warn(
            f"the model ended at once, after {tokens}: it is an instruct model (it has a chat template), and "
            "a prompt outside its chat may end it; add --chat to wrap the prompt in a user's turn"
        )


def _run_batch(args: argparse.Namespace) -> int:
    """``verispec generate --batch FILE``: every request in a continuous batch of --max-batch sequences."""
    from verispec.options import GenerationOptions

    if args.prompt is not None:
        raise UsageError("give PROMPT or --batch FILE, not both")
    if args.tools is not None:
        raise UsageError("--tools calls functions from one PROMPT's chat, not from --batch's requests")
    if args.trace is not None or args.show_trace or tree_shape_of(args) is not None:
        raise UsageError("--batch decodes chains: no traces, no token trees")
    slots = DEFAULT_MAX_BATCH if args.max_batch is None else args.max_batch
    if not is_int(slots) or slots < 1:
        raise UsageError(f"--max-batch must be >= 1, got {slots}")
    options = GenerationOptions(**option_fields(args))
    from verispec.batch import generate_requests, read_requests, record
    from verispec.choice import ModelChoice

    requests = read_requests(args.batch)  # refused before a model loads when no line is a request
    choice = ModelChoice(**model_fields(args), **suffix_fields(args))
    choice.check_models()  # before torch loads
    from verispec.api import Speculator  # loads torch: once every argument is checked
    from verispec.resolve import Target

    speculator = Speculator.on(Target.load(choice))
    start = time.perf_counter()
    try:
        results = generate_requests(speculator, requests, options, slots=slots)
    finally:  # Ctrl-C too
        choice.save_suffix_cache(speculator.suffix_cache)
    seconds = time.perf_counter() - start
    tokens = 0
    for (ident, _, _), result in zip(requests, results, strict=True):
        tokens += len(result.token_ids)
        if args.json:
            print(json.dumps(record(ident, result)))
        elif result.error:
            print(f"--- {ident}: error: {result.error}")
        else:
            print(f"--- {ident} ---\n{result.text.strip()}\n")
    failed = sum(1 for r in results if r.error)
    print(
        f"[batch of {len(requests)}, {slots} at a time] {tokens} tokens in {seconds:.2f} s: "
        f"{tokens / seconds:.1f} tokens/s" + (f"; {failed} refused" if failed else ""),
        file=sys.stderr,
    )
    return 0


def tools_of(args: argparse.Namespace) -> Tools | None:
    """The tools of --tools FILE and --tool-choice (a function's NAME: that function), read and checked
    before a model loads (UsageError: one line)."""
    if args.tools is None:
        if args.tool_choice is not None:
            raise UsageError("--tool-choice chooses among --tools FILE's functions: give --tools too")
        return None
    from verispec.grammar.tools import CHOICES, Tools

    choice = "auto" if args.tool_choice is None else args.tool_choice
    named = choice if choice in CHOICES else {"type": "function", "function": {"name": choice}}
    try:
        definitions = parse_json(read_text(args.tools))
        if definitions == []:
            raise UsageError("the list is empty: give at least one function")
        return Tools.of(definitions, named)
    except UsageError as err:
        raise UsageError(f"--tools {args.tools}: {err}") from None


def _trace_settings(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The header items of a trace that the stats do not hold: models and sampling settings."""
    from verispec.models.names import DEFAULT_MODEL

    items = [("target", args.target or DEFAULT_MODEL)]
    if args.draft is not None:
        items.append(("draft", args.draft))
    items.append(("temperature", f"{args.temperature:g}"))
    transforms = (("top-k", args.top_k, 0), ("top-p", args.top_p, 1.0), ("min-p", args.min_p, 0.0))
    items += [(name, f"{value:g}") for name, value, default in transforms if value != default]
    items.append(("seed", "random" if args.seed is None else str(args.seed)))
    if args.invariant:
        items.append(("draws", "invariant"))
    return tuple(items)


def _output_trace(args: argparse.Namespace, trace: Trace) -> None:
    """Print the trace (--show-trace) and write its HTML file (--trace)."""
    from verispec.viz.trace import trace_terminal, write_trace_html

    if args.show_trace:
        print(trace_terminal(trace, colour=sys.stdout.isatty()), end="")
    if args.trace is not None:
        print(f"trace written to {write_trace_html(trace, args.trace)}", file=sys.stderr)


def _read_stdin() -> str:
    """The prompt piped on standard input; UsageError saying how to give one when none is."""
    how = 'give PROMPT (verispec generate "Why is the sky blue?") or pipe it on standard input'
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError(f"no prompt: {how}")
    text = sys.stdin.read()
    if not text.strip():
        raise UsageError(f"no prompt: standard input was empty; {how}")
    return text


STOPS = {  # a generation's stop reason in the summary's words
    "eos": "the end of sequence",
    "max_new_tokens": "--max-new-tokens",
    "stop_string": "a stop string",
    "context": "the end of the target's context",
}


def _summary(stats: GenerationStats) -> str:
    """The line on stderr after a generation: its tokens and seconds (the prefill among them, as in --json's
    ``tokens_per_second``), the tokens drafted and accepted, why it stopped, and a constraint's setup apart
    (in none of the generation's times)."""
    grammar = f"; grammar setup {stats.grammar_seconds:.2f} s before it" if stats.grammar_seconds else ""
    return (
        f"[{stats.drafter}, k={stats.k}] {stats.new_tokens} tokens in {stats.total_seconds:.2f} s, prefill "
        f"{stats.prefill_seconds:.2f} s included: {stats.tokens_per_second:.1f} tokens/s, "
        f"{stats.tokens_per_target_call:.2f} tokens per target call; {stats.drafted} drafted, "
        f"{stats.accepted} accepted ({stats.acceptance_rate:.2f}); stopped by "
        f"{STOPS.get(stats.stop_reason, stats.stop_reason)}{grammar}"
    )


DEMO_PROMPT = (
    "Correct the spelling mistakes in this text and write it out again in full:\n\n"
    "Speculative decoding lets a smal draft model propose several tokens, and the large target model "
    "checks them all in one pass. When the draft is rigt, many tokens are acepted at once; when it is "
    "wrong, the target still produces the correct next token, so the output is exactly the same."
)


def add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="compare plain and speculative decoding on an input-grounded prompt",
        description="Generate greedily for a prompt that copies its input with --drafter none, then with the "
        "chosen drafter (by default: ngram, and the learned drafter shipped for the target when there is "
        f"one), {DEMO_RUNS} runs each in turns, check that the outputs are identical, and print the median "
        "run's speedups (and whether the machine was busy: plain decoding's step varying across its runs).",
    )
    add_model_arguments(parser)
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt (default: a spelling correction)")
    parser.set_defaults(func=run_demo, max_new_tokens=96)


def run_demo(args: argparse.Namespace) -> int:
    """Run ``verispec demo``: exit status 1 if any speculative output differs from plain decoding's."""
    from verispec.choice import ModelChoice
    from verispec.drafting.tree import AUTO
    from verispec.options import GenerationOptions

    check_prompt(args.prompt)
    options = GenerationOptions(k=k_flag(args), max_new_tokens=args.max_new_tokens, chat=True)  # greedy
    choice = ModelChoice(**model_fields(args))  # the drafter's choice
    choice.check_models()  # the models it names, before torch loads
    from verispec.api import Speculator  # loads transformers: once every argument is checked
    from verispec.drafting.learned.kinds import shipped_drafter
    from verispec.models.base import has_chat_template
    from verispec.resolve import Target

    target = Target.load(choice)  # once, shared by every drafter
    plain = Speculator.on(target, drafter=PLAIN)
    if not has_chat_template(plain.tokenizer):  # a llama2.c model: the prompt as it is
        options = dataclasses.replace(options, chat=False)
    tree = AUTO if args.k is None else None  # the learned drafter's tree, unless a K is asked for
    chosen = Speculator.on(target, tree=tree)
    speculators = {PLAIN: plain}
    if args.drafter == AUTO_DRAFTER and args.draft is None:  # auto's choice and the others beside it
        learned = args.drafter_path is not None or shipped_drafter(target.label) is not None
        for name in (n for n in auto_candidates(learned) if n != chosen.drafter_name):  # chosen: last
            path = args.drafter_path if DRAFTERS[name].learned else None
            speculators[name] = Speculator.on(target, drafter=name, drafter_path=path, tree=tree)
        print(f"drafter auto chooses {chosen.drafter_name} for this target on this machine\n")
    speculators[chosen.drafter_name] = chosen
    for speculator in speculators.values():  # warm-up: each one's first-call overheads
        speculator.generate(args.prompt, options, max_new_tokens=4)
    runs: dict[str, list[GenerationResult]] = {name: [] for name in speculators}
    for _ in range(DEMO_RUNS):  # in turns: a busy spell slows every method alike
        for name, speculator in speculators.items():
            runs[name].append(speculator.generate(args.prompt, options))
    results = {name: _median_run(done) for name, done in runs.items()}
    for name, result in results.items():
        print(f"--- {name} ---\n{result.text.strip()}\n")
    base = results[PLAIN]
    print(f"the median of {DEMO_RUNS} runs each, in turns:")
    width = max(len(name) for name in results)
    for name, result in results.items():
        s = result.stats
        speedup = s["tokens_per_second"] / base.stats["tokens_per_second"]
        same = (
            ""
            if name == PLAIN
            else f"; identical to {PLAIN}: {'yes' if result.token_ids == base.token_ids else 'NO'}"
        )
        print(
            f"{name:>{width}}: {s['new_tokens']} tokens, {s['tokens_per_second']:.1f} tokens/s "
            f"({speedup:.2f}x), {s['tokens_per_target_call']:.2f} tokens per target call{same}"
        )
        if name != PLAIN and speedup < 1:
            print(why_slower(s, base.stats))
    busy = busy_machine([r.stats for r in runs[PLAIN]])
    if busy:
        print(busy)
    identical = all(r.token_ids == base.token_ids for done in runs.values() for r in done)
    return 0 if identical else 1


DEMO_RUNS = 3  # timed runs of each method in demo (the median kept)
BUSY = 1.5  # plain decoding's step varying more than this factor across the runs: a busy machine


def _median_run(results: list[GenerationResult]) -> GenerationResult:
    """The run of median tokens/s."""
    return sorted(results, key=lambda r: r.stats["tokens_per_second"])[len(results) // 2]


def busy_machine(plain: list[Mapping[str, Any]]) -> str:
    """A line saying that the machine was busy when plain decoding's step (its time after the prefill per
    target call) varied more than BUSY across ``plain``'s runs (their stats), "" else: the speedups measured
    beside it are then rough."""
    steps = [(s["total_seconds"] - s["prefill_seconds"]) / max(1, s["target_calls"]) for s in plain]
    if min(steps) <= 0 or max(steps) / min(steps) <= BUSY:
        return ""
    low, high = 1e3 * min(steps), 1e3 * max(steps)
    return (
        f"this machine was busy: a plain decoding step took {low:.1f} to {high:.1f} ms across the "
        f"{len(steps)} runs (other work beside it?): the speedups above are rough; run the demo again when "
        "the machine is quiet"
    )


def why_slower(stats: Mapping[str, Any], plain: Mapping[str, Any]) -> str:
    """Why a drafter ran slower than plain decoding, from what the run measured: a round's cost in plain
    decoding steps (each a whole plain round: its forward and the rest) — verifying, drafting and the rest —
    against the tokens it committed."""
    step = (plain["total_seconds"] - plain["prefill_seconds"]) / max(1, plain["target_calls"])
    rounds = max(1, stats["target_calls"])
    whole = (stats["total_seconds"] - stats["prefill_seconds"]) / rounds / step
    verify, draft = stats["target_seconds"] / rounds / step, stats["draft_seconds"] / rounds / step
    nothing = "" if stats["drafted"] else " (it drafted nothing: --k auto found no round where it would pay)"
    return (
        f"        slower here: a round cost {whole:.2f} plain steps ({verify:.2f} verifying, {draft:.2f} "
        f"drafting, {max(0.0, whole - verify - draft):.2f} the rest) and committed "
        f"{stats['tokens_per_target_call']:.2f} tokens{nothing}; speculation pays when a round commits more "
        "tokens than it costs steps (docs/adaptive-k.md)"
    )
