"""Bytes behind URLs (``s3://``, ``gs://``, ``https://``, ``file://``, ``memory://``), through fsspec.

fsspec is an optional dependency (the ``remote`` extra: ``pip install 'fsspec[http]'``, or
``pip install -e '.[remote]'`` in a checkout), imported only when a URL is seen. Every read here is
stateless (``cat_file`` of a whole file or of a byte range), so reader threads can share one
filesystem object: there is no file position to race on.

Resolving a URL to its filesystem (``url_to_fs``) costs more than a small read from memory (22-25 us
with the GIL held, half of a ``file://`` read of 100 KB: docs/design.md), so each thread keeps the
filesystems it resolved, keyed by everything ``url_to_fs`` builds one from: the
protocol, the options the URL itself carries (a host, a user) and the storage options. Per thread, as
fsspec itself keeps a filesystem without async support per thread; a forked child starts afresh, as
fsspec's own cache does.

An asynchronous file system's read (HTTP, S3, GCS) runs on fsspec's event loop while the reader thread
waits for it in short steps that check the thread's cancellation: fsspec's own ``cat_file`` waits
until the request ends, and a server that accepts a connection and never answers held the reader, and
with it the interpreter's exit, for aiohttp's default limit of 5 minutes after ``close()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import re
import stat
import threading
from collections.abc import Hashable, Sequence
from typing import Any

from ._cancel import check_cancelled

__all__ = [
    "cat_file",
    "cat_files",
    "concurrent_reads",
    "filesystem",
    "is_url",
    "read_url",
    "read_urls",
    "require_fsspec",
]

#: Seconds between cancellation checks while a reader waits for an asynchronous read.
_CANCEL_STEP = 0.05

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# Chained URLs (``simplecache::s3://...``) carry ``::`` before a scheme's ``://``: a local file named
# ``Foo::Bar.png`` has no ``://`` after it, and is read as the local file it is.
_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*::.*://")


def is_url(text: str) -> bool:
    """Whether ``text`` names a file by URL (``scheme://...`` or an fsspec chain ``a::b://...``)."""
    # The substring test first: a local path (the common case) is then refused without a regex.
    return "://" in text and bool(_URL.match(text) or _CHAINED.match(text))


def require_fsspec(url: str) -> Any:
    """Imports fsspec, or says what to install to read ``url``.

    The message names the package itself, as the ``remote`` extra declares it: threadloader is not on
    PyPI, so an install by the extra's name alone would find nothing.

    Raises:
        ImportError: If fsspec is not installed, or the package of ``url``'s protocol (s3fs for s3://).
    """
    try:
        import fsspec
    except ImportError as exc:
        raise ImportError(
            f"reading {url!r} needs fsspec: pip install 'fsspec[http]' (threadloader's remote extra; in "
            "a threadloader checkout, pip install -e '.[remote]'), plus the protocol's own package where "
            "fsspec needs one: s3fs for s3://, gcsfs for gs://"
        ) from exc
    # Each protocol of a chain too (``simplecache::s3://``): unchecked, a missing s3fs was found only at
    # the first batch, by fsspec's message alone, which names no URL.
    for bit in url.split("::"):
        protocol = fsspec.core.split_protocol(bit if "://" in bit else f"{bit}://")[0]
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:  # fsspec's message names the package: "Install s3fs to access S3"
            raise ImportError(f"reading {url!r} needs the package of its protocol: {exc}") from exc
        except ValueError:  # a protocol fsspec does not know: each sample's read says so
            pass
    return fsspec


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem object and the path within it for ``url``, as ``url_to_fs`` gives them.

    A thread that resolved a filesystem for the same protocol, URL options and storage options before
    gets that one back. Chained URLs (``a::b://``), and options that cannot be compared by value, are
    resolved every time.
    """
    protocol, sep, _ = url.partition("://")
    options = _frozen(storage_options) if storage_options else ()
    uncached = not sep or len(protocol) < 2 or "::" in url or "protocol" in (storage_options or ())
    if uncached or options is None:
        return _url_to_fs(url, storage_options)
    cache = _local
    cls = cache.classes.get(protocol)
    if cls is not None:
        fs = cache.filesystems.get((protocol, _url_options(cls, url), options))
        if fs is not None:
            return fs, cls._strip_protocol(url)
    fs, path = _url_to_fs(url, storage_options)
    cls = cache.classes[protocol] = type(fs)
    url_options = _url_options(cls, url)
    if url_options is not None:
        cache.filesystems[protocol, url_options, options] = fs
    return fs, path


def read_url(url: str) -> bytes:
    """The whole file at ``url``, in one stateless call (safe from any thread).

    Raises:
        OSError: For a ``file://`` URL of something other than a regular file: a FIFO's read would
            wait for a writer forever, with the reader thread and the process's exit behind it.
    """
    fs, path = filesystem(url)
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    if "file" in protocols and not stat.S_ISREG(os.stat(path).st_mode):
        raise OSError(f"not a regular file (a FIFO, a socket or a device): {url}")
    return cat_file(fs, path, url)


def cat_file(fs: Any, path: str, url: str, start: int | None = None, end: int | None = None) -> bytes:
    """``fs.cat_file(path, start, end)``, stopped when the calling reader thread is cancelled.

    An asynchronous file system's read is run on its event loop and waited for in steps of
    :data:`_CANCEL_STEP`, so a request the server never answers ends at ``close()`` (it is cancelled
    on the loop) instead of at the back end's own time limit.

    Raises:
        Cancelled: If the reader thread is cancelled while it waits.
        TimeoutError: If the back end's time limit ran out (its message names the option that sets it).
    """
    if not concurrent_reads(fs):
        return bytes(fs.cat_file(path, start=start, end=end))
    try:
        return bytes(_on_loop(fs, fs._cat_file(path, start=start, end=end)))
    except asyncio.TimeoutError as exc:  # aiohttp's has no message: say what ran out and what sets it
        raise TimeoutError(timed_out(url)) from exc


def concurrent_reads(fs: Any) -> bool:
    """Whether ``fs`` reads on an event loop of its own (HTTP, S3, GCS), where reads can overlap."""
    return bool(getattr(fs, "async_impl", False)) and not getattr(fs, "asynchronous", False)


def cat_files(fs: Any, reads: Sequence[tuple[str, str, int | None, int | None]]) -> list[bytes | Exception]:
    """Each ``(path, url, start, end)``'s bytes, read at once on ``fs``'s event loop, or its error.

    Why: one reader thread waits for a batch's requests together, so a batch costs a round trip or
    so, not one per sample; a reader thread per request in flight would cost a CUDA stream and its
    cached memory each. ``fs`` must read concurrently (:func:`concurrent_reads`). A sample's error is
    its own, as :func:`cat_file` raises it.

    Raises:
        Cancelled: If the calling reader thread is cancelled while it waits (every read is cancelled).
    """

    async def read_all() -> list[Any]:
        return await asyncio.gather(
            *(fs._cat_file(path, start=start, end=end) for path, _, start, end in reads),
            return_exceptions=True,
        )

    results: list[bytes | Exception] = []
    for (_, url, _, _), result in zip(reads, _on_loop(fs, read_all()), strict=True):
        if isinstance(result, asyncio.TimeoutError):
            error = TimeoutError(timed_out(url))
            error.__cause__ = result
            results.append(error)
        elif isinstance(result, BaseException):
            if not isinstance(result, Exception):  # a cancellation of the loop's own: not the sample's
                raise result
            results.append(result)
        else:
            results.append(bytes(result))
    return results


def read_urls(urls: Sequence[str]) -> list[bytes | Exception | None]:
    """The files at ``urls`` on file systems that read concurrently, each one's at once (:func:`cat_files`).

    Returns:
        Per URL, in order: its bytes, its read's error, or ``None`` where it is to be read alone with
        :func:`read_url` (a file system that does not read concurrently, or one that does not resolve:
        that read says why).
    """
    results: list[bytes | Exception | None] = [None] * len(urls)
    groups: dict[int, tuple[Any, list[int], list[tuple[str, str, int | None, int | None]]]] = {}
    for position, url in enumerate(urls):
        try:
            fs, path = filesystem(url)
        except Exception:  # ImportError, an unknown protocol: read alone, which raises or reports it
            continue
        if concurrent_reads(fs):
            _, positions, reads = groups.setdefault(id(fs), (fs, [], []))
            positions.append(position)
            reads.append((path, url, None, None))
    for fs, positions, reads in groups.values():
        for position, result in zip(positions, cat_files(fs, reads), strict=True):
            results[position] = result
    return results


def _on_loop(fs: Any, coroutine: Any) -> Any:
    """What ``coroutine`` returns, run on ``fs``'s event loop, waited for in steps that check cancellation."""
    future = asyncio.run_coroutine_threadsafe(coroutine, fs.loop)
    try:
        while not future.done():
            concurrent.futures.wait([future], timeout=_CANCEL_STEP)
            check_cancelled()
    except BaseException:  # Cancelled, or a KeyboardInterrupt in a caller's own thread
        future.cancel()
        raise
    return future.result()


def timed_out(url: str) -> str:
    """What ran out when a read of ``url`` found no answer in time, and what sets it.

    fsspec's ``FSTimeoutError`` (aiohttp's) carries no message: an error that only named it said
    neither that a time limit ran out nor how to change it.
    """
    return (
        f"{url}: no answer within the back end's time limit (for HTTP, aiohttp's 5 minutes unless set "
        """through fsspec's configuration: FSSPEC_HTTP='{"timeout": 60}' in the environment)"""
    )


def _url_to_fs(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    fsspec = require_fsspec(url)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path


class _Cache(threading.local):
    """One thread's resolved filesystems, and the filesystem class of each protocol."""

    def __init__(self) -> None:
        self.classes: dict[str, Any] = {}
        self.filesystems: dict[tuple[str, Hashable, Hashable], Any] = {}


_local = _Cache()


def _forget_in_child() -> None:
    """A forked child resolves its filesystems again, as fsspec makes new instances in a new process."""
    global _local
    _local = _Cache()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _url_options(cls: Any, url: str) -> Hashable | None:
    """The options the URL itself gives its filesystem (a host, a user), as a key."""
    found = cls._get_kwargs_from_urls(url)
    return _frozen(found) if found else ()


def _frozen(value: Any) -> Hashable | None:
    """``value`` as a key equal only to an equal value of the same types; ``None`` if it has none."""
    if isinstance(value, dict):
        frozen = {key: _frozen(item) for key, item in value.items()}
        if any(item is None or not isinstance(key, str) for key, item in frozen.items()):
            return None
        return (dict, tuple(sorted(frozen.items(), key=lambda pair: pair[0])))
    if isinstance(value, (list, tuple)):
        items = [_frozen(item) for item in value]
        return None if any(item is None for item in items) else (type(value), tuple(items))
    if isinstance(value, (str, bytes, int, float, bool, type(None))):
        return (type(value), value)
    return None
