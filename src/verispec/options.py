"""What a generation asks for, parsed once where it comes in (library keywords, the command line, a batch
line, a server request) into frozen objects: :class:`SamplingParams` (how the target samples),
:class:`GenerationOptions` (K, the length, the stop strings, chat, log-probabilities, the sampling, and the
output's structure: a :class:`~verispec.grammar.Constraint`): per request (which models and drafter is
:class:`~verispec.choice.ModelChoice`'s).

Light to import (no torch): the command line checks every argument with these before it loads anything, so a
mistake is reported in a fraction of a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from verispec.errors import UsageError
from verispec.grammar.constraint import Constraint  # light: llguidance loads when one is checked
from verispec.grammar.tools import Tools
from verispec.inputs import check_int, check_seed, check_text, did_you_mean, is_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_K",
    "DEFAULT_SAMPLING",
    "K_NAMES",
    "MAX_K",
    "DraftLength",
    "MAX_LOGPROBS",
    "MAX_TEMPERATURE",
    "GenerationOptions",
    "Decoding",
    "OptionFields",
    "SamplingParams",
]

MAX_TEMPERATURE = 3.4028234663852886e38  # float32's largest value
"""The largest temperature: logits are divided by it in float32, where a larger one is infinite (and a
masked token's −inf / inf is NaN)."""
MAX_LOGPROBS = 20  # the most likely alternatives a request may ask for per token, as OpenAI allows
K_NAMES = ("additive", "auto")  # the K policies named rather than numbered (verispec.costs.policies)


@dataclass(frozen=True)
class SamplingParams:
    """How the target samples; validated on construction (UsageError with a one-line message).

    temperature: in [0, :data:`MAX_TEMPERATURE`]; 0 means greedy decoding.
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: in (0, 1]; keep the smallest set of most likely tokens whose mass reaches top_p (at least the most
        likely token, however small top_p is); 1 keeps all.
    min_p: in [0, 1); drop tokens whose probability is below min_p × the largest probability; 0 keeps all.
    seed: seed of the generator that drives all sampling; None draws a fresh seed.
    invariant: draw the token at each sequence position from the seed and that position alone
        (:func:`verispec.sampling.position_draws`), not from the generator's stream: the sampled tokens are
        then the target's own sampling with that seed, token for token, whatever the drafter, K (``auto``
        included), token tree or batch. A drafter's sampled proposal is drawn with the same noise (coupled),
        and accepted a little less often than by rejection sampling; a single guess (prompt lookup, a greedy
        draft) is accepted with probability p(x) either way. None (the default) means: invariant exactly
        when a seed is given, so that a seed always names the same tokens; ``invariant=False`` with a seed
        opts out (rejection sampling's stream of draws: a little more acceptance, tokens that depend on the
        drafter and K).

    The distribution these parameters define is :func:`verispec.sampling.probs_from_logits`'s.
    """

    temperature: float = 1.0
    _: KW_ONLY  # the rest by name: a positional (1.0, 40, 0.9) reads as nothing
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    invariant: bool | None = None  # resolved on construction: a bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "_follows_seed", self.invariant is None)  # not a field: follows_seed
        if self.invariant is None:
            object.__setattr__(self, "invariant", self.seed is not None)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_TEMPERATURE:
            raise UsageError(f"temperature must be a number in [0, {MAX_TEMPERATURE:.4g}], got {t!r}")
        check_int(self.top_k, "top_k", 0, hint=" (0 disables it)")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise UsageError(f"top_p must be in (0, 1], got {p!r}")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0 <= m < 1):
            raise UsageError(f"min_p must be in [0, 1), got {m!r}")
        if self.seed is not None:
            check_seed(self.seed)
        if not isinstance(self.invariant, bool):
            raise UsageError(f"invariant must be true or false, got {self.invariant!r}")

    @classmethod
    def of(cls, source: Any) -> SamplingParams:
        """The parameters that ``source`` holds as attributes of the same names (a command's flags, a server
        request's body); validated as on construction."""
        return cls(
            source.temperature,
            top_k=source.top_k,
            top_p=source.top_p,
            min_p=source.min_p,
            seed=source.seed,
            invariant=source.invariant,
        )

    def with_seed(self, seed: int | None) -> SamplingParams:
        """These parameters with ``seed``; invariant draws as chosen on construction, or (when not chosen)
        following the new seed, as for ``SamplingParams(..., seed=seed)``. ``dataclasses.replace`` instead
        keeps the resolved choice."""
        return dataclasses.replace(self, seed=seed, invariant=None if self.follows_seed else self.invariant)

    @property
    def follows_seed(self) -> bool:
        """Whether ``invariant`` was left to follow the seed (None on construction), not chosen."""
        return bool(vars(self)["_follows_seed"])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator seeded with ``seed`` (a fresh random seed when it is None)."""
        import torch

        g = torch.Generator(device=device)
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


DEFAULT_SAMPLING = SamplingParams(temperature=0)
"""What the library generates with unless given ``sampling`` (or ``temperature``), as the command line does:
greedy, the target's own greedy output token for token and the same on every run (transformers' ``generate``
is greedy by default too). The server keeps OpenAI's default temperature of 1."""


# A fixed K's most: more than a round scores is never drafted (engine.ROUND_TOKENS, whose module loads torch;
# tested equal)
MAX_K = 64


@dataclass(frozen=True)
class DraftLength:
    """K, a chain round's draft length, parsed once at the door (:meth:`parse`: a command line's flag, a
    request's field, a library keyword) and passed down typed: ``fixed`` tokens every round (an integer in
    [0, :data:`MAX_K`]; 0 drafts nothing), or the policy ``named`` (one of :data:`K_NAMES`): "additive" (+2 /
    −1 rule) or "auto" (the K that the calibrated cost model and the running acceptance estimate favour, 0
    included); exactly one of the two. ``str()`` spells it as it is given and as stats and reports show it:
    "4", "auto"."""

    fixed: int | None = None
    named: str | None = None

    def __post_init__(self) -> None:
        if (self.fixed is None) == (self.named is None):
            raise UsageError("a K is fixed or named: give one of fixed= and named=")
        if self.named is not None and self.named not in K_NAMES:
            raise UsageError(f"a K's name is one of {', '.join(K_NAMES)}, got {self.named[:20]!r}")
        if self.fixed is not None:
            check_int(self.fixed, "k", 0)
            if self.fixed > MAX_K:  # never echoed: a request's may have thousands of digits
                raise UsageError(f"k must be at most {MAX_K} (a round scores at most {MAX_K} tokens)")

    @property
    def auto(self) -> bool:
        """Whether K is "auto"'s (the cost model's choice)."""
        return self.named == "auto"

    @classmethod
    def parse(cls, k: DraftLength | int | str | None) -> DraftLength:
        """``k`` as given (an int, or text from a command line or a request; one already parsed as it is;
        None: :data:`DEFAULT_K`), validated (UsageError)."""
        if isinstance(k, DraftLength):
            return k
        if k is None:
            return DEFAULT_K
        if isinstance(k, str):
            if k in K_NAMES:
                return cls(named=k)
            if not (k.isascii() and k.isdigit()) or len(k) > 9:  # "²" is a digit to isdigit, not to int
                raise UsageError(f"k must be an integer >= 0, 'additive' or 'auto', got {k[:20]!r}")
            k = int(k)
        return cls(fixed=k)

    def __str__(self) -> str:
        return str(self.fixed) if self.named is None else self.named


DEFAULT_K = DraftLength(named="auto")


@dataclass(frozen=True)
class Decoding:
    """What a generation asks of the engine's decoding, the fields that :class:`GenerationOptions` (what a
    caller asks for) and the engine's own config (:class:`~verispec.engine.sequence.EngineConfig`, the tokens
    that end a sequence beside them) share, checked once on construction (UsageError).

    max_new_tokens: at most this many tokens after the prompt (≥ 1). sampling: :data:`DEFAULT_SAMPLING`
    (greedy) unless given. stop: strings that end the generation (non-empty, valid text; not included in the
    text). logprobs: each token's log-probability under the target's own distribution and that many
    likeliest alternatives (None, or 0 to :data:`MAX_LOGPROBS`).
    """

    max_new_tokens: int = 128
    sampling: SamplingParams = field(default=DEFAULT_SAMPLING)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise UsageError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if isinstance(self.stop, str) or not isinstance(self.stop, (tuple, list)):
            raise UsageError(f"stop must be a sequence of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        check_int(self.max_new_tokens, "max_new_tokens", 1)
        n = self.logprobs
        if n is not None and (not is_int(n) or not 0 <= n <= MAX_LOGPROBS):
            raise UsageError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise UsageError("stop strings must be non-empty strings")
            check_text(s, "a stop string")


@dataclass(frozen=True, kw_only=True)
class GenerationOptions(Decoding):
    """How one generation runs, checked once on construction (UsageError): :class:`Decoding`'s fields
    (``max_new_tokens``, ``sampling``, ``stop``, ``logprobs``) and these.

    k: the draft length, a :class:`DraftLength` (a fixed K, "additive" or "auto"; an int or its text is
    parsed into one; not used by token trees). chat: the prompt in the model's chat template (it may then be
    a list of messages). constraint: the output's structure (:class:`~verispec.grammar.Constraint`: a JSON
    schema, any JSON object, a regex or a grammar), checked when the Constraint is built; the output is then
    distributed exactly as the target's constrained sampling without speculation (:mod:`verispec.grammar`).
    tools: the functions a chat may call (:class:`~verispec.grammar.tools.Tools`), rendered in its template,
    the calls held to their grammar (:attr:`structure`; not beside a ``constraint``).
    """

    k: DraftLength = DEFAULT_K
    chat: bool = False
    constraint: Constraint | None = None
    tools: Tools | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", DraftLength.parse(self.k))  # a library's k=4 or k="auto" too
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise UsageError(f"constraint must be a Constraint, got {type(self.constraint).__name__}")
        if self.tools is not None and not isinstance(self.tools, Tools):
            raise UsageError(
                f"tools must be a Tools (Tools.of: OpenAI's definitions), got {type(self.tools).__name__}"
            )
        if self.tools is not None and not self.chat:
            raise UsageError("tools are rendered in the chat template: give chat=True too")
        if self.tools is not None and self.tools.constraint is not None and self.constraint is not None:
            raise UsageError("tool calls have their own grammar: give tools or a constraint, not both")
        if not isinstance(self.chat, bool):
            raise UsageError(f"chat must be true or false, got {self.chat!r}")
        super().__post_init__()

    @property
    def structure(self) -> Constraint | None:
        """The constraint the output is held to: ``constraint``, or the tools' calls' grammar."""
        return (self.tools.constraint if self.tools is not None else None) or self.constraint

    @classmethod
    def of(cls, options: GenerationOptions | None = None, **fields: object) -> GenerationOptions:
        """``options`` (default: the defaults) with ``fields`` replaced: the one door from keywords to the
        object. A field of :class:`SamplingParams` (``temperature=0.5``, ``seed=1``, ...) replaces that of
        the options' sampling, as ``verispec.generate`` takes them (not beside ``sampling=``); a keyword that
        is neither is a UsageError naming verispec's own (see :func:`check_keywords`)."""
        check_keywords(fields, OPTION_NAMES + SAMPLING_NAMES)
        base = options if options is not None else cls()
        own = {name: fields.pop(name) for name in SAMPLING_NAMES if name in fields}
        if own and "sampling" in fields:
            raise UsageError(f"give sampling= or its fields ({', '.join(own)}=), not both")
        if own:
            s = base.sampling
            kept = {f: getattr(s, f) for f in SAMPLING_NAMES} | {
                "invariant": None if s.follows_seed else s.invariant
            }
            fields["sampling"] = SamplingParams(**(kept | own))
        return dataclasses.replace(base, **fields) if fields else base  # type: ignore[arg-type]


class OptionFields(TypedDict, total=False):
    """:class:`GenerationOptions`' fields as keywords (``Speculator.generate(prompt, k=4)``), and its
    sampling's (``temperature=0.5``)."""

    k: DraftLength | int | str
    max_new_tokens: int
    sampling: SamplingParams
    chat: bool
    stop: tuple[str, ...]
    logprobs: int | None
    constraint: Constraint | None
    tools: Tools | None
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    invariant: bool | None


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(GenerationOptions))
SAMPLING_NAMES = tuple(f.name for f in dataclasses.fields(SamplingParams))

FOREIGN_KEYWORDS = {  # transformers' (and OpenAI's) generation keywords → what verispec takes instead
    "max_length": "max_new_tokens (tokens after the prompt)",
    "max_tokens": "max_new_tokens",
    "do_sample": "temperature (0: greedy) or sampling=SamplingParams(...)",
    "generation_config": "sampling=SamplingParams(...)",
    "stop_strings": "stop",
    "random_seed": "seed",
}


def check_keywords(given: Iterable[str], allowed: tuple[str, ...]) -> None:
    """One-line UsageError for the first of ``given`` (keyword names) that is not one of ``allowed``, naming
    verispec's own keyword for a transformers one (``max_length`` → ``max_new_tokens``), else the keywords
    taken."""
    for name in given:
        if name in allowed:
            continue
        if name in FOREIGN_KEYWORDS:
            raise UsageError(f"{name} is not a verispec argument; use {FOREIGN_KEYWORDS[name]}")
        close = did_you_mean(name, allowed)
        raise UsageError(f"{name} is not a verispec argument{close}; use one of {', '.join(allowed)}")
