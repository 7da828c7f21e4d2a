"""`qwenft train launcher.nproc_per_node=N` on one machine: when it starts its own workers (never inside a launch
that already made this process a rank), and the command line it starts them with, as Hydra reads it back."""

import pytest

from helpers import compose
from qwenft.cli import _local_workers_command, _starts_local_workers

# one task of `srun --ntasks-per-node=8 -N2 python -m qwenft train ...` (the reviewer's repro of the double launch)
SRUN_TASK = {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "16",
             "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n1"}


@pytest.mark.parametrize("environ, starts", [
    ({}, True),  # a plain shell
    (SRUN_TASK, False),  # each srun task is one rank already
    ({**SRUN_TASK, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, False),
    ({"RANK": "0", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}, False),  # a torchrun worker
    ({"RANK": "3", "WORLD_SIZE": "8"}, False),
    ({"SLURM_JOB_ID": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, True),  # the sbatch shell: no step
    ({**SRUN_TASK, "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1"}, True),  # `srun -n1 qwenft train`: one task
], ids=["shell", "srun-task", "srun-task-0", "torchrun", "rank-env", "sbatch-shell", "srun-one-task"])
def test_local_workers_only_outside_a_launch(environ, starts):
    """A recipe with launcher.nproc_per_node=8: under srun (several tasks) or torchrun the process is one rank and
    must not start 8 workers of its own; in a shell, the sbatch shell or a one-task step it does."""
    cfg = compose(["recipe=tiny", "launcher.nproc_per_node=8"])
    assert _starts_local_workers(cfg, environ) is starts
    assert not _starts_local_workers(compose(["recipe=tiny"]), environ)  # nproc_per_node=1: never


@pytest.mark.parametrize("run_dir", ["/tmp/proj (copy)/outputs/r1", "/tmp/runs (a)/it's [b], {c}=d ${e}\\",
                                     "outputs/tiny/20261205-101500"])
@pytest.mark.parametrize("typed", ["run_dir='{}'", None])
def test_local_workers_get_the_run_dir_hydra_reads_back(run_dir, typed):
    """The workers' command line (a list: no shell between) composes to the same run_dir and keeps the user's
    other overrides; the user's own run_dir override, quoted for Hydra or not given, is replaced."""
    hydra_escaped = run_dir.replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${")
    user = ["recipe=tiny", "launcher.nproc_per_node=2", "train.max_steps=3"]
    if typed:
        user.append(typed.format(hydra_escaped))
    cfg = compose(user)
    command = _local_workers_command(cfg, user, run_dir)
    assert command[2:6] == ["qwenft.launch.torchrun", "--standalone", "--nproc-per-node=2", "-m"]
    assert command[6:8] == ["qwenft", "train"]
    args = command[8:]
    assert sum(a.startswith("run_dir=") for a in args) == 1 and "train.max_steps=3" in args
    again = compose(args)
    assert again.run_dir == run_dir and again.train.max_steps == 3
