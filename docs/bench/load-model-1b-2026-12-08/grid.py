"""The probe's predicted batch cost V(b rows, m tokens each) against forwards of b rows timed after 200 positions (1 B cost)."""
import statistics, time, torch
from verispec.api import Speculator
from verispec.models.base import RowInput
spec = Speculator("/work/scratch/files/smollm2-1b.gguf", drafter="model", draft="smollm2-135m")
cal = spec.calibration()
print("probe:", cal.target.probe if hasattr(cal, "target") else "?")
batch = cal.batch_cost_at(200)
model = spec.model
rows = model.new_cache_rows(8)
ctx = list(range(100, 300))
for r in rows:
    model.forward_rows([RowInput(r, torch.tensor(ctx), torch.arange(200), None, logits=False, hidden=False)])
def t(b, m):
    ins = [RowInput(rows[i], torch.tensor(ctx[:m]), torch.arange(200, 200 + m), None, logits=True, hidden=False) for i in range(b)]
    t0 = time.perf_counter(); model.forward_rows(ins); dt = time.perf_counter() - t0
    for i in range(b): rows[i].truncate(200)
    return dt
t(1, 1)
one = statistics.median([t(1, 1) for _ in range(15)])
for b, m in [(1, 4), (1, 8), (1, 16), (4, 1), (4, 4), (4, 8), (8, 1), (8, 4), (8, 8), (8, 13)]:
    ratio = statistics.median([t(b, m) / t(1, 1) for _ in range(5)])
    print(f"b={b} m={m}: timed {ratio:.2f}  predicted {batch.forward(b, b * m):.2f}")
