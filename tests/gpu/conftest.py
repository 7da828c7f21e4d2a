"""The GPU tier: every test under tests/gpu needs CUDA, carries the `gpu` marker, and is skipped without CUDA
(CI's CPU box), so `python -m pytest -q tests` passes there and runs this tier on a GPU box.

Its training runs go through qwenft's runner in the pytest process (helpers.train_alone, or inside
qwenft.distributed.fake_pg.fake_process_group), never in tests/distributed.py's forked ranks: a process forked
after its parent initialised CUDA cannot use CUDA.

Every test here has a time limit (pytest-timeout, in the `test` extra and the GPU image): `TIMEOUT_S`, or its own
`@pytest.mark.timeout(...)` where a cold machine's kernel compilation needs more. A test past its limit fails
with pytest-timeout's message and the session goes on to the next test, so a slow compile costs one test, not
the whole call. The limit arrives as SIGALRM (method "signal"), which qwenft's runner does not take for a
preemption (SIGTERM and SIGUSR1 are its signals: a plain `timeout` around pytest would make a training test
save a checkpoint and stop, so scripts kill with `timeout -s KILL` as the last resort). Without the plugin the
marks do nothing."""

from pathlib import Path

import pytest
import torch

# A test's own limit on a fresh machine, which compiles Triton's and inductor's kernels in the first test of each
# shape (about a minute for the tiny model's compiled layers).
TIMEOUT_S = 150
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _HERE in Path(item.path).resolve().parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT_S, method="signal"))


@pytest.fixture(autouse=True)
def _needs_cuda(request):
    # a module whose RUNS_ON_CPU is true runs without CUDA (test_multi_gpu.py's dry run on gloo)
    if not torch.cuda.is_available() and not getattr(request.module, "RUNS_ON_CPU", False):
        pytest.skip("needs CUDA (the GPU tier, tests/gpu)")
