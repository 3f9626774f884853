"""The drafters verispec knows, by name: what each one needs, what it can do, and how it is built.

This is the one place where a drafter's name means something. The API, the command line, the calibration and
the bench ask a :class:`DrafterKind` (``DRAFTERS[name]``) instead of comparing names. To add a drafter, write
its chain form (the :class:`~verispec.drafting.base.Drafter` protocol) and, if it has one, its tree form
(:class:`~verispec.drafting.base.TreeDrafter`), then add one entry to :data:`DRAFTERS`. A learned kind's entry
also declares what it trains (:class:`Trained`: its head class in :mod:`verispec.drafting.learned`, its recipe
in :mod:`verispec.training`, the targets verispec ships a file of it for); the kinds' head classes
(:data:`verispec.drafting.learned.kinds.HEADS`), their shipped files, the kinds ``train-drafter`` trains and
the recipe each trains with are read from there.

``auto`` is not a drafter but a choice among them (:func:`choose_auto`, :func:`auto_with_head`): the draft
model when one is given, else the eagle head behind prompt lookup when a learned drafter exists for the
target, else prompt lookup. :func:`check_choice` is every
check of a choice of drafter (and its draft, file and tree) that needs no model: light to import (no torch),
the command line asks it before anything loads.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verispec.drafting.specs import (  # the drafters' own spellings, here for every choice's checks
    CROSS_TOKENIZER,
    EARLY_EXIT,
    SELF,
    check_algorithm,
    early_exit_layers,
    self_draft,
)
from verispec.errors import UsageError
from verispec.inputs import did_you_mean

if TYPE_CHECKING:  # the drafters themselves are imported where they are built: this table loads no torch
    from verispec.costs.analytic import CostModel
    from verispec.drafting.base import Drafter, TreeDrafter
    from verispec.drafting.cross_tokenizer import VocabularyPair
    from verispec.drafting.learned.head import LearnedHead
    from verispec.drafting.suffix_cache import SuffixCache
    from verispec.drafting.tree import TreeShape
    from verispec.models.base import Cache, LanguageModel
    from verispec.options import SamplingParams

    TreeFactory = Callable[[Drafter, TreeShape, CostModel | None], TreeDrafter]

__all__ = [
    "AUTO",
    "CHOICES",
    "CROSS_TOKENIZER",
    "DRAFTERS",
    "DRAFT_MODEL",
    "EAGLE",
    "EARLY_EXIT",
    "LOOKUP_FIRST",
    "PLAIN",
    "SELF",
    "DraftInputs",
    "DrafterKind",
    "Trained",
    "auto_candidates",
    "auto_with_head",
    "check_algorithm",
    "check_choice",
    "choose_auto",
    "drafter_kind",
    "drafter_names",
    "early_exit_layers",
    "self_draft",
]

AUTO = "auto"
PLAIN = "none"  # the drafter that drafts nothing: plain decoding, every speedup's baseline
DRAFT_MODEL = "model"  # the drafter that drafts with a draft model (--draft)
EAGLE = "eagle"  # verispec's own learned drafter: a drafter file's default kind
LOOKUP_FIRST = "ngram+eagle"  # prompt lookup first, the eagle head elsewhere: auto's where the head pays


@dataclass(frozen=True)
class DraftInputs:
    """What a drafter is built from, for one generation: the engine's sampling parameters (the draft samples
    with the same transform), the target, and whichever of these its kind needs."""

    sampling: SamplingParams
    target: LanguageModel
    draft: LanguageModel | None = None  # a draft model (``needs_draft_model``)
    target_cache: Cache | None = None  # the target's cache, read by an early-exit draft (its first layers)
    slot: Cache | None = None  # the target's cache of the sequence's slot: a learned head's own cache is the
    # same row of one it holds for the batch, so that the batch's rows draft together
    head: LearnedHead | None = None  # a learned drafter (``learned``), of the kind's own class
    pair: VocabularyPair | None = None  # a draft model with another tokenizer: the two vocabularies
    cross_tokenizer: str = "auto"  # and the algorithm that drafts across them (CROSS_TOKENIZER)
    cost_ratio: float | None = None  # the calibrated c of this drafter, once measured
    suffix_cache: SuffixCache | None = None  # the suffix drafter's cache shared across requests (None: a
    # private one per drafter, cold)

    def need_draft(self, name: str) -> LanguageModel:
        """The draft model, or UsageError naming the drafter that needs one."""
        if self.draft is None:
            raise UsageError(f"drafter {name!r} needs a draft model (--draft SPEC)")
        return self.draft

    def need_head(self, name: str, kind: type[LearnedHead]) -> Any:
        """The learned drafter, of class ``kind``, or UsageError naming the drafter that needs one."""
        if not isinstance(self.head, kind):
            found = f", not a {self.head.kind} drafter" if self.head is not None else ""
            raise UsageError(
                f"drafter {name!r} needs a {kind.kind} drafter file (--drafter-path FILE){found}"
            )
        return self.head


@dataclass(frozen=True)
class Trained:
    """What a learned kind's files hold and how verispec trains one: its head class and its training recipe,
    each named by its dotted path (imported where used: this table loads no torch), and the targets (short
    names) verispec ships a file of it for, ``verispec/data/drafters/TARGET-KIND.safetensors``: those auto may
    draft with, and those whose file drafts only when its kind is asked for."""

    head: str  # a LearnedHead subclass, "verispec.drafting.learned.MODULE.CLASS"
    recipe: str  # its recipe, "verispec.training.MODULE.CLASS" (a verispec.training.recipe.Recipe)
    shipped: tuple[str, ...] = ()
    on_request: tuple[str, ...] = ()  # shipped, but never loaded by auto (it would cost more than it gives)
    through_target: bool = False  # trained through the target's own float32 layers (native kernels compute
    # no gradients), whatever precision it otherwise runs in

    def head_class(self) -> type[LearnedHead]:
        """The head class, imported."""
        head: type[LearnedHead] = _named(self.head)
        return head

    def recipe_class(self) -> Any:
        """The recipe class, imported."""
        return _named(self.recipe)


def _named(path: str) -> Any:
    """The object at the dotted ``path`` ("package.module.NAME"), its module imported."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class DrafterKind:
    """One drafter: its capabilities and factories.

    chain: builds the chain drafter for one generation. tree: branches that chain drafter into a tree drafter
    of a shape (the cost model is given for a dynamic shape of budget "auto", else None); None when the kind
    has no tree form.
    """

    name: str
    summary: str
    chain: Callable[[DraftInputs], Drafter]
    tree: TreeFactory | None = None
    drafts: bool = True  # False only for plain decoding: K is then irrelevant and nothing is calibrated
    needs_draft_model: bool = False  # a second model (--draft SPEC), or the target's first layers
    trained: Trained | None = None  # a learned kind of its own: drafts with a trained file of that kind
    head: str = ""  # drafts with a trained file of another learned kind, this one
    published: str = ""  # drafts with a head in its authors' published layout: its class's dotted path, whose
    # ``load(path, target, label, fast)`` reads it (--drafter-path)
    dynamic_trees: bool = False  # takes tree shapes with a node budget (ranks its nodes, EAGLE-2)
    reads_target_hidden: bool = False  # drafts from the target's hidden states: needs a native target
    reads_target_cache: bool = False  # runs the target's first layers on the target's own cache
    shared_cache: bool = False  # drafts from a cache shared across requests (DraftInputs.suffix_cache)

    @property
    def learned(self) -> bool:
        """Whether the kind drafts with a trained drafter file: --drafter-path, or the one shipped for the
        target."""
        return self.trained is not None or bool(self.head or self.published)

    def published_class(self) -> Any:
        """The class that reads the kind's published heads (``published``), imported."""
        return _named(self.published)

    @property
    def head_kind(self) -> str:
        """The kind of learned drafter file a learned kind drafts with."""
        return self.head or self.name

    @property
    def takes_trees(self) -> bool:
        """Whether the kind proposes token trees."""
        return self.tree is not None

    def check_tree(self, shape: TreeShape) -> None:
        """UsageError unless this kind drafts token trees of ``shape`` (one with a node budget: only a kind
        with dynamic trees); asked before any model loads."""
        if not self.takes_trees:
            takers = drafter_names(lambda kind: kind.takes_trees)
            raise UsageError(f"token trees need the {takers} drafter, not {self.name!r}")
        if not self.dynamic_trees:
            from verispec.drafting.base import check_static

            check_static(shape, self.name)


def _model_chain(inputs: DraftInputs) -> Drafter:
    """A draft model's chain: with the target's tokenizer, or across tokenizers
    (:mod:`verispec.drafting.cross_tokenizer`; auto weighs a draft forward at the calibrated c, or before
    the calibration at the models' size ratio)."""
    from verispec.drafting.cross_tokenizer import CrossTokenizerDrafter
    from verispec.drafting.draft_model import ModelDrafter

    draft = inputs.need_draft("model")
    if inputs.pair is None:
        return ModelDrafter(
            draft, inputs.sampling, inputs.target.vocab_size, inputs.target_cache, inputs.slot
        )
    ratio = inputs.cost_ratio if inputs.cost_ratio else _size_ratio(draft, inputs.target)
    return CrossTokenizerDrafter(draft, inputs.pair, inputs.sampling, inputs.cross_tokenizer, ratio)


def _size_ratio(draft: LanguageModel, target: LanguageModel) -> float:
    """Parameters of the draft over the target's (what a memory-bound forward costs), 0.1 when unknown."""
    import torch

    models = [m for m in (draft, target) if isinstance(m, torch.nn.Module)]
    sizes = [sum(p.numel() for p in m.parameters()) for m in models]
    return sizes[0] / sizes[1] if len(sizes) == 2 and sizes[1] else 0.1


def _eagle_tree(chain: Drafter, shape: TreeShape, cost: CostModel | None) -> TreeDrafter:
    """The learned head's tree: sampled children above temperature 0 for a static shape, top-k (single
    guesses) for a dynamic one."""
    from verispec.drafting.learned.eagle_drafter import EagleDrafter, EagleTreeDrafter

    assert isinstance(chain, EagleDrafter)  # the eagle kind's chain factory builds one
    if shape.budget is None:
        return EagleTreeDrafter(chain, shape, sampled=True)
    return EagleTreeDrafter(chain, shape, cost=cost)


def _medusa_tree(chain: Drafter, shape: TreeShape, cost: CostModel | None) -> TreeDrafter:
    """Medusa's tree: each depth's children from its head, sampled above temperature 0."""
    from verispec.drafting.learned.medusa import MedusaDrafter, MedusaTreeDrafter

    assert isinstance(chain, MedusaDrafter)  # the medusa kind's chain factory builds one
    heads = chain.heads.num_heads
    if shape.max_depth > heads:  # head d drafts depth d: nothing could draft deeper
        raise UsageError(
            f"the Medusa file has {heads} heads, one per depth: a tree {shape.max_depth} deep needs as many"
        )
    return MedusaTreeDrafter(chain, shape, sampled=True)


def _exit_chain(inputs: DraftInputs) -> Drafter:
    """The target's first layers and a trained exit, on the target's cache."""
    from verispec.drafting.draft_model import ModelDrafter
    from verispec.drafting.learned.exit import ExitAdapter, ExitDraft
    from verispec.drafting.learned.head import native_target

    draft = ExitDraft(native_target(inputs.target), inputs.need_head("exit", ExitAdapter))
    return ModelDrafter(draft, inputs.sampling, inputs.target.vocab_size, inputs.target_cache)


def _lookahead_chain(inputs: DraftInputs) -> Drafter:
    """Trained lookahead tokens after the context, run through the whole target on the target's cache."""
    from verispec.drafting.learned.lookahead import LookaheadDrafter, LookaheadTokens

    tokens = inputs.need_head("lookahead", LookaheadTokens)
    return LookaheadDrafter(tokens, inputs.target, inputs.sampling, inputs.target_cache)


def _model_tree(chain: Drafter, shape: TreeShape, cost: CostModel | None) -> TreeDrafter:
    """A draft model's tree of its top-k children."""
    from verispec.drafting.draft_model import ModelDrafter, ModelTreeDrafter

    assert isinstance(chain, ModelDrafter)  # with the target's tokenizer (the API refuses trees across)
    return ModelTreeDrafter(chain, shape)


def _no_chain(inputs: DraftInputs) -> Drafter:
    """Plain decoding's drafter: nothing."""
    from verispec.drafting.base import NoDrafter

    return NoDrafter()


def _ngram_chain(inputs: DraftInputs) -> Drafter:
    """Prompt lookup."""
    from verispec.drafting.ngram import NGramDrafter

    return NGramDrafter()


def _eagle_chain(inputs: DraftInputs) -> Drafter:
    """The learned head, reading the target's hidden states."""
    from verispec.drafting.learned.eagle import EagleHead
    from verispec.drafting.learned.eagle_drafter import EagleDrafter

    head = inputs.need_head("eagle", EagleHead)
    return EagleDrafter(head, inputs.sampling, head.cache_row(inputs.slot))


def _eagle3_chain(inputs: DraftInputs) -> Drafter:
    """A published EAGLE-3 head, reading three of the target's layers."""
    from verispec.drafting.learned.eagle3 import Eagle3Drafter, Eagle3Head

    return Eagle3Drafter(inputs.need_head("eagle3", Eagle3Head), inputs.sampling)


def _eagle2_chain(inputs: DraftInputs) -> Drafter:
    """A published EAGLE-1/2 head, reading the target's final hidden states."""
    from verispec.drafting.learned.eagle2 import Eagle2Drafter, Eagle2Head

    return Eagle2Drafter(inputs.need_head("eagle2", Eagle2Head), inputs.sampling)


def _medusa_chain(inputs: DraftInputs) -> Drafter:
    """Every Medusa head in one forward."""
    from verispec.drafting.learned.medusa import MedusaDrafter, MedusaHeads

    return MedusaDrafter(inputs.need_head("medusa", MedusaHeads), inputs.sampling)


def _ngram_eagle_chain(inputs: DraftInputs) -> Drafter:
    """Prompt lookup where the context's suffix occurred before, the learned head elsewhere."""
    from verispec.drafting.hybrid import LookupFirstDrafter
    from verispec.drafting.ngram import NGramDrafter

    return LookupFirstDrafter(NGramDrafter(), _eagle_chain(inputs), LOOKUP_FIRST)


def _ngram_tree(chain: Drafter, shape: TreeShape, cost: CostModel | None) -> TreeDrafter:
    """Several prompt-lookup matches merged into a tree."""
    from verispec.drafting.ngram import NGramDrafter, NGramTreeDrafter

    assert isinstance(chain, NGramDrafter)  # the ngram kind's chain factory builds one
    return NGramTreeDrafter(shape, chain)


def _suffix_chain(inputs: DraftInputs) -> Drafter:
    """SuffixDecoding over the request's own text and the shared cache of previous outputs."""
    from verispec.drafting.suffix import SuffixDrafter

    return SuffixDrafter(inputs.suffix_cache)


def _suffix_tree(chain: Drafter, shape: TreeShape, cost: CostModel | None) -> TreeDrafter:
    """The suffix matches' continuations, by count, merged into a tree."""
    from verispec.drafting.suffix import SuffixDrafter, SuffixTreeDrafter

    assert isinstance(chain, SuffixDrafter)  # the suffix kind's chain factory builds one
    return SuffixTreeDrafter(shape, chain)


_SHIPPED = ("smollm2-135m",)  # the targets verispec ships every learned kind's file for

DRAFTERS: dict[str, DrafterKind] = {
    kind.name: kind
    for kind in (
        DrafterKind(PLAIN, "plain decoding: drafts nothing (the speed baseline)", _no_chain, drafts=False),
        DrafterKind(
            DRAFT_MODEL,
            "a smaller model with the target's tokenizer, or the target's first layers (--draft layers:N)",
            _model_chain,
            _model_tree,
            needs_draft_model=True,
        ),
        DrafterKind(
            "ngram",
            "prompt lookup: copies what followed the context's suffix earlier",
            _ngram_chain,
            _ngram_tree,
        ),
        DrafterKind(
            "suffix",
            "SuffixDecoding: what followed the context's longest suffix in this request or earlier outputs",
            _suffix_chain,
            _suffix_tree,
            shared_cache=True,
        ),
        DrafterKind(
            EAGLE,
            "a learned head reading the target's hidden states (EAGLE-style)",
            _eagle_chain,
            _eagle_tree,
            trained=Trained(
                head="verispec.drafting.learned.eagle.EagleHead",
                recipe="verispec.training.eagle.EagleRecipe",
                shipped=_SHIPPED,
                # Gemma 3 270M's head: behind prompt lookup level with lookup alone on the bench (its
                # pretrained model copies its prompts), for 0.5-0.9 s more at each start
                # (docs/learned-drafters.md)
                on_request=("gemma3-270m",),
            ),
            dynamic_trees=True,
            reads_target_hidden=True,
        ),
        DrafterKind(
            "eagle3",
            "an EAGLE-3 head as its authors publish it (--drafter-path its model.safetensors), reading three "
            "of the target's layers; trained by train-drafter --kind eagle3",
            _eagle3_chain,
            _eagle_tree,
            trained=Trained(
                head="verispec.drafting.learned.eagle3.Eagle3Head",
                recipe="verispec.training.eagle3.Eagle3Recipe",
            ),
            published="verispec.drafting.learned.eagle3.Eagle3Head",
            dynamic_trees=True,
            reads_target_hidden=True,
        ),
        DrafterKind(
            "eagle2",
            "an EAGLE-1/2 head as its authors publish it (--drafter-path its model.safetensors), reading the "
            "target's last hidden state",
            _eagle2_chain,
            _eagle_tree,
            published="verispec.drafting.learned.eagle2.Eagle2Head",
            dynamic_trees=True,
            reads_target_hidden=True,
        ),
        DrafterKind(
            LOOKUP_FIRST,
            "prompt lookup where the context's suffix occurred before, the eagle head elsewhere",
            _ngram_eagle_chain,
            head="eagle",
            reads_target_hidden=True,
        ),
        DrafterKind(
            "medusa",
            "Medusa heads on the target's last hidden state, head i guessing the token i + 1 ahead",
            _medusa_chain,
            _medusa_tree,
            trained=Trained(
                head="verispec.drafting.learned.medusa.MedusaHeads",
                recipe="verispec.training.medusa.MedusaRecipe",
                shipped=_SHIPPED,
            ),
            reads_target_hidden=True,
        ),
        DrafterKind(
            "exit",
            "the target's first layers and a trained exit (a LayerSkip-style self-draft)",
            _exit_chain,
            _model_tree,
            trained=Trained(
                head="verispec.drafting.learned.exit.ExitAdapter",
                recipe="verispec.training.exit.ExitRecipe",
                shipped=_SHIPPED,
            ),
            reads_target_cache=True,
        ),
        DrafterKind(
            "lookahead",
            "trained lookahead tokens after the context: one target forward drafts several tokens (PaSS)",
            _lookahead_chain,
            trained=Trained(
                head="verispec.drafting.learned.lookahead.LookaheadTokens",
                recipe="verispec.training.lookahead.LookaheadRecipe",
                shipped=_SHIPPED,
                through_target=True,
            ),
            reads_target_cache=True,
        ),
    )
}
CHOICES = (AUTO, *DRAFTERS)  # what --drafter accepts


def drafter_kind(name: str) -> DrafterKind:
    """The drafter named ``name``; UsageError listing the choices for an unknown one (and the closest)."""
    try:
        return DRAFTERS[name]
    except (KeyError, TypeError):
        close = did_you_mean(name, CHOICES) if isinstance(name, str) else ""
        raise UsageError(f"unknown drafter {name!r}{close}; choose one of {', '.join(CHOICES)}") from None


def check_choice(
    draft: object,
    drafter: str,
    drafter_path: object = None,
    draft_tokenizer: object = None,
    cross_tokenizer: str = "auto",
    tree: object = None,
) -> DrafterKind | None:
    """The drafter's kind (None for auto), after every check of a choice that needs no model: ``draft`` a
    draft SPEC (or a model already loaded), ``drafter`` a name of :data:`CHOICES`, a drafter file, the draft's
    own tokenizer, the cross-tokenizer algorithm and ``tree`` (a TreeShape, "auto" or None) together."""
    from verispec.drafting.tree import TreeShape  # numpy, no torch

    check_algorithm(cross_tokenizer)
    own_weights = isinstance(draft, str) and (
        early_exit_layers(draft) is not None or self_draft(draft) is not None
    )
    if draft_tokenizer is not None and (draft is None or own_weights):
        raise UsageError("--draft-tokenizer is the tokenizer of a draft model (--draft SPEC)")
    if cross_tokenizer != "auto" and (draft is None or own_weights):
        raise UsageError("--cross-tokenizer applies to a draft whose tokenizer differs from the target's")
    kind = None if drafter == AUTO else drafter_kind(drafter)
    if kind is not None and kind.needs_draft_model and draft is None:
        raise UsageError(f"drafter {drafter!r} needs a draft model (--draft SPEC)")
    if draft is not None and kind is not None and not kind.needs_draft_model:
        raise UsageError(f"a draft model was given but drafter is {drafter!r}")
    if draft is not None and drafter_path is not None:
        raise UsageError("give a draft model (--draft) or a drafter file (--drafter-path), not both")
    if drafter_path is not None and kind is not None and not kind.learned:
        raise UsageError(f"a drafter file was given but drafter is {drafter!r}")
    if kind is not None and kind.published and drafter_path is None and draft is None:
        raise UsageError(
            f"drafter {drafter!r} reads a published head: give its file (--drafter-path "
            "DIR/model.safetensors, its config.json beside it)"
        )
    if tree is not None and tree != AUTO and not isinstance(tree, TreeShape):
        raise UsageError(f"tree must be a TreeShape, {AUTO!r} or None, got {tree!r}")
    if kind is not None and isinstance(tree, TreeShape):
        kind.check_tree(tree)
    return kind


def drafter_names(which: Callable[[DrafterKind], bool] = lambda kind: True, last: str = "or") -> str:
    """The names of the drafters ``which`` holds for, in the registry's order, as text ("a, b or c"): every
    list of drafters in a help text or an error is built here, so none goes stale when one is added."""
    *others, final = [name for name, kind in DRAFTERS.items() if which(kind)] or [""]
    return f"{', '.join(others)} {last} {final}" if others else final


def choose_auto(has_draft_model: bool, has_learned_drafter: bool) -> DrafterKind:
    """What ``auto`` picks: the draft model when one is given, else the eagle head behind prompt lookup when
    a learned drafter exists for the target, else prompt lookup."""
    if has_draft_model:
        return DRAFTERS[DRAFT_MODEL]
    return DRAFTERS[auto_candidates(has_learned_drafter)[-1]]  # the head behind the lookup where there is one


def auto_with_head(head_kind: str, tree: bool) -> DrafterKind:
    """What ``auto`` drafts with beside a learned drafter file of ``head_kind`` (shipped or given): an eagle
    head behind prompt lookup (:data:`LOOKUP_FIRST`), unless a token ``tree`` is asked for (that drafter
    drafts chains), else the file's own kind. The lookup's guesses are free and long where the context
    repeats itself and the head's are dear and short, so the head drafts only where the lookup has nothing:
    on every task of the bench, lookup-first drafted at least as fast as the head alone (docs/drafters.md)."""
    return DRAFTERS[LOOKUP_FIRST if head_kind == EAGLE and not tree else head_kind]


def auto_candidates(has_learned_drafter: bool) -> tuple[str, ...]:
    """The drafters ``auto`` chooses between without a draft model: prompt lookup, and, when a learned
    drafter exists for the target, its head alone and behind the lookup, auto's choice last (``verispec
    demo`` runs each)."""
    return ("ngram", EAGLE, LOOKUP_FIRST) if has_learned_drafter else ("ngram",)
