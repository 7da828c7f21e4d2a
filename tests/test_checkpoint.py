"""Sharded checkpoints resume exactly: a run stopped at step 2 and resumed trains steps 3-4 to the same
losses as a run that never stopped (fp32, CPU)."""

import json

import pytest

from distributed import run_distributed
from qwenft.cli import compose


def _train(rank, world_size, overrides):
    from qwenft.train.runner import run

    return run(compose(overrides)).losses


def _overrides(run_dir, max_steps, *extra):
    # warmup over all 4 steps with a constant tail: every step has its own lr, and the schedule does not
    # depend on max_steps, so the 2-step run and the 4-step run follow the same one
    return ["recipe=tiny", f"train.max_steps={max_steps}", "data.seq_len=128", "model.kernels.gdn=torch",
            "train.progress_bar=false", "checkpoint.export_hf=false", "optim.lr=5e-4",
            "lr_scheduler.warmup_steps=4", "lr_scheduler.decay=constant", "train.global_batch_size=4",
            "train.micro_batch_size=1", "checkpoint.every_steps=2", f"run_dir={run_dir}", *extra]


def _logged_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("a") / "run"
    run_distributed(_train, 2, _overrides(run_dir, 4))
    return _logged_losses(run_dir)


def test_resume_on_the_same_mesh_is_bit_identical(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    run_distributed(_train, 2, _overrides(run_dir, 2, "checkpoint.keep=1"))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000002"
    losses = run_distributed(_train, 2, _overrides(run_dir, 4, "checkpoint.keep=1", "checkpoint.resume=auto"))
    assert len(losses[0]) == 2  # only steps 3 and 4 ran
    logged = _logged_losses(run_dir)
    assert sorted(logged) == [1, 2, 3, 4]  # appended to the first run's metrics
    assert logged[3] == uninterrupted[3] and logged[4] == uninterrupted[4], (logged, uninterrupted)
    assert uninterrupted[3] != uninterrupted[4]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step-000004"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step-000004"]


def test_resume_on_another_mesh(tmp_path, uninterrupted):
    """Saved by 2 FSDP ranks, loaded by one: DCP reshards; only the reduction order differs."""
    run_dir = tmp_path / "run"
    run_distributed(_train, 2, _overrides(run_dir, 2))
    (losses,) = run_distributed(_train, 1, _overrides(run_dir, 4))
    for got, step in zip(losses, (3, 4)):
        assert abs(got - uninterrupted[step]) <= 1e-5 * abs(uninterrupted[step]), (step, got, uninterrupted[step])


def test_corrupt_checkpoint_is_a_one_line_error(tmp_path):
    broken = tmp_path / "checkpoints" / "step-000002"
    broken.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step-000002\n")
    with pytest.raises(RuntimeError, match="incomplete or corrupt") as info:
        run_distributed(_train, 1, _overrides(tmp_path, 2))
    assert str(broken) in str(info.value)
    with pytest.raises(RuntimeError, match="does not exist"):
        run_distributed(_train, 1, _overrides(tmp_path / "other", 2, f"checkpoint.resume={tmp_path / 'nope'}"))
