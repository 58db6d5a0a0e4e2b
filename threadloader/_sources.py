"""Sources: what the user passes, turned into indexable samples, and reading their bytes.

A source is anything with ``__len__`` and ``__getitem__`` whose items are a path, encoded bytes, or a
``(path | bytes, target)`` pair; a directory becomes an :class:`ImageFolder`. Sources are only ever
indexed from reader threads, never pickled, so classes defined in a notebook cell work as they are.
Bytes that live elsewhere (a tar member, a URL) are a :class:`Deferred`: the source says where they are,
and the reader thread reads them in the ``read`` stage. Tar shards (``_tar``) and URLs (``_remote``, through
fsspec) plug in that way.
"""

from __future__ import annotations

import abc
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from torch.utils.data import IterableDataset

from ._remote import is_url, read_url, require_fsspec
from .errors import SampleError

__all__ = [
    "IMAGE_EXTENSIONS",
    "Deferred",
    "ImageFolder",
    "RemoteFile",
    "SampleRef",
    "Source",
    "as_source",
    "fetch",
    "read_bytes",
]

#: File extensions an :class:`ImageFolder` picks up (the same set as torchvision's ImageFolder).
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


class Deferred(abc.ABC):
    """Encoded bytes that are read later, in a reader thread: a tar member, a file behind a URL.

    A source may return one wherever it could return a path; ``read`` must be safe to call from many
    threads at once, and anything it raises becomes the sample's :class:`SampleError` (stage ``"read"``).
    """

    __slots__ = ()

    @property
    @abc.abstractmethod
    def origin(self) -> str:
        """Where the bytes are, for error messages (a URL, ``shard.tar:member``)."""

    @abc.abstractmethod
    def read(self) -> bytes:
        """The encoded bytes."""


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
_ENCODED_TYPES = (str, os.PathLike, bytes, bytearray, memoryview, Deferred)
#: Non-blocking: opening a FIFO for reading would otherwise wait for a writer, forever. Reads of a regular
#: file ignore the flag.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)

logger = logging.getLogger("threadloader")


class Source(Protocol):
    """What the loader indexes: a map-style dataset of encoded images."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclass(frozen=True, slots=True)
class SampleRef:
    """One sample as the source gave it, before any I/O."""

    index: int
    data: Encoded
    target: Any

    @property
    def origin(self) -> str:
        """The path, or a short description of in-memory bytes, for error messages."""
        if isinstance(self.data, Deferred):
            return self.data.origin
        if isinstance(self.data, (str, os.PathLike)):
            return os.fspath(self.data)
        return f"<{len(self.data)} bytes in memory>"


class ImageFolder:
    """A directory laid out one sub-folder per class, in torchvision's ImageFolder order.

    Classes are the sorted sub-folder names, numbered from 0; files are sorted by path within each
    class, and only regular files with an extension in :data:`IMAGE_EXTENSIONS` (any case) are kept.
    Anything else with such a name (a FIFO, a socket, a device, a broken link) is left out with a
    warning: reading it could block forever. Symlinked folders are followed, each real directory once
    per class; a link back to a folder it is inside (a loop) is not followed, with a warning.

    Attributes:
        root: The directory.
        classes: Class names, index = target.
        class_to_idx: Class name to target.
        samples: ``(path, target)`` pairs in order.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise NotADirectoryError(f"ImageFolder root {str(self.root)!r} is not a directory")
        self.classes = sorted(entry.name for entry in os.scandir(self.root) if entry.is_dir())
        if not self.classes:
            raise FileNotFoundError(
                f"no class sub-folders in {str(self.root)!r}: a directory source must hold one folder per "
                "class (root/cat/1.jpg, root/dog/2.jpg); for a flat folder pass a list of file paths"
            )
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples: list[tuple[str, int]] = []
        for name in self.classes:
            files = _image_files(os.path.join(self.root, name))
            self.samples.extend((path, self.class_to_idx[name]) for path in sorted(files))
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
            if entry.is_dir():
                if entry.is_symlink() and _links_to_ancestor(entry.path):
                    logger.warning(
                        "symlink loop: %r leads to %r, a folder it is inside; not followed",
                        entry.path,
                        os.path.realpath(entry.path),
                    )
                else:
                    folders.append(entry.path)
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                (files if entry.is_file() else others).append(entry.path)
        pending.extend(reversed(folders))
    if others:
        logger.warning(
            "left out %d path(s) with an image extension that are not regular files (FIFO, socket, "
            "device or broken link): %s",
            len(others),
            ", ".join(repr(path) for path in sorted(others)[:5]) + (", ..." if len(others) > 5 else ""),
        )
    return files


def _links_to_ancestor(path: str) -> bool:
    target = os.path.realpath(path)
    return os.path.commonpath([target, os.path.realpath(os.path.dirname(path))]) == target


def as_source(source: object) -> Source:
    """Checks a user's source and returns something indexable.

    A directory becomes an :class:`ImageFolder`; a tar shard pattern (``"shards/{000000..000127}.tar"``,
    one ``.tar`` path or URL) or a list of ``.tar`` paths becomes a ``TarShards``.

    Raises:
        TypeError: If ``source`` is neither a directory nor a map-style dataset, with the likely fix.
        ImportError: If the source names URLs and fsspec is not installed.
    """
    # Imported here: _tar builds on this module (Deferred, IMAGE_EXTENSIONS); this is only the dispatch.
    from ._tar import TarShards, is_shard_spec

    if isinstance(source, (str, os.PathLike)):
        if os.path.isdir(source):
            return ImageFolder(source)
        if is_shard_spec(source):
            return TarShards(source)
        raise TypeError(
            "a single path as source must be a directory (one sub-folder per class) or tar shards "
            f"('shards/{{000000..000127}}.tar'), got {os.fspath(source)!r}; to load one file pass a list: "
            "ThreadLoader([path])"
        )
    if isinstance(source, (list, tuple)) and source:
        if all(isinstance(item, (str, os.PathLike)) and is_shard_spec(item) for item in source):
            return TarShards(source)
        first = source[0][0] if isinstance(source[0], tuple) and source[0] else source[0]
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


def fetch(source: Source, index: int) -> SampleRef:
    """Calls ``source[index]`` and checks that the item is encoded data, optionally with a target.

    Raises:
        SampleError: If ``__getitem__`` raises or returns something that is not encoded image data.
    """
    try:
        item = source[index]
    except Exception as exc:
        origin = f"{type(source).__name__}[{index}]"
        raise SampleError.from_exception(exc, index=index, origin=origin, stage="fetch") from exc
    if isinstance(item, _ENCODED_TYPES):
        return SampleRef(index, _locate(item), None)
    if isinstance(item, Sequence) and len(item) == 2 and isinstance(item[0], _ENCODED_TYPES):
        return SampleRef(index, _locate(item[0]), item[1])
    raise SampleError(
        index=index,
        origin=f"{type(source).__name__}[{index}]",
        stage="fetch",
        reason=(
            f"expected a path, encoded bytes, or a (path | bytes, target) pair, got {_type_of(item)}; "
            "threadloader decodes by itself, so return the file path or its bytes, not a decoded image"
        ),
    )


def read_bytes(ref: SampleRef) -> bytes | bytearray | memoryview:
    """Returns the encoded bytes of a sample, reading the file if it is a path.

    Only regular files are read: a FIFO would block the reader forever, a device might never end.

    Raises:
        SampleError: If the file cannot be read, or is not a regular file.
        ImportError: If the sample is a URL and fsspec is not installed (a set-up error, not the sample's).
    """
    if isinstance(ref.data, Deferred):
        try:
            return ref.data.read()
        except ImportError:
            raise
        except Exception as exc:  # fsspec back ends raise their own types (aiohttp, botocore, ...)
            raise SampleError.from_exception(exc, index=ref.index, origin=ref.origin, stage="read") from exc
    if not isinstance(ref.data, (str, os.PathLike)):
        return ref.data
    try:
        fd = os.open(ref.data, _READ_FLAGS)
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                with open(fd, "rb", buffering=0, closefd=False) as f:  # unbuffered: one read
                    return f.read()
        finally:
            os.close(fd)
    except OSError as exc:
        raise SampleError.from_exception(exc, index=ref.index, origin=ref.origin, stage="read") from exc
    raise SampleError(
        index=ref.index,
        origin=ref.origin,
        stage="read",
        reason=f"not a regular file ({_file_kind(mode)}): only regular files are read",
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


def _locate(data: Encoded) -> Encoded:
    """A URL string becomes a :class:`RemoteFile`, read through fsspec; anything else is kept."""
    return RemoteFile(data) if isinstance(data, str) and is_url(data) else data


def _type_of(item: object) -> str:
    if isinstance(item, tuple):
        return "tuple(" + ", ".join(type(x).__name__ for x in item) + ")"
    return type(item).__module__.split(".")[0] + "." + type(item).__qualname__
