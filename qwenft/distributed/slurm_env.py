"""torch.distributed's environment for a process that `srun` started as one rank, without torchrun."""

import os
import re
import subprocess
from typing import Mapping

from qwenft.conf.schema import MASTER_PORT_BASE


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[003-010,012],cpu1' -> 'gpu003'."""
    prefix, ranges, suffix = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,\[]*)", nodelist).groups()
    return prefix + (re.split(r"[-,]", ranges)[0] if ranges else "") + suffix


def node_address(name: str) -> str:
    """The NodeAddr SLURM has for a node (names need not resolve); the name itself without scontrol."""
    try:
        out = subprocess.run(["scontrol", "show", "node", name], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return name
    match = re.search(r"NodeAddr=(\S+)", out.stdout)
    return match.group(1) if match else name


def env_from_slurm(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch.distributed variables for a process that `srun` started as one rank (no torchrun).

    Applies only inside a job step (SLURM_STEP_ID and SLURM_PROCID set) when RANK and WORLD_SIZE are not set
    (torchrun sets them, and then they win). Maps RANK <- SLURM_PROCID, WORLD_SIZE <- SLURM_STEP_NUM_TASKS,
    LOCAL_RANK <- SLURM_LOCALID; MASTER_ADDR <- NodeAddr of the step's first node (SLURM_STEP_NODELIST),
    MASTER_PORT <- 20000 + SLURM_JOB_ID % 20000; MASTER_ADDR / MASTER_PORT already set are kept. The batch
    shell itself has no SLURM_STEP_ID: a plain `qwenft train` there stays a single process.
    """
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env or "RANK" in env or "WORLD_SIZE" in env:
        return {}
    world = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))
    mapped = {"RANK": env["SLURM_PROCID"], "WORLD_SIZE": world, "LOCAL_RANK": env.get("SLURM_LOCALID", "0")}
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
        mapped["MASTER_ADDR"] = node_address(first_host(nodelist)) if nodelist else "127.0.0.1"
    if "MASTER_PORT" not in env:
        mapped["MASTER_PORT"] = str(MASTER_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % MASTER_PORT_BASE)
    return mapped
