"""verispec: exact speculative decoding for language models.

p is always the target's distribution and q the draft's. See :mod:`verispec.verify` for the vocabulary of
accepted, recovered and bonus tokens, and :mod:`verispec.tree_verify` for verifying a token tree.
"""

from verispec.sampling import SamplingParams, probs_from_logits
from verispec.tree_verify import (
    SiblingRule,
    TreeRule,
    TreeVerdict,
    greedy_sibling_rule,
    sample_tree_verdict,
    sibling_rule,
    tree_greedy_verify,
    tree_rejection_sample,
)
from verispec.verify import (
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

__all__ = [
    "Rule",
    "SamplingParams",
    "SiblingRule",
    "TreeRule",
    "TreeVerdict",
    "Verdict",
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
