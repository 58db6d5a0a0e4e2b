"""A group's files read in two calls into C (``_reads.c``), where that library was built.

Python's read of one file lets go of the GIL four times (``os.open``, ``os.fstat``, ``os.read``,
``os.close``), and each time a training loop beside the readers may take it: a hand-off that costs the
loop a wake-up, per system call. Here the files of a call cost two calls into C, each letting go of the
GIL once (ctypes does around a call): one opens them all and reads their sizes, the other reads them
into ``bytes`` objects made at those sizes and closes them (the read stage gives it a batch's files a
few at a time, so that a reader told to stop is not held up by a whole batch on slow storage).

Each file is a ``bytes`` of its own, made uninitialized by ``PyBytes_FromStringAndSize(NULL, n)`` and
filled before anything else sees it, as ``os.read`` itself does: the same allocations as Python's
reads. One buffer for the group, as first written, cost more than the hand-offs saved: a fresh
anonymous ``mmap`` faulted in every page on the read and unmapped them after (the reads took three
times Python's, and a training step beside them on a GPU ran slower: docs/design.md, "GIL releases
per image"). A file of size 0 gets Python's one empty ``bytes``, which nothing writes into.

A tar shard's members are ranges of files the shard's storage keeps open: :func:`read_ranges` reads a
group of them in one call, where Python's ``os.pread`` lets go of the GIL once a member.

Anything this cannot read as Python would (a path that does not encode, a file that grew past its
stated size) comes back as :data:`RETRY`, for Python's own read, which raises what it always raised.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import threading
from collections.abc import Sequence
from ctypes import POINTER, c_char_p, c_int, c_longlong, c_ssize_t, c_uint, c_void_p, py_object
from dataclasses import dataclass

__all__ = ["RETRY", "NotRegular", "available", "read_files", "read_ranges"]


@dataclass(frozen=True)
class NotRegular:
    """A path that is not a regular file (a directory, a FIFO, a device): its ``st_mode``."""

    mode: int


#: A path to read with Python's own calls instead.
RETRY = None

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # once tried: the library, or None where it was not built


def _library() -> ctypes.CDLL | None:
    if _loaded:  # once loaded, every batch asks: no lock for that
        return _loaded[0]
    with _lock:
        if not _loaded:
            spec = importlib.util.find_spec(f"{__package__}._reads")
            library = ctypes.CDLL(spec.origin) if spec is not None and spec.origin else None
            if library is not None:
                int_p, long_p = POINTER(c_int), POINTER(c_longlong)
                names, modes = POINTER(c_char_p), POINTER(c_uint)
                library.tl_open_files.argtypes = [c_int, names, c_int, int_p, long_p, modes, int_p]
                pointers = POINTER(c_void_p)
                library.tl_read_files.argtypes = [c_int, int_p, long_p, pointers, long_p, int_p]
                library.tl_close_files.argtypes = [c_int, int_p]
                library.tl_read_ranges.argtypes = [c_int, int_p, long_p, long_p, pointers, long_p, int_p]
                functions = (library.tl_open_files, library.tl_read_files, library.tl_close_files)
                for function in (*functions, library.tl_read_ranges):
                    function.restype = None
            _loaded.append(library)
        return _loaded[0]


def available() -> bool:
    """Whether the C library was built (a C compiler was found when threadloader was installed)."""
    return _library() is not None


def read_files(
    paths: Sequence[str | os.PathLike[str]], flags: int
) -> list[bytes | OSError | NotRegular | None]:
    """Reads each path's regular file, opened with ``flags``; needs :func:`available`.

    Returns:
        Per path, in order: its bytes, the ``OSError`` that opening or reading it raised,
        :class:`NotRegular`, or :data:`RETRY`.
    """
    library = _library()
    assert library is not None, "read_files needs the C library: check available() first"
    encoded: list[bytes | None] = []
    for path in paths:
        try:
            name = os.fsencode(path)
        except (TypeError, ValueError):  # not a path, a lone surrogate: Python's read says so
            name = None
        encoded.append(None if name is None or b"\0" in name else name)
    sent = [position for position, name in enumerate(encoded) if name is not None]
    count = len(sent)
    results: list[bytes | OSError | NotRegular | None] = [RETRY] * len(paths)
    if not count:
        return results
    names = (c_char_p * count)(*(encoded[position] for position in sent))
    fds, sizes, modes, errs = (c_int * count)(), (c_longlong * count)(), (c_uint * count)(), (c_int * count)()
    library.tl_open_files(count, names, flags, fds, sizes, modes, errs)
    try:
        blobs = [_new_bytes(None, max(sizes[slot], 0)) for slot in range(count)]
        got = (c_longlong * count)()
        library.tl_read_files(count, fds, sizes, _addresses(blobs), got, errs)
    finally:
        library.tl_close_files(count, fds)  # those not reached, where making the bytes raised
    for slot, position in enumerate(sent):
        if errs[slot]:
            results[position] = OSError(errs[slot], os.strerror(errs[slot]), os.fsdecode(paths[position]))
        elif sizes[slot] < 0:
            results[position] = NotRegular(modes[slot])
        elif got[slot] == sizes[slot]:  # else it grew past its size, or says 0 (a virtual file): RETRY
            results[position] = blobs[slot]
        elif got[slot] < sizes[slot]:  # it shrank between the size and the read
            results[position] = blobs[slot][: got[slot]]
    return results


def read_ranges(ranges: Sequence[tuple[int, int, int]]) -> list[bytes | OSError]:
    """Reads each ``(fd, offset, size)`` range of an open file; needs :func:`available`.

    Returns:
        Per range, in order: its bytes (shorter than ``size`` only where the file ends first), or the
        ``OSError`` its read raised, as ``os.pread`` would.
    """
    library = _library()
    assert library is not None, "read_ranges needs the C library: check available() first"
    count = len(ranges)
    if not count:
        return []
    fds, offsets, sizes = (c_int * count)(), (c_longlong * count)(), (c_longlong * count)()
    got, errs = (c_longlong * count)(), (c_int * count)()
    for slot, (fd, offset, size) in enumerate(ranges):
        fds[slot], offsets[slot], sizes[slot] = fd, offset, size
    blobs = [_new_bytes(None, size) for _, _, size in ranges]
    library.tl_read_ranges(count, fds, offsets, sizes, _addresses(blobs), got, errs)
    return [
        OSError(errs[slot], os.strerror(errs[slot]))
        if errs[slot]
        else blobs[slot]
        if got[slot] == sizes[slot]
        else blobs[slot][: got[slot]]
        for slot in range(count)
    ]


#: CPython's own constructor of an uninitialized ``bytes`` (``os.read`` fills one so), and the address
#: of a ``bytes`` object's contents; called with the GIL held.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes, _new_bytes.restype = [c_char_p, c_ssize_t], py_object
_contents = ctypes.pythonapi.PyBytes_AsString
_contents.argtypes, _contents.restype = [py_object], c_void_p


def _addresses(blobs: list[bytes]) -> ctypes.Array[c_void_p]:
    """Where each ``bytes`` of ``blobs`` keeps its contents, for C to fill them before anyone reads them."""
    return (c_void_p * len(blobs))(*(_contents(blob) for blob in blobs))
