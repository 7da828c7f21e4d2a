"""Where a run lives and how it reports: its directory (agreed by every rank, locked for the run's life), the
`qwenft` logger and train.log, CPU thread counts, and user faults as one line naming the key or file
(`input_file`, `on_rank0`)."""

import logging
import os
import tempfile
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from qwenft.conf.schema import Config
from qwenft.launch import run_lock

log = logging.getLogger("qwenft")


def describe(e: Exception) -> str:
    """An exception as the rest of one line: a file fault names its file."""
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.strerror or type(e).__name__}: {e.filename}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


@contextmanager
def input_file(key: str, value, hint: str | None = None):
    """A missing, unreadable or corrupt file behind `key=value` as one ValueError naming both and, with `hint`
    (else the error says it), what to do."""
    try:
        yield
    except (OSError, ValueError) as e:
        raise ValueError(f"{key}={value}: {describe(e)}" + (f"; {hint}" if hint else "")) from e


def on_rank0(is_main: bool, fn: Callable[[], None]) -> None:
    """Run `fn` on rank 0 only, and raise its user fault (ValueError, OSError) on every rank: no rank waits in a
    collective for one that has stopped, and each exits with the same code (rank 0 alone prints the line)."""
    error, failure = [None], None
    if is_main:
        try:
            fn()
        except (ValueError, OSError) as e:
            error, failure = [describe(e)], e
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(error, src=0)
    if failure is not None:
        raise failure
    if error[0] is not None:
        raise ValueError(error[0])


def default_run_dir(recipe: str) -> str:
    return str(Path("outputs") / recipe / datetime.now().strftime("%Y%m%d-%H%M%S"))


def agree_run_dir(cfg: Config) -> Path:
    """Every rank must write to the same dir; rank 0's timestamp wins."""
    choice = [cfg.run_dir or default_run_dir(cfg.recipe)]
    dist.broadcast_object_list(choice, src=0)
    return Path(choice[0])


def cpu_threads(cores: int, ranks_on_node: int, load: float) -> int:
    """Intra-op threads for a CPU run: this rank's share of the cores not already busy. torch's default (every
    core) degrades badly when another process holds one: the tiny recipe on 2 cores with one busy neighbour took
    20-80 s a step with 2 threads, about 2 s with 1 (0.45 s with both cores free)."""
    share = max(1, cores // ranks_on_node)
    free = max(0.0, cores - load)
    return max(1, min(share, round(free / ranks_on_node)))


# the environment variables that place each kernel compiler's cache, by the subdirectory of
# model.kernels.cache_dir it gets; each library reads its variable when it first compiles
KERNEL_CACHES = {"inductor": "TORCHINDUCTOR_CACHE_DIR", "triton": "TRITON_CACHE_DIR", "tilelang": "TILELANG_CACHE_DIR"}


def set_kernel_caches(cache_dir: str | None) -> str:
    """Point inductor's, Triton's and TileLang's caches at subdirectories of `cache_dir` (model.kernels.cache_dir),
    before anything compiles; returns the log line. None leaves each library's own default (or the user's
    variables) in place."""
    if cache_dir is None:
        places = ", ".join(f"{name} {os.environ[var]}" for name, var in KERNEL_CACHES.items() if var in os.environ)
        return ("kernel caches: each library's default" + (f" but {places} (environment)" if places else "")
                + "; model.kernels.cache_dir=DIR keeps them for the next run")
    root = Path(cache_dir).expanduser().resolve()
    for name, var in KERNEL_CACHES.items():
        try:
            (root / name).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"model.kernels.cache_dir={cache_dir}: cannot make {root / name} ({e.strerror}); "
                             f"give a writable directory, or null for each library's default") from None
        os.environ[var] = str(root / name)
    return f"kernel caches: {root}/{{{','.join(KERNEL_CACHES)}}} (model.kernels.cache_dir)"


def set_cpu_threads() -> None:
    """On a CPU run, unless OMP_NUM_THREADS says, set torch's thread count by `cpu_threads` and log the choice."""
    if "OMP_NUM_THREADS" in os.environ:
        log.info("cpu threads: %d (OMP_NUM_THREADS)", torch.get_num_threads())
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = cpu_threads(cores, ranks, load)
    torch.set_num_threads(threads)
    log.info("cpu threads: %d (%d cores, %d rank(s) on this node, load %.1f; set OMP_NUM_THREADS to choose)",
             threads, cores, ranks, load)


def make_run_dir(run_dir: Path, cleanup: ExitStack | None) -> None:
    """Create (or check) the run dir and lock it for this run; `cleanup` releases the lock at the run's end (without
    one, the process's exit does)."""
    hint = "give a directory qwenft may create or write to as run_dir"
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run_dir={run_dir} is a file, not a directory; {hint}")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=run_dir):  # mkdir succeeds on an existing read-only dir
            pass
    except OSError as e:
        raise ValueError(f"run_dir={run_dir} cannot be written ({describe(e)}); {hint}") from e
    lock = run_lock.acquire(run_dir)
    if cleanup is not None:
        cleanup.callback(lock.release)


def refuse_fresh_start_over_checkpoints(run_dir: Path, resume_from: Path | None, resume: str) -> None:
    """checkpoint.resume=none in a run dir with checkpoints is refused, and so is a resume from another run dir's
    checkpoint there: the new run's checkpoints would join the
    earlier run's in checkpoints/, and `checkpoint.keep` would rotate them against each other (a step-000010 of the
    new run goes before the earlier run's step-000100). An earlier run's metrics.jsonl alone is kept aside instead
    (MetricsLogger), and a resumed run cuts it back to its checkpoint's step."""
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir())
    if resume_from is not None and checkpoints and resume_from.resolve().parent != (run_dir / "checkpoints").resolve():
        raise ValueError(f"run_dir={run_dir} holds its own checkpoints ({', '.join(checkpoints)}) and "
                         f"checkpoint.resume={resume} is another run's: the two runs' checkpoints would mix; resume "
                         f"it in a new run_dir, or resume this one from its own (checkpoint.resume=auto)")
    if resume_from is None and checkpoints:
        raise ValueError(f"run_dir={run_dir} holds an earlier run's checkpoints ({', '.join(checkpoints)}) and "
                         f"checkpoint.resume={resume} starts afresh: the two runs' checkpoints would mix; resume with "
                         f"checkpoint.resume=auto, give a new run_dir, or delete {run_dir / 'checkpoints'} to start "
                         f"over in it")


def setup_logging(run_dir: Path, is_main: bool, progress_bar: bool) -> None:
    """The `qwenft` logger: console and (rank 0) run_dir/train.log. Its child `qwenft.steps` carries the
    per-step lines: to train.log always, to the console only without the progress bar (which shows them)."""
    steps = logging.getLogger("qwenft.steps")
    for logger in (log, steps):
        logger.setLevel(logging.INFO if is_main else logging.WARNING)
        for handler in logger.handlers:  # an earlier run in this process (tests) left its log file open
            handler.close()
        logger.handlers.clear()
    log.propagate = False
    steps.propagate = not progress_bar
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S")
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    log.addHandler(console)
    if is_main:
        file = logging.FileHandler(run_dir / "train.log")
        file.setFormatter(fmt)
        log.addHandler(file)
        if progress_bar:
            steps.addHandler(file)
