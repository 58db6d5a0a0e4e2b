"""Counters and per-stage host time, shared by the reader threads and the consumer.

One lock guards everything: updates happen a few times per batch, so contention is negligible next to
decoding, and a single lock keeps every snapshot consistent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

__all__ = ["STAGES", "LoaderStats", "StatsRecorder"]

#: Stages whose host time is recorded, in data-path order. ``ahead`` is a reader thread idle because its
#: loader's ``prefetch`` window is full: the consumer is slower, or the oldest batch is still being made
#: while later ones are done (batches go out in order); ``wait`` is the consumer blocked in ``next()``.
#: A :class:`~threadloader.BatchDecoder` has neither: both stay 0 in its stats.
STAGES = ("fetch", "read", "parse", "decode_lock", "decode", "fallback", "transform", "ahead", "wait")


@dataclass(frozen=True)
class LoaderStats:
    """A consistent snapshot of a loader's counters since it was created.

    Stage times are host wall-clock seconds summed over all threads (so they can exceed elapsed time);
    GPU work is asynchronous and shows up where the host waits for it, not where it was queued.

    ``batches`` and ``samples`` count what the consumer received. Everything else counts the reader
    threads' work as it is done, so it includes batches made ahead (``prefetch``) that a loop which
    stops early never receives: ``skipped``, ``errors``, ``cpu_fallbacks``, ``started_on_cpu``,
    ``region_decodes`` and the stage times (``wait`` aside, the consumer's own).

    Attributes:
        batches: Batches handed to the consumer.
        samples: Samples in those batches.
        skipped: Samples dropped by ``on_error="skip"``, counted when their batch is made: a loop
            that stops early may count those of batches it never received (prefetched), and a resumed
            pass those of its first group's batches it skips.
        errors: Sample errors seen (raised or skipped), counted as ``skipped`` is.
        cpu_fallbacks: Samples the GPU decoder gave up on that were decoded on the CPU instead.
        started_on_cpu: Samples of a GPU loader's first batches, decoded with Pillow and copied to the
            GPU while nvImageCodec was starting in the background.
        region_decodes: Samples decoded as a random crop's region only, not as the whole image.
        stage_seconds: Host seconds per stage, keys as in :data:`STAGES`.
        stage_cpu_seconds: CPU seconds the timing threads (the readers, the consumer) spent in each
            stage, keys as in :data:`STAGES`: what a stage's ``stage_seconds`` has beyond these it
            spent waiting (for the GIL beside a training loop, a lock, a read from disk, the GPU) or
            on work that other threads did for it (nvImageCodec's in ``decode``, Pillow's pool's in
            the first batches of a GPU loader), whose CPU is not counted. ``ahead`` and ``wait`` are
            waits themselves, whose CPU is not measured: 0.
    """

    batches: int = 0
    samples: int = 0
    skipped: int = 0
    errors: int = 0
    cpu_fallbacks: int = 0
    started_on_cpu: int = 0
    region_decodes: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    stage_cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))


class StatsRecorder:
    """Thread-safe accumulator behind :class:`LoaderStats`.

    Re-entrant: the consumer counts each batch it takes here, and a signal handler's ``stats()`` runs
    in that thread between two bytecodes, maybe inside the count; with a plain lock it waited for itself.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._counts = {
            "batches": 0,
            "samples": 0,
            "skipped": 0,
            "errors": 0,
            "cpu_fallbacks": 0,
            "started_on_cpu": 0,
            "region_decodes": 0,
        }
        self._seconds = dict.fromkeys(STAGES, 0.0)
        self._cpu_seconds = dict.fromkeys(STAGES, 0.0)

    def count(self, name: str, n: int = 1) -> None:
        """Adds ``n`` to the counter ``name``."""
        with self._lock:
            self._counts[name] += n

    def count_many(self, **counts: int) -> None:
        """Adds to several counters at once: no snapshot sees some of them added and not the others."""
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def add_time(self, stage: str, seconds: float, cpu_seconds: float = 0.0) -> None:
        """Adds host seconds to ``stage``, and the CPU seconds of the thread that spent them."""
        with self._lock:
            self._seconds[stage] += seconds
            self._cpu_seconds[stage] += cpu_seconds

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        """Times the body as host seconds of ``stage`` and its thread's CPU seconds, also when it raises."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add_time(stage, time.perf_counter() - start, time.thread_time() - cpu)

    def snapshot(self) -> LoaderStats:
        """Returns the current values as an immutable :class:`LoaderStats`."""
        with self._lock:
            return LoaderStats(
                **self._counts,
                stage_seconds=dict(self._seconds),
                stage_cpu_seconds=dict(self._cpu_seconds),
            )
