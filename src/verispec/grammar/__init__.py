"""Structured output, exact under speculation: a JSON schema, a regex or a grammar constrains what a sequence
may say, and speculation leaves the constrained distribution unchanged.

The definition. At each position the *constrained target* is the target's logits with every token the grammar
does not allow after the prefix set to −inf, then the one sampling transform
(:func:`verispec.sampling.probs_from_logits`: temperature → top-k → top-p → min-p), for the target and the
draft alike: p masked to the allowed tokens and renormalised, the mask applied BEFORE the transform (top-p's
nucleus and min-p's floor are taken among the allowed tokens). Greedy decoding is the argmax of the masked
logits. Speculative decoding then verifies the draft against that p: at draft position i the mask is the
grammar's after the committed prefix and drafts 1..i−1; the residual max(p − q, 0) and the bonus token come
from the constrained p; after verification the grammar's state is rolled back to the accepted prefix and
advanced over the recovered or bonus token (end-of-sequence included). A drafter never advances the
committed state.

The draft's q may stay unmasked and the output is still exact: rejection sampling is exact for any q the
draft was drawn from, and the constrained p is 0 off the grammar, so a draft token the grammar forbids is
rejected with probability 1 (accept min(1, p/q) = 0; a single guess or a greedy draft likewise) and the
residual max(p − q, 0) is 0 there too: every emitted token is allowed. A q masked with the grammar advanced
over the drafts before it only raises acceptance; one masked with another state is exact only if the draft
was drawn from it (the enumeration suite shows that variant caught).

Forced tokens are free drafts: where the grammar allows exactly one token, the masked logits hold one finite
entry, so the constrained p is a point mass there whatever the sampling settings, and a draft of that token
is accepted with probability 1 by every verifier (rejection: min(1, 1/q) = 1; a single guess: p(x) = 1;
greedy: the argmax; invariant draws: the only token of positive weight). The engine proposes that run of
forced tokens first (point masses in q), then the drafter's guesses after it; where the only token allowed
is an end-of-sequence token it is committed without a forward.

Modules: :mod:`~verispec.grammar.constraint` (the frozen spec a request carries, validated),
:mod:`~verispec.grammar.rounds` (the state protocol and the pure steps of a constrained round),
:mod:`~verispec.grammar.matcher` (that state over llguidance's matcher), :mod:`~verispec.grammar.tokens`
(llguidance's tokenizer from a tokenizer's spelled tokens), :mod:`~verispec.grammar.tools` (tool calls: the
grammar of OpenAI's ``tool_choice``, the chat template's rendering, the calls read back).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verispec.grammar.constraint import KINDS, Constraint

if TYPE_CHECKING:
    from verispec.grammar.rounds import GrammarState

__all__ = ["KINDS", "Constraint", "GrammarState"]


def __getattr__(name: str) -> Any:
    """``GrammarState`` imported on first use: a :class:`Constraint` is checked without torch."""
    if name == "GrammarState":
        from verispec.grammar.rounds import GrammarState

        return GrammarState
    raise AttributeError(f"module 'verispec.grammar' has no attribute {name!r}")
