"""Sources: what the user passes, turned into indexable samples, and reading their bytes.

A source is anything with ``__len__`` and ``__getitem__`` whose items are a path, encoded bytes, or a
``(path | bytes, target)`` pair; a directory becomes an :class:`ImageFolder`. Sources are only ever
indexed from reader threads, never pickled, so classes defined in a notebook cell work as they are.
Bytes that live elsewhere (a tar member, a URL) are a :class:`Deferred`: the source says where they are,
and the reader thread reads them in the ``read`` stage. Tar shards (``_tar``) and URLs (``_remote``, through
fsspec) plug in that way; both sit below this module, on :mod:`._encoded`.
"""

from __future__ import annotations

import functools
import logging
import os
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeAlias

import torch
from torch.utils.data import IterableDataset

from . import _filereads
from ._cancel import check_cancelled
from ._encoded import IMAGE_EXTENSIONS, Deferred
from ._remote import is_url, read_url, read_urls, require_fsspec
from ._tar import TarMember, TarShards, is_shard_spec, read_members
from .errors import SampleError, detached

__all__ = [
    "IMAGE_EXTENSIONS",
    "Blob",
    "Deferred",
    "Fetched",
    "ImageFolder",
    "RemoteFile",
    "Source",
    "as_source",
    "fetch_batch",
    "is_folder",
    "origin_of",
    "read_batch",
]


class RemoteFile(Deferred):
    """A file behind an fsspec URL (``s3://``, ``gs://``, ``https://``, ``file://``, ``memory://``)."""

    __slots__ = ("url",)

    def __init__(self, url: str) -> None:
        self.url = url

    @property
    def origin(self) -> str:
        return self.url

    def read(self) -> bytes:
        return read_url(self.url)

    def __repr__(self) -> str:
        return f"RemoteFile({self.url!r})"


Encoded: TypeAlias = "str | os.PathLike[str] | bytes | bytearray | memoryview | Deferred"
Blob: TypeAlias = "bytes | bytearray | memoryview"  # what reading gives: the decoder's input
#: Non-blocking: opening a FIFO for reading would otherwise wait for a writer, forever. Reads of a regular
#: file ignore the flag.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
_CHUNK = 1 << 20  # bytes per read past a file's stated size
#: Files (or tar members) per call into C (:mod:`._filereads`): a stop is seen between calls, and 16
#: files a call still let go of the GIL 32 times less often than Python's four calls a file (16 members,
#: 16 times less often than a pread each).
_FILES_PER_CALL = 16

logger = logging.getLogger("threadloader")


class Source(Protocol):
    """What the loader indexes: a map-style dataset of encoded images."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


#: One sample as the source gave it, before any I/O: ``(index, data, target)``. A plain tuple: a reader
#: makes one per sample, and an object with fields costs several times more to build.
Fetched: TypeAlias = "tuple[int, Encoded, Any]"

_PATH, _BYTES, _DEFERRED, _PAIR, _OTHER = range(5)


def _kind_of(cls: type) -> int:
    """What a sample's type is: a path, bytes, a Deferred, a pair or something else.

    The checks against ABCs (os.PathLike, Deferred, Sequence) cost more than the rest of a sample's
    fetch, so :func:`_kind` does them once per type.
    """
    if issubclass(cls, (str, os.PathLike)):
        return _PATH
    if issubclass(cls, (bytes, bytearray, memoryview)):
        return _BYTES
    if issubclass(cls, Deferred):
        return _DEFERRED
    if issubclass(cls, Sequence):
        return _PAIR
    return _OTHER


#: :func:`_kind_of`, cached per type (docs/design.md has the cost it saves); bounded, as types made on
#: the fly would grow it for ever.
_kind: Callable[[type], int] = functools.lru_cache(maxsize=1024)(_kind_of)


def origin_of(data: Encoded) -> str:
    """The path, or a short description of in-memory bytes, for error messages.

    A released memoryview is described as one: its size can no longer be read, and the error raised
    while naming its sample's decode failure ended the pass, ``on_error="skip"`` or not.
    """
    if _kind(type(data)) == _DEFERRED:
        return data.origin  # type: ignore[union-attr]
    if isinstance(data, (str, os.PathLike)):
        return os.fspath(data)
    try:
        return f"<{memoryview(data).nbytes} bytes in memory>"  # type: ignore[arg-type]  # not items
    except ValueError:
        return "<a released memoryview>"


class ImageFolder:
    """A directory laid out one sub-folder per class, in torchvision's ImageFolder order.

    Classes are the sorted sub-folder names, numbered from 0; within a class, each folder's own files
    (sorted by name) come before its sub-folders' (walked in sorted order), as torchvision's, and only
    regular files with an extension in :data:`IMAGE_EXTENSIONS` (any case) are kept.
    Anything else with such a name (a FIFO, a socket, a device, a broken link) is left out with a
    warning: reading it could block forever. Symlinked folders are followed, each real directory once
    per class; a link back to a folder it is inside (a loop) is not followed, with a warning. A class
    folder with no image files is refused unless ``allow_empty`` (as torchvision's): a stray folder such
    as ``.ipynb_checkpoints`` would otherwise shift every later class's target.

    Args:
        root: The directory; a leading ``~`` is the user's home, as torchvision's.
        allow_empty: Keep class folders with no image files as classes with no samples.

    Attributes:
        root: The directory.
        classes: Class names, index = target.
        class_to_idx: Class name to target.
        samples: ``(path, target)`` pairs in order.
    """

    def __init__(self, root: str | os.PathLike[str], *, allow_empty: bool = False) -> None:
        self.root = Path(os.path.expanduser(root))
        if not self.root.is_dir():
            what = "is not a directory" if self.root.exists() else "does not exist"
            raise NotADirectoryError(f"ImageFolder root {str(self.root)!r} {what}")
        with os.scandir(self.root) as scan:
            self.classes = sorted(entry.name for entry in scan if is_folder(entry) and not _loops(entry))
        if not self.classes:
            shards = any(is_shard_spec(name) for name in os.listdir(self.root))
            flat = (
                f"for a folder of tar shards pass {os.path.join(self.root, '*.tar')!r}"
                if shards
                else ("for a flat folder pass a list of file paths")
            )
            raise FileNotFoundError(
                f"no class sub-folders in {str(self.root)!r}: a directory source must hold one folder per "
                f"class (root/cat/1.jpg, root/dog/2.jpg); {flat}"
            )
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        empty = []
        for name in self.classes:
            files = _image_files(os.path.join(self.root, name))
            # torchvision's order: folders by path, each folder's own files before its sub-folders'
            in_order = sorted(files, key=lambda path: (os.path.dirname(path), os.path.basename(path)))
            self.samples.extend((path, self.class_to_idx[name]) for path in in_order)
            empty += [] if in_order else [name]
        if empty and self.samples and not allow_empty:
            raise FileNotFoundError(
                f"class folders with no image files ({', '.join(IMAGE_EXTENSIONS)}) in {str(self.root)!r}: "
                f"{', '.join(map(repr, empty))}; every class after one would get the wrong target: remove "
                "them, or pass ImageFolder(root, allow_empty=True) to keep them as classes without samples"
            )
        if not self.samples:
            raise FileNotFoundError(
                f"no image files ({', '.join(IMAGE_EXTENSIONS)}) under {str(self.root)!r}"
            )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.samples[index]

    def __repr__(self) -> str:
        return f"ImageFolder({str(self.root)!r}, classes={len(self.classes)}, samples={len(self.samples)})"


def is_folder(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a folder, through links; a link that loops (ELOOP) or fails is not one."""
    try:
        return entry.is_dir()
    except OSError as exc:  # is_dir() is False for a link to nothing, but raises for a link loop
        logger.warning("left out %r: %s: %s", entry.path, type(exc).__name__, exc)
        return False


def _is_regular(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a regular file, through links; one that cannot be looked at is not."""
    try:
        return entry.is_file()
    except OSError:  # a link loop: counted with the other paths that are not regular files
        return False


def _image_files(top: str) -> list[str]:
    """Regular image files under ``top``, through symlinked folders, each real directory once.

    ``os.walk(followlinks=True)`` (torchvision's way) walks a folder once per path that reaches it, so a
    link to an ancestor repeats the tree until the path is too long, and a link to the root lists
    every class under this one. Here folders are walked depth first in sorted order, so a directory
    reached by two paths is listed under the first, whatever order the file system returns.
    """
    files: list[str] = []
    others: list[str] = []
    visited: set[tuple[int, int]] = set()
    pending = [top]
    while pending:
        directory = pending.pop()
        try:
            status = os.stat(directory)
            if (status.st_dev, status.st_ino) in visited:  # reached again through a link
                continue
            visited.add((status.st_dev, status.st_ino))
            with os.scandir(directory) as scan:
                entries = sorted(scan, key=lambda entry: entry.name)
        except OSError as exc:
            logger.warning("left out folder %r: %s: %s", directory, type(exc).__name__, exc)
            continue
        folders = []
        for entry in entries:
            if is_folder(entry):
                if not _loops(entry):
                    folders.append(entry.path)
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                (files if _is_regular(entry) else others).append(entry.path)
        pending.extend(reversed(folders))
    if others:
        logger.warning(
            "left out %d path(s) with an image extension that are not regular files (FIFO, socket, "
            "device, broken link or link loop): %s",
            len(others),
            ", ".join(repr(path) for path in sorted(others)[:5]) + (", ..." if len(others) > 5 else ""),
        )
    return files


def _loops(entry: os.DirEntry[str]) -> bool:
    """Whether ``entry`` is a link to a folder it is inside (the root too), said in a warning if so."""
    if not entry.is_symlink():
        return False
    target = os.path.realpath(entry.path)
    if os.path.commonpath([target, os.path.realpath(os.path.dirname(entry.path))]) != target:
        return False
    logger.warning("symlink loop: %r leads to %r, a folder it is inside; not followed", entry.path, target)
    return True


def as_source(source: object) -> Source:
    """Checks a user's source and returns something indexable.

    A directory becomes an :class:`ImageFolder`; a tar shard pattern (``"shards/{000000..000127}.tar"``,
    a glob ``"shards/*.tar"``, one ``.tar`` path or URL) or a list of them becomes a ``TarShards``.

    Raises:
        FileNotFoundError: If ``source`` is a local path that does not exist.
        TypeError: If ``source`` is neither a directory nor a map-style dataset, with the likely fix.
        ImportError: If the source names URLs and fsspec is not installed.
    """
    if isinstance(source, (str, os.PathLike)):
        if not is_url(os.fspath(source)):
            source = os.path.expanduser(source)
        if os.path.isdir(source):
            return ImageFolder(source)
        if is_shard_spec(source):
            return TarShards(source)
        path = os.fspath(source)
        if not os.path.exists(path) and not is_url(path):
            broken = " (a link to a missing target)" if os.path.lexists(path) else ""
            raise FileNotFoundError(
                f"source {path!r} does not exist{broken}: pass a directory with one sub-folder per class, "
                "tar shards ('shards/{000000..000127}.tar') or a list of image files"
            )
        raise TypeError(
            "a single path as source must be a directory (one sub-folder per class) or tar shards "
            f"('shards/{{000000..000127}}.tar'), got {os.fspath(source)!r}; to load one file pass a list: "
            "ThreadLoader([path])"
        )
    if isinstance(source, (list, tuple)) and source:
        if all(isinstance(item, (str, os.PathLike)) and is_shard_spec(item) for item in source):
            return TarShards(source)
        # A pair is any 2-item sequence, as fetch_batch reads it: [url, target] as well as (url, target).
        pair = _kind(type(source[0])) == _PAIR and len(source[0]) == 2
        first = source[0][0] if pair else source[0]
        if isinstance(first, str) and is_url(first):
            require_fsspec(first)  # a missing fsspec fails here, not once per sample
    if isinstance(source, (bytes, bytearray, memoryview)):
        raise TypeError("source is one bytes object; pass a list of encoded images: ThreadLoader([data])")
    if isinstance(source, IterableDataset) or not (
        hasattr(source, "__getitem__") and hasattr(source, "__len__")
    ):
        kind = "an iterable-style dataset" if hasattr(source, "__iter__") else type(source).__name__
        raise TypeError(
            f"source must be map-style (__len__ and __getitem__), got {kind}: threadloader reads samples by "
            "index so that order and resumption do not depend on thread timing; wrap the items in a list"
        )
    return source  # type: ignore[return-value]


def fetch_batch(source: Source, indices: Sequence[int]) -> list[Fetched | SampleError]:
    """Calls ``source[index]`` per index and checks that each item is encoded data, maybe with a target.

    Stops between samples when the reader thread is cancelled.

    Returns:
        Per index, in order: the sample, or the :class:`SampleError` that ``__getitem__`` raised or that
        says the item is not encoded image data.
    """
    fetched: list[Fetched | SampleError] = []
    for index in indices:
        check_cancelled()  # a slow source makes a long batch: stop between samples
        try:
            item = source[index]
        except Exception as exc:
            fetched.append(_error(exc, index, f"{type(source).__name__}[{index}]", "fetch"))
            continue
        data, target = item, None
        kind = _kind(type(item))
        if kind == _PAIR and len(item) == 2:
            data = item[0]
            kind = _kind(type(data))
            if kind < _PAIR:
                target = item[1]
        if kind >= _PAIR:
            fetched.append(_not_encoded(source, index, item))
            continue
        if kind == _PATH and isinstance(data, str) and is_url(data):
            data = RemoteFile(data)  # type: ignore[arg-type]
        fetched.append((index, data, target))
    return fetched


def read_batch(fetched: list[Fetched | SampleError]) -> list[Blob | SampleError]:
    """Reads the encoded bytes of each sample: a path's file, a :class:`Deferred`'s bytes.

    Only regular files are read: a FIFO would block the reader forever, a device might never end.
    Stops between samples when the reader thread is cancelled.

    Returns:
        Per sample, in order: its bytes, or its :class:`SampleError` (a fetch error, passed on, or the
        read's: a file that cannot be read or is not a regular file, a Deferred whose read raised).

    Raises:
        ImportError: If a sample is a URL and fsspec is not installed (a set-up error, not the sample's).
    """
    together = _read_together(fetched)
    blobs: list[Blob | SampleError] = []
    for position, sample in enumerate(fetched):
        if isinstance(sample, SampleError):
            blobs.append(sample)
            continue
        if position in together:
            blobs.append(together[position])
            continue
        check_cancelled()  # a slow storage makes a long batch too
        index, data, _ = sample
        kind = _kind(type(data))
        if kind == _BYTES:
            blobs.append(data)  # type: ignore[arg-type]
        elif kind == _PATH:
            blobs.append(_read_file(index, data))  # type: ignore[arg-type]
        else:
            blobs.append(_read_deferred(index, data))  # type: ignore[arg-type]
    return blobs


def _read_together(fetched: list[Fetched | SampleError]) -> dict[int, Blob | SampleError]:
    """The batch's reads done together, by position: files and tar members in C, a few a call.

    URLs and tar members on file systems that read concurrently are requested all at once. Those left
    to each sample's own read (:data:`._filereads.RETRY`, file systems that read one request at a
    time) are not in it.
    """
    files: list[int] = []
    members: list[int] = []
    urls: list[int] = []
    for position, sample in enumerate(fetched):
        if not isinstance(sample, SampleError):
            kind = type(sample[1])
            if _kind(kind) == _PATH:
                files.append(position)
            elif kind is TarMember:
                members.append(position)
            elif kind is RemoteFile:
                urls.append(position)
    read: dict[int, Blob | SampleError] = {}
    if _filereads.available():
        for first in range(0, len(files), _FILES_PER_CALL):
            check_cancelled()  # between calls: on slow storage a call's files take a while
            _read_files(fetched, files[first : first + _FILES_PER_CALL], read)
    samples: list[Fetched] = [fetched[position] for position in members + urls]  # type: ignore[misc]
    outcomes = read_members([data for _, data, _ in samples[: len(members)]], per_call=_FILES_PER_CALL)  # type: ignore[misc]
    outcomes += read_urls([data.url for _, data, _ in samples[len(members) :]])  # type: ignore[union-attr]
    for position, (index, data, _), outcome in zip(members + urls, samples, outcomes, strict=True):
        if isinstance(outcome, Exception):
            read[position] = _error(outcome, index, data.origin, "read")  # type: ignore[union-attr]
        elif outcome is not None:
            read[position] = outcome
    return read


def _read_files(
    fetched: list[Fetched | SampleError], chunk: list[int], read: dict[int, Blob | SampleError]
) -> None:
    """Reads the files at the positions of ``chunk`` into ``read`` (those C leaves to Python left out)."""
    paths: list[str | os.PathLike[str]] = [fetched[position][1] for position in chunk]  # type: ignore[index,misc]
    for position, path, outcome in zip(chunk, paths, _filereads.read_files(paths, _READ_FLAGS), strict=True):
        index = fetched[position][0]  # type: ignore[index]
        if isinstance(outcome, OSError):
            read[position] = _error(outcome, index, os.fsdecode(path), "read")
        elif isinstance(outcome, _filereads.NotRegular):
            read[position] = _not_regular(index, path, outcome.mode)
        elif outcome is not _filereads.RETRY:
            read[position] = outcome


def _read_file(index: int, path: str | os.PathLike[str]) -> bytes | SampleError:
    """A regular file's bytes, read with as few system calls as Python allows."""
    try:
        fd = os.open(path, _READ_FLAGS)
        try:
            status = os.fstat(fd)
            if stat.S_ISREG(status.st_mode):
                # One byte past the size: a shorter read is the end of the file, as a regular file's
                # reads only stop short there. A file that grew, or a size of 0 (some virtual file
                # systems report that), reads on to the end.
                data = os.read(fd, status.st_size + 1)
                if len(data) != status.st_size:
                    data = b"".join([data, *iter(functools.partial(os.read, fd, _CHUNK), b"")])
                return data
        finally:
            os.close(fd)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path, a lone surrogate in its name
        return _error(exc, index, os.fsdecode(path), "read")
    return _not_regular(index, path, status.st_mode)


def _not_regular(index: int, path: str | os.PathLike[str], mode: int) -> SampleError:
    return SampleError(
        index=index,
        origin=os.fsdecode(path),
        stage="read",
        reason=f"not a regular file ({_file_kind(mode)}): only regular files are read",
    )


def _read_deferred(index: int, data: Deferred) -> bytes | SampleError:
    """A :class:`Deferred`'s bytes, or its sample's read error: anything ``read`` raises, or a non-bytes.

    A ``RemoteFile``'s ``ImportError`` (fsspec missing) is raised on: every URL would fail alike.
    """
    try:
        blob = data.read()
    except ImportError as exc:
        if isinstance(data, RemoteFile):
            raise
        return _error(exc, index, data.origin, "read")
    except Exception as exc:  # fsspec back ends raise their own types (aiohttp, botocore, ...)
        return _error(exc, index, data.origin, "read")
    if not isinstance(blob, bytes | bytearray | memoryview):
        got = TypeError(f"{type(data).__name__}.read() returned {type(blob).__name__}, not bytes")
        return _error(got, index, data.origin, "read")
    return blob  # type: ignore[return-value]


def _error(exc: Exception, index: int, origin: str, stage: str) -> SampleError:
    """The sample's error for ``exc``, chained to it as ``raise ... from exc`` would."""
    error = SampleError.from_exception(exc, index=index, origin=origin, stage=stage)
    error.__cause__ = detached(exc)  # without the reader's frames, which hold its whole group
    return error


def _not_encoded(source: Source, index: int, item: object) -> SampleError:
    """Why ``item`` is not a sample, with the fix; a list is looked into as a tuple is (both are pairs)."""
    data = item[0] if isinstance(item, (tuple, list)) and item else item
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 1:
        # torchvision.io.read_file's: a file's bytes, not a decoded image
        hint = "a 1-D uint8 tensor of a file's bytes (torchvision.io.read_file's) goes as bytes: return "
        hint += "tensor.numpy().tobytes(), or the file's path"
    elif str(getattr(data, "dtype", "")) == "uint8" and getattr(data, "ndim", None) == 1:
        # numpy.fromfile(path, dtype=numpy.uint8)'s: the same bytes as an array
        hint = "a 1-D uint8 array of a file's bytes (numpy.fromfile's) goes as bytes: return "
        hint += "array.tobytes(), or the file's path"
    else:
        hint = "threadloader decodes by itself, so return the file path or its bytes, not a decoded image"
    return SampleError(
        index=index,
        origin=f"{type(source).__name__}[{index}]",
        stage="fetch",
        reason=f"expected a path, encoded bytes, or a (path | bytes, target) pair, got {_type_of(item)}; "
        + hint,
    )


_FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _file_kind(mode: int) -> str:
    return next((kind for is_kind, kind in _FILE_KINDS if is_kind(mode)), stat.filemode(mode))


#: Element types an error names of a tuple or list it got.
_TYPES_SHOWN = 4


def _type_of(item: object) -> str:
    if isinstance(item, (tuple, list)):
        kind = "list" if isinstance(item, list) else "tuple"
        # The first few: a decoded image returned as nested lists (image.tolist()) has hundreds.
        names = [type(x).__name__ for x in item[:_TYPES_SHOWN]] + ["..."] * (len(item) > _TYPES_SHOWN)
        return kind + "(" + ", ".join(names) + ")"
    return type(item).__module__.split(".")[0] + "." + type(item).__qualname__
