"""Cooperative cancellation of the work running in a reader thread.

A thread cannot be stopped from outside, and one abandoned inside torch when the interpreter finalizes
aborts the whole process. So long work checks, between its steps (a sample, an image, a batch), whether
the thread that runs it was asked to stop. The flag is per thread, set once when the thread starts, so
the code in between (the pipeline, the decoders) needs no extra argument. Outside a reader thread the
check does nothing.
"""

from __future__ import annotations

import threading

__all__ = ["Cancelled", "bind_cancel", "check_cancelled", "in_own_thread"]

_local = threading.local()


class Cancelled(BaseException):
    """Raised by :func:`check_cancelled` in a thread whose work was cancelled.

    A ``BaseException``: per-sample error handling (``except Exception``) must not turn it into a bad
    sample and go on with the next one.
    """


def bind_cancel(flag: threading.Event) -> None:
    """Makes ``flag`` the calling thread's cancellation flag (once, at the start of a reader thread)."""
    _local.flag = flag


def check_cancelled() -> None:
    """Raises :class:`Cancelled` if the calling thread's work was cancelled; cheap enough per image.

    Raises:
        Cancelled: If the flag bound by :func:`bind_cancel` in this thread is set.
    """
    flag: threading.Event | None = getattr(_local, "flag", None)
    if flag is not None and flag.is_set():
        raise Cancelled


def in_own_thread() -> bool:
    """Whether the calling thread is one of the library's own (it has a cancellation flag bound)."""
    return getattr(_local, "flag", None) is not None
