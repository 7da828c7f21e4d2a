"""A layer's projections of one input, forward and backward as a tp rank runs them under in_matmul weight grads
(bf16): separate matmuls (dW added into each buffer, x's gradient a fused sum of the partials) against one
matmul of the weights stacked (cat per microbatch), grads cat'd and copied back, or grads one buffer already."""
import torch

torch.manual_seed(0)
dev, dt, T, H = "cuda", torch.bfloat16, 4096, 5120
fused_sum = torch.compile(lambda *t: sum(t), dynamic=False)


def timed(fn, n=30):
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
    groups = {"gdn z|qkv|b|a": [6144, 10240, 48, 48], "attn q|k|v": [12288, 1024, 1024], "mlp gate|up": [17408, 17408]}
    for name, outs in groups.items():
        outs = [max(o // tp, 1) for o in outs]
        x = torch.randn(T, H, device=dev, dtype=dt)
        dys = [torch.randn(T, o, device=dev, dtype=dt) for o in outs]
        ws = [torch.randn(o, H, device=dev, dtype=dt) * 0.02 for o in outs]
        gs = [torch.zeros(o, H, device=dev, dtype=dt) for o in outs]
        G = torch.zeros(sum(outs), H, device=dev, dtype=dt)
        gviews = list(G.split(outs))

        def separate():
            ys = [x @ w.t() for w in ws]
            for g, dy in zip(gs, dys):
                g.addmm_(dy.t(), x)
            return ys, fused_sum(*[dy @ w for dy, w in zip(dys, ws)])

        def stacked(contiguous):
            W = torch.cat(ws)
            y = (x @ W.t()).split(outs, dim=-1)
            dY = torch.cat(dys, dim=-1)
            if contiguous:
                G.addmm_(dY.t(), x)
            else:
                whole = torch.cat(gs)
                whole.addmm_(dY.t(), x)
                for g, part in zip(gs, whole.split(outs)):
                    g.copy_(part)
            return y, dY @ W

        def fwd_sep():
            return [x @ w.t() for w in ws]

        def fwd_st():
            return x @ torch.cat(ws).t()

        s, c, k = timed(separate), timed(lambda: stacked(False)), timed(lambda: stacked(True))
        fs, ft = timed(fwd_sep), timed(fwd_st)
        print(f"tp{tp} {name:14s} {outs}: separate {s:7.1f} us, stacked+grad cat {c:7.1f} ({s - c:+6.1f}), "
              f"stacked contiguous grads {k:7.1f} ({s - k:+6.1f}); forward alone {fs:6.1f} vs {ft:6.1f}", flush=True)
