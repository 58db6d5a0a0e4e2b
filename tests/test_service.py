"""BatchDecoder: results matched to callers under concurrency, micro-batching, backpressure, errors,
shutdown, and the example server and load test."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import queue
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import pytest
import torch
import torch.nn.functional as F

import threadloader._runtime
import threadloader._workers
from threadloader import BatchDecoder, LoaderClosedError, SampleError, ThreadLoaderError
from threadloader.decode import DecodedBatch, ImageDecoder, PillowDecoder
from threadloader.service import MicroBatcher, QueueFullError

from .conftest import (
    GatedDecoder,
    encode,
    gpu_mismatch,
    header_only_png,
    photo,
    post_predict,
    reader_threads,
    run_script,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
N = 48


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    """Small JPEGs of different sizes, so that a result given to the wrong caller cannot match."""
    return [encode(photo(16 + i % 5, 24 + i % 7, seed=i), quality=90) for i in range(N)]


def assert_image(image: torch.Tensor, ref: np.ndarray) -> None:
    np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), ref)


@pytest.fixture
def gated() -> Iterator[GatedDecoder]:
    decoder = GatedDecoder()
    yield decoder
    decoder.gate.set()  # never leave a worker blocked, whatever the test did


def plugged(decoder: GatedDecoder, **options: object) -> tuple[BatchDecoder, concurrent.futures.Future]:
    """A one-worker service whose worker is blocked in the decoder on a first request."""
    service = BatchDecoder(decoder=decoder, num_threads=1, max_delay_ms=0, **options)  # type: ignore[arg-type]
    plug = service.submit(encode(photo(8, 8)))
    assert decoder.entered.wait(5)
    return service, plug


def test_concurrent_submit_from_16_threads(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    start = threading.Barrier(16)
    with BatchDecoder(device="cpu", max_batch=8, max_delay_ms=5, num_threads=2) as service:

        def caller(offset: int) -> list[tuple[int, concurrent.futures.Future]]:
            start.wait()
            picks = [(offset * 5 + k) % N for k in range(12)]
            return [(i, service.submit(blobs[i])) for i in picks]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            submitted = [pair for pairs in pool.map(caller, range(16)) for pair in pairs]
        for index, future in submitted:
            assert_image(future.result(timeout=10), refs[index])
        stats = service.stats()
    assert stats.submitted == stats.completed == 16 * 12
    assert stats.failed == stats.cancelled == stats.rejected == stats.queue_depth == 0
    assert sum(size * n for size, n in stats.batch_sizes.items()) == 16 * 12
    assert max(stats.batch_sizes) <= 8


def test_decode_and_decode_many(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    with BatchDecoder(device="cpu", num_threads=2) as service:
        assert_image(service.decode(blobs[0]), refs[0])
        for image, ref in zip(service.decode_many(blobs), refs, strict=True):
            assert_image(image, ref)
        assert service.decode_many([]) == []
        with pytest.raises(TypeError, match="not its path"):
            service.submit("photo.jpg")  # type: ignore[arg-type]


def chw_float(ref: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(ref).permute(2, 0, 1).float()


def bilinear(image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """torch's antialiased bilinear resize of one float (3, H, W) image: the reference filter."""
    return F.interpolate(image[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def test_output_format_as_the_loader(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.3, 0.4)
    options = {"size": (20, 30), "dtype": torch.float32, "mean": mean, "std": std}
    with BatchDecoder(device="cpu", channels_last=True, **options) as service:  # type: ignore[arg-type]
        images = service.decode_many(blobs[:6])
    for image, ref in zip(images, refs[:6], strict=True):
        assert image.shape == (3, 20, 30) and image.dtype == torch.float32
        assert image.stride() == (1, 30 * 3, 3)  # a view of a channels_last batch: HWC in memory
        # Spelled out: scaled to [0, 1], minus the mean, over the std, per channel.
        expected = (
            bilinear(chw_float(ref), (20, 30)) / 255 - torch.tensor(mean).view(3, 1, 1)
        ) / torch.tensor(std).view(3, 1, 1)
        torch.testing.assert_close(image, expected, rtol=0, atol=1e-5)


def test_asyncio(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    async def main(service: BatchDecoder) -> list[torch.Tensor]:
        return await asyncio.gather(*(service.adecode(data) for data in blobs))

    with BatchDecoder(device="cpu", max_batch=16, max_delay_ms=5, num_threads=2) as service:
        for image, ref in zip(asyncio.run(main(service)), refs, strict=True):
            assert_image(image, ref)
        with pytest.raises(SampleError):
            asyncio.run(service.adecode(b"not an image"))


def test_batching_happens_without_a_gate(blobs: list[bytes]) -> None:
    with BatchDecoder(device="cpu", max_batch=16, max_delay_ms=500, num_threads=1) as service:
        futures = [service.submit(blobs[i % N]) for i in range(64)]
        concurrent.futures.wait(futures, timeout=10)
        sizes = service.stats().batch_sizes
    assert max(sizes) > 1 and max(sizes) <= 16
    assert sum(size * n for size, n in sizes.items()) == 64


def test_max_batch_and_what_is_queued_goes_together(gated: GatedDecoder, blobs: list[bytes]) -> None:
    service, plug = plugged(gated, max_batch=8)
    with service:
        futures = [service.submit(blobs[i]) for i in range(20)]  # queued while the worker is blocked
        assert service.stats().queue_depth == 20
        gated.gate.set()
        concurrent.futures.wait([plug, *futures], timeout=10)
    assert gated.sizes == [1, 8, 8, 4]
    assert service.stats().batch_sizes == {1: 1, 4: 1, 8: 2}


def test_max_delay_waits_for_company(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    with BatchDecoder(device="cpu", max_delay_ms=100, num_threads=1) as service:
        started = time.perf_counter()
        assert_image(service.decode(blobs[0]), refs[0])
        assert 0.09 < time.perf_counter() - started < 2
        p50 = service.stats().latency_ms_p50
        assert p50 is not None and p50 >= 90


def test_backpressure_raise(gated: GatedDecoder, blobs: list[bytes]) -> None:
    service, plug = plugged(gated, max_batch=1, max_queue=2, when_full="raise")
    with service:
        queued = [service.submit(blobs[0]), service.submit(blobs[1])]
        with pytest.raises(QueueFullError, match="max_queue=2") as caught:
            service.submit(blobs[2])
        assert isinstance(caught.value, queue.Full) and isinstance(caught.value, ThreadLoaderError)

        async def shed() -> None:
            await service.adecode(blobs[2])

        with pytest.raises(QueueFullError):
            asyncio.run(shed())
        stats = service.stats()
        assert (stats.queue_depth, stats.submitted, stats.rejected) == (2, 3, 2)
        gated.gate.set()
        for future in [plug, *queued]:
            future.result(timeout=5)


def test_decode_many_cancels_what_it_queued_when_it_does_not_fit(
    gated: GatedDecoder, blobs: list[bytes]
) -> None:
    service, plug = plugged(gated, max_batch=1, max_queue=2, when_full="raise")
    with pytest.raises(QueueFullError):
        service.decode_many(blobs[:3])
    gated.gate.set()
    service.close()
    plug.result()
    stats = service.stats()
    assert (stats.submitted, stats.completed, stats.cancelled, stats.rejected) == (3, 1, 2, 1)


def test_backpressure_block(gated: GatedDecoder, blobs: list[bytes], refs: list[np.ndarray]) -> None:
    service, plug = plugged(gated, max_batch=1, max_queue=2)
    with service:
        queued = [service.submit(blobs[0]), service.submit(blobs[1])]
        started = time.perf_counter()
        with pytest.raises(QueueFullError, match="max_queue=2"):
            service.submit(blobs[2], timeout=0.05)
        assert time.perf_counter() - started >= 0.05
        blocked: list[concurrent.futures.Future] = []
        submitter = threading.Thread(target=lambda: blocked.append(service.submit(blobs[2])))
        submitter.start()

        async def waits_for_room() -> torch.Tensor:
            return await service.adecode(blobs[3])  # woken by a freed slot, never blocking the loop

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(asyncio.run, waits_for_room())
            submitter.join(0.1)
            assert submitter.is_alive() and not waiting.done()  # both wait for room
            gated.gate.set()
            submitter.join(5)
            assert_image(waiting.result(timeout=5), refs[3])
        for future, index in zip([*queued, *blocked], [0, 1, 2], strict=True):
            assert_image(future.result(timeout=5), refs[index])
        plug.result(timeout=5)


def test_blocked_submit_ends_on_close(gated: GatedDecoder, blobs: list[bytes]) -> None:
    service, _ = plugged(gated, max_batch=1, max_queue=1)
    service.submit(blobs[0])
    errors: list[BaseException] = []

    def submit() -> None:
        try:
            service.submit(blobs[1])
        except BaseException as exc:
            errors.append(exc)

    submitter = threading.Thread(target=submit)
    submitter.start()
    submitter.join(0.05)
    threading.Timer(0.05, gated.gate.set).start()
    service.close(cancel_pending=True)
    submitter.join(2)
    assert not submitter.is_alive() and isinstance(errors[0], LoaderClosedError)


def test_bad_image_fails_only_its_own_future(
    gated: GatedDecoder, blobs: list[bytes], refs: list[np.ndarray], caplog: pytest.LogCaptureFixture
) -> None:
    truncated = blobs[3][: len(blobs[3]) // 2]
    inputs = [blobs[0], b"not an image", blobs[1], truncated, blobs[2]]
    service, plug = plugged(gated, max_batch=8)
    with service:
        futures = [service.submit(data) for data in inputs]
        gated.gate.set()
        concurrent.futures.wait([plug, *futures], timeout=10)
        stats = service.stats()
    assert gated.sizes == [1, 5]  # one micro-batch held the good and the bad
    for future, index in zip([futures[0], futures[2], futures[4]], [0, 1, 2], strict=True):
        assert_image(future.result(), refs[index])
    for future, reason in ((futures[1], "cannot identify image"), (futures[3], "truncated")):
        error = future.exception()
        assert isinstance(error, SampleError) and error.stage == "decode" and reason in error.reason.lower()
    # The decoder's own exception is chained: Pillow's kind of error for bytes it cannot identify.
    assert isinstance(futures[1].exception().__cause__, PIL.UnidentifiedImageError)  # type: ignore[union-attr]
    assert futures[1].exception().index == 2  # type: ignore[union-attr]  # its submission number
    assert (stats.completed, stats.failed) == (4, 2)


def test_pixel_limit_fails_the_request(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    big = encode(photo(40, 50), quality=90)
    with BatchDecoder(device="cpu", max_pixels=30 * 40) as service:
        with pytest.raises(SampleError, match="over the limit of 1,200"):
            service.decode(big)
        with pytest.raises(SampleError, match="limit"):  # from the header: this file has no pixel data
            service.decode(header_only_png(4000, 3000))
        assert_image(service.decode(blobs[0]), refs[0])


def test_a_failing_batch_fails_its_requests_and_the_service_goes_on(
    blobs: list[bytes], refs: list[np.ndarray]
) -> None:
    class Flaky(PillowDecoder):
        calls = 0

        def decode(self, encoded, *, stream, stats=None, region_of=None, pad=False):  # type: ignore[no-untyped-def]
            Flaky.calls += 1
            if Flaky.calls == 1:
                raise MemoryError("out of memory")
            return super().decode(encoded, stream=stream, stats=stats)

    with BatchDecoder(decoder=Flaky(), num_threads=1) as service:
        with pytest.raises(MemoryError):
            service.decode(blobs[0])
        assert_image(service.decode(blobs[1]), refs[1])
        assert (service.stats().failed, service.stats().completed) == (1, 1)


def test_close_finishes_pending(gated: GatedDecoder, blobs: list[bytes], refs: list[np.ndarray]) -> None:
    service, plug = plugged(gated, max_batch=2)
    futures = [service.submit(blobs[i]) for i in range(6)]
    threading.Timer(0.1, gated.gate.set).start()
    service.close()
    assert plug.done() and all(future.done() for future in futures)
    for future, ref in zip(futures, refs[:6], strict=True):
        assert_image(future.result(), ref)
    assert not any(thread.is_alive() for thread in service.threads) and reader_threads() == []
    with pytest.raises(LoaderClosedError):
        service.submit(blobs[0])
    service.close()  # idempotent


def test_close_cancels_pending(gated: GatedDecoder, blobs: list[bytes], refs: list[np.ndarray]) -> None:
    service, plug = plugged(gated, max_batch=2)
    futures = [service.submit(blobs[i]) for i in range(6)]
    threading.Timer(0.1, gated.gate.set).start()
    started = time.perf_counter()
    service.close(cancel_pending=True)
    assert time.perf_counter() - started < 1.5
    assert plug.result() is not None  # the batch being decoded still completes
    assert all(future.cancelled() for future in futures)
    assert service.stats().cancelled == 6
    assert not any(thread.is_alive() for thread in service.threads) and reader_threads() == []
    with pytest.raises(LoaderClosedError):
        asyncio.run(service.adecode(blobs[0]))


def test_cancelled_future_is_dropped(gated: GatedDecoder, blobs: list[bytes], refs: list[np.ndarray]) -> None:
    service, _ = plugged(gated, max_batch=8)
    with service:
        dropped, kept = service.submit(blobs[0]), service.submit(blobs[1])
        assert dropped.cancel()
        gated.gate.set()
        assert_image(kept.result(timeout=5), refs[1])
    assert gated.sizes == [1, 1]
    stats = service.stats()
    assert (stats.submitted, stats.completed, stats.cancelled) == (3, 2, 1)


def test_dropping_the_service_stops_its_threads(blobs: list[bytes]) -> None:
    service = BatchDecoder(device="cpu", num_threads=3)
    future = service.submit(blobs[0])
    assert len(reader_threads()) == 3
    future.result(timeout=5)
    del service
    gc.collect()
    deadline = time.monotonic() + 2
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reader_threads() == []


def test_stats_latency_and_invariants(blobs: list[bytes]) -> None:
    with BatchDecoder(device="cpu", num_threads=2) as service:
        assert service.stats().latency_ms_p50 is None
        service.decode_many(blobs)
        stats = service.stats()
    assert stats.latency_ms_p50 is not None and stats.latency_ms_p90 is not None
    assert stats.latency_ms_p99 is not None
    assert 0 < stats.latency_ms_p50 <= stats.latency_ms_p90 <= stats.latency_ms_p99
    assert stats.submitted == stats.completed + stats.failed + stats.cancelled == N
    assert stats.stage_seconds["decode"] > 0
    assert 0 < stats.stage_cpu_seconds["decode"] <= stats.stage_seconds["decode"] * 1.05  # timer grain


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_batch": 0}, "max_batch"),
        ({"max_delay_ms": -1}, "max_delay_ms"),
        ({"max_queue": 0}, "max_queue"),
        ({"when_full": "drop"}, "when_full"),
        ({"num_threads": 0}, "num_threads"),
        ({"mean": (0.5, 0.5, 0.5), "std": (0.2, 0.2, 0.2)}, "float dtype"),
    ],
)
def test_bad_options(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchDecoder(device="cpu", **options)  # type: ignore[arg-type]


@pytest.mark.gpu
def test_gpu_concurrent_submit_on_callers_streams(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    """Each caller reads its results on its own busy stream without syncing first: the service made that
    stream wait for the decode and kept the memory from being reused while its kernels were queued."""
    start = threading.Barrier(16)
    with BatchDecoder(device="cuda", max_batch=16, max_delay_ms=2, num_threads=2) as service:

        def caller(offset: int) -> list[tuple[int, torch.Tensor]]:
            stream = torch.cuda.Stream()
            copies = []
            with torch.cuda.stream(stream):
                slow = torch.randn(1024, 1024, device="cuda")
                start.wait()
                picks = [(offset * 5 + k) % N for k in range(24)]
                futures = [(i, service.submit(blobs[i])) for i in picks]
                for i, future in futures:
                    image = future.result(timeout=30)
                    slow = slow @ slow  # queued before the copy, so a reused block would be overwritten
                    slow = slow / slow.norm()
                    copies.append((i, image.clone()))
                    del image
            stream.synchronize()
            return copies

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = [pair for pairs in pool.map(caller, range(16)) for pair in pairs]
        assert max(service.stats().batch_sizes) > 1
    for index, image in results:
        assert image.is_cuda and image.shape == (3, *refs[index].shape[:2])
        assert gpu_mismatch(image, refs[index]) is None


@pytest.mark.gpu
def test_gpu_micro_batcher_after_the_decoder_on_callers_streams(
    blobs: list[bytes], refs: list[np.ndarray]
) -> None:
    """Decoded on the GPU, then through a MicroBatcher whose function returns CUDA tensors: each caller,
    on a busy stream of its own, reads its result without a sync (the batcher's stream waited for the
    caller's, and its result was handed back by event)."""
    calls: list[int] = []

    def doubled(images: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(len(images))
        return [image.float() * 2 for image in images]

    with (
        BatchDecoder(device="cuda", max_batch=16, max_delay_ms=2) as decoder,
        MicroBatcher(doubled, max_batch=16, max_delay_ms=5, device="cuda") as batcher,
    ):

        def caller(index: int) -> torch.Tensor:
            with torch.cuda.stream(torch.cuda.Stream()):
                slow = torch.randn(1024, 1024, device="cuda")
                for _ in range(4):
                    slow = slow @ slow / 1024  # the stream is busy when the image is decoded on it
                result = batcher.run(decoder.decode(blobs[index]))
                return (result / 2).cpu()  # on this stream: no sync before

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(caller, range(N)))
    assert sum(calls) == N and len(calls) < N
    for index, image in enumerate(results):
        assert gpu_mismatch(image, refs[index]) is None


def _start_server(*options: str) -> tuple[subprocess.Popen[str], int]:
    command = [sys.executable, str(EXAMPLES / "server.py"), "--port", "0", *options]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = server.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("listening on http://127.0.0.1:"), line
    return server, int(line.rsplit(":", 1)[1])


def test_example_server_and_load_test(tmp_path: Path) -> None:
    server, port = _start_server("--device", "cpu", "--mode", "batched")
    try:
        status, answer = post_predict(port, encode(photo(60, 80), quality=90))
        assert status == 200 and answer["shape"] == [3, 224, 224]
        assert "top5" in answer or isinstance(answer["checksum"], float)
        status, answer = post_predict(port, b"not an image")
        assert status == 400 and "is not an image this server decodes" in str(answer["error"])
        out = tmp_path / "load.json"
        load = [sys.executable, str(EXAMPLES / "loadtest.py"), "--port", str(port), "--seconds", "1"]
        load += ["--concurrency", "2", "--warmup", "0", "--images", "8", "--out", str(out)]
        done = subprocess.run(load, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert "| mode | clients | req/s |" in done.stdout
        (row,) = json.loads(out.read_text())["rows"]
        assert row["requests"] > 0 and row["errors"] == 0 and row["p99_ms"] >= row["p50_ms"] > 0
    finally:
        server.terminate()
        assert server.wait(10) == 0
        server.stdout.close()  # type: ignore[union-attr]


def test_deterministic_transforms_as_the_loader(blobs: list[bytes], refs: list[np.ndarray]) -> None:
    from threadloader.transforms import CenterCrop, Resize

    with BatchDecoder(device="cpu", transform=[Resize(12), CenterCrop(10)]) as service:
        images = service.decode_many(blobs[:4])
    for image, ref in zip(images, refs[:4], strict=True):
        height, width = ref.shape[:2]  # wider than high: the height becomes 12
        resized = bilinear(chw_float(ref), (12, int(12 * width / height))).round().clamp(0, 255)
        left = round((resized.shape[2] - 10) / 2)
        expected = resized[:, 1:11, left : left + 10].to(torch.uint8)
        assert image.shape == (3, 10, 10) and image.dtype == torch.uint8
        assert (image.int() - expected.int()).abs().max() <= 1  # a resampled value may round otherwise


def test_random_transforms_are_refused() -> None:
    from threadloader.transforms import RandomHorizontalFlip

    with pytest.raises(ValueError, match="random"):
        BatchDecoder(device="cpu", transform=[RandomHorizontalFlip()])


def test_a_cancelled_request_frees_its_slot_at_once(gated: GatedDecoder, blobs: list[bytes]) -> None:
    """A client that goes away makes room for the next one before any worker reaches its request."""
    service, plug = plugged(gated, max_batch=8, max_queue=2, when_full="raise")
    with service:
        leaving, staying = service.submit(blobs[0]), service.submit(blobs[1])
        with pytest.raises(QueueFullError):
            service.submit(blobs[2])
        assert leaving.cancel()
        assert service.stats().queue_depth == 1  # gone from the queue, with the worker still blocked
        newcomer = service.submit(blobs[2])  # its slot
        gated.gate.set()
        for future in (plug, staying, newcomer):
            future.result(timeout=5)
    assert gated.sizes == [1, 2]  # the cancelled request was never decoded
    stats = service.stats()
    assert (stats.submitted, stats.completed, stats.cancelled, stats.rejected) == (4, 3, 1, 1)


def test_adecode_cancelled_by_its_caller_frees_its_slot(gated: GatedDecoder, blobs: list[bytes]) -> None:
    service, plug = plugged(gated, max_batch=8, max_queue=4)

    async def client_goes_away() -> None:
        task = asyncio.ensure_future(service.adecode(blobs[0]))
        while service.stats().queue_depth == 0:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)  # the future's cancellation reaches the queue on the loop's next turn

    with service:
        asyncio.run(client_goes_away())
        stats = service.stats()
        assert (stats.queue_depth, stats.cancelled) == (0, 1)  # the worker is still blocked
        gated.gate.set()
        plug.result(timeout=5)
    assert gated.sizes == [1]


def test_adecode_awaits_a_freed_slot_and_gives_up_after_its_timeout(
    gated: GatedDecoder, blobs: list[bytes], refs: list[np.ndarray]
) -> None:
    service, plug = plugged(gated, max_batch=8, max_queue=1)

    async def main() -> torch.Tensor:
        queued = service.submit(blobs[0])
        started = time.perf_counter()
        with pytest.raises(QueueFullError, match="max_queue=1"):
            await service.adecode(blobs[1], timeout=0.05)
        assert 0.05 <= time.perf_counter() - started < 1.0
        waiting = asyncio.ensure_future(service.adecode(blobs[2], timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        queued.cancel()  # frees the slot: the waiter is woken and takes it, with the worker still blocked
        freed = time.perf_counter()
        while service.stats().queue_depth == 0:
            await asyncio.sleep(0.001)
        assert time.perf_counter() - freed < 0.5  # woken by the freed slot, not by its timeout
        gated.gate.set()
        return await waiting

    with service:
        assert_image(asyncio.run(main()), refs[2])
        plug.result(timeout=5)
    stats = service.stats()
    assert (stats.submitted, stats.completed, stats.cancelled, stats.rejected) == (3, 2, 1, 1)


def _sums(batches: list[int]) -> MicroBatcher[torch.Tensor, torch.Tensor]:
    """A batcher whose function sums each input, one call per batch, recording each batch's size."""

    def total(inputs: list[torch.Tensor]) -> torch.Tensor:
        batches.append(len(inputs))
        return torch.stack(inputs).flatten(1).sum(dim=1)

    return MicroBatcher(total, max_batch=16, max_delay_ms=50)


def test_micro_batcher_calls_its_function_once_per_batch() -> None:
    inputs = [torch.arange(12, dtype=torch.float64).reshape(3, 4) * i for i in range(64)]
    batches: list[int] = []
    start = threading.Barrier(16)

    def client(first: int) -> list[float]:
        start.wait()
        futures = [batcher.submit(inputs[i]) for i in range(first, 64, 16)]
        return [float(future.result(timeout=10)) for future in futures]

    with _sums(batches) as batcher, concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(client, range(16)))
        stats = batcher.stats()
    for first, got in enumerate(answers):
        assert got == [float(inputs[i].sum()) for i in range(first, 64, 16)]
    assert sum(batches) == 64 and max(batches) <= 16 and len(batches) < 64  # batched, within max_batch
    assert stats.batch_sizes == {size: batches.count(size) for size in set(batches)}
    assert (stats.submitted, stats.completed, stats.batches) == (64, 64, len(batches))


def test_micro_batcher_chained_after_the_decoder_from_asyncio(
    blobs: list[bytes], refs: list[np.ndarray]
) -> None:
    """A service's two stages, each micro-batched: decode, then one call of the 'model' per batch."""
    calls: list[int] = []

    def channel_means(images: list[torch.Tensor]) -> list[list[float]]:
        calls.append(len(images))
        return [image.double().mean(dim=(1, 2)).tolist() for image in images]

    async def main(
        decoder: BatchDecoder, model: MicroBatcher[torch.Tensor, list[float]]
    ) -> list[list[float]]:
        async def one(data: bytes) -> list[float]:
            return await model.arun(await decoder.adecode(data))

        return await asyncio.gather(*(one(data) for data in blobs))

    with (
        BatchDecoder(device="cpu", max_batch=16, max_delay_ms=5) as decoder,
        MicroBatcher(channel_means, max_batch=16, max_delay_ms=20) as model,
    ):
        answers = asyncio.run(main(decoder, model))
    for answer, ref in zip(answers, refs, strict=True):
        np.testing.assert_allclose(answer, ref.reshape(-1, 3).mean(axis=0), rtol=1e-12)
    assert sum(calls) == N and len(calls) < N


def test_micro_batcher_failures_fail_their_batch_only() -> None:
    def strict(inputs: list[int]) -> list[int]:
        if -1 in inputs:
            raise ArithmeticError("a negative input")
        return [2 * x for x in inputs] if 0 not in inputs else []

    with MicroBatcher(strict, max_batch=4, max_delay_ms=0) as batcher:
        with pytest.raises(ArithmeticError, match="a negative input"):
            batcher.run(-1)
        with pytest.raises(ValueError, match="returned 0 results for a micro-batch of 1 inputs"):
            batcher.run(0)
        assert batcher.run(21) == 42  # it goes on
        stats = batcher.stats()
    assert (stats.completed, stats.failed) == (1, 2)


def test_micro_batcher_sheds_load_and_frees_a_cancelled_slot() -> None:
    gate, entered = threading.Event(), threading.Event()

    def slow(inputs: list[int]) -> list[int]:
        entered.set()
        assert gate.wait(10)
        return inputs

    batcher = MicroBatcher(slow, max_batch=4, max_delay_ms=0, max_queue=2, when_full="raise")
    try:
        plug = batcher.submit(0)
        assert entered.wait(5)
        leaving, staying = batcher.submit(1), batcher.submit(2)
        with pytest.raises(QueueFullError, match="MicroBatcher queue is full"):
            batcher.submit(3)

        async def shed() -> None:
            await batcher.arun(3)

        with pytest.raises(QueueFullError):
            asyncio.run(shed())
        leaving.cancel()
        newcomer = batcher.submit(4)
        gate.set()
        assert [f.result(timeout=5) for f in (plug, staying, newcomer)] == [0, 2, 4]
    finally:
        gate.set()
        batcher.close(cancel_pending=True)
    stats = batcher.stats()
    assert (stats.rejected, stats.cancelled, stats.completed) == (2, 1, 3)
    assert not any(thread.is_alive() for thread in batcher.threads)
    with pytest.raises(LoaderClosedError):
        batcher.submit(5)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"fn": None}, TypeError, "fn must be callable"),
        ({"num_threads": 0}, ValueError, "num_threads"),
        ({"num_threads": None}, ValueError, r"num_threads must be an int, got None \(NoneType\)"),
        ({"max_batch": 0}, ValueError, "max_batch"),
        ({"max_batch": 2.5}, ValueError, r"max_batch must be an int, got 2\.5"),
        ({"max_queue": None}, ValueError, r"max_queue must be an int, got None"),
        ({"when_full": "drop"}, ValueError, "when_full"),
        # inf and past threading.TIMEOUT_MAX: a worker's wait raised and the worker died with its
        # requests unanswered; NaN: a lone request waited forever, its worker spinning
        ({"max_delay_ms": float("inf")}, ValueError, "max_delay_ms must be a finite number .*got inf"),
        ({"max_delay_ms": 1e13}, ValueError, "max_delay_ms must be a finite number"),
        ({"max_delay_ms": float("nan")}, ValueError, "max_delay_ms must be a finite number .*got nan"),
        ({"max_delay_ms": None}, ValueError, "max_delay_ms must be a finite number .*got None"),
        ({"max_delay_ms": 10**400}, ValueError, "max_delay_ms must be a finite number"),  # was OverflowError
        # torch's own RuntimeError, naming no argument
        ({"device": "tpu"}, ValueError, r"device must be 'cpu', 'cuda', 'cuda:N' or None, got 'tpu'"),
        ({"device": "meta"}, ValueError, "device must be 'cpu' or a CUDA device, got meta"),
    ],
)
def test_micro_batcher_bad_options(options: dict[str, object], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        MicroBatcher(**{"fn": list, **options})  # type: ignore[arg-type]


@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "1"])
def test_a_bad_timeout_is_refused_at_once(timeout: object) -> None:
    """NaN never ran out: a submit to a full queue spun forever at a whole core."""
    release = threading.Event()

    def held(inputs: list[int]) -> list[int]:
        release.wait(10)
        return inputs

    with MicroBatcher(held, max_batch=1, max_delay_ms=0, max_queue=1) as batcher:
        first = batcher.submit(1)
        time.sleep(0.05)  # taken by the worker
        second = batcher.submit(2)  # fills the queue
        with pytest.raises(
            ValueError, match=f"timeout must be None or a number of seconds, .*got {timeout!r}"
        ):
            batcher.submit(3, timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout must be None or a number of seconds"):
            asyncio.run(batcher.arun(3, timeout=timeout))  # type: ignore[arg-type]
        release.set()
        assert (first.result(5), second.result(5)) == (1, 2)


@pytest.mark.parametrize("timeout", [float("inf"), 10**400])
def test_a_timeout_past_what_a_wait_takes_waits_as_long_as_it_can(timeout: float) -> None:
    """10**400 raised a bare OverflowError converting to float; inf, a lock wait's OverflowError."""
    with MicroBatcher(lambda inputs: inputs, max_delay_ms=0) as batcher:
        assert batcher.submit(7, timeout=timeout).result(5) == 7
        assert asyncio.run(batcher.arun(8, timeout=timeout)) == 8


def test_a_tensor_of_encoded_bytes_is_told_to_go_as_bytes() -> None:
    with (
        BatchDecoder(device="cpu") as service,
        pytest.raises(TypeError, match=r"tensor.numpy\(\).tobytes\(\)"),
    ):
        service.submit(torch.zeros(10, dtype=torch.uint8))  # type: ignore[arg-type]


def test_close_from_the_done_callbacks_of_two_workers_returns(tmp_path: Path) -> None:
    """Two workers answer at once, and each answer's done-callback closes the service: neither may wait
    for the other (each would wait forever), and the interpreter's exit must not wait for them either."""
    script = """
import threading
from threadloader.service import MicroBatcher

both = threading.Barrier(2)

def together(inputs):
    both.wait(10)  # the two workers run a micro-batch each at the same time
    return inputs

service = MicroBatcher(together, num_threads=2, max_batch=1, max_delay_ms=0)
returned = []
def close_service(future):
    service.close()
    returned.append(threading.current_thread().name)
futures = [service.submit(k) for k in range(2)]
for future in futures:
    future.add_done_callback(close_service)
print([future.result(10) for future in futures])
for thread in service.threads:
    thread.join(10)
print(len(returned), [thread.is_alive() for thread in service.threads])
"""
    done = run_script(tmp_path, script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["[0, 1]", "2 [False, False]"]


def test_a_function_that_raises_a_base_exception_fails_its_batch_and_the_service_goes_on() -> None:
    """``asyncio.CancelledError`` (or ``sys.exit()``) from the function is not an ``Exception``: it
    used to end the worker, leaving its requests and every later one unanswered."""
    calls = 0

    def cancelled_once(inputs: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise asyncio.CancelledError("the model's task was cancelled")
        return inputs

    with MicroBatcher(cancelled_once, num_threads=1, max_batch=1, max_delay_ms=0) as service:
        failed = service.submit(1)
        error = failed.exception(10)
        assert isinstance(error, RuntimeError) and isinstance(error.__cause__, asyncio.CancelledError)
        assert service.submit(2).result(10) == 2


def test_a_failed_batch_keeps_nothing_of_its_function_alive() -> None:
    """The error goes to the futures without its frames: with them, it held the function's locals (say
    the activations of a model that ran out of memory) for as long as a caller kept the future, and in
    a cycle through the batch's requests until the garbage collector ran (off here)."""
    freed = threading.Event()

    def out_of_memory(inputs: list[int]) -> list[int]:
        activations = torch.zeros(64)
        weakref.finalize(activations, freed.set)
        raise RuntimeError("CUDA out of memory")

    gc.collect()
    gc.disable()
    try:
        with MicroBatcher(out_of_memory, num_threads=1, max_batch=1, max_delay_ms=0) as service:
            future = service.submit(1)
            error = future.exception(10)
            assert isinstance(error, RuntimeError) and "out of memory" in str(error)
            assert "out_of_memory" in "".join(getattr(error, "__notes__", []))  # its traceback, as text
            assert freed.wait(5), "the function's locals are alive while its caller holds the future"
    finally:
        gc.enable()


@pytest.mark.parametrize(
    ("returned", "name"),
    [
        (None, "NoneType"),
        (map(str, []), "map"),
        # a dict of one item answered its caller with the key; a string, with its first character
        ({1: 10}, "dict"),
        ("a", "str"),
        (torch.tensor(5), "Tensor"),  # a 0-d tensor: torch's "len() of a 0-d tensor"
    ],
)
def test_a_batch_function_returning_no_sequence_says_so(returned: object, name: str) -> None:
    with MicroBatcher(lambda inputs: returned, max_batch=1, max_delay_ms=0) as batcher:  # type: ignore[arg-type,return-value]
        error = batcher.submit(1).exception(10)
    assert isinstance(error, TypeError)
    assert str(error).startswith(f"the batch function returned {name}; return a list (or a tensor or array")


def test_a_cancelled_requests_callback_raising_system_exit_leaves_the_others_cancelled() -> None:
    """close(cancel_pending=True) cancelled the queued requests in a loop that a callback's SystemExit
    ended: the later ones were neither queued nor answered, their callers waiting forever."""
    started, release = threading.Event(), threading.Event()

    def slow(items: list[int]) -> list[int]:
        started.set()
        release.wait(10)
        return items

    def leave(future: concurrent.futures.Future[Any]) -> None:
        sys.exit(1)

    batcher = MicroBatcher(slow, max_batch=1, max_delay_ms=0, num_threads=1)
    first = batcher.submit(0)
    assert started.wait(5)
    queued = [batcher.submit(i) for i in range(1, 4)]
    queued[0].add_done_callback(leave)
    closing = threading.Thread(target=batcher.close, kwargs={"cancel_pending": True})
    closing.start()
    for future in queued:
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(5)
    release.set()
    closing.join(10)
    assert not closing.is_alive() and first.result(5) == 0
    assert batcher.stats().cancelled == 3


@pytest.mark.parametrize("how", ["cancelled by its caller", "dropped by close"])
def test_a_request_cancelled_while_queued_wakes_concurrent_futures_wait(how: str) -> None:
    """cancel() alone does not wake concurrent.futures.wait or as_completed (an executor's taking the
    work does, which a request that leaves the queue never gets): wait([future]) never returned."""
    started, release = threading.Event(), threading.Event()

    def slow(items: list[int]) -> list[int]:
        started.set()
        release.wait(10)
        return items

    batcher = MicroBatcher(slow, max_batch=1, max_delay_ms=0, num_threads=1)
    try:
        running = batcher.submit(1)
        assert started.wait(5)
        queued = batcher.submit(2)
        closing = threading.Thread(target=batcher.close, kwargs={"cancel_pending": True})
        if how == "cancelled by its caller":
            assert queued.cancel()
        else:
            closing.start()  # it waits for the running batch; the queued one is dropped at once
        done, _ = concurrent.futures.wait([queued], timeout=5)
        assert done == {queued} and queued.cancelled()
        assert list(concurrent.futures.as_completed([queued], timeout=5)) == [queued]
    finally:
        release.set()
        batcher.close()
    if closing.ident is not None:
        closing.join(10)
    assert running.result(5) == 1 and batcher.stats().cancelled == 1


def test_a_request_its_caller_finished_while_queued_is_withdrawn(caplog: pytest.LogCaptureFixture) -> None:
    """A caller that gave up with future.set_exception() while its request was queued: the worker's
    set_running_or_notify_cancel() raised RuntimeError, which ended the worker with its requests
    unanswered and every later one waiting forever; then, caught, it still logged a CRITICAL "Future ...
    in unexpected state: FINISHED" from concurrent.futures for each such request."""
    caplog.set_level(logging.DEBUG, logger="concurrent.futures")
    started, release = threading.Event(), threading.Event()

    def slow(items: list[int]) -> list[int]:
        started.set()
        release.wait(10)
        return [10 * x for x in items]

    with MicroBatcher(slow, max_batch=1, max_delay_ms=0, num_threads=1) as batcher:
        first = batcher.submit(1)
        assert started.wait(5)
        given_up = batcher.submit(2)
        given_up.set_exception(TimeoutError("gave up"))
        later = batcher.submit(3)
        release.set()
        assert (first.result(5), later.result(5)) == (10, 30)  # the worker has passed the given-up one
        assert batcher.stats().cancelled == 1
    assert [record.getMessage() for record in caplog.records if record.name == "concurrent.futures"] == []


def test_a_request_its_caller_finished_while_running_leaves_the_rest_of_its_batch_answered() -> None:
    """A caller that gave up with future.set_exception() once a worker had taken its request: the
    worker's set_result raised InvalidStateError, which answered every later request of the micro-batch
    with it instead of its result, and the given-up request was counted as completed."""
    taken, release = threading.Event(), threading.Event()

    def slow(items: list[int]) -> list[int]:
        taken.set()
        release.wait(10)
        return [10 * x for x in items]

    with MicroBatcher(slow, max_batch=4, max_delay_ms=200, num_threads=1) as batcher:
        futures = [batcher.submit(i) for i in range(4)]
        assert taken.wait(5)
        futures[1].set_exception(TimeoutError("gave up"))
        release.set()
        assert [futures[i].result(5) for i in (0, 2, 3)] == [0, 20, 30]
        with pytest.raises(TimeoutError, match="gave up"):
            futures[1].result(0)
        stats = batcher.stats()
    assert (stats.batches, stats.completed, stats.failed) == (1, 3, 1)


def test_a_micro_batcher_on_a_cuda_device_that_is_not_there_says_so() -> None:
    """It raised torch's 'Torch not compiled with CUDA enabled' or 'torch.cuda.Stream requires CUDA'."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    wanted = f"cuda:{count}"
    with pytest.raises(
        RuntimeError, match=rf"device='{wanted}' but (no CUDA GPU is usable|only {count} CUDA)"
    ):
        MicroBatcher(lambda items: items, device=wanted)


def test_each_request_of_a_failed_batch_gets_its_own_error() -> None:
    """A raise adds the raising caller's frames to the error: one object shared by a batch's requests
    carried one caller's frames and locals (a request's body) into the next caller's traceback."""

    def out_of_memory(inputs: list[int]) -> list[int]:
        raise MemoryError(f"no room for {len(inputs)} inputs")

    def first_callers_handler(future: concurrent.futures.Future[int]) -> BaseException:
        body = bytearray(1000)  # a local that must not reach the second caller's error  # noqa: F841
        try:
            future.result(10)
        except MemoryError as error:
            error.add_note("seen by the first caller")
            return error
        raise AssertionError("the batch did not fail")

    with MicroBatcher(out_of_memory, num_threads=1, max_batch=2, max_delay_ms=200) as service:
        futures = [service.submit(1), service.submit(2)]
        first = first_callers_handler(futures[0])
        second = futures[1].exception(10)
    assert type(first) is type(second) is MemoryError and first is not second
    assert str(first) == str(second) == "no room for 2 inputs"
    assert "seen by the first caller" not in getattr(second, "__notes__", [])
    assert "out_of_memory" in "".join(getattr(second, "__notes__", []))  # the function's traceback, as text
    try:
        futures[1].result()
    except MemoryError as raised:
        names = [frame.f_code.co_name for frame, _ in traceback.walk_tb(raised.__traceback__)]
    assert "first_callers_handler" not in names, names


def test_a_service_finalized_inside_its_own_queue_lock_does_not_deadlock(tmp_path: Path) -> None:
    """A service dropped in a reference cycle is closed by whichever thread the garbage collector runs
    in, which may be a worker inside the queue's lock (every allocation there may collect)."""
    script = """
import gc, threading
from threadloader.service import MicroBatcher

class Server:
    pass

gc.disable()
server = Server()
server.service = MicroBatcher(lambda inputs: inputs, num_threads=1)
server.me = server  # a cycle, as an application's objects make
queue = server.service._queue
del server
done = threading.Event()

def collect_inside_the_lock():
    with queue._lock:  # as gather(), put() and a cancelled request's callback do
        gc.collect()  # what an allocation there may do
    done.set()

threading.Thread(target=collect_inside_the_lock, daemon=True).start()
print(done.wait(10))
"""
    done = run_script(tmp_path, script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


# ------------------------------------------------- what a batch function or a callback may raise


@pytest.mark.parametrize("raised", [StopIteration, KeyboardInterrupt, SystemExit, asyncio.CancelledError])
def test_a_batch_function_raising_a_non_exception_fails_its_requests_with_a_runtime_error(
    raised: type[BaseException],
) -> None:
    """An asyncio caller never got an answer for StopIteration (its future refuses it), saw its event
    loop stop for KeyboardInterrupt and SystemExit, and looked cancelled for CancelledError."""

    def fn(items: list[int]) -> list[int]:
        raise raised("from the model")

    async def call(batcher: MicroBatcher) -> BaseException:
        with pytest.raises(RuntimeError) as info:
            await asyncio.wait_for(batcher.arun(1), 5)
        return info.value

    with MicroBatcher(fn, max_delay_ms=0) as batcher:
        error = asyncio.run(call(batcher))
        assert f"the batch function raised {raised.__name__}" in str(error)
        assert type(error.__cause__) is raised
        with pytest.raises(RuntimeError) as info:
            batcher.submit(2).result(5)
        assert type(info.value.__cause__) is raised


def test_a_non_exception_whose_str_raises_still_fails_its_requests() -> None:
    """Its text went into the wrapping error's message, and a ``__str__`` that raised there ended the
    worker with the batch's requests unanswered: their callers waited forever."""

    class Unprintable(BaseException):
        def __str__(self) -> str:
            raise ValueError("no text")

    def fn(items: list[int]) -> list[int]:
        raise Unprintable

    with MicroBatcher(fn, max_batch=2, max_delay_ms=200, num_threads=1) as batcher:
        futures = [batcher.submit(i) for i in range(2)]
        for future in futures:
            with pytest.raises(RuntimeError, match=r"raised Unprintable: <its str\(\) raised ValueError>"):
                future.result(5)
        assert batcher.submit(3).exception(5) is not None  # the worker goes on


def test_a_done_callbacks_system_exit_stays_with_its_request() -> None:
    """It went to the batch's other requests (a successful batch), or ended the worker with them
    unanswered (a failed one)."""

    def leave(future: concurrent.futures.Future[Any]) -> None:
        sys.exit(1)

    with MicroBatcher(lambda items: [10 * x for x in items], max_batch=3, max_delay_ms=500) as batcher:
        futures = [batcher.submit(i) for i in range(3)]
        futures[0].add_done_callback(leave)
        assert [f.result(5) for f in futures] == [0, 10, 20]

    def bad(items: list[int]) -> list[int]:
        raise ValueError("bad input")

    with MicroBatcher(bad, max_batch=3, max_delay_ms=500, num_threads=1) as batcher:
        futures = [batcher.submit(i) for i in range(3)]
        futures[0].add_done_callback(leave)
        for future in futures:
            with pytest.raises(ValueError, match="bad input"):
                future.result(5)
        with pytest.raises(ValueError, match="bad input"):
            batcher.submit(3).result(5)  # the worker goes on


class _CodedError(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"model failed with code {code}")
        self.code = code


KEPT = RuntimeError("the model's one error, raised again and again")


def test_each_callers_error_keeps_the_message_and_the_raised_error_gains_nothing() -> None:
    """A copy rebuilt through __init__ formatted the message again ("failed with code failed with
    code 7"); and an error the function keeps gained a note of its traceback at every batch, which
    every later request's error printed."""

    def coded(items: list[int]) -> list[int]:
        raise _CodedError(7)

    with MicroBatcher(coded, max_delay_ms=0) as batcher, pytest.raises(_CodedError) as info:
        batcher.submit(1).result(5)
    assert str(info.value) == "model failed with code 7" and info.value.code == 7

    def kept(items: list[int]) -> list[int]:
        raise KEPT

    with MicroBatcher(kept, max_delay_ms=0, num_threads=1) as batcher:
        errors = []
        for i in range(20):
            with pytest.raises(RuntimeError) as info:
                batcher.submit(i).result(5)
            errors.append(info.value)
    assert not getattr(KEPT, "__notes__", None) and KEPT.__traceback__ is None
    assert all(error is not KEPT and len(error.__notes__) == 1 for error in errors)


def test_a_wake_up_for_a_closed_loops_waiter_goes_to_the_next_one() -> None:
    """A loop closed with an arun waiting for room took the freed slot's wake-up: another loop's
    arun, waiting too, waited on though the queue had room."""
    gate = threading.Event()
    with MicroBatcher(
        lambda items: (gate.wait(5), items)[1], max_delay_ms=0, max_queue=1, num_threads=1
    ) as batcher:
        batcher.submit("busy")
        time.sleep(0.2)  # the worker holds it: the next fills the queue
        batcher.submit("queued")
        abandoned: list[asyncio.Task[Any]] = []

        def closed_loop() -> None:
            loop = asyncio.new_event_loop()
            abandoned.append(loop.create_task(batcher.arun("A")))
            loop.run_until_complete(asyncio.sleep(0.2))
            loop.close()  # its task never cancelled

        thread = threading.Thread(target=closed_loop)
        thread.start()
        thread.join()

        async def waits_for_room() -> str:
            task = asyncio.ensure_future(batcher.arun("B"))
            await asyncio.sleep(0.2)
            gate.set()
            return await asyncio.wait_for(task, 5)

        assert asyncio.run(waits_for_room()) == "B"


def test_numpy_numbers_are_milliseconds() -> None:
    """max_delay_ms=np.float32(1) was "not a finite number", where counts take numpy's integers."""
    with MicroBatcher(lambda items: items, max_delay_ms=np.float32(1), max_batch=np.int64(4)) as batcher:
        assert batcher.submit(5).result(5) == 5


def test_a_numpy_timeout_waits_as_a_float() -> None:
    """Under 3.13 a lock's wait refuses a numpy float32, which killed a worker given max_delay_ms as
    one (test_numpy_numbers_are_milliseconds); a timeout is made a float as well."""
    gate = threading.Event()
    with MicroBatcher(lambda items: (gate.wait(5), items)[1], max_queue=1, max_delay_ms=0) as batcher:
        batcher.submit(1)
        time.sleep(0.2)  # the worker holds it; the next fills the queue
        batcher.submit(2)
        with pytest.raises(QueueFullError):
            batcher.submit(3, timeout=np.float32(0.05))
        gate.set()


def test_a_failed_requests_origin_counts_its_bytes_not_its_items() -> None:
    """A memoryview of 100 uint32 values was '100 bytes' in the error's origin (and 10 for 10 rows)."""
    with BatchDecoder(device="cpu", num_threads=1) as service:
        for data, size in (
            (memoryview(np.arange(100, dtype=np.uint32)), 400),
            (memoryview(np.zeros((10, 40), np.uint8)), 400),
            (b"not an image", 12),
        ):
            with pytest.raises(SampleError) as caught:
                service.decode(data)
            assert caught.value.origin.endswith(f", {size} bytes")


def test_a_second_close_waits_for_the_answers_as_the_first_does() -> None:
    """A close that returned because another had waited left requests unanswered (and freed the
    decoder under them, on a BatchDecoder)."""

    def slow(items: list[int]) -> list[int]:
        time.sleep(0.3)
        return items

    batcher = MicroBatcher(slow, max_batch=1, max_delay_ms=0)
    futures = [batcher.submit(i) for i in range(3)]
    first = threading.Thread(target=batcher.close)
    first.start()
    time.sleep(0.05)
    batcher.close()  # another thread's, while the first waits
    assert all(future.done() for future in futures)
    first.join(5)
    cancelled = MicroBatcher(slow, max_batch=1, max_delay_ms=0)
    running = cancelled.submit(1)
    time.sleep(0.05)
    cancelled.close(cancel_pending=True)
    cancelled.close()  # waits for the batch under way
    assert running.result(0) == 1


class OwnedDecoder(ImageDecoder):
    """A decoder the service builds (and so closes): its first call blocks until ``gate`` opens, later
    ones while ``later`` is clear; it records whether ``close`` ever ran while a call was inside
    ``decode``."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.gate, self.entered, self.later = threading.Event(), threading.Event(), threading.Event()
        self.later.set()
        self.lock = threading.Lock()
        self.calls = self.running = self.closes = 0
        self.closed_under_a_call = False
        self._inner = PillowDecoder()

    def decode(self, encoded: Any, *, stream: Any, stats: Any = None, **_: Any) -> DecodedBatch:
        with self.lock:
            self.calls += 1
            first = self.calls == 1
            self.running += 1
        try:
            if first:
                self.entered.set()
                assert self.gate.wait(10), "the test never opened the gate"
            else:
                assert self.later.wait(10), "the test never let the later calls go"
            return self._inner.decode(encoded, stream=stream, stats=stats)
        finally:
            with self.lock:
                self.running -= 1

    def close(self) -> None:
        with self.lock:
            self.closes += 1
            self.closed_under_a_call |= self.running > 0


@pytest.mark.parametrize("how", ["cancel_pending", "done_callback", "ctrl_c"])
def test_close_never_closes_the_decoder_under_a_running_call(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A close that stopped waiting for a worker still in the decoder (close(cancel_pending=True)
    after its second, a close from a done-callback, a Ctrl-C in the join) closed the decoder under the
    call, or, after a Ctrl-C, never closed it. The last worker closes it as it leaves the call."""
    decoder = OwnedDecoder()
    monkeypatch.setattr(threadloader._runtime, "build_decoder", lambda *_, **__: decoder)
    monkeypatch.setattr(threadloader._workers, "JOIN_TIMEOUT", 0.2)
    service = BatchDecoder(device="cpu", num_threads=2, max_batch=1, max_delay_ms=0)
    try:
        held = service.submit(encode(photo(8, 8)))
        assert decoder.entered.wait(5)
        if how == "cancel_pending":
            started = time.monotonic()
            service.close(cancel_pending=True)
            assert time.monotonic() - started < 5  # close has an exit while the call runs on
        elif how == "done_callback":  # the other worker answers a request whose callback closes
            closed = threading.Event()
            decoder.later.clear()  # the callback is added before the answer: it runs in the worker
            other = service.submit(encode(photo(8, 8)))
            other.add_done_callback(lambda _: (service.close(), closed.set()))
            decoder.later.set()
            assert closed.wait(5)
        else:

            def interrupted(deadline: float) -> bool:
                raise KeyboardInterrupt  # what the join raises after a Ctrl-C (uninterrupted)

            service._group.join_by = interrupted  # type: ignore[method-assign,union-attr]
            try:
                with pytest.raises(KeyboardInterrupt):
                    service.close(cancel_pending=True)
            finally:
                del service._group.join_by  # type: ignore[union-attr]
        assert decoder.closes == 0  # not while the first call runs
        decoder.gate.set()
        assert held.result(5).shape == (3, 8, 8)
        for thread in service.threads:
            thread.join(5)
        assert decoder.closes >= 1
        assert not decoder.closed_under_a_call
    finally:
        decoder.gate.set()  # a failure leaves no worker blocked
        service.close()


def _held(
    served: list[str] | None = None,
) -> tuple[Callable[[list[str]], list[str]], threading.Event, threading.Event]:
    """A MicroBatcher function that says when it is entered and holds its call until the gate opens;
    the items it returns go to ``served`` too."""
    gate, entered = threading.Event(), threading.Event()

    def held(items: list[str]) -> list[str]:
        entered.set()
        gate.wait(10)
        if served is not None:
            served.extend(items)
        return items

    return held, gate, entered


async def _filled(batcher: MicroBatcher[str, str], entered: threading.Event) -> Future[str]:
    """A one-slot batcher made full: a request held in its function, and one queued (returned)."""
    batcher.submit("running")
    assert await asyncio.to_thread(entered.wait, 5)
    return batcher.submit("queued")


def test_a_cancel_in_the_loop_step_that_hands_an_arun_its_slot_cancels_it() -> None:
    """On 3.11 asyncio.wait_for returned normally when its task was cancelled in the step that woke it
    (gh-86296): the cancelled arun queued its request and waited for the result."""
    held, gate, entered = _held()

    async def main() -> None:
        with MicroBatcher(held, max_batch=1, max_delay_ms=0, max_queue=1) as batcher:
            try:
                queued = await _filled(batcher, entered)
                task = asyncio.ensure_future(batcher.arun("late", timeout=10))
                await asyncio.sleep(0.1)  # waiting for room
                queued.cancel()  # frees its slot: the waiter is woken in the next step...
                task.cancel()  # ...which its cancel shares
                with pytest.raises(asyncio.CancelledError):
                    await task
                assert batcher.stats().submitted == 2  # never queued
            finally:
                gate.set()

    asyncio.run(main())


def test_room_goes_to_the_waiters_first_come_first_served() -> None:
    """A freed slot went to whoever ran first: a newcomer took it from an asyncio waiter woken for it,
    which then waited behind the newcomers, again and again (some waited past their timeout under a
    load that others were served in milliseconds). Threads and asyncio tasks now share one line."""
    served: list[str] = []
    record, gate, entered = _held(served)

    async def main() -> None:
        with MicroBatcher(record, max_batch=1, max_delay_ms=0, max_queue=1) as batcher:
            try:
                queued = await _filled(batcher, entered)
                first = asyncio.ensure_future(batcher.arun("A"))
                await asyncio.sleep(0.1)
                thread = threading.Thread(target=batcher.run, args=("T",))  # a thread in line after A
                thread.start()
                await asyncio.sleep(0.1)
                queued.cancel()  # a slot frees: A's...
                newcomer = asyncio.ensure_future(batcher.arun("B"))  # ...though B arrives before A runs
                await asyncio.sleep(0.1)
                gate.set()
                assert await asyncio.wait_for(asyncio.gather(first, newcomer), 5) == ["A", "B"]
                await asyncio.to_thread(thread.join, 5)
            finally:
                gate.set()

    asyncio.run(main())
    assert served == ["running", "A", "T", "B"]


class _Interrupted(BaseException):
    """A Ctrl-C, or another error a signal handler raises, landing at a chosen step."""


@pytest.mark.parametrize("caller", ["thread", "task"])
def test_an_interrupt_as_a_waiter_claims_its_slot_passes_the_slot_on(
    caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C landing between a waiter's wake and its claim of the slot handed to it (the claim's
    first step, outside the wait's handler) kept that slot taken for good: the queue stayed full for
    every later caller. Seen with real interrupts on 3.13t (about 1 in 500 hand-overs)."""
    held, gate, entered = _held()

    with MicroBatcher(held, max_batch=1, max_delay_ms=0, max_queue=1) as batcher:
        queue = batcher._queue
        claim = queue._claim

        def interrupted(waiter: Any, data: Any, stream: Any) -> Any:
            if waiter is not None and waiter.granted:
                raise _Interrupted  # at the claim's first step, as a signal handler's error lands
            return claim(waiter, data, stream)

        try:
            running = batcher.submit("running")
            assert entered.wait(5)
            queued = batcher.submit("queued")  # the queue is full
            monkeypatch.setattr(queue, "_claim", interrupted)
            caught: list[BaseException] = []

            def in_line() -> None:
                deadline = time.monotonic() + 5
                while not queue._line:
                    assert time.monotonic() < deadline, "the waiter never stood in line"
                    time.sleep(0.001)

            if caller == "thread":

                def put() -> None:
                    try:
                        queue.put("late", None, wait=5)
                    except _Interrupted as exc:
                        caught.append(exc)

                thread = threading.Thread(target=put)
                thread.start()
                in_line()
                queued.cancel()  # frees its slot: handed to the waiter, which is interrupted
                thread.join(5)
                assert not thread.is_alive()
            else:

                async def main() -> None:
                    task = asyncio.ensure_future(queue.aput("late", None, wait=5))
                    await asyncio.to_thread(in_line)
                    queued.cancel()
                    with pytest.raises(_Interrupted):
                        await task
                    caught.append(_Interrupted())

                asyncio.run(main())
            assert len(caught) == 1
            monkeypatch.undo()
            after = batcher.submit("after", timeout=0)  # the slot is free again
            gate.set()
            assert running.result(5) == "running"
            assert after.result(5) == "after"
        finally:
            gate.set()


def test_an_interrupt_inside_a_claim_hands_the_slot_to_the_next_in_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Ctrl-C inside a waiter's claim, after it let go of the slot handed to it and before its
    request was queued, left that slot free while the next in line waited on for another."""
    held, gate, entered = _held()

    with MicroBatcher(held, max_batch=1, max_delay_ms=0, max_queue=1) as batcher:
        queue = batcher._queue
        append = queue._append
        interrupt = [True]

        def interrupted(data: Any, stream: Any) -> Any:
            if data == "first" and interrupt.pop():
                raise _Interrupted  # between letting go of the handed slot and queueing
            return append(data, stream)

        try:
            running = batcher.submit("running")
            assert entered.wait(5)
            queued = batcher.submit("queued")  # the queue is full
            monkeypatch.setattr(queue, "_append", interrupted)
            outcomes: dict[str, Any] = {}

            def put(name: str) -> None:
                try:
                    outcomes[name] = queue.put(name, None, wait=10)
                except BaseException as exc:
                    outcomes[name] = exc

            threads = []
            for name in ("first", "second"):  # in this order in line
                threads.append(threading.Thread(target=put, args=(name,)))
                threads[-1].start()
                deadline = time.monotonic() + 5
                while len(queue._line) < len(threads):
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
            queued.cancel()  # one slot frees: handed to "first", interrupted in its claim
            for thread in threads:
                thread.join(5)  # "second" is handed the slot, not left waiting its 10 seconds
                assert not thread.is_alive()
            assert isinstance(outcomes["first"], _Interrupted)
            assert not isinstance(outcomes["second"], BaseException), outcomes["second"]
            gate.set()
            assert running.result(5) == "running"
            assert outcomes["second"].result(5) == "second"
        finally:
            gate.set()


def test_a_service_whose_workers_cannot_start_closes_its_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BatchDecoder whose threads failed to start ("can't start new thread", the interpreter exiting,
    a Ctrl-C) raised, leaving the decoder built for it (and on a GPU its warm-up threads) to nobody."""
    decoder = OwnedDecoder()
    monkeypatch.setattr(threadloader._runtime, "build_decoder", lambda *_, **__: decoder)

    def no_threads(**_: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threadloader.service, "ThreadGroup", no_threads)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        BatchDecoder(device="cpu", num_threads=2, max_batch=1, max_delay_ms=0)
    assert decoder.closes == 1


def test_a_memoryview_released_after_submit_fails_no_request(
    blobs: list[bytes], refs: list[np.ndarray]
) -> None:
    """A caller's view released (its with block ended) before a worker took it: the error raised while
    naming its request failed all three requests of the micro-batch, the two good ones too."""
    with BatchDecoder(device="cpu", num_threads=1, max_batch=3, max_delay_ms=5000) as service:
        first = service.submit(blobs[0])
        with memoryview(bytearray(blobs[1])) as view:
            second = service.submit(view)
        third = service.submit(blobs[2])  # fills the batch: gathered after the release
        for future, ref in zip((first, second, third), refs[:3], strict=True):
            assert_image(future.result(timeout=10), ref)
        released = memoryview(blobs[3])
        released.release()
        with pytest.raises(ValueError, match="released memoryview"):
            service.submit(released)  # refused to its caller, queued for nobody
        assert service.stats().submitted == 3


def test_decode_many_refuses_one_image_given_whole(blobs: list[bytes]) -> None:
    """One body passed as the list was iterated: bytes gave ints, refused with advice to pass the file's
    contents (which it was), and an empty body gave [] as if decoded."""
    with BatchDecoder(device="cpu", num_threads=1) as service:
        for one in (blobs[0], bytearray(blobs[0]), memoryview(blobs[0]), b"", "photo.jpg"):
            with pytest.raises(TypeError, match=r"got one \w+; use decode\(data\) for one image"):
                service.decode_many(one)  # type: ignore[arg-type]
        assert service.stats().submitted == 0


def test_the_batch_function_runs_with_torchs_own_thread_count() -> None:
    """``fn`` is the user's model, not a reader: its worker ran torch's ops on one OpenMP thread (the
    readers' setting, where the threads are the parallelism), so a model stage on the CPU used one core
    of the machine, where the same call in the caller's thread used them all."""
    with MicroBatcher(lambda inputs: [torch.get_num_threads()] * len(inputs), max_delay_ms=0) as batcher:
        assert batcher.run(0) == torch.get_num_threads()
