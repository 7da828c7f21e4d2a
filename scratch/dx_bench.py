"""x's gradient of a layer's projections of one input: separate matmuls then a fused n-way add (what a compiled
tp rank runs) against one matmul and addmm_ (beta = 1) chained. 27B shapes, tokens 4096, bf16."""
import torch

torch.manual_seed(0)
dev, dt, T, H = "cuda", torch.bfloat16, 4096, 5120
fused_sum = torch.compile(lambda *t: sum(t), dynamic=False)


def timed(fn, n=40):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n * 1000  # us


for tp in (1, 2, 4):
    groups = {"gdn": [2048, 2048, 6144, 6144, 96], "mlp": [17408, 17408], "attn": [12288, 1024, 1024]}
    for name, outs in groups.items():
        outs = [max(o // tp, 1) for o in outs]
        dys = [torch.randn(T, o, device=dev, dtype=dt) for o in outs]
        ws = [torch.randn(o, H, device=dev, dtype=dt) * 0.02 for o in outs]

        def separate():
            return fused_sum(*[dy @ w for dy, w in zip(dys, ws)])

        def chained():
            dx = dys[0] @ ws[0]
            for dy, w in zip(dys[1:], ws[1:]):
                dx.addmm_(dy, w)
            return dx

        def mms_only():
            return [dy @ w for dy, w in zip(dys, ws)]

        err = ((separate().float() - chained().float()).norm() / separate().float().norm()).item()
        s, c, m = timed(separate), timed(chained), timed(mms_only)
        print(f"tp{tp} {name:5s} outs {outs}: separate+add {s:7.1f} us, chained addmm {c:7.1f} us, "
              f"matmuls alone {m:7.1f} us, saved {s - c:6.1f} us ({(s - c) / s:+.1%}), rel diff {err:.1e}", flush=True)
