"""Letting a thread that waits for the GIL in, from the readers' loops that hold it.

A reader that keeps the GIL for a whole group of images (its file reads and nvImageCodec's per-image
calls hold it, on purpose: letting go of it per image costs a training loop a hand-off each time)
would keep a training loop that wants it back waiting for the whole group. So the per-image loops
call :meth:`Pacer.tick`, which sleeps an instant once :data:`EVERY` seconds have passed: long enough
for the waiting thread to take the GIL. Merely letting go of it is not: the releasing thread takes it
straight back before the waiting one has woken. Without a GIL (free-threaded Python), nothing to do.

A free-threaded build has the opposite need: a thread that makes objects must run Python now and then
for other threads' drops of them to free them (:data:`MERGE_INTERVAL`), so its waits wake to do so.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import sysconfig
import threading
import time

__all__ = ["EVERY", "MERGE_INTERVAL", "SLICE_ENV", "Pacer"]

#: Set to a number of microseconds to change :data:`EVERY` (read at import): for measuring what the
#: readers' turns cost an eager training step beside them (``.ci/gpu-results``'s ``gil-slice`` part).
SLICE_ENV = "THREADLOADER_GIL_SLICE_US"


def _slice() -> float:
    value = os.environ.get(SLICE_ENV, "")
    if not value.strip():  # unset or empty: the default, as for the library's other variables
        return 100e-6
    try:
        micros = float(value)
    except ValueError:
        micros = -1.0
    if not 0 < micros < 1e6:
        raise ValueError(f"{SLICE_ENV} must be microseconds, more than 0 and less than 1e6, got {value!r}")
    return micros * 1e-6


#: Most seconds a reader's loop keeps the GIL before letting a waiting thread in (100 us unless
#: :data:`SLICE_ENV` says otherwise).
EVERY = _slice()
#: How long it then sleeps: long enough for a waiting thread to wake and take the GIL.
_PAUSE = 20e-6
#: On a free-threaded build, longest a thread that waits goes without running Python (``None`` with a GIL).
#: There an object is freed by the thread that made it (biased reference counting): a batch that the
#: consumer drops last waits in its reader's queue until the reader next runs Python, which a thread
#: blocked in a wait never does. A wake cost 0.16 ms of CPU on a 2-core VM (a bare sleep's wake there
#: 0.07 ms): under 2% of a core per waiting reader.
MERGE_INTERVAL = 0.01 if sysconfig.get_config_var("Py_GIL_DISABLED") else None
#: Whether the GIL is on, asked at each tick rather than once at import: a free-threaded build turns it
#: back on when a module that needs it is imported later (torchvision, where triton is installed).
_gil_enabled = getattr(sys, "_is_gil_enabled", lambda: True)
_PR_SET_TIMERSLACK = 29
_slack = threading.local()


class Pacer:
    """Call :meth:`tick` once per item of a loop that keeps the GIL; one per loop, in one thread."""

    __slots__ = ("_since",)

    def __init__(self) -> None:
        self._since = time.perf_counter()

    def tick(self) -> None:
        """Sleeps an instant if the loop has kept the GIL for :data:`EVERY` seconds since the last time."""
        if not _gil_enabled():
            return
        now = time.perf_counter()
        if now - self._since >= EVERY:
            _pause()
            self._since = time.perf_counter()


def _pause() -> None:
    if not getattr(_slack, "set", False):
        # Linux wakes a sleeping thread up to 50 us late by default (its timer slack, per thread):
        # 1 us here, so that the pause lasts about what it asks for.
        if sys.platform == "linux":
            with contextlib.suppress(OSError, AttributeError):
                ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        _slack.set = True
    time.sleep(_PAUSE)
