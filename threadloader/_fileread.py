"""Reading a file's bytes without letting go of the GIL when the page cache holds them.

Why: Python's own read (``os.open``, ``os.fstat``, ``os.read``, ``os.close``) lets go of the GIL four
times per file, and each time a training loop waiting for the GIL takes it and the reader has to win it
back: a hand-off that costs the loop a thread wake-up (docs/design.md, "GIL releases per image"). A
file in the page cache is read in microseconds, so here the C library is called with the GIL held
(:class:`ctypes.PyDLL`), and the read asks the kernel not to wait for the disk (``preadv2`` with
``RWF_NOWAIT``): whatever is not cached is then read with the GIL let go, as Python would. Opening a
file still holds the GIL for its metadata lookup, which on a cold network file system can take long.

The bytes are read straight into a new ``bytes`` object, which nothing else has seen yet. Where any of
this is unavailable (not Linux with glibc 2.28, another interpreter), Python's read is used.
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat
import sys
from ctypes import c_char_p, c_int, c_int64, c_size_t, c_ssize_t, c_uint, c_void_p
from typing import Any

__all__ = ["NotRegularFile", "read_file"]

#: Non-blocking: opening a FIFO for reading would otherwise wait for a writer, forever. Reads of a regular
#: file ignore the flag.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_AT_EMPTY_PATH, _STATX_TYPE, _STATX_SIZE = 0x1000, 0x1, 0x200
_STATX_MODE_AT, _STATX_SIZE_AT, _STATX_BYTES = 0x1C, 0x28, 256  # struct statx, the same on every arch
_RWF_NOWAIT = 0x8
_CHUNK = 1 << 20  # bytes per read past a file's stated size
#: Largest read made with the GIL held: copying more from the page cache takes longer (some 100 us per
#: MiB) than the hand-off that letting go of the GIL costs.
_HELD_LIMIT = 1 << 20


class NotRegularFile(OSError):
    """The path is not a regular file (a FIFO, a device, a directory): it is not read.

    Attributes:
        mode: Its ``st_mode``.
    """

    def __init__(self, mode: int) -> None:
        super().__init__(f"not a regular file (mode {stat.filemode(mode)})")
        self.mode = mode


class _Libc:
    """The C library's calls, bound once: those that may block let go of the GIL, the others keep it."""

    def __init__(self) -> None:
        held, released = ctypes.PyDLL(None, use_errno=True), ctypes.CDLL(None, use_errno=True)
        self.open = _bound(held.open, [c_char_p, c_int], c_int)
        self.statx = _bound(held.statx, [c_int, c_char_p, c_int, c_uint, c_void_p], c_int)
        self.preadv2 = _bound(held.preadv2, [c_int, c_void_p, c_int, c_int64, c_int], c_ssize_t)
        self.pread = _bound(released.pread, [c_int, c_void_p, c_size_t, c_int64], c_ssize_t)
        self.close = _bound(held.close, [c_int], c_int)
        self.new_bytes = _bound(
            ctypes.pythonapi.PyBytes_FromStringAndSize, [c_void_p, c_ssize_t], ctypes.py_object
        )
        #: Where a bytes object's characters start, from its address (CPython's layout).
        self.bytes_offset = bytes.__basicsize__ - 1
        probe = self.new_bytes(None, 4)
        ctypes.memmove(id(probe) + self.bytes_offset, b"\x01\x02\x03\x04", 4)
        if probe != b"\x01\x02\x03\x04":
            raise OSError("bytes objects are not laid out as in CPython")


def _bound(function: Any, argtypes: list[Any], restype: Any) -> Any:
    function.argtypes, function.restype = argtypes, restype
    return function


@functools.cache
def _libc() -> _Libc | None:
    if sys.platform != "linux" or sys.implementation.name != "cpython":
        return None
    try:
        return _Libc()
    except (OSError, AttributeError):  # no statx or preadv2 (glibc < 2.28), or not CPython's bytes
        return None


def read_file(path: str | os.PathLike[str]) -> bytes:
    """A regular file's bytes.

    Raises:
        NotRegularFile: For anything but a regular file (a FIFO would block the reader forever, a
            device might never end).
        OSError: As ``open`` or ``read`` would.
    """
    libc = _libc()
    if libc is None:
        return _read_in_python(path)
    descriptor = libc.open(os.fsencode(path), _OPEN_FLAGS)
    if descriptor < 0:
        return _read_in_python(path)  # raises the error with its path, as Python words it
    try:
        info = ctypes.create_string_buffer(_STATX_BYTES)
        if libc.statx(descriptor, b"", _AT_EMPTY_PATH, _STATX_TYPE | _STATX_SIZE, info) != 0:
            return _read_in_python(path)
        mode = int.from_bytes(info.raw[_STATX_MODE_AT : _STATX_MODE_AT + 2], "little")
        size = int.from_bytes(info.raw[_STATX_SIZE_AT : _STATX_SIZE_AT + 8], "little")
        if not stat.S_ISREG(mode):
            raise NotRegularFile(mode)
        if size == 0:  # some virtual file systems say 0 and have more
            return _read_in_python(path)
        data = libc.new_bytes(None, size)
        if _read_into(libc, descriptor, id(data) + libc.bytes_offset, size) != size:
            return _read_in_python(path)  # shorter than it said: it changed under us
        return data
    finally:
        libc.close(descriptor)


def _read_into(libc: _Libc, descriptor: int, address: int, size: int) -> int:
    """Reads up to ``size`` bytes to ``address``: what the page cache has with the GIL held, the rest not."""
    got = 0
    if size <= _HELD_LIMIT:
        got = max(0, _read_cached(libc, descriptor, address, size, 0))
    while got < size:
        more = libc.pread(descriptor, address + got, size - got, got)
        if more <= 0:
            if more < 0 and ctypes.get_errno() == 4:  # EINTR
                continue
            break
        got += more
    if got == size and _read_cached(
        libc, descriptor, ctypes.addressof(ctypes.create_string_buffer(1)), 1, size
    ):
        return -1  # grew since its size was read, or cannot tell without waiting: read it again in Python
    return got


def _read_cached(libc: _Libc, descriptor: int, address: int, size: int, offset: int) -> int:
    """What the page cache has of ``size`` bytes at ``offset``, with the GIL held; -1 if it has none.

    -1 also where the file system does not take ``RWF_NOWAIT`` (EOPNOTSUPP): the caller reads as usual.
    """
    vector = (c_void_p * 2)(address, size)  # one struct iovec
    return int(libc.preadv2(descriptor, vector, 1, offset, _RWF_NOWAIT))


def _read_in_python(path: str | os.PathLike[str]) -> bytes:
    """Python's read: lets go of the GIL around each call."""
    descriptor = os.open(path, _OPEN_FLAGS | getattr(os, "O_BINARY", 0))
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise NotRegularFile(status.st_mode)
        # One byte past the size: a shorter read is the end of the file, as a regular file's reads only
        # stop short there. A file that grew, or a size of 0, reads on to the end.
        data = os.read(descriptor, status.st_size + 1)
        if len(data) != status.st_size:
            data = b"".join([data, *iter(functools.partial(os.read, descriptor, _CHUNK), b"")])
        return data
    finally:
        os.close(descriptor)
