"""Thread stress: the structures that threads share, hammered from many threads at once.

Each test fails when the lock or the ordering behind the structure it checks is taken away. On a
free-threaded Python (3.13t, ``PYTHON_GIL=0``) threads run in parallel, so such races show within a
run; with a GIL they show only where a thread switch lands inside the window, which the tiny switch
interval set here makes likely. ``THREADLOADER_STRESS=N`` repeats the work N times
(``.ci/run-freethreaded`` runs them longer under 3.13t).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from threadloader import BatchDecoder, ThreadLoader
from threadloader._stats import LoaderStats, StatsRecorder
from threadloader._workers import WeakRegistry
from threadloader.decode import DecodedBatch, Encoded, ImageDecoder, RegionOf, StageRecorder

from .conftest import encode, photo, pil_reference

STRESS = int(os.environ.get("THREADLOADER_STRESS", "1"))
#: Calls per thread in the counter and registry tests: with a GIL and the tiny switch interval below,
#: each is slow (lock hand-offs), and a fifth of the free-threaded count still shows the races.
CALLS = (20_000 if not getattr(sys, "_is_gil_enabled", lambda: True)() else 4_000) * STRESS


@pytest.fixture(autouse=True)
def frequent_switches() -> Iterator[None]:
    """With a GIL, a switch at almost every chance: a race window then sees other threads often."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(previous)


def run_together(count: int, target: Callable[[int], None]) -> None:
    """Runs ``target(i)`` in ``count`` threads released at once; re-raises the first failure."""
    start = threading.Barrier(count)

    def run(i: int) -> None:
        start.wait()
        target(i)

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        for future in [pool.submit(run, i) for i in range(count)]:
            future.result()


def watched(count: int, work: Callable[[int], None], watch: Callable[[], None]) -> None:
    """Runs ``work`` as :func:`run_together` does while a thread calls ``watch()`` over and over."""
    done = threading.Event()
    failures: list[BaseException] = []

    def watcher() -> None:
        try:
            while not done.is_set():
                watch()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=watcher)
    thread.start()
    try:
        run_together(count, work)
    finally:
        done.set()
        thread.join()
    if failures:
        raise failures[0]


def test_stats_counters_lose_no_update_from_many_threads() -> None:
    stats, threads, calls = StatsRecorder(), 8, CALLS

    def hammer(_: int) -> None:
        for _ in range(calls):
            stats.count("errors")
            stats.add_time("decode", 1.0)

    run_together(threads, hammer)
    snapshot = stats.snapshot()
    assert snapshot.errors == threads * calls
    assert snapshot.stage_seconds["decode"] == threads * calls  # whole numbers: float sums are exact


def test_a_snapshot_never_sees_counters_added_together_apart() -> None:
    stats, writers, calls = StatsRecorder(), 4, CALLS
    torn: list[LoaderStats] = []

    def write(_: int) -> None:
        for _ in range(calls):
            stats.count_many(batches=1, samples=4)

    def check() -> None:
        snapshot = stats.snapshot()
        if snapshot.samples != 4 * snapshot.batches:
            torn.append(snapshot)

    watched(writers, write, check)
    assert not torn, f"{len(torn)} snapshots saw batches without their samples, e.g. {torn[0]}"
    assert stats.snapshot().samples == 4 * writers * calls


def test_the_weak_registry_lists_while_other_threads_add_and_drop() -> None:
    class Item:
        pass

    registry: WeakRegistry[Item] = WeakRegistry()
    kept = [Item() for _ in range(3)]
    for item in kept:
        registry.add(item)
    rounds = CALLS

    def churn(_: int) -> None:
        for _ in range(rounds):
            registry.add(Item())  # dropped at once: its reference dies in this thread

    def check() -> None:
        live = registry.live()
        assert all(any(item is other for other in live) for item in kept)

    watched(3, churn, check)
    assert sorted(map(id, registry.live())) == sorted(map(id, kept))  # only those outlive the churn


def test_many_reader_threads_give_every_batch_in_order_with_its_pixels_and_counts() -> None:
    # Sizes differ from sample to sample, so an image handed to the wrong place cannot match.
    good = [encode(photo(20 + i % 7, 28 + i % 5, seed=i), quality=90) for i in range(60)]
    bad = {7, 23, 41, 58}
    source = [(b"not an image" if i in bad else data, i) for i, data in enumerate(good)]
    refs = [pil_reference(data) for data in good]
    seed, epochs, batches = 5, 3 * STRESS, 0
    with ThreadLoader(
        source, batch_size=4, shuffle=True, seed=seed, num_threads=16, prefetch=1, on_error="skip"
    ) as loader:
        for epoch in range(epochs):
            # DistributedSampler's order for one process: randperm seeded with seed + epoch.
            order = torch.randperm(len(source), generator=torch.Generator().manual_seed(seed + epoch))
            expected = [int(i) for i in order if int(i) not in bad]
            batches += sum(any(int(i) not in bad for i in order[k : k + 4]) for k in range(0, len(order), 4))
            got: list[int] = []
            for images, targets in loader:
                for image, target in zip(images, targets.tolist(), strict=True):
                    np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), refs[target])
                    got.append(target)
            assert got == expected, f"epoch {epoch}"
        stats = loader.stats()
    assert stats.skipped == stats.errors == len(bad) * epochs
    assert stats.samples == (len(source) - len(bad)) * epochs
    assert stats.batches == batches  # a batch whose samples are all bad is not yielded


def test_service_stats_never_count_an_answered_request_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = [encode(photo(8 + i % 3, 8, seed=i)) for i in range(16)]
    submitters, per_submitter = 4, 100 * STRESS
    broken: list[str] = []
    with BatchDecoder(device="cpu", max_batch=4, max_delay_ms=0, num_threads=2) as service:
        queue_counts = service._queue.counts

        def preempted_after_reading() -> dict[str, Any]:
            counts = queue_counts()
            time.sleep(0.002)  # the reading thread preempted here: requests are answered meanwhile
            return counts

        monkeypatch.setattr(service._queue, "counts", preempted_after_reading)

        def submit(_: int) -> None:
            futures = [service.submit(blobs[k % len(blobs)]) for k in range(per_submitter)]
            for future in futures:
                future.result()

        def check() -> None:
            s = service.stats()
            if s.submitted < s.completed + s.failed + s.cancelled + s.queue_depth:
                broken.append(str(s))

        watched(submitters, submit, check)
        final = service.stats()
    assert not broken, f"{len(broken)} snapshots answered more requests than were submitted: {broken[0]}"
    assert final.completed == final.submitted == submitters * per_submitter


class _CountedDecoder(ImageDecoder):
    """Decodes nothing: each call is a batch of zeros, counted, so that a test knows where the readers are."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.calls = 0
        self._counted = threading.Condition()

    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StageRecorder | None = None,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        with self._counted:
            self.calls += 1
            self._counted.notify_all()
        count = len(encoded)
        pixels = torch.zeros((count, 64, 64, 3), dtype=torch.uint8)
        return DecodedBatch(extents=[(64, 64)] * count, batch=pixels, rows=set(range(count)))

    def wait_for(self, calls: int) -> None:
        """Waits until the readers have made ``calls`` calls."""
        with self._counted:
            assert self._counted.wait_for(lambda: self.calls >= calls, timeout=10)


def test_a_batch_the_consumer_drops_is_freed_while_the_readers_wait() -> None:
    """Freed at the drop, not when the reader that made it next takes a task (docs/design.md).

    The readers wait for room in a full window when each batch is dropped. Two things kept it alive:
    the reader's last result (any Python), and, on a free-threaded build, the reader itself, which
    frees an object it made and another thread dropped only when it next runs Python.
    """
    batches, decoder = 12, _CountedDecoder()
    late: list[tuple[int, float]] = []
    with ThreadLoader(
        [b"unread"] * (4 * batches), batch_size=4, num_threads=2, prefetch=1, decoder=decoder, size=(64, 64)
    ) as loader:
        iterator = iter(loader)
        for k in range(batches):
            images, _ = next(iterator)
            decoder.wait_for(min(k + 3, batches))  # the window, two batches past this one, is full
            time.sleep(0.03)  # and both readers wait in it
            freed = threading.Event()
            weakref.finalize(images, freed.set)
            del images
            started = time.perf_counter()
            if not freed.wait(0.2):  # the readers wake every 10 ms on a free-threaded build
                late.append((k, time.perf_counter() - started))
    assert not late, f"batches (index, seconds) still alive 0.2 s after the consumer dropped them: {late}"


@pytest.mark.parametrize("num_threads", [1, 2])
def test_an_answer_the_caller_drops_is_freed_while_the_service_idles(num_threads: int) -> None:
    """Freed at the drop, not when the worker that made it next takes a request (docs/design.md).

    Three things kept it alive: a cycle through the future's done-callback (freed only by the garbage
    collector), the worker's last micro-batch (any Python), and, on a free-threaded build, the worker
    itself, which frees what it made and another thread dropped only when it next runs Python.
    """
    late: list[tuple[int, float]] = []
    with BatchDecoder(
        decoder=_CountedDecoder(), num_threads=num_threads, max_delay_ms=0, size=(64, 64)
    ) as service:
        for k in range(5):
            image = service.decode(b"unread")
            time.sleep(0.05)  # the worker is back in its wait for requests
            freed = threading.Event()
            weakref.finalize(image, freed.set)
            del image
            started = time.perf_counter()
            if not freed.wait(0.2):
                late.append((k, time.perf_counter() - started))
    assert not late, f"answers (index, seconds) still alive 0.2 s after the caller dropped them: {late}"
