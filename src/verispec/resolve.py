"""From a choice of models and drafter (:class:`~verispec.choice.ModelChoice`) to the loaded parts a
:class:`~verispec.api.Speculator` generates with: every check of the choice that needs no model (made first,
so that a mistake costs no load: :func:`~verispec.drafting.registry.check_choice`,
:meth:`~verispec.choice.ModelChoice.check_models`), the loading (a :class:`Target` once, whatever drafters
draft beside it), and every "auto" rule in one place — which drafter auto drafts with (a draft model when
given, else the eagle head verispec ships for the target behind prompt lookup where the cost model says the
head pays, else prompt lookup), which tree ``tree="auto"`` is, which learned drafter file a target gets.
The drafters' names mean something only here and in the registry (:mod:`verispec.drafting.registry`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from verispec.costs.analytic import CostModel, expected_tokens_per_call, speedup_by_k, tree_tokens_bound
from verispec.costs.calibrate import ReadingTree, TreeRound, calibrate
from verispec.drafting.cross_tokenizer import VocabularyPair, same_vocabulary
from verispec.drafting.learned.eagle_drafter import DEFAULT_TREE
from verispec.drafting.learned.head import LearnedHead, native_target
from verispec.drafting.learned.kinds import load_head, shipped_drafter
from verispec.drafting.learned.medusa import MedusaHeads, medusa_tree
from verispec.drafting.registry import (
    DRAFTERS,
    EAGLE,
    DrafterKind,
    DraftInputs,
    auto_with_head,
    check_choice,
    choose_auto,
    early_exit_layers,
    self_draft,
)
from verispec.drafting.tree import AUTO, TreeShape
from verispec.errors import UsageError
from verispec.models.base import HiddenStateModel, LanguageModel, Tokenizer
from verispec.models.llama import Llama
from verispec.models.registry import load_model
from verispec.options import SamplingParams

if TYPE_CHECKING:
    from verispec.choice import Loadable, ModelChoice

__all__ = ["LEARNED_MARGIN", "Parts", "Target", "check_device", "resolve"]

LEARNED_MARGIN = 1.5
"""``auto`` drafts with the learned drafter only where the cost model predicts it this much faster than plain
decoding at the agreement its file records on held-out data: that agreement is measured on chats the target
wrote itself and overestimates acceptance elsewhere (the shipped SmolLM2 drafter: 0.64 at the first position
held out, 0.25–0.50 on the bench's tasks), so a drafter predicted to pay only a little does not pay."""


def check_device(name: str) -> torch.device:
    """The torch device ``name`` names, or a one-line UsageError when it is unknown or not on this machine."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown device {name!r}: use 'cpu' or 'cuda'") from None
    count = {"cuda": torch.cuda.device_count(), "mps": int(torch.backends.mps.is_available())}
    if device.type in count and (device.index or 0) >= count[device.type]:
        found = f"{count[device.type]} {device.type} device(s)" if count[device.type] else f"no {device.type}"
        raise UsageError(f"device {name!r} is not on this machine (torch sees {found}): use 'cpu'")
    return device


@dataclass(frozen=True)
class Parts:
    """What a speculator generates with: the loaded target and its tokenizer, the drafter's kind and what it
    drafts from (a draft model, the two vocabularies of a draft with another tokenizer, a learned drafter),
    the token tree (None: chain rounds), and the labels that name target and draft in calibrations."""

    model: LanguageModel
    tokenizer: Tokenizer
    kind: DrafterKind
    draft: LanguageModel | None = None
    pair: VocabularyPair | None = None  # a draft with another tokenizer: the two vocabularies
    cross_tokenizer: str = "auto"
    head: LearnedHead | None = None  # the learned drafter's
    tree: TreeShape | None = None
    early_exit: bool = False  # the draft is the target's first layers, on the target's cache
    target_label: str = ""
    draft_label: str = ""

    @property
    def drafter_name(self) -> str:
        """How stats name the drafter (a draft across tokenizers: with its algorithm)."""
        return self.kind.name if self.pair is None else f"{self.kind.name}-{self.cross_tokenizer}"


@dataclass(frozen=True)
class Target:
    """A target loaded once (:meth:`load`): its model and tokenizer, the label naming it (in calibrations, and
    the drafter verispec ships for it), the choice it was loaded from (its tokenizer and precision, its own
    drafter) and the device. Any number of drafters draft beside it (:func:`resolve` with ``target``,
    :meth:`verispec.api.Speculator.on`), none loading it again."""

    model: LanguageModel
    tokenizer: Tokenizer
    choice: ModelChoice
    label: str
    device: torch.device = torch.device("cpu")

    @property
    def precision(self) -> str:
        """The weights' precision it was asked for (:data:`~verispec.models.llama.PRECISIONS`, or auto)."""
        return self.choice.precision

    @classmethod
    def load(cls, choice: ModelChoice, label: str | None = None) -> Target:
        """``choice``'s target, loaded once everything it names has been checked
        (:meth:`~verispec.choice.ModelChoice.check_models`, the device); ``label`` names it (default: its
        SPEC)."""
        choice.check_models()
        device = check_device(choice.device)
        model, tokenizer = load_model(
            choice.target, tokenizer=choice.tokenizer, device=device, precision=choice.precision
        )
        return cls(model, tokenizer, choice, choice.target if label is None else label, device)


def resolve(choice: ModelChoice, tree: TreeShape | str | None = None, target: Target | None = None) -> Parts:
    """The parts of ``choice`` (see :class:`~verispec.api.Speculator`, which documents its fields), drafting
    token trees of ``tree`` when given: its drafter beside ``target`` (loaded from the choice when None, else
    the target's own); UsageError for a choice that cannot work, before any model loads where that can be
    known."""
    draft = choice.draft
    kind = check_choice(
        draft, choice.drafter, choice.drafter_path, choice.draft_tokenizer, choice.cross_tokenizer, tree
    )
    if target is None:
        target = Target.load(choice)
    else:
        choice.check_models(target=False)
    model, device, precision, target_label = target.model, target.device, choice.precision, target.label
    layers = early_exit_layers(draft) if isinstance(draft, str) else None
    itself = self_draft(draft) if isinstance(draft, str) else None
    draft_model, pair = None, None
    if layers is not None:
        draft_model = _early_exit(model, layers)
    elif itself is not None:
        draft_model = _requantized(model, *itself)
    elif draft is not None:
        draft_model, spoken = _load(draft, choice.draft_tokenizer_spec, device, precision)
        if not same_vocabulary(target.tokenizer, spoken):  # drafts across tokenizers
            pair = VocabularyPair.build(target.tokenizer, spoken, draft_model.vocab_size)
    if choice.cross_tokenizer != "auto" and pair is None:
        raise UsageError("--cross-tokenizer applies to a draft whose tokenizer differs from the target's")
    shaped = isinstance(tree, TreeShape)  # a token tree's shape given
    kind, head = _kind_and_head(kind, model, draft is not None, choice.drafter_path, target_label, shaped)
    if kind.reads_target_hidden and not isinstance(model, HiddenStateModel):
        raise UsageError(
            f"drafter {kind.name!r} reads the target's hidden states: it needs a native target, "
            f"not a {type(model).__name__}"
        )
    shape = _default_tree(kind, head, model, target_label) if tree == AUTO else tree
    shape = None if shape is None else _checked_tree(shape, kind, model, across=pair is not None)
    return Parts(
        model,
        target.tokenizer,
        kind,
        draft=draft_model,
        pair=pair,
        cross_tokenizer=choice.cross_tokenizer,
        head=head,
        tree=shape,
        early_exit=layers is not None,
        target_label=target_label,
        draft_label=draft if isinstance(draft, str) else "",
    )


def _checked_tree(shape: TreeShape | str, kind: DrafterKind, model: LanguageModel, across: bool) -> TreeShape:
    """``shape``; UsageError for a token tree that ``kind`` cannot draft, that ``model``'s context cannot
    hold, or beside a draft across tokenizers (``across``)."""
    assert isinstance(shape, TreeShape)  # checked by check_choice
    kind.check_tree(shape)
    shape.check_fits(model.max_context)
    if across:
        raise UsageError("token trees are drafted with the target's tokenizer, not across tokenizers")
    return shape


def _kind_and_head(
    kind: DrafterKind | None,
    model: LanguageModel,
    drafted: bool,
    drafter_path: str | Path | None,
    target_label: str,
    tree: bool,
) -> tuple[DrafterKind, LearnedHead | None]:
    """The drafter kind (``kind`` None: auto's choice) and its learned head: the file given, or a shipped one
    (auto takes the shipped file only where it pays, else prompt lookup; a file given decides auto's kind,
    :func:`~verispec.drafting.registry.auto_with_head`). ``drafted``: a draft model was given; ``tree``: a
    token tree's shape was given."""
    head = None
    learned = kind.learned if kind is not None else not drafted  # auto: the shipped one, if any
    if learned or drafter_path is not None:
        wanted = kind.head_kind if kind is not None else None if drafter_path is not None else EAGLE
        head = _learned_head(model, drafter_path, target_label, kind is not None, wanted)
    shipped = kind is None and not drafted and drafter_path is None and head is not None
    if shipped and head is not None and not _learned_pays(model, head, target_label):
        head = None  # auto: prompt lookup instead of the shipped drafter (see LEARNED_MARGIN)
    if kind is None and head is not None:  # auto with a drafter file: by the file's kind
        kind = auto_with_head(head.kind, tree)
    return (kind if kind is not None else choose_auto(drafted, head is not None)), head


def _default_tree(
    kind: DrafterKind, head: LearnedHead | None, model: LanguageModel, target_label: str
) -> TreeShape | None:
    """The tree of ``tree="auto"``: the eagle drafter's :data:`DEFAULT_TREE` where it may pay
    (:func:`_tree_may_pay`), Medusa's sparse tree shaped by its heads' held-out accuracies; None (chain
    rounds) for the other drafters."""
    if kind.name == EAGLE:
        return DEFAULT_TREE if head is None or _tree_may_pay(model, head, target_label) else None
    if isinstance(head, MedusaHeads) and head.rank_accuracy:
        return medusa_tree(head.rank_accuracy)
    return None


def _tree_may_pay(model: LanguageModel, head: LearnedHead, target_label: str) -> bool:
    """Whether :data:`DEFAULT_TREE` may draft faster than a chain at its best K and cannot lose to plain
    decoding: by this machine's calibrated costs, the tree's expected tokens bounded from above (its siblings'
    guesses as good as they could be, :func:`~verispec.costs.analytic.tree_tokens_bound`) per round of
    its verification and drafting (the tree's own, :func:`_tree_drafting`) at least the chain's best expected
    speed, and bounded from below (its first-ranked path alone, no sibling ever accepted) at least plain
    decoding's (a tree round always drafts, where a chain's K may fall to 0), at the per-position agreement
    the drafter's file records on held-out data. True without that record."""
    costs = _chain_costs(model, head, target_label)
    if costs is None:
        return True
    alphas, cost, chain = costs
    shape = DEFAULT_TREE
    if cost.max_k is not None and shape.num_nodes - 1 > cost.max_k:
        return False
    round_cost = cost.verify(shape.num_nodes) + _tree_drafting(model, head, shape, target_label)
    first = max(len(path) for path in shape.paths if not any(path))  # the first-ranked path's depth
    least = expected_tokens_per_call(alphas[:first]) if first else 1.0
    return least >= round_cost and tree_tokens_bound(shape.paths, alphas) / round_cost >= chain


def _tree_drafting(model: LanguageModel, head: LearnedHead, shape: TreeShape, target_label: str) -> float:
    """What drafting one round of ``shape`` with the learned head costs in plain steps, by this machine's
    calibrated costs (measured once and cached: :class:`~verispec.costs.calibrate.TreeRound`)."""
    kind = DRAFTERS[EAGLE]
    assert kind.tree is not None  # eagle drafts trees
    tree = kind.tree(kind.chain(DraftInputs(SamplingParams(temperature=0), model, head=head)), shape, None)
    reading = cast(ReadingTree, tree)  # the head's tree branches its chain and reads the target's states
    return calibrate(model, TreeRound(reading), target_label=target_label).cost_model.draft_cost(1)


def _learned_pays(model: LanguageModel, head: LearnedHead, target_label: str) -> bool:
    """Whether auto should draft with the learned drafter: the cost model (this machine's calibrated costs,
    measured once and cached) predicts it at least LEARNED_MARGIN times faster than plain decoding at its
    best K, at the per-position agreement its file records on held-out data."""
    costs = _chain_costs(model, head, target_label)
    return costs is not None and costs[2] >= LEARNED_MARGIN


def _chain_costs(
    model: LanguageModel, head: LearnedHead, target_label: str
) -> tuple[list[float], CostModel, float] | None:
    """The learned drafter's chain by this machine's calibrated costs (measured once and cached): the
    per-position agreement its file records on held-out data, up to the longest K the costs cover (the
    last one repeated beyond), the cost model and the chain's expected speedup at its best K; None where
    the file records no agreement."""
    heldout = head.heldout_accuracy
    if not heldout:
        return None
    greedy = SamplingParams(temperature=0)
    drafter = DRAFTERS[EAGLE].chain(DraftInputs(greedy, model, head=head))
    cost = calibrate(model, drafter, target_label=target_label).cost_model
    k_max = cost.max_k if cost.max_k is not None else len(heldout)
    alphas = [*heldout, *[heldout[-1]] * max(0, k_max - len(heldout))][:k_max]
    return alphas, cost, float(speedup_by_k(alphas, cost.round_costs(k_max)).max())


def _early_exit(model: LanguageModel, layers: int) -> LanguageModel:
    """The early-exit draft: the target's first ``layers`` layers (native models only)."""
    if not isinstance(model, Llama):
        raise UsageError(f"early-exit drafts need a native model; this target is a {type(model).__name__}")
    if layers >= model.config.num_layers:
        raise UsageError(
            f"layers:{layers} needs a target of more layers; this one has {model.config.num_layers}"
        )
    return model.first_layers(layers)


def _requantized(model: LanguageModel, layers: int | None, precision: str) -> LanguageModel:
    """The self-draft ``self:PRECISION`` / ``layers:N:PRECISION``: the target's own weights in another
    precision (native models only)."""
    if not isinstance(model, Llama):
        raise UsageError(f"self-drafts need a native model; this target is a {type(model).__name__}")
    return model.requantized(precision, layers)


def _learned_head(
    model: LanguageModel, path: str | Path | None, target_label: str, required: bool, kind: str | None
) -> LearnedHead | None:
    """The learned drafter: read from ``path`` (of ``kind`` when given), else the file of ``kind`` shipped for
    the target. Unless ``required`` (drafter "auto"), a missing or mismatched shipped file gives None."""
    chosen = path if path is not None else shipped_drafter(target_label, kind or EAGLE, auto=not required)
    if chosen is None:
        if not required:
            return None
        raise UsageError(
            f"drafter {kind!r} needs a drafter file (--drafter-path FILE, made by verispec train-drafter "
            f"--kind {kind}): verispec ships none for {target_label or 'this target'!r}"
        )
    fast = bool(getattr(model, "optimized_for_cpu", False))  # on the CPU fast path like its target
    if not required and path is None:
        try:
            return load_head(chosen, native_target(model), target_label, fast, kind)
        except UsageError:  # a shipped file for another version of the target: fall back to ngram
            return None
    return load_head(chosen, native_target(model), target_label, fast, kind)


def _load(
    spec: Loadable, tokenizer: str | None, device: torch.device, precision: str
) -> tuple[LanguageModel, Tokenizer]:
    if isinstance(spec, tuple):
        return spec
    return load_model(spec, tokenizer=tokenizer, device=device, precision=precision)
