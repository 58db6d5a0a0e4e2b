"""Where a tar shard's bytes come from: local files kept open, or an fsspec file system.

Both read by position (``os.pread``; a ranged ``cat_file``), so no file position is shared between
reader threads, and both read a batch's ranges together (``read_many``): local ones in one call into C
(:func:`._filereads.read_ranges`), remote ones in one wait on fsspec's event loop
(:func:`._remote.cat_files`). :mod:`._tar` indexes shards and reads their members through these.
"""

from __future__ import annotations

import os
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import IO, Any, Protocol

from . import _filereads
from ._remote import cat_file, cat_files, concurrent_reads, filesystem

__all__ = ["MAX_OPEN_SHARDS", "FsspecStorage", "LocalStorage", "Storage"]


class Storage(Protocol):
    """Where shards live: the local file system, or an fsspec one. Every call is stateless."""

    def size(self, path: str) -> int: ...

    def open(self, path: str) -> IO[bytes]: ...

    def read(self, path: str, offset: int, size: int) -> bytes: ...


class LocalStorage:
    """Local files, read with ``os.pread`` (no shared position to race on) on descriptors kept open.

    One storage per ``TarShards`` (its members hold it too) keeps up to :data:`MAX_OPEN_SHARDS`
    descriptors for every thread that reads through it, the least recently used closed first, so a
    sample is one system call, not an open, a read and a close. A thread counts itself in on a
    descriptor for its read, under the storage's lock, and only a descriptor no thread is reading is
    closed: none is closed (and its number reused for another file) under a read. Files are opened
    outside the lock, so a slow file system's open holds up no other read. The rest close when the
    storage is collected; at interpreter exit they are left to the operating system, since a reader
    thread may still be reading.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: OrderedDict[str, _File] = OrderedDict()  # by path, the least recently used first
        weakref.finalize(self, _close_all, self._files).atexit = False
        _local_storages.add(self)

    def _forked(self) -> None:
        """In a forked child: the lock anew (a parent's reader may have held it) and no readers."""
        self._lock = threading.Lock()
        for file in self._files.values():
            file.readers = 0

    def __reduce__(self) -> tuple[type[LocalStorage], tuple[()]]:
        """Pickles without the open files: a copy in another process opens its own."""
        return (LocalStorage, ())

    def size(self, path: str) -> int:
        status = os.stat(path)
        if not stat.S_ISREG(status.st_mode):  # a FIFO would block its open forever
            raise OSError(f"{path} is not a regular file: only regular files are read as shards")
        return status.st_size

    def open(self, path: str) -> IO[bytes]:
        return open(path, "rb")

    def read(self, path: str, offset: int, size: int) -> bytes:
        file = self._enter(path)
        try:
            data = os.pread(file.fd, size, offset)
            if len(data) == size:
                return data
            chunks = [data]  # short: the shard ends early, or a read stopped short; read on until sure
            while data and size > len(data):
                offset, size = offset + len(data), size - len(data)
                data = os.pread(file.fd, size, offset)
                chunks.append(data)
            return b"".join(chunks)
        finally:
            self._leave([file])

    def read_many(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes | OSError]:
        """Each ``(path, offset, size)`` range's bytes (shorter where the shard ends), or its error.

        One call into C for them all (:func:`._filereads.read_ranges`), on the descriptors :meth:`read`
        uses, each counted in for the call as for a read; a shard that does not open is that range's
        error. Needs :func:`._filereads.available`.
        """
        entered: list[_File | OSError] = []
        try:
            for path, _, _ in ranges:
                try:
                    entered.append(self._enter(path))
                except OSError as exc:
                    entered.append(exc)
            reads = iter(
                _filereads.read_ranges(
                    [
                        (file.fd, offset, size)
                        for file, (_, offset, size) in zip(entered, ranges, strict=True)
                        if isinstance(file, _File)
                    ]
                )
            )
            return [file if isinstance(file, OSError) else next(reads) for file in entered]
        finally:
            self._leave([file for file in entered if isinstance(file, _File)])

    def _leave(self, files: list[_File]) -> None:
        """Counts the calling thread out of ``files``, once per entry (one per :meth:`_enter`); trims."""
        with self._lock:
            for file in files:
                file.readers -= 1
            self._trim()

    def _enter(self, path: str) -> _File:
        """The open file at ``path``, with the calling thread counted among its readers."""
        with self._lock:
            file = self._files.get(path)
            if file is not None:
                self._files.move_to_end(path)
                file.readers += 1
                return file
        opened = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        with self._lock:
            file = self._files.get(path)
            spare = opened if file is not None else None  # another thread opened it meanwhile
            if file is None:
                file = self._files[path] = _File(opened)
            self._files.move_to_end(path)
            file.readers += 1
            self._trim()
        if spare is not None:
            os.close(spare)
        return file

    def _trim(self) -> None:
        """Closes the least recently used files that no thread is reading, down to the bound (locked)."""
        excess = len(self._files) - MAX_OPEN_SHARDS
        if excess > 0:
            for path in [path for path, file in self._files.items() if not file.readers][:excess]:
                os.close(self._files.pop(path).fd)


#: Most shard files one ``TarShards`` keeps open for its threads; beyond it, the least recently
#: used one nobody is reading is closed.
MAX_OPEN_SHARDS = 32


class _File:
    """A shard file kept open, and how many threads are reading it now."""

    __slots__ = ("fd", "readers")

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.readers = 0


def _close_all(files: OrderedDict[str, _File]) -> None:
    while files:
        os.close(files.popitem()[1].fd)


#: Every local storage alive: a forked child resets their locks and reader counts (its copy of a lock
#: that a parent's reader held stays held, so the child's first read waited forever).
_local_storages: weakref.WeakSet[LocalStorage] = weakref.WeakSet()


def _reset_in_child() -> None:
    for storage in list(_local_storages):
        storage._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)


class FsspecStorage:
    """A file system of fsspec: ranged ``cat_file`` calls, which keep no position either.

    The file system is looked up at each call (``_remote.filesystem``: per thread, cached, forgotten
    in a forked child), not kept: an HTTP file system made before a fork refuses to work after it.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self._url = url
        self._storage_options = storage_options

    def _fs(self) -> Any:
        return filesystem(self._url, self._storage_options)[0]

    def size(self, path: str) -> int:
        size = self._fs().size(path)
        if size is None:  # an HTTP server that sends no Content-Length
            raise OSError(
                "the server does not report the shard's size (no Content-Length), which indexing it by "
                "ranged reads needs; serve it with one, or copy the shard to storage that reports sizes"
            )
        return int(size)

    def open(self, path: str) -> IO[bytes]:
        return self._fs().open(path, "rb")  # type: ignore[no-any-return]

    def read(self, path: str, offset: int, size: int) -> bytes:
        return cat_file(self._fs(), path, self._url, start=offset, end=offset + size)

    def read_many(self, ranges: Sequence[tuple[str, int, int]]) -> list[bytes | Exception] | None:
        """Each ``(path, offset, size)`` range's bytes or its error, requested at once (:func:`cat_files`).

        ``None`` where the file system reads one request at a time.
        """
        fs = self._fs()
        if not concurrent_reads(fs):
            return None
        return cat_files(fs, [(path, self._url, offset, offset + size) for path, offset, size in ranges])
