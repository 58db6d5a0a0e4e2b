"""A pool of threads that runs numbered tasks and hands results out in task order.

Ordering does not depend on thread timing: tasks are numbered when they are taken, results are keyed
by that number, and the consumer takes them strictly in sequence. Memory is bounded: no thread starts
a task more than ``window`` tasks ahead of the consumer. Every wait ends on ``close()``, and the
consumer's wait also notices threads that died, so nothing hangs. Threads hold no reference to whoever
owns the pool, so dropping the owner closes the pool.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

__all__ = ["OrderedPool"]

T = TypeVar("T")

#: Seconds ``close()`` waits for all threads to finish their current task.
JOIN_TIMEOUT = 1.0
_POLL = 0.5

_open_pools: weakref.WeakSet[OrderedPool[Any]] = weakref.WeakSet()


class OrderedPool(Generic[T]):
    """Runs ``work(task, thread_index)`` for each task on ``num_threads`` threads, in-order results.

    Args:
        tasks: The tasks, taken lazily (under the pool's lock) as threads become free.
        work: Called in a pool thread; its return value or exception is the task's result.
        num_threads: Threads to start; ``thread_index`` is ``0..num_threads-1``, stable per thread.
        window: Most tasks taken but not yet handed to the consumer (the memory bound).
        name: Prefix of the threads' names, to find them in a debugger or ``threading.enumerate()``.
    """

    def __init__(
        self,
        *,
        tasks: Iterator[Any],
        work: Callable[[Any, int], T],
        num_threads: int,
        window: int,
        name: str,
    ) -> None:
        self._tasks = tasks
        self._work = work
        self._window = max(window, 1)
        self._cv = threading.Condition()
        self._taken = 0  # tasks taken from the iterator so far
        self._handed = 0  # results handed to the consumer so far
        self._end: int | None = None  # number of tasks, once the iterator is exhausted
        self._results: dict[int, tuple[bool, Any]] = {}
        self._closed = False
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(num_threads)
        ]
        _open_pools.add(self)
        for thread in self._threads:
            thread.start()

    def next(self) -> T:
        """Returns the next result in task order, re-raising the task's exception.

        Raises:
            StopIteration: After the last task's result, or once the pool is closed.
        """
        with self._cv:
            while True:
                if self._handed in self._results:
                    ok, value = self._results.pop(self._handed)
                    self._handed += 1
                    self._cv.notify_all()
                    if ok:
                        return value
                    raise value
                if self._closed or (self._end is not None and self._handed >= self._end):
                    raise StopIteration
                if not any(thread.is_alive() for thread in self._threads):
                    raise RuntimeError("all reader threads ended without producing the next batch")
                self._cv.wait(_POLL)

    def close(self) -> None:
        """Stops taking tasks, drops pending results and joins the threads (each finishes its task)."""
        with self._cv:
            self._closed = True
            self._results.clear()
            self._cv.notify_all()
        deadline = time.monotonic() + JOIN_TIMEOUT
        current = threading.current_thread()
        for thread in self._threads:
            if thread is not current:
                thread.join(max(0.0, deadline - time.monotonic()))
        _open_pools.discard(self)

    @property
    def threads(self) -> list[threading.Thread]:
        """The pool's threads (for tests and diagnostics)."""
        return list(self._threads)

    def _run(self, index: int) -> None:
        while True:
            with self._cv:
                while not self._closed and self._end is None and self._taken >= self._handed + self._window:
                    self._cv.wait()
                if self._closed or self._end is not None:
                    return
                seq = self._taken
                try:
                    task = next(self._tasks)
                except StopIteration:
                    self._end = seq
                    self._cv.notify_all()
                    return
                except BaseException as exc:
                    self._results[seq] = (False, exc)
                    self._taken = self._end = seq + 1
                    self._cv.notify_all()
                    return
                self._taken += 1
            try:
                result: tuple[bool, Any] = (True, self._work(task, index))
            except BaseException as exc:
                result = (False, exc)
            with self._cv:
                if self._closed:
                    return
                self._results[seq] = result
                self._cv.notify_all()


@atexit.register
def _close_open_pools() -> None:
    """Joins reader threads before the interpreter tears down the libraries they are calling into."""
    for pool in list(_open_pools):
        pool.close()
