# A/B of the fused AdamW kernel: the committed one (old) against the working tree's, bf16 weights/grads/moments,
# stochastic rounding, ~1e9 parameters in the 27B's shapes; alternating, CUDA events.
import sys, importlib.util, torch
sys.path.insert(0, "scratch")
import adamw_old
from qwenft.train import adamw_kernel as new
shapes = [(5120, 17408), (17408, 5120), (5120, 5120)] * 3
gen = torch.Generator(device="cuda").manual_seed(0)
ts = [[torch.randn(s, device="cuda", generator=gen).mul_(0.02).bfloat16() for _ in range(4)] for s in shapes]
n = sum(t[0].numel() for t in ts)
def run(mod):
    for p, g, m, v in ts:
        mod.adamw_update_(p, g, m, v, lr=1e-5, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step_size=-1e-5,
                          bias_correction2_sqrt=0.5, seed=3, stochastic_rounding=True)
res = {"old": [], "new": []}
for mod in (adamw_old, new):
    run(mod); run(mod)
for _ in range(5):
    for name, mod in (("old", adamw_old), ("new", new)):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); run(mod); run(mod); b.record(); torch.cuda.synchronize()
        res[name].append(a.elapsed_time(b) / 2 * 1e9 / n)
for k, v in res.items():
    v.sort(); print(f"ADAMW {k}: median {v[2]:.3f} ms per 1e9 params (min {v[0]:.3f}); floor at 14 B/param, 4.8 TB/s: 2.92")
