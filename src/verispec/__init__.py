"""verispec: exact speculative decoding for language models.

    >>> import verispec
    >>> result = verispec.generate("Once upon a time", drafter="ngram", max_new_tokens=32, temperature=0)

The public names, all importable from here: :func:`generate` and :class:`Speculator` (load a target and a
drafter, then generate, streamed or whole), :class:`GenerationOptions`, :class:`SamplingParams` and
:class:`Constraint` (what a generation asks for; a Constraint: structured output, a JSON schema, a regex or a
grammar), :func:`probs_from_logits` (the one transform that defines the sampled distribution), the pure
verifiers of :mod:`verispec.verify` and :class:`UsageError`, the exception for a caller's mistake.

p is always the target's distribution and q the draft's, passed by keyword. See :mod:`verispec.verify.chain`
for the vocabulary of accepted, recovered and bonus tokens, and :mod:`verispec.verify.tree` for verifying a
token tree. Every name but UsageError is imported on first use (torch, and transformers for the generation
API, load only when needed).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from verispec.errors import UsageError

if TYPE_CHECKING:
    from verispec.api import GenerationResult, Speculator, generate
    from verispec.drafting.tree import TreeShape
    from verispec.grammar.constraint import Constraint
    from verispec.options import GenerationOptions, SamplingParams
    from verispec.sampling import probs_from_logits
    from verispec.text import Chunk
    from verispec.verify.chain import (
        Rule,
        Verdict,
        greedy_rule,
        greedy_verify,
        rejection_rule,
        rejection_sample,
        sample_verdict,
        single_guess_rule,
        single_guess_sample,
    )
    from verispec.verify.tree import (
        SiblingRule,
        TreeRule,
        TreeVerdict,
        greedy_sibling_rule,
        sample_tree_verdict,
        sibling_rule,
        tree_greedy_verify,
        tree_rejection_sample,
    )

_MODULES = {  # module → its public names here, imported on first access: `import verispec` loads no torch
    "verispec.api": ("GenerationResult", "Speculator", "generate"),
    "verispec.drafting.tree": ("TreeShape",),
    "verispec.grammar.constraint": ("Constraint",),
    "verispec.options": ("GenerationOptions", "SamplingParams"),
    "verispec.sampling": ("probs_from_logits",),
    "verispec.text": ("Chunk",),
    "verispec.verify.chain": (
        "Rule", "Verdict", "greedy_rule", "greedy_verify", "rejection_rule", "rejection_sample",
        "sample_verdict", "single_guess_rule", "single_guess_sample",
    ),
    "verispec.verify.tree": (
        "SiblingRule", "TreeRule", "TreeVerdict", "greedy_sibling_rule", "sample_tree_verdict",
        "sibling_rule", "tree_greedy_verify", "tree_rejection_sample",
    ),
}  # fmt: skip
_LAZY = {name: module for module, names in _MODULES.items() for name in names}


def __getattr__(name: str) -> Any:
    """The public names but UsageError, imported on first use (PEP 562): the command line's --help and usage
    errors need no torch."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verispec' has no attribute {name!r}")


__all__ = [
    "Chunk",
    "Constraint",
    "GenerationOptions",
    "GenerationResult",
    "Rule",
    "SamplingParams",
    "SiblingRule",
    "Speculator",
    "TreeRule",
    "TreeShape",
    "TreeVerdict",
    "UsageError",
    "Verdict",
    "generate",
    "greedy_rule",
    "greedy_sibling_rule",
    "greedy_verify",
    "probs_from_logits",
    "rejection_rule",
    "rejection_sample",
    "sample_tree_verdict",
    "sample_verdict",
    "sibling_rule",
    "single_guess_rule",
    "single_guess_sample",
    "tree_greedy_verify",
    "tree_rejection_sample",
]
__version__ = "0.1.0"
