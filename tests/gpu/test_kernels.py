"""qwenft's own Triton kernels against their torch references, on CUDA (skipped without a GPU)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_ce_kernel_equals_torch_ops():
    from qwenft.models.ce_kernel import ce_grad_
    from qwenft.models.linear_ce import IGNORE_INDEX, _ce_grad_torch_

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(300, 50_000, device="cuda", generator=gen) * 4).bfloat16()
    labels = torch.randint(0, 50_000, (300,), device="cuda", generator=gen)
    labels[::5] = IGNORE_INDEX
    ours, ref = logits.clone(), logits.clone()
    loss, ref_loss = ce_grad_(ours, labels, IGNORE_INDEX), _ce_grad_torch_(ref, labels)
    assert _rel(loss, ref_loss) < 1e-6
    assert _rel(ours.float(), ref.float()) < 1e-3  # both fp32 math rounded once to bf16; exp differs in the last bits
    assert not ours[::5].any()  # unlabelled tokens: no gradient
    labels[1::5] = logits[1::5].float().argmax(-1)  # top-1 hits to count (the MTP head's accuracy)
    _, hits_n = ce_grad_(logits.clone(), labels, IGNORE_INDEX, with_hits=True)
    want = ((logits.float().argmax(-1) == labels) & (labels != IGNORE_INDEX)).int()
    assert torch.equal(hits_n, want) and want.sum() >= 60


def test_vocab_parallel_ce_kernels_equal_torch_ops():
    """The vocab-parallel pair on each half of a vocabulary, as two tp ranks hold it: statistics and gradient as
    the torch ops compute them, and the halves' statistics combined give the whole-vocabulary kernel's CE and,
    side by side, its gradient."""
    from qwenft.constants import IGNORE_INDEX
    from qwenft.models.ce_kernel import ce_grad_, shard_ce_grad_, shard_stats
    from qwenft.models.linear_ce import _shard_ce_grad_torch_, _shard_stats_torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(300, 50_000, device="cuda", generator=gen) * 4).bfloat16()
    labels = torch.randint(0, 50_000, (300,), device="cuda", generator=gen)
    labels[::5] = IGNORE_INDEX
    labels[1], labels[2], labels[3] = 25_000, 49_999, 24_999  # both edges of the second half, the first's last
    starts = (0, 25_000)
    halves = [logits[:, :25_000].contiguous(), logits[:, 25_000:].contiguous()]
    stats = [shard_stats(x, labels, start, IGNORE_INDEX) for x, start in zip(halves, starts)]
    for x, start, ours in zip(halves, starts, stats):
        assert _rel(ours, _shard_stats_torch(x, labels, start)) < 1e-6
    row_max = torch.maximum(stats[0][0], stats[1][0])
    lse = (stats[0][1] * (stats[0][0] - row_max).exp() + stats[1][1] * (stats[1][0] - row_max).exp()).log() + row_max
    whole = logits.clone()
    loss = ce_grad_(whole, labels, IGNORE_INDEX)
    assert _rel((lse - stats[0][2] - stats[1][2]) * (labels != IGNORE_INDEX), loss) < 1e-6
    grads = []
    for x, start in zip(halves, starts):
        ours, ref = x.clone(), x.clone()
        shard_ce_grad_(ours, labels, lse, start, IGNORE_INDEX)
        _shard_ce_grad_torch_(ref, labels, lse, start)
        assert _rel(ours.float(), ref.float()) < 1e-3
        grads.append(ours)
    assert _rel(torch.cat(grads, 1).float(), whole.float()) < 1e-3
    assert not grads[0][::5].any() and not grads[1][::5].any()  # unlabelled tokens: no gradient


def test_scale_rounds_once_from_fp32():
    from qwenft.models.ce_kernel import scale_

    x = torch.randn(1 << 20, device="cuda").bfloat16()
    s = torch.tensor(1.0 / 3001, device="cuda")
    assert torch.equal(scale_(x.clone(), s), (x.float() * s).bfloat16())


def test_scale_add_rounds_once_from_fp32():
    """ce_kernel.scale_add_ (the fused head's weight gradient added into `.grad`): acc + x * s formed in fp32,
    rounded once to bf16; within one bf16 step of torch's fp32 formula (a fused multiply-add rounds once where
    torch rounds the product first), equal for nearly every element."""
    from qwenft.models.ce_kernel import scale_add_

    gen = torch.Generator(device="cuda").manual_seed(0)
    acc = torch.randn(1 << 20, device="cuda", generator=gen).bfloat16()
    x = torch.randn(1 << 20, device="cuda", generator=gen).bfloat16()
    s = torch.tensor(1.0 / 3001, device="cuda")
    got, ref = scale_add_(acc.clone(), x, s), (acc.float() + x.float() * s).bfloat16()
    torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=0)
    assert (got == ref).float().mean().item() > 0.999


@pytest.mark.parametrize("tile", [8, 64, 4097], ids=["tile8", "tile64", "untiled"])
def test_add_sorted_rows_rounds_each_row_once(tile):
    """The embedding's backward kernel (ce_kernel.add_sorted_rows_): every id's rows summed in fp32 and added into
    its bf16 row with one rounding, for runs from one row to 1,500 (one id in over a third of the tokens, runs
    longer than a tile of rows and not a multiple of it), a run of 3,000 rows (a padding tail) in a stream of
    its own, the hidden size not a multiple of the column slab; equal to the fp64 sum rounded once for nearly
    every element, never a bf16 step off, the same bits on a rerun. With tiles of 8 or 64 rows (a long run's
    whole tiles summed ahead by programs of their own; the edge cases are the next test's) and with none. Ids of
    -1 (a vocab-parallel rank's tokens outside its shard, half of them here) add nothing."""
    from qwenft.models.ce_kernel import add_sorted_rows_

    gen = torch.Generator(device="cuda").manual_seed(0)
    dy = torch.randn(4096, 1000, device="cuda", generator=gen).bfloat16()
    grad = torch.randn(3000, 1000, device="cuda", generator=gen).bfloat16()

    def check(ids):
        keep = ids >= 0
        ref = grad.double().index_add(0, ids[keep], dy[keep].double())
        sorted_ids, order = ids.sort(stable=True)
        got = add_sorted_rows_(grad.clone(), sorted_ids, order, dy, tile=tile)
        torch.testing.assert_close(got.double(), ref, rtol=2**-7, atol=0)
        assert (got == ref.bfloat16()).double().mean().item() > 0.999
        assert torch.equal(add_sorted_rows_(grad.clone(), sorted_ids, order, dy, tile=tile), got)

    ids = torch.randint(0, 3000, (4096,), device="cuda", generator=gen)
    ids[torch.randperm(4096, device="cuda", generator=gen)[:1500]] = 7
    ids[:13] = 2999
    check(ids)
    padded = ids.clone()
    padded[1096:] = 2998  # a run of 3,000 rows and more: a padding tail
    check(padded)
    ids[torch.randperm(4096, device="cuda", generator=gen)[:2048]] = -1
    check(ids)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_add_sorted_rows_sums_every_row_once_at_tile_edges(ids_dtype):
    """add_sorted_rows_ on crafted sorted layouts, with small integers whose sums bf16 holds exactly, so the result
    equals the exact sum only if every row of every run is added once: runs that start and end on a tile's edge
    and inside a tile, ids of -1 first (ending on an edge, and inside a tile) that add nothing, one id over 64 and
    over 67 rows, a stream whose last tile is partial, a tile that is not a power of two, more tile than rows;
    rows read through a shuffled order; int64 ids (what add_token_rows_ sorts) and int32."""
    from qwenft.models.ce_kernel import add_sorted_rows_

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = [  # (run lengths, the first run's id -1 or not, tile)
        ([8, 16, 5, 3, 8, 7, 9, 1, 24, 8], False, 8),
        ([16, 8, 13, 11], True, 8),
        ([5, 19, 8, 4], True, 8),
        ([64], False, 8), ([64], False, 64), ([67], False, 8), ([67], False, 64),
        ([5, 100], False, 64), ([5, 100], False, 100), ([3, 200, 1, 70], True, 24), ([30], False, 64),
    ]
    for lengths, skipped_first, tile in cases:
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).cuda()
        if skipped_first:
            ids = ids - 1
        ids = ids.to(ids_dtype)
        n, width = len(ids), 600  # two column slabs of 512
        order = torch.randperm(n, device="cuda", generator=gen)
        src = torch.randint(-1, 2, (n, width), device="cuda", generator=gen).bfloat16()
        grad = torch.randint(-2, 3, (len(lengths), width), device="cuda", generator=gen).bfloat16()
        keep = ids >= 0
        ref = grad.double().index_add(0, ids[keep].long(), src[order][keep].double())
        got = add_sorted_rows_(grad.clone(), ids, order, src, tile=tile)
        assert torch.equal(got.double(), ref), (lengths, skipped_first, tile)


@pytest.mark.parametrize("head_scaled", [False, True], ids=["head-scaled-in-backward", "head-scaled-in-forward"])
def test_weight_grad_in_matmul_is_as_close_to_fp32_as_autograd(head_scaled):
    """model.kernels.weight_grad=in_matmul's kernels on CUDA in bf16 (cuBLAS's beta = 1, the embedding's segment
    sums (add_sorted_rows_), the fused head's scale_add_ or, given the loss's factor, its forward matmuls with alpha =
    the factor), four microbatches with repeated tokens: every weight's gradient at most as far from the fp32
    gradient as autograd's path in bf16 (which rounds each microbatch's gradient and then each sum), give or take
    a quarter."""
    import copy

    from torch import nn

    from qwenft.models import weight_grad
    from qwenft.models.linear_ce import LMHead

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.up, self.down = nn.Embedding(4096, 512), nn.Linear(512, 1024, False), nn.Linear(1024, 512)
            self.head = LMHead(512, 4096, ce_kernel="fused")

        def forward(self, ids):
            return self.head(self.down(torch.tanh(self.up(self.embed(ids)))), ids.roll(-1, dims=1))

    torch.manual_seed(0)
    fp32 = Net().cuda()
    autograd, in_matmul = copy.deepcopy(fp32).bfloat16(), copy.deepcopy(fp32).bfloat16()
    weight_grad.enable(in_matmul)
    weight_grad.prepare_grads([in_matmul], ce_scale=1 / 16384 if head_scaled else None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 512, (2, 2048), device="cuda", generator=gen)  # each token about 8 times a row
        for model in (fp32, autograd, in_matmul):
            (model(ids) / 16384).backward()
    for (name, ref), (_, a), (_, b) in zip(fp32.named_parameters(), autograd.named_parameters(),
                                           in_matmul.named_parameters()):
        err_autograd, err_in_matmul = _rel(a.grad, ref.grad), _rel(b.grad, ref.grad)
        assert err_in_matmul <= 1.25 * err_autograd + 1e-6, (name, err_in_matmul, err_autograd)
        assert err_in_matmul < 1e-2, (name, err_in_matmul)


def test_fused_linear_ce_within_bf16_of_fp32():
    from qwenft.models.linear_ce import fused_linear_ce_sum

    gen = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(512, 256, device="cuda", generator=gen)
    w = torch.randn(32_000, 256, device="cuda", generator=gen) * 0.05
    labels = torch.randint(0, 32_000, (512,), device="cuda", generator=gen)
    labels[::4] = -100
    h32, w32 = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(h32 @ w32.t(), labels, ignore_index=-100, reduction="sum")
    (ref / 3001).backward()
    for chunk in (0, 100):
        hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        out = fused_linear_ce_sum(hb, wb, labels, chunk)
        (out / 3001).backward()
        assert abs(out.item() - ref.item()) < 1e-2 * abs(ref.item())
        assert _rel(hb.grad, h32.grad) < 2e-2 and _rel(wb.grad, w32.grad) < 2e-2


def _adamw_run(fused, dtype, state_dtype, rounding, steps=3):
    from qwenft.train.optim import LowPrecisionAdamW

    gen = torch.Generator(device="cuda").manual_seed(2)
    # one launch updates all: a tensor over many programs (each takes 16 blocks: 16,384 fp32 or 32,768 bf16 weight
    # elements), one of a partial block, one of exactly a program's elements for each dtype, one a bf16 block past
    # that, and one with nothing to update
    shapes = ((513, 1031), (7,), (16384,), (32768,), (32768 + 2048,), (0,))
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).to(dtype)) for s in shapes]
    opt = LowPrecisionAdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, state_dtype=state_dtype,
                            stochastic_rounding=rounding, fused=fused)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
        opt.step()
    return params, opt


def test_fused_adamw_equals_foreach_in_fp32():
    ours, _ = _adamw_run(True, torch.float32, torch.float32, False)
    ref, _ = _adamw_run(False, torch.float32, torch.float32, False)
    for a, b in zip(ours, ref):
        assert a.numel() == 0 or _rel(a, b) < 1e-6


def test_fused_adamw_bf16_nearest_within_one_ulp_of_foreach():
    ours, _ = _adamw_run(True, torch.bfloat16, torch.bfloat16, False, steps=1)
    ref, _ = _adamw_run(False, torch.bfloat16, torch.bfloat16, False, steps=1)
    for a, b in zip(ours, ref):
        ulp = torch.finfo(torch.bfloat16).eps * b.float().abs()
        assert ((a.float() - b.float()).abs() <= ulp).all()


def test_fused_adamw_stochastic_rounding_is_unbiased():
    """An update of 1e-4 on 1.0 is far below half a bf16 ulp (2^-8 below 1): rounding to nearest loses it,
    stochastic rounding keeps it in the mean over 2^20 elements (standard error about 2e-6)."""
    from qwenft.train.optim import LowPrecisionAdamW

    for rounding, expected in ((True, 1e-4), (False, 0.0)):
        p = torch.nn.Parameter(torch.ones(1 << 20, device="cuda", dtype=torch.bfloat16))
        p.grad = torch.ones_like(p)
        LowPrecisionAdamW([p], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, state_dtype=torch.float32,
                          stochastic_rounding=rounding, fused=True).step()
        assert abs((1 - p.float().mean().item()) - expected) < 5e-6


def test_fused_adamw_bf16_moments_round_unbiased_and_independently(device="cuda"):
    """bf16 weight and both moments rounded stochastically in one step, each from its own 16 random bits: the
    means of the three over 2^20 elements keep values that rounding to nearest would lose, on even and odd
    elements alike (an element pair shares one Philox call), and whether one rounds up says nothing of the others.
    The gradient 1 + 2^-9 sits a quarter of a bf16 ulp above 1, so m = 0.1 g and v = 0.05 g^2 are far from bf16
    values; the weight's update is 1e-4 on 1.0."""
    from qwenft.train.adamw_kernel import AdamWTensor, FusedAdamW

    n, lr, beta2, gf = 1 << 20, 1e-4, 0.95, 1 + 2**-9
    g = torch.full((n,), gf, device=device)
    p = torch.ones(n, device=device, dtype=torch.bfloat16)
    m = torch.zeros(n, device=device, dtype=torch.bfloat16)
    v = torch.zeros(n, device=device, dtype=torch.bfloat16)
    FusedAdamW().update_([AdamWTensor(p, g, m, v, step_size=-lr / 0.1, bias_correction2_sqrt=(1 - beta2) ** 0.5,
                                      seed=11)],
                         lr=lr, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0, stochastic_rounding=True)
    ups = []
    for t, exact in ((p, 1 - lr), (m, 0.1 * gf), (v, (1 - beta2) * gf * gf)):
        tf = t.float()
        lo, hi = tf.unique().tolist()  # the two bf16 neighbours of the exact value, nothing else
        assert lo < exact < hi
        for half in (tf[0::2], tf[1::2]):  # standard error of the mean: (hi - lo) / 2 / sqrt(2^19)
            assert abs(half.mean().item() - exact) < 6 * (hi - lo) / 2 / 2**9.5
        ups.append((tf == hi).float())
    corr = torch.corrcoef(torch.stack(ups))
    assert (corr - torch.eye(3, device=device)).abs().max() < 0.01  # independent: |r| about 1e-3 at 2^20


def test_fused_adamw_launches_once_per_group_and_dtypes():
    """Eight weights of two dtypes in two parameter groups, one gradient a view two bytes into its buffer (as FSDP2's
    can be): five kernel launches a step (group x parameter dtype, and the unaligned tensor's own), not one per
    tensor; each tensor's update equals its update alone (its own seed and bias corrections, the same Philox bits
    wherever its chunks land in the launch)."""
    from torch.profiler import ProfilerActivity, profile

    from qwenft.train.optim import LowPrecisionAdamW

    def run(together):
        gen = torch.Generator(device="cuda").manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(1000 * (i + 1) + 17 * i, device="cuda", generator=gen)
                                     .to(torch.bfloat16 if i % 2 else torch.float32)) for i in range(8)]
        for i, p in enumerate(params):
            buffer = torch.randn(p.numel() + 1, device="cuda", generator=gen).to(p.dtype)
            p.grad = buffer[1:] if i == 3 else buffer[:-1]  # params[3] (bf16): 2 bytes past a 16-byte boundary
        groups = [{"params": params[:4]}, {"params": params[4:], "weight_decay": 0.0}]
        if together:
            opt = LowPrecisionAdamW(groups, lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16, seed=3, fused=True)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                opt.step()
                torch.cuda.synchronize()
            launches = sum(e.count for e in prof.key_averages() if e.key == "_adamw_kernel")
            return [p.detach().clone() for p in params], launches
        # one optimizer per tensor, its parameter index and group settings as in the shared one
        out = []
        for i, p in enumerate(params):
            pad = [torch.nn.Parameter(torch.zeros(1, device="cuda")) for _ in range(i)]  # index i in the optimizer
            opt = LowPrecisionAdamW([{"params": pad}, {"params": [p], "weight_decay": 0.1 if i < 4 else 0.0}],
                                    lr=1e-2, state_dtype=torch.bfloat16, seed=3, fused=True)
            opt.step()
            out.append(p.detach().clone())
        return out, None

    together, launches = run(True)
    alone, _ = run(False)
    assert launches == 5
    for a, b in zip(together, alone):
        assert torch.equal(a, b)


def test_fused_adamw_skipped_on_the_device_changes_nothing():
    """The fused step queued with a flag the GPU reads (the runner's step whose loss or norm is not finite): set, the
    kernels leave weights and moments as they were, and `unstep` gives back the step counts; with the flag clear,
    the steps before and after equal those of a run without the skipped step and without flags."""
    from qwenft.train.optim import LowPrecisionAdamW

    def snapshot(opt, params):
        return [t.clone() for p in params for t in (p.detach(), *(opt.state[p][k] for k in ("exp_avg", "exp_avg_sq",
                                                                                           "step")))]

    runs = []
    for skipped in (False, True):
        gen = torch.Generator(device="cuda").manual_seed(4)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen).bfloat16())
                  for s in ((513, 1031), (7,))]
        opt = LowPrecisionAdamW(params, lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16, fused=True)
        grads = [[torch.randn(p.shape, device="cuda", generator=gen).bfloat16() for p in params] for _ in range(3)]
        for k in (0, 1, 2) if skipped else (0, 2):
            for p, g in zip(params, grads[k]):
                p.grad = g
            before = snapshot(opt, params) if k == 1 else None
            opt.step(skip_if=torch.tensor(k == 1, device="cuda") if skipped else None)  # against no flag at all
            if k == 1:
                opt.unstep()
                assert all(torch.equal(a, b) for a, b in zip(snapshot(opt, params), before))
        runs.append(snapshot(opt, params))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_moe_block_backward_is_bit_reproducible():
    """The MoE block in bf16 with torch._grouped_mm, forward and backward twice on the same inputs: outputs and
    every gradient bit-equal. Tensor parallel runs this block replicated on every tp rank with no gradient
    reduction, so its replicas stay equal only if its backward adds in a fixed order."""
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.models.qwen3_5.moe import MoE

    text = named_config("35b_a3b").text
    torch.manual_seed(0)
    block = MoE(text, kernel="grouped_mm").cuda().to(torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.02)
    x = torch.randn(1, 4096, text.hidden_size, device="cuda", dtype=torch.bfloat16)
    probe = torch.randn_like(x)
    runs = []
    for _ in range(2):
        xg = x.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        y = block(xg)
        (y.float() * probe.float()).sum().backward()
        runs.append([y, xg.grad, *(p.grad.clone() for p in block.parameters())])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_adamw_applies_a_pending_clip_scale(dtype):
    """The clip coefficient read by the kernel from the device (no sync): both moments after one step are those of
    the scaled gradient (AdamW's normalised first update hides a scale, the moments do not), equal to the foreach
    path's fp32 multiply, and the gradient in memory is not written. Parameters and gradients share a dtype, as in a
    run (fp32, or bf16 with `optim.master_dtype=bfloat16`); the updated parameters agree to fp32's rounding, or
    within one bf16 ulp (each path rounds once)."""
    from qwenft.train.optim import LowPrecisionAdamW

    states = []
    for fused in (True, False):
        gen = torch.Generator(device="cuda").manual_seed(3)
        p = torch.nn.Parameter(torch.randn(513, 1031, device="cuda", generator=gen).to(dtype))
        g = torch.randn(p.shape, device="cuda", generator=gen).to(dtype)
        opt = LowPrecisionAdamW([p], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                state_dtype=torch.float32, stochastic_rounding=False, fused=fused)
        p.grad = g.clone()
        opt.scale_grads([p], torch.tensor(0.37, device="cuda"))
        opt.step()
        assert torch.equal(p.grad, g)
        m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
        scaled = g.float() * 0.37
        assert _rel(m, 0.1 * scaled) < 1e-6 and _rel(v, 0.05 * scaled * scaled) < 1e-6
        states.append((p.detach().clone(), m.clone(), v.clone()))
    (p_fused, *moments_fused), (p_ref, *moments_ref) = states
    for a, b in zip(moments_fused, moments_ref):
        assert _rel(a, b) < 1e-6
    if dtype == torch.float32:  # the two paths order their fp32 operations differently
        assert _rel(p_fused, p_ref) < 1e-6
    else:
        ulp = torch.finfo(dtype).eps * p_ref.float().abs()
        assert ((p_fused.float() - p_ref.float()).abs() <= ulp).all()


def _conv_grads(conv, x, w, probe, *args):
    """conv(x, w, *args)'s output and the gradients of (output * probe).sum() for x and w, all fp64."""
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = conv(x, w, *args)
    (y.double() * probe.double()).sum().backward()
    return y.double(), x.grad.double(), w.grad.double()


# (rows, tokens, channels, document offsets): rows of their own; and one packed row whose documents cross the
# 64-token blocks, hold a single token, and end on a block's edge, with channels that fill no channel block
CONV_CASES = [(2, 300, 160, None), (1, 320, 200, [0, 70, 71, 128, 200, 320])]


@pytest.mark.parametrize("rows,tokens,channels,offsets", CONV_CASES)
def test_causal_conv_kernel_equals_torch_conv(rows, tokens, channels, offsets):
    """qwenft's conv + SiLU kernels against the torch conv in fp64, from fp32 inputs: the output and both
    gradients within fp32's rounding (the kernels sum in fp32; relative errors about 1e-7), no tap reaching
    into another document or row, and the backward's bits the same on a second run (the weight's partial
    gradients summed in a fixed order)."""
    from qwenft.models.qwen3_5.conv_kernel import causal_conv_silu
    from qwenft.models.qwen3_5.gdn import causal_conv, positions_in_document

    gen = torch.Generator(device="cuda").manual_seed(5)
    x, probe = (torch.randn(rows, tokens, channels, device="cuda", generator=gen) for _ in range(2))
    w = torch.randn(channels, 4, device="cuda", generator=gen) * 0.5
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device="cuda")
    pos = None if cu is None else positions_in_document(cu, tokens)
    ref = _conv_grads(lambda x, w: causal_conv(x, w[:, None], pos), x.double(), w.double(), probe)
    ours = _conv_grads(causal_conv_silu, x, w, probe, cu)
    for a, b in zip(ours, ref):
        assert _rel(a, b) < 1e-5
    again = _conv_grads(causal_conv_silu, x, w, probe, cu)
    for a, b in zip(ours, again):
        assert torch.equal(a, b)


def test_causal_conv_kernel_on_a_fixed_layout():
    """The layout that CUDA graphs replay (`varlen.fixed_layout`: pad documents after the stream, then empty
    documents, the chunk indices given): the kernels' output and gradients those of the torch conv on the same
    documents, within fp32's rounding of fp64."""
    from qwenft.models.qwen3_5.conv_kernel import causal_conv_silu
    from qwenft.models.qwen3_5.gdn import causal_conv, positions_in_document
    from qwenft.models.qwen3_5.varlen import fixed_layout

    layout = fixed_layout(torch.tensor([0, 70, 71, 128, 200]), bucket=8)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x, probe = (torch.randn(1, layout.tokens, 96, device="cuda", generator=gen) for _ in range(2))
    w = torch.randn(96, 4, device="cuda", generator=gen) * 0.5
    cu, blocks = layout.cu_seqlens.cuda(), layout.chunk_indices.cuda()
    pos = positions_in_document(cu, layout.tokens)
    ref = _conv_grads(lambda x, w: causal_conv(x, w[:, None], pos), x.double(), w.double(), probe)
    ours = _conv_grads(causal_conv_silu, x, w, probe, cu, blocks)
    for a, b in zip(ours, ref):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("rows,tokens,channels,offsets", CONV_CASES)
def test_causal_conv_kernel_in_bf16_is_as_close_to_fp64_as_fla(rows, tokens, channels, offsets):
    """On bf16 inputs and weights, the kernels' output and gradients sit no farther from the fp64 conv of the
    same bf16 values than fla's `causal_conv1d` (which it replaces beside fla's delta rule) does: both round
    their results to bf16 once, and fla's backward also rounds its recomputed pre-activation to bf16."""
    pytest.importorskip("fla")
    from fla.modules.convolution import causal_conv1d

    from qwenft.models.qwen3_5.conv_kernel import causal_conv_silu
    from qwenft.models.qwen3_5.gdn import causal_conv, positions_in_document

    gen = torch.Generator(device="cuda").manual_seed(6)
    x, probe = (torch.randn(rows, tokens, channels, device="cuda", generator=gen).bfloat16() for _ in range(2))
    w = (torch.randn(channels, 4, device="cuda", generator=gen) * 0.5).bfloat16()
    cu = None if offsets is None else torch.tensor(offsets, dtype=torch.int32, device="cuda")
    pos = None if cu is None else positions_in_document(cu, tokens)
    ref = _conv_grads(lambda x, w: causal_conv(x, w[:, None], pos), x.double(), w.double(), probe)
    ours = _conv_grads(causal_conv_silu, x, w, probe, cu)
    varlen = {} if cu is None else {"cu_seqlens": cu.long()}
    fla = _conv_grads(lambda x, w: causal_conv1d(x=x, weight=w, activation="silu", **varlen)[0], x, w, probe)
    for a, b, r in zip(ours, fla, ref):
        assert _rel(a, r) < 1e-2  # bf16's rounding of each result: about 2^-9 relative
        assert _rel(a, r) <= 1.05 * _rel(b, r)
