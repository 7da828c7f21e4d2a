"""The GPU tier: every test under tests/gpu needs CUDA, carries the `gpu` marker, and is skipped without CUDA
(CI's CPU box), so `python -m pytest -q tests` passes there and runs this tier on a GPU box."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (the GPU tier, tests/gpu)")
