"""Context parallelism's CUDA kernels against the unsplit ones, one layer on the same weights, forward and backward:
fla's context-parallel GatedDeltaNet (`causal_conv1d` and `chunk_gated_delta_rule` with a `cp_context`) and the
flash kernel's document-piece attention over gathered keys (`context_parallel.attend_span`).

GatedDeltaNet runs on 2 and 4 cp ranks, each a process of its own on the one GPU, joined by gloo: gloo moves
no CUDA tensor, so the ranks' collectives (fla's and qwenft's) go through the host (`_HostStaged`). Threads in one
process cannot stand in for the ranks: autograd runs every CUDA backward of a process on one device thread, where
one rank's blocking all-gather would wait forever for the others'. The spans' outputs, concatenated, and their
gradients, summed, are compared with the unsplit row on fla's kernel and on the torch path in fp32.

One row of 512 tokens, documents at 0, 5, 300, 301, 384, 512: at cp4 (spans of 128) the second document crosses
three spans, a one-token document starts at an edge's neighbour, one ends exactly at the edge 384 and the last
fills the last span; at cp2 the long document straddles the edge 256. No boundary sits on a 64-token chunk edge
but the span edges.
"""

import importlib.util
import os
import pickle
import time

import pytest
import torch

from helpers import rel_err
from distributed import free_port

pytestmark = pytest.mark.gpu

BOUNDS = [0, 5, 300, 301, 384, 512]


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA (the GPU tier, tests/gpu)"
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("fla.ops.cp") is None:
        return "needs flash-linear-attention >= 0.5 (fla.ops.cp): the GPU kit or pip install -e '.[gpu]'"
    return None


class _HostStaged:
    """torch.distributed as fla's and qwenft's context-parallel code call it, with the all-gathers, all-reduces and
    reduce-scatters of CUDA tensors done on host copies (gloo takes no CUDA tensor); everything else passes
    through."""

    def __init__(self, dist):
        self._dist = dist

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_gather_into_tensor(self, out, inp, group=None, async_op=False):
        # flat: NCCL takes the output stacked ([world, *in]) or concatenated, gloo only concatenated along dim 0
        host = out.cpu()
        self._dist.all_gather_into_tensor(host.view(-1), inp.cpu().reshape(-1), group=group)
        out.copy_(host)

    all_gather_single = all_gather_into_tensor

    def all_reduce(self, t, op=None, group=None, async_op=False):
        host = t.cpu()
        self._dist.all_reduce(host, op=op or self._dist.ReduceOp.SUM, group=group)
        t.copy_(host)

    def get_backend(self, group=None):
        return "gloo"


def _gdn_rank(rank, world, port, kernel, state, x, probe, queue):
    """One cp rank: its span of the layer's output and its gradients (the input's span, every parameter's), or
    the traceback of what failed, put on `queue` (a rank that fails would otherwise leave the others waiting in
    a collective and the parent waiting on the queue)."""
    import traceback

    try:
        queue.put((rank, _gdn_span(rank, world, port, kernel, state, x, probe), None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
        raise


def _gdn_span(rank, world, port, kernel, state, x, probe) -> bytes:
    import torch.distributed as dist

    import fla.ops.cp.comm as fla_comm
    from qwenft.models.qwen3_5 import context_parallel

    from test_packed_kernels import _gdn, _gdn_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    staged = _HostStaged(dist)
    fla_comm.dist = staged
    context_parallel.dist = staged
    context_parallel._all_gather = staged.all_gather_into_tensor
    try:
        layer = _gdn(_gdn_config(), kernel, torch.float32, state)
        shard = context_parallel.cp_shard(torch.tensor(BOUNDS, dtype=torch.int32, device="cuda"), dist.group.WORLD)
        x_span = shard.split(x.cuda()).detach().requires_grad_()
        qkv, z, beta, a = layer.project(x_span)
        out = layer.output(layer.mix(qkv, beta, a, cp=shard), z)
        (out * shard.split(probe.cuda())).sum().backward()
        grads = {"input": x_span.grad.cpu(), **{n: p.grad.cpu() for n, p in layer.named_parameters()}}
        for name, g in grads.items():
            if name != "input":
                dist.all_reduce(g)  # each span's share of a parameter's gradient
        # plain pickle: the queue's own would share the tensors through file descriptors gone once this rank exits
        return pickle.dumps((out.detach().cpu(), grads))
    finally:
        dist.destroy_process_group()


def _start_cp(world: int, kernel: str, port: int, state, x, probe):
    """The `world` ranks of one cp run, started: each compiles its kernels while this process goes on."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gdn_rank, args=(r, world, port, kernel, state, x, probe, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    return procs, queue


def _collect_cp(world: int, kernel: str, procs, queue, timeout_s: float = 600):
    """The run's output (the spans concatenated) and gradients (the input's concatenated, the parameters' summed
    by the ranks), or the test's failure naming the rank that failed or went silent."""
    import queue as queue_module

    got, deadline = {}, time.monotonic() + timeout_s
    while len(got) < world:
        try:
            rank, payload, error = queue.get(timeout=2)
        except queue_module.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                pytest.fail(f"{kernel} cp{world}: rank(s) {dead} (rank, exit code) died without reporting")
            if time.monotonic() > deadline:
                pytest.fail(f"{kernel} cp{world}: no result from ranks {sorted(set(range(world)) - set(got))} "
                            f"after {timeout_s:.0f} s")
            continue
        if error is not None:
            pytest.fail(f"{kernel} cp{world} rank {rank} failed:\n{error}")
        got[rank] = pickle.loads(payload)
    out = torch.cat([got[r][0] for r in range(world)], dim=1)
    grads = {name: g for name, g in got[0][1].items() if name != "input"}
    grads["input"] = torch.cat([got[r][1]["input"] for r in range(world)], dim=1)
    return out, grads


def _stop(procs) -> None:
    """Ranks that reported exit once their result is read; after 30 s in all, the rest (a failed test's) are
    killed."""
    deadline = time.monotonic() + 30
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()


@pytest.mark.timeout(460, method="signal")  # each spawned rank compiles fla's kernels (cold: minutes)
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
def test_fla_context_parallel_gated_delta_net_equals_the_unsplit_row(world):
    """fla's cp kernels, and the torch cp path on the same GPU, against the unsplit row on fla's kernel and on the
    torch path (fp32): the output and the gradients of the input and every parameter. fla's tolerances are its
    TF32 ones (test_packed_kernels.GDN_TOLERANCES); the torch cp path equals the torch row to fp32 rounding (1e-4: its sums
    run in another order; a lost state or conv row moves outputs at 1e-2)."""
    if (why := _skip_reason()) is not None:
        pytest.skip(why)
    from test_packed_kernels import GDN_TOLERANCES, _check, _forward_backward, _gdn, _gdn_config, _gdn_state

    cfg, state = _gdn_config(), _gdn_state(_gdn_config(), seed=1)
    gen = torch.Generator().manual_seed(2)
    x, probe = (torch.randn(1, BOUNDS[-1], cfg.hidden_size, generator=gen) for _ in range(2))
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device="cuda")
    ports = set()
    while len(ports) < 2:
        ports.add(free_port())
    # both cp runs' ranks start first: on a fresh machine their kernel compiles overlap this process's own for the
    # unsplit row, instead of following them
    runs = {kernel: _start_cp(world, kernel, port, state, x, probe) for kernel, port in zip(("fla", "torch"), ports)}
    try:
        unsplit = {kernel: _forward_backward(_gdn(cfg, kernel, torch.float32, state), x.cuda(), probe.cuda(), cu)
                   for kernel in ("torch", "fla")}
        fla_out, fla_grads = _collect_cp(world, "fla", *runs["fla"])
        torch_out, torch_grads = _collect_cp(world, "torch", *runs["torch"])
    finally:
        for procs, _ in runs.values():
            _stop(procs)
    ref_out, ref_grads = (t.cpu() if torch.is_tensor(t) else {k: v.cpu() for k, v in t.items()}
                          for t in unsplit["torch"])
    _check(f"fla cp{world} against the torch row", fla_out, fla_grads, ref_out, ref_grads,
           GDN_TOLERANCES[torch.float32])
    u_out, u_grads = (t.cpu() if torch.is_tensor(t) else {k: v.cpu() for k, v in t.items()} for t in unsplit["fla"])
    _check(f"fla cp{world} against the fla row", fla_out, fla_grads, u_out, u_grads, GDN_TOLERANCES[torch.float32])
    _check(f"torch cp{world} against the torch row", torch_out, torch_grads, ref_out, ref_grads,
           {"output": 1e-4, "grad": 1e-4})


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_flash_attention_over_gathered_keys_equals_the_row(world, dtype):
    """Each span's queries through the flash kernel over the keys from their first document's start
    (`attend_span`, the cp path after its all-gather) against causal attention of the whole row by document
    (masked SDPA, fp32): outputs and the gradients of q, k, v. The flash kernel aligns a piece's causal mask at
    the bottom right, which only these pieces (fewer queries than keys) exercise."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the GPU tier, tests/gpu)")
    from qwenft.models.qwen3_5.attention import attend, resolve_attention_kernel
    from qwenft.models.qwen3_5.context_parallel import CPShard, attend_span

    if resolve_attention_kernel("auto", True, torch.device("cuda"), dtype) != "flash_varlen":
        pytest.skip("torch's varlen flash kernel is not available")
    H, Hkv, D, T = 8, 2, 128, BOUNDS[-1]
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, probe = (torch.randn(1, H, T, D, device="cuda", generator=gen) for _ in range(2))
    k, v = (torch.randn(1, Hkv, T, D, device="cuda", generator=gen) for _ in range(2))
    cu = torch.tensor(BOUNDS, dtype=torch.int32, device="cuda")

    def run(fn, *tensors):
        leaves = [t.detach().to(dtype).float().requires_grad_() for t in tensors]
        out = fn(*leaves)
        (out * probe.transpose(1, 2)).sum().backward()
        return out.detach(), [t.grad for t in leaves]

    scale = D**-0.5
    ref_out, ref_grads = run(lambda q_, k_, v_: attend(q_, k_, v_, scale, cu, "sdpa"), q, k, v)
    out, grads = torch.zeros_like(ref_out), [torch.zeros_like(t) for t in (q, k, v)]
    cu_cpu = torch.tensor(BOUNDS, dtype=torch.long)
    for rank in range(world):
        shard = CPShard(None, rank, world, T, cu_cpu, torch.device("cuda"))
        leaves = [q.detach().to(dtype).requires_grad_(), k.detach().to(dtype).requires_grad_(),
                  v.detach().to(dtype).requires_grad_()]
        span = attend_span(leaves[0][:, :, shard.start:shard.end], leaves[1], leaves[2], scale, shard, shard.start,
                           shard.end, "auto")
        (span.float() * probe.transpose(1, 2)[:, shard.start:shard.end]).sum().backward()
        out[:, shard.start:shard.end] = span.detach().float()
        for g, leaf in zip(grads, leaves):
            g += leaf.grad.float()
    assert rel_err(out, ref_out) < 2e-2, rel_err(out, ref_out)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) < 3e-2, (name, rel_err(g, r))
