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

Reader streams are leased from a pool of the process and given back when their loader closes, so the
next loader's readers run on the same few streams. Torch keeps two things per stream: the caching
allocator's freed blocks, which only allocations on their own stream reuse, and a cuBLAS workspace
(32 MiB on Hopper) per cuBLAS handle and stream that ran a matrix product (the resize where Triton is
missing), kept for the life of the process. Torch hands out its own 32 streams of a priority in turn,
so each loader built on fresh streams left both behind for the loaders after it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["STREAMS", "ReaderStream", "Ready", "StreamPool"]


def _new_stream(device: torch.device, high_priority: bool) -> torch.cuda.Stream:
    # (least, greatest): a lower number is a higher priority; torch clamps to what it supports.
    # A static method; torch's stub declares it on instances.
    priority = torch.cuda.Stream.priority_range()[1] if high_priority else 0  # type: ignore[call-arg]
    return torch.cuda.Stream(device, priority=priority)


class StreamPool:
    """CUDA streams lent to one reader at a time, and lent again once given back.

    A lease takes the stream given back last, whose freed blocks are the ones the caching allocator
    holds; a new stream is made only when every one made is lent.

    Args:
        new_stream: Makes a stream, called with the device and whether it is to be of high priority.
    """

    def __init__(self, new_stream: Callable[[torch.device, bool], Any] = _new_stream) -> None:
        self._new_stream = new_stream
        # Reentrant: a loader's finalizer gives streams back, and the collector may run it inside a
        # lease or a give-back of this same thread; each is one list operation, safe to nest.
        self._lock = threading.RLock()
        self._free: dict[tuple[torch.device, bool], list[Any]] = {}

    def lease(self, device: torch.device, *, high_priority: bool) -> Any:
        """A stream on ``device`` that no other reader is lent until it is given back."""
        with self._lock:
            free = self._free.get((device, high_priority))
            if free:
                return free.pop()
        return self._new_stream(device, high_priority)

    def give_back(self, device: torch.device, stream: Any, *, high_priority: bool) -> None:
        """Returns a stream from :meth:`lease`: the next lease of its kind gets it."""
        with self._lock:
            self._free.setdefault((device, high_priority), []).append(stream)


#: The pool every reader of the process leases from.
STREAMS = StreamPool()


class ReaderStream:
    """A reader thread's dedicated CUDA stream on the loader's device (nothing on the CPU).

    The stream is leased from ``pool`` (default: :data:`STREAMS`) and goes back to it on :meth:`release`.
    Of the device's highest priority unless ``high_priority`` is ``False`` (a service's workers that
    run the user's model, which has no training step beside it to get ahead of).
    """

    def __init__(
        self, device: torch.device, *, pool: StreamPool | None = None, high_priority: bool = True
    ) -> None:
        self.device = device
        self.stream: torch.cuda.Stream | None = None
        self._pool: StreamPool | None = None
        self._high_priority = high_priority
        self._lock = threading.Lock()  # two closes at once give it back once
        if device.type == "cuda":
            self._pool = pool or STREAMS
            self.stream = self._pool.lease(device, high_priority=self._high_priority)

    def release(self) -> None:
        """Gives the stream back for a later reader. Idempotent.

        Called once the reader's thread has stopped. Work it queued stays ordered before the next
        reader's on the stream; a thread still running past its deadline shares the stream, which
        orders its work with the next reader's rather than beside it.
        """
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.give_back(self.device, self.stream, high_priority=self._high_priority)

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
