"""The service's request queue: bounded, FIFO, and handing out micro-batches to worker threads.

Every wait in it (a submitter waiting for room, a worker waiting for requests) ends when it is closed.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .._workers import POLL
from ..decode.base import Encoded
from ..errors import LoaderClosedError, QueueFullError

__all__ = ["Request", "RequestQueue"]


@dataclass(slots=True)
class Request:
    """One caller's image, the future it waits on, and the CUDA stream it will read the result on."""

    number: int
    data: Encoded
    future: Future[torch.Tensor]
    stream: torch.cuda.Stream | None
    submitted: float  # time.perf_counter()


class RequestQueue:
    """A bounded FIFO that hands out micro-batches; every wait in it ends when it is closed.

    Args:
        capacity: Most requests waiting (``max_queue``).
        max_batch: Most requests in one micro-batch.
        max_delay: Most seconds a micro-batch waits for company, counted from its first request's
            submission.
    """

    def __init__(self, *, capacity: int, max_batch: int, max_delay: float) -> None:
        self._capacity = capacity
        self._max_batch = max_batch
        self._max_delay = max_delay
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        # Held by the one worker gathering a batch, so that concurrent arrivals fill its batch instead
        # of being split among idle workers; the others wait here and decode in parallel meanwhile.
        self._gathering = threading.Lock()
        self._items: collections.deque[Request] = collections.deque()
        self.closed = False
        self.submitted = self.rejected = self.cancelled = 0

    def put(
        self, data: Encoded, stream: torch.cuda.Stream | None, *, wait: float | None
    ) -> Future[torch.Tensor]:
        """Enqueues a request; waits up to ``wait`` seconds for room (``None``: as long as it takes).

        Raises:
            QueueFullError: If the queue is still full when the wait ends.
            LoaderClosedError: If the service is closed, also while waiting.
        """
        with self._lock:
            deadline = None if wait is None else time.monotonic() + wait
            while len(self._items) >= self._capacity and not self.closed:
                remaining = POLL if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    self.rejected += 1
                    raise QueueFullError(
                        f"BatchDecoder queue is full ({self._capacity} requests waiting, "
                        f"max_queue={self._capacity}): the service is overloaded; retry later or raise "
                        "max_queue"
                    )
                self._not_full.wait(min(remaining, POLL))
            if self.closed:
                raise LoaderClosedError("this BatchDecoder was closed; create a new one to decode")
            future: Future[torch.Tensor] = Future()
            self._items.append(Request(self.submitted, data, future, stream, time.perf_counter()))
            self.submitted += 1
            self._not_empty.notify()
        return future

    def gather(self) -> list[Request] | None:
        """Blocks for the first request, then takes more until ``max_batch`` or ``max_delay`` after it.

        The delay runs from the first request's submission, so a request that already waited behind
        busy workers is not held back further. Requests cancelled by their caller are dropped here.

        Returns:
            The micro-batch (empty when all it took were cancelled); ``None`` once closed and drained.
        """
        with self._gathering, self._lock:
            while not self._items:
                if self.closed:
                    return None
                self._not_empty.wait(POLL)
            deadline = self._items[0].submitted + self._max_delay
            batch: list[Request] = []
            while len(batch) < self._max_batch:
                if self._items:
                    request = self._items.popleft()
                    self._not_full.notify()
                    if request.future.set_running_or_notify_cancel():
                        batch.append(request)
                    else:
                        self.cancelled += 1
                    continue
                remaining = deadline - time.perf_counter()
                if remaining <= 0 or self.closed:
                    break
                self._not_empty.wait(remaining)
            return batch

    def close(self, *, cancel_pending: bool) -> None:
        """Refuses new requests, wakes every waiter and, if asked, cancels the requests still queued."""
        with self._lock:
            self.closed = True
            dropped = list(self._items) if cancel_pending else []
            if cancel_pending:
                self._items.clear()
            self.cancelled += len(dropped)
            self._not_empty.notify_all()
            self._not_full.notify_all()
        for request in dropped:  # outside the lock: cancel() runs the callers' done-callbacks
            request.future.cancel()

    def counts(self) -> dict[str, Any]:
        """Requests queued now, and the queue's counters, read together."""
        with self._lock:
            return {
                "queue_depth": len(self._items),
                "submitted": self.submitted,
                "rejected": self.rejected,
                "cancelled": self.cancelled,
            }
