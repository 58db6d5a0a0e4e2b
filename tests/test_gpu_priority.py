"""Loader CUDA streams run at the device's highest priority, so training kernels do not starve them.

The loader's kernels run inside a transform on the reader's stream: a transform that notes the
current stream's priority sees what every kernel of the batch was queued with.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from threadloader import BatchDecoder, ThreadLoader
from threadloader.transforms import Transform

from .conftest import encode, photo

pytestmark = pytest.mark.gpu


class _NotePriority(Transform):
    """Identity that records the priority of the CUDA stream its kernels would be queued on."""

    def __init__(self) -> None:
        self.priorities: list[int] = []

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        self.priorities.append(torch.cuda.current_stream(images.device).priority)
        return images


def _highest() -> int:
    highest = torch.cuda.Stream.priority_range()[1]  # (least, greatest); lower is higher
    assert highest < torch.cuda.current_stream().priority, "device offers no priority above the default"
    return highest


def test_loader_kernels_run_on_highest_priority_streams() -> None:
    note = _NotePriority()
    samples = [(encode(photo(64, 80, seed=i), quality=90), i) for i in range(12)]
    with ThreadLoader(samples, batch_size=4, device="cuda", num_threads=2, transform=note) as loader:
        batches = list(loader)
    assert len(batches) == 3
    assert note.priorities, "the transform never ran"
    assert set(note.priorities) == {_highest()}


def test_batch_decoder_kernels_run_on_highest_priority_streams() -> None:
    note = _NotePriority()
    with BatchDecoder(device="cuda", max_batch=4, transform=note) as decoder:
        decoder.decode(encode(photo(64, 80), quality=90))
    assert note.priorities, "the transform never ran"
    assert set(note.priorities) == {_highest()}
