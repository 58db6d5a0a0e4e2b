"""Decoding a gathered micro-batch with the loader's ``BatchProducer`` and answering each request's future.

The worker threads run :func:`serve`: gather a micro-batch from the queue, decode it, repeat until the
queue is closed and drained. A bad image fails its own request; a failure of the whole batch (CUDA out
of memory) fails the requests it left unanswered, and the worker goes on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .._cancel import Cancelled
from .._handoff import Ready
from .._pipeline import Batch
from .._runtime import Runtime
from .._stats import StatsRecorder
from ..errors import LoaderClosedError, SampleError
from .metrics import Metrics
from .queue import Request, RequestQueue

__all__ = ["Engine", "serve"]

_CLOSED_WHILE_DECODING = "the interpreter is exiting: its BatchDecoder stopped while decoding this request"


@dataclass(frozen=True)
class Decoded:
    """A micro-batch's outcome by position: each image made, each rejection, and the batch's event."""

    images: dict[int, torch.Tensor]
    rejected: dict[int, SampleError]
    event: torch.cuda.Event | None


@dataclass(frozen=True)
class Engine:
    """What a worker needs to make a micro-batch.

    It holds no reference to the service, so that dropping the service runs its finalizer.
    """

    runtime: Runtime
    pipeline_stats: StatsRecorder
    metrics: Metrics

    def run(self, requests: list[Request], worker: int) -> None:
        """Decodes the requests as one batch on ``worker``'s stream and answers each future."""
        self.metrics.batch(len(requests))
        try:
            self._answer_all(requests, self._decode(requests, worker))
        except Cancelled:  # the interpreter is exiting: answer what this batch left, then stop
            self._fail_unanswered(requests, LoaderClosedError(_CLOSED_WHILE_DECODING))
            raise
        except Exception as exc:  # e.g. CUDA out of memory: fail what this batch left unanswered, go on
            self._fail_unanswered(requests, exc)

    def _decode(self, requests: list[Request], worker: int) -> Decoded:
        rejected: dict[int, SampleError] = {}
        producer = self.runtime.producer(
            source=[request.data for request in requests],
            on_error="skip",  # a bad image fails its own request only
            stats=self.pipeline_stats,
            on_skip=lambda error: rejected.__setitem__(error.index, error),
        )
        # While nvImageCodec starts, Pillow decodes; else it waits for the warm-up (once).
        (outcome,) = self.runtime.produce(producer, [range(len(requests))], worker)
        if not isinstance(outcome, Batch):  # every image of the batch failed
            return Decoded({}, rejected, None)
        return Decoded(dict(zip(outcome.indices, outcome.images, strict=True)), rejected, outcome.ready.event)

    def _answer_all(self, requests: list[Request], decoded: Decoded) -> None:
        for position, request in enumerate(requests):
            image = decoded.images.get(position)
            if image is None:
                self._answer(request, error=_request_error(request, decoded.rejected.get(position)))
                continue
            if request.stream is not None:  # safe on the stream that was current in the submitting thread
                Ready([image], decoded.event).receive(stream=request.stream)
            self._answer(request, image=image)

    def _fail_unanswered(self, requests: list[Request], error: BaseException) -> None:
        for request in requests:
            if not request.future.done():
                self._answer(request, error=error)

    def _answer(
        self, request: Request, *, image: torch.Tensor | None = None, error: BaseException | None = None
    ) -> None:
        self.metrics.answered(ok=error is None, seconds=time.perf_counter() - request.submitted)
        if error is None:
            request.future.set_result(image)  # type: ignore[arg-type]
        else:
            request.future.set_exception(error)


def _request_error(request: Request, error: SampleError | None) -> SampleError:
    """The pipeline's error for a rejected image, renamed after the request rather than its batch slot."""
    origin = f"request {request.number}, {len(request.data)} bytes"
    reason = error.reason if error is not None else "the decoder rejected it"
    stage = error.stage if error is not None else "decode"
    renamed = SampleError(index=request.number, origin=origin, stage=stage, reason=reason)
    renamed.__cause__ = error.__cause__ if error is not None else None
    return renamed


def serve(queue: RequestQueue, engine: Engine, index: int) -> None:
    """Worker ``index``: gathers micro-batches and decodes them until the queue is closed and drained."""
    while (requests := queue.gather()) is not None:
        if requests:
            engine.run(requests, index)
