"""`qwenft slurm` against a real SLURM (slurmctld + two slurmds on this host): a 2-node job, a preempted job that
requeues itself and resumes, secrets kept out of every file; the script's key lines, the one-line errors, and
`env_from_slurm` inside a real srun step."""

import hashlib
import math
import re
import shlex
import subprocess
import sys
import time

import pytest

import slurm_cluster
from helpers import REPO, compose, read_metrics, run_qwenft
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
        "launcher.env={NCCL_DEBUG: WARN, HF_TOKEN: null}", "mesh.tp=2", "mesh.pp=2", "train.global_batch_size=32",
        f"run_dir={tmp_path}/run")
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
    assert f'run_dir={tmp_path}/run "checkpoint.resume=$resume" || status=$?' in script and "mesh.tp=2" in script
    assert "-m qwenft.launch.torchrun --nnodes" in script  # torchrun that leaves SIGUSR1 to the workers
    assert "# qwenft slurm: recipe tiny, 4 node(s) x 8 process(es) = world 32" in script
    assert not (tmp_path / "run").exists()  # a dry run writes nothing


def test_dry_run_cpu_nodes_and_defaults(capsys):
    script = _dry_run(capsys, "launcher.nodes=2", "launcher.gpus_per_node=0", "launcher.nproc_per_node=3",
                      "train.global_batch_size=12")
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
     "launcher.nproc_per_node=4 disagrees with launcher.gpus_per_node=8; on GPU nodes each GPU is one process"),
    # what `qwenft train` refuses at its start, for the job's world size
    (["launcher.gpus_per_node=0", "launcher.nodes=3"],
     "train.global_batch_size=8 is not a multiple of train.micro_batch_size=2 x dp=3 = 6 (the job: launcher.nodes=3 "
     "x launcher.nproc_per_node=1 = 3 ranks = pp 1 x dp 3 x tp 1)"),
    (["recipe=qwen3_5_27b_tp4pp4", "launcher.nodes=6", "data.path=/d"],
     "train.global_batch_size=32 is not a multiple of train.micro_batch_size=1 x dp=3 = 3 (the job: "
     "launcher.nodes=6 x launcher.gpus_per_node=8 = 48 ranks = pp 4 x dp 3 x tp 4)"),
    (["launcher.gpus_per_node=3", "mesh.tp=3", "train.global_batch_size=2"],
     "mesh.tp=3 does not divide num_attention_heads=4 (full attention query heads); valid mesh.tp: [1, 2]"),
    (["launcher.gpus_per_node=0", "model.name=bogus"], "model.name='bogus' "),
    (["launcher.gpus_per_node=2", "mesh.pp=2", "pipeline.layers_per_stage=[1,2]"],
     "pipeline.layers_per_stage=[1, 2] "),
    (["+launcher.env.NCCL-DEBUG=INFO"],
     "launcher.env.NCCL-DEBUG is not a shell variable name (the script exports it); valid: letters, digits and _, "
     "not starting with a digit ([A-Za-z_][A-Za-z0-9_]*)"),
    (["launcher.env={1BAD: x}"], "launcher.env.1BAD is not a shell variable name"),
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


def test_refused_before_anything_is_written_or_submitted(tmp_path, capsys, monkeypatch):
    """A config `qwenft train` would refuse at its start: no run dir, no script, no sbatch call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    _fake_sbatch(bin_dir, f"touch {tmp_path}/sbatch_ran; echo 123")
    code = main(["slurm", "recipe=tiny", "launcher.gpus_per_node=0", "launcher.nodes=3", f"run_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and "train.global_batch_size=8 is not a multiple" in err and err.strip().count("\n") == 0
    assert not (tmp_path / "run").exists() and not (tmp_path / "sbatch_ran").exists()


def test_gpu_nodes_run_one_process_per_gpu_whatever_the_recipes_nproc(capsys):
    """A recipe's launcher.nproc_per_node (8 in the big recipes) is for `qwenft train` on one machine: on GPU nodes
    the job runs launcher.gpus_per_node processes a node, with a note; nproc_per_node=1 on the command line is
    accepted, another value that disagrees refused (test_bad_input_one_line_errors)."""
    args = ["slurm", "recipe=qwen3_5_27b_tp4pp4", "launcher.nodes=4", "launcher.gpus_per_node=4", "data.path=/d",
            "--dry-run"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert "--nproc-per-node=4 " in out.out and "4 node(s) x 4 process(es) = world 16" in out.out
    assert "#SBATCH --gpus-per-node=4" in out.out.splitlines()
    assert out.err.strip() == ("qwenft: note: launcher.nproc_per_node=8 (the recipe's, for `qwenft train` on one "
                               "machine) is not used: on GPU nodes each GPU is one process, launcher.gpus_per_node=4")
    for same in ("launcher.nproc_per_node=4", "launcher.nproc_per_node=1"):
        assert main([*args, same]) == 0
        out = capsys.readouterr()
        assert "--nproc-per-node=4 " in out.out and out.err == ""


def test_model_path_not_on_this_machine_checks_the_rest(tmp_path, capsys):
    """model.path a container mounts (not readable where `qwenft slurm` runs): the batch split is still checked,
    the model's checks are left to the job's start, with a note."""
    code = main(["slurm", "recipe=tiny", "--dry-run", "launcher.gpus_per_node=0", "launcher.nodes=3",
                 f"model.path={tmp_path}/ckpt"])
    assert code == 2 and "train.global_batch_size=8 is not a multiple" in capsys.readouterr().err
    code = main(["slurm", "recipe=tiny", "--dry-run", "launcher.gpus_per_node=0", f"model.path={tmp_path}/ckpt"])
    err = capsys.readouterr().err
    assert code == 0 and err.strip() == (f"qwenft: note: model.path={tmp_path}/ckpt is not on this machine (a "
                                         f"container's mount?): the job checks the model against the mesh when it "
                                         f"starts")


def _run_script_with_bash(tmp_path, script: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """The batch script run by bash as the batch shell would (`set -euo pipefail` included), with srun and scontrol
    on the PATH that only record the command srun was given; that command's words."""
    bin_dir = tmp_path / "fake_slurm"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\0" "$@" > "$SRUN_ARGS"\n')
    (bin_dir / "scontrol").write_text('#!/bin/sh\n[ "$2" = node ] && echo "NodeAddr=127.0.0.1" || echo n1\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "n1",
           "SLURM_JOB_NUM_NODES": "1", "SRUN_ARGS": str(tmp_path / "srun_args")}
    out = subprocess.run(["bash", str(tmp_path / "job.sh")], env=env, capture_output=True, text=True, timeout=60)
    words = (tmp_path / "srun_args").read_bytes().decode().split("\0")[:-1] if out.returncode == 0 else []
    return out, words


@pytest.mark.parametrize("user_run_dir", [False, True])
def test_paths_with_spaces_and_parentheses_reach_train_as_typed(user_run_dir, tmp_path, capsys, monkeypatch):
    """Submitted from `proj (copy) #2 100%`: the #SBATCH paths are quoted for sbatch (% as %%, # escaped), and the
    train command, as bash runs the script and Hydra composes what srun gets, has the run dir and checkpoint.resume
    the user meant; launcher.setup runs after set -euo pipefail, with an unset variable allowed."""
    workdir = tmp_path / "proj (copy) #2 100%"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    resume = f"{tmp_path}/ck pt (1)/it's step-000100"
    args = ["launcher.gpus_per_node=0", "checkpoint.resume='" + resume.replace("'", "\\'") + "'",
            "launcher.setup=['echo \"setup saw <$QWENFT_TEST_UNSET>\"']", "train.max_steps=3"]
    if user_run_dir:
        args.append(f"run_dir='{tmp_path}/runs (a)/r1'")
    script = _dry_run(capsys, *args)
    lines = script.splitlines()
    run_dir = (f"{tmp_path}/runs (a)/r1" if user_run_dir else
               re.search(r"^run_dir='(.*)'$", script, re.M).group(1))
    if not user_run_dir:
        assert run_dir.startswith(f"{workdir}/outputs/tiny/")
    escaped = {"#": "\\#", "%": "%%"}  # sbatch: an unescaped # may end the option; --output expands %
    assert '#SBATCH --chdir="' + str(workdir).replace("#", escaped["#"]) + '"' in lines
    output = run_dir.replace("#", escaped["#"]).replace("%", escaped["%"])
    assert f'#SBATCH --output="{output}/slurm-%j.out"' in lines
    assert lines.index("set -euo pipefail") < lines.index("set +u") < lines.index(
        'echo "setup saw <$QWENFT_TEST_UNSET>"') < lines.index("set -u")

    out, words = _run_script_with_bash(tmp_path, script)
    assert out.returncode == 0 and "setup saw <>" in out.stdout, out.stderr
    train_args = words[words.index("train") + 1:]
    cfg = compose(train_args)
    assert cfg.run_dir == run_dir and cfg.checkpoint.resume == resume and cfg.train.max_steps == 3
    assert sum(w.startswith("run_dir=") for w in train_args) == 1


def test_docs_command_line_examples_parse():
    """The `launcher.*=...` overrides docs/slurm.md shows inline (the fenced commands are run by
    test_documented_commands) compose as written, shell quotes included."""
    text = (REPO / "docs" / "slurm.md").read_text()
    spans = [s for s in re.findall(r"`([\"']?\+?launcher\.[\w.]+=[^`]*)`", text)
             if not re.search(r"[<…]|=[A-Z]$", s)]
    assert len(spans) >= 6, spans
    for span in spans:
        compose(["recipe=tiny", *shlex.split(span)], missing_ok=True)


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
    submission, and a failed one leaves no dir or script behind."""
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
    assert not (run_dir / "slurm.sh").exists()
    (run_dir / "slurm.sh").write_text("# the earlier job's script\n")
    assert main([*args, f"run_dir={run_dir}"]) == 2
    assert (run_dir / "slurm.sh").read_text() == "# the earlier job's script\n"
    assert main([*args, f"run_dir={tmp_path / 'new' / 'deeper'}"]) == 2
    assert not (tmp_path / "new").exists()  # no dir it made stays behind
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


@pytest.mark.distributed
@pytest.mark.slow
def test_job_submitted_from_a_dir_with_spaces_parentheses_hash_and_percent(cluster, tmp_path):
    """The real sbatch reads the quoted #SBATCH --chdir and --output (its log lands in the run dir), the job's
    setup sources a script that reads an unset variable (as `conda activate` does) under set -u, and the train
    command trains into the run dir under that awkward path."""
    workdir = tmp_path / "proj (copy) #2 100%"
    workdir.mkdir()
    (workdir / "activate.sh").write_text('echo "setup saw <$QWENFT_TEST_UNSET>"\n')
    out = run_qwenft("slurm", "recipe=tiny", "launcher.gpus_per_node=0", "train.max_steps=2",
                     "checkpoint.export_hf=false", "data.seq_len=128", "model.kernels.gdn=torch",
                     "train.progress_bar=false", "launcher.setup=['. ./activate.sh']",
                     env={**cluster.env, "OMP_NUM_THREADS": "1"}, cwd=workdir, timeout=120)
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"submitted job (\d+)", out.stdout).group(1)
    state = cluster.wait_job(job_id, timeout=180)
    [run_dir] = (workdir / "outputs" / "tiny").iterdir()
    log = run_dir / f"slurm-{job_id}.out"
    assert state == ("COMPLETED", "0:0"), (log.read_text()[-4000:] if log.exists() else "") + cluster.logs()
    assert "setup saw <>" in log.read_text()
    assert f"run dir {run_dir}" in (run_dir / "train.log").read_text()
    assert [r["step"] for r in read_metrics(run_dir) if "loss" in r] == [1, 2]


def test_slurm_launcher_option(capsys):
    script = _dry_run(capsys, "launcher=slurm", "launcher.partition=gpu", "mesh.tp=2", "train.global_batch_size=16")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --partition=gpu",
                 "#SBATCH --time=04:00:00", "export HF_TOKEN"):
        assert line in script.splitlines(), line
