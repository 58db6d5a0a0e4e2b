"""Reader threads end on every way out of a loop, also mid-batch, nothing leaks, prefetching stays bounded,
and the interpreter exits cleanly with threads still working."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from threadloader import LoaderClosedError, ThreadLoader, ThreadLoaderError
from threadloader._cancel import Cancelled, bind_cancel
from threadloader._stats import StatsRecorder
from threadloader._workers import OrderedPool
from threadloader.decode import PillowDecoder

from .conftest import SlowSamples, distinct_jpegs, reader_threads, run_script, wait_for_no_reader_threads

H, W = 16, 24
N = 40


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return distinct_jpegs(N, H, W)


def make(blobs: list[bytes], **options) -> ThreadLoader:
    options = {"batch_size": 2, "num_threads": 3, "prefetch": 2, "device": "cpu", **options}
    return ThreadLoader(SlowSamples(blobs), **options)


def assert_batch(images: torch.Tensor, targets: torch.Tensor, refs: list[np.ndarray], expected: list[int]):
    assert targets.tolist() == expected
    for image, index in zip(images, expected, strict=True):
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), refs[index])


def assert_all_ended(before: int) -> None:
    assert wait_for_no_reader_threads(1.0) == []
    assert threading.active_count() == before


def test_break(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    before = threading.active_count()
    loader = make(blobs, size=(H, W))
    for b, (images, targets) in enumerate(loader):
        assert len(reader_threads()) == 3
        assert_batch(images, targets, refs, [2 * b, 2 * b + 1])
        if b == 2:
            break
    assert_all_ended(before)
    # The loader is still usable: the next pass starts from the beginning.
    images, targets = next(iter(loader))
    assert_batch(images, targets, refs, [0, 1])
    assert_all_ended(before)


@pytest.mark.parametrize("order", ["iterator_first", "loader_first"])
def test_del_iterator_and_loader(blobs: list[bytes], refs: list[np.ndarray], order: str) -> None:
    before = threading.active_count()
    loader = make(blobs)
    iterator = iter(loader)
    next(iterator)
    assert len(reader_threads()) == 3
    if order == "iterator_first":
        del iterator
        assert_all_ended(before)
        del loader
    else:
        del loader
        # The iterator keeps the pass going: the remaining batches all come, in order.
        images, targets = next(iterator)
        assert_batch(images, targets, refs, [2, 3])
        del iterator
    # No gc.collect(): reference counting alone must end the threads.
    assert_all_ended(before)


def act_in_the_second_loop_body(loader: ThreadLoader, seen: list[list[int]], act: Callable[[], None]) -> None:
    """Iterates ``loader``, each batch's targets into ``seen``, and calls ``act`` in the loop body of the
    second batch."""
    for _, targets in loader:
        seen.append(targets.tolist())
        if len(seen) == 2:
            act()


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_the_loop_body(blobs: list[bytes], refs: list[np.ndarray], error: type) -> None:
    def fail() -> None:
        raise error("consumer failed")

    before = threading.active_count()
    loader = make(blobs)
    seen: list[list[int]] = []
    with pytest.raises(error, match="consumer failed"):
        act_in_the_second_loop_body(loader, seen, fail)
    assert seen == [[0, 1], [2, 3]]
    assert_all_ended(before)
    assert [t.tolist() for _, t in loader][:2] == [[0, 1], [2, 3]]  # a new pass still works
    assert_all_ended(before)


def test_close_mid_iteration(blobs: list[bytes]) -> None:
    def close() -> None:
        start = time.monotonic()
        loader.close()
        assert time.monotonic() - start < 1.0
        assert reader_threads() == []

    before = threading.active_count()
    loader = make(blobs)
    seen: list[list[int]] = []
    with pytest.raises(LoaderClosedError, match="closed while this pass was running"):
        act_in_the_second_loop_body(loader, seen, close)
    assert seen == [[0, 1], [2, 3]]  # the loop did not go on, nor end as if the epoch were complete
    assert_all_ended(before)
    loader.close()  # idempotent
    loader.close()
    with pytest.raises(LoaderClosedError, match="closed"):
        iter(loader)
    assert issubclass(LoaderClosedError, ThreadLoaderError)


def test_close_with_an_iterator_held(blobs: list[bytes]) -> None:
    before = threading.active_count()
    loader = make(blobs)
    iterator = iter(loader)
    next(iterator)
    loader.close()
    assert_all_ended(before)
    for _ in range(2):  # every later call too, never StopIteration
        with pytest.raises(LoaderClosedError):
            next(iterator)
    assert_all_ended(before)


def test_a_signal_handler_inside_the_loaders_locks_can_call_it(blobs: list[bytes]) -> None:
    """A signal handler runs in the main thread between two of its bytecodes: maybe while that thread
    lists the loader's iterators or counts a batch it took. A handler's state_dict(), stats() or close()
    (a checkpoint on SIGTERM) then took those locks again and waited for itself forever."""
    loader = make(blobs)
    iterator = iter(loader)
    next(iterator)
    got: dict[str, Any] = {}

    def interrupted_inside() -> None:  # the main thread's state when the handler runs, then the handler
        with loader._iterators._lock:
            got["state"] = loader.state_dict()
        with loader._stats._lock:
            got["batches"] = loader.stats().batches
        with loader._iterators._lock:
            loader.close()
            got["closed"] = True

    thread = threading.Thread(target=interrupted_inside, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), f"the handler waited for its own thread's lock (got {sorted(got)})"
    assert got["state"]["epoch"] == 0 and got["state"]["batches"] == 1  # one batch taken, of epoch 0
    assert got["batches"] == 1 and got["closed"]
    with pytest.raises(LoaderClosedError):
        next(iterator)


def test_a_close_while_another_thread_closes_waits_for_the_readers_too(blobs: list[bytes]) -> None:
    """loader.close() while the iterator is being closed elsewhere (a break in another thread) returned
    at once, with readers still inside the user's collate_fn: a caller that then frees what it uses
    (a file, a database handle) pulled it from under them."""
    inside, freed = threading.Event(), threading.Event()
    used_after_free: list[str] = []

    def slow_collate(targets: list[Any]) -> list[Any]:
        inside.set()
        time.sleep(0.4)  # user work that checks for no cancellation
        if freed.is_set():
            used_after_free.append(threading.current_thread().name)
        return targets

    loader = make(blobs, collate_fn=slow_collate)
    iterator = iter(loader)
    assert inside.wait(10)
    other = threading.Thread(target=iterator.close)  # the consumer's break, in its thread
    other.start()
    time.sleep(0.05)
    loader.close()
    still = [thread.name for thread in reader_threads()]
    freed.set()
    other.join(10)
    time.sleep(0.5)
    assert still == [] and used_after_free == [], (still, used_after_free)


def test_close_before_iterating(blobs: list[bytes]) -> None:
    loader = make(blobs)
    loader.close()
    loader.close()
    with pytest.raises(LoaderClosedError):
        list(loader)
    assert reader_threads() == []


@pytest.mark.parametrize("raise_inside", [False, True])
def test_context_manager_exit(blobs: list[bytes], refs: list[np.ndarray], raise_inside: bool) -> None:
    before = threading.active_count()
    expectation = pytest.raises(RuntimeError, match="inside with") if raise_inside else nullcontext()
    with expectation, make(blobs) as loader:
        iterator = iter(loader)  # still referenced after the block: close() must end it anyway
        images, targets = next(iterator)
        assert_batch(images, targets, refs, [0, 1])
        if raise_inside:
            raise RuntimeError("inside with")
    assert_all_ended(before)
    with pytest.raises(LoaderClosedError):
        iter(loader)
    del iterator


def test_many_epochs_in_a_row(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    before = threading.active_count()
    loader = ThreadLoader(
        [(b, i) for i, b in enumerate(blobs[:6])], batch_size=2, num_threads=3, shuffle=True, device="cpu"
    )
    for e in range(30):
        order = []
        for images, targets in loader:
            threads = reader_threads()
            assert len(threads) <= 3
            assert all(t.name.startswith(f"threadloader-e{e}-") for t in threads)  # none left from before
            assert_batch(images, targets, refs, targets.tolist())
            order.extend(targets.tolist())
        assert sorted(order) == list(range(6))
        assert_all_ended(before)
        stats = loader.stats()
        assert (stats.samples, stats.batches) == (6 * (e + 1), 3 * (e + 1))
    loader.close()


def test_two_loaders_interleaved(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    before = threading.active_count()
    a = make(blobs[:12], num_threads=2)
    b = make(blobs[:12], num_threads=3, batch_size=3, sampler=list(reversed(range(12))))
    got_a, got_b = [], []
    for (images_a, targets_a), (images_b, targets_b) in zip(a, b, strict=False):
        assert len(reader_threads()) <= 5
        assert_batch(images_a, targets_a, refs, targets_a.tolist())
        assert_batch(images_b, targets_b, refs, targets_b.tolist())
        got_a.append(targets_a.tolist())
        got_b.append(targets_b.tolist())
    assert got_a == [[0, 1], [2, 3], [4, 5], [6, 7]]  # zip stops at b's 4 batches
    assert got_b == [[11, 10, 9], [8, 7, 6], [5, 4, 3], [2, 1, 0]]
    del a, b
    assert_all_ended(before)


def test_temporary_loader_yields_every_batch(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    before = threading.active_count()
    got = []
    for images, targets in make(blobs[:10]):
        gc.collect()  # the loader has no name: only the iterator keeps it alive
        assert_batch(images, targets, refs, targets.tolist())
        got.append(targets.tolist())
    assert got == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert_all_ended(before)


@pytest.mark.parametrize("num_threads", [1, 4])
def test_thread_count_is_num_threads(blobs: list[bytes], num_threads: int) -> None:
    before = threading.active_count()
    loader = make(blobs, num_threads=num_threads, prefetch=1)  # 20 batches > window + 1
    iterator = iter(loader)
    next(iterator)
    names = sorted(t.name for t in reader_threads())
    assert names == sorted(f"threadloader-e0-{i}" for i in range(num_threads))
    assert threading.active_count() == before + num_threads
    assert all(t.daemon for t in reader_threads())
    iterator.close()
    assert_all_ended(before)


class Recording(Dataset):
    """Records every index requested, so the test can see how far ahead the threads got."""

    def __init__(self, blobs: list[bytes]) -> None:
        self.blobs = blobs
        self.requested: set[int] = set()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        with self.lock:
            self.requested.add(index)
        return self.blobs[index], index

    def batches_started(self, batch_size: int) -> int:
        with self.lock:
            return len({i // batch_size for i in self.requested})


def _settle(dataset: Recording, batch_size: int, expected: int) -> int:
    """Waits until ``expected`` batches were started (or 2 s), then a little more for any excess."""
    deadline = time.monotonic() + 2.0
    while dataset.batches_started(batch_size) < expected and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.1)
    return dataset.batches_started(batch_size)


@pytest.mark.parametrize(("num_threads", "prefetch"), [(1, 1), (2, 2), (3, 1), (4, 3)])
def test_prefetch_bound_is_exact(blobs: list[bytes], num_threads: int, prefetch: int) -> None:
    batch_size = 2
    dataset = Recording(blobs)  # 20 batches: more than any window here
    loader = ThreadLoader(
        dataset, batch_size=batch_size, num_threads=num_threads, prefetch=prefetch, device="cpu"
    )
    window = num_threads * prefetch
    iterator = iter(loader)
    _, targets = next(iterator)  # the consumer holds batch 0 and does not advance
    assert targets.tolist() == [0, 1]
    assert _settle(dataset, batch_size, window + 1) == window + 1
    assert max(dataset.requested) == (window + 1) * batch_size - 1
    _, targets = next(iterator)  # one step forward frees exactly one slot
    assert targets.tolist() == [2, 3]
    assert _settle(dataset, batch_size, window + 2) == window + 2
    iterator.close()
    assert wait_for_no_reader_threads(1.0) == []


def test_a_failing_sampler_ends_every_thread(blobs: list[bytes]) -> None:
    before = threading.active_count()

    class BrokenSampler:
        def __len__(self) -> int:
            return 10

        def __iter__(self):
            yield from range(5)
            raise RuntimeError("sampler broke")

    loader = make(blobs, sampler=BrokenSampler())
    seen = []
    with pytest.raises(RuntimeError, match="sampler broke"):
        for _, targets in loader:
            seen.append(targets.tolist())
    assert seen == [[0, 1], [2, 3]]
    assert_all_ended(before)


# Slow batches (issue 13): leaving a loop ends the readers within a few steps of their work, not at the
# end of their batch, and the interpreter exits cleanly with the script's own exit code.

#: Seconds each sample of a slow batch takes, and samples per batch: a batch takes seconds.
STEP = 0.05
SLOW_BATCH = 64
#: Most seconds from leaving a loop to the last reader thread gone, on those batches: a few steps.
STOP_BOUND = 0.5


class SlowAfterFirst(Dataset):
    """A fast first batch, then STEP seconds per sample; says when reader threads are inside slow ones."""

    def __init__(self, blobs: list[bytes]) -> None:
        self.blobs = blobs
        self.cv = threading.Condition()
        self.inside: set[str] = set()
        self.slow_calls = 0

    def __len__(self) -> int:
        return 4 * SLOW_BATCH

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        if index >= SLOW_BATCH:
            with self.cv:
                self.inside.add(threading.current_thread().name)
                self.slow_calls += 1
                self.cv.notify_all()
            time.sleep(STEP)
        return self.blobs[index % len(self.blobs)], index

    def wait_inside(self, threads: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.inside) >= threads, timeout=10)


def slow_loader(blobs: list[bytes]) -> tuple[ThreadLoader, SlowAfterFirst]:
    source = SlowAfterFirst(blobs)
    # Two threads, one batch each in flight: once the consumer has batch 0, both are in slow batches.
    # One batch per group on every device (a GPU groups 64 images by default).
    loader = ThreadLoader(
        source, batch_size=SLOW_BATCH, decode_batch_size=SLOW_BATCH, num_threads=2, prefetch=1
    )
    return loader, source


def seconds_until_no_reader_threads(started: float) -> float:
    assert wait_for_no_reader_threads(5.0) == []
    return time.monotonic() - started


@pytest.mark.parametrize("way", ["break", "del", "close", "with"])
def test_slow_batches_stop_promptly(blobs: list[bytes], way: str) -> None:
    loader, source = slow_loader(blobs)
    started = 0.0
    if way == "break":
        for _ in loader:
            source.wait_inside(2)
            started = time.monotonic()
            break
    elif way == "with":
        with loader:
            iterator = iter(loader)
            next(iterator)
            source.wait_inside(2)
            started = time.monotonic()
    else:
        iterator = iter(loader)
        next(iterator)
        source.wait_inside(2)
        started = time.monotonic()
        if way == "del":
            del iterator
        else:
            loader.close()
    elapsed = seconds_until_no_reader_threads(started)
    assert elapsed < STOP_BOUND, f"readers took {elapsed:.2f} s to stop after {way}"
    assert source.slow_calls < SLOW_BATCH  # neither thread finished its batch (2 x 3.2 s)


def _waiting_in_pool(thread: threading.Thread) -> bool:
    """Whether ``thread`` is inside OrderedPool.next, waiting for a result."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code is OrderedPool.next.__code__:
            return True
        frame = frame.f_back
    return False


def test_close_from_another_thread_fails_the_waiting_next(blobs: list[bytes]) -> None:
    loader, source = slow_loader(blobs)
    iterator = iter(loader)
    next(iterator)
    consumer = threading.current_thread()
    closed_at: list[float] = []

    def close_once_the_consumer_waits() -> None:
        deadline = time.monotonic() + 10
        while not _waiting_in_pool(consumer) and time.monotonic() < deadline:
            time.sleep(0.001)
        closed_at.append(time.monotonic())
        loader.close()

    closer = threading.Thread(target=close_once_the_consumer_waits)
    closer.start()
    with pytest.raises(LoaderClosedError, match="closed while this pass was running"):
        next(iterator)  # waits for batch 1, seconds away, until the other thread closes the loader
    closer.join(5)
    assert seconds_until_no_reader_threads(closed_at[0]) < STOP_BOUND
    with pytest.raises(LoaderClosedError):  # and every call after it: the epoch did not end
        next(iterator)
    assert source.slow_calls < SLOW_BATCH


def test_close_while_a_pass_is_starting_still_stops_it(blobs: list[bytes]) -> None:
    # close() from another thread while __iter__ is between its closed-check and registering the new
    # pass (here: inside the sampler's set_epoch) must not return before that pass is stopped.
    inside, go = threading.Event(), threading.Event()

    class Sampler:
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(8))

        def __len__(self) -> int:
            return 8

        def set_epoch(self, epoch: int) -> None:
            inside.set()
            go.wait(10)

    loader = ThreadLoader(blobs[:8], batch_size=2, sampler=Sampler(), num_threads=1, device="cpu")
    closer = threading.Thread(target=lambda: (inside.wait(10), loader.close()))
    closer.start()
    starter = threading.Thread(target=lambda: (inside.wait(10), time.sleep(0.2), go.set()))
    starter.start()
    iterator = iter(loader)  # blocks in set_epoch until go; close() runs meanwhile
    closer.join(10)
    starter.join(10)
    with pytest.raises(LoaderClosedError):
        next(iterator)


def test_close_from_another_thread_drops_batches_already_received(blobs: list[bytes]) -> None:
    samples = [(blob, i) for i, blob in enumerate(blobs[:16])]
    loader = ThreadLoader(samples, batch_size=2, decode_batch_size=8, num_threads=1, device="cpu")
    iterator = iter(loader)
    _, targets = next(iterator)  # batch 0 of a group of 4: batches 1-3 are in the iterator already
    assert targets.tolist() == [0, 1]
    closer = threading.Thread(target=loader.close)
    closer.start()
    closer.join(5)
    with pytest.raises(LoaderClosedError):
        next(iterator)


def test_pillow_stops_between_images(blobs: list[bytes]) -> None:
    """A batch of large images is long to decode: a cancelled thread decodes no further image."""
    cancel = threading.Event()
    taken: list[int] = []

    class CancelAtSecond(Sequence):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> bytes:
            taken.append(index)
            if index == 1:
                cancel.set()
            return blobs[index]

    raised: list[BaseException] = []

    def decode() -> None:
        bind_cancel(cancel)
        try:
            PillowDecoder().decode(CancelAtSecond(), stream=None, stats=StatsRecorder())
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join(5)
    assert taken == [0, 1] and len(raised) == 1 and isinstance(raised[0], Cancelled)


def test_pillow_on_threads_stops_at_the_next_image_and_joins_its_threads(
    blobs: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU loader's first batches decode on threads of the call: cancelled, it starts no image that
    was not under way, and returns only once the ones under way have ended, its threads gone."""
    from threadloader.decode import pillow

    cancel = threading.Event()
    started: list[int] = []
    original = pillow.decode_rgb

    def slow_decode(data: bytes, **options: object) -> np.ndarray:
        started.append(len(started))
        cancel.set()  # as the first image starts
        time.sleep(0.05)
        return original(data, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(pillow, "decode_rgb", slow_decode)
    raised: list[BaseException] = []
    left: list[list[str]] = []

    def decode() -> None:
        bind_cancel(cancel)
        try:
            PillowDecoder(threads=2).decode(blobs * 5, stream=None)
        except BaseException as exc:
            raised.append(exc)
        left.append([t.name for t in threading.enumerate() if t.name.startswith("threadloader-pillow")])

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join(10)
    assert len(raised) == 1 and isinstance(raised[0], Cancelled)
    assert 1 <= len(started) <= 4 < len(blobs) * 5  # the two under way, and two more at most
    assert left == [[]]


#: A script that leaves a loader (or a service) while its reader thread is inside seconds of torch
#: calls, then ends. A daemon thread still inside torch when the interpreter finalizes aborts the
#: process ("terminate called without an active exception", exit code 134).
EXIT_SCRIPT = """
import sys, threading, time
import torch
from threadloader import BatchDecoder, ThreadLoader
from threadloader.transforms import Transform
from tests.conftest import encode, photo

JPEG = encode(photo(16, 24), quality=90)
entered = threading.Event()


def slow_torch_work():
    entered.set()
    x = torch.ones(1000, 1000)
    end = time.monotonic() + 2.5  # a step longer than any fixed join timeout, all in torch
    while time.monotonic() < end:
        x.to(torch.float64)


class SlowSource:
    def __len__(self):
        return 8

    def __getitem__(self, index):
        if index >= 2:
            slow_torch_work()
        return JPEG, index


class SlowTransform(Transform):
    def apply(self, images, params):
        slow_torch_work()
        return images


if sys.argv[1] == "service":
    decoder = BatchDecoder(device="cpu", num_threads=1, transform=SlowTransform())
    future = decoder.submit(JPEG)
    future.add_done_callback(lambda f: print("answered:", type(f.exception()).__name__, flush=True))
    entered.wait()
else:
    loader = ThreadLoader(SlowSource(), batch_size=2, num_threads=1, prefetch=2, device="cpu")
    for images, _ in loader:
        entered.wait()  # the reader is inside batch 1
        break
print("left", flush=True)
if sys.argv[1] == "raise":
    raise RuntimeError("the script failed")
"""


def run_exit_script(tmp_path: Path, what: str) -> subprocess.CompletedProcess[str]:
    return run_script(tmp_path, EXIT_SCRIPT, what)


def alarms(stderr: str) -> list[str]:
    """Lines of ``stderr`` that say something went wrong natively or at shutdown."""
    words = ("terminate", "fatal", "abort", "exception ignored", "segmentation", "core dumped")
    return [line for line in stderr.splitlines() if any(word in line.lower() for word in words)]


@pytest.mark.parametrize(
    ("what", "output"),
    [("loader", ["left"]), ("service", ["left", "answered: LoaderClosedError"])],
    ids=["loader", "service"],
)
def test_exit_while_a_reader_is_inside_torch(tmp_path: Path, what: str, output: list[str]) -> None:
    result = run_exit_script(tmp_path, what)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:-1] == output
    assert "Traceback" not in result.stderr and not alarms(result.stderr), result.stderr


def test_uncaught_exception_keeps_its_exit_code(tmp_path: Path) -> None:
    result = run_exit_script(tmp_path, "raise")
    assert result.returncode == 1, result.stderr
    assert result.stderr.count("Traceback") == 1
    assert result.stderr.strip().endswith("RuntimeError: the script failed")
    assert not alarms(result.stderr), result.stderr


#: A daemon thread iterating a loader, epoch after epoch, while the main script ends with exit code 3.
DAEMON_CONSUMER_SCRIPT = """
import sys, threading
from threadloader import ThreadLoader
from tests.conftest import SlowSamples, encode, photo

JPEG = encode(photo(16, 24), quality=90)
started = threading.Event()


def consume():
    loader = ThreadLoader(SlowSamples([JPEG] * 1000), batch_size=2, num_threads=1, device="cpu")
    for epoch in range(3):
        for images, _ in loader:
            started.set()


threading.Thread(target=consume, name="consumer", daemon=True).start()
started.wait()
print("main done", flush=True)
sys.exit(3)
"""


def test_a_daemon_thread_iterating_at_exit_ends_silently(tmp_path: Path) -> None:
    """The exit hook stops the loader under the daemon consumer: no traceback, the script's exit code."""
    result = run_script(tmp_path, DAEMON_CONSUMER_SCRIPT)
    assert (result.returncode, result.stdout) == (3, "main done\n"), result.stderr
    assert "Traceback" not in result.stderr and "Exception in thread" not in result.stderr, result.stderr
    assert not alarms(result.stderr), result.stderr


#: A daemon thread starts a pass once threadloader's exit hook has run; then an exit hook of the
#: user's, registered before the import so that it runs after threadloader's (atexit is LIFO), uses the
#: loader from the main thread. A hang dumps every thread's stack and exits with code 1.
PASS_AFTER_THE_EXIT_HOOK_SCRIPT = """
import atexit, faulthandler, sys, threading, time


def parked(thread):
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "_exiting":
            return True
        frame = frame.f_back
    return False


def after_threadloaders_hook():
    begin.set()
    deadline = time.monotonic() + 30
    while not parked(consumer):
        assert time.monotonic() < deadline, "the daemon thread's iter() never reached _exiting()"
        time.sleep(0.01)
    faulthandler.dump_traceback_later(20, exit=True)
    print("epoch", loader.state_dict()["epoch"], flush=True)
    try:
        iter(loader)
    except LoaderClosedError as exc:
        print("iter:", exc, flush=True)
    loader.close()
    faulthandler.cancel_dump_traceback_later()
    print("closed", flush=True)


atexit.register(after_threadloaders_hook)

from threadloader import LoaderClosedError, ThreadLoader
from tests.conftest import SlowSamples, encode, photo

JPEG = encode(photo(16, 24), quality=90)
loader = ThreadLoader(SlowSamples([JPEG] * 8), batch_size=2, num_threads=2, device="cpu")
begin = threading.Event()


def consume():
    begin.wait()
    for _ in loader:
        print("a batch after the exit hook", flush=True)


consumer = threading.Thread(target=consume, name="consumer", daemon=True)
consumer.start()
"""


def test_a_pass_a_daemon_thread_starts_after_the_exit_hook_holds_no_lock_of_the_loader(
    tmp_path: Path,
) -> None:
    """The daemon thread parks for good in _exiting(): it did so inside iter(), in the pool's thread
    group, holding the loader's locks, so an exit hook that ran later and called state_dict(), iter()
    or close() waited for it forever, and the interpreter never exited."""
    result = run_script(tmp_path, PASS_AFTER_THE_EXIT_HOOK_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "epoch 0\niter: the interpreter is exiting: its exit hook closed this loader\nclosed\n"
    ), result.stderr
    assert "Traceback" not in result.stderr and not alarms(result.stderr), result.stderr


def test_close_and_state_dict_do_not_wait_for_a_sampler_that_blocks_a_pass_starting(
    blobs: list[bytes],
) -> None:
    """iter(loader) drew its first batches from the sampler holding the loader's lock: a sampler that
    blocks before its first index (a streaming one waiting for work) held up close() and state_dict()
    from every other thread until it yielded."""
    release = threading.Event()

    class Streaming:
        def __iter__(self):
            release.wait(20)
            yield from range(len(blobs))

        def __len__(self) -> int:
            return len(blobs)

    loader = make(blobs, sampler=Streaming())
    outcome: list[BaseException] = []

    def consume() -> None:
        try:
            iter(loader)
        except BaseException as exc:
            outcome.append(exc)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    time.sleep(0.3)  # the consumer waits in the sampler
    started = time.monotonic()
    assert loader.state_dict()["epoch"] == 0
    loader.close()
    assert time.monotonic() - started < 2
    release.set()
    consumer.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], LoaderClosedError), outcome
    assert "closed while its pass started" in str(outcome[0])


#: A MicroBatcher whose function loads each request's images with a ThreadLoader, exiting mid-batch.
LOADER_IN_A_WORKER_SCRIPT = """
import sys, threading
from threadloader import MicroBatcher, ThreadLoader
from tests.conftest import SlowSamples, encode, photo

JPEG = encode(photo(16, 24), quality=90)
inside = threading.Event()


def load_all(requests):
    counts = []
    for _ in requests:
        count = 0
        for images, _ in ThreadLoader(SlowSamples([JPEG] * 1000), batch_size=2, num_threads=2, device="cpu"):
            inside.set()
            count += len(images)
        counts.append(count)
    return counts


batcher = MicroBatcher(load_all, max_batch=1, max_delay_ms=0, num_threads=1)
future = batcher.submit("job")
future.add_done_callback(lambda f: print("answered:", type(f.exception()).__name__, flush=True))
inside.wait()
print("main done", flush=True)
"""


def test_exit_while_a_library_thread_iterates_a_loader(tmp_path: Path) -> None:
    """The exit hook waits for a MicroBatcher's worker, which parked for good in the loader's next()
    (where a user's daemon thread is parked until the process ends): the process never exited."""
    started = time.monotonic()
    result = run_script(tmp_path, LOADER_IN_A_WORKER_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "main done\nanswered: LoaderClosedError\n"
    assert time.monotonic() - started < 60
    assert "Traceback" not in result.stderr and not alarms(result.stderr), result.stderr


def test_no_threads_start_once_the_exit_hook_ran(blobs: list[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """After the hook, a pass would start readers that nothing stops: refused (here, in the main thread)."""
    from threadloader import _workers

    loader = make(blobs)
    monkeypatch.setattr(_workers, "_exited", True)
    before = threading.active_count()
    with pytest.raises(LoaderClosedError, match="the interpreter is exiting"):
        iter(loader)
    assert threading.active_count() == before
    loader.close()


def test_a_thread_start_that_fails_part_way_stops_the_threads_already_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """ "can't start new thread" (a process limit) at the second of three: the group's owner is never
    made, so nothing else would stop the first, which runs until cancelled."""
    from threadloader._cancel import check_cancelled
    from threadloader._workers import ThreadGroup

    start = threading.Thread.start
    starts = 0

    def second_fails(thread: threading.Thread) -> None:
        nonlocal starts
        starts += 1
        if starts == 2:
            raise RuntimeError("can't start new thread")
        start(thread)

    def until_cancelled(index: int) -> None:
        while True:
            check_cancelled()
            time.sleep(0.01)

    monkeypatch.setattr(threading.Thread, "start", second_fails)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        ThreadGroup(name="threadloader-partial", count=3, target=until_cancelled, wake=lambda: None)
    monkeypatch.undo()
    assert starts == 2
    assert wait_for_no_reader_threads(5.0) == []


@pytest.mark.parametrize("failure", ["batch", "batch of a group", "sample"])
def test_an_error_the_consumer_drops_frees_what_its_frames_held(blobs: list[bytes], failure: str) -> None:
    """A failed batch's error, once dropped, holds nothing: without the collector (off here), its
    traceback's frames (the reader's, holding what the batch was made of; the iterator's, holding the
    loader) were kept in a cycle through the frames that had the error as a local. A batch's error
    inside a group is one of the group's outcomes, which its frames' callers had as a local."""
    held: list[threading.Event] = []

    def failing_collate(targets: list[object]) -> object:
        if failure == "batch of a group" and 4 not in targets:  # the group's third batch fails
            return torch.tensor(targets)
        made = torch.zeros(4)  # stands for the batch a reader was making when it failed
        held.append(threading.Event())
        weakref.finalize(made, held[-1].set)
        raise ValueError("the targets do not collate")

    def run() -> weakref.ref[ThreadLoader]:
        if failure == "batch":
            loader = make(blobs, collate_fn=failing_collate, num_threads=1)
            error: type[Exception] = ValueError
        elif failure == "batch of a group":
            loader = make(blobs, collate_fn=failing_collate, num_threads=1, decode_batch_size=6)
            error = ValueError
        else:
            loader = ThreadLoader([b"not an image", *blobs], batch_size=2, num_threads=2, device="cpu")
            error = ThreadLoaderError
        try:
            for _ in loader:
                pass
        except error:
            pass
        return weakref.ref(loader)

    gc.collect()
    gc.disable()
    try:
        loader = run()
        if failure != "sample":
            assert held and held[0].wait(5)
        assert wait_for_no_reader_threads(5.0) == []
        assert loader() is None
    finally:
        gc.enable()


def test_the_exit_hooks_cancel_never_hands_the_consumer_cancelled(
    blobs: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook cancels a pool's group (its readers' flag) before the pool shuts: a reader stopped in
    between handed in Cancelled as its task's result, which the consumer raised (a daemon consumer
    printed it at exit). The gap is widened here."""
    from threadloader import _workers

    shut = _workers.OrderedPool._shut

    def late(self: Any, error: Any) -> None:
        if error is _workers._exiting:
            time.sleep(0.05)  # the readers see the flag before the pool is shut
        shut(self, error)

    monkeypatch.setattr(_workers.OrderedPool, "_shut", late)
    for _ in range(3):
        loader = make(blobs, num_threads=2, prefetch=1)
        iterator = iter(loader)
        next(iterator)
        # From another thread, as _end_threads_at_exit does, while this one waits in next().
        hook = threading.Timer(0.01, iterator._pool._group.cancel)  # type: ignore[attr-defined]
        hook.start()
        with pytest.raises(LoaderClosedError):  # the main thread's _exiting(): not Cancelled
            while True:
                next(iterator)
        hook.join()
        loader.close()


def test_a_next_that_close_wakes_raises_at_once_beside_a_stuck_reader() -> None:
    """The woken next() closed the pool again and waited another second for the stuck reader's thread
    (and so did every later next() and close()). A later close() waits for the readers only to the
    first close's deadline, never a second of its own."""
    release = threading.Event()

    class Stuck:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> Any:
            release.wait(30)  # a read that does not return
            raise OSError("released")

    loader = ThreadLoader(Stuck(), batch_size=2, num_threads=1, device="cpu")
    iterator = iter(loader)
    closer = threading.Timer(0.2, loader.close)
    closer.start()
    started = time.perf_counter()
    with pytest.raises(LoaderClosedError):
        next(iterator)
    woken = time.perf_counter() - started
    loader.close()
    closed_again = time.perf_counter() - started
    release.set()
    closer.join()
    # The first close, at 0.2 s, waits for the stuck reader until 0.2 + JOIN_TIMEOUT (1 s).
    assert woken < 0.8 and closed_again < 1.7, (woken, closed_again)


_EXIT_DURING_THREADED_PILLOW = """
import os, sys, threading, time
from threadloader.decode import PillowDecoder, pillow

def slow(data, *, max_pixels):  # a large photo's decode
    if threading.current_thread().name == "user":  # in the caller's thread, not the call's pool
        os.write(2, b"decoded in the daemon thread at exit\\n")
    time.sleep(0.1)
    import numpy as np
    return np.zeros((2, 2, 3), np.uint8)

pillow.decode_rgb = slow
decoder = PillowDecoder(threads=2)
threading.Thread(
    target=decoder.decode, args=([b"x"] * 40,), kwargs={"stream": None}, daemon=True, name="user"
).start()
time.sleep(0.3)
print(time.time(), flush=True)  # the script ends here
"""


def test_an_exit_during_a_threaded_pillow_call_waits_for_a_few_images_not_the_batch() -> None:
    """A pool runs all it was handed before the interpreter ends: given the batch's 40 images at once,
    the exit waited about 2 s for them (a GPU loader's CPU start, a script that fails at its first step)."""
    child = subprocess.run(
        [sys.executable, "-c", _EXIT_DURING_THREADED_PILLOW], capture_output=True, text=True, timeout=60
    )
    ended = time.time()
    assert child.returncode == 0, child.stderr
    assert ended - float(child.stdout.split()[-1]) < 1.0
    # The pool refuses work once the exit has begun: that raised in the caller's thread (a traceback at
    # every such exit, and at times an abort as the thread unwound while the interpreter finalized).
    assert "Traceback" not in child.stderr, child.stderr
    # Nor does that daemon thread decode the rest itself: it would run torch while the interpreter
    # finalizes. It parks until the process ends.
    assert "decoded in the daemon thread" not in child.stderr, child.stderr


_EXIT_DURING_THREADED_PILLOW_IN_A_THREAD_JOINED = """
import threading, time
import numpy as np
from threadloader.decode import PillowDecoder, pillow

def slow(data, *, max_pixels):
    time.sleep(0.05)
    return np.full((2, 2, 3), len(data), np.uint8)

pillow.decode_rgb = slow

def run():
    batch = PillowDecoder(threads=2).decode([b"x" * n for n in range(1, 21)], stream=None)
    print(batch.errors, [int(batch.image(p)[0, 0, 0]) for p in range(20)], flush=True)

threading.Thread(target=run).start()  # not a daemon: the interpreter waits for it
time.sleep(0.2)
"""


def test_a_threaded_pillow_call_in_a_thread_the_exit_waits_for_decodes_its_whole_batch() -> None:
    """Python joins a non-daemon thread after the pools stop taking work: the rest of its batch is
    decoded in that thread, not lost to an error."""
    child = subprocess.run(
        [sys.executable, "-c", _EXIT_DURING_THREADED_PILLOW_IN_A_THREAD_JOINED],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == f"{{}} {list(range(1, 21))}", child.stdout + child.stderr
    assert "Traceback" not in child.stderr, child.stderr


def test_a_sampler_that_blocks_holds_up_no_next_or_close(blobs: list[bytes]) -> None:
    """A reader took the next task from the user's sampler holding the pool's lock: while the sampler
    blocked (a streaming sampler waiting for indices, a collective call), the consumer could not take a
    batch already made, and close() (and Ctrl-C in it, and the exit hook) waited for the sampler."""
    release = threading.Event()

    class Waiting:
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(4)
            release.wait(20)  # the fifth index comes late
            yield from range(4, len(blobs))

        def __len__(self) -> int:
            return len(blobs)

    loader = ThreadLoader(blobs, batch_size=2, sampler=Waiting(), num_threads=2, device="cpu")
    iterator = iter(loader)
    try:
        started = time.perf_counter()
        assert len(next(iterator)[0]) == 2 and len(next(iterator)[0]) == 2
        assert time.perf_counter() - started < 5  # the sampler is blocked now, in a reader
        started = time.perf_counter()
        loader.close()
        assert time.perf_counter() - started < 3  # a second's wait for the readers, not the sampler's 20
        with pytest.raises(LoaderClosedError):
            next(iterator)
    finally:
        release.set()
    assert wait_for_no_reader_threads(5) == []


def test_a_ctrl_c_in_close_still_closes_every_iteration(
    blobs: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A KeyboardInterrupt out of the first iterator's close left the loop over them: a second live
    iteration kept its readers and went on yielding batches, and the runtime stayed open."""
    loader = ThreadLoader(blobs, batch_size=2, num_threads=2, device="cpu")
    first, second = iter(loader), iter(loader)
    next(first), next(second)
    close = type(first).close
    interrupted: list[object] = []

    def close_then_interrupt(self: Any, **options: Any) -> None:
        close(self, **options)
        if not interrupted:
            interrupted.append(self)
            raise KeyboardInterrupt

    monkeypatch.setattr(type(first), "close", close_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    assert len(interrupted) == 1
    for iterator in (first, second):
        with pytest.raises(LoaderClosedError):
            next(iterator)
    assert wait_for_no_reader_threads(3) == []


def test_an_interrupt_while_a_pass_starts_leaves_no_readers(
    blobs: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C after the pass's pool started and before its iterator owned it left the readers
    running, owned by nobody: the loader's close() did not see them."""
    from threadloader import loader as module

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    loader = ThreadLoader(blobs, batch_size=2, num_threads=2, device="cpu")
    monkeypatch.setattr(module._EpochIterator, "__init__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        iter(loader)
    assert wait_for_no_reader_threads(3) == []
    loader.close()


def test_a_loader_whose_constructor_fails_after_its_runtime_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A constructor that raised after the Runtime was built (pin_memory's warning made an error, a
    Ctrl-C) left its decoder, and on a GPU its warm-up, to nobody: __del__ skips a half-made loader."""
    import warnings

    import threadloader._runtime

    closes: list[int] = []

    class Built(PillowDecoder):
        def close(self) -> None:
            closes.append(1)

    monkeypatch.setattr(threadloader._runtime, "build_decoder", lambda *_, **__: Built())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Warning, match="pin_memory=True, but CUDA is not available"):
            ThreadLoader([b""], batch_size=1, device="cpu", pin_memory=True)
    assert closes == [1]
