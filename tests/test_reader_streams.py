"""Reader streams are leased from the process's pool and given back when their loader closes.

Torch keeps, per stream, the caching allocator's freed blocks (reused only by allocations on that
stream) and a cuBLAS workspace per cuBLAS handle that ran a matrix product on it. Loaders built in turn
on fresh streams each left both behind; leased streams are the same few, loader after loader. The
streams here are stand-ins made by the pool's factory, so the lending is seen on a machine without a
GPU (tests/test_gpu_streams.py checks it with CUDA streams).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from threadloader import ThreadLoader, _runtime
from threadloader._handoff import ReaderStream, StreamPool

from .conftest import GatedDecoder, HashesInsideTheLock, encode, photo

GPU = torch.device("cuda", 0)


class _Made:
    """A factory of stand-in streams: each one a new object, the calls noted."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.device, bool]] = []

    def __call__(self, device: torch.device, high_priority: bool) -> object:
        self.calls.append((device, high_priority))
        return object()


def test_a_stream_given_back_is_lent_again_and_a_new_one_made_only_when_all_are_lent() -> None:
    made = _Made()
    pool = StreamPool(made)
    first, second = pool.lease(GPU, high_priority=True), pool.lease(GPU, high_priority=True)
    assert first is not second and len(made.calls) == 2
    pool.give_back(GPU, second, high_priority=True)
    pool.give_back(GPU, first, high_priority=True)
    assert pool.lease(GPU, high_priority=True) is first  # the one given back last
    assert pool.lease(GPU, high_priority=True) is second
    assert len(made.calls) == 2
    # Another priority or device is another kind: never lent a stream of this one.
    pool.give_back(GPU, first, high_priority=True)
    other = [pool.lease(GPU, high_priority=False), pool.lease(torch.device("cuda", 1), high_priority=True)]
    assert first not in other
    assert made.calls[2:] == [(GPU, False), (torch.device("cuda", 1), True)]


def test_readers_leasing_at_once_each_get_a_stream_of_their_own() -> None:
    pool = StreamPool(_Made())
    for _ in range(4):  # some given back first, so leases take from the free list and make new ones
        pool.give_back(GPU, object(), high_priority=True)
    together = threading.Barrier(16, timeout=10)
    got: list[Any] = []

    def lease() -> None:
        together.wait()
        got.append(pool.lease(GPU, high_priority=True))

    threads = [threading.Thread(target=lease) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len({id(stream) for stream in got}) == len(got) == 16


def test_a_reader_stream_is_given_back_once_however_often_it_is_released() -> None:
    pool = StreamPool(_Made())
    reader = ReaderStream(GPU, pool=pool)
    reader.release()
    reader.release()  # a close repeated after a Ctrl-C
    assert pool.lease(GPU, high_priority=True) is reader.stream
    assert pool.lease(GPU, high_priority=True) is not reader.stream  # not lent twice


def test_a_cpu_reader_has_no_stream_and_nothing_to_give_back() -> None:
    made = _Made()
    reader = ReaderStream(torch.device("cpu"), pool=StreamPool(made))
    reader.release()
    assert reader.stream is None and made.calls == []


def test_closing_a_loader_gives_its_readers_streams_back_for_the_next_loader() -> None:
    """The wiring: a loader's close ends with its readers' release (stand-ins on a CPU loader)."""
    pool = StreamPool(_Made())
    samples = [(encode(photo(40, 32, seed=i)), i) for i in range(4)]
    loader = ThreadLoader(samples, batch_size=2, num_threads=2)
    assert len(list(loader)) == 2
    # After the pass: the readers' threads have ended, and a CPU loader's readers have no stream.
    readers = [ReaderStream(GPU, pool=pool) for _ in range(2)]
    loader._runtime.readers = readers
    loader.close()
    assert {id(pool.lease(GPU, high_priority=True)) for _ in range(2)} == {id(r.stream) for r in readers}


def test_a_runtime_whose_warm_up_fails_to_start_gives_its_streams_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No runtime reaches the caller to be closed: the constructor gives the streams back itself."""
    pool = StreamPool(_Made())
    leased: list[ReaderStream] = []

    def reader_stream(_device: torch.device) -> ReaderStream:  # stand-ins for a GPU loader's streams
        leased.append(ReaderStream(GPU, pool=pool))
        return leased[-1]

    def failing_warmup(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("the warm-up could not start")

    monkeypatch.setattr(_runtime, "ReaderStream", reader_stream)
    monkeypatch.setattr(_runtime, "Warmup", failing_warmup)
    decoder = GatedDecoder()
    decoder.warms_up = True  # type: ignore[misc]
    samples = [(encode(photo(40, 32, seed=i)), i) for i in range(4)]
    with pytest.raises(RuntimeError, match="could not start"):
        ThreadLoader(samples, batch_size=2, num_threads=2, decoder=decoder)
    assert len(leased) == 2
    assert {id(pool.lease(GPU, high_priority=True)) for _ in range(2)} == {id(r.stream) for r in leased}


def test_closing_a_micro_batcher_gives_its_workers_streams_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batcher's workers run the user's model on leased streams of the default priority."""
    from threadloader import MicroBatcher, service

    made = _Made()
    pool = StreamPool(made)
    leased: list[ReaderStream] = []

    def worker_stream(_device: torch.device, *, high_priority: bool) -> ReaderStream:
        leased.append(ReaderStream(GPU, pool=pool, high_priority=high_priority))
        return leased[-1]

    monkeypatch.setattr(service, "ReaderStream", worker_stream)
    batcher = MicroBatcher(lambda inputs: inputs, num_threads=2)  # no request: the stand-ins stay unused
    batcher.close()
    batcher.close()  # twice: given back once
    assert made.calls == [(GPU, False), (GPU, False)]
    assert {id(pool.lease(GPU, high_priority=False)) for _ in range(2)} == {id(r.stream) for r in leased}
    assert len(made.calls) == 2


def test_a_stream_given_back_from_inside_the_pools_lock_in_the_same_thread_does_not_wait_for_itself() -> None:
    """A loader's finalizer gives its readers' streams back, and the collector may run it anywhere: in
    the pool's own locked code too, in the thread that holds the lock (another loader's lease)."""
    pool = StreamPool(_Made())
    stream = pool.lease(GPU, high_priority=True)

    gives_back = HashesInsideTheLock(lambda: pool.give_back(GPU, stream, high_priority=True))  # a device key
    leased: list[object] = []
    thread = threading.Thread(
        target=lambda: leased.append(pool.lease(gives_back, high_priority=True)),  # type: ignore[arg-type]
        daemon=True,
    )
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the thread waits for the pool's lock that it holds itself"
    assert leased and pool.lease(GPU, high_priority=True) is stream  # given back all the same
