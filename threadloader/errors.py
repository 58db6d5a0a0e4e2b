"""Exceptions raised by threadloader, and the warnings it gives.

The errors of the data and of the loader's state derive from :class:`ThreadLoaderError` (a bad sample or
shard, a closed loader, a full queue), so a caller can tell them from a bug anywhere else. A bad
argument is a ``ValueError`` or ``TypeError`` at construction, as in the standard library.
"""

from __future__ import annotations

import builtins
import re
import traceback
from collections.abc import Iterator
from queue import Full

__all__ = ["CPUFallbackWarning", "LoaderClosedError", "QueueFullError", "SampleError", "ThreadLoaderError"]

#: The heap address in a default object repr (``<_io.BytesIO object at 0x7f...>``): of no use to a reader,
#: and a server that forwards the message would leak its memory layout.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class ThreadLoaderError(RuntimeError):
    """Base class of the errors of the data and the loader's state (samples, shards, closed, queue full)."""


class SampleError(ThreadLoaderError):
    """One sample could not be fetched, read or decoded.

    Raised in the consumer at the batch that holds the sample (``on_error="raise"``); with
    ``on_error="skip"`` it is logged and counted instead. The original exception is chained as
    ``__cause__``: the source's, the read's or the decoder's (on the GPU path Pillow's, when it fails
    too; nvImageCodec reports status codes). On the GPU path an image refused from its header (over
    ``max_pixels``) has none; on the CPU path Pillow's ``DecompressionBombError`` is chained.

    Attributes:
        index: The sample's index in the source.
        origin: Where the sample came from: its path, or a short description of in-memory bytes.
        stage: What failed: ``"fetch"`` (the source's ``__getitem__``), ``"read"`` or ``"decode"``.
        reason: A one-line description of the cause, without heap addresses (an object's default repr
            keeps its type: ``<_io.BytesIO object>``).
    """

    def __init__(self, *, index: int, origin: str, stage: str, reason: str) -> None:
        self.index = index
        self.origin = origin
        self.stage = stage
        self.reason = _one_line(_ADDRESS.sub("", reason))
        super().__init__(f"sample {index} ({origin}): {stage} failed: {self.reason}")

    @classmethod
    def from_exception(cls, exc: BaseException, *, index: int, origin: str, stage: str) -> SampleError:
        """Builds the error for ``exc``; the caller chains it with ``raise ... from exc``.

        An exception without a message (``raise IndexError``) is named alone, not as ``"IndexError: "``.
        """
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        return cls(index=index, origin=origin, stage=stage, reason=reason)

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only __init__ would otherwise break copy/pickle of the exception (pytest, logging); the
        # instance's dict carries its notes (the traceback ``detached`` keeps as text) across.
        return (_rebuild_sample_error, (self.index, self.origin, self.stage, self.reason), self.__dict__)


def _one_line(text: str) -> str:
    """``text``'s lines joined by spaces, as ``reason`` promises one line.

    A multi-line message (a record's validation error) made the skip log's warning, and the message a
    caller prints, span several lines.
    """
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _rebuild_sample_error(index: int, origin: str, stage: str, reason: str) -> SampleError:
    return SampleError(index=index, origin=origin, stage=stage, reason=reason)


def detached(exc: BaseException, *, as_text: bool = True) -> BaseException:
    """``exc`` and every exception it chains or groups, their tracebacks as text: a sample error's cause.

    A traceback keeps each of its frames alive, and each frame its caller (``frame.f_back``): an error
    kept by the user (a list of the bad samples, a failed request's future) would keep a reader
    thread's whole stack, its group's bytes and decoded images, in memory, and where the exception
    sits in a dict of one of those frames, a cycle that only the garbage collector frees. The
    traceback is kept as text, in a note (Python 3.11 and later print it with the exception), unless
    not ``as_text``.
    """
    for current in chained(exc):
        if current.__traceback__ is not None:
            if as_text:
                frames = "".join(traceback.format_tb(current.__traceback__)).rstrip()
                _note_once(current, f"{_TRACEBACK_NOTE}\n{frames}")
            current.__traceback__ = None
    return exc


def chained(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception it holds: its cause, its context, an exception group's members.

    Each once, cycles included. The members count: a source's fetches in a task group hold their own
    tracebacks, and their own causes.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        members = getattr(current, "exceptions", ()) if isinstance(current, _GROUPS) else ()
        pending += [current.__cause__, current.__context__, *members]


_TRACEBACK_NOTE = "Traceback (as text; its frames released):"
#: Exception groups, whose members :func:`detached` releases too (none before Python 3.11).
_GROUPS: tuple[type[BaseException], ...] = (
    (builtins.BaseExceptionGroup,) if hasattr(builtins, "BaseExceptionGroup") else ()
)


def _note_once(exc: BaseException, note: str) -> None:
    """Adds ``note`` to ``exc``, in place of a traceback note an earlier raise of it left.

    A source may raise one exception it keeps (a dataset caching its failures): each raise detached
    it again, and its notes grew by a traceback every epoch.
    """
    if not hasattr(exc, "add_note"):  # Python 3.10: no notes, the text is dropped
        return
    notes: list[str] = getattr(exc, "__notes__", [])
    for i, old in enumerate(notes):
        if old.startswith(_TRACEBACK_NOTE):
            notes[i] = note
            return
    exc.add_note(note)


class LoaderClosedError(ThreadLoaderError):
    """The loader was used after :meth:`ThreadLoader.close`."""


class QueueFullError(ThreadLoaderError, Full):
    """The request queue is at ``max_queue``: the service is overloaded.

    Also a ``queue.Full``, so code written against the standard library's queues catches it.
    """


class CPUFallbackWarning(UserWarning):
    """A GPU is there, but ``device=None`` decodes on the CPU: nvImageCodec is not installed.

    A category of its own, so that it can be turned into an error where a silent CPU run would waste
    GPU time (``warnings.simplefilter("error", CPUFallbackWarning)``), or filtered where the CPU is meant.
    """
