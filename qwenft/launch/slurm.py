"""SLURM: the sbatch script `qwenft slurm` submits (a hand-written srun's environment mapping is
qwenft.distributed.slurm_env).

The script runs one task per node; `srun` starts torchrun on every node, and the torchruns meet by c10d
rendezvous on the first node's address. That address is the first node's NodeAddr from `scontrol show
node`, not its name: node names need not resolve (they don't on test clusters with fake nodes).

Preemption (docs/slurm.md): `--signal=USR1@N` sends SIGUSR1 to every process of the srun step N seconds before
the time limit; the workers save a checkpoint and write `<run_dir>/preempted` (qwenft/launch/signals.py), and
the script, once srun has returned, requeues the job, which resumes from `latest` in the same run dir.
"""

import os
import re
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING, Mapping

from qwenft.conf.layout import Layout, resolve_layout
from qwenft.conf.schema import MASTER_PORT_BASE
from qwenft.launch.overrides import hydra_value, sets, without
from qwenft.launch.signals import EXIT_PREEMPTED, MARKER

if TYPE_CHECKING:
    from qwenft.conf.schema import Config

SHUTDOWN_TIMEOUT = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # what `export NAME` takes: a shell variable name


def procs_per_node(cfg: "Config", overrides: list[str]) -> int:
    """Processes per node: one per GPU (launcher.gpus_per_node), or launcher.nproc_per_node on CPU nodes
    (gpus_per_node=0). On GPU nodes a recipe's nproc_per_node is for `qwenft train` on one machine and is not used
    (`ignored_nproc`); one given on the command line must agree with gpus_per_node (or be 1, the default)."""
    launcher = cfg.launcher
    if launcher.gpus_per_node == 0:
        return launcher.nproc_per_node
    if sets(overrides, "launcher.nproc_per_node") and launcher.nproc_per_node not in (1, launcher.gpus_per_node):
        raise ValueError(
            f"launcher.nproc_per_node={launcher.nproc_per_node} disagrees with launcher.gpus_per_node="
            f"{launcher.gpus_per_node}; on GPU nodes each GPU is one process: drop launcher.nproc_per_node, or set "
            f"launcher.gpus_per_node={launcher.nproc_per_node}")
    return launcher.gpus_per_node


def ignored_nproc(cfg: "Config", overrides: list[str]) -> str | None:
    """The note for a recipe's launcher.nproc_per_node that a GPU job does not use (it differs from gpus_per_node)."""
    launcher = cfg.launcher
    if (launcher.gpus_per_node == 0 or launcher.nproc_per_node in (1, launcher.gpus_per_node)
            or sets(overrides, "launcher.nproc_per_node")):
        return None
    return (f"launcher.nproc_per_node={launcher.nproc_per_node} (the recipe's, for `qwenft train` on one machine) "
            f"is not used: on GPU nodes each GPU is one process, launcher.gpus_per_node={launcher.gpus_per_node}")


def ranks(cfg: "Config", overrides: list[str]) -> tuple[int, str]:
    """The job's world size, and where it comes from for an error: `launcher.nodes=2 x launcher.gpus_per_node=8 =
    16 ranks`."""
    launcher = cfg.launcher
    procs = procs_per_node(cfg, overrides)
    world = launcher.nodes * procs
    per_node = (f"launcher.gpus_per_node={procs}" if launcher.gpus_per_node
                else f"launcher.nproc_per_node={procs}")
    return world, f"launcher.nodes={launcher.nodes} x {per_node} = {world} ranks"


def check(cfg: "Config", overrides: list[str]) -> Layout:
    """The job's layout; raises ValueError (one line) for launcher keys the script cannot carry out and for a mesh
    that can't fill the job. What `qwenft train` checks at its start on that layout (batching, the model's head
    counts, ...) is qwenft.cli's to run: this package does not import qwenft.train."""
    for name in cfg.launcher.env or {}:
        if not ENV_NAME.fullmatch(str(name)):
            raise ValueError(f"launcher.env.{name} is not a shell variable name (the script exports it); valid: "
                             f"letters, digits and _, not starting with a digit ([A-Za-z_][A-Za-z0-9_]*)")
    world, where = ranks(cfg, overrides)
    mesh = cfg.mesh
    return resolve_layout(mesh.tp, mesh.pp, mesh.dp, world, ranks=where, ep=mesh.ep, cp=mesh.cp)


def _sbatch_value(value: str) -> str:
    """A value as an #SBATCH line carries it: sbatch splits the line at whitespace outside quotes (double quotes
    in every version, single quotes too in later ones), takes a backslash as an escape, inside quotes too, and a
    `#` as the start of a comment (older versions even inside quotes): slurm's opt.c:_get_argument."""
    if not re.search(r"[\s\"'\\#]", value):
        return value
    return '"' + re.sub(r'(["\\#])', r"\\\1", value) + '"'


def render(cfg: "Config", overrides: list[str], run_dir: str, workdir: str) -> str:
    """The sbatch script. `overrides` are the user's, passed on to `qwenft train` with run_dir fixed and
    checkpoint.resume=auto on a requeued start, so a requeued job resumes from the same dir's `latest`."""
    launcher = cfg.launcher
    procs = procs_per_node(cfg, overrides)
    world = check(cfg, overrides).world_size
    python = launcher.python or ("python" if launcher.container_image else sys.executable)
    q = shlex.quote

    sbatch = [f"--job-name={_sbatch_value(launcher.job_name or 'qwenft-' + cfg.recipe)}",
              f"--nodes={launcher.nodes}", "--ntasks-per-node=1"]
    if launcher.gpus_per_node:
        sbatch.append(f"--gpus-per-node={launcher.gpus_per_node}")
    for key in ("cpus_per_task", "partition", "account", "qos", "time"):
        value = getattr(launcher, key)
        if value is not None:
            sbatch.append(f"--{key.replace('_', '-')}={_sbatch_value(str(value))}")
    # --output expands %j (the job id); a % of the path is written %%
    output = _sbatch_value(run_dir.replace("%", "%%") + "/slurm-%j.out")
    sbatch += [f"--chdir={_sbatch_value(workdir)}", f"--output={output}", "--open-mode=append",
               "--export=ALL", f"--signal=USR1@{launcher.signal_seconds}"]
    sbatch.append("--requeue" if launcher.requeue else "--no-requeue")
    sbatch += list(launcher.sbatch_extra)

    lines = ["#!/bin/bash",
             f"# qwenft slurm: recipe {cfg.recipe}, {launcher.nodes} node(s) x {procs} process(es) = world "
             f"{world}; written by `qwenft slurm`, see docs/slurm.md"]
    lines += [f"#SBATCH {option}" for option in sbatch]
    lines += ["set -euo pipefail", ""]
    env = launcher.env or {}
    if env:
        lines.append("# launcher.env; names without a value come from the submitting shell (--export=ALL)")
        for name, value in env.items():
            lines.append(f"export {name}" if value is None else f"export {name}={q(str(value))}")
        lines.append("")
    if SHUTDOWN_TIMEOUT not in env:
        lines += ["# how long torchrun lets its workers save after it forwards a SIGTERM (torch 2.11 ignores it: 30 s)",
                  f"export {SHUTDOWN_TIMEOUT}={launcher.signal_seconds}", ""]
    if launcher.setup:
        lines += ["# launcher.setup, with unset variables allowed (set +u): `conda activate` and some `module load`",
                  "# scripts read variables that may be unset, which set -u would make fatal",
                  "set +u", *launcher.setup, "set -u", ""]
    port = launcher.master_port or f"$(({MASTER_PORT_BASE} + SLURM_JOB_ID % {MASTER_PORT_BASE}))"
    lines += [
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "# node names need not resolve; SLURM knows each node's address",
        'head_addr=$(scontrol show node "$head_node" | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')',
        'head_addr=${head_addr:-$head_node}',
        f"port={port}",
        'echo "qwenft: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}, '
        'rendezvous $head_addr:$port"',
        f"run_dir={q(run_dir)}",
        *_resume_lines(cfg.checkpoint.resume),
        "",
        "# --signal sends SIGUSR1 to the srun step (torchrun ignores it, the workers save and stop); this shell",
        "# only sees it from `scancel --signal=USR1 --full` or a B: signal, and must not die of it",
        "trap 'echo \"qwenft: SIGUSR1 reached the batch shell (ignored; the workers act on their own)\"' USR1",
        f'rm -f "$run_dir/{MARKER}"  # an earlier start\'s: only this start\'s preemption requeues the job',
        "",
    ]
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if launcher.cpus_per_task is not None:  # srun stopped inheriting sbatch's --cpus-per-task in 22.05
        srun.append(f"--cpus-per-task={launcher.cpus_per_task}")
    if launcher.container_image:
        srun += [f"--container-image={q(launcher.container_image)}", f"--container-workdir={q(workdir)}"]
        if launcher.container_mounts:
            srun.append(f"--container-mounts={q(','.join(launcher.container_mounts))}")
    torchrun = [q(python), "-m", "qwenft.launch.torchrun", '--nnodes="$SLURM_JOB_NUM_NODES"',
                f"--nproc-per-node={procs}", "--rdzv-backend=c10d", '--rdzv-endpoint="$head_addr:$port"',
                '--rdzv-id="$SLURM_JOB_ID"', "--max-restarts=0"]
    # run_dir as Hydra reads it (quoted where it holds spaces, parentheses, quotes); $resume is written so too
    train = ["-m", "qwenft", "train", *(q(o) for o in without(overrides, "run_dir", "checkpoint.resume")),
             q(f"run_dir={hydra_value(run_dir)}"), '"checkpoint.resume=$resume"']
    lines.append("status=0")
    lines.append(" \\\n    ".join([" ".join(srun), " ".join(torchrun), " ".join(train)]) + " || status=$?")
    lines += [
        "# torchrun exits 1 when its workers stopped on a signal; the marker they write tells it from a failure",
        f'if [ -f "$run_dir/{MARKER}" ]; then',
        *([f'  if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {launcher.max_requeues} ]; then',
           f'    echo "qwenft: preempted ($(cat "$run_dir/{MARKER}")); requeueing job $SLURM_JOB_ID"',
           '    scontrol requeue "$SLURM_JOB_ID"',
           "    exit 0",
           "  fi",
           f'  echo "qwenft: preempted; not requeueing after ${{SLURM_RESTART_COUNT:-0}} restarts '
           f'(launcher.max_requeues={launcher.max_requeues})"'] if launcher.requeue else
          ['  echo "qwenft: preempted; not requeueing (launcher.requeue=false)"']),
        f"  exit {EXIT_PREEMPTED}",
        "fi",
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"


def _resume_lines(resume: str) -> list[str]:
    """`resume=...` for the train command: the user's checkpoint.resume (as a Hydra value) on the first start,
    this run's own `latest` once the job was requeued (when it has one)."""
    if resume == "auto":
        return ["resume=auto"]
    return [f"resume={shlex.quote(hydra_value(resume))}  # checkpoint.resume; a requeued start continues from this "
            f"run's latest",
            'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && [ -f "$run_dir/checkpoints/latest" ]; then resume=auto; fi']


def missing_secrets(cfg: "Config", environ: Mapping[str, str] | None = None) -> list[str]:
    """launcher.env names passed by name that the submitting shell doesn't have."""
    environ = os.environ if environ is None else environ
    return [name for name, value in (cfg.launcher.env or {}).items() if value is None and name not in environ]


def submit(script_path: str) -> str:
    """sbatch the script (the caller has checked that sbatch is on the PATH); the job id."""
    out = subprocess.run(["sbatch", "--parsable", script_path], capture_output=True, text=True)
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
        raise ValueError(f"sbatch {script_path} failed: {reason}")
    return out.stdout.strip().split(";")[0]
