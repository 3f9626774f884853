"""Learned drafters: their training data and training, the shared file format, and the kinds (EAGLE heads,
Medusa heads, a trained early exit, lookahead tokens) with their drafters."""
