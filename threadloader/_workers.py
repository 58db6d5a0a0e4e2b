"""The library's threads: how they start, stop, and end before the interpreter does; and OrderedPool.

Every thread the library starts belongs to a :class:`ThreadGroup`, the one place that decides how
threads stop. Stopping is cooperative: cancelling a group sets the flag that :func:`check_cancelled`
reads between the steps of a batch (a sample, an image, a batch), so a thread ends within one step
however long its batch is, and its owner's waits are woken. The threads are daemons, and an ``atexit``
hook cancels every group and waits until its threads have returned: a thread abandoned inside torch
when the interpreter finalizes aborts the process (``terminate called without an active exception``).
A daemon thread of the user's still iterating then waits until the process ends (:func:`_exiting`).
Each thread runs torch's ops on itself alone (:func:`_one_intra_op_thread`): the threads are the
parallelism. A ``MicroBatcher``'s are not: they run the user's model, which keeps torch's count.

:class:`OrderedPool` runs numbered tasks on a group and hands results out in task order. Ordering does
not depend on thread timing: tasks are numbered when they are taken, results are keyed by that number,
and the consumer takes them strictly in sequence. Memory is bounded: no thread starts a task more than
``window`` tasks ahead of the consumer. Every wait ends on ``close()``, and the consumer's wait also
notices threads that died, so nothing hangs. Threads hold no reference to whoever owns the pool, so
dropping the owner closes the pool.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar, overload

import torch

from ._cancel import Cancelled, bind_cancel, in_own_thread
from ._gil import MERGE_INTERVAL
from .errors import LoaderClosedError

__all__ = [
    "JOIN_TIMEOUT",
    "POLL",
    "LastOut",
    "OrderedPool",
    "ThreadGroup",
    "WeakRegistry",
    "available_cpus",
    "close_deadline",
    "consumer_error",
    "park_outside",
    "uninterrupted",
]

T = TypeVar("T")

#: Most seconds an owner's ``close()`` waits for its threads. They end at their next cancellation check
#: anyway, and interpreter exit waits for them however long that takes.
JOIN_TIMEOUT = 1.0
#: Longest a thread waits before checking again whether its owner closed (wake-ups are immediate).
POLL = 0.5


#: Seconds interpreter exit waits before saying on stderr which threads it is waiting for.
EXIT_NOTICE = 10.0


class WeakRegistry(Generic[T]):
    """Objects held by weak reference, added and listed from any thread, under one lock.

    Not a ``weakref.WeakSet``: its removals run in whichever thread drops an object, outside any lock of
    the caller's, and one that lands while another thread copies the set raises "Set changed size
    during iteration" there (a window the GIL made narrow; free-threaded Python runs it in parallel).
    Here nothing changes outside the lock: dead references are dropped when an object is added.
    Re-entrant: a signal handler runs in the main thread between two of its bytecodes, so a handler's
    ``state_dict()`` or ``close()`` (which list a loader's iterators here) may come while that thread
    is inside ``live()`` itself; with a plain lock it waited for itself forever.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._refs: list[weakref.ref[T]] = []

    def add(self, item: T) -> None:
        """Adds ``item``, held weakly."""
        with self._lock:
            self._refs = [ref for ref in self._refs if ref() is not None]
            self._refs.append(weakref.ref(item))

    def live(self) -> list[T]:
        """The objects added and still alive, in the order they were added."""
        with self._lock:
            return [item for item in (ref() for ref in self._refs) if item is not None]


#: Every thread group alive, for the exit hook to stop.
_groups: WeakRegistry[ThreadGroup] = WeakRegistry()
#: Set by the exit hook, under its lock: a group made after it would start threads that nothing stops
#: before finalization.
_exited = False
_exit_lock = threading.Lock()


def close_deadline(until: float | None = None) -> float:
    """The ``time.monotonic()`` deadline of a close's wait.

    ``until``, an owner's deadline shared by the groups it closes, else :data:`JOIN_TIMEOUT` from now.
    """
    return time.monotonic() + JOIN_TIMEOUT if until is None else until


class ThreadGroup:
    """Daemon threads that one owner (a pool, a service) starts and stops together.

    Daemons, because Python joins other threads before running ``atexit`` hooks: a thread waiting for
    a consumer that is gone would hang the interpreter before anything could tell it to stop. The exit
    hook here does that instead: it cancels the group and waits until the threads have returned.

    Args:
        name: Prefix of the threads' names (``name-0``, ``name-1``...).
        count: Threads to start.
        target: Called in each thread with its index ``0..count-1``; it may end by raising
            :class:`Cancelled` once cancelled.
        wake: Called on :meth:`cancel`, in the cancelling thread: wakes the owner's waits (its threads
            waiting for work, a consumer waiting for results), which must then end.
        one_op_thread: Each thread runs torch's ops on itself alone (:func:`_one_intra_op_thread`);
            ``False`` for threads that run the user's own code (a model stage), which keep torch's count.
    """

    def __init__(
        self,
        *,
        name: str,
        count: int,
        target: Callable[[int], None],
        wake: Callable[[], None],
        one_op_thread: bool = True,
    ) -> None:
        self.cancelled = threading.Event()
        self._wake = wake
        self._one_op_thread = one_op_thread
        self._threads = [
            threading.Thread(target=self._run, args=(target, i), name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        #: Set by each thread as its last step: what joining waits for (see join_until).
        self._ended = [threading.Event() for _ in range(count)]
        # Set once every thread has started: none works before. On a free-threaded build a start beside a
        # busy sibling on its core waited for it (docs/design.md, "Free-threaded Python").
        self._go = threading.Event()
        with _exit_lock:
            exited = _exited
            if not exited:
                _groups.add(self)
        if exited:
            raise _exiting()
        started = 0
        try:
            for thread in self._threads:
                thread.start()
                started += 1
        except BaseException as exc:  # "can't start new thread", or Ctrl-C: the owner is never made, so
            for ended in self._ended[started:]:  # nothing would stop the threads already started
                ended.set()
            self.cancel()
            if isinstance(exc, RuntimeError) and "start new thread" in str(exc):
                raise RuntimeError(
                    f"{name}: the system refused thread {started + 1} of {count} ({exc}); ask for fewer "
                    f"threads (num_threads), or raise the process's thread limit (ulimit -u)"
                ) from exc
            raise
        finally:
            self._go.set()

    @property
    def threads(self) -> list[threading.Thread]:
        """The group's threads (for tests and diagnostics)."""
        return list(self._threads)

    def cancel(self) -> None:
        """Asks every thread to stop at its next cancellation check and wakes the owner's waits."""
        self.cancelled.set()
        self._wake()

    def join(self, timeout: float | None) -> bool:
        """Waits up to ``timeout`` seconds (``None``: no limit) for the threads other than the caller.

        A bounded wait runs to its end through a KeyboardInterrupt, then raises it (see
        :func:`uninterrupted`): a second Ctrl-C while the first closes the owner would otherwise leave
        its threads running, under a chained traceback. An unbounded wait ends on Ctrl-C.

        Returns:
            Whether they have all ended.
        """
        if timeout is None:
            self.join_until(None)
            return not self.alive()
        return self.join_by(time.monotonic() + timeout)

    def join_by(self, deadline: float) -> bool:
        """:meth:`join` until a ``time.monotonic()`` deadline, which an owner's several groups share."""
        uninterrupted(functools.partial(self.join_until, deadline))
        return not self.alive()

    def join_until(self, deadline: float | None) -> None:
        """Waits until ``deadline`` (``time.monotonic()``; ``None``: no limit) for the other threads.

        A KeyboardInterrupt ends the wait, and the wait can be repeated. It waits for each thread's end
        event, then joins the thread, which has only its teardown left: before Python 3.13 a
        ``Thread.join`` that a KeyboardInterrupt cuts short marks the thread ended while it still runs,
        so a repeated join would return at once.
        """
        current = threading.current_thread()
        for thread, ended in zip(self._threads, self._ended, strict=True):
            if thread is not current:
                ended.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if ended.is_set():
                    thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def alive(self) -> list[threading.Thread]:
        """The threads still running, other than the calling one (which may be closing its own pool).

        A started thread that has not set its end event runs, whatever an interrupted join made its
        ``is_alive()`` say (see :meth:`join_until`).
        """
        current = threading.current_thread()
        return [
            thread
            for thread, ended in zip(self._threads, self._ended, strict=True)
            if thread is not current
            and (thread.is_alive() or (thread.ident is not None and not ended.is_set()))
        ]

    def _run(self, target: Callable[[int], None], index: int) -> None:
        try:
            self._go.wait()  # set by the constructor once it has started every thread
            bind_cancel(self.cancelled)
            if self._one_op_thread:
                _one_intra_op_thread()
            with contextlib.suppress(Cancelled):  # stopped on request: nothing to report
                target(index)
        finally:
            self._ended[index].set()


def _one_intra_op_thread() -> None:
    """Makes torch run the calling thread's ops on that thread alone, as DataLoader's workers do.

    The readers are the parallelism: with each also splitting its resizes over every core (torch's
    default), a 2-core machine ran 2 x 2 threads that wait for each other at every op, and on a busy
    machine a large batch of mixed sizes loaded several times slower (docs/design.md has the numbers).
    ``torch.set_num_threads(1)`` would do it for every thread of the process, the training loop's too,
    so this sets OpenMP's per-thread count instead, after torch's own first setting of it in this
    thread. Where torch's OpenMP runtime cannot be reached, nothing changes.
    """
    set_threads = _omp_set_num_threads()
    if set_threads is not None:
        torch.get_num_threads()  # torch sets a thread's OpenMP count on its first call: let it go first
        set_threads(1)


@functools.cache
def _omp_set_num_threads() -> Callable[[int], object] | None:
    """OpenMP's ``omp_set_num_threads`` of the runtime torch runs on, or ``None``."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:  # looked up from torch's own extension: the search covers the libraries it links, so its runtime
        found: Callable[[int], object] = ctypes.CDLL(torch._C.__file__).omp_set_num_threads
    except (AttributeError, OSError):
        return None
    return found


@atexit.register
def _end_threads_at_exit() -> None:
    """Cancels every thread group and waits until its threads have returned, with no fixed limit.

    Cancelled threads end within one step of their work. A step that never ends (a read that blocks
    forever) holds the exit here, said on stderr after :data:`EXIT_NOTICE` seconds; Ctrl-C ends the
    wait. Returning earlier would leave the thread inside torch while the interpreter finalizes.
    """
    global _exited
    with _exit_lock:
        _exited = True
        groups = _groups.live()
    for group in groups:
        group.cancel()
    started = time.monotonic()
    noticed = False
    for thread in [thread for group in groups for thread in group.alive()]:
        while thread.is_alive():
            thread.join(POLL)
            if thread.is_alive() and not noticed and time.monotonic() - started > EXIT_NOTICE:
                names = ", ".join(t.name for group in groups for t in group.alive())
                print(
                    f"threadloader: waiting for threads {names} to finish their current step before the "
                    "interpreter exits (a read that never returns holds it here; Ctrl-C ends the wait)",
                    file=sys.stderr,
                    flush=True,
                )
                noticed = True


class OrderedPool(Generic[T]):
    """Runs ``work(task, thread_index)`` for each task on ``num_threads`` threads, in-order results.

    Args:
        tasks: The tasks, taken lazily as threads become free, by one thread at a time (outside the pool's
            lock: an iterator that blocks holds up no ``next()`` or ``close()``).
        work: Called in a pool thread; its return value or exception is the task's result. Long work
            calls :func:`~threadloader._cancel.check_cancelled` between its steps, so ``close()`` ends it.
        num_threads: Threads to start; ``thread_index`` is ``0..num_threads-1``, stable per thread.
        window: Most tasks taken but not yet handed to the consumer (the memory bound).
        name: Prefix of the threads' names, to find them in a debugger or ``threading.enumerate()``.
        on_ahead: Told the seconds a thread waited because ``window`` tasks were taken and not yet
            handed out, in that thread, outside the pool's lock: a consumer slower than the threads,
            or an oldest task still in the works while later ones are done (results go out in order).

    Threads beyond the process's cores take their first task once the first task's result is in: all
    starting at once, more threads than cores share them, and the first result, the one the consumer
    waits for, comes when nearly all of theirs do, many times later than with one thread per core.
    Afterwards every thread takes tasks as they come, so steady throughput is unchanged.
    """

    def __init__(
        self,
        *,
        tasks: Iterator[Any],
        work: Callable[[Any, int], T],
        num_threads: int,
        window: int,
        name: str,
        on_ahead: Callable[[float], None] | None = None,
    ) -> None:
        self._tasks = tasks
        self._work = work
        self._on_ahead = on_ahead
        self._window = max(window, 1)
        self._cv = threading.Condition()
        self._taking = threading.Lock()  # one thread at a time in the tasks iterator, outside _cv
        self._taken = 0  # tasks taken from the iterator so far
        self._handed = 0  # results handed to the consumer so far
        self._end: int | None = None  # number of tasks, once the iterator is exhausted
        self._results: dict[int, tuple[bool, Any]] = {}
        self._closed_error: Callable[[], BaseException] | None = None  # set once, by the first close
        self._closed_until: float | None = None  # its wait's deadline (None: the exit hook's, no wait)
        self._eager = min(num_threads, available_cpus())  # threads that take tasks from the start
        self._first_in = False  # the first task's result is in: every thread takes tasks
        self._group = ThreadGroup(
            name=name,
            count=num_threads,
            target=self._run,
            wake=functools.partial(self._shut, _exiting),
        )

    @property
    def closed(self) -> bool:
        """Whether the pool was closed (its ``next()`` raises the error it was closed with)."""
        return self._closed_error is not None

    def next(self) -> T:
        """Returns the next result in task order, re-raising the task's exception.

        Raises:
            StopIteration: After the last task's result.
            BaseException: Once the pool is closed, the error given to :meth:`close`, also in a call that
                was already waiting.
        """
        with self._cv:
            while self._closed_error is None:
                if self._handed in self._results:
                    ok, value = self._results.pop(self._handed)
                    self._handed += 1
                    self._cv.notify_all()
                    if ok:
                        return value
                    try:
                        raise value
                    finally:  # the traceback holds this frame: it must not hold the error in turn
                        del value
                if self._end is not None and self._handed >= self._end:
                    raise StopIteration
                # Threads the group's cancel stopped before it shut the pool: its error comes next.
                cancelled = self._group.cancelled.is_set()
                if not cancelled and not any(thread.is_alive() for thread in self._group.threads):
                    raise RuntimeError("all reader threads ended without producing the next batch")
                self._cv.wait(POLL)
            error = self._closed_error
        raise error()  # outside the lock: the exit hook's error keeps a daemon thread here (_exiting)

    def close(
        self, error: Callable[[], BaseException] = StopIteration, *, until: float | None = None
    ) -> None:
        """Stops taking tasks, drops pending results, cancels the work in progress and joins the threads.

        Threads end at their next cancellation check; this waits up to :data:`JOIN_TIMEOUT` for that. A
        KeyboardInterrupt meanwhile is raised once all that is done (:func:`uninterrupted`).

        Args:
            error: Makes what ``next()`` raises from now on (the first close decides); the default
                ends an iteration as if the tasks were exhausted.
            until: The ``time.monotonic()`` deadline of the wait instead, shared by an owner that closes
                several pools (a loader's iterators each waited a second in turn).

        A pool already closed waits for its threads to the first close's deadline, not one of its own
        (a consumer's ``next()`` that the close woke closes again, and with a reader stuck in a read
        waited another second each time); and not at once: a close from another thread meanwhile (a
        ``break`` there) returned while readers still ran the user's code, whose resources the caller
        would then free under them.
        """
        with self._cv:
            closed, first_until = self.closed, self._closed_until
        if closed:
            if first_until is not None:
                self._group.join_until(first_until)
            return
        deadline = close_deadline(until)
        uninterrupted(
            functools.partial(self._shut, error, deadline),
            self._group.cancel,
            functools.partial(self._group.join_until, deadline),
        )

    @property
    def threads(self) -> list[threading.Thread]:
        """The pool's threads (for tests and diagnostics)."""
        return self._group.threads

    def _shut(self, error: Callable[[], BaseException], until: float | None = None) -> None:
        with self._cv:
            if self._closed_error is None:
                self._closed_error, self._closed_until = error, until
            self._results.clear()
            self._cv.notify_all()

    def _over(self) -> bool:
        """Whether no task is to be taken any more: the pool closed, or the tasks ran out."""
        return self.closed or self._end is not None

    def _full(self) -> bool:
        """Whether ``window`` tasks are taken and not yet handed out (call with the lock held)."""
        return self._taken >= self._handed + self._window

    def _take(self, index: int) -> tuple[int, Any] | None:
        """The next task and its place, once the window has room; ``None`` when the thread should end.

        Thread ``index`` past the eager ones first waits for the first task's result (see the class). A
        wait for room is told to ``on_ahead`` after the lock is released, also when the tasks ran out
        meanwhile, and not when the pool was closed. The task is taken from the iterator (the user's
        sampler) by one thread at a time and outside the pool's lock: a sampler that blocks held up
        ``close()``, the consumer's ``next()`` of a batch already made, and the exit hook.
        """
        ahead = 0.0
        try:
            while True:
                with self._cv:
                    while index >= self._eager and not (self._first_in or self._over()):
                        self._cv.wait(MERGE_INTERVAL)
                    if self._full():
                        started = time.perf_counter()
                        while not self._over() and self._full():
                            self._cv.wait(MERGE_INTERVAL)
                        ahead += time.perf_counter() - started
                    if self._over():
                        return None
                with self._taking:
                    with self._cv:  # another thread may have taken the room or the last task meanwhile
                        if self._over():
                            return None
                        if self._full():
                            continue
                        seq = self._taken
                    return self._next_task(seq)
        finally:
            if ahead and not self.closed and self._on_ahead is not None:
                self._on_ahead(ahead)

    def _next_task(self, seq: int) -> tuple[int, Any] | None:
        """Task ``seq`` from the iterator (holding ``_taking``, not the pool's lock), recorded under it."""
        try:
            task = next(self._tasks)
        except StopIteration:
            with self._cv:
                self._end = seq
                self._cv.notify_all()
            return None
        except BaseException as exc:
            with self._cv:
                self._results[seq] = (False, exc)
                self._taken = self._end = seq + 1
                self._cv.notify_all()
            return None
        with self._cv:
            if self.closed:  # closed while the iterator ran: the task is nobody's
                return None
            self._taken += 1
            return seq, task

    def _run(self, index: int) -> None:
        while (taken := self._take(index)) is not None:
            if not self._complete(*taken, index):
                return

    def _complete(self, seq: int, task: Any, index: int) -> bool:
        """Runs task ``seq`` and hands its result in; ``False`` once the pool is closed.

        A call of its own, so that the thread holds no reference to the result once it is handed in:
        waiting in :meth:`_take` with it, the thread kept a batch the consumer had dropped alive until
        its next task. A failure's traceback holds this frame, so the frame lets go of the result: else
        the error, the frames it passed through and the batch they were making live on in a cycle
        after the consumer has dropped the error, until the garbage collector runs.
        """
        try:
            result: tuple[bool, Any] = (True, self._work(task, index))
        except Cancelled:  # the pool is being closed (the exit hook cancels it before it shuts it): a
            return False  # result handed in meanwhile would make the consumer raise Cancelled
        except BaseException as exc:
            result = (False, consumer_error(exc))
        try:
            with self._cv:
                if self.closed:
                    return False
                self._results[seq] = result
                self._first_in = self._first_in or seq == 0
                self._cv.notify_all()
            return True
        finally:
            del result


@overload
def consumer_error(exc: Exception) -> Exception: ...
@overload
def consumer_error(exc: BaseException) -> BaseException: ...
def consumer_error(exc: BaseException) -> BaseException:
    """An error of a reader's work as the consumer raises it: itself, but for a ``StopIteration``.

    Raised on by the consumer's ``next()``, a ``StopIteration`` (a helper's ``next()`` that ran dry in a
    transform or ``collate_fn``) would end the pass as if the epoch were complete, batches short: it
    becomes a ``RuntimeError`` that says so, with it as the cause.
    """
    if not isinstance(exc, StopIteration):
        return exc
    error = RuntimeError(f"a reader's work raised StopIteration: {exc}".rstrip(": "))
    error.__cause__ = exc
    return error


def available_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS reports it)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class LastOut:
    """Runs a step once the last of a set of threads has left: at once, if they all have.

    For freeing what a thread may still be using after its owner stopped waiting for it (a decoder
    under a call that outlived ``close()``'s deadline): the owner hands the step over, and the last
    thread out runs it, never under that call.

    Args:
        threads: How many threads will call :meth:`leave`, each once, as its last step.
        what: What the step does, for the log line if it fails in a thread (no caller to raise to).
    """

    def __init__(self, threads: int, *, what: str) -> None:
        self._lock = threading.Lock()
        self._inside = threads
        self._step: Callable[[], object] | None = None
        self._what = what

    def leave(self) -> None:
        """A thread is done; the last one runs the step handed over, if any."""
        with self._lock:
            self._inside -= 1
            step = self._step if self._inside == 0 else None
            if step is not None:
                self._step = None
        if step is None:
            return
        try:
            step()
        except Exception:
            logging.getLogger("threadloader").exception("threadloader: %s failed", self._what)

    def then(self, step: Callable[[], object]) -> bool:
        """Runs ``step`` now if every thread has left, else hands it to the last one; whether it ran here.

        ``step`` must be idempotent: every close hands its own over, and one handed over while another
        waits is dropped (that one runs).
        """
        with self._lock:
            if self._inside > 0:
                if self._step is None:
                    self._step = step
                return False
        step()
        return True


def uninterrupted(*steps: Callable[[], object]) -> None:
    """Runs ``steps`` in order, each to its end through KeyboardInterrupt, then raises the first one caught.

    Closing is where a second Ctrl-C lands: ``timeout -s INT`` signals every process of a group, and a
    key held down repeats. Cut short, a close leaves its threads running and chains a second traceback
    to the first. So an interrupted step is run again (every step here may be repeated), and the
    interrupt is raised after the last step, unless a KeyboardInterrupt is already being handled (the
    close runs because of it): that one says the same and goes on.
    """
    interrupt: KeyboardInterrupt | None = None
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as exc:
                interrupt = interrupt or exc
    if interrupt is not None and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
        raise interrupt


#: Per thread: whether it runs a :func:`park_outside` block.
_outside = threading.local()


class _Park(BaseException):
    """What :func:`_exiting` raises inside :func:`park_outside`, to park once out of it.

    Not an ``Exception``, which a handler on the way out might take for an error of its own.
    """


@contextlib.contextmanager
def park_outside() -> Iterator[None]:
    """A block that holds locks: a daemon thread that :func:`_exiting` keeps parks once out of it.

    Parked inside, it held them for good: an exit hook of the user's that ran later and took them (a
    loader's ``close()``, ``state_dict()``) waited for it forever, and the interpreter never exited.
    Blocks nest: the outermost parks.
    """
    outer = getattr(_outside, "on", False)
    _outside.on = True
    parked = False
    try:
        yield
    except _Park:
        if outer:
            raise
        parked = True
    finally:
        _outside.on = outer
    if parked:
        raise _exiting()


def _exiting() -> LoaderClosedError:
    """Where a thread ends up that uses a pool, or starts a group, once the exit hook has run.

    Only daemon threads still run then (Python joins the others before ``atexit`` hooks), and the main
    thread in an exit hook that runs after this module's. A user's daemon thread waits here until the
    process ends, as Python stops daemon threads at exit: silently, with the script's exit code, and
    never inside torch, where stopping a thread aborts the process. Raising would unwind it, and the
    torch calls that unwinding makes (freeing its batches) race the interpreter's finalization. One of
    the library's own threads (a ``MicroBatcher`` worker whose function iterates a loader) is cancelled
    instead: the exit hook waits for it to end, so parked here it hung the exit. The main thread, which
    the process waits for, gets the error. Inside :func:`park_outside`, the thread parks once out of it.
    """
    if in_own_thread():
        raise Cancelled
    if threading.current_thread() is not threading.main_thread():
        if getattr(_outside, "on", False):
            raise _Park  # to park here once the block's locks are released
        threading.Event().wait()
    return LoaderClosedError("the interpreter is exiting: its exit hook closed this loader")
