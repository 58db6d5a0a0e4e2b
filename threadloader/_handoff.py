"""Handing a finished batch from a reader thread's CUDA stream to the consumer's, without a host sync.

The reader queues its work on its own stream and records an event after the last kernel. The consumer
makes its current stream wait on that event (a device-side wait: the host does not block, and unlike
``wait_stream`` it does not wait for work the reader queued later), then calls ``record_stream`` on
every tensor it receives. ``record_stream`` is what keeps the caching allocator from handing the
tensor's memory back to the reader stream while the consumer's kernels that read it are still queued.
On the CPU all of this is a no-op.

Reader streams have the highest priority the device offers: the training loop's kernels fill the GPU,
and at the default priority the loader's decode and transform kernels queue behind them, so the next
batch is late. A higher-priority stream's blocks are scheduled first as SMs free up; it does not
preempt running kernels.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ReaderStream", "Ready"]

_HIGH_PRIORITY = True
"""Reader streams at the device's highest priority; benchmarks turn it off to measure what it changes."""


class ReaderStream:
    """A reader thread's dedicated CUDA stream on the loader's device (nothing on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None
        if device.type == "cuda":
            # (least, greatest): a lower number is a higher priority; torch clamps to what it supports.
            # A static method; torch's stub declares it on instances.
            priority = torch.cuda.Stream.priority_range()[1] if _HIGH_PRIORITY else 0  # type: ignore[call-arg]
            self.stream = torch.cuda.Stream(device, priority=priority)

    @contextmanager
    def active(self) -> Iterator[torch.cuda.Stream | None]:
        """Makes this stream (and its device) current in the calling thread for the body."""
        if self.stream is None:
            yield None
            return
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield self.stream

    def seal(self, tensors: list[torch.Tensor], targets: Any = None) -> Ready:
        """Marks the end of the work producing ``tensors`` (and ``targets``) on this stream.

        ``targets`` may hold CUDA tensors (a ``collate_fn`` that moves them, a source's CUDA targets
        stacked here): those, in dicts, lists and tuples too, are handed over as ``tensors`` are.
        """
        if self.stream is None:
            return Ready(tensors, None)
        event = torch.cuda.Event()
        event.record(self.stream)
        return Ready([*tensors, *_cuda_tensors_in(targets)], event)


@dataclass
class Ready:
    """Tensors finished by a reader stream, and the event that says when."""

    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None

    def receive(self, *, stream: torch.cuda.Stream | None = None) -> None:
        """Makes the tensors safe to use on ``stream``: by default the current one of their device.

        A service passes the stream that was current in the thread that asked for them.
        """
        if self.event is None:
            return
        if stream is None:
            stream = torch.cuda.current_stream(self.tensors[0].device if self.tensors else None)
        stream.wait_event(self.event)
        for tensor in self.tensors:
            if tensor.is_cuda:
                tensor.record_stream(stream)


def _cuda_tensors_in(data: Any) -> list[torch.Tensor]:
    """The CUDA tensors in ``data``: itself, or in its mappings, lists and tuples, at any depth."""
    if isinstance(data, torch.Tensor):
        return [data] if data.is_cuda else []
    if isinstance(data, Mapping):
        data = list(data.values())
    elif not isinstance(data, (list, tuple)):
        return []
    return [tensor for item in data for tensor in _cuda_tensors_in(item)]
