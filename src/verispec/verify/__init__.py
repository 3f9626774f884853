"""Verifiers: pure functions from (draft tokens, p, q) to a verdict — which draft tokens are *accepted*, and
the *recovered* or *bonus* token that follows — for a chain of draft tokens (``chain``) or a token tree
(``tree``). Each is a closed-form rule plus one sampler; nothing here holds state or touches a model."""
