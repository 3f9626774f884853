"""Learned drafters: the shared file format, and the kinds (EAGLE heads, Medusa heads, a trained early exit,
lookahead tokens) with their drafters; they are trained by :mod:`verispec.training`."""
