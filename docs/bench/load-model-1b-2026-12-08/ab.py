"""A/B in one process: a draft model's rows drafting together (ModelDrafter.propose_rows, 8db82ba) against
each row drafting alone (rows_key patched to None: the drafter before it), under bench-load at 1 B cost.
The turns interleaved; the second A/B ran with concurrency (4, 8), 8 requests, max_new_tokens=192."""
import json
import time
from verispec.bench.load import LoadConfig, run_load
from verispec.drafting.draft_model import ModelDrafter
original = ModelDrafter.rows_key
out = {}
for turn in range(2):
    for mode in (("rows", "alone") if turn == 0 else ("alone", "rows")):
        ModelDrafter.rows_key = original if mode == "rows" else property(lambda self: None)
        cfg = LoadConfig(target="/work/scratch/files/smollm2-1b.gguf", draft="smollm2-135m", methods=("none", "model"),
                         concurrency=(1, 4, 8), requests=16, max_new_tokens=64, threads=2, out="")
        t = time.time(); res = run_load(cfg, progress=False)
        for c in res["cells"]:
            out.setdefault((mode, c["method"], c["concurrency"]), []).append(round(c["tokens_per_second"], 2))
            if c["method"] == "model": print(mode, c["concurrency"], "tau", round(c["tokens_per_target_call"] or 0, 2), "drafts/round", round(c["drafted_per_round"] or 0, 2), flush=True)
        print(mode, "turn", turn, round(time.time() - t), "s", {k: v for k, v in out.items() if k[0] == mode}, flush=True)
json.dump({"|".join(map(str, k)): v for k, v in out.items()}, open("/work/scratch/s10/rows_ab.json", "w"), indent=1)
