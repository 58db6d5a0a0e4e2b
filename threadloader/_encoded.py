"""What an encoded sample can be besides a path or bytes, and which files hold images.

The bottom of the sources: :mod:`._sources` (what the user passes) and :mod:`._tar` (tar shards, one
kind of source) both build on these, so neither imports the other's internals and ``_sources`` can
import ``_tar`` for its dispatch without a cycle.
"""

from __future__ import annotations

import abc

__all__ = ["IMAGE_EXTENSIONS", "Deferred"]

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
