"""The Python API: load a target (and a draft), then generate text, streamed or whole.

    >>> import verispec
    >>> result = verispec.generate("Summarize: ...", drafter="ngram", max_new_tokens=64, temperature=0)
    >>> result.text, result.token_ids, result.stats["tokens_per_target_call"]

``Speculator`` keeps the models loaded between generations; ``generate`` is a one-shot convenience. What a
generation asks for is one :class:`~verispec.options.GenerationOptions`, given whole or as its fields'
keywords, checked once at the door.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, Unpack, cast

from verispec.choice import DEFAULT_PRECISION, DrafterFields, ModelChoice
from verispec.costs.analytic import BatchCost, CostModel
from verispec.costs.calibrate import QUICK_REPETITIONS, Calibration, calibrate
from verispec.costs.online import OnlineCosts
from verispec.costs.policies import AdditiveK, ConstantK, CostModelK, Evidence, KPolicy, PartsK, TreeGate
from verispec.drafting.base import Drafter, TreeDrafter
from verispec.drafting.hybrid import LookupFirstDrafter
from verispec.drafting.registry import DraftInputs
from verispec.drafting.suffix_cache import SuffixCache, tokenizer_identity
from verispec.drafting.suffix_files import open_suffix_cache
from verispec.drafting.tree import AUTO, TreeShape
from verispec.engine.driver import Collected, Driver
from verispec.engine.sequence import DrafterFor, EngineConfig, GenerationStats, Request, TokenLogprob
from verispec.errors import UsageError
from verispec.grammar.constraint import Constraint
from verispec.grammar.matcher import start_state
from verispec.grammar.rounds import GrammarState
from verispec.grammar.tokens import llg_tokenizer
from verispec.grammar.tools import CALL_OPEN, Tools
from verispec.inputs import check_int, check_prompt, check_text, did_you_mean, is_int
from verispec.models.base import Cache, SpelledTokenizer
from verispec.models.names import DEFAULT_MODEL
from verispec.options import (
    DEFAULT_K,
    DEFAULT_SAMPLING,
    OPTION_NAMES,
    SAMPLING_NAMES,
    DraftLength,
    GenerationOptions,
    OptionFields,
    SamplingParams,
    check_keywords,
)
from verispec.resolve import Parts, Target, check_device, resolve
from verispec.text import Chunk, TextAssembler
from verispec.trace import TraceRecorder

if TYPE_CHECKING:
    from verispec.choice import Loadable

P = ParamSpec("P")
R = TypeVar("R")
# a prompt: text, a conversation ({"role", "content"} messages, with chat), or token ids taken as they are
Prompt = str | Sequence[Mapping[str, Any]] | Sequence[int]

__all__ = [
    "GenerationResult",
    "Speculator",
    "failure_message",
    "generate",
    "k_policy",
]


def _own_keywords(function: Callable[P, R]) -> Callable[P, R]:
    """``function``, refusing a keyword it does not take with :func:`check_keywords` (not a TypeError); a
    constructor's (``Speculator``'s) generation options (``k``, ``temperature``...) named as what each
    generation takes."""
    parameters = inspect.signature(function).parameters
    allowed = tuple(name for name in parameters if name != "self")
    generations = set(OPTION_NAMES + SAMPLING_NAMES) - set(allowed) if "self" in parameters else set()

    @functools.wraps(function)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for name in kwargs:
            meant = name if name in generations else None
            if meant is None and name not in allowed and not did_you_mean(name, allowed):
                meant = did_you_mean(name, generations).removeprefix(" (did you mean ").removesuffix("?)")
            if meant:  # a generation's option, or close to one and to nothing here
                said = name if meant == name else f"{name} (did you mean {meant}?)"
                raise UsageError(
                    f"{said} is each generation's option (generate, stream, generate_batch: {meant}=...), "
                    "not the speculator's"
                )
        check_keywords(kwargs, allowed)
        return function(*args, **kwargs)

    return checked


@dataclass(frozen=True)
class GenerationResult:
    """What one generation produced."""

    text: str  # the generated text (prompt excluded, stop string excluded)
    token_ids: list[int]  # the generated token ids
    stats: dict[str, Any]  # GenerationStats.as_dict()
    error: str = ""  # in a batch: why this request was refused (one line), its other fields then empty
    logprobs: tuple[TokenLogprob, ...] = ()  # each generated token's, when asked for (logprobs=N)

    @classmethod
    def collected(cls, sink: Collected, stats: GenerationStats) -> GenerationResult:
        """What ``sink`` was given, or its error (one line)."""
        if sink.error is not None:
            return cls("", [], {}, error=failure_message(sink.error))
        return cls("".join(sink.text), list(sink.token_ids), stats.as_dict(), logprobs=tuple(sink.logprobs))


def failure_message(error: BaseException) -> str:
    """One line for a request that failed: a caller's mistake as it is, anything else as an internal error
    naming its type (a bug to report)."""
    if isinstance(error, UsageError):
        return str(error)
    detail = str(error).splitlines()[0][:200] if str(error) else ""
    return f"internal error: {type(error).__name__}" + (f": {detail}" if detail else "")


def k_policy(
    k: DraftLength | int | str,
    cost: CostModel | None = None,
    costs_at: Callable[[int], CostModel] | None = None,
    batch_costs_at: Callable[[int], BatchCost] | None = None,
    online: OnlineCosts | None = None,
    shared: Evidence | None = None,
) -> KPolicy:
    """The K policy that ``k`` (a :class:`~verispec.options.DraftLength`, or its int or text) names; "auto"
    needs ``cost``, the calibrated cost model of the target and drafter (:meth:`Speculator.calibration`
    measures or loads it), follows the context with ``costs_at``, plans batches with ``batch_costs_at``,
    corrects them all by the costs measured as it runs in ``online`` and starts from the acceptance evidence
    ``shared`` by other requests (see :class:`~verispec.costs.policies.CostModelK`)."""
    k = DraftLength.parse(k)
    if k.fixed is not None:
        return ConstantK(k.fixed)
    if not k.auto:
        return AdditiveK()
    if cost is None:
        raise UsageError("k 'auto' needs the cost model of the target and drafter")
    return CostModelK(cost, costs_at=costs_at, batch_costs_at=batch_costs_at, online=online, shared=shared)


def _auto_k(calibration: Calibration, online: OnlineCosts | None, shared: Evidence | None) -> CostModelK:
    """``--k auto`` over ``calibration``'s costs, corrected by those ``online`` measures as it runs, its
    acceptance estimates starting from the ``shared`` evidence of other requests (None: from the prior)."""
    costs = calibration.cost_model, calibration.cost_model_at, calibration.batch_cost_at
    return cast(CostModelK, k_policy(DEFAULT_K, *costs, online, shared))


class Speculator:
    """A loaded target (and draft) that generates with a chosen drafter.

    target, draft: model SPECs (see :func:`verispec.models.registry.load_model`) or already loaded
    (model, tokenizer) pairs; the target defaults to ``smollm2-135m``. The draft may also be ``layers:N``:
    the target's own first N layers (early exit, sharing the target's weights).
    drafter: a name of :data:`~verispec.drafting.registry.DRAFTERS` (one that ``needs_draft_model`` needs
    ``draft``; a ``learned`` one its file: ``drafter_path``, or the one verispec ships for the target) or
    "auto" (model when a draft is given, else the shipped learned drafter when it exists, matches the target
    and pays by this machine's costs, behind prompt lookup for an eagle head, ``ngram+eagle``; else ngram).
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

    These arguments are a :class:`~verispec.choice.ModelChoice` (with ``device``), checked and loaded by
    :func:`verispec.resolve.resolve` (every "auto" rule is there); :meth:`on` drafts beside a target already
    loaded (:class:`~verispec.resolve.Target`: one load for any number of drafters), :meth:`from_parts`
    assembles a speculator from parts already resolved.
    """

    @_own_keywords
    def __init__(
        self,
        target: Loadable | None = None,
        draft: Loadable | None = None,
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
        spec = DEFAULT_MODEL if target is None else target
        choice = ModelChoice(
            target=spec if isinstance(spec, str) else "",  # a loaded target: named by its label alone
            tokenizer=tokenizer,
            draft=draft,
            draft_tokenizer=draft_tokenizer,
            cross_tokenizer=cross_tokenizer,
            drafter=drafter,
            drafter_path=None if drafter_path is None else str(drafter_path),
            precision=precision,
            device=device,
        )
        loaded = None
        if isinstance(spec, tuple):
            loaded = Target(*spec, choice, target_label or "", check_device(device))
        elif target_label is not None:
            loaded = Target.load(choice, target_label)
        self._assemble(resolve(choice, tree, loaded))

    @classmethod
    def on(
        cls,
        target: Target,
        *,
        drafter: str | None = None,
        tree: TreeShape | str | None = None,
        **fields: Unpack[DrafterFields],
    ) -> Speculator:
        """A speculator drafting beside ``target`` (loaded once: :meth:`verispec.resolve.Target.load`), with
        the drafter of its choice (``drafter`` None), its suffix cache from the choice's file, or with
        ``drafter`` and what it drafts from, ``fields`` (:meth:`~verispec.choice.ModelChoice.with_drafter`: a
        drafter with a shared cache then starts empty); token trees of ``tree`` when given (see the class)."""
        if drafter is None and fields:
            raise UsageError(f"give the drafter that drafts from {', '.join(fields)}")
        choice = target.choice if drafter is None else target.choice.with_drafter(drafter, **fields)
        speculator = cls.from_parts(resolve(choice, tree, target))
        if speculator.kind.shared_cache:
            identity = tokenizer_identity(speculator.tokenizer)
            speculator.suffix_cache = open_suffix_cache(
                choice.suffix_cache_file, choice.suffix_budget, identity
            )
        return speculator

    @classmethod
    def from_parts(cls, parts: Parts) -> Speculator:
        """A speculator generating with ``parts`` (see :func:`verispec.resolve.resolve`)."""
        speculator = cls.__new__(cls)
        speculator._assemble(parts)
        return speculator

    def _assemble(self, parts: Parts) -> None:
        self.parts = parts
        self.model, self.tokenizer, self.kind = parts.model, parts.tokenizer, parts.kind
        self.draft, self.pair, self.head, self.tree = parts.draft, parts.pair, parts.head, parts.tree
        self.drafter_name = parts.drafter_name
        self.suffix_cache: SuffixCache | None = None  # a drafter's cache shared by every request (suffix)
        if parts.kind.shared_cache:
            self.suffix_cache = SuffixCache(vocabulary=tokenizer_identity(parts.tokenizer))
        self._calibration: Calibration | None = None
        self._online: OnlineCosts | None = None  # the costs measured as it runs, against `_calibration`
        # a lookup first (LookupFirstDrafter): the lookup's own calibration and costs measured as it runs
        self._lookup: tuple[Calibration, OnlineCosts] | None = None
        # (part, sampling settings but the seed, constrained) → the acceptance evidence of `--k auto` requests
        self._evidence: dict[tuple[object, ...], Evidence] = {}
        self._driver: Driver | None = None  # the streams' engine, kept between them (see stream)
        self._streams = threading.Lock()  # held by the stream running on it

    def _drafter(
        self,
        sampling: SamplingParams,
        target_cache: Cache | None = None,
        suffix_cache: SuffixCache | None = None,
        policy: KPolicy | None = None,
    ) -> Drafter | TreeDrafter:
        """The drafter for one generation (a tree drafter with ``tree``); an early-exit draft reads
        ``target_cache`` (when given), a suffix drafter ``suffix_cache`` (default: this speculator's); a
        drafter of parts asks ``policy`` (its request's, a :class:`PartsK`) each part's K."""
        chain = self._chain_drafter(sampling, target_cache, suffix_cache or self.suffix_cache)
        if isinstance(chain, LookupFirstDrafter) and isinstance(policy, PartsK):
            chain.policy = policy
        if self.tree is None:
            return chain
        assert self.kind.tree is not None  # checked by resolve
        cost = self.calibration().cost_model if self.tree.budget == AUTO else None
        return self.kind.tree(chain, self.tree, cost)

    def _chain_drafter(
        self,
        sampling: SamplingParams,
        target_cache: Cache | None = None,
        suffix_cache: SuffixCache | None = None,
    ) -> Drafter:
        """The chain drafter (what :meth:`calibration` measures, with a private empty suffix cache, so that
        the cost measured never depends on what the shared one holds; a tree drafter branches it)."""
        shared = target_cache if self.parts.early_exit or self.kind.reads_target_cache else None
        inputs = DraftInputs(
            sampling,
            self.model,
            draft=self.draft,
            target_cache=shared,
            slot=target_cache,
            head=self.head,
            pair=self.pair,
            cross_tokenizer=self.parts.cross_tokenizer,
            cost_ratio=self._calibration.cost_ratio if self._calibration is not None else None,
            suffix_cache=suffix_cache,
        )
        return self.kind.chain(inputs)

    def calibration(self, *, force: bool = False, repetitions: int = QUICK_REPETITIONS) -> Calibration:
        """The costs of this target and drafter on this machine (:mod:`verispec.costs.calibrate`): read from
        the cache, or probed (seconds, once) and cached on first use; ``force`` measures them again in
        full."""
        if self._calibration is None or force:
            drafter = self._chain_drafter(SamplingParams(temperature=0))
            parts = drafter if isinstance(drafter, LookupFirstDrafter) else None
            measure = functools.partial(
                calibrate,
                self.model,
                target_label=self.parts.target_label,
                draft_label=self.parts.draft_label,
                repetitions=repetitions,
            )
            # a lookup first: its head's costs (the lookup's are next to none), and the lookup's apart
            self._calibration = measure(
                (parts.head if parts else drafter) if self.kind.drafts else None, force=force
            )
            self._online = OnlineCosts(self._calibration.step_seconds)
            lookup = None if parts is None else measure(parts.lookup, draft_label="")
            self._lookup = None if lookup is None else (lookup, OnlineCosts(lookup.step_seconds))
        return self._calibration

    def k_policy(self, k: DraftLength | int | str, options: GenerationOptions | None = None) -> KPolicy:
        """The K policy ``k`` names (a :class:`~verispec.options.DraftLength`, or its int or text), "auto"
        over this speculator's calibrated costs, corrected by the timings of its rounds (one estimator for
        the calibration, shared by every request; drafter "none" drafts nothing whatever K, so it needs none;
        token trees take no K: "auto" gates their rounds, :class:`~verispec.costs.policies.TreeGate`). A
        request's ``options`` (optional) name the acceptance evidence its estimates start from and add to:
        that of this speculator's requests with the same sampling settings and, or without, a constraint (the
        seed aside)."""
        k = DraftLength.parse(k)
        if self.tree is not None:  # auto: tree rounds where they are faster than plain ones
            return TreeGate() if k.auto else ConstantK(0)
        if not k.auto:
            return k_policy(k)
        if not self.kind.drafts:
            return ConstantK(0)
        calibration = self.calibration()
        policy = _auto_k(calibration, self._online, self._shared("head", calibration, options))
        if self._lookup is None:
            return policy
        lookup, online = self._lookup  # a lookup first: a policy per part
        shared = self._shared("lookup", lookup, options)
        return PartsK({"lookup": _auto_k(lookup, online, shared), "head": policy})

    def _shared(
        self, part: str, calibration: Calibration, options: GenerationOptions | None
    ) -> Evidence | None:
        """The acceptance evidence that ``part``'s auto K policies (over ``calibration``) share for requests
        with ``options``' sampling settings (the seed aside) and constraint or none; made on first use, None
        without options."""
        if options is None:
            return None
        s = options.sampling
        key = (part, s.temperature, s.top_k, s.top_p, s.min_p, s.invariant, options.structure is not None)
        if key not in self._evidence:
            self._evidence[key] = Evidence(calibration.cost_model.max_k or 0)
        return self._evidence[key]

    def k_label(self, k: DraftLength | int | str) -> str:
        """How stats name the draft size: K (a :class:`~verispec.options.DraftLength`, or its int or text),
        the tree's shape, or "0" for drafter "none" (it drafts nothing whatever K asks)."""
        if self.tree is not None:
            return f"tree {self.tree.name}"
        return str(DraftLength.parse(k)) if self.kind.drafts else "0"

    def encode_prompt(self, prompt: Prompt, chat: bool = False, tools: Tools | None = None) -> list[int]:
        """The prompt's token ids: ``prompt`` as it is (text, or token ids of the target's vocabulary), or
        (``chat``) in the model's chat template, where it may also be a conversation: {"role", "content"}
        messages ending with a user turn or tool results, and the functions it may call (``tools``)."""
        listed = hasattr(prompt, "__len__") and hasattr(prompt, "__iter__")
        tensor = "torch" in sys.modules and isinstance(prompt, sys.modules["torch"].Tensor)  # ids: .tolist()
        if tensor or isinstance(prompt, (bytes, Mapping)) or not (isinstance(prompt, str) or listed):
            raise UsageError(
                "a prompt is text, a list of token ids or (chat=True) a list of messages, "
                f"not {type(prompt).__name__}"
            )
        if not isinstance(prompt, str) and prompt and all(is_int(t, integral=True) for t in prompt):
            if chat:
                raise UsageError("token ids are a prompt as it is: they take no chat template (chat=False)")
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            if not all(0 <= t < self.model.vocab_size for t in ids):
                raise UsageError(f"a prompt's token ids must lie in [0, {self.model.vocab_size})")
            return ids
        if isinstance(prompt, str):
            check_prompt(prompt)
            if not chat:
                return self.tokenizer.encode(prompt, add_bos=True)
        elif chat and prompt:
            prompt = cast(Sequence[Mapping[str, Any]], prompt)  # not token ids: checked above
            for i, message in enumerate(prompt):
                if not isinstance(message, Mapping):
                    raise UsageError(f"message {i} must be a {{'role', 'content'}} mapping")
                role, content = message.get("role"), message.get("content")
                if not isinstance(role, str) or not role:
                    raise UsageError(f"message {i} needs a role (system, user, assistant, tool)")
                if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
                    raise UsageError(f"message {i}'s content must be text (None only beside tool_calls)")
                check_text(content or "", f"message {i}'s content")
        elif prompt and all(isinstance(t, (int, float)) for t in prompt):  # numbers, not all integers
            bad = next(t for t in prompt if not is_int(t, integral=True))
            raise UsageError(f"a prompt's token ids must be integers, got {bad!r}")
        else:
            raise UsageError(
                "a conversation (a list of messages) needs chat=True and at least one message; "
                "token ids at least one id"
            )
        ids = self._chat_ids(prompt, tools)
        context = self.model.max_context
        if tools is not None and len(ids) >= context:  # what made it long: said before the context's refusal
            alone = len(self._chat_ids(prompt, None))
            raise UsageError(
                f"the prompt has {len(ids)} tokens, {len(ids) - alone} of them the tools' definitions; "
                f"the context holds {context}"
            )
        return ids

    def _chat_ids(self, prompt: str | Sequence[Mapping[str, Any]], tools: Tools | None) -> list[int]:
        """The token ids of the tokenizer's chat prompt, told the tools where there are some."""
        if tools is None:
            text = self.tokenizer.chat_prompt(prompt)
        else:
            text = self.tokenizer.chat_prompt(prompt, tools=tools)
        return self.tokenizer.encode(text, add_bos=True)

    def request(
        self,
        prompt: Prompt,
        options: GenerationOptions,
        *,
        stats: GenerationStats | None = None,
        trace: TraceRecorder | None = None,
        suffix_cache: SuffixCache | None = None,
    ) -> tuple[Request, TextAssembler]:
        """An engine request for ``prompt`` with ``options`` (its own drafter, made for the cache row it is
        given, its own K policy, stop check and grammar state, whose setup — a constraint compiled, once per
        tokenizer llguidance's vocabulary — is timed here, apart: ``stats.grammar_seconds``, in none of the
        generation's times), and the text assembler of its output. ``stats`` (optional) is filled in as it
        goes; ``trace`` (optional, chain rounds only) records every round (see
        :mod:`verispec.trace`); ``suffix_cache``: the suffix drafter's shared cache for this request (a
        server tenant's; default :attr:`suffix_cache`)."""
        eos = self.tokenizer.eos_token_ids  # the ends the grammar allows too (its tokenizer's own)
        config = EngineConfig.of(options, eos)
        stats = stats if stats is not None else GenerationStats(self.drafter_name, self.k_label(options.k))
        calls = CALL_OPEN if options.tools is not None and options.tools.constraint is not None else None
        text = TextAssembler(self.tokenizer, options.stop, calls)  # stop strings never cut a tool call
        ids = self.encode_prompt(prompt, options.chat, options.tools)
        policy = self.k_policy(options.k, options)
        start = time.perf_counter()
        grammar = self._grammar(options.structure)  # compiled here, before the request's clock starts
        stats.grammar_seconds = time.perf_counter() - start if grammar is not None else 0.0
        request = Request(
            ids,
            config,
            DrafterFor(lambda cache: self._drafter(options.sampling, cache, suffix_cache, policy)),
            policy,
            stats,
            text.stop_check if options.stop else None,
            trace,
            grammar=grammar,
        )
        return request, text

    def _grammar(self, constraint: Constraint | None) -> GrammarState | None:
        """A fresh grammar state for one request (never shared), or None without a constraint."""
        if constraint is None:
            return None
        if not self._constrains():
            raise UsageError(
                "structured output needs a tokenizer that spells its tokens and has an end token"
            )
        assert isinstance(self.tokenizer, SpelledTokenizer)
        return start_state(constraint, self.tokenizer)

    def _constrains(self) -> bool:
        """Whether requests can be constrained here: a tokenizer that spells its tokens and has an end."""
        return isinstance(self.tokenizer, SpelledTokenizer) and bool(self.tokenizer.eos_token_ids)

    def prepare_constraints(self) -> None:
        """Make now what every constrained request shares, where requests can be constrained: llguidance's
        view of the tokenizer (made once per tokenizer; 0.6 s and about 20 MB for SmolLM2's 49,152 tokens),
        so that a server's first constrained request neither waits for it nor grows by it."""
        if self._constrains():
            assert isinstance(self.tokenizer, SpelledTokenizer)
            llg_tokenizer(self.tokenizer)

    def stream(
        self,
        prompt: Prompt,
        options: GenerationOptions | None = None,
        *,
        stats: GenerationStats | None = None,
        trace: TraceRecorder | None = None,
        **fields: Unpack[OptionFields],
    ) -> Iterator[Chunk]:
        """Yields what each round commits, decoding ``prompt`` alone (a batch of one): ``options``, or the
        defaults, with ``fields`` replaced (``k=4``, ``max_new_tokens=64``, ``sampling=``, ``chat=``,
        ``stop=``, ``logprobs=``: :class:`~verispec.options.GenerationOptions`; or the sampling's own,
        ``temperature=0.5``, ``seed=1``, ..., as :func:`generate` takes them); ``stats`` and ``trace`` as
        for :meth:`request`.

        One stream at a time runs on this speculator's own engine, kept from stream to stream: a prompt that
        begins with the last one's prompt and output (a chat's next turn, an agent's next step) keeps the
        keys and values of that start instead of scoring it again (``stats.cached_prompt_tokens``; a draft
        model's row of them too; the tokens are the same either way: a position's keys and values are a
        function of the tokens up to it).
        A stream started while another is open (another thread, or a generator not yet finished) runs on an
        engine of its own."""
        request, text = self.request(
            prompt, GenerationOptions.of(options, **fields), stats=stats, trace=trace
        )
        owned = self._streams.acquire(blocking=False)
        driver = self._own_driver() if owned else Driver(self.model)
        sink = Collected()
        running = driver.admit(request, text, sink)
        try:
            while not sink.ended:
                driver.step()
                yield from sink.take()
            yield from sink.take()
        finally:
            if not sink.ended and running is not None:  # the reader left early: its slot is freed
                driver.cancel(running)
            if owned:
                self._streams.release()
        if sink.error is not None:
            raise sink.error

    def forget(self) -> None:
        """Drop the engine kept between streams, and the keys and values it holds: the next stream scores
        its whole prompt, as a first one does (the bench's samples, each timed from an empty cache)."""
        with self._streams:
            self._driver = None

    def _own_driver(self) -> Driver:
        """The engine this speculator's streams run on, one at a time (made on first use)."""
        if self._driver is None:
            self._driver = Driver(self.model)
        return self._driver

    def generate(
        self,
        prompt: Prompt,
        options: GenerationOptions | None = None,
        *,
        stats: GenerationStats | None = None,
        trace: TraceRecorder | None = None,
        **fields: Unpack[OptionFields],
    ) -> GenerationResult:
        """The whole generation at once; arguments as for :meth:`stream`."""
        chosen = GenerationOptions.of(options, **fields)
        stats = stats if stats is not None else GenerationStats(self.drafter_name, self.k_label(chosen.k))
        chunks = list(self.stream(prompt, chosen, stats=stats, trace=trace))
        return GenerationResult(
            text="".join(c.text for c in chunks),
            token_ids=[t for c in chunks for t in c.token_ids],
            stats=stats.as_dict(),
            logprobs=tuple(x for c in chunks for x in c.logprobs),
        )

    def generate_batch(
        self,
        prompts: Iterable[Prompt],
        options: GenerationOptions | Sequence[GenerationOptions] | None = None,
        *,
        slots: int = 8,
        seeds: Sequence[int] | None = None,
        **fields: Unpack[OptionFields],
    ) -> list[GenerationResult]:
        """Every prompt generated in a continuous batch of up to ``slots`` sequences (each request joining as
        a slot frees; options as for :meth:`stream`, or one per prompt: each its own sampling, constraint,
        chat, length...), results in the prompts' order. A prompt that cannot be
        generated (empty, too long for the context, not valid Unicode) gets a result with ``error`` set, as
        does one whose generation fails on its own (an internal error: its type and message); the others are
        untouched. Each result equals what :meth:`generate` gives for that prompt alone (greedy: token for
        token; sampled: the same tokens for the same seed at a fixed K, or at any K with
        ``SamplingParams.invariant``). ``seeds``: one sampling seed per prompt (instead of the sampling
        parameters' one for all)."""
        check_int(slots, "slots", 1)
        if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Iterable):
            raise UsageError(
                f"prompts is a list of prompts, not {type(prompts).__name__} (one prompt: generate)"
            )
        prompts = list(prompts)  # a generator's too
        if seeds is not None and len(seeds) != len(prompts):
            raise UsageError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        if isinstance(options, Sequence) and len(options) != len(prompts):
            raise UsageError(f"{len(options)} options for {len(prompts)} prompts")
        each = options if isinstance(options, Sequence) else [options] * len(prompts)
        chosen = [GenerationOptions.of(own, **fields) for own in each]
        results: list[GenerationResult | None] = [None] * len(prompts)
        collected: dict[int, tuple[Collected, GenerationStats]] = {}
        driver = Driver(self.model, slots=min(slots, max(1, len(prompts))))
        waiting = deque(enumerate(prompts))
        while waiting or driver.live:
            while waiting and driver.free_slots:
                index, prompt = waiting.popleft()
                own = chosen[index]
                if seeds is not None:
                    own = dataclasses.replace(own, sampling=own.sampling.with_seed(seeds[index]))
                try:
                    request, text = self.request(prompt, own)
                except Exception as err:  # this request only
                    results[index] = GenerationResult("", [], {}, error=failure_message(err))
                    continue
                collected[index] = (sink := Collected(), request.stats)
                driver.admit(request, text, sink)
            driver.step()
        for index, (sink, stats) in collected.items():
            results[index] = GenerationResult.collected(sink, stats)
        return [r for r in results if r is not None]


@_own_keywords
def generate(
    prompt: str,
    *,
    target: str | None = None,
    draft: str | None = None,
    drafter: str = "auto",
    tokenizer: str | None = None,
    k: DraftLength | int | str = DEFAULT_K,
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
    json_schema: Mapping[str, Any] | str | None = None,
    regex: str | None = None,
    grammar: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
) -> GenerationResult:
    """Generate text for ``prompt`` with speculative decoding; the same arguments and defaults as ``verispec
    generate`` (greedy unless ``temperature`` > 0: :data:`~verispec.options.DEFAULT_SAMPLING`; a keyword of
    transformers' ``generate`` such as ``max_length`` is a one-line UsageError naming verispec's own;
    ``invariant``: None, invariant draws exactly when a ``seed`` is given, see
    :class:`~verispec.options.SamplingParams`; ``tree``: a :class:`~verispec.drafting.tree.TreeShape`, "WxD"
    or a JSON shape file, either with ":N" or ":auto" for a dynamic tree, or "auto": the learned drafter's
    default tree, see :class:`Speculator`; ``json_schema`` (a dict or its JSON text), ``regex`` or ``grammar``
    (Lark or GBNF): at most one, the output's structure, see :class:`~verispec.grammar.Constraint`;
    ``tools``, ``tool_choice``, ``parallel_tool_calls``: OpenAI's, with ``chat``, the calls read from the
    text by :func:`~verispec.grammar.tools.read_calls`, see :class:`~verispec.grammar.tools.Tools`)."""
    sampling = SamplingParams(
        temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, invariant=invariant
    )
    constraint = Constraint.of(json_schema, regex, grammar)
    options = GenerationOptions(
        k=DraftLength.parse(k),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        chat=chat,
        stop=stop,
        constraint=constraint,
        tools=Tools.of(tools, tool_choice, parallel_tool_calls),
    )
    shape = TreeShape.parse(tree) if isinstance(tree, str) and tree != AUTO else tree
    speculator = Speculator(
        target, draft, drafter, tokenizer, tree=shape, drafter_path=drafter_path, precision=precision
    )
    return speculator.generate(prompt, options)
