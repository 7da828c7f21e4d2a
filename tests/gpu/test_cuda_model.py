"""The tiny model on CUDA against the same weights on the CPU (fp32)."""

import pytest
import torch

from helpers import rel_err
from qwenft.models.loader import build_model, init_random_weights
from qwenft.models.qwen3_5.configs import named_config

pytestmark = pytest.mark.gpu


def test_tiny_forward_on_cuda_equals_cpu():
    """A row of two packed documents through the tiny model (3 GatedDeltaNet layers, 1 attention layer; torch
    kernels, SDPA): CUDA's logits within 1e-4 of the CPU's. fp32 on both; torch's CUDA matmuls default to
    full fp32, not TF32."""
    cfg = named_config("tiny")
    cpu, cuda = (init_random_weights(build_model(cfg, kernels="torch"), seed=0, device="cpu", dtype=torch.float32)
                 for _ in range(2))
    cuda.to("cuda")
    ids = torch.randint(0, cfg.text.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
    cu_seqlens = torch.tensor([0, 70, 128], dtype=torch.int32)  # the first document crosses a GDN chunk (64)
    with torch.no_grad():
        ref = cpu(input_ids=ids, cu_seqlens=cu_seqlens)
        out = cuda(input_ids=ids.cuda(), cu_seqlens=cu_seqlens.cuda())
    assert out.device.type == "cuda"
    assert rel_err(out.cpu(), ref) < 1e-4
