"""The fake world (qwenft.distributed.fake_pg): every collective fills its output from this rank's own tensors,
so a one-process rank of a larger world computes on defined numbers; a sequence parallel tp2 run trains finite."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from helpers import compose, parity_overrides, read_metrics
from qwenft.distributed.fake_pg import fake_process_group

# the names torch 2.13 gives them (2.11: all_gather_tensor, all_gather_into_tensor, ...)
all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
WORLD, RANK = 3, 1  # a middle rank: its chunk is neither the first nor the last


def _poisoned(*shape):
    return torch.full(shape, float("nan"))


def _wait(t):
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def test_every_collective_fills_its_output_from_the_local_tensors():
    """Outputs start as NaN (or are fresh memory, for the functional collectives DTensor uses). Gathers repeat the
    local tensor (in place too), reduce-scatters keep this rank's chunk, all-to-alls get back what was sent to each
    rank, a receive and a scatter off the root are zeros; all-reduce and broadcast leave the tensor as it was."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    x = torch.arange(1.0, 13.0).reshape(6, 2)  # 6 rows: 3 chunks of 2
    tiled = torch.cat([x] * WORLD)
    mine = x[2 * RANK:2 * RANK + 2]
    with fake_process_group(WORLD, RANK):
        group = dist.group.WORLD
        out = _poisoned(18, 2)
        all_gather_into(out, x)
        assert torch.equal(out, tiled)
        out = _poisoned(18, 2)  # in place, as FSDP gathers: the input is this rank's rows of the output
        out[6 * RANK:6 * RANK + 6] = x
        all_gather_into(out, out[6 * RANK:6 * RANK + 6])
        assert torch.equal(out, tiled)
        outs = [_poisoned(6, 2) for _ in range(WORLD)]
        dist.all_gather(outs, x)
        assert all(torch.equal(o, x) for o in outs)
        out = _poisoned(2, 2)
        reduce_scatter_into(out, x)
        assert torch.equal(out, mine)
        out = _poisoned(6, 2)
        dist.reduce_scatter(out, [x, 2 * x, 3 * x])
        assert torch.equal(out, 2 * x)
        out = _poisoned(6, 2)
        dist.all_to_all_single(out, x)
        assert torch.equal(out, x)
        out = _poisoned(5, 2)  # uneven: 1, 3 and 1 rows come back where 2, 1 and 3 were sent
        dist.all_to_all_single(out, x, output_split_sizes=[1, 3, 1], input_split_sizes=[2, 1, 3])
        assert torch.equal(out, torch.cat([x[0:1], x[2:3], torch.zeros(2, 2), x[3:4]]))
        outs = [_poisoned(2, 2) for _ in range(WORLD)]
        dist.all_to_all(outs, list(x.chunk(WORLD)))
        assert all(torch.equal(o, c) for o, c in zip(outs, x.chunk(WORLD)))
        y = x.clone()
        dist.all_reduce(y)
        dist.broadcast(y, src=0)
        assert torch.equal(y, x)
        out = _poisoned(6, 2)
        dist.recv(out, src=0)
        assert torch.equal(out, torch.zeros(6, 2))
        out = _poisoned(6, 2)
        dist.scatter(out, src=0)
        assert torch.equal(out, torch.zeros(6, 2))

        assert torch.equal(_wait(all_gather(x, 0, group)), tiled)
        assert torch.equal(_wait(all_gather(x, 1, group)), torch.cat([x] * WORLD, dim=1))
        assert torch.equal(_wait(reduce_scatter(x, "sum", 0, group)), mine)
        assert torch.equal(_wait(funcol.all_to_all_single(x, None, None, group)), x)
        assert torch.equal(_wait(funcol.all_reduce(x, "sum", group)), x)

        mesh = init_device_mesh("cpu", (WORLD,))
        assert torch.equal(DTensor.from_local(x, mesh, [Shard(0)]).full_tensor(), tiled)
        partial = DTensor.from_local(x, mesh, [Partial()])
        assert torch.equal(partial.redistribute(mesh, [Shard(0)]).to_local(), mine)
        assert torch.equal(partial.redistribute(mesh, [Shard(1)]).to_local(), x[:, RANK:RANK + 1])
        assert torch.equal(partial.redistribute(mesh, [Replicate()]).to_local(), x)
        assert dist.all_gather_object([None] * WORLD, {"rank": RANK}) is None


@pytest.mark.parametrize("world", [2, 4, 5, 8])
def test_a_gather_repeats_the_shard_for_every_world_and_rank_in_place_too(world):
    """The gather fills rows by doubling the filled ones: every row gets the shard, at any world size (powers of
    two and not), and in place from any rank's row (rank 0's row is the first one written)."""
    x = torch.arange(1.0, 7.0).reshape(3, 2)
    for rank in range(world):
        with fake_process_group(world, rank):
            out = _poisoned(3 * world, 2)
            all_gather_into(out, x)
            assert torch.equal(out, torch.cat([x] * world))
            out = _poisoned(3 * world, 2)
            out[3 * rank:3 * rank + 3] = x
            all_gather_into(out, out[3 * rank:3 * rank + 3])
            assert torch.equal(out, torch.cat([x] * world))


def test_dynamo_never_compiles_the_fake_groups_python():
    """Every method of the group (the collectives a compiled graph calls back into) is under
    `torch.compiler.disable`: torch 2.11's Dynamo compiled them inside compiled layers, host work on every
    collective (torch 2.13 on the CPU does not reach them, so the mark itself is what can be checked here)."""
    from qwenft.distributed.fake_pg import LocalCopyGroup

    methods = {n: m for n, m in vars(LocalCopyGroup).items() if callable(m) and not n.startswith("__")}
    assert {"allreduce", "all_gather_single", "_allgather_base", "_gather_into", "reduce_scatter_single",
            "all_to_all_single"} <= set(methods)
    assert all(getattr(m, "_torchdynamo_disable", False) for m in methods.values()), \
        [n for n, m in methods.items() if not getattr(m, "_torchdynamo_disable", False)]


def test_sequence_parallel_trains_finite_in_a_fake_tp2_world(tmp_path):
    """Rank 0 of a fake tp2 world with mesh.sequence_parallel=true (norms on half the tokens: an all-gather before
    each projection, a reduce-scatter after) trains 3 steps of the tiny model to finite losses and gradient norms,
    every optimizer step taken. On torch 2.11's own fake backend the reduce-scatter left fresh memory and the
    loss turned NaN."""
    from qwenft.train.runner import run

    overrides = parity_overrides(tmp_path / "run", "mesh.tp=2", "mesh.sequence_parallel=true", "data.seq_len=64",
                                 "checkpoint.export_hf=false")
    with fake_process_group(2):
        result = run(compose(overrides))
    rows = [r for r in read_metrics(tmp_path / "run") if "grad_norm" in r]
    assert len(result.losses) == 3 and result.skipped_steps == 0, result
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows), rows
