"""Analysis: the analytic model of speculative decoding (``analytic``: expected tokens per target call,
speedup from calibrated costs, optimal K and tree sizes), its Monte-Carlo check (``simulate``), and how
``--k auto`` recovers from a wrong calibration against made-up costs (``recovery``)."""
