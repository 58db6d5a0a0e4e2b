"""What a reader makes of each kind of item, subclasses included, and reading files whose stated size is
not their length. Pixels are checked against Pillow's decode of the same bytes."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from threadloader import SampleError, ThreadLoader
from threadloader._sources import Deferred, read_batch

from .conftest import encode, photo, pil_reference

H, W = 12, 20


class PathStr(str):
    pass


class PosixSubpath(type(pathlib.Path())):  # type: ignore[misc]
    pass


class Blob(bytes):
    pass


class InMemory(Deferred):
    """A user's own Deferred: bytes kept elsewhere, read on demand."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    @property
    def origin(self) -> str:
        return "in-memory"

    def read(self) -> bytes:
        return self.data


class Pair(Sequence[Any]):
    """A sequence that is neither a tuple nor a list (registered with Sequence by inheritance)."""

    def __init__(self, *items: Any) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: Any) -> Any:
        return self.items[index]


def test_every_kind_of_item_and_its_subclasses(tmp_path: Path) -> None:
    blobs = [encode(photo(H, W, seed=900 + i), quality=90) for i in range(9)]
    for i, data in enumerate(blobs):
        (tmp_path / f"{i}.jpg").write_bytes(data)
    path = [str(tmp_path / f"{i}.jpg") for i in range(9)]
    items: list[Any] = [
        path[0],
        PathStr(path[1]),
        Path(path[2]),
        PosixSubpath(path[3]),
        Blob(blobs[4]),
        (bytearray(blobs[5]), 5),
        [memoryview(blobs[6]), 6],
        Pair(InMemory(blobs[7]), 7),
        (PathStr(Path(path[8]).as_uri()), 8) if _has_fsspec() else (path[8], 8),
    ]
    ((images, targets),) = list(ThreadLoader(items, batch_size=9))  # one batch
    assert targets == [None, None, None, None, None, 5, 6, 7, 8]
    for image, data in zip(images, blobs, strict=True):
        np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pil_reference(data))


@pytest.mark.parametrize("item", [Pair(b"x", 0, 1), Pair(3, 0), 3.5, (b"x",)])
def test_items_that_are_not_encoded_data_are_fetch_errors(item: Any) -> None:
    with pytest.raises(SampleError) as info:
        list(ThreadLoader([item], batch_size=1))
    assert (info.value.index, info.value.stage, info.value.origin) == (0, "fetch", "list[0]")
    assert "expected a path, encoded bytes, or a (path | bytes, target) pair" in info.value.reason


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="needs a file with a stated size of 0")
def test_a_file_is_read_to_its_end_whatever_size_it_states() -> None:
    assert os.stat("/proc/version").st_size == 0
    expected = Path("/proc/version").read_bytes()
    assert expected
    assert read_batch([(0, "/proc/version", None)]) == [expected]


def test_files_of_every_size_are_read_whole(tmp_path: Path) -> None:
    payloads = [b"", b"x", os.urandom(4096), os.urandom((1 << 20) + 3)]
    for i, data in enumerate(payloads):
        (tmp_path / f"{i}.bin").write_bytes(data)
    assert read_batch([(i, str(tmp_path / f"{i}.bin"), None) for i in range(len(payloads))]) == payloads


def _has_fsspec() -> bool:
    try:
        import fsspec  # type: ignore[import-untyped]  # noqa: F401
    except ImportError:
        return False
    return True


class _Store(Deferred):
    """A user's Deferred whose read fails one way or another."""

    def __init__(self, read: Any) -> None:
        self._read = read

    @property
    def origin(self) -> str:
        return "store:key"

    def read(self) -> bytes:
        return self._read()


def _missing_module() -> bytes:
    import not_a_module_of_this_test  # type: ignore[import-not-found]  # noqa: F401

    return b""


@pytest.mark.parametrize(
    ("read", "reason"),
    [
        (_missing_module, "ModuleNotFoundError: No module named 'not_a_module_of_this_test'"),
        (lambda: None, "_Store.read() returned NoneType, not bytes"),
    ],
)
def test_what_a_deferreds_read_raises_or_returns_wrong_is_its_samples_read_error(
    read: Any, reason: str
) -> None:
    """An ImportError ended the pass (only fsspec's, for URLs, should), and a read that returned None
    failed in the decoder ("object of type 'NoneType' has no len()")."""
    good = encode(photo(H, W), "PNG")
    with pytest.raises(SampleError) as info:
        list(ThreadLoader([InMemory(good), _Store(read)], batch_size=2, device="cpu"))
    assert (info.value.index, info.value.stage, info.value.origin) == (1, "read", "store:key")
    assert reason in info.value.reason
    skipping = ThreadLoader([InMemory(good), _Store(read)], batch_size=2, device="cpu", on_error="skip")
    ((images, _),) = list(skipping)
    assert len(images) == 1


def test_a_memoryviews_size_is_its_bytes() -> None:
    """len() of a memoryview of 4-byte items counted items: "<10 bytes in memory>" for 40 bytes."""
    import array

    data = memoryview(array.array("I", range(10)))
    with pytest.raises(SampleError) as info:
        list(ThreadLoader([data], batch_size=1, device="cpu"))
    assert info.value.origin == "<40 bytes in memory>"
    assert "(40 bytes starting" in info.value.reason
