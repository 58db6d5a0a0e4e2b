"""Bytes behind URLs (``s3://``, ``gs://``, ``https://``, ``file://``, ``memory://``), through fsspec.

fsspec is an optional dependency (``pip install 'threadloader[remote]'``), imported only when a URL
is seen. Every read here is stateless (``cat_file`` of a whole file or of a byte range), so reader
threads can share one filesystem object: there is no file position to race on.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["filesystem", "is_url", "read_url", "require_fsspec"]

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
# Chained URLs (``simplecache::s3://...``) carry ``::`` before the scheme's ``://``.
_CHAINED = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*::")


def is_url(text: str) -> bool:
    """Whether ``text`` names a file by URL (``scheme://...`` or an fsspec chain ``a::b://...``)."""
    return bool(_URL.match(text) or _CHAINED.match(text))


def require_fsspec(url: str) -> Any:
    """Imports fsspec, or says which extra to install to read ``url``.

    Raises:
        ImportError: If fsspec is not installed.
    """
    try:
        import fsspec  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ImportError(
            f"reading {url!r} needs fsspec: pip install 'threadloader[remote]' (plus the protocol's own "
            "package where fsspec needs one: s3fs for s3://, gcsfs for gs://)"
        ) from exc
    return fsspec


def filesystem(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem object and the path within it for ``url``.

    fsspec caches filesystem instances per protocol and options, so calling this per sample costs a
    dictionary look-up and a parse, not a new connection.
    """
    fsspec = require_fsspec(url)
    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs, path


def read_url(url: str) -> bytes:
    """The whole file at ``url``, in one stateless call (safe from any thread)."""
    fs, path = filesystem(url)
    return bytes(fs.cat_file(path))
