"""BatchDecoder: the inference-server face of the pipeline, with dynamic micro-batching.

Requests arrive one image at a time from any number of threads (or an asyncio loop). The GPU decoder
is several times faster per image on a batch, so, as Triton's dynamic batcher does, worker threads
gather queued requests into micro-batches (up to ``max_batch`` images, or whatever has arrived
``max_delay_ms`` after the first one) and make each with the training loader's own
:class:`~threadloader._pipeline.BatchProducer`: same decoder, same transforms, same stream hand-off.
Each caller gets its own image through a ``concurrent.futures.Future``.

:class:`MicroBatcher` is its sibling for the next stage: the same queue, limits, cancellation and
counters, gathering any inputs (decoded images, say) and calling one function (a model) once per
micro-batch. A service chains the two, ``await model.arun(await decoder.adecode(body))``, and writes no
queue of its own.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import numbers
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeGuard, TypeVar

import torch

from ._checks import check_count
from ._device import parse_device, usable
from ._handoff import ReaderStream
from ._options import DEFAULTS, Options
from ._runtime import Runtime
from ._serving.batcher import CallEngine
from ._serving.engine import Engine, Runner, serve_then_leave
from ._serving.metrics import Metrics
from ._serving.queue import RequestQueue, cancel
from ._stats import STAGES, StatsRecorder
from ._workers import LastOut, ThreadGroup, close_deadline
from .decode.base import Encoded, ImageDecoder
from .errors import QueueFullError
from .transforms import Transform

__all__ = ["BatchDecoder", "BatcherStats", "MicroBatcher", "QueueFullError", "ServiceStats", "WhenFull"]

WhenFull = Literal["block", "raise"]
T = TypeVar("T")
R = TypeVar("R")

_service_numbers = itertools.count()


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of a :class:`MicroBatcher`'s (or :class:`BatchDecoder`'s) counters since it was created.

    ``submitted`` equals ``completed + failed + cancelled`` plus the requests still queued or running;
    read while requests are answered, it is at least ``completed + failed + cancelled + queue_depth``.

    Attributes:
        queue_depth: Requests waiting in the queue now (not yet taken by a worker).
        submitted: Requests accepted by ``submit``.
        rejected: Requests refused because the queue was full.
        completed: Requests answered with a result.
        failed: Requests answered with an error (their own, or a failure of their whole batch), and
            requests their caller finished itself (``set_exception`` on giving up) while they ran.
        cancelled: Requests cancelled before a worker took them, by their caller (which frees their
            slot in the queue at once) or by ``close(cancel_pending=True)``.
        batches: Micro-batches run.
        batch_sizes: Micro-batch size to how many batches had it.
        latency_ms_p50: Median milliseconds from ``submit`` to the result, over the most recent
            :data:`~threadloader._serving.metrics.LATENCY_WINDOW` completed requests; ``None`` before
            the first.
        latency_ms_p90: 90th percentile, likewise.
        latency_ms_p99: 99th percentile, likewise.
    """

    queue_depth: int = 0
    submitted: int = 0
    rejected: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    batches: int = 0
    batch_sizes: dict[int, int] = field(default_factory=dict)
    latency_ms_p50: float | None = None
    latency_ms_p90: float | None = None
    latency_ms_p99: float | None = None


@dataclass(frozen=True)
class ServiceStats(BatcherStats):
    """A :class:`BatchDecoder`'s counters (as :class:`BatcherStats`) and its pipeline's.

    Attributes:
        cpu_fallbacks: Images the GPU decoder gave up on that Pillow decoded instead.
        stage_seconds: Host seconds per pipeline stage, summed over workers (keys as in ``STAGES``;
            ``ahead`` and ``wait``, a loader's prefetch window and its consumer, stay 0 here).
        stage_cpu_seconds: The workers' own CPU seconds per stage (as ``LoaderStats``' say).
    """

    cpu_fallbacks: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    stage_cpu_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))


class _Batching(Generic[T, R]):
    """The queue, workers and counters that :class:`BatchDecoder` and :class:`MicroBatcher` share."""

    _group: ThreadGroup | None = None  # set last by _start: the finalizer closes only a started service
    _release: Callable[[], object] | None = None  # what close runs once no worker is in a call

    def _start(
        self,
        runner: Runner,
        *,
        metrics: Metrics,
        device: torch.device,
        num_threads: int,
        max_batch: int,
        max_delay_ms: float,
        max_queue: int,
        when_full: WhenFull,
        one_op_thread: bool = True,
    ) -> None:
        # Plain Python numbers from here on: 3.13's lock waits refuse a numpy float32 timeout.
        self.device, self.num_threads = device, int(num_threads)
        self.max_batch = int(max_batch)
        self.max_delay_ms = float(max_delay_ms)
        self.max_queue = int(max_queue)
        self.when_full: WhenFull = when_full
        self._metrics = metrics
        self._queue = RequestQueue(
            capacity=self.max_queue,
            max_batch=self.max_batch,
            max_delay=self.max_delay_ms / 1000,
            owner=type(self).__name__,
        )
        # The workers see the queue and the runner, never the service: dropping it runs its finalizer.
        # Interpreter exit cancels the group: queued requests are cancelled, batches being run stop at
        # their next step and fail their requests with LoaderClosedError.
        # Closes the decoder once no worker is in a call to it (see _close).
        self._last_out = LastOut(self.num_threads, what="closing the service's decoder")
        self._group = ThreadGroup(
            name=f"threadloader-{type(self).__name__.lower()}{next(_service_numbers)}",
            count=self.num_threads,
            target=functools.partial(serve_then_leave, self._last_out, self._queue, runner),
            wake=functools.partial(self._queue.close, cancel_pending=True),
            one_op_thread=one_op_thread,
        )

    def submit(self, data: T, *, timeout: float | None = None) -> Future[R]:
        """Queues one input; the future's result is its output.

        Cancelling the future before a worker takes it drops the request and frees its slot in the
        queue at once. Done-callbacks run in a worker thread: keep them short.

        Args:
            data: The input.
            timeout: With ``when_full="block"``, most seconds to wait for room in the queue (``None``:
                as long as it takes).

        Raises:
            QueueFullError: The queue is full (at once with ``when_full="raise"``, else after ``timeout``).
            LoaderClosedError: The service is closed.
        """
        return self._queue.put(self._checked(data), self._caller_stream(), wait=self._wait(timeout))

    async def _asubmit(self, data: T, timeout: float | None) -> R:
        """From asyncio: room is awaited (woken when a slot frees, never polled), then the result.

        A cancelled awaiting task cancels its request, which frees its slot if no worker has taken it.
        """
        future = await self._queue.aput(self._checked(data), self._caller_stream(), wait=self._wait(timeout))
        return await asyncio.wrap_future(future)

    def _wait(self, timeout: float | None) -> float | None:
        if timeout is not None and not (_is_real(timeout) and timeout >= 0):  # NaN fails: a caller spinning
            raise ValueError(f"timeout must be None or a number of seconds, 0 or more, got {timeout!r}")
        if self.when_full != "block":
            return 0.0
        if timeout is None:
            return None
        # inf or 10**400: as long as a lock's wait can be (a longer one raises OverflowError)
        return threading.TIMEOUT_MAX if timeout > threading.TIMEOUT_MAX else float(timeout)

    def _checked(self, data: T) -> T:
        return data

    def _counts(self) -> dict[str, Any]:
        # The answers before the queue: a request answered in between was submitted before the queue's
        # read, so every snapshot has submitted >= completed + failed + cancelled + queue_depth. The
        # other order counts a request queued at the first read and answered by the second twice.
        answers = self._metrics.snapshot()
        return {**self._queue.counts(), **answers}

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stops the service; further ``submit`` calls raise :class:`LoaderClosedError`. Idempotent.

        Called in a worker (from a future's done-callback), it returns at once: the workers answer what
        is left as above, then stop. Waiting there for the other workers would wait forever for one
        doing the same.

        Args:
            cancel_pending: ``False`` (default) runs every request already queued, then stops: close
                returns when they are all answered. ``True`` cancels the queued requests (their futures
                raise ``CancelledError``); the batches being run still complete, and the workers are
                joined within about a second.
        """
        self._close(cancel_pending, close_deadline(), self._release)

    def _close(self, cancel_pending: bool, until: float, release: Callable[[], object] | None = None) -> None:
        """:meth:`close`, a bounded wait ending at ``until`` (``time.monotonic()``).

        ``release`` (closing the decoder) runs once no worker is in a call: here if they have all
        left, else in the last one as it leaves, which a join that ends early (its deadline, a Ctrl-C,
        a close from a worker) does not wait for. Left to the workers before the join, it is not lost
        to a Ctrl-C that cuts the join short.
        """
        self._queue.close(cancel_pending=cancel_pending)
        if release is not None:
            self._last_out.then(release)
        assert self._group is not None
        if threading.current_thread() in self._group.threads:
            return
        if cancel_pending:
            self._group.join_by(until)
        else:
            self._group.join(None)  # every close waits for the answers, a second one (another thread's) too

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads (for tests and diagnostics)."""
        return self._group.threads if self._group is not None else []

    def _caller_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        # A finalizer must not block on queued work: holders of pending futures get CancelledError. Not
        # at interpreter exit, where the exit hook has stopped the workers (see ThreadLoader.__del__).
        if not _finalizing() and self._group is not None:
            self.close(cancel_pending=True)


_Self = TypeVar("_Self", bound=_Batching[Any, Any])


class BatchDecoder(_Batching[Encoded, torch.Tensor]):
    """Decodes images sent one at a time from many threads, in dynamically gathered micro-batches.

    Safe to call from any number of threads and from asyncio. Each result is one ``(3, H, W)`` tensor
    on ``device`` (a view of its micro-batch's tensor when ``size`` is set), formatted exactly as
    :class:`ThreadLoader` formats batches.

    Stream safety: ``submit`` records the CUDA stream current in the calling thread. When the batch
    is done, the worker makes that stream wait on the batch's event (a device-side wait) and calls
    ``record_stream`` for it on the result, then completes the future. So the tensor can be used on
    that stream straight away, with no host sync; to use it on another stream, make that stream wait
    for the submitting one first. On the CPU none of this applies.

    Args:
        device: ``None`` picks ``"cuda"`` when a GPU and nvImageCodec are usable, else ``"cpu"``.
        max_batch: Most requests decoded together.
        max_delay_ms: Longest a request waits for others to join its batch, counted from its
            submission: the latency spent to buy throughput. ``0`` batches only what is already queued.
        size: ``(H, W)`` to resize every image to; ``None`` keeps each image's size.
        dtype: ``torch.uint8``, or a float type scaled to [0, 1] (float32, float16, bfloat16, float64).
        mean: Per-channel mean to subtract (float dtypes, with ``std``), on the [0, 1] scale.
        std: Per-channel standard deviation to divide by.
        channels_last: Results are views of ``channels_last`` batches (needs ``size``).
        num_threads: Worker threads, each gathering and decoding whole batches on its own CUDA stream;
            default as for :class:`ThreadLoader` (2 on a GPU, the CPU count, at most 32, on the CPU).
        max_queue: Most requests waiting; the memory bound.
        when_full: What ``submit`` does when ``max_queue`` requests wait: ``"block"`` until there is
            room (or ``timeout``), ``"raise"`` :class:`QueueFullError` at once (shed load).
        backend: GPU decoding backend, as for :class:`ThreadLoader`.
        decode_threads: nvImageCodec's own CPU threads per Decoder; default: the cores the workers leave
            free, shared by the Decoders they decode on at once (``gpu_decoders``, at most one per
            worker).
        gpu_decoders: Most nvImageCodec Decoders decoding at once, as for :class:`ThreadLoader`.
        jpeg_fancy_upsampling: Smooth JPEG chroma upsampling, as Pillow's (the default), as for
            :class:`ThreadLoader`.
        max_pixels: Decompression-bomb guard: an image whose header declares more pixels fails its
            request, decoded by nobody. Default: Pillow's limit (about 89.5 million); ``None``: no limit.
        transform: Deterministic transforms applied to every image after decoding, as for
            :class:`ThreadLoader` (e.g. ``[Resize(256), CenterCrop(224)]``); random ones are for training.
        region_decode: As for :class:`ThreadLoader` (it matters only for random crops, which a service
            refuses); ``None`` reads ``THREADLOADER_REGION_DECODE`` when the service is built.
        decoder: An :class:`~threadloader.decode.ImageDecoder` to decode with, as for
            :class:`ThreadLoader`.

    Example:
        >>> with BatchDecoder(size=(224, 224), dtype=torch.float32) as decoder:  # doctest: +SKIP
        ...     image = decoder.decode(request_body)  # (3, 224, 224), ready on this thread's stream
    """

    def __init__(
        self,
        *,
        device: str | torch.device | int | None = DEFAULTS.device,
        max_batch: int = 64,
        max_delay_ms: float = 2.0,
        size: tuple[int, int] | None = DEFAULTS.size,
        dtype: torch.dtype = DEFAULTS.dtype,
        mean: Sequence[float] | None = DEFAULTS.mean,
        std: Sequence[float] | None = DEFAULTS.std,
        channels_last: bool = DEFAULTS.channels_last,
        num_threads: int | None = DEFAULTS.num_threads,
        max_queue: int = 1024,
        when_full: WhenFull = "block",
        backend: str = DEFAULTS.backend,
        decode_threads: int | None = DEFAULTS.decode_threads,
        gpu_decoders: int = DEFAULTS.gpu_decoders,
        jpeg_fancy_upsampling: bool = DEFAULTS.jpeg_fancy_upsampling,
        max_pixels: int | None = DEFAULTS.max_pixels,
        transform: Transform | Sequence[Transform] | None = DEFAULTS.transform,
        region_decode: bool | None = DEFAULTS.region_decode,
        decoder: ImageDecoder | None = DEFAULTS.decoder,
    ) -> None:
        _check_batching(
            max_batch=max_batch, max_delay_ms=max_delay_ms, max_queue=max_queue, when_full=when_full
        )
        options = Options.of(locals())  # the options both front ends take, checked
        if options.chain is not None and options.chain.random:
            raise ValueError(
                f"{options.chain!r} is random: a service answers each image the same way every time; "
                "use deterministic transforms (Resize, CenterCrop, Normalize, ToDtype)"
            )
        self._runtime = runtime = Runtime(options, batch_size=max_batch, decode_batch_size=max_batch)
        self._pipeline_stats = StatsRecorder()
        metrics = Metrics()
        try:
            self._start(
                Engine(runtime=runtime, pipeline_stats=self._pipeline_stats, metrics=metrics),
                metrics=metrics,
                device=runtime.device,
                num_threads=runtime.num_threads,
                max_batch=max_batch,
                max_delay_ms=max_delay_ms,
                max_queue=max_queue,
                when_full=when_full,
            )
        except BaseException:  # no thread to start, the interpreter exiting, a Ctrl-C: nobody would
            runtime.close()  # close the warm-up and the decoder built for this service
            raise

    def submit(self, data: Encoded, *, timeout: float | None = None) -> Future[torch.Tensor]:
        """Queues one encoded image; the future's result is its ``(3, H, W)`` tensor.

        The result is safe to use on the CUDA stream current in this thread now (see the class notes).
        A bad image fails only its own future, with a :class:`SampleError` whose ``index`` is the
        request's submission number. Cancelling the future before a worker takes it drops the request
        and frees its slot in the queue. Done-callbacks run in a worker thread: keep them short.

        Args:
            data: The encoded image (JPEG, PNG, ... bytes).
            timeout: With ``when_full="block"``, most seconds to wait for room in the queue (``None``:
                as long as it takes).

        Raises:
            QueueFullError: The queue is full (at once with ``when_full="raise"``, else after ``timeout``).
            LoaderClosedError: The service is closed.
        """
        return super().submit(data, timeout=timeout)

    def decode(self, data: Encoded) -> torch.Tensor:
        """Decodes one image, blocking until it is done; see :meth:`submit`.

        Raises:
            SampleError: If the image cannot be decoded.
        """
        return self.submit(data).result()

    def decode_many(self, images: Sequence[Encoded]) -> list[torch.Tensor]:
        """Decodes several images, in order; they may share micro-batches with other callers' requests.

        Raises:
            SampleError: The first bad image's error (the others are still decoded).
            QueueFullError: With ``when_full="raise"``, when they do not fit; those already queued are
                cancelled.
            TypeError: If ``images`` is one image (bytes, or a string): iterated, it was refused as an
                ``int`` or a one-letter path, with advice that did not fit.
        """
        if isinstance(images, (bytes, bytearray, memoryview, str)):
            raise TypeError(
                f"decode_many takes a list of encoded images, got one {type(images).__name__}; "
                "use decode(data) for one image, decode_many([data, ...]) for several"
            )
        futures: list[Future[torch.Tensor]] = []
        try:
            futures.extend(self.submit(data) for data in images)
        except BaseException:
            for future in futures:
                cancel(future)
            raise
        return [future.result() for future in futures]

    async def adecode(self, data: Encoded, *, timeout: float | None = None) -> torch.Tensor:
        """Decodes one image from asyncio, never blocking the event loop.

        The result is safe on the CUDA stream current in the loop's thread. With ``when_full="block"``,
        a full queue is awaited until a slot frees (woken by it, not polled), for at most ``timeout``
        seconds; with ``"raise"`` it is refused at once, which a server answers with 503. Cancelling the
        awaiting task (its client went away) cancels a request not yet decoded and frees its slot.

        Raises:
            SampleError: If the image cannot be decoded.
            QueueFullError: The queue is full (at once with ``when_full="raise"``, else after ``timeout``).
            LoaderClosedError: The service is closed.
        """
        return await self._asubmit(data, timeout)

    def stats(self) -> ServiceStats:
        """Counters, the batch-size histogram and recent latency percentiles since construction."""
        counts = self._counts()
        pipeline = self._pipeline_stats.snapshot()
        return ServiceStats(
            **counts,
            cpu_fallbacks=pipeline.cpu_fallbacks,
            stage_seconds=pipeline.stage_seconds,
            stage_cpu_seconds=pipeline.stage_cpu_seconds,
        )

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stops the service; further ``submit`` calls raise :class:`LoaderClosedError`. Idempotent.

        Args:
            cancel_pending: ``False`` (default) decodes every request already queued, then stops: close
                returns when they are all answered. ``True`` cancels the queued requests (their futures
                raise ``CancelledError``); the batches being decoded still complete, and close
                returns once they have, or after about a second (``JOIN_TIMEOUT``) if one is still in
                the decoder.

        The decoder this service built is closed once no worker is in a call to it: by close, or, when
        close stopped waiting first (that second, a Ctrl-C, a close from a done-callback, which runs in
        a worker), by the last worker as it leaves its call. Never under a running call. Nor under the GPU
        decoder's start in the background: whichever closes it waits for that start (up to 15 s).
        """
        until = close_deadline()  # one bounded wait for the workers and the warm-up
        # After a drain, the warm-up gets its own second.
        release = functools.partial(self._runtime.close, until=until if cancel_pending else None)
        self._close(cancel_pending, until, release)

    def _checked(self, data: Encoded) -> Encoded:
        """Refuses anything but in-memory bytes: a string would be read as a file path by the pipeline.

        A memoryview is queued as a view of its own on the same buffer (no copy): the caller's released
        (the end of a ``with memoryview(...)`` block) before a worker took it failed every request of
        its micro-batch, not only its own.

        Raises:
            TypeError: If ``data`` is not bytes, a bytearray or a memoryview.
            ValueError: If ``data`` is a memoryview already released.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            fix = (
                "pass them as bytes (tensor.numpy().tobytes())"
                if hasattr(data, "numpy") or hasattr(data, "tobytes")
                else "pass the file's contents (open(path, 'rb').read()), not its path"
            )
            raise TypeError(f"BatchDecoder decodes encoded image bytes, got {type(data).__name__}; {fix}")
        if isinstance(data, memoryview):
            try:
                return memoryview(data)
            except ValueError as exc:
                raise ValueError(
                    "BatchDecoder got a released memoryview: submit it before releasing it (the end of its "
                    "with block releases it), or submit a copy, bytes(view), taken before"
                ) from exc
        return data

    def __repr__(self) -> str:
        return (
            f"BatchDecoder(device={self.device}, max_batch={self.max_batch}, "
            f"max_delay_ms={self.max_delay_ms}, num_threads={self.num_threads}, "
            f"max_queue={self.max_queue}, when_full={self.when_full!r}, output={self._runtime.output})"
        )


class MicroBatcher(_Batching[T, R]):
    """Calls ``fn`` once per micro-batch of inputs sent one at a time: a service's model stage.

    :class:`BatchDecoder`'s sibling, with its queue, limits, cancellation, counters and shutdown: worker
    threads gather queued inputs into micro-batches (up to ``max_batch``, or what has arrived
    ``max_delay_ms`` after the first) and call ``fn(inputs)``, which returns one result per input, in
    order; each caller gets its own. An exception from ``fn`` fails every request of that batch, and
    the batcher goes on. A service chains the two stages:
    ``await batcher.arun(await decoder.adecode(body))``.

    Stream safety, with ``device`` a CUDA device: ``submit`` records the caller's current stream; each
    worker calls ``fn`` on a stream of its own after it has waited for those streams (device-side), and
    a CUDA tensor result is handed back to its caller's stream by event, as :class:`BatchDecoder` does.
    So a decoded image can be submitted straight from the stream it was delivered on. Results that are
    host values (``.tolist()`` in ``fn``) cost one host sync per batch, in the worker, never in the
    caller's thread (an event loop).

    Args:
        fn: Called in a worker thread with a list of inputs; returns a sequence (or a tensor whose first
            dimension is the batch) of one result per input.
        max_batch: Most inputs per call.
        max_delay_ms: Longest an input waits for others to join its batch, counted from its submission.
        max_queue: Most requests waiting; the memory bound.
        when_full: ``"block"`` until there is room (or ``timeout``), ``"raise"`` :class:`QueueFullError`
            at once (shed load: a server's 503).
        num_threads: Worker threads, each calling ``fn`` on whole batches (1: one model call at a time).
        device: The CUDA device whose streams ``fn`` runs on; ``None`` or a CPU device: no stream
            hand-off (CPU work, or ``fn`` manages its own).

    Example:
        >>> def classify(images: list[torch.Tensor]) -> list[list[int]]:  # doctest: +SKIP
        ...     return model(torch.stack(images)).topk(5).indices.tolist()
        >>> with MicroBatcher(classify, device="cuda") as batcher:  # doctest: +SKIP
        ...     top5 = await batcher.arun(await decoder.adecode(body))
    """

    def __init__(
        self,
        fn: Callable[[list[T]], Sequence[R]],
        *,
        max_batch: int = 64,
        max_delay_ms: float = 2.0,
        max_queue: int = 1024,
        when_full: WhenFull = "block",
        num_threads: int = 1,
        device: str | torch.device | None = None,
    ) -> None:
        _check_batching(
            max_batch=max_batch, max_delay_ms=max_delay_ms, max_queue=max_queue, when_full=when_full
        )
        check_count("num_threads", num_threads, optional=False)
        if not callable(fn):
            raise TypeError(f"fn must be callable (inputs -> one result each), got {type(fn).__name__}")
        where = usable(parse_device(device if device is not None else "cpu"))
        # Leased and given back as a loader's readers' are: a model's cuBLAS workspaces and cached
        # blocks, which torch keeps per stream, serve the next batcher built in the process.
        workers = [ReaderStream(where, high_priority=False) for _ in range(num_threads)]
        streams = tuple(worker.stream for worker in workers if worker.stream is not None)
        self._release = functools.partial(_release_all, workers)
        metrics = Metrics()
        try:
            self._start(
                CallEngine(fn=fn, metrics=metrics, streams=streams),
                metrics=metrics,
                device=where,
                num_threads=num_threads,
                max_batch=max_batch,
                max_delay_ms=max_delay_ms,
                max_queue=max_queue,
                when_full=when_full,
                # fn is the user's model, not a reader: it keeps torch's threads, as a training loop
                # does (one OpenMP thread ran a CPU model on one core).
                one_op_thread=False,
            )
        except BaseException:  # no batcher to close: the streams back now
            _release_all(workers)
            raise

    def run(self, data: T) -> R:
        """Runs one input through ``fn`` in a micro-batch, blocking until its result; see ``submit``."""
        return self.submit(data).result()

    async def arun(self, data: T, *, timeout: float | None = None) -> R:
        """Runs one input from asyncio, never blocking the event loop.

        A full queue is awaited until a slot frees (``when_full="block"``, at most ``timeout`` seconds)
        or refused at once (``"raise"``); cancelling the awaiting task cancels a request no worker has
        taken, freeing its slot and its place in the next batch.

        Raises:
            QueueFullError: The queue is full (at once with ``when_full="raise"``, else after ``timeout``).
            LoaderClosedError: The batcher is closed.
        """
        return await self._asubmit(data, timeout)

    def stats(self) -> BatcherStats:
        """Counters, the batch-size histogram and recent latency percentiles since construction."""
        return BatcherStats(**self._counts())

    def __repr__(self) -> str:
        return (
            f"MicroBatcher(device={self.device}, max_batch={self.max_batch}, "
            f"max_delay_ms={self.max_delay_ms}, num_threads={self.num_threads}, "
            f"max_queue={self.max_queue}, when_full={self.when_full!r})"
        )


def _release_all(workers: list[ReaderStream]) -> None:
    for worker in workers:
        worker.release()


def _check_batching(*, max_batch: int, max_delay_ms: float, max_queue: int, when_full: str) -> None:
    check_count("max_batch", max_batch, optional=False)
    check_count("max_queue", max_queue, optional=False)
    # inf or NaN would hold a lone request forever (a worker spinning on NaN), and past
    # threading.TIMEOUT_MAX a worker's wait raises: it would die with its requests unanswered.
    if not _is_number(max_delay_ms) or not 0 <= max_delay_ms / 1000 <= threading.TIMEOUT_MAX:
        raise ValueError(
            f"max_delay_ms must be a finite number of milliseconds, 0 or more, got {max_delay_ms!r}"
        )
    if when_full not in ("block", "raise"):
        raise ValueError(f"when_full must be 'block' or 'raise', got {when_full!r}")


def _is_real(value: object) -> TypeGuard[float]:
    """A real number (an int, a float, numpy's), not a bool: one that compares and converts as a float."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite real number (numpy's too), not a bool (``True`` is no number of milliseconds).

    An int too large for a float (``10**400``) is none: torch and the lock waits take floats.
    """
    if not _is_real(value):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
