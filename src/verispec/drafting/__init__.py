"""Drafting: everything that proposes tokens for the target to verify — the protocols (``base``), token-tree
shapes (``tree``), the drafters by kind (``ngram``, ``draft_model``, the learned ``eagle`` heads) and the one
registry that names them (``registry``)."""
