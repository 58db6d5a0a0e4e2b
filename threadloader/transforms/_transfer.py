"""Small host tensors (per-image parameters) copied to the GPU without waiting for the stream."""

from __future__ import annotations

import torch

__all__ = ["to_device"]


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copies a small host tensor to ``device`` without waiting for the stream.

    Through pinned memory from torch's host cache, which keeps it until the copy has run; a pageable
    copy would wait. Staged by hand: ``Tensor.pin_memory()`` first asks the driver whether the tensor is
    pinned already, a driver call per copy (its cost: docs/benchmarks.md).
    """
    if device.type == "cpu":
        return values
    staged = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=True).copy_(values)
    return staged.to(device, non_blocking=True)
