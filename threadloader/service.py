"""BatchDecoder: the inference-server face of the pipeline, with dynamic micro-batching.

Requests arrive one image at a time from any number of threads (or an asyncio loop). The GPU decoder
is several times faster per image on a batch, so, as Triton's dynamic batcher does, worker threads
gather queued requests into micro-batches (up to ``max_batch`` images, or whatever has arrived
``max_delay_ms`` after the first one) and make each with the training loader's own
:class:`~threadloader._pipeline.BatchProducer`: same decoder, same transforms, same stream hand-off.
Each caller gets its own image through a ``concurrent.futures.Future``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from queue import Full
from typing import Any, Literal

import numpy as np
import torch

from ._cancel import Cancelled
from ._handoff import ReaderStream, Ready
from ._options import as_transform, set_up
from ._output import OutputFormat
from ._pipeline import Batch, BatchProducer
from ._stats import STAGES, StatsRecorder
from ._workers import JOIN_TIMEOUT, POLL, ThreadGroup
from .decode.base import DEFAULT_MAX_PIXELS, Encoded, ImageDecoder
from .errors import LoaderClosedError, SampleError, ThreadLoaderError
from .transforms import Transform

__all__ = ["BatchDecoder", "QueueFullError", "ServiceStats", "WhenFull"]

WhenFull = Literal["block", "raise"]

#: Requests whose latency :meth:`BatchDecoder.stats` summarizes (the most recent ones).
LATENCY_WINDOW = 10_000
#: How often :meth:`BatchDecoder.adecode` retries a full queue without blocking the event loop.
_ASYNC_RETRY = 0.002

_service_numbers = itertools.count()


class QueueFullError(ThreadLoaderError, Full):
    """The request queue is at ``max_queue``: the service is overloaded.

    Also a ``queue.Full``, so code written against the standard library's queues catches it.
    """


@dataclass(frozen=True)
class ServiceStats:
    """A snapshot of a :class:`BatchDecoder`'s counters since it was created.

    ``submitted`` equals ``completed + failed + cancelled`` plus the requests still queued or being
    decoded.

    Attributes:
        queue_depth: Requests waiting in the queue now (not yet taken by a worker).
        submitted: Requests accepted by ``submit``.
        rejected: Requests refused because the queue was full.
        completed: Requests answered with an image.
        failed: Requests answered with an error (a bad image, or a failure of their whole batch).
        cancelled: Requests cancelled before decoding, by their caller or by ``close(cancel_pending=True)``.
        batches: Micro-batches decoded.
        batch_sizes: Micro-batch size to how many batches had it.
        latency_ms_p50: Median milliseconds from ``submit`` to the result, over the most recent
            :data:`LATENCY_WINDOW` completed requests; ``None`` before the first.
        latency_ms_p90: 90th percentile, likewise.
        latency_ms_p99: 99th percentile, likewise.
        cpu_fallbacks: Images the GPU decoder gave up on that Pillow decoded instead.
        stage_seconds: Host seconds per pipeline stage, summed over workers (keys as in ``STAGES``).
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
    cpu_fallbacks: int = 0
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))


@dataclass(slots=True)
class _Request:
    """One caller's image, the future it waits on, and the CUDA stream it will read the result on."""

    number: int
    data: Encoded
    future: Future[torch.Tensor]
    stream: torch.cuda.Stream | None
    submitted: float  # time.perf_counter()


class _RequestQueue:
    """A bounded FIFO that hands out micro-batches; every wait in it ends when it is closed."""

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
        self._items: collections.deque[_Request] = collections.deque()
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
            self._items.append(_Request(self.submitted, data, future, stream, time.perf_counter()))
            self.submitted += 1
            self._not_empty.notify()
        return future

    def gather(self) -> list[_Request] | None:
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
            batch: list[_Request] = []
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


class _Metrics:
    """Thread-safe counters of answered requests and batches, and a window of recent latencies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.completed = self.failed = self.batches = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)

    def batch(self, size: int) -> None:
        with self._lock:
            self.batches += 1
            self.batch_sizes[size] += 1

    def answered(self, *, ok: bool, seconds: float) -> None:
        with self._lock:
            if ok:
                self.completed += 1
                self._latencies.append(seconds * 1000)
            else:
                self.failed += 1

    def snapshot(self) -> dict[str, Any]:
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


@dataclass(frozen=True)
class _Engine:
    """What a worker needs to make a micro-batch.

    It holds no reference to the service, so that dropping the service runs its finalizer.
    """

    decoder: ImageDecoder
    output: OutputFormat
    transform: Transform | None
    pipeline_stats: StatsRecorder
    metrics: _Metrics

    def run(self, requests: list[_Request], reader: ReaderStream) -> None:
        """Decodes the requests as one batch on ``reader``'s stream and answers each future."""
        self.metrics.batch(len(requests))
        try:
            self._decode(requests, reader)
        except Cancelled:  # the interpreter is exiting: answer what this batch left, then stop
            for request in requests:
                if not request.future.done():
                    self._answer(request, error=LoaderClosedError(_CLOSED_WHILE_DECODING))
            raise
        except Exception as exc:  # e.g. CUDA out of memory: fail what this batch left unanswered, go on
            for request in requests:
                if not request.future.done():
                    self._answer(request, error=exc)

    def _decode(self, requests: list[_Request], reader: ReaderStream) -> None:
        rejected: dict[int, SampleError] = {}
        producer = BatchProducer(
            source=[request.data for request in requests],
            decoder=self.decoder,
            output=self.output,
            on_error="skip",  # a bad image fails its own request only
            stats=self.pipeline_stats,
            transform=self.transform,
            on_skip=lambda error: rejected.__setitem__(error.index, error),
        )
        (outcome,) = producer.produce([range(len(requests))], reader)
        if isinstance(outcome, Batch):
            images, event = dict(zip(outcome.indices, outcome.images, strict=True)), outcome.ready.event
        else:  # every image of the batch failed
            images, event = {}, None
        for position, request in enumerate(requests):
            image = images.get(position)
            if image is None:
                self._answer(request, error=_request_error(request, rejected.get(position)))
                continue
            if request.stream is not None:  # safe on the stream that was current in the submitting thread
                Ready([image], event).receive(stream=request.stream)
            self._answer(request, image=image)

    def _answer(
        self, request: _Request, *, image: torch.Tensor | None = None, error: BaseException | None = None
    ) -> None:
        self.metrics.answered(ok=error is None, seconds=time.perf_counter() - request.submitted)
        if error is None:
            request.future.set_result(image)  # type: ignore[arg-type]
        else:
            request.future.set_exception(error)


_CLOSED_WHILE_DECODING = "the interpreter is exiting: its BatchDecoder stopped while decoding this request"


def _request_error(request: _Request, error: SampleError | None) -> SampleError:
    """The pipeline's error for a rejected image, renamed after the request rather than its batch slot."""
    origin = f"request {request.number}, {len(request.data)} bytes"
    reason = error.reason if error is not None else "the decoder rejected it"
    stage = error.stage if error is not None else "decode"
    return SampleError(index=request.number, origin=origin, stage=stage, reason=reason)


def _serve(queue: _RequestQueue, engine: _Engine, readers: list[ReaderStream], index: int) -> None:
    """Worker ``index``: gathers micro-batches and decodes them until the queue is closed and drained."""
    while (requests := queue.gather()) is not None:
        if requests:
            engine.run(requests, readers[index])


class BatchDecoder:
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
        dtype: ``torch.uint8``, or a float type scaled to [0, 1].
        mean: Per-channel mean to subtract (float dtypes, with ``std``), on the [0, 1] scale.
        std: Per-channel standard deviation to divide by.
        channels_last: Results are views of ``channels_last`` batches (needs ``size``).
        num_threads: Worker threads, each gathering and decoding whole batches on its own CUDA stream;
            default as for :class:`ThreadLoader` (2 on a GPU, the CPU count on the CPU).
        max_queue: Most requests waiting; the memory bound.
        when_full: What ``submit`` does when ``max_queue`` requests wait: ``"block"`` until there is
            room (or ``timeout``), ``"raise"`` :class:`QueueFullError` at once (shed load).
        backend: GPU decoding backend, as for :class:`ThreadLoader`.
        decode_threads: nvImageCodec's own CPU threads; default: the cores the workers leave free.
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
        device: str | torch.device | int | None = None,
        max_batch: int = 64,
        max_delay_ms: float = 2.0,
        size: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.uint8,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        channels_last: bool = False,
        num_threads: int | None = None,
        max_queue: int = 1024,
        when_full: WhenFull = "block",
        backend: str = "auto",
        decode_threads: int | None = None,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        transform: Transform | Sequence[Transform] | None = None,
        region_decode: bool | None = None,
        decoder: ImageDecoder | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        if max_delay_ms < 0:
            raise ValueError(f"max_delay_ms must be 0 or more, got {max_delay_ms}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        if when_full not in ("block", "raise"):
            raise ValueError(f"when_full must be 'block' or 'raise', got {when_full!r}")
        chain = as_transform(transform)
        if chain is not None and chain.random:
            raise ValueError(
                f"{chain!r} is random: a service answers each image the same way every time; "
                "use deterministic transforms (Resize, CenterCrop, Normalize, ToDtype)"
            )
        setup = set_up(
            chain,
            size=size,
            dtype=dtype,
            mean=mean,
            std=std,
            channels_last=channels_last,
            device=device,
            num_threads=num_threads,
            backend=backend,
            decode_threads=decode_threads,
            max_pixels=max_pixels,
            region_decode=region_decode,
            decoder=decoder,
        )
        self.device, self.num_threads = setup.device, setup.num_threads
        self.max_batch = max_batch
        self.max_delay_ms = float(max_delay_ms)
        self.max_queue = max_queue
        self.when_full: WhenFull = when_full
        self._output = setup.output
        self._pipeline_stats = StatsRecorder()
        self._metrics = _Metrics()
        engine = _Engine(
            decoder=setup.decoder,
            output=setup.output,
            transform=chain,
            pipeline_stats=self._pipeline_stats,
            metrics=self._metrics,
        )
        self._queue = _RequestQueue(capacity=max_queue, max_batch=max_batch, max_delay=max_delay_ms / 1000)
        readers = [ReaderStream(self.device) for _ in range(self.num_threads)]
        # The workers see the queue and the engine, never the service: dropping it runs its finalizer.
        # Interpreter exit cancels the group: queued requests are cancelled, batches being decoded stop
        # at their next step and fail their requests with LoaderClosedError.
        self._group = ThreadGroup(
            name=f"threadloader-service{next(_service_numbers)}",
            count=self.num_threads,
            target=functools.partial(_serve, self._queue, engine, readers),
            wake=functools.partial(self._queue.close, cancel_pending=True),
        )

    def submit(self, data: Encoded, *, timeout: float | None = None) -> Future[torch.Tensor]:
        """Queues one encoded image; the future's result is its ``(3, H, W)`` tensor.

        The result is safe to use on the CUDA stream current in this thread now (see the class notes).
        A bad image fails only its own future, with a :class:`SampleError` whose ``index`` is the
        request's submission number. Cancelling the future before a worker takes it drops the request.
        Done-callbacks run in a worker thread: keep them short.

        Args:
            data: The encoded image (JPEG, PNG, ... bytes).
            timeout: With ``when_full="block"``, most seconds to wait for room in the queue (``None``:
                as long as it takes).

        Raises:
            QueueFullError: The queue is full (at once with ``when_full="raise"``, else after ``timeout``).
            LoaderClosedError: The service is closed.
        """
        return self._queue.put(
            _checked(data), self._caller_stream(), wait=timeout if self.when_full == "block" else 0.0
        )

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
        """
        futures: list[Future[torch.Tensor]] = []
        try:
            futures.extend(self.submit(data) for data in images)
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return [future.result() for future in futures]

    async def adecode(self, data: Encoded) -> torch.Tensor:
        """Decodes one image from asyncio, never blocking the event loop.

        The result is safe on the CUDA stream current in the loop's thread. With ``when_full="block"``,
        a full queue is waited out by retrying every few milliseconds (``asyncio.wait_for`` bounds it);
        cancelling the awaiting task cancels a request not yet decoded.

        Raises:
            SampleError: If the image cannot be decoded.
            QueueFullError: With ``when_full="raise"``, when the queue is full.
        """
        data, stream = _checked(data), self._caller_stream()
        while True:
            try:
                future = self._queue.put(data, stream, wait=0.0)
                break
            except QueueFullError:
                if self.when_full == "raise":
                    raise
            await asyncio.sleep(_ASYNC_RETRY)
        return await asyncio.wrap_future(future)

    def stats(self) -> ServiceStats:
        """Counters, the batch-size histogram and recent latency percentiles since construction."""
        pipeline = self._pipeline_stats.snapshot()
        return ServiceStats(
            **self._queue.counts(),
            cpu_fallbacks=pipeline.cpu_fallbacks,
            stage_seconds=pipeline.stage_seconds,
            **self._metrics.snapshot(),
        )

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stops the service; further ``submit`` calls raise :class:`LoaderClosedError`. Idempotent.

        Args:
            cancel_pending: ``False`` (default) decodes every request already queued, then stops: close
                returns when they are all answered. ``True`` cancels the queued requests (their futures
                raise ``CancelledError``); the batches being decoded still complete, and the workers
                are joined within about a second.
        """
        self._queue.close(cancel_pending=cancel_pending)
        # close() may run in a worker, from a done-callback: the group never waits for the calling thread.
        self._group.join(JOIN_TIMEOUT if cancel_pending else None)

    @property
    def threads(self) -> list[threading.Thread]:
        """The worker threads (for tests and diagnostics)."""
        return self._group.threads

    def _caller_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def __enter__(self) -> BatchDecoder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # A finalizer must not block on queued work: holders of pending futures get CancelledError.
        if getattr(self, "_group", None) is not None:
            self.close(cancel_pending=True)

    def __repr__(self) -> str:
        return (
            f"BatchDecoder(device={self.device}, max_batch={self.max_batch}, "
            f"max_delay_ms={self.max_delay_ms}, num_threads={self.num_threads}, "
            f"max_queue={self.max_queue}, when_full={self.when_full!r}, output={self._output})"
        )


def _checked(data: object) -> Encoded:
    """Refuses anything but in-memory bytes: a string would be read as a file path by the pipeline."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"BatchDecoder decodes encoded image bytes, got {type(data).__name__}; "
            "pass the file's contents (open(path, 'rb').read()), not its path"
        )
    return data
