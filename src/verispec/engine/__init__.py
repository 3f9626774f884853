"""The engine: propose → score → verify → commit/rollback over a continuous batch.

``engine`` holds :class:`~verispec.engine.engine.SpeculativeEngine` (a step of every running sequence's
round on one preallocated cache), ``rounds`` a step's rounds one per sequence (chain, tree, prompt chunk:
what each drafts and how it is verified), ``sequence`` what a caller submits and what runs (``Request``,
``Running``, their stats), ``driver`` the one loop every caller runs it with, ``scheduler`` that loop in its
own thread for many callers (the server)."""
