"""The GPU tier: every test under tests/gpu needs CUDA, carries the `gpu` marker, and is skipped without CUDA
(CI's CPU box), so `python -m pytest -q tests` passes there and runs this tier on a GPU box.

Its training runs go through qwenft's runner in the pytest process (helpers.train_alone, or inside
qwenft.distributed.fake_pg.fake_process_group), never in tests/distributed.py's forked ranks: a process forked
after its parent initialised CUDA cannot use CUDA."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the GPU tier, tests/gpu)")
