"""qwenft.transfer.copy_to_device on the CPU (the pinned, asynchronous GPU path runs in the GPU tier
through every microbatch)."""

import torch

from qwenft.transfer import copy_to_device


def test_copy_to_device_is_a_new_tensor_only_when_asked_on_the_cpu():
    """A host tensor stays itself on the CPU unless `fresh` (the step's token count, which an all-reduce then
    sums in place, must not change the host count the loss's factor comes from)."""
    count = torch.tensor([6712])
    assert copy_to_device(count, "cpu") is count
    summed = copy_to_device(count, torch.device("cpu"), fresh=True)
    summed += 1
    assert count.item() == 6712 and summed.item() == 6713
