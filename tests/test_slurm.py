"""`qwenft slurm` against a real SLURM (slurmctld + two slurmds on this host): a 2-node job, a preempted job that
requeues itself and resumes, secrets kept out of every file; the script's key lines, the one-line errors, and
`env_from_slurm` inside a real srun step."""

import hashlib
import math
import re
import subprocess
import sys
import time

import pytest

import slurm_cluster
from helpers import REPO, read_metrics, run_qwenft
from qwenft.cli import main
from qwenft.distributed.slurm_env import env_from_slurm, first_host


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
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue", "#SBATCH --exclusive", "#SBATCH --export=ALL",
                 "export NCCL_DEBUG=WARN", "export HF_TOKEN", "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=120",
                 f"run_dir={tmp_path}/run", "resume=auto",
                 'if [ -f "$run_dir/preempted" ]; then', '  if [ "${SLURM_RESTART_COUNT:-0}" -lt 10 ]; then',
                 '    scontrol requeue "$SLURM_JOB_ID"', "  exit 75"):
        assert line in script.splitlines(), line
    assert 'rm -f "$run_dir/preempted"' in script and "hf_secret_value" not in script
    assert "--container-image='nvcr.io#nvidia/pytorch:25.01-py3'" in script
    assert "--container-mounts=/data:/data,/ckpt:/ckpt" in script
    assert "--nproc-per-node=8" in script and '--rdzv-endpoint="$head_addr:$port"' in script
    assert '"run_dir=$run_dir" "checkpoint.resume=$resume" || status=$?' in script and "mesh.tp=4" in script
    assert "-m qwenft.launch.torchrun --nnodes" in script  # torchrun that leaves SIGUSR1 to the workers
    assert "# qwenft slurm: recipe tiny, 4 node(s) x 8 process(es) = world 32" in script
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_dry_run_cpu_nodes_and_defaults(capsys):
    script = _dry_run(capsys, "launcher.nodes=2", "launcher.gpus_per_node=0", "launcher.nproc_per_node=3")
    assert "--gpus-per-node" not in script and "--nproc-per-node=3" in script
    assert "#SBATCH --job-name=qwenft-tiny" in script and "--partition" not in script
    assert re.search(r"run_dir=/\S+/outputs/tiny/\d{8}-\d{6}", script)  # absolute: the job's dir is fixed


def test_requeue_false_neither_asks_slurm_nor_requeues_itself(capsys):
    script = _dry_run(capsys, "launcher.gpus_per_node=0", "launcher.requeue=false")
    lines = script.splitlines()
    assert "#SBATCH --no-requeue" in lines and "#SBATCH --requeue" not in lines and "scontrol requeue" not in script
    assert '  echo "qwenft: preempted; not requeueing (launcher.requeue=false)"' in lines and "  exit 75" in lines


def test_dry_run_resume_path_only_on_the_first_start(capsys):
    """checkpoint.resume=<dir> starts the job from that checkpoint; a requeued start continues from its own."""
    script = _dry_run(capsys, "launcher.gpus_per_node=0", "checkpoint.resume=/ckpt/run1/checkpoints/step-000100")
    lines = script.splitlines()
    assert "resume=/ckpt/run1/checkpoints/step-000100  # checkpoint.resume; a requeued start continues from this " \
           "run's latest" in lines
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -f "$run_dir/checkpoints/latest" ]; then resume=auto; fi' \
           in lines
    assert "checkpoint.resume=/ckpt" not in script.split("srun ", 1)[1]  # only through $resume


@pytest.mark.parametrize("overrides, message", [
    (["launcher.nodes=0"], "launcher.nodes=0 must be >= 1"),
    (["launcher.nodes=1", "launcher.gpus_per_node=6", "mesh.tp=4"],
     "launcher.nodes=1 x launcher.gpus_per_node=6 = 6 ranks, but mesh.tp=4 x mesh.pp=1 = 4 does not divide 6"),
    (["launcher.nodes=2", "launcher.gpus_per_node=0", "launcher.nproc_per_node=2", "mesh.dp=3"],
     "launcher.nodes=2 x launcher.nproc_per_node=2 = 4 ranks, but mesh.tp=1 x mesh.pp=1 x mesh.dp=3 = 3"),
    (["launcher.gpus_per_node=8", "launcher.nproc_per_node=4"],
     "launcher.nproc_per_node=4 disagrees with launcher.gpus_per_node=8"),
    (["+launcher.env.WANDB_API_KEY=abc"], "launcher.env.WANDB_API_KEY has a value; secrets are passed by name"),
    (["launcher.max_requeues=-1"], "launcher.max_requeues=-1 must be >= 0"),
])
def test_bad_input_one_line_errors(overrides, message, capsys):
    code = main(["slurm", "recipe=tiny", "--dry-run", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.strip().count("\n") == 0


@pytest.mark.parametrize("command", ["show", "train"])
def test_secret_values_refused_by_every_command(command, capsys):
    """`qwenft train` and `show` write or print the config too: a secret's value never gets that far."""
    code = main([command, "recipe=tiny", "+launcher.env.db_password=hunter2"])
    captured = capsys.readouterr()
    assert code == 2 and "launcher.env.db_password has a value; secrets are passed by name only" in captured.err
    assert "hunter2" not in captured.out and captured.err.strip().count("\n") == 0


def test_missing_sbatch(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it: no sbatch
    code = main(["slurm", "recipe=tiny", "launcher.gpus_per_node=0", f"run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and "sbatch not found on PATH" in err, err
    assert err.strip().count("\n") == 0 and not (tmp_path / "run").exists()


def _fake_sbatch(directory, script: str) -> None:
    sbatch = directory / "sbatch"
    sbatch.write_text(f"#!/bin/sh\n{script}\n")
    sbatch.chmod(0o755)


def test_a_submission_leaves_a_run_dirs_config_as_its_run_wrote_it(tmp_path, capsys, monkeypatch):
    """`qwenft slurm` into a run dir that holds a run: its config.yaml (which a resume compares against and an
    export reads) stays as that run wrote it, whether sbatch fails or submits; a new run dir gets one after a
    submission, none after a failed one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("written by the run\n")
    args = ["slurm", "recipe=tiny", "launcher.gpus_per_node=0", "train.global_batch_size=4"]
    _fake_sbatch(bin_dir, "echo 'sbatch: error: Invalid account' >&2; exit 1")
    assert main([*args, f"run_dir={run_dir}"]) == 2 and "Invalid account" in capsys.readouterr().err
    assert (run_dir / "config.yaml").read_text() == "written by the run\n"
    assert main([*args, f"run_dir={tmp_path / 'new'}"]) == 2
    assert not (tmp_path / "new" / "config.yaml").exists()
    _fake_sbatch(bin_dir, "echo 123")
    assert main([*args, f"run_dir={run_dir}"]) == 0 and "submitted job 123" in capsys.readouterr().out
    assert (run_dir / "config.yaml").read_text() == "written by the run\n"
    assert main([*args, f"run_dir={tmp_path / 'new'}"]) == 0
    assert "global_batch_size: 4" in (tmp_path / "new" / "config.yaml").read_text()


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


SECRETS = {"HF_TOKEN": "hf_qwenft_test_secret_1", "WANDB_API_KEY": "wandb_qwenft_test_secret_2"}


@pytest.mark.distributed
@pytest.mark.slow
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
                         cwd=REPO, env={**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} world 4 sum 10" for r in range(4)], out.stdout


@pytest.mark.distributed
@pytest.mark.slow
def test_two_node_job_is_preempted_requeued_and_completes(cluster, tmp_path):
    """A 2-node job (one process a node). SIGUSR1 to the job's steps (what --signal=USR1@N sends before the time
    limit): the workers save a checkpoint and stop, the script requeues the job, and the second start resumes from
    that checkpoint and completes; metrics.jsonl covers every step. Also: secrets listed by name reach the job
    from the submitting shell (each start's setup line prints a hash of one) and no file in the run dir."""
    run_dir, max_steps = tmp_path / "run", 15  # signalled after step 3's checkpoint: 12 steps to spare
    start = time.monotonic()
    out = run_qwenft("slurm", "recipe=tiny", "launcher.nodes=2", "launcher.gpus_per_node=0",
                     "launcher.nproc_per_node=1", f"train.max_steps={max_steps}", "checkpoint.every_steps=3",
                     "checkpoint.export_hf=false", "data.seq_len=128", "model.kernels.gdn=torch",
                     "train.progress_bar=false", "launcher.env={HF_TOKEN: null, WANDB_API_KEY: null}",
                     "launcher.setup=['printenv HF_TOKEN | sha256sum']", f"run_dir={run_dir}",
                     env={**cluster.env, "OMP_NUM_THREADS": "1", **SECRETS}, timeout=300)
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)
    log = run_dir / f"slurm-{job_id}.out"
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "latest").exists():
        assert time.monotonic() < deadline and cluster.job_state(job_id)[0] in ("PENDING", "RUNNING"), \
            (log.read_text() if log.exists() else "") + cluster.logs()
        time.sleep(0.1)
    cluster.run("scancel", "--signal=USR1", job_id)  # the steps, not the batch shell: as --signal=USR1@N
    while "Restarts=1" not in cluster.run("scontrol", "-o", "show", "job", job_id):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.5)
    state = cluster.wait_job(job_id, timeout=180, release_held=True)
    text = log.read_text()
    assert state == ("COMPLETED", "0:0"), f"{state}\n{text[-4000:]}\n{cluster.logs()}"
    print(f"preempted 2-node job {job_id}: submit to COMPLETED in {time.monotonic() - start:.0f} s")
    stopped_at = int(re.search(r"qwenft: preempted \(step (\d+), SIGUSR1, checkpoint \S+\); requeueing job", text)[1])
    assert 3 <= stopped_at < max_steps and "restart 1, rendezvous" in text
    train_log = (run_dir / "train.log").read_text()
    assert f"continuing at step {stopped_at + 1}" in train_log
    assert "world 2 = pp 1 x dp 2 x tp 1" in train_log
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    assert {r["step"] for r in rows} == set(range(1, max_steps + 1)) and all(math.isfinite(r["loss"]) for r in rows)
    assert not (run_dir / "preempted").exists()
    assert (run_dir / "slurm.sh").exists() and "nodes: 2" in (run_dir / "config.yaml").read_text()
    assert "rendezvous 127.0.0.1:" in text  # the head node's NodeAddr, not its unresolvable name
    assert text.count(hashlib.sha256(SECRETS["HF_TOKEN"].encode() + b"\n").hexdigest()) == 2  # both starts have it
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert {"slurm.sh", "config.yaml", f"slurm-{job_id}.out", "train.log"} <= {p.name for p in files}
    for path in files:
        data = path.read_bytes()
        assert not any(value.encode() in data for value in SECRETS.values()), path


def test_slurm_launcher_option(capsys):
    script = _dry_run(capsys, "launcher=slurm", "launcher.partition=gpu", "mesh.tp=4")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --partition=gpu",
                 "#SBATCH --time=04:00:00", "export HF_TOKEN"):
        assert line in script.splitlines(), line
