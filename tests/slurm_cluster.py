"""A real SLURM cluster on this host for the tests: slurmctld plus two slurmds posing as nodes n1, n2.

Debian's `slurm-wlm` (22.05) is installed with apt-get when the daemons are missing (CI runs as root).
Everything lives under a temporary dir: slurm.conf, state, spool, logs, pid files. `AuthType=auth/none`
and `CredType=cred/none` need no munge key; each fake node is `slurmd -N nX` with its own port, all with
NodeAddr 127.0.0.1 (fake names don't resolve). Measured here: install 13 s, idle ~1 s after start.
"""

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from distributed import free_port

NODES = ("n1", "n2")


@dataclass
class SlurmCluster:
    root: Path
    env: dict  # os.environ plus SLURM_CONF: pass to every subprocess that talks to the cluster

    def run(self, *cmd: str, check: bool = True) -> str:
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
        return out.stdout

    def job_fields(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict; slurmctld keeps finished jobs for MinJobAge."""
        out = self.run("scontrol", "-o", "show", "job", job_id)
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def job_state(self, job_id: str) -> tuple[str, str]:
        fields = self.job_fields(job_id)
        return fields["JobState"], fields["ExitCode"]

    def wait_job(self, job_id: str, timeout: float, release_held: bool = False) -> tuple[str, str]:
        """Poll until the job ends: (JobState, ExitCode). release_held: start a job that SLURM holds back
        (a requeued job waits ~2 min for its BeginTime) at once."""
        deadline = time.monotonic() + timeout
        pending_since = None
        while True:
            state = self.job_state(job_id)
            pending_since = (pending_since or time.monotonic()) if state[0] == "PENDING" else None
            # Not at once: slurmd refuses a job credential created in the same second as the previous start's
            # revocation ("Job credential revoked") and the job FAILs; SLURM's own hold avoids that.
            if release_held and pending_since is not None and time.monotonic() - pending_since > 3:
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
            if state[0] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED"):
                return state
            if time.monotonic() > deadline:
                self.run("scancel", job_id, check=False)
                raise TimeoutError(f"job {job_id} still {state[0]} after {timeout:.0f} s")
            time.sleep(1)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))


def ensure_installed() -> str | None:
    """Install slurm-wlm if the daemons are missing; the reason it can't, or None."""
    if all(shutil.which(b) for b in ("slurmctld", "slurmd", "sbatch", "scontrol")):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm is not installed and apt-get as root is not available"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm"]):
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            return f"{' '.join(cmd)} failed: {out.stderr.strip().splitlines()[-1:]}"
    return None


def write_conf(root: Path) -> Path:
    host = socket.gethostname()
    cpus = os.cpu_count() or 1
    ctld_port = free_port()
    nodes = "\n".join(
        f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} CPUs={cpus} State=UNKNOWN"
        for n in NODES)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=qwenfttest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/jobcomp.txt
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
MinJobAge=600
KillWait=5
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    (root / "state").mkdir()
    return conf


def start(root: Path) -> tuple[SlurmCluster, list[subprocess.Popen]]:
    conf = write_conf(root)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs = [subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
                              stdout=subprocess.DEVNULL, stderr=open(root / "slurmctld.stderr.log", "w"))]
    for n in NODES:
        procs.append(subprocess.Popen(["slurmd", "-D", "-N", n, "-f", str(conf)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(root / f"slurmd-{n}.stderr.log", "w")))
    cluster = SlurmCluster(root, env)
    deadline = time.monotonic() + 30
    while True:
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        if len(states) == len(NODES) and all(s == "idle" for s in states.values()):
            return cluster, procs
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            stop(procs)
            raise RuntimeError(f"SLURM did not reach idle (sinfo: {states}); logs:\n{cluster.logs()}")
        time.sleep(0.5)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
