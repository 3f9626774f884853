"""Costs, one room: what speculation costs on this machine and what K it therefore drafts.

``calibrate`` measures a target's and a drafter's costs (probed in seconds, cached per model and per
drafter's own ``cost_identity``); ``online`` corrects them from the engine's own timings as it runs;
``policies`` turn costs and observed acceptance into each round's K (``--k auto``) and a batch's plan;
``analytic`` is the model they share (expected tokens per target call, speedup from a cost curve, optimal K
and tree sizes), ``simulate`` its Monte-Carlo check on toy pairs, and ``recovery`` how ``--k auto`` recovers
from a wrong calibration against made-up costs."""
