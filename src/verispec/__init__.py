"""verispec: exact speculative decoding for language models.

p is always the target's distribution and q the draft's. See :mod:`verispec.verify` for the vocabulary of
accepted, recovered and bonus tokens.
"""

from verispec.sampling import SamplingParams, probs_from_logits
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
    "Verdict",
    "greedy_rule",
    "greedy_verify",
    "probs_from_logits",
    "rejection_rule",
    "rejection_sample",
    "sample_verdict",
    "single_guess_rule",
    "single_guess_sample",
]
__version__ = "0.1.0"
