"""Host tensors to the device without making the host wait for the GPU."""

import torch


def copy_to_device(t: torch.Tensor, device, fresh: bool = False) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, asynchronously: a copy from pageable memory
    makes the host wait for the GPU. `fresh`: a new tensor even where none is needed (the CPU), for a collective
    that works in place."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device, copy=fresh)
    return t.pin_memory().to(device, non_blocking=True)
