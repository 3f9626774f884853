"""The Python API: load a target (and a draft), then generate text, streamed or whole.

    >>> import verispec
    >>> result = verispec.generate("Summarize: ...", drafter="ngram", max_new_tokens=64, temperature=0)
    >>> result.text, result.token_ids, result.stats["tokens_per_target_call"]

``Speculator`` keeps the models loaded between generations; ``generate`` is a one-shot convenience.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ParamSpec, TypeVar

import torch

from verispec.analysis.analytic import BatchCost, CostModel, speedup_by_k
from verispec.calibrate import QUICK_REPETITIONS, Calibration, calibrate
from verispec.drafting.base import Drafter, TreeDrafter
from verispec.drafting.cross_tokenizer import VocabularyPair, check_algorithm, same_vocabulary
from verispec.drafting.draft_model import early_exit_layers, self_draft
from verispec.drafting.learned.eagle_drafter import DEFAULT_TREE
from verispec.drafting.learned.head import LearnedHead, native_target
from verispec.drafting.learned.kinds import load_head, shipped_drafter
from verispec.drafting.learned.medusa import MedusaHeads, medusa_tree
from verispec.drafting.registry import DRAFTERS, DraftInputs, choose_auto, drafter_kind
from verispec.drafting.tree import AUTO, TreeShape
from verispec.engine import EngineConfig, GenerationStats, Request, SpeculativeEngine, TokenLogprob
from verispec.errors import UsageError
from verispec.inputs import check_text, is_int
from verispec.models.base import Cache, HiddenStateModel, LanguageModel, Tokenizer
from verispec.models.llama import DEFAULT_PRECISION, Llama
from verispec.models.registry import DEFAULT_MODEL, load_model
from verispec.policies import AdditiveK, ConstantK, CostModelK, KPolicy
from verispec.sampling import SamplingParams
from verispec.trace import TraceRecorder

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "DEFAULT_K",
    "Chunk",
    "GenerationResult",
    "ModelChoice",
    "Speculator",
    "failure_message",
    "generate",
    "k_policy",
    "parse_k",
]

DEFAULT_K = "auto"
DEFAULT_SAMPLING = SamplingParams(temperature=0)
"""What the library generates with unless given ``sampling`` (or ``temperature``), as the command line does:
greedy, the target's own greedy output token for token and the same on every run (transformers' ``generate``
is greedy by default too). The server keeps OpenAI's default temperature of 1."""
FOREIGN_KEYWORDS = {  # transformers' (and OpenAI's) generation keywords → what verispec takes instead
    "max_length": "max_new_tokens (tokens after the prompt)",
    "max_tokens": "max_new_tokens",
    "do_sample": "temperature (0: greedy) or sampling=SamplingParams(...)",
    "generation_config": "sampling=SamplingParams(...)",
    "stop_strings": "stop",
    "random_seed": "seed",
}


def check_keywords(given: Iterable[str], allowed: Sequence[str]) -> None:
    """One-line UsageError for the first of ``given`` that is not one of ``allowed``, naming verispec's own
    keyword for a transformers one (``max_length`` → ``max_new_tokens``), else the keywords taken."""
    for name in given:
        if name not in allowed:
            use = FOREIGN_KEYWORDS.get(name, f"one of {', '.join(allowed)}")
            raise UsageError(f"{name} is not a verispec argument; use {use}")


def _own_keywords(function: Callable[P, R]) -> Callable[P, R]:
    """``function``, refusing a keyword it does not take with :func:`check_keywords` (not a TypeError)."""
    allowed = tuple(inspect.signature(function).parameters)

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        check_keywords(kwargs, allowed)
        return function(*args, **kwargs)

    return checked


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


LEARNED_MARGIN = 1.5
"""``auto`` drafts with the learned drafter only where the cost model predicts it this much faster than plain
decoding at the agreement its file records on held-out data: that agreement is measured on chats the target
wrote itself and overestimates acceptance elsewhere (the shipped SmolLM2 drafter: 0.64 at the first position
held out, 0.25–0.50 on the bench's tasks), so a drafter predicted to pay only a little does not pay."""


@dataclass(frozen=True)
class Chunk:
    """What one round committed: its tokens, and the text that became final with them (possibly empty: text
    is held back until it is whole characters and cannot be the start of a stop string); ``logprobs``: each
    token's, when the request asks for them (see :meth:`Speculator.request`)."""

    text: str
    token_ids: list[int]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationResult:
    """What one generation produced."""

    text: str  # the generated text (prompt excluded, stop string excluded)
    token_ids: list[int]  # the generated token ids
    stats: dict  # GenerationStats.as_dict()
    error: str = ""  # in a batch: why this request was refused (one line), its other fields then empty
    logprobs: tuple[TokenLogprob, ...] = ()  # each generated token's, when asked for (logprobs=N)


def failure_message(error: BaseException) -> str:
    """One line for a request that failed: a caller's mistake as it is, anything else as an internal error
    naming its type (a bug to report)."""
    if isinstance(error, UsageError):
        return str(error)
    detail = str(error).splitlines()[0][:200] if str(error) else ""
    return f"internal error: {type(error).__name__}" + (f": {detail}" if detail else "")


def parse_k(k: int | str) -> int | str:
    """``k`` as given on the command line, validated: an integer ≥ 0 (fixed), "additive" (+2 / −1 rule) or
    "auto" (the K that the calibrated cost model and the running acceptance estimate favour, 0 included)."""
    if isinstance(k, str):
        if k in ("additive", "auto"):
            return k
        if not (k.isascii() and k.isdigit()) or len(k) > 9:  # "²" is a digit to isdigit, not to int
            raise UsageError(f"k must be an integer >= 0, 'additive' or 'auto', got {k[:20]!r}")
        k = int(k)
    return ConstantK(k).k


def k_policy(
    k: int | str,
    cost: CostModel | None = None,
    costs_at: Callable[[int], CostModel] | None = None,
    batch_costs_at: Callable[[int], BatchCost] | None = None,
) -> KPolicy:
    """The K policy that ``k`` (see :func:`parse_k`) names; "auto" needs ``cost``, the calibrated cost model
    of the target and drafter (:meth:`Speculator.calibration` measures or loads it), follows the context with
    ``costs_at`` and plans batches with ``batch_costs_at`` (see :class:`~verispec.policies.CostModelK`)."""
    k = parse_k(k)
    if isinstance(k, int):
        return ConstantK(k)
    if k == "additive":
        return AdditiveK()
    if cost is None:
        raise UsageError("k 'auto' needs the cost model of the target and drafter")
    return CostModelK(cost, costs_at=costs_at, batch_costs_at=batch_costs_at)


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """The models to load and the drafter to draft with, as a config (``verispec serve``, ``verispec batch``
    extend it): the :class:`Speculator` arguments that name files and choices, checked when it loads."""

    target: str = DEFAULT_MODEL
    tokenizer: str | None = None
    draft: str | None = None
    draft_tokenizer: str | None = None  # the draft's own tokenizer file (a llama2.c draft)
    cross_tokenizer: str = "auto"  # with a draft of another tokenizer: tli, string or auto
    drafter: str = "auto"
    drafter_path: str | None = None
    precision: str = DEFAULT_PRECISION

    def speculator(self, loaded: tuple[LanguageModel, Tokenizer] | None = None, **options) -> Speculator:
        """The Speculator of this choice; ``loaded``: the target already in memory, instead of loading
        ``target`` (which still names it); ``options``: further Speculator arguments (``tree``)."""
        return Speculator(
            loaded if loaded is not None else self.target,
            self.draft,
            self.drafter,
            self.tokenizer,
            drafter_path=self.drafter_path,
            target_label=self.target,
            precision=self.precision,
            draft_tokenizer=self.draft_tokenizer,
            cross_tokenizer=self.cross_tokenizer,
            **options,
        )


class Speculator:
    """A loaded target (and draft) that generates with a chosen drafter.

    target, draft: model SPECs (see :func:`verispec.models.registry.load_model`) or already loaded
    (model, tokenizer) pairs; the target defaults to ``smollm2-135m``. The draft may also be ``layers:N``:
    the target's own first N layers (early exit, sharing the target's weights).
    drafter: a name of :data:`~verispec.drafting.registry.DRAFTERS` (one that ``needs_draft_model`` needs
    ``draft``; a ``learned`` one its file: ``drafter_path``, or the one verispec ships for the target) or
    "auto" (model when a draft is given, else the shipped learned drafter when it exists and matches the
    target, else ngram).
    tree: a token-tree shape (:class:`~verispec.drafting.tree.TreeShape`): a drafter that ``takes_trees`` then
    proposes a tree each round (several n-gram matches; the draft's top-k children at each node; the learned
    head's top-k when greedy, else independent samples of its q), which the target scores in one forward; K is
    then not used. A dynamic shape (with a node budget, e.g. ``TreeShape.parse("3x4:auto")``) needs the eagle
    drafter; budget "auto" sizes each tree by the calibrated costs (:meth:`calibration`). ``tree="auto"``:
    the eagle drafter's :data:`~verispec.drafting.learned.eagle_drafter.DEFAULT_TREE`, Medusa's sparse tree
    shaped by its heads' accuracies, chain rounds for the other drafters.
    drafter_path: a learned drafter file (``verispec train-drafter``) for the target, for a ``learned``
    drafter (a file of its kind) or "auto" (the file's kind).
    target_label: names a loaded target (default: its SPEC) in messages and calibration notices, and picks
    the drafter verispec ships for it.
    precision: the weights of target and draft models loaded from a SPEC ("fp32", "fp16" or "auto": the
    fastest this machine runs, see :meth:`verispec.models.llama.Llama.optimize_for_cpu`). It is part of the
    target's identity: fp16 rounds every projection and the output head, and the output is exactly that
    model's.
    """

    def __init__(
        self,
        target: str | tuple[LanguageModel, Tokenizer] | None = None,
        draft: str | tuple[LanguageModel, Tokenizer] | None = None,
        drafter: str = "auto",
        tokenizer: str | None = None,
        device: str = "cpu",
        tree: TreeShape | str | None = None,
        drafter_path: str | Path | None = None,
        target_label: str | None = None,
        precision: str = DEFAULT_PRECISION,
        draft_tokenizer: str | None = None,
        cross_tokenizer: str = "auto",
    ) -> None:
        check_algorithm(cross_tokenizer)
        torch_device = check_device(device)
        layers = early_exit_layers(draft) if isinstance(draft, str) else None
        itself = self_draft(draft) if isinstance(draft, str) else None
        own_weights = layers is not None or itself is not None  # the target's own: its tokenizer
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
        if kind is not None and isinstance(tree, TreeShape):
            kind.check_tree(tree)  # before a model loads
        self.model, self.tokenizer = _load(
            DEFAULT_MODEL if target is None else target, tokenizer, torch_device, precision
        )
        self.draft = None
        self.pair: VocabularyPair | None = None  # a draft with another tokenizer: the two vocabularies
        self.cross_tokenizer = cross_tokenizer
        self.early_exit = layers is not None  # the draft shares the target's cache
        if layers is not None:
            self.draft = _early_exit(self.model, layers)
        elif itself is not None:
            self.draft = _requantized(self.model, *itself)
        elif draft is not None:
            self.draft, spoken = _load(draft, draft_tokenizer or tokenizer, torch_device, precision)
            if not same_vocabulary(self.tokenizer, spoken):  # drafts across tokenizers
                self.pair = VocabularyPair.build(self.tokenizer, spoken, self.draft.vocab_size)
        if cross_tokenizer != "auto" and self.pair is None:
            raise UsageError("--cross-tokenizer applies to a draft whose tokenizer differs from the target's")
        if target_label is None:
            target_label = DEFAULT_MODEL if target is None else target if isinstance(target, str) else ""
        self.head: LearnedHead | None = None  # the learned drafter's
        learned = kind.learned if kind is not None else draft is None  # auto: the shipped one, if any
        if learned or drafter_path is not None:
            wanted = kind.name if kind is not None else None if drafter_path is not None else "eagle"
            self.head = _learned_head(self.model, drafter_path, target_label, kind is not None, wanted)
        shipped = kind is None and draft is None and drafter_path is None and self.head is not None
        if shipped and not self._learned_pays(target_label):
            self.head = None  # auto: prompt lookup instead of the shipped drafter (see LEARNED_MARGIN)
        if kind is None and self.head is not None:  # auto with a drafter file: the file's kind
            kind = DRAFTERS[self.head.kind]
        self.kind = kind if kind is not None else choose_auto(draft is not None, self.head is not None)
        if self.kind.reads_target_hidden and not isinstance(self.model, HiddenStateModel):
            raise UsageError(
                f"drafter {self.kind.name!r} reads the target's hidden states: it needs a native target, "
                f"not a {type(self.model).__name__}"
            )
        if tree == AUTO:
            tree = self._default_tree()
        elif tree is not None and not isinstance(tree, TreeShape):
            raise UsageError(f"tree must be a TreeShape, {AUTO!r} or None, got {tree!r}")
        if tree is not None:
            self.kind.check_tree(tree)
            tree.check_fits(self.model.max_context)
        self.tree = tree
        if tree is not None and self.pair is not None:
            raise UsageError("token trees are drafted with the target's tokenizer, not across tokenizers")
        self.drafter_name = self.kind.name if self.pair is None else f"{self.kind.name}-{cross_tokenizer}"
        self._labels = (target_label, draft if isinstance(draft, str) else "")
        self._calibration: Calibration | None = None

    def _drafter(self, sampling: SamplingParams, target_cache: Cache | None = None) -> Drafter | TreeDrafter:
        """The drafter for one generation (a tree drafter with ``tree``); an early-exit draft reads
        ``target_cache`` (when given)."""
        chain = self._chain_drafter(sampling, target_cache)
        if self.tree is None:
            return chain
        assert self.kind.tree is not None  # checked in the constructor
        cost = self.calibration().cost_model if self.tree.budget == AUTO else None
        return self.kind.tree(chain, self.tree, cost)

    def _chain_drafter(self, sampling: SamplingParams, target_cache: Cache | None = None) -> Drafter:
        """The chain drafter (what :meth:`calibration` measures; a tree drafter branches it)."""
        shared = target_cache if self.early_exit or self.kind.reads_target_cache else None
        inputs = DraftInputs(
            sampling,
            self.model,
            draft=self.draft,
            target_cache=shared,
            head=self.head,
            pair=self.pair,
            cross_tokenizer=self.cross_tokenizer,
            cost_ratio=self._calibration.cost_ratio if self._calibration is not None else None,
        )
        return self.kind.chain(inputs)

    def _default_tree(self) -> TreeShape | None:
        """The tree of ``tree="auto"``: the eagle drafter's :data:`DEFAULT_TREE`, Medusa's sparse tree shaped
        by its heads' held-out accuracies; None (chain rounds) for the other drafters."""
        if self.kind.name == "eagle":
            return DEFAULT_TREE
        if isinstance(self.head, MedusaHeads) and self.head.rank_accuracy:
            return medusa_tree(self.head.rank_accuracy)
        return None

    def _learned_pays(self, target_label: str) -> bool:
        """Whether auto should draft with the learned drafter: the cost model (this machine's calibrated
        costs, measured once and cached) predicts it at least LEARNED_MARGIN times faster than plain
        decoding at its best K, at the per-position agreement its file records on held-out data."""
        assert self.head is not None
        heldout = self.head.heldout_accuracy
        if not heldout:
            return False
        greedy = SamplingParams(temperature=0)
        drafter = DRAFTERS["eagle"].chain(DraftInputs(greedy, self.model, head=self.head))
        cost = calibrate(self.model, drafter, target_label=target_label).cost_model
        k_max = cost.max_k if cost.max_k is not None else len(heldout)
        alphas = [*heldout, *[heldout[-1]] * max(0, k_max - len(heldout))][:k_max]  # the last one after it
        return float(speedup_by_k(alphas, cost.round_costs(k_max)).max()) >= LEARNED_MARGIN

    def calibration(self, *, force: bool = False, repetitions: int = QUICK_REPETITIONS) -> Calibration:
        """The costs of this target and drafter on this machine (:mod:`verispec.calibrate`): read from the
        cache, or measured (seconds) and cached on first use; ``force`` measures them again."""
        if self._calibration is None or force:
            drafter = self._chain_drafter(SamplingParams(temperature=0))
            self._calibration = calibrate(
                self.model,
                drafter if self.kind.drafts else None,
                target_label=self._labels[0],
                draft_label=self._labels[1],
                repetitions=repetitions,
                force=force,
            )
        return self._calibration

    def k_policy(self, k: int | str) -> KPolicy:
        """The K policy ``k`` names (see :func:`parse_k`), "auto" over this speculator's calibrated costs
        (drafter "none" drafts nothing whatever K, so it needs none; tree rounds do not use K)."""
        if self.tree is not None:
            return ConstantK(0)
        if parse_k(k) != "auto":
            return k_policy(k)
        if not self.kind.drafts:
            return ConstantK(0)
        calibration = self.calibration()
        return k_policy(k, calibration.cost_model, calibration.cost_model_at, calibration.batch_cost_at)

    def k_label(self, k: int | str) -> str:
        """How stats name the draft size: K (see :func:`parse_k`), or the tree's shape."""
        return str(parse_k(k)) if self.tree is None else f"tree {self.tree.name}"

    def encode_prompt(self, prompt: str | Sequence[Mapping[str, str]], chat: bool = False) -> list[int]:
        """The prompt's token ids: ``prompt`` as it is, or (``chat``) in the model's chat template, where it
        may also be a conversation: {"role", "content"} messages ending with a user turn."""
        if isinstance(prompt, str):
            if not check_text(prompt, "the prompt").strip():
                raise UsageError("the prompt is empty")
            text = self.tokenizer.chat_prompt(prompt) if chat else prompt
        elif chat and prompt:
            for i, message in enumerate(prompt):
                check_text(message.get("content", ""), f"message {i}'s content")
            text = self.tokenizer.chat_prompt(prompt)
        else:
            raise UsageError("a conversation (a list of messages) needs chat=True and at least one message")
        return self.tokenizer.encode(text, add_bos=True)

    def stream(self, prompt: str | Sequence[Mapping[str, str]], **options) -> Iterator[Chunk]:
        """Yields what each round commits, decoding ``prompt`` alone (a batch of one); options as for
        :meth:`request`."""
        check_keywords(options, REQUEST_OPTIONS)
        request, text = self.request(prompt, **options)
        engine = SpeculativeEngine(self.model)
        running = engine.submit(request)
        for tokens in engine.follow(running):
            yield Chunk(text.add(tokens), tokens, running.last_logprobs(len(tokens)))
        tail = text.finish()
        if tail:
            yield Chunk(tail, [])

    def request(
        self,
        prompt: str | Sequence[Mapping[str, str]],
        *,
        k: int | str = DEFAULT_K,
        max_new_tokens: int = 128,
        sampling: SamplingParams | None = None,
        chat: bool = False,
        stop: tuple[str, ...] = (),
        stats: GenerationStats | None = None,
        trace: TraceRecorder | None = None,
        logprobs: int | None = None,
    ) -> tuple[Request, _TextAssembler]:
        """An engine request for ``prompt`` (its own drafter, made for the cache row it is given, its own K
        policy and stop check), and the text assembler of its output; ``sampling`` defaults to
        :data:`DEFAULT_SAMPLING`, greedy. ``stats`` (optional) is filled in as
        it goes; ``trace`` (optional, chain rounds only) records every round (see :mod:`verispec.trace`);
        ``logprobs`` (optional, 0 to 20): each token's log-probability under the target's own distribution
        and that many likeliest alternatives, in each chunk (see :class:`~verispec.engine.TokenLogprob`)."""
        sampling = sampling or DEFAULT_SAMPLING
        for s in stop:
            check_text(s, "a stop string")
        eos = self.tokenizer.eos_token_ids
        config = EngineConfig(max_new_tokens, sampling, eos, tuple(stop), logprobs)
        stats = stats if stats is not None else GenerationStats(self.drafter_name, self.k_label(k))
        text = _TextAssembler(self.tokenizer, config.stop_strings)
        request = Request(
            self.encode_prompt(prompt, chat),
            config,
            lambda cache: self._drafter(sampling, cache),
            self.k_policy(k),
            stats,
            text.stop_check if stop else None,
            trace,
        )
        return request, text

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[Mapping[str, str]]],
        *,
        slots: int = 8,
        seeds: Sequence[int] | None = None,
        **options,
    ) -> list[GenerationResult]:
        """Every prompt generated in a continuous batch of up to ``slots`` sequences (each request joining as
        a slot frees; options as for :meth:`request`, but ``stats`` and ``trace``), results in the prompts'
        order. A prompt that cannot be generated (empty, too long for the context, not valid Unicode) gets a
        result with ``error`` set, as does one whose generation fails on its own (an internal error: its
        type and message); the others are untouched. Each result equals what :meth:`generate` gives for that
        prompt alone (greedy: token for token; sampled: the same tokens for the same seed at a fixed K, or at
        any K with ``SamplingParams.invariant``). ``seeds``: one sampling seed per prompt (instead of the
        sampling parameters' one for all)."""
        if not is_int(slots) or slots < 1:
            raise UsageError(f"slots must be an integer >= 1, got {slots!r}")
        if seeds is not None and len(seeds) != len(prompts):
            raise UsageError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        check_keywords(options, REQUEST_OPTIONS)
        sampling = options.pop("sampling", None) or DEFAULT_SAMPLING
        results: list[GenerationResult | None] = [None] * len(prompts)
        engine = SpeculativeEngine(self.model, slots=min(slots, max(1, len(prompts))))
        waiting = list(enumerate(prompts))
        running: dict[int, tuple[int, _TextAssembler, list[Chunk]]] = {}  # id(Running) → its prompt's
        while waiting or engine.running:
            while waiting and engine.free_slots:
                index, prompt = waiting.pop(0)
                own = sampling if seeds is None else sampling.with_seed(seeds[index])
                try:
                    request, text = self.request(prompt, sampling=own, **options)
                    handle = engine.submit(request)
                except Exception as err:  # this request only
                    results[index] = GenerationResult("", [], {}, error=failure_message(err))
                    continue
                running[id(handle)] = (index, text, [])
            for handle, tokens in engine.step():
                index, text, chunks = running[id(handle)]
                try:
                    if handle.error is not None:
                        raise handle.error
                    if tokens:
                        chunks.append(Chunk(text.add(tokens), tokens, handle.last_logprobs(len(tokens))))
                    if handle.done:
                        tail = text.finish()
                        results[index] = GenerationResult(
                            "".join(c.text for c in chunks) + tail,
                            [t for c in chunks for t in c.token_ids],
                            handle.request.stats.as_dict(),
                            logprobs=tuple(handle.logprobs),
                        )
                except Exception as err:  # this request only
                    engine.cancel(handle)
                    results[index] = GenerationResult("", [], {}, error=failure_message(err))
                if handle.done:
                    del running[id(handle)]
        return [r for r in results if r is not None]

    def generate(self, prompt: str | Sequence[Mapping[str, str]], **options) -> GenerationResult:
        """The whole generation at once; options as for :meth:`request`."""
        stats = GenerationStats(self.drafter_name, self.k_label(options.get("k", DEFAULT_K)))
        chunks = list(self.stream(prompt, stats=stats, **options))
        return GenerationResult(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            stats=stats.as_dict(),
            logprobs=tuple(x for c in chunks for x in c.logprobs),
        )


REQUEST_OPTIONS = tuple(inspect.signature(Speculator.request).parameters)[2:]  # after self and prompt


TEXT_WINDOW = 8  # tokens decoded before the newest ones, so that a tokenizer's joins across them are seen
STOP_REACH = 64  # tokens (beyond a stop string's length) whose text a stop check searches


class _TextAssembler:
    """Incremental detokenization: emits text only once it is final (whole UTF-8 characters, and not a
    possible beginning of a stop string), and cuts the text before a stop string.

    A step decodes only its newest tokens, after a window of :data:`TEXT_WINDOW` tokens before them, not the
    whole output: the text of the tokens before the window is kept (``kept``: the decoded ``ids[:anchor]``),
    and the window's own text is cut from the front of the decode. Where the decode of the window and the
    tokens after it does not begin with the window's text alone (a join the window cannot see), everything
    is decoded again. A stop check searches the text of the last tokens alone: the text before them held no
    stop string, or the sequence would have stopped there."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self.sent = 0  # characters already yielded
        self.anchor, self.kept, self.window = (
            0,
            "",
            "",
        )  # ids[:anchor] decode to kept; window: ids[w:anchor]'s

    def stop_check(self, new_ids: list[int]) -> int | None:
        """How many of ``new_ids`` to keep when a stop string appears in their text, else None."""
        reach = STOP_REACH + max(len(s) for s in self.stop_strings)
        if not any(s in self.tokenizer.decode(new_ids[-reach:]) for s in self.stop_strings):
            return None
        return self._stop_keep(new_ids)

    def _stop_keep(self, new_ids: list[int]) -> int | None:
        """:meth:`stop_check` from the text of all of ``new_ids``."""
        if not any(s in self.tokenizer.decode(new_ids) for s in self.stop_strings):
            return None
        keep = len(new_ids)
        while keep > 0 and any(s in self.tokenizer.decode(new_ids[: keep - 1]) for s in self.stop_strings):
            keep -= 1
        return keep

    def _decoded(self, end: int) -> str:
        """The text of ``ids[:end]`` (end ≥ anchor), from the kept text and a decode of the window onwards."""
        whole = self.tokenizer.decode(self.ids[max(0, self.anchor - TEXT_WINDOW) : end])
        if whole.startswith(self.window):
            return self.kept + whole[len(self.window) :]
        return self.tokenizer.decode(self.ids[:end])

    def _text(self) -> str:
        text = self._decoded(len(self.ids))
        # keep the text of all but the newest tokens, up to the last of a few places where a character ends
        for anchor in range(
            len(self.ids) - TEXT_WINDOW, max(self.anchor, len(self.ids) - 2 * TEXT_WINDOW), -1
        ):
            kept = self._decoded(anchor)
            if text.startswith(kept) and not kept.endswith("\ufffd"):
                window = self.tokenizer.decode(self.ids[max(0, anchor - TEXT_WINDOW) : anchor])
                self.anchor, self.kept, self.window = anchor, kept, window
                break
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text

    def add(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self._text()
        final = len(text.rstrip("\ufffd"))
        for s in self.stop_strings:  # hold back a tail that may grow into a stop string
            for n in range(min(len(s) - 1, final), 0, -1):
                if text[final - n : final] == s[:n]:
                    final -= n
                    break
        piece, self.sent = text[self.sent : max(final, self.sent)], max(final, self.sent)
        return piece

    def finish(self) -> str:
        text = self._text()
        piece, self.sent = text[self.sent :], len(text)
        return piece


def _early_exit(model: LanguageModel, layers: int) -> LanguageModel:
    """The early-exit draft: the target's first ``layers`` layers (native models only)."""
    first_layers = getattr(model, "first_layers", None)
    if first_layers is None:
        raise UsageError(f"early-exit drafts need a native model; this target is a {type(model).__name__}")
    return first_layers(layers)


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
    chosen = path if path is not None else shipped_drafter(target_label, kind or "eagle")
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
    spec: str | tuple[LanguageModel, Tokenizer], tokenizer: str | None, device: torch.device, precision: str
) -> tuple[LanguageModel, Tokenizer]:
    if isinstance(spec, tuple):
        return spec
    return load_model(spec, tokenizer=tokenizer, device=device, precision=precision)


@_own_keywords
def generate(
    prompt: str,
    *,
    target: str | None = None,
    draft: str | None = None,
    drafter: str = "auto",
    tokenizer: str | None = None,
    k: int | str = DEFAULT_K,
    max_new_tokens: int = 128,
    temperature: float = DEFAULT_SAMPLING.temperature,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int | None = None,
    invariant: bool | None = None,
    chat: bool = False,
    stop: tuple[str, ...] = (),
    tree: TreeShape | str | None = None,
    drafter_path: str | None = None,
    precision: str = DEFAULT_PRECISION,
) -> GenerationResult:
    """Generate text for ``prompt`` with speculative decoding; the same arguments and defaults as ``verispec
    generate`` (greedy unless ``temperature`` > 0: :data:`DEFAULT_SAMPLING`; a keyword of transformers'
    ``generate`` such as ``max_length`` is a one-line UsageError naming verispec's own; ``invariant``: None,
    invariant draws exactly when a ``seed`` is given, see :class:`~verispec.sampling.SamplingParams`;
    ``tree``: a :class:`~verispec.drafting.tree.TreeShape`, "WxD" or a JSON shape file, either with ":N" or
    ":auto" for a dynamic tree, or "auto": the learned drafter's default tree, see :class:`Speculator`)."""
    sampling = SamplingParams(temperature, top_k, top_p, min_p, seed, invariant)
    shape = TreeShape.parse(tree) if isinstance(tree, str) and tree != AUTO else tree
    speculator = Speculator(
        target, draft, drafter, tokenizer, tree=shape, drafter_path=drafter_path, precision=precision
    )
    return speculator.generate(
        prompt, k=k, max_new_tokens=max_new_tokens, sampling=sampling, chat=chat, stop=tuple(stop)
    )
