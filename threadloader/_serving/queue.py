"""The service's request queue: bounded, FIFO, and handing out micro-batches to worker threads.

Every wait in it (a submitter waiting for room, a worker waiting for requests) ends when it is closed.
A request cancelled while it waits leaves the queue at once, so its slot is free for the next caller
(a client that went away holds no room). Waiting for room from asyncio is woken by freed slots, not
polled. Submitters waiting for room, threads and asyncio tasks alike, stand in one line and get slots
first come first served: a freed slot is handed to the first in line, and a newcomer queues behind
them (a slot taken by whoever ran first left a waiter behind newcomers, again and again).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .._gil import MERGE_INTERVAL
from .._workers import POLL
from ..errors import LoaderClosedError, QueueFullError

__all__ = ["Request", "RequestQueue", "cancel"]

logger = logging.getLogger("threadloader")


@dataclass(slots=True, eq=False)  # compared by identity: the queue removes a cancelled one by itself
class Request:
    """One caller's input, the future it waits on, and the CUDA stream it will read the result on."""

    number: int
    data: Any
    future: Future[Any]
    stream: torch.cuda.Stream | None
    submitted: float  # time.perf_counter()


class RequestQueue:
    """A bounded FIFO that hands out micro-batches; every wait in it ends when it is closed.

    Args:
        capacity: Most requests waiting (``max_queue``).
        max_batch: Most requests in one micro-batch.
        max_delay: Most seconds a micro-batch waits for company, counted from its first request's
            submission.
        owner: The service's class name, for error messages.
    """

    def __init__(self, *, capacity: int, max_batch: int, max_delay: float, owner: str) -> None:
        self._capacity = capacity
        self._max_batch = max_batch
        self._max_delay = max_delay
        self._owner = owner
        # Reentrant: a service dropped in a reference cycle is finalized (and closed) by whichever thread
        # the garbage collector runs in, which may be a worker inside this lock.
        self._lock = threading.RLock()
        self._not_empty = threading.Condition(self._lock)
        # Held by the one worker gathering a batch, so that concurrent arrivals fill its batch instead
        # of being split among idle workers; the others wait here and decode in parallel meanwhile.
        self._gathering = threading.Lock()
        self._items: collections.deque[Request] = collections.deque()
        # Submitters waiting for room, first come first served; and the slots handed to some of them
        # that they have not taken yet, which count as taken.
        self._line: collections.deque[_Waiter] = collections.deque()
        self._granted = 0
        self.closed = False
        self.submitted = self.rejected = self.cancelled = 0

    def put(self, data: Any, stream: torch.cuda.Stream | None, *, wait: float | None) -> Future[Any]:
        """Enqueues a request; waits up to ``wait`` seconds for room (``None``: as long as it takes).

        Raises:
            QueueFullError: If the queue is still full when the wait ends.
            LoaderClosedError: If the service is closed, also while waiting.
        """
        with self._lock:
            if self._room() or wait == 0:
                return self._claim(None, data, stream)
            deadline = None if wait is None else time.monotonic() + wait
            ready = threading.Condition(self._lock)
            waiter = _Waiter(ready=ready)
            self._line.append(waiter)
            # The claim inside too: a Ctrl-C landing between the wait's end and the claim (the call's
            # first step) left a slot handed to it taken for good, and a full queue's later callers
            # waited forever.
            try:
                while not waiter.granted and not self.closed:
                    remaining = POLL if deadline is None else deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    ready.wait(min(remaining, POLL))
                return self._claim(waiter, data, stream)
            except BaseException:  # Ctrl-C: a slot it was handed goes to the next in line
                self._leave(waiter)
                raise

    async def aput(self, data: Any, stream: torch.cuda.Stream | None, *, wait: float | None) -> Future[Any]:
        """As :meth:`put`, awaiting room without blocking the event loop: woken when a slot is freed.

        The waiter is awaited directly, its deadline a timer that completes it: ``asyncio.wait_for``
        on Python 3.11 (gh-86296) returned normally when the task was cancelled in the loop step that
        woke it, and the cancelled caller queued its request and waited for the result.
        """
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._room() or wait == 0:
                return self._claim(None, data, stream)
            waiter = _Waiter(loop=loop, future=loop.create_future())
            self._line.append(waiter)
        assert waiter.future is not None
        timer = None if wait is None else loop.call_later(wait, _set_done, waiter.future)
        try:
            await waiter.future  # handed a slot, the queue closed, or its time is up
            with self._lock:  # inside: a Ctrl-C before the claim passes the slot on, as in put
                return self._claim(waiter, data, stream)
        except BaseException:  # cancelled: a slot it was handed goes to the next in line
            self._leave(waiter)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def gather(self) -> list[Request] | None:
        """Blocks for the first request, then takes more until ``max_batch`` or ``max_delay`` after it.

        The delay runs from the first request's submission, so a request that already waited behind
        busy workers is not held back further. Requests cancelled by their caller are dropped here if
        they were not already.

        Returns:
            The micro-batch (empty when all it took were cancelled); ``None`` once closed and drained.
        """
        with self._gathering_turn(), self._lock:
            while not self._items:
                if self.closed:
                    return None
                self._not_empty.wait(MERGE_INTERVAL or POLL)  # the waiter's dropped objects, freed (3.13t)
            deadline = self._items[0].submitted + self._max_delay
            batch: list[Request] = []
            while len(batch) < self._max_batch:
                if self._items:
                    request = self._items.popleft()
                    self._freed()
                    if _start(request.future):
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
            line, self._line = self._line, collections.deque()
            for waiter in line:  # each finds the queue closed
                waiter.wake()
        for request in dropped:  # outside the lock: cancel() runs the callers' done-callbacks
            cancel(request.future)
            if request.future.cancelled():
                _notify_cancelled(request.future)

    def counts(self) -> dict[str, Any]:
        """Requests queued now, and the queue's counters, read together."""
        with self._lock:
            return {
                "queue_depth": len(self._items),
                "submitted": self.submitted,
                "rejected": self.rejected,
                "cancelled": self.cancelled,
            }

    def _room(self) -> bool:
        """Whether a newcomer may queue now: a free slot and nobody in line before it.

        ``True`` once closed, so that it meets the closed error.
        """
        return self.closed or (not self._line and len(self._items) + self._granted < self._capacity)

    def _claim(self, waiter: _Waiter | None, data: Any, stream: torch.cuda.Stream | None) -> Future[Any]:
        """Queues a request where there is room for it, under the lock; else raises the rejection.

        The room is a slot handed to ``waiter``, else a free one (``waiter`` leaves the line).
        """
        if waiter is not None:
            if waiter.granted:
                waiter.granted = False
                self._granted -= 1
                return self._append(data, stream)
            with contextlib.suppress(ValueError):  # its time is up: it leaves the line
                self._line.remove(waiter)
        if self._room():
            return self._append(data, stream)
        raise self._rejection()

    def _rejection(self) -> QueueFullError:
        self.rejected += 1
        return QueueFullError(
            f"{self._owner} queue is full ({self._capacity} requests waiting, max_queue={self._capacity}): "
            "the service is overloaded; retry later or raise max_queue"
        )

    def _append(self, data: Any, stream: torch.cuda.Stream | None) -> Future[Any]:
        if self.closed:
            raise LoaderClosedError(f"this {self._owner} was closed; create a new one")
        request = Request(self.submitted, data, Future(), stream, time.perf_counter())
        self._items.append(request)
        self.submitted += 1
        self._not_empty.notify()
        # Not a partial over the request: the future would hold it, and through it itself and its result,
        # in a cycle that only the garbage collector frees, not the caller's dropping the result.
        request.future.add_done_callback(self._withdraw)
        return request.future

    @contextlib.contextmanager
    def _gathering_turn(self) -> Iterator[None]:
        """Holds :attr:`_gathering`; a worker waiting for it wakes as one waiting for requests does."""
        while not self._gathering.acquire(timeout=MERGE_INTERVAL or -1):  # wakes on 3.13t only
            pass
        try:
            yield
        finally:
            self._gathering.release()

    def _withdraw(self, future: Future[Any]) -> None:
        """A request's done-callback: one cancelled while queued leaves the queue and frees its slot."""
        if not future.cancelled():
            return
        with self._lock:
            # O(queue), within max_queue; not found: already taken by gather (and counted there) or
            # dropped by close (which notifies it).
            at = next((at for at, request in enumerate(self._items) if request.future is future), None)
            if at is None:
                return
            del self._items[at]
            self.cancelled += 1
            self._freed()
        _notify_cancelled(future)

    def _freed(self) -> None:
        """A slot was freed (under the lock): handed to the first in line, if anyone waits for one.

        A waiter that can no longer take it (its task cancelled, its loop closed) passes it on.
        """
        while self._line and len(self._items) + self._granted < self._capacity:
            waiter = self._line.popleft()
            if waiter.wake():
                waiter.granted = True
                self._granted += 1

    def _leave(self, waiter: _Waiter) -> None:
        """A submitter gives up waiting (cancelled, interrupted): a slot it was handed goes to the next."""
        with self._lock:
            if waiter.granted:
                waiter.granted = False
                self._granted -= 1
            else:
                with contextlib.suppress(ValueError):
                    self._line.remove(waiter)
            # Also where it held none: a Ctrl-C inside its claim may have let go of its slot unqueued.
            self._freed()


@dataclass(slots=True, eq=False)  # compared by identity: it leaves the line by itself
class _Waiter:
    """A submitter waiting in line for room: a thread (``ready``) or an asyncio task (``future``)."""

    ready: threading.Condition | None = None
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future[None] | None = None
    granted: bool = False  # a slot was handed to it

    def wake(self) -> bool:
        """Wakes it, under the queue's lock; ``False`` where nothing would wake.

        That is a task cancelled (which may not have left the line yet) or one whose loop closed.
        """
        if self.ready is not None:
            self.ready.notify()
            return True
        assert self.loop is not None and self.future is not None
        return not self.future.done() and _wake(self.loop, self.future)


def _set_done(waiter: asyncio.Future[None]) -> None:
    """Completes an asyncio waiter (in its loop) that nothing completed or cancelled yet."""
    if not waiter.done():
        waiter.set_result(None)


def _wake(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future[None]) -> bool:
    """Wakes an asyncio waiter from any thread; ``False`` where its loop has closed (nothing to wake)."""
    try:
        loop.call_soon_threadsafe(_set_done, waiter)
    except RuntimeError:
        return False
    return True


def cancel(future: Future[Any]) -> None:
    """Cancels ``future``; a done-callback's ``SystemExit`` or other non-``Exception`` is logged.

    ``concurrent.futures`` catches only an ``Exception`` from a callback: raised on, it stopped a loop
    of cancels, leaving the later requests neither queued nor answered, their callers waiting forever.
    """
    try:
        future.cancel()
    except Exception:
        raise
    except BaseException:
        logger.exception("a done-callback of a cancelled request raised; the other requests go on")


def _notify_cancelled(future: Future[Any]) -> None:
    """Tells ``concurrent.futures.wait`` and ``as_completed`` that a request cancelled while queued is done.

    ``cancel()`` alone does not: their waiters hear of a cancel only from the future's
    ``set_running_or_notify_cancel()``, which an executor calls as it takes the work, and a request
    that leaves the queue is never taken (``wait([future])`` never returned). Called once per future,
    by whichever took it off the queue (under the queue's lock, so only one does).
    """
    future.set_running_or_notify_cancel()


def _start(future: Future[Any]) -> bool:
    """Marks a queued request's future running: ``False`` if it was cancelled or finished while queued.

    A future its caller finished itself (``set_exception`` on giving up) is withdrawn as a cancelled one
    is, without ``set_running_or_notify_cancel``: on it that raised ``RuntimeError`` (which ended the
    worker thread) and logged a CRITICAL "in unexpected state" line per request given up. A cancelled one
    goes through it, which tells ``concurrent.futures.wait`` and ``as_completed``.
    """
    if future.done() and not future.cancelled():
        return False
    try:
        return future.set_running_or_notify_cancel()
    except RuntimeError:  # finished by its holder since the check: withdrawn too
        return False
