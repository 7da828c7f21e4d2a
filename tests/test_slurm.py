"""`qwenft slurm` against a real SLURM (slurmctld + two slurmds on this host), the script's key lines, the
one-line errors, and `env_from_slurm` inside a real srun step."""

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import slurm_cluster
from qwenft.cli import main
from qwenft.launch.slurm import env_from_slurm, first_host

REPO = Path(__file__).resolve().parent.parent


def qwenft(*args, env=None, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "qwenft", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.ensure_installed()
    if reason:
        pytest.skip(reason)
    cluster, procs = slurm_cluster.start(tmp_path_factory.mktemp("slurm"))
    yield cluster
    slurm_cluster.stop(procs)


def _dry_run(capsys, *overrides):
    """In process: the dry-run tests need no cluster and no fresh interpreter."""
    code = main(["slurm", "recipe=tiny", "--dry-run", *overrides])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


def test_dry_run_script_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    script = _dry_run(capsys, 
        "launcher.nodes=4", "launcher.gpus_per_node=8", "launcher.partition=gpu", "launcher.account=proj",
        "launcher.time=04:00:00", "launcher.qos=high", "launcher.job_name=ft",
        "launcher.container_image='nvcr.io#nvidia/pytorch:25.01-py3'",
        "launcher.container_mounts=[/data:/data,/ckpt:/ckpt]", "launcher.sbatch_extra=[--exclusive]",
        "launcher.env={NCCL_DEBUG: WARN, HF_TOKEN: null}", "mesh.tp=4", "mesh.pp=2", f"run_dir={tmp_path}/run")
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=04:00:00",
                 "#SBATCH --qos=high", "#SBATCH --job-name=ft", f"#SBATCH --output={tmp_path}/run/slurm-%j.out",
                 "#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --exclusive", "#SBATCH --export=ALL",
                 "export NCCL_DEBUG=WARN", "export HF_TOKEN", "trap on_usr1 USR1"):
        assert line in script.splitlines(), line
    assert "hf_secret_value" not in script
    assert "--container-image='nvcr.io#nvidia/pytorch:25.01-py3'" in script
    assert "--container-mounts=/data:/data,/ckpt:/ckpt" in script
    assert "--nproc-per-node=8" in script and '--rdzv-endpoint="$head_addr:$port"' in script
    assert f"run_dir={tmp_path}/run" in script and "mesh.tp=4" in script
    assert "# qwenft slurm: recipe tiny, 4 node(s) x 8 process(es) = world 32" in script
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_dry_run_cpu_nodes_and_defaults(capsys):
    script = _dry_run(capsys, "launcher.nodes=2", "launcher.gpus_per_node=0", "launcher.nproc_per_node=3")
    assert "--gpus-per-node" not in script and "--nproc-per-node=3" in script
    assert "#SBATCH --job-name=qwenft-tiny" in script and "--partition" not in script
    assert re.search(r"run_dir=/\S+/outputs/tiny/\d{8}-\d{6}", script)  # absolute: the job's dir is fixed


@pytest.mark.parametrize("overrides, message", [
    (["launcher.nodes=0"], "launcher.nodes=0 must be >= 1"),
    (["launcher.nodes=1", "launcher.gpus_per_node=6", "mesh.tp=4"],
     "launcher.nodes=1 x launcher.gpus_per_node=6 = 6 ranks, but mesh.tp=4 x mesh.pp=1 = 4 does not divide 6"),
    (["launcher.nodes=2", "launcher.gpus_per_node=0", "launcher.nproc_per_node=2", "mesh.dp=3"],
     "launcher.nodes=2 x launcher.nproc_per_node=2 = 4 ranks, but mesh.tp=1 x mesh.pp=1 x mesh.dp=3 = 3"),
    (["launcher.gpus_per_node=8", "launcher.nproc_per_node=4"],
     "launcher.nproc_per_node=4 disagrees with launcher.gpus_per_node=8"),
    (["+launcher.env.WANDB_API_KEY=abc"], "launcher.env.WANDB_API_KEY has a value; secrets are passed by name"),
])
def test_bad_input_one_line_errors(overrides, message, capsys):
    code = main(["slurm", "recipe=tiny", "--dry-run", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.strip().count("\n") == 0


def test_missing_sbatch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it: no sbatch
    code = main(["slurm", "recipe=tiny", "launcher.gpus_per_node=0", f"run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and "sbatch not found on PATH" in err, err
    assert err.strip().count("\n") == 0 and not (tmp_path / "run").exists()


def test_first_host():
    assert first_host("gpu[003-010,012],cpu1") == "gpu003"
    assert first_host("n1,n2") == "n1" and first_host("n[1-2]") == "n1" and first_host("a[7]-ib") == "a7-ib"


def test_env_from_slurm_leaves_torchrun_and_batch_shell_alone():
    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_LOCALID": "1", "MASTER_ADDR": "10.0.0.1"}
    assert env_from_slurm(step) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_PORT": "20007"}
    assert env_from_slurm({**step, "RANK": "0", "WORLD_SIZE": "8"}) == {}  # torchrun's variables win
    batch_shell = {k: v for k, v in step.items() if k != "SLURM_STEP_ID"}
    assert env_from_slurm(batch_shell) == {}


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_node_job_completes(cluster, tmp_path):
    run_dir = tmp_path / "run"
    start = time.monotonic()
    out = qwenft("slurm", "recipe=tiny", "launcher.nodes=2", "launcher.gpus_per_node=0",
                 "launcher.nproc_per_node=1", "train.max_steps=3", "train.progress_bar=false",
                 f"run_dir={run_dir}", env={**cluster.env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)
    state, exit_code = cluster.wait_job(job_id, timeout=240)
    log = (run_dir / f"slurm-{job_id}.out").read_text() if (run_dir / f"slurm-{job_id}.out").exists() else ""
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"{state} {exit_code}\n{log[-4000:]}\n{cluster.logs()}"
    print(f"2-node job {job_id}: submit to COMPLETED in {time.monotonic() - start:.0f} s")
    assert "world 2 = pp 1 x dp 2 x tp 1" in (run_dir / "train.log").read_text()
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert (run_dir / "slurm.sh").exists() and "nodes: 2" in (run_dir / "config.yaml").read_text()
    assert "rendezvous 127.0.0.1:" in log  # the head node's NodeAddr, not its unresolvable name


def test_hand_written_srun_joins_one_process_group(cluster, tmp_path):
    """srun with one task per rank and no torchrun: mesh.init_process_group maps SLURM's variables."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os, torch, torch.distributed as dist\n"
        "from qwenft.distributed.mesh import init_process_group\n"
        "init_process_group('gloo')\n"
        "t = torch.tensor([float(dist.get_rank() + 1)]); dist.all_reduce(t)\n"
        "print('rank', dist.get_rank(), 'world', dist.get_world_size(), 'sum', int(t.item()), flush=True)\n"
        "dist.destroy_process_group()\n")
    out = subprocess.run(["srun", "-N2", "--ntasks-per-node=2", "--overcommit", sys.executable, str(probe)],
                         cwd=REPO, env={**cluster.env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} world 4 sum 10" for r in range(4)], out.stdout


def test_usr1_requeues_into_the_same_run_dir(cluster, tmp_path):
    """--signal's SIGUSR1 reaches the batch shell, whose trap requeues the job (launcher.max_requeues=1);
    the second start trains in the same run dir. (Without checkpoint resume it starts from step 1 again.)"""
    run_dir = tmp_path / "run"
    out = qwenft("slurm", "recipe=tiny", "launcher.nodes=2", "launcher.gpus_per_node=0", "launcher.max_requeues=1",
                 "train.max_steps=3", "train.progress_bar=false", f"run_dir={run_dir}",
                 env={**cluster.env, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)
    log = run_dir / f"slurm-{job_id}.out"
    deadline = time.monotonic() + 60
    while not (log.exists() and "restart 0, rendezvous" in log.read_text()):
        assert time.monotonic() < deadline, cluster.logs()
        time.sleep(0.5)
    cluster.run("scancel", "--signal=USR1", "--batch", job_id)  # what --signal=B:USR1@120 sends
    while "Restarts=1" not in cluster.run("scontrol", "-o", "show", "job", job_id):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    state = cluster.wait_job(job_id, timeout=180, release_held=True)
    text = log.read_text()
    assert state == ("COMPLETED", "0:0"), f"{state}\n{text[-4000:]}"
    assert "qwenft: SIGUSR1, requeueing job" in text and "restart 1, rendezvous" in text
    assert [r["step"] for r in _metrics(run_dir)][-3:] == [1, 2, 3]


def test_slurm_launcher_option(capsys):
    script = _dry_run(capsys, "launcher=slurm", "launcher.partition=gpu", "mesh.tp=4")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --partition=gpu",
                 "#SBATCH --time=04:00:00", "export HF_TOKEN"):
        assert line in script.splitlines(), line
