"""The commands around drafters' costs and training: ``calibrate``, ``drafter-data``, ``train-drafter``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from verispec.cli.common import (
    add_model_specs,
    add_threads_argument,
    format_table,
    model_fields,
    parse_precision,
)
from verispec.drafting.registry import AUTO as AUTO_DRAFTER
from verispec.errors import UsageError
from verispec.inputs import check_int
from verispec.models.names import is_llama2c  # light: no torch

__all__ = [
    "add_calibrate_parser",
    "add_drafter_data_parser",
    "add_train_drafter_parser",
    "run_calibrate",
    "run_drafter_data",
    "run_train_drafter",
]


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec calibrate``."""
    parser = subparsers.add_parser(
        "calibrate",
        help="measure the target's verification curve and the draft's cost on this machine",
        description="Measure v(k) = T(k new tokens) / T(1) for k = 1..16 and the cost ratio c = T_draft / "
        "T_target(1) of the drafter (--drafter, as generate chooses it), and cache them for --k auto.",
    )
    add_model_specs(parser)
    parser.add_argument(
        "--drafter",
        default=AUTO_DRAFTER,
        help="the drafter to calibrate with the target (default: auto, as generate chooses)",
    )
    parser.add_argument("--drafter-path", metavar="FILE", help="a learned drafter (verispec train-drafter)")
    parser.add_argument("--repetitions", type=int, default=10, help="timings per k (default: 10)")
    add_threads_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    """Run ``verispec calibrate``: measure, cache, and print v(k), c and the best K for a few α."""
    from verispec.choice import ModelChoice
    from verispec.costs.analytic import optimal_k

    check_int(args.repetitions, "--repetitions", 1)
    choice = ModelChoice(**model_fields(args))  # checked before torch loads
    import torch

    from verispec.api import Speculator
    from verispec.resolve import Target

    speculator = Speculator.on(Target.load(choice))
    calibration = speculator.calibration(force=True, repetitions=args.repetitions)
    if args.json:
        print(json.dumps(calibration.to_dict(), indent=2))
        return 0
    cost = calibration.cost_model
    last = "" if cost.catch_up_limit is None else f" (the last {cost.catch_up_limit} at most)"
    print(
        f"{speculator.drafter_name} drafter: c = {calibration.cost_ratio:.4f} a token + c0 = "
        f"{cost.fixed_cost:.4f} a proposal, catch-up u = {cost.catch_up:.4f} a position{last}; "
        f"T_target(1) = {1e3 * calibration.target.seconds[0]:.2f} ms; "
        f"{torch.get_num_threads()} threads"
    )
    curve = cost.verify_cost
    assert isinstance(curve, tuple)  # a calibration measures v(k) as a sequence
    rows = [{"k": k, "v": v} for k, v in enumerate(curve, 1)]
    print(format_table(rows, (("k new tokens", "k", "d"), ("v(k)", "v", ".3f"))))
    best = (
        f"α={a:g}: K={optimal_k(a, cost.cost_ratio, curve, fixed_cost=cost.fixed_cost)}"
        for a in (0.3, 0.5, 0.7, 0.9)
    )
    print(f"best K: {', '.join(best)}")
    print(f"cached in {calibration.path}", file=sys.stderr)
    return 0


def add_drafter_data_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec drafter-data``."""
    parser = subparsers.add_parser(
        "drafter-data",
        help="build the training data of a learned drafter: the target's own answers to a prompt set",
        description="Have the target answer a generated set of chat prompts (half greedily, half sampled at "
        "temperature 1) and store every token with the target's final hidden state, split into train and "
        "held-out sets (see verispec.training.data). Needs no model hub and no corpus.",
    )
    parser.add_argument(
        "--target", default="smollm2-135m", metavar="SPEC", help="the target (default: %(default)s)"
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the data set directory")
    parser.add_argument("--prompts", type=int, default=1024, help="prompts to answer (default: %(default)s)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=192, help="longest answer in tokens (default: %(default)s)"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="prompts per batch (default: %(default)s)")
    parser.add_argument(
        "--heldout", type=float, default=0.05, help="fraction of prompts held out (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt set and sampling seed (default: 0)")
    parser.add_argument(
        "--first-prompt",
        type=int,
        default=0,
        metavar="N",
        help="start at prompt N of the prompt set, to add new prompts to an earlier data set (default: 0)",
    )
    parser.add_argument(
        "--questions",
        choices=("templates", "target"),
        default="templates",
        help="who writes the user turns: verispec's prompt templates, or the target itself, sampled from its "
        "chat template (default: %(default)s)",
    )
    parser.add_argument(
        "--turns",
        type=int,
        default=1,
        metavar="N",
        help="user turns per target-written conversation; each answered turn is one sequence (default: 1)",
    )
    parser.add_argument(
        "--follow-ups",
        type=int,
        metavar="N",
        help="instead: copy the data set --from DIR and add second turns to its first N chats of each split",
    )
    parser.add_argument("--from", dest="source", metavar="DIR", help="the data set --follow-ups extends")
    parser.add_argument(
        "--ray",
        nargs="?",
        const="local",
        metavar="ADDRESS",
        help="answer the prompts on Ray workers (the cluster at ADDRESS, or a local Ray), in ranges merged",
    )
    parser.add_argument("--workers", type=int, default=2, metavar="N", help="Ray workers with --ray (2)")
    parser.add_argument(
        "--precision",
        type=parse_precision,
        default="auto",
        metavar="PRECISION",
        help="the target's weights, as for generate: auto (default: the precision generate runs it in, "
        "the weights its drafters will read), fp32, fp16, q8_0 or q4_1",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="instead: write the union of these data sets (same target) into --out",
    )
    parser.add_argument(
        "--text",
        nargs="+",
        metavar="SOURCE",
        help="instead: token windows of offline text, no answers and no hidden states (for train-drafter "
        "--kind eagle3, which recomputes the target's states): stdlib (the Python standard library's "
        "docstrings, PSF-2.0) or PATH:LICENCE (the .py docstrings and .md/.rst/.txt files under PATH); "
        "resumable: a rerun continues from the shards written",
    )
    parser.add_argument(
        "--window", type=int, default=512, metavar="N", help="tokens per text window with --text (512)"
    )
    add_threads_argument(parser)
    parser.set_defaults(func=run_drafter_data)


def run_drafter_data(args: argparse.Namespace) -> int:
    """Run ``verispec drafter-data``: build the data set and print what it holds."""
    from verispec.training.data import (
        DataConfig,
        add_follow_ups,
        build_dataset,
        drafter_data_on_ray,
        merge_datasets,
    )

    config = DataConfig(
        args.prompts,
        args.max_new_tokens,
        args.batch_size,
        args.heldout,
        args.seed,
        first_prompt=args.first_prompt,
        questions=args.questions,
        turns=args.turns,
        precision=args.precision,
    )
    if is_llama2c(args.target) and args.text is None:
        raise UsageError("drafter-data answers chat prompts: a llama2.c checkpoint has no chat template")
    if (args.follow_ups is None) != (args.source is None):
        raise UsageError("--follow-ups N and --from DIR go together")
    if args.merge is not None and args.source is not None:
        raise UsageError("--merge and --follow-ups are separate steps")
    if args.ray is not None and (args.merge is not None or args.source is not None):
        raise UsageError("--ray answers new prompts: not with --merge or --follow-ups")
    if args.text is not None and (args.merge is not None or args.source is not None or args.ray is not None):
        raise UsageError("--text builds a data set of its own: not with --merge, --follow-ups or --ray")
    if args.text is not None:
        from verispec.training.text import TextConfig, build_text_dataset

        text = TextConfig(tuple(args.text), args.window, args.heldout, args.seed)  # checked before loading
        meta = build_text_dataset(args.target, args.out, text)
    elif args.merge is not None:
        meta = merge_datasets(args.merge, args.out)
    elif args.ray is not None:
        meta = drafter_data_on_ray(args.target, args.out, config, args.ray, args.workers)
    elif args.source is not None:
        meta = add_follow_ups(args.source, args.out, args.follow_ups, config)
    else:
        meta = build_dataset(args.target, args.out, config)
    print(
        f"{meta['num_sequences']} sequences ({meta['splits']['train']} train, {meta['splits']['heldout']} "
        f"held out), {meta['num_tokens']} tokens of which {meta['answer_tokens']} answer tokens, in "
        f"{meta['seconds']:.0f} s; written to {args.out}"
    )
    return 0


def add_train_drafter_parser(subparsers: argparse._SubParsersAction) -> None:
    """Declare ``verispec train-drafter``."""
    from verispec.training.config import KINDS, TrainConfig

    defaults = {field.name: field.default for field in dataclasses.fields(TrainConfig)}  # no validation
    parser = subparsers.add_parser(
        "train-drafter",
        help="train a learned drafter (EAGLE or EAGLE-3 head, Medusa heads, trained exit, lookahead "
        "tokens) on a drafter-data set",
        description="Train a learned drafter for a target, with logits over a reduced draft vocabulary (see "
        "verispec.training): --kind eagle, a draft head (one decoder layer unless --layers) "
        "that predicts the target's next hidden state from its current one and the next token; medusa, "
        "--heads heads on the target's last hidden state, head i guessing the token i + 1 ahead; exit, an "
        "adapter after the target's first --exit-layer layers; lookahead, --lookahead input embeddings that "
        "one forward of the frozen target reads after the context to guess the tokens after its next "
        "(PaSS); eagle3, an EAGLE-3 head in the layout its authors publish (the target's low, middle and "
        "high layers fused, the target's distribution alone as the loss, --unroll steps on its own outputs; "
        "DIR/model.safetensors and DIR/config.json). Writes DIR/drafter.safetensors, "
        "DIR/checkpoint.pt and DIR/log.jsonl; --resume continues an interrupted run.",
    )
    parser.add_argument("--target", metavar="SPEC", help="the target (default: smollm2-135m)")
    parser.add_argument("--tokenizer", metavar="FILE", help="tokenizer file, for llama2.c checkpoints")
    parser.add_argument(
        "--data",
        required=True,
        nargs="+",
        metavar="DIR",
        help="the data set (verispec drafter-data), or several trained on together (eagle3: text and "
        "answers)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the training run's directory")
    parser.add_argument(
        "--kind", default=defaults["kind"], choices=KINDS, help="drafter kind (default: %(default)s)"
    )
    for flag, help_text in (
        ("steps", "optimizer steps"),
        ("batch-tokens", "slots per batch"),
        ("window", "slots per window (batch_tokens // window windows per batch)"),
        ("draft-vocab", "size of the draft vocabulary: the most frequent answer tokens"),
        ("unroll", "extra steps unrolled on the head's own features"),
        ("layers", "eagle: decoder layers of the head (beyond --init's: new layers that start as no-ops)"),
        ("heads", "medusa: heads, head i guessing the token i + 1 positions ahead"),
        ("exit-layer", "exit: the target layer whose output the trained exit reads"),
        ("lookahead", "lookahead: trained tokens after the context, each guessing one token further"),
        ("checkpoint-every", "steps between checkpoints"),
        ("eval-every", "steps between held-out evaluations"),
        ("seed", "seed of initialisation, batches and noise"),
        ("lr", "peak learning rate"),
        ("ce-weight", "weight of the cross-entropy against the feature loss"),
        ("noise", "half-width of the uniform feature noise, relative to the features' RMS"),
        ("ce-target", "token (the target's next token) or distribution (its own on the draft vocabulary)"),
    ):
        default = defaults[flag.replace("-", "_")]  # an int, float or str: the flag's type
        parser.add_argument(
            f"--{flag}", type=type(default), default=default, help=f"{help_text} (default: {default})"
        )
    parser.add_argument(
        "--init",
        default="",
        metavar="FILE",
        help="start from this drafter (fine-tuning it on --data), keeping its draft vocabulary",
    )
    parser.add_argument(
        "--precision",
        type=parse_precision,
        metavar="PRECISION",
        help="the target's weights, as for generate (default: auto, the precision generate runs it in and "
        "drafter-data answers in; fp32 for lookahead tokens, trained through the target's float32 layers)",
    )
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    add_threads_argument(parser)
    parser.set_defaults(func=run_train_drafter)


def run_train_drafter(args: argparse.Namespace) -> int:
    """Run ``verispec train-drafter``: validate, load the target, train, print where the drafter is."""
    from verispec.models.names import DEFAULT_MODEL
    from verispec.models.registry import load_model
    from verispec.training.config import THROUGH_TARGET, TrainConfig
    from verispec.training.data import read_data_meta
    from verispec.training.train import train_drafter

    config = TrainConfig(
        kind=args.kind,
        steps=args.steps,
        batch_tokens=args.batch_tokens,
        window=args.window,
        lr=args.lr,
        draft_vocab=args.draft_vocab,
        ce_weight=args.ce_weight,
        noise=args.noise,
        ce_target=args.ce_target,
        unroll=args.unroll,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        seed=args.seed,
        init=args.init,
        layers=args.layers,
        heads=args.heads,
        exit_layer=args.exit_layer,
        lookahead=args.lookahead,
    )
    for directory in args.data:
        read_data_meta(directory)  # before loading a model
    if args.init and not os.path.isfile(args.init):
        raise UsageError(f"no such drafter file: {args.init}")
    label = args.target or DEFAULT_MODEL
    precision = args.precision or ("fp32" if args.kind in THROUGH_TARGET else "auto")
    model, _ = load_model(label, tokenizer=args.tokenizer, precision=precision)
    path = train_drafter(model, args.data, args.out, config, target_label=label, resume=args.resume)
    print(f"drafter written to {path}")
    return 0
