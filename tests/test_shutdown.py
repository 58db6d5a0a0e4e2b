"""Reader threads end on every way out of a loop, nothing leaks, and prefetching stays bounded."""

from __future__ import annotations

import gc
import threading
import time
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from threadloader import LoaderClosedError, ThreadLoader, ThreadLoaderError

from .conftest import encode, photo, pil_reference, reader_threads, wait_for_no_reader_threads

H, W = 16, 24
N = 40


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return [encode(photo(H, W, seed=i), quality=90) for i in range(N)]


@pytest.fixture(scope="module")
def refs(blobs: list[bytes]) -> list[np.ndarray]:
    return [pil_reference(b) for b in blobs]


class Slow(Dataset):
    """(bytes, index) after a short sleep, so that threads are mid-batch when the consumer leaves."""

    def __init__(self, blobs: list[bytes], delay: float = 0.005) -> None:
        self.blobs = blobs
        self.delay = delay

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[bytes, int]:
        time.sleep(self.delay)
        return self.blobs[index], index


def make(blobs: list[bytes], **options) -> ThreadLoader:
    options = {"batch_size": 2, "num_threads": 3, "prefetch": 2, **options}
    return ThreadLoader(Slow(blobs), **options)


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


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_exception_in_the_loop_body(blobs: list[bytes], refs: list[np.ndarray], error: type) -> None:
    before = threading.active_count()
    loader = make(blobs)
    seen = []
    with pytest.raises(error, match="consumer failed"):
        for _, targets in loader:
            seen.append(targets.tolist())
            if len(seen) == 2:
                raise error("consumer failed")
    assert seen == [[0, 1], [2, 3]]
    assert_all_ended(before)
    assert [t.tolist() for _, t in loader][:2] == [[0, 1], [2, 3]]  # a new pass still works
    assert_all_ended(before)


def test_close_mid_iteration(blobs: list[bytes]) -> None:
    before = threading.active_count()
    loader = make(blobs)
    seen = []
    for _, targets in loader:
        seen.append(targets.tolist())
        if len(seen) == 2:
            start = time.monotonic()
            loader.close()
            assert time.monotonic() - start < 1.0
            assert reader_threads() == []
    assert seen == [[0, 1], [2, 3]]  # the loop ended at close()
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
    assert list(iterator) == []
    assert_all_ended(before)


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
        [(b, i) for i, b in enumerate(blobs[:6])], batch_size=2, num_threads=3, shuffle=True
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
    loader = ThreadLoader(dataset, batch_size=batch_size, num_threads=num_threads, prefetch=prefetch)
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
