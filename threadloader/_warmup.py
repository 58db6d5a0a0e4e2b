"""Warming a front end's pipeline up in the background, while its caller sets up the rest.

On a GPU the first batch would pay for everything done once per process or per device: loading
nvImageCodec and its self-test, making Decoders, the engines' first decode, the region check,
compiling the resampling kernel (docs/benchmarks.md, "Memory and start-up"). A training script builds
its loader and then its model, optimizer and compiled step; a server builds its decoder before it
listens. So a front end starts a :class:`Warmup` when it is built: batches of the photos bundled with
the package, one per Decoder the readers will lease at once, go through a producer like its own (the
same decoder, transforms and output format, its own counters) in threads of their own, and reader
threads wait for them before their first batch instead of doing the same work at once beside them.

Nothing here changes what the readers do: whatever the warm-up leaves undone or fails at (it logs and
ends), the first batch does as it would have, and raises what it would have raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from importlib import resources

from ._cancel import Cancelled, check_cancelled
from ._handoff import ReaderStream
from ._pipeline import BatchProducer
from ._stats import StatsRecorder
from ._workers import POLL, LastOut, ThreadGroup, close_deadline
from .errors import SampleError

__all__ = ["Warmup", "warmup_source"]

logger = logging.getLogger("threadloader")


def warmup_source() -> list[tuple[bytes, int]]:
    """The photos bundled with the package (``threadloader/_sample``), as ``(bytes, target)`` samples.

    Four JPEGs of four sizes: whole images of different sizes (the padded path), and regions for a
    random crop, as a first batch of photos uses them.
    """
    folder = resources.files("threadloader") / "_sample"
    photos = sorted((e for e in folder.iterdir() if e.name.endswith(".jpg")), key=lambda e: e.name)
    return [(photo.read_bytes(), 0) for photo in photos]


#: Copies of each bundled photo in a warm-up batch. One of each is enough to make and run each Decoder
#: and compile the kernels; each copy costs device memory while every warm-up thread runs at once.
_COPIES = 1


class Warmup:
    """Runs batches of :func:`warmup_source` in background threads, started at construction.

    Args:
        new_producer: Makes a producer like the front end's own, given the keyword arguments ``source``,
            ``stats``, ``on_error``, ``on_skip`` and ``collate`` (the warm-up's: its own counters, bad
            samples skipped quietly, the default collate rather than the user's).
        readers: The front end's reader streams, idle until the warm-up ends: thread ``i`` runs on
            ``readers[i]``, so the memory it leaves in torch's cache (which keeps freed blocks for
            the stream they were used on) is reused by that reader.
        threads: Batches decoded at once, one per thread: as many as the readers will decode at once,
            so that each Decoder they will lease is made and has decoded (an engine initializes on its
            first decode), not only the first.
        prepare: Work that needs no decoder, run at once in one more thread on the first reader's
            stream (compiling the output's kernel, which the batches would otherwise reach only after
            nvImageCodec has started).
    """

    def __init__(
        self,
        new_producer: Callable[..., BatchProducer],
        readers: Sequence[ReaderStream],
        *,
        threads: int = 1,
        prepare: Callable[[], object] | None = None,
    ) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._deadline: float | None = None  # the first close's: every close waits until it
        self._batches = threads
        self._prepare = prepare
        self._running = threads + (prepare is not None)
        self._last_out = LastOut(self._running, what="closing the decoder after the background warm-up")
        self._new_producer = new_producer
        self._readers = list(readers)
        self._group = ThreadGroup(
            name="threadloader-warmup", count=self._running, target=self._run, wake=self._done.set
        )

    def _run(self, index: int) -> None:
        try:
            if index == self._batches:  # the thread beyond the batches': prepare
                assert self._prepare is not None
                check_cancelled()  # closed before this thread began: nothing to compile for
                with self._readers[0].active():
                    self._prepare()
                return
            samples = warmup_source() * _COPIES
            producer = self._new_producer(
                source=samples, stats=StatsRecorder(), on_error="skip", on_skip=_ignore, collate=None
            )
            producer.produce([range(len(samples))], self._readers[index % len(self._readers)])
        except Cancelled:  # its owner was closed: the thread group's to end
            raise
        except BaseException:  # the readers' first batch does the same and raises it to the consumer
            logger.debug("threadloader: the background warm-up failed", exc_info=True)
        finally:
            with self._lock:
                self._running -= 1
                if not self._running:
                    self._done.set()
            self._last_out.leave()

    @property
    def done(self) -> bool:
        """Whether the warm-up has finished or failed, or was cancelled (its threads may still be ending)."""
        return self._done.is_set()

    def wait(self) -> None:
        """Returns once the warm-up has ended; in a reader thread, raises ``Cancelled`` if it is cancelled.

        Raises:
            Cancelled: The calling reader thread was asked to stop meanwhile.
        """
        while not self._done.wait(POLL):
            check_cancelled()
        check_cancelled()

    def close(self, *, until: float | None = None) -> None:
        """Stops the warm-up at its next step (its owner was closed), waiting until ``until``.

        ``until`` is a ``time.monotonic()`` deadline, by default ``JOIN_TIMEOUT`` from now. A step in
        nvImageCodec (loading it, making a Decoder) or a kernel's compilation is not interrupted: the
        threads end after it, on their own, and interpreter exit waits for them. Every close waits
        until the first one's deadline: an owner's close, its ``with`` block's and its finalizer's each
        waited a second again, and one in another thread meanwhile still waits with the first.
        """
        with self._lock:
            if self._deadline is None:
                self._deadline = close_deadline(until)
            deadline = self._deadline
        self._group.cancel()
        self._group.join_by(deadline)

    def then(self, step: Callable[[], object]) -> bool:
        """Runs ``step`` once no warm-up thread is in a call any more: now, or by the last as it ends.

        For closing the decoder, which must not run under the warm-up's call: the GPU decoder's close
        waited for nvImageCodec's start (seconds), past the close's deadline.

        Returns:
            Whether it ran here.
        """
        return self._last_out.then(step)


def _ignore(_error: SampleError) -> None:
    """A warm-up sample that fails says nothing: the readers' first batch shows what is wrong."""
