"""Decoding a gathered micro-batch with the loader's ``BatchProducer`` and answering each request's future.

The worker threads run :func:`serve`: gather a micro-batch from the queue, run it (decode it, here; call
a function on it, in ``batcher``), repeat until the queue is closed and drained. A bad image fails its
own request; a failure of the whole batch (CUDA out of memory) fails the requests it left unanswered,
and the worker goes on.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._cancel import Cancelled
from .._handoff import Ready
from .._pipeline import Batch
from .._runtime import Runtime
from .._stats import StatsRecorder
from .._workers import LastOut
from ..errors import LoaderClosedError, SampleError, detached
from .metrics import Metrics
from .queue import Request, RequestQueue

logger = logging.getLogger("threadloader")

__all__ = ["Engine", "Runner", "answer", "run_guarded", "serve", "serve_then_leave"]

_CLOSED_WHILE_RUNNING = "the interpreter is exiting: its service stopped while running this request"


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
        run_guarded(
            self.metrics, requests, lambda: self._answer_all(requests, self._decode(requests, worker))
        )

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
        if isinstance(outcome, Exception):  # what the transform raised: it fails the whole micro-batch
            try:
                raise outcome
            finally:  # the traceback holds this frame: it must not hold the error in turn
                del outcome
        if not isinstance(outcome, Batch):  # every image of the batch failed
            return Decoded({}, rejected, None)
        return Decoded(dict(zip(outcome.indices, outcome.images, strict=True)), rejected, outcome.ready.event)

    def _answer_all(self, requests: list[Request], decoded: Decoded) -> None:
        for position, request in enumerate(requests):
            image = decoded.images.get(position)
            if image is None:
                answer(self.metrics, request, error=_request_error(request, decoded.rejected.get(position)))
                continue
            if request.stream is not None:  # safe on the stream that was current in the submitting thread
                Ready([image], decoded.event).receive(stream=request.stream)
            answer(self.metrics, request, result=image)


def _request_error(request: Request, error: SampleError | None) -> SampleError:
    """The pipeline's error for a rejected image, renamed after the request rather than its batch slot."""
    origin = f"request {request.number}, {memoryview(request.data).nbytes} bytes"  # bytes, not items
    reason = error.reason if error is not None else "the decoder rejected it"
    stage = error.stage if error is not None else "decode"
    renamed = SampleError(index=request.number, origin=origin, stage=stage, reason=reason)
    renamed.__cause__ = error.__cause__ if error is not None else None
    return renamed


class Runner(Protocol):
    """What a worker runs a gathered micro-batch with (:class:`Engine`, ``batcher.CallEngine``)."""

    def run(self, requests: list[Request], worker: int) -> None:
        """Answers every request's future."""


def run_guarded(metrics: Metrics, requests: list[Request], work: Callable[[], None]) -> None:
    """Counts the micro-batch and runs ``work``, which answers its requests.

    A failure of the whole batch answers those it left with that error, and the worker goes on (at
    interpreter exit, it stops). Any error counts, not only an ``Exception``: a function that raises
    ``asyncio.CancelledError`` or calls ``sys.exit()`` would otherwise end the worker with its requests
    unanswered. The error goes to the futures as a copy detached from its frames (``errors.detached``),
    which hold this batch's requests, whose futures hold the error: a cycle that kept every activation
    of the failed call alive until the garbage collector ran. The raised error itself loses its frames
    too, in case the function keeps it, but gains no note.
    """
    metrics.batch(len(requests))
    try:
        work()
    except Cancelled:  # the interpreter is exiting: answer what this batch left, then stop
        _fail_unanswered(metrics, requests, LoaderClosedError(_CLOSED_WHILE_RUNNING))
        raise
    except BaseException as exc:  # e.g. CUDA out of memory: fail what this batch left unanswered, go on
        error = detached(_chain_copy(_deliverable(exc)))
        detached(exc, as_text=False)  # an error the function keeps holds no worker's frames
        _fail_unanswered(metrics, requests, error)


def _deliverable(exc: BaseException) -> BaseException:
    """``exc``, or a ``RuntimeError`` caused by it where a caller could not be given ``exc`` itself.

    An asyncio caller's future refuses a ``StopIteration`` (its answer never came), and re-raises a
    ``KeyboardInterrupt`` or ``SystemExit`` into its event loop (one bad batch stopped the server), or
    a ``CancelledError`` as if the caller had been cancelled: those arrive as the ``__cause__``.
    """
    if isinstance(exc, Exception) and not isinstance(exc, (StopIteration, StopAsyncIteration)):
        return exc
    try:
        text = str(exc)
    except Exception as error:  # a __str__ that raises ended the worker here, its requests unanswered
        text = f"<its str() raised {type(error).__name__}>"
    wrapped = RuntimeError(f"the batch function raised {type(exc).__name__}: {text}".rstrip(": "))
    wrapped.__cause__ = exc
    return wrapped


def answer(
    metrics: Metrics, request: Request, *, result: Any = None, error: BaseException | None = None
) -> None:
    """Completes a request's future with its result or ``error``, and counts it.

    Counted first, so that a caller woken by its answer reads stats that include it. A future its
    caller finished while the request ran (``set_exception`` on giving up) is left as it is and counted
    as failed: its ``InvalidStateError``, raised on, went to the batch's later requests in place of
    their answers. A done-callback's ``SystemExit`` or other non-``Exception`` (``concurrent.futures``
    catches only an ``Exception``) is logged here: raised on, it went to the batch's other requests, or
    ended the worker with them unanswered.
    """
    given_up = request.future.done()
    metrics.answered(ok=error is None and not given_up, seconds=time.perf_counter() - request.submitted)
    if given_up:
        return
    try:
        if error is None:
            request.future.set_result(result)
        else:
            request.future.set_exception(error)
    except InvalidStateError:  # finished by its caller since the check above: it has its answer
        return
    except Exception:
        raise
    except BaseException:
        logger.exception("a done-callback of a request raised; the request is answered, the service goes on")


def _fail_unanswered(metrics: Metrics, requests: list[Request], error: BaseException) -> None:
    for request in requests:
        if not request.future.done():
            answer(metrics, request, error=_own_copy(error))


def _own_copy(error: BaseException) -> BaseException:
    """A request's own copy of its batch's error, of the same type, message and chain.

    Each ``future.result()`` raises the object it was given, and a raise adds the raising caller's
    frames to that object's traceback: one object shared by a batch's callers carried each caller's
    frames, and the locals in them (a request's body), to the others, and kept them alive. An error
    that cannot be copied is shared.
    """
    own = _copied(error)
    if own is not error:
        own.__cause__, own.__context__ = error.__cause__, error.__context__
        own.__suppress_context__ = error.__suppress_context__
    return own


def _chain_copy(error: BaseException, memo: dict[int, BaseException] | None = None) -> BaseException:
    """``error`` and the errors it chains, copied with their tracebacks: what ``detached`` may change.

    A batch function may raise an error it keeps (a module's one instance, raised again and again):
    detached in place, it gained a note of the traceback at every batch, which every later request's
    error then printed.
    """
    memo = {} if memo is None else memo
    if id(error) in memo:
        return memo[id(error)]
    own = memo[id(error)] = _copied(error)
    if own is not error:
        own.__traceback__ = error.__traceback__
        own.__suppress_context__ = error.__suppress_context__
        own.__cause__ = None if error.__cause__ is None else _chain_copy(error.__cause__, memo)
        own.__context__ = None if error.__context__ is None else _chain_copy(error.__context__, memo)
    return own


def _copied(error: BaseException) -> BaseException:
    """A copy of ``error``, its attributes and notes its own; ``error`` itself where it cannot be copied.

    ``copy.copy`` builds it anew from its arguments, which an ``__init__`` that formats its message
    from them formats again ("failed with code failed with code 7"): such an error is copied without
    its ``__init__``.
    """
    own: BaseException | None = None
    with contextlib.suppress(Exception):
        own = copy.copy(error)
    try:
        if own is None or str(own) != str(error):
            own = type(error).__new__(type(error), *error.args)
            own.__dict__.update(vars(error))
    except Exception:
        return error
    notes = getattr(error, "__notes__", None)
    if notes is not None:
        own.__notes__ = list(notes)  # type: ignore[attr-defined]  # a note one caller adds stays its own
    return own


def serve(queue: RequestQueue, runner: Runner, index: int) -> None:
    """Worker ``index``: gathers micro-batches and runs them until the queue is closed and drained."""
    while _serve_one(queue, runner, index):
        pass


def _serve_one(queue: RequestQueue, runner: Runner, index: int) -> bool:
    """Gathers one micro-batch and runs it; whether the queue is still open.

    A call of its own, so that the worker holds none of the batch's requests (nor, through their
    futures, the answers) while it waits for the next: a caller that drops an answer frees it.
    """
    requests = queue.gather()
    if requests is None:
        return False
    if requests:
        runner.run(requests, index)
    return True


def serve_then_leave(last_out: LastOut, queue: RequestQueue, runner: Runner, index: int) -> None:
    """A worker's target: :func:`serve`, then ``last_out.leave()`` however it ended.

    The last worker out closes the service's decoder, if its close has handed that over.
    """
    try:
        serve(queue, runner, index)
    finally:
        last_out.leave()
