"""What a service counts as it answers: requests answered, micro-batch sizes and recent latencies."""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

__all__ = ["LATENCY_WINDOW", "Metrics"]

#: Requests whose latency ``BatchDecoder.stats()`` summarizes (the most recent ones).
LATENCY_WINDOW = 10_000


class Metrics:
    """Thread-safe counters of answered requests and batches, and a window of recent latencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completed = self.failed = self.batches = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)

    def batch(self, size: int) -> None:
        """Counts a micro-batch of ``size`` requests taken for decoding."""
        with self._lock:
            self.batches += 1
            self.batch_sizes[size] += 1

    def answered(self, *, ok: bool, seconds: float) -> None:
        """Counts a request answered ``seconds`` after its submission; only images count as latency."""
        with self._lock:
            if ok:
                self.completed += 1
                self._latencies.append(seconds * 1000)
            else:
                self.failed += 1

    def snapshot(self) -> dict[str, Any]:
        """The counters and latency percentiles, as ``ServiceStats`` fields (percentiles once answered)."""
        with self._lock:
            latencies = list(self._latencies)
            values: dict[str, Any] = {
                "completed": self.completed,
                "failed": self.failed,
                "batches": self.batches,
                "batch_sizes": dict(sorted(self.batch_sizes.items())),
            }
        if latencies:
            p50, p90, p99 = np.percentile(latencies, [50, 90, 99]).tolist()
            values.update(latency_ms_p50=p50, latency_ms_p90=p90, latency_ms_p99=p99)
        return values
