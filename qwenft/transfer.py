"""Tensors between host and device without making the host wait for more of the GPU's work than it needs."""

from collections.abc import Callable

import torch


def copy_to_device(t: torch.Tensor, device, fresh: bool = False) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, asynchronously: a copy from pageable memory
    makes the host wait for the GPU. `fresh`: a new tensor even where none is needed (the CPU), for a collective
    that works in place."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device, copy=fresh)
    return t.pin_memory().to(device, non_blocking=True)


def read_later(tensors: list[torch.Tensor]) -> Callable[[], list[float]]:
    """The values of 1-element tensors, copied to the host as one float64 row now (in the stream's order) and
    read by calling the returned function, which waits for that copy alone: work queued after this call (an
    optimizer step) keeps running on the GPU while the host goes on. float64 holds an fp32 value or an integer
    count below 2^53 exactly."""
    row = torch.stack([t.reshape(()).to(torch.float64) for t in tensors])
    if row.device.type != "cuda":
        values = row.tolist()
        return lambda: values
    host = torch.empty(row.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(row, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(row.device))

    def wait() -> list[float]:
        copied.synchronize()
        return host.tolist()
    return wait
