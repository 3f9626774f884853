"""Training a learned drafter on a data set of :mod:`verispec.training.data` (the target's own answers, with
its final hidden state at every position): ``verispec train-drafter``. One loop for every kind, with the
kind's :class:`~verispec.training.recipe.Recipe` (named by its entry in the drafter registry: its fresh head,
its batch loss, its evaluation; :mod:`verispec.training.eagle`, :mod:`~verispec.training.medusa`,
:mod:`~verispec.training.exit`, :mod:`~verispec.training.lookahead`). What every kind shares:

- draft vocabulary: the ``draft_vocab`` most frequent tokens of the training split's answers (or ``init``'s);
- AdamW (β = 0.9, 0.95), learning rate warmed up linearly over ``warmup`` steps then cosine-decayed to 10 %,
  gradient norm clipped at ``grad_clip``;
- every ``eval_every`` steps: the held-out top-1 accuracy at each draft position (the recipe's evaluation),
  shown on the progress bar and appended to ``log.jsonl`` with the same measure on the training split (its gap
  to the held-out one says whether more data or more steps would help);
- every ``checkpoint_every`` steps: ``checkpoint.pt`` (weights, optimizer, step, random state) and the
  drafter file ``drafter.safetensors``, each written atomically; ``resume`` continues from the checkpoint and
  ends exactly where an uninterrupted run ends;
- the target's fingerprint, recorded in the drafter file, and the data set checked to be the target's own.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from verispec.drafting.learned.head import LearnedHead, native_target, target_fingerprint
from verispec.drafting.learned.kinds import load_head
from verispec.drafting.registry import DRAFTERS
from verispec.errors import UsageError
from verispec.files import atomic_path
from verispec.models.base import LanguageModel
from verispec.models.llama import Llama
from verispec.training.config import THROUGH_TARGET, TrainConfig
from verispec.training.data import answered_precision, load_split, load_splits, read_data_meta, target_sizes
from verispec.training.recipe import EVAL_POSITIONS, IGNORE, Recipe, TrainingData, draft_index

__all__ = ["train_drafter"]

CHECKPOINT = "checkpoint.pt"
LOG = "log.jsonl"
_DATA_RECORD = ("target", "num_sequences", "num_tokens", "generation", "text")  # a data set's, in the file
_FEATURE_CHECK_TOKENS = 32  # positions of the data set recomputed to check that it belongs to the target
_FEATURE_CHECK_TOLERANCE = 0.02  # relative error allowed (the data set stores float16)
# kinds trained through the float32 target (config.THROUGH_TARGET), whatever precision answered the data: the
# same weights computed another way differ more (SmolLM2's Q4_1 kernels, 8-bit activations, vs float32: 0.035)
_OTHER_PRECISION_TOLERANCE = 0.1


def _answer_tokens(split: dict[str, Tensor]) -> Tensor:
    """The tokens the target wrote (after each prompt) in a split: [M] int64."""
    offsets, prompts = split["offsets"].tolist(), split["prompt_lengths"].tolist()
    keep = torch.zeros(split["tokens"].shape[0], dtype=torch.bool)  # [N]
    for start, end, prompt in zip(offsets[:-1], offsets[1:], prompts, strict=True):
        keep[start + prompt : end] = True
    return split["tokens"][keep].long()


def _recipe_class(config: TrainConfig) -> Any:
    """The recipe class of ``config.kind``, as the drafter registry names it."""
    trained = DRAFTERS[config.kind].trained
    assert trained is not None  # TrainConfig takes the trained kinds alone
    return trained.recipe_class()


def _draft_vocabulary(answers: Tensor, size: int, vocab: int) -> Tensor:
    """The ``size`` most frequent of the ``answers`` tokens (ties: lower id first), ascending:
    [min(size, V)] int64."""
    counts = torch.bincount(answers, minlength=vocab)  # [V]
    order = torch.argsort(counts, descending=True, stable=True)  # [V]
    return order[: min(size, vocab)].sort().values


def _check_data(directory: Path, target: Llama, label: str) -> dict:
    """The data set's meta.json, after checking that the data set exists and was made for ``target``'s
    sizes."""
    meta = read_data_meta(directory)
    own = target_sizes(target)
    sizes = [meta.get(name) for name in own]  # hidden size, vocabulary
    if sizes != list(own.values()):
        raise UsageError(
            f"the data set in {directory} was made by target {meta.get('target')!r} (hidden size {sizes[0]}, "
            f"vocabulary {sizes[1]}), not by {label!r} ({own['hidden_size']}, {own['vocab_size']})"
        )
    return meta


def _check_states(directory: Path, meta: dict, target: Llama, label: str, tolerance: float) -> None:
    """Check that the data set's stored hidden states are ``target``'s: those of the first held-out
    positions recomputed by the target (their relative error at most ``tolerance``)."""
    held = load_split(directory, "heldout")
    n = min(_FEATURE_CHECK_TOKENS, int(held["offsets"][1]))
    tokens = held["tokens"][:n].long()[None]  # [1, n]
    with torch.no_grad():
        ours = target.forward_hidden(tokens, torch.arange(n)[None], target.new_cache(1, n))[0].float()
    ours = ours[:, : target.config.hidden_size]  # the final state, before any tapped layers' inputs
    error = float((ours - held["hidden"][:n].float()).norm() / ours.norm())
    if error > tolerance:
        raise UsageError(
            f"the data set in {directory} was made by target {meta.get('target')!r}: its hidden states "
            f"differ from those of {label!r} (relative error {error:.3f}); it was answered in precision "
            f"{answered_precision(meta)}: train in that precision (--precision), or make the data set again"
        )


def _write_atomic(path: Path, obj: object) -> None:
    """Save ``obj`` to ``path`` with torch.save, atomically (a temporary file renamed over it)."""
    with atomic_path(path) as tmp:
        torch.save(obj, tmp)


@dataclass
class _Run:
    """A training run: where its files go, what they record about its origin, the head with its optimizer and
    random stream, and how far it has come."""

    config: TrainConfig
    out_dir: Path
    fingerprint: str  # target_fingerprint of the target
    draft_vocab: Tensor  # [Vd] int64
    coverage: float  # share of the training answers' tokens that are in the draft vocabulary
    data: list[dict[str, object]]  # each data set's meta.json entries recorded in the drafter file
    recipe: Recipe
    head: LearnedHead
    optimizer: torch.optim.Optimizer
    generator: torch.Generator  # every random draw of the run, in order (initialisation, batches, noise)
    step: int = 0  # steps done
    seconds: float = 0.0  # time spent in the steps
    accuracy: list[float] = dataclasses.field(default_factory=lambda: [0.0] * EVAL_POSITIONS)  # last eval
    measures: dict = dataclasses.field(default_factory=dict)  # the kind's further measures, last eval

    @property
    def settings(self) -> dict[str, object]:
        """The training settings as the checkpoint and the drafter file record them."""
        return dataclasses.asdict(self.config)


def _checkpoint_path(out_dir: Path, resume: bool) -> Path:
    """The checkpoint file of the run in ``out_dir``, after checking that it exists when resuming and does
    not otherwise (UsageError)."""
    path = out_dir / CHECKPOINT
    if resume and not path.is_file():
        raise UsageError(f"nothing to resume: {out_dir} holds no {CHECKPOINT}")
    if not resume and path.exists():
        raise UsageError(f"{out_dir} already holds a training run: pass --resume, or choose another --out")
    return path


def _choose_draft_vocab(
    config: TrainConfig, target: Llama, target_label: str, answers: Tensor
) -> tuple[Tensor, LearnedHead | None]:
    """(draft vocabulary [Vd] int64, drafter to start from or None): that of ``config.init`` when given
    (its size must be ``config.draft_vocab``), else the most frequent of the ``answers`` [M] tokens."""
    start = load_head(config.init, target, target_label, kind=config.kind) if config.init else None
    if start is None:
        return _draft_vocabulary(answers, config.draft_vocab, target.vocab_size), None
    if start.draft_vocab_size != config.draft_vocab:
        raise UsageError(
            f"the drafter {config.init} to start from has a draft vocabulary of "
            f"{start.draft_vocab_size} tokens, not draft_vocab = {config.draft_vocab}"
        )
    return start.draft_vocab, start


def _new_head(
    target: Llama, config: TrainConfig, draft_vocab: Tensor, recipe: Recipe, metadata: dict[str, str]
) -> tuple[LearnedHead, torch.optim.Optimizer, torch.Generator]:
    """A trainable head of the recipe's kind on ``draft_vocab`` [Vd], its AdamW optimizer and the run's random
    stream, which the initialisation has drawn from."""
    generator = torch.Generator().manual_seed(config.seed)
    head = recipe.new_head(target, config, draft_vocab, metadata, generator)
    for param in head.parameters():
        param.requires_grad_(True)
    optimizer = torch.optim.AdamW(
        head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    return head, optimizer, generator


def _resume(run: _Run, checkpoint_path: Path) -> None:
    """Restore ``run`` from its checkpoint (UsageError when that was written with other settings, for another
    target or another draft vocabulary) and drop the logged evaluations made after it: they are made again."""
    state = torch.load(checkpoint_path, weights_only=True)
    settings = run.settings
    saved = {**dataclasses.asdict(TrainConfig()), **state["settings"]}  # newer settings: their defaults
    changed = [k for k in settings if saved[k] != settings[k]]
    if changed:
        differences = ", ".join(f"{k} {saved[k]!r} there, {settings[k]!r} now" for k in changed)
        raise UsageError(f"cannot resume the run in {run.out_dir}: its settings differ ({differences})")
    if state["target_fingerprint"] != run.fingerprint:
        raise UsageError(f"cannot resume the run in {run.out_dir}: it was made for another target")
    if not torch.equal(state["draft_vocab"], run.draft_vocab):
        raise UsageError(f"cannot resume the run in {run.out_dir}: the data set has changed")
    run.head.load_state_dict(state["head"])
    run.optimizer.load_state_dict(state["optimizer"])
    run.generator.set_state(state["rng"])
    run.step, run.seconds, run.accuracy = state["step"], state["seconds"], state["accuracy"]
    run.measures = state.get("measures", {})
    log = run.out_dir / LOG
    if log.is_file():
        kept = [line for line in log.read_text().splitlines() if json.loads(line)["step"] <= run.step]
        log.write_text("".join(f"{line}\n" for line in kept))


def _save(run: _Run) -> None:
    """Write the drafter file (its training record in the metadata) and the checkpoint of ``run``."""
    run.head.metadata["training"] = {
        **run.settings,
        "steps_done": run.step,
        "seconds": round(run.seconds, 1),
        "heldout_top1_per_position": [round(a, 4) for a in run.accuracy],
        **run.measures,
        "draft_vocab_coverage": round(run.coverage, 4),
        "data": run.data,
    }
    run.head.save(run.out_dir / run.recipe.drafter_name)
    _write_atomic(
        run.out_dir / CHECKPOINT,
        {
            "target_fingerprint": run.fingerprint,
            "settings": run.settings,
            "draft_vocab": run.draft_vocab,
            "head": run.head.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "rng": run.generator.get_state(),
            "step": run.step,
            "seconds": run.seconds,
            "accuracy": run.accuracy,
            "measures": run.measures,
        },
    )


def _train_step(run: _Run, train: TrainingData, noise: float) -> float:
    """One optimizer step of ``run`` on a random batch of ``train``; returns its loss."""
    config = run.config
    began = time.perf_counter()
    for group in run.optimizer.param_groups:
        group["lr"] = config.lr_at(run.step)
    loss = run.recipe.loss(run.head, train, config, noise, run.generator)
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(run.head.parameters(), config.grad_clip)
    run.optimizer.step()
    run.step += 1
    run.seconds += time.perf_counter() - began
    return loss.item()


def _log_evaluation(run: _Run, loss: float | None, train: TrainingData, heldout: TrainingData) -> None:
    """Evaluate ``run``'s head on both splits, keep the held-out accuracy and append a line to the log
    (``loss``: the last step's, None before the first)."""
    config = run.config
    run.accuracy, run.measures = run.recipe.evaluate(run.head, heldout, config)
    record = {
        "step": run.step,
        "loss": loss,
        "seconds": round(run.seconds, 1),
        "heldout_top1": run.accuracy,
        **{f"heldout_{k.removeprefix('heldout_')}": v for k, v in run.measures.items()},
        "train_top1": run.recipe.evaluate(run.head, train, config)[0],
    }
    with (run.out_dir / LOG).open("a") as log:
        log.write(json.dumps(record) + "\n")


def _train_loop(run: _Run, train: TrainingData, heldout: TrainingData, noise: float, progress: bool) -> None:
    """Step ``run`` to ``config.steps``, evaluating and checkpointing at their intervals and at the end."""
    config = run.config
    bar = tqdm(
        total=config.steps, initial=run.step, desc=f"training {config.kind} drafter", disable=not progress
    )
    if progress:
        bar.write(
            f"draft vocabulary: {run.draft_vocab.shape[0]} tokens, "
            f"covering {run.coverage:.1%} of the answers",
            file=sys.stderr,
        )
    if run.step == 0 and config.init:  # where fine-tuning starts: the drafter's own accuracy on this data
        _log_evaluation(run, None, train, heldout)
    while run.step < config.steps:
        loss = _train_step(run, train, noise)
        if run.step % config.eval_every == 0 or run.step == config.steps:
            _log_evaluation(run, loss, train, heldout)
        bar.set_postfix(loss=f"{loss:.3f}", top1="/".join(f"{a:.2f}" for a in run.accuracy))
        bar.update(1)
        if run.step % config.checkpoint_every == 0 or run.step == config.steps:
            _save(run)
    bar.close()


def train_drafter(
    target: LanguageModel,
    data_dir: str | Path | Sequence[str | Path],
    out_dir: str | Path,
    config: TrainConfig = TrainConfig(),
    *,
    target_label: str = "",
    resume: bool = False,
    progress: bool = True,
) -> Path:
    """Train a drafter for ``target`` on the data set in ``data_dir`` (or the data sets, their splits joined);
    returns the drafter file written into ``out_dir`` (with ``checkpoint.pt`` and ``log.jsonl``). ``resume``
    continues from the checkpoint in ``out_dir``, which must have been written with the same settings for
    the same target. UsageError for an unsupported target, a missing or foreign data set (one of token ids
    alone for a kind that reads the stored hidden states), or a checkpoint that cannot be resumed."""
    target = native_target(target)
    label = target_label or "the target"
    directories = [Path(data_dir)] if isinstance(data_dir, str | Path) else [Path(d) for d in data_dir]
    out_dir = Path(out_dir)
    recipe_class = _recipe_class(config)
    stored = recipe_class.reads_stored_hidden
    tolerance = _OTHER_PRECISION_TOLERANCE if config.kind in THROUGH_TARGET else _FEATURE_CHECK_TOLERANCE
    metas = [_check_data(directory, target, label) for directory in directories]
    if stored:
        for directory, meta in zip(directories, metas, strict=True):
            _check_states(directory, meta, target, label, tolerance)
    checkpoint_path = _checkpoint_path(out_dir, resume)
    fingerprint = target_fingerprint(target)
    train_split = load_splits(directories, "train", stored)
    answers = _answer_tokens(train_split)  # [M]
    draft_vocab, start = _choose_draft_vocab(config, target, target_label, answers)  # [Vd]
    index = draft_index(draft_vocab, target.vocab_size)  # [V]
    recipe: Recipe = recipe_class.of(target, config, start)
    train = recipe.prepare(target, TrainingData.from_split(train_split, index))
    heldout = recipe.prepare(
        target, TrainingData.from_split(load_splits(directories, "heldout", stored), index)
    )
    noise = config.noise * float(train.hidden[:65536].float().pow(2).mean().sqrt()) if stored else 0.0
    metadata = {"kind": config.kind, "target": target_label, "target_fingerprint": fingerprint}
    head, optimizer, generator = _new_head(target, config, draft_vocab, recipe, metadata)
    run = _Run(
        config=config,
        out_dir=out_dir,
        fingerprint=fingerprint,
        draft_vocab=draft_vocab,
        coverage=float(index[answers].ne(IGNORE).float().mean()),
        data=[{k: meta.get(k) for k in _DATA_RECORD} for meta in metas],
        recipe=recipe,
        head=head,
        optimizer=optimizer,
        generator=generator,
    )
    if resume:
        _resume(run, checkpoint_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    _train_loop(run, train, heldout, noise, progress)
    return out_dir / recipe.drafter_name
