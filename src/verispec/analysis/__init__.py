"""Analysis: the analytic model of speculative decoding (``analytic``: expected tokens per target call,
speedup from calibrated costs, optimal K and tree sizes) and its Monte-Carlo check (``simulate``)."""
