"""Tar shards in the WebDataset layout as a map-style source: indexed once on open, one read per sample.

A shard (``000000.tar``) holds samples as members that share a key: ``key.jpg`` with ``key.cls``,
``key.txt`` or ``key.json``. Each shard is walked once with :mod:`tarfile` when the source is built,
recording every image member's offset and size and reading the (small) target members; after that a
sample is one positioned read (``os.pread`` on a local file, a ranged ``cat_file`` through fsspec:
:mod:`._shardfiles`); a batch's members are read together (:func:`read_members`: a few calls into C,
or one wait for all of its remote requests).
Nothing holds a file position, so any number of reader threads index the source at once.

Why an index rather than streaming: a map-style source is shuffled exactly over the whole set (not
within a buffer), composes with the loader's samplers, with sharding by rank and with resumption,
all of which work on indices, and its order is the sampler's whatever the threads do. The cost is
the walk on open (docs/sources.md has it measured) and a little memory per sample.
"""

from __future__ import annotations

import asyncio
import bisect
import copy
import glob
import json
import logging
import os
import posixpath
import re
import tarfile
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, Any, Literal

from . import _filereads
from ._cancel import check_cancelled
from ._checks import check_count
from ._encoded import IMAGE_EXTENSIONS, Deferred
from ._remote import filesystem, is_url, timed_out
from ._shardfiles import FsspecStorage, LocalStorage, Storage
from .errors import ThreadLoaderError, chained

__all__ = [
    "SHARD_SUFFIXES",
    "ShardError",
    "TarMember",
    "TarShards",
    "expand_braces",
    "is_shard_spec",
    "read_members",
]

logger = logging.getLogger("threadloader")

#: Names that make a path or URL a tar shard for ``ThreadLoader(...)``.
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")

Target = Literal["auto", "cls", "txt", "json"]
_TARGETS = ("auto", "cls", "txt", "json")

# Compressed shards cannot be read by position: named so the error says what the file is (bzip2's
# "BZh" is followed by its block size, a digit from 1 to 9).
_COMPRESSED = {
    re.compile(rb"\x1f\x8b"): "gzip",
    re.compile(rb"BZh[1-9]"): "bzip2",
    re.compile(rb"\xfd7zXZ\x00"): "xz",
    re.compile(rb"\x28\xb5\x2f\xfd"): "zstd",
}
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)(?:\.\.(-?\d+))?$")
_LETTERS = re.compile(r"^([A-Za-z])\.\.([A-Za-z])(?:\.\.(-?\d+))?$")
_GLOB = re.compile(r"[*?[]")  # what makes a local path a glob, as for the glob module


class ShardError(ThreadLoaderError):
    """A tar shard, or one sample in it, is not what the WebDataset layout says.

    Raised when the source is built for a shard that cannot be indexed at all (missing, not a tar,
    compressed); inside the loader, a sample's problem (a missing member, a truncated one, a target
    that does not parse) reaches you as a :class:`SampleError` whose reason is this error's message.

    Attributes:
        shard: The shard's path or URL.
        member: The member at fault, when there is one.
    """

    def __init__(self, message: str, *, shard: str, member: str | None = None) -> None:
        super().__init__(message)
        self.shard = shard
        self.member = member

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_shard_error, (str(self), self.shard, self.member), self.__dict__)


def _rebuild_shard_error(message: str, shard: str, member: str | None) -> ShardError:
    return ShardError(message, shard=shard, member=member)


def is_shard_spec(source: str | os.PathLike[str]) -> bool:
    """Whether a path, URL, brace pattern or glob names tar shards, by its suffix.

    A URL's query (a signed URL's ``?X-Amz-Signature=...``) and fragment are not its suffix.
    """
    text = os.fsdecode(source)  # a path object may give bytes, as a POSIX path can be
    if is_url(text):
        text = text.split("#", 1)[0].split("?", 1)[0]
    return text.lower().endswith(SHARD_SUFFIXES)


def expand_braces(pattern: str) -> list[str]:
    """Expands brace patterns as WebDataset (and bash) do.

    ``{000..127}`` is a numeric range, zero-padded to the wider end when either end has a leading
    zero (and descending when the first end is larger), ``{0..126..2}`` every second number of it,
    ``{a..e}`` a range of letters (a step too); ``{a,b}`` lists alternatives, and braces around
    anything else (``{x}``) stay as they are. Groups may be nested and repeated: the result is their
    product, leftmost group outermost.

    Raises:
        ValueError: If the braces do not balance.
    """
    start = pattern.find("{")
    if start < 0:
        if "}" in pattern:
            raise ValueError(f"unbalanced '}}' in shard pattern {pattern!r}")
        return [pattern]
    depth, end = 0, start
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    if depth:
        raise ValueError(f"unbalanced '{{' in shard pattern {pattern!r}")
    head, body, tails = pattern[:start], pattern[start + 1 : end], expand_braces(pattern[end + 1 :])
    numeric, letters = _RANGE.match(body), _LETTERS.match(body)
    if numeric:
        first, last, by = numeric.groups()
        padded = any(len(x.lstrip("-")) > 1 and x.lstrip("-").startswith("0") for x in (first, last))
        width = max(len(first), len(last)) if padded else 0
        choices = [f"{n:0{width}d}" for n in _steps(int(first), int(last), by)]
    elif letters:
        first, last, by = letters.groups()
        choices = [chr(n) for n in _steps(ord(first), ord(last), by)]
    else:
        parts = _split_top_level(body)
        choices = [expanded for part in parts for expanded in expand_braces(part)]
        if len(parts) == 1:  # no comma and no range: bash keeps the braces
            choices = ["{" + choice + "}" for choice in choices]
    return [head + choice + tail for choice in choices for tail in tails]


def _steps(first: int, last: int, by: str | None) -> range:
    """``first`` to ``last``, both included, every ``|by|``-th (bash ignores the step's sign; 0 is 1)."""
    step = abs(int(by or 1)) or 1
    return range(first, last + 1, step) if last >= first else range(first, last - 1, -step)


def _split_top_level(body: str) -> list[str]:
    """Splits ``a,{b,c},d`` at the commas outside nested braces."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for char in body:
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        depth += {"{": 1, "}": -1}.get(char, 0)
        current.append(char)
    parts.append("".join(current))
    return parts


class TarMember(Deferred):
    """One image member of a shard: where its bytes are; :meth:`read` is one positioned read.

    Attributes:
        shard: The shard's path or URL.
        name: The member's name in the tar.
        offset: Where its data starts in the shard.
        size: Its size in bytes.
    """

    __slots__ = ("_path", "_storage", "name", "offset", "shard", "size")

    def __init__(self, shard: _Shard, name: str, offset: int, size: int) -> None:
        self.shard = shard.url
        self._path = shard.path
        self._storage = shard.storage
        self.name = name
        self.offset = offset
        self.size = size

    @property
    def origin(self) -> str:
        return f"{self.shard}:{self.name}"

    def read(self) -> bytes:
        """The member's bytes.

        Raises:
            ShardError: If the shard ends before the member does (a truncated shard), or the storage
                returned more than the range asked for.
        """
        return self._checked(self._storage.read(self._path, self.offset, self.size))

    def _checked(self, data: bytes) -> bytes:
        """``data``, checked to be the member's size: else raises the :class:`ShardError` that says why."""
        if len(data) > self.size:  # fsspec's HTTP returns the whole file from a server that ignores Range
            raise ShardError(
                f"{self.origin}: asked for bytes {self.offset}-{self.offset + self.size}, got "
                f"{len(data)} bytes: the storage ignores range requests (an HTTP server must support Range)",
                shard=self.shard,
                member=self.name,
            )
        if len(data) < self.size:
            raise ShardError(
                f"{self.origin}: the shard is truncated: the member needs bytes {self.offset}-"
                f"{self.offset + self.size}, {len(data)} of its {self.size} bytes are there",
                shard=self.shard,
                member=self.name,
            )
        return data

    def __repr__(self) -> str:
        return f"TarMember({self.origin!r}, offset={self.offset}, size={self.size})"


def read_members(members: Sequence[TarMember], *, per_call: int) -> list[bytes | Exception | None]:
    """Reads members together: on local storage ``per_call`` to a call into C, remote ones at once.

    Remote: on storage that reads concurrently (HTTP, S3, GCS), each storage's members in one wait.
    A training loop beside the readers then meets one hand-off of the GIL per call, where each local
    member's ``os.pread`` makes one; a remote batch costs about one round trip, not one a member.
    Stops between calls when the reader thread is cancelled.

    Returns:
        Per member, in order: its bytes, the exception its :meth:`TarMember.read` would have raised, or
        ``None`` where it is to be read with :meth:`TarMember.read` (without the C, or through an fsspec
        file system that reads one request at a time).
    """
    results: list[bytes | Exception | None] = [None] * len(members)
    storages: dict[int, tuple[LocalStorage | FsspecStorage, list[int]]] = {}
    for position, member in enumerate(members):
        storage = member._storage
        if isinstance(storage, FsspecStorage) or (
            isinstance(storage, LocalStorage) and _filereads.available()
        ):
            storages.setdefault(id(storage), (storage, []))[1].append(position)
    for storage, positions in storages.values():
        step = per_call if isinstance(storage, LocalStorage) else len(positions)
        for first in range(0, len(positions), step):
            check_cancelled()  # between calls: on slow storage a call's reads take a while
            chunk = positions[first : first + step]
            reads = storage.read_many(
                [(members[at]._path, members[at].offset, members[at].size) for at in chunk]
            )
            for position, data in zip(chunk, reads or [None] * len(chunk), strict=True):
                try:
                    if isinstance(data, bytes):
                        data = members[position]._checked(data)
                except ShardError as exc:
                    data = exc
                results[position] = data
    return results


@dataclass
class _Shard:
    """The index of one shard: its samples (keys) in order of first appearance."""

    url: str
    path: str
    storage: Storage
    keys: list[str] = field(default_factory=list)
    images: list[tuple[str, int, int] | None] = field(default_factory=list)  # (name, offset, size)
    targets: list[bytes | None] = field(default_factory=list)  # the target member's bytes
    problems: dict[int, str] = field(default_factory=dict)  # sample -> why it cannot be read
    # A sample without an image member: the extensions it has, for its error.
    others: dict[int, tuple[str, ...]] = field(default_factory=dict)
    damage: list[str] = field(default_factory=list)


class TarShards:
    """Tar shards in the WebDataset layout, as a map-style source of ``(member, target)``.

    Every shard is indexed when this is built (its headers walked once with :mod:`tarfile`, its
    target members read), so the length is exact, shuffling is over the whole set, and a sample is
    one positioned read from any thread. ``ThreadLoader("shards/{000000..000127}.tar")`` builds one
    with the defaults.

    A sample is every key in a shard (members ``key.ext`` share the key: the name up to the first
    dot of its base name). Keys are numbered shard by shard, in order of first appearance.

    Errors: a shard that cannot be indexed at all (missing, unreadable, not a tar, compressed)
    raises :class:`ShardError` here, naming it. Problems of single samples are raised when the sample
    is fetched, so the loader reports them as that sample's :class:`SampleError` (or skips and counts
    them with ``on_error="skip"``): a key with no image member, or no target member when one is
    required; a target that does not parse; a member cut off by a truncated shard. A damaged header
    in the middle of a shard is skipped over (the members after it are still indexed), logged, and
    listed in :attr:`damaged`; the member it described is lost, so its key may miss a member.

    Args:
        shards: A path or URL, a brace pattern (``"shards/{000000..000127}.tar"``, expanded as
            WebDataset does), a glob of local paths (``"shards/*.tar"``: the matching files, sorted by
            name), or a sequence of them. URLs are read through fsspec
            (``pip install 'fsspec[http]'``, the ``remote`` extra).
        image: Extension(s) of the image member, first match wins: ``"jpg"``, ``("jpg", "png")``
            or ``"jpg;png"``. Default: every extension :class:`ImageFolder` reads.
        target: ``"cls"`` (an integer in text), ``"txt"`` (a UTF-8 string), ``"json"`` (the parsed
            JSON, or its ``target_key`` item), ``None`` (no target: items are the members alone),
            or ``"auto"``: ``"cls"`` when any shard has a ``.cls`` member, else ``None``.
        target_key: With ``target="json"``, the key of the JSON object to use as the target.
        storage_options: Passed to fsspec for URL shards (credentials, endpoints).
        index_threads: Threads that index shards at once (reading remote shards is I/O bound).

    Attributes:
        shards: The shard paths or URLs, expanded, in order.
        target: The resolved target kind (``"auto"`` resolved), or ``None``.
        damaged: Damaged spots found while indexing: ``"shard: what"``, one per spot.
        index_seconds: Wall time the indexing took.
    """

    def __init__(
        self,
        shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        *,
        image: str | Sequence[str] | None = None,
        target: Target | None = "auto",
        target_key: str | None = None,
        storage_options: dict[str, Any] | None = None,
        index_threads: int = 16,
    ) -> None:
        check_count("index_threads", index_threads, optional=False)
        if target not in (*_TARGETS, None):
            raise ValueError(f"target must be one of {_TARGETS} or None, got {target!r}")
        if target_key is not None and target != "json":
            raise ValueError(
                f"target_key picks an item of a .json target; it needs target='json', got {target!r}"
            )
        self.shards = _expand(shards)
        self._images = _extensions(image)
        started = time.perf_counter()
        wanted = "cls" if target == "auto" else target
        local = LocalStorage()  # the shards' open files: this source's, closed when it goes away
        with ThreadPoolExecutor(max_workers=max(1, min(index_threads, len(self.shards)))) as pool:
            self._index = list(
                pool.map(
                    lambda url: _index_shard(url, storage_options, self._images, wanted, local), self.shards
                )
            )
        self.index_seconds = time.perf_counter() - started
        if target == "auto":
            # A .cls member counts though it cannot be read (truncated): its sample's error says why.
            has_cls = any(s.problems or any(t is not None for t in s.targets) for s in self._index)
            target = "cls" if has_cls else None
        self.target: str | None = target
        self.target_key = target_key
        self._starts = [0]
        for shard in self._index:
            self._starts.append(self._starts[-1] + len(shard.keys))
        if not len(self):
            raise ShardError(
                f"no samples in {len(self.shards)} shard(s), the first {self.shards[0]!r}",
                shard=self.shards[0],
            )
        self.damaged = [f"{shard.url}: {note}" for shard in self._index for note in shard.damage]
        for note in self.damaged:
            logger.warning("threadloader: damaged tar shard: %s", note)

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, index: int) -> TarMember | tuple[TarMember, Any]:
        """The image member of sample ``index``, with its target unless ``target`` is ``None``.

        Raises:
            IndexError: If ``index`` is out of range.
            ShardError: If the sample has no image member, no target member when one is required,
                or a target that does not parse.
        """
        if not 0 <= index < self._starts[-1]:
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        number = bisect.bisect_right(self._starts, index) - 1
        shard, position = self._index[number], index - self._starts[number]
        key = shard.keys[position]
        if self.target is not None and position in shard.problems:
            raise ShardError(
                f"{shard.url}: {shard.problems[position]}", shard=shard.url, member=f"{key}.{self.target}"
            )
        image = shard.images[position]
        if image is None:
            raise ShardError(
                f"{shard.url}: sample {key!r} has no image member ({', '.join(self._images)})"
                + _others_note(key, shard.others.get(position, ()))
                + _damage_note(shard),
                shard=shard.url,
                member=key,
            )
        member = TarMember(shard, *image)
        if self.target is None:
            return member
        raw = shard.targets[position]
        if raw is None:
            name = f"{key}.{self.target}"
            raise ShardError(
                f"{shard.url}: sample {key!r} has no target member {name!r} (target={self.target!r}; "
                "target=None loads images without targets)" + _damage_note(shard),
                shard=shard.url,
                member=name,
            )
        try:
            return member, self._parse(raw)
        except (ValueError, KeyError, TypeError) as exc:
            name = f"{key}.{self.target}"
            raise ShardError(
                f"{shard.url}:{name}: target does not parse: {type(exc).__name__}: {exc}",
                shard=shard.url,
                member=name,
            ) from exc

    def _parse(self, raw: bytes) -> Any:
        if self.target == "cls":
            return int(raw.decode("ascii").strip())
        if self.target == "txt":
            return raw.decode("utf-8")
        value = json.loads(raw)
        if self.target_key is None:
            return value
        if not isinstance(value, dict):
            raise TypeError(f"target_key={self.target_key!r} needs a JSON object, got {type(value).__name__}")
        return value[self.target_key]

    def __repr__(self) -> str:
        return (
            f"TarShards({len(self.shards)} shards, samples={len(self)}, target={self.target!r}, "
            f"first={self.shards[0]!r})"
        )


def _damage_note(shard: _Shard) -> str:
    """Why a member may be missing: the damage found in its shard, if any."""
    return f"; the shard is damaged: {'; '.join(shard.damage)}" if shard.damage else ""


def _expand(shards: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    specs = [shards] if isinstance(shards, (str, os.PathLike)) else list(shards)
    if not specs:
        raise ValueError("no shards given: pass a path, a brace pattern or a list of shard paths")
    if not all(isinstance(spec, (str, os.PathLike)) for spec in specs):
        kinds = sorted({type(spec).__name__ for spec in specs})
        raise TypeError(f"shards must be paths or URLs (str or os.PathLike), got {', '.join(kinds)}")
    return [url for spec in specs for pattern in expand_braces(os.fspath(spec)) for url in _matching(pattern)]


def _matching(pattern: str) -> list[str]:
    """A local glob's shards, sorted by name; any other path or URL alone, as it is.

    URLs are not globbed: HTTP cannot list, and a ``?`` or ``[`` is part of many URLs (a query, an IPv6
    host). A ``*`` in one is refused with the brace syntax that names the shards instead.

    Raises:
        ShardError: If a local glob matches no file, or a URL holds a ``*``.
    """
    brace = "name the shards with a brace range instead: 'shards/{000000..000127}.tar'"
    if is_url(pattern):
        if "*" in pattern:
            raise ShardError(f"{pattern}: URLs are not globbed; {brace}", shard=pattern)
        return [pattern]
    if not _GLOB.search(pattern) or os.path.exists(pattern):
        return [pattern]
    matches = sorted(glob.glob(pattern))
    if not matches:
        where = f"from {os.getcwd()!r}"
        raise ShardError(f"{pattern}: no file matches this glob ({where}); {brace}", shard=pattern)
    return matches


def _others_note(key: str, extensions: Sequence[str]) -> str:
    """What the sample has instead, and why a dotted name such as ``key.b.jpg`` is not its image.

    The key is the name up to the first dot of the file's name, as WebDataset splits it, so a member
    ``a.b.jpg`` is sample ``a``'s extension ``b.jpg``: the error named none of the members it found.
    """
    if not extensions:
        return ""
    members = ", ".join(f"{key}.{ext}" for ext in extensions)
    dotted = [ext for ext in extensions if "." in ext]
    note = f"; its members: {members}"
    if dotted:
        note += (
            f" (the key is the name up to its first dot: {key}.{dotted[0]} is extension {dotted[0]!r}; "
            "rename it without the inner dot, or pass image= that extension)"
        )
    return note


def _extensions(image: str | Sequence[str] | None) -> tuple[str, ...]:
    if image is None:
        return tuple(ext.lstrip(".") for ext in IMAGE_EXTENSIONS)
    names = image.split(";") if isinstance(image, str) else None
    if names is None and isinstance(image, Iterable):
        names = list(image)
    if names is None or not all(isinstance(name, str) for name in names):
        raise TypeError(
            f"image must be an extension or a list of them ('jpg', ['jpg', 'png']), got {image!r}"
        )
    extensions = tuple(name.strip().lstrip(".").lower() for name in names if name.strip())
    if not extensions:
        raise ValueError(f"image must name at least one extension, got {image!r}")
    return extensions


def _split_name(name: str) -> tuple[str, str] | None:
    """``dir/key.ext.more`` -> (``dir/key``, ``ext.more``) as WebDataset splits it; None without a dot."""
    directory, _, base = name.rpartition("/")
    key, dot, extension = base.partition(".")
    if not dot or not key:
        return None
    return (f"{directory}/{key}" if directory else key), extension.lower()


def _compression(head: bytes) -> str | None:
    """The compression a shard's first block says it has; ``None`` for a tar's header, whatever its name.

    A plain tar starts with its first member's name, which may start as a compressed format's magic
    bytes do (a member named ``BZh91_0001.jpg``): a header whose checksum holds is a tar's.
    """
    try:
        tarfile.TarInfo.frombuf(head, "utf-8", "surrogateescape")
        return None
    except tarfile.HeaderError:
        pass
    return next((kind for magic, kind in _COMPRESSED.items() if magic.match(head)), None)


def _index_shard(
    url: str,
    storage_options: dict[str, Any] | None,
    images: tuple[str, ...],
    target: str | None,
    local: LocalStorage,
) -> _Shard:
    if is_url(url):
        _, path = filesystem(url, storage_options)
        shard = _Shard(url, path, FsspecStorage(url, storage_options))
    else:
        shard = _Shard(url, url, local)
    try:
        size = shard.storage.size(shard.path)
        if not size:
            raise ShardError(f"{url}: the shard is empty (0 bytes)", shard=url)
        with shard.storage.open(shard.path) as f:
            kind = _compression(f.read(tarfile.BLOCKSIZE))
            if kind is not None:
                raise ShardError(
                    f"{url}: a {kind}-compressed tar cannot be read by position; store shards as plain "
                    "(uncompressed) tar files: JPEG members gain nothing from compression",
                    shard=url,
                )
            f.seek(0)
            members, targets = _walk(f, shard, size, target)
    except ShardError:
        raise
    except Exception as exc:  # OSError, tarfile.ReadError, and whatever an fsspec back end raises
        if _ran_out_of_time(exc):
            raise ShardError(f"cannot index the shard: {timed_out(url)}", shard=url) from exc
        raise ShardError(f"{url}: cannot index the shard: {type(exc).__name__}: {exc}", shard=url) from exc
    if not members:
        raise ShardError(
            f"{url}: no files in it: an empty tar archive or one of folders only, not a tar archive, "
            "or damaged from its first header",
            shard=url,
        )
    _group(shard, members, targets, images, target)
    return shard


def _ran_out_of_time(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from, is a back end's time limit running out.

    fsspec's HTTP size lookup turns a request that timed out into ``FileNotFoundError``, and its
    timeout (aiohttp's) has no message: named as they are, neither says what ran out.
    """
    return any(isinstance(cause, asyncio.TimeoutError) for cause in chained(exc))


class _Walk(tarfile.TarFile):
    """tarfile stepping over a damaged header block by block, the first header (its constructor's) too.

    ``ignore_zeros`` makes tarfile step over a damaged header itself instead of stopping there (which
    would silently drop the rest of the shard), except a damaged header after a long name's (GNU or
    PAX), which it raises for: this steps over that one. A read error at the shard's end is the last
    member's data running past it (``cut`` says so), and ends the walk.
    """

    def __init__(self, f: IO[bytes], size: int) -> None:
        self.shard_size = size
        self.cut: str | None = None
        super().__init__(fileobj=f, mode="r", ignore_zeros=True)

    def next(self) -> tarfile.TarInfo | None:
        while True:
            try:
                return super().next()
            except tarfile.ReadError as exc:
                if self.offset >= self.shard_size:
                    self.cut = str(exc)
                    return None
                self.offset += tarfile.BLOCKSIZE


def _walk(
    f: IO[bytes], shard: _Shard, size: int, target: str | None
) -> tuple[list[tarfile.TarInfo], dict[int, bytes | str]]:
    """Reads every header, the target members' contents (as they go by), and checks the gaps.

    The gaps :class:`_Walk` stepped over are checked here: zero blocks are padding, pax global headers
    are headers, anything else is a damaged header, recorded in ``shard.damage``. So is a shard without
    its end-of-archive blocks, which tar writers always write: a shard cut between two members looks
    whole to tarfile. A sparse member's bytes are not stored in one run: it is left out, and said so.
    A link (hard or symbolic) to a member stored before it is that member's bytes under its own name,
    as GNU tar stores a second copy of a file; a link named as no sample, or to a folder, is no member;
    any other link is left out, and said so.

    Returns:
        The regular-file members, and per target member (by its data's offset: names repeat) its bytes or
        why it cannot be read.
    """
    members: list[tarfile.TarInfo] = []
    regular: dict[str, tarfile.TarInfo] = {}
    folders: set[str] = set()
    targets: dict[int, bytes | str] = {}
    gaps: list[tuple[int, int]] = []
    expected = 0  # where the next header should start
    with _Walk(f, size) as archive:
        while (member := archive.next()) is not None:
            if member.offset > expected:
                gaps.append((expected, member.offset))
            expected = archive.offset  # past its data, as tarfile found it (a sparse member's is shorter)
            if member.isdir():
                folders.add(posixpath.normpath(member.name))
            if member.issym() or member.islnk():
                linked = _linked(member, regular)
                if linked is None:
                    if _split_name(member.name) is None or _target(member) in folders:
                        continue  # no sample's name, or a link to a folder (latest -> train): no sample
                    shard.damage.append(
                        f"member {member.name!r} is a link to {member.linkname!r}, which the shard does not "
                        "hold before it: left out"
                    )
                    continue
                member = linked
            elif not member.isreg():
                continue
            if member.sparse is not None:
                shard.damage.append(
                    f"member {member.name!r} is stored sparse (tar --sparse), its bytes not in one run: "
                    "left out; write shards without --sparse"
                )
                continue
            members.append(member)
            regular[posixpath.normpath(member.name)] = member
            parts = _split_name(member.name)
            if target is not None and parts is not None and parts[1] == target:
                targets[member.offset_data] = _read_target(archive, member, size)
    if archive.cut is not None and members and members[-1].offset_data + members[-1].size > size:
        shard.damage.append(f"truncated at byte {size} ({archive.cut})")
    elif archive.cut is not None or expected + tarfile.BLOCKSIZE > size:
        shard.damage.append(
            f"no end-of-archive blocks after byte {min(expected, size)}: the shard may be cut short there, "
            "its later members lost"
        )
    if expected < size:
        gaps.append((expected, size))
    for start, end in gaps:
        damaged = _damage_in(f, start, end)
        if damaged is not None:
            shard.damage.append(
                f"bytes {damaged}-{end} are not tar headers: a damaged or cut-off header, its member lost"
            )
    return members, targets


def _target(link: tarfile.TarInfo) -> str:
    """The member a link names, as a normalized path; a symbolic link's is relative to its folder.

    './a.jpg' (from tar -cf x.tar .) is 'a.jpg', as the keys are.
    """
    name = link.linkname
    if link.issym():
        name = posixpath.join(posixpath.dirname(link.name), name)
    return posixpath.normpath(name)


def _linked(link: tarfile.TarInfo, regular: dict[str, tarfile.TarInfo]) -> tarfile.TarInfo | None:
    """A link as the regular member it names, under the link's own name; ``None`` if none came before."""
    found = regular.get(_target(link))
    if found is None:
        return None
    member = copy.copy(found)
    member.name = link.name
    return member


def _damage_in(f: IO[bytes], start: int, end: int) -> int | None:
    """Where a gap between members holds what is neither zero padding nor a pax global header; ``None``.

    Both may come in any order: two archives concatenated leave the first one's end-of-archive blocks,
    then the second one's global header (``git archive`` writes one first), which tarfile reads as no
    member. Zeros are read a MiB at a time.
    """
    while start < end:
        f.seek(start)
        chunk = f.read(min(1 << 20, end - start))
        if not chunk:
            return None
        zeros = len(chunk) - len(chunk.lstrip(b"\0"))
        if zeros == len(chunk) or zeros >= tarfile.BLOCKSIZE:
            start += zeros if zeros == len(chunk) else zeros - zeros % tarfile.BLOCKSIZE
            continue
        try:
            header = tarfile.TarInfo.frombuf(chunk[: tarfile.BLOCKSIZE], "utf-8", "surrogateescape")
        except tarfile.HeaderError:
            return start
        if header.type != tarfile.XGLTYPE:
            return start
        start += tarfile.BLOCKSIZE + _blocks(header.size)
    return None


def _blocks(size: int) -> int:
    """Bytes that ``size`` bytes of member data take in a tar: whole 512-byte blocks."""
    return -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE


def _read_target(archive: tarfile.TarFile, member: tarfile.TarInfo, size: int) -> bytes | str:
    if member.offset_data + member.size > size:
        return f"target member {member.name!r} is truncated (the shard ends at byte {size})"
    extracted = archive.extractfile(member)
    assert extracted is not None  # a regular file always has contents
    return extracted.read()


def _group(
    shard: _Shard,
    members: list[tarfile.TarInfo],
    targets: dict[int, bytes | str],
    images: tuple[str, ...],
    target: str | None,
) -> None:
    """Groups members by key into samples: each key's image (first extension in ``images``) and target.

    A key's member with an extension its sample has already starts another sample of that key: two
    archives concatenated, each numbered from 0, are both archives' samples.
    """
    samples: list[tuple[str, dict[str, tarfile.TarInfo]]] = []
    latest: dict[str, dict[str, tarfile.TarInfo]] = {}  # per key, the members of its latest sample
    for member in members:
        parts = _split_name(member.name)
        if parts is None:
            continue
        key, ext = parts
        found = latest.get(key)
        if found is None or ext in found:
            found = latest[key] = {}
            samples.append((key, found))
        found[ext] = member
    for key, found in samples:
        position = len(shard.keys)
        shard.keys.append(key)
        image = next((found[ext] for ext in images if ext in found), None)
        shard.images.append(None if image is None else (image.name, image.offset_data, image.size))
        if image is None:
            shard.others[position] = tuple(found)
        raw = targets.get(found[target].offset_data) if target is not None and target in found else None
        if isinstance(raw, str):
            shard.problems[position] = raw
            raw = None
        shard.targets.append(raw)
