"""A batch's files read at once in C (``threadloader/_reads.c``): the same bytes and the same errors as
Python's reads (checked against ``Path.read_bytes`` and the error Python's ``open`` raises), every
descriptor closed, and Python's own reads where the library was not built; a batch's tar members too
(against what ``tarfile`` extracts, and ``os.pread``'s bytes and errors)."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from threadloader import SampleError, TarMember, TarShards, _filereads, _sources
from threadloader._cancel import Cancelled, bind_cancel
from threadloader._sources import read_batch

from .conftest import write_files

pytestmark = pytest.mark.skipif(not _filereads.available(), reason="the C library (_reads.c) was not built")


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def files(tmp_path: Path) -> list[str]:
    return write_files(tmp_path, [os.urandom(size) for size in (5_000, 0, 1, 70_000, 4096, 123)])


def test_a_batchs_files_are_read_in_c_whole(files: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's read is not called for regular files: the C reads give every byte of each, each file a
    ``bytes`` of its own (no buffer shared with the others, which one kept image would keep alive)."""

    def refuse(index: int, path: str) -> bytes:
        raise AssertionError(f"read {path} in Python")

    monkeypatch.setattr(_sources, "_read_file", refuse)
    blobs = read_batch([(i, path, None) for i, path in enumerate(files)])
    assert blobs == [Path(path).read_bytes() for path in files]
    assert all(type(blob) is bytes for blob in blobs)


def test_without_the_library_python_reads_them(files: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_filereads, "_loaded", [None])
    assert not _filereads.available()
    blobs = read_batch([(i, path, None) for i, path in enumerate(files)])
    assert blobs == [Path(path).read_bytes() for path in files]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_what_cannot_be_read_fails_its_sample_alone_and_closes_every_descriptor(
    files: list[str], tmp_path: Path
) -> None:
    fifo = str(tmp_path / "pipe.jpg")
    os.mkfifo(fifo)
    missing = str(tmp_path / "gone.jpg")
    batch = [files[0], missing, str(tmp_path), fifo, "bad\0name.jpg", files[3]]
    before = _open_descriptors()
    result: list[Any] = []
    reader = threading.Thread(
        target=lambda: result.extend(read_batch([(i, p, None) for i, p in enumerate(batch)]))
    )
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO with no writer blocked"
    assert _open_descriptors() == before
    good, gone, directory, pipe, nul, last = result
    assert bytes(good) == Path(files[0]).read_bytes()
    assert bytes(last) == Path(files[3]).read_bytes()
    with pytest.raises(FileNotFoundError) as python:
        open(missing, "rb")  # noqa: SIM115
    errors = {"gone": gone, "directory": directory, "pipe": pipe, "nul": nul}
    assert all(isinstance(error, _sources.SampleError) for error in errors.values()), errors
    assert gone.reason == f"FileNotFoundError: {python.value}"
    assert (gone.index, gone.stage, gone.origin) == (1, "read", missing)
    assert directory.reason.startswith("not a regular file (a directory)")
    assert pipe.reason.startswith("not a regular file (a FIFO")
    with pytest.raises(ValueError) as python_nul:
        os.open("bad\0name.jpg", os.O_RDONLY)
    assert nul.reason == f"ValueError: {python_nul.value}"


@pytest.mark.skipif(not os.path.exists("/proc/self/cmdline"), reason="needs a file that states a size of 0")
def test_a_file_that_states_a_smaller_size_is_read_to_its_end(files: list[str]) -> None:
    """A virtual file (size 0, content) or one that grew: the C read fills its stated size and one more
    byte, so it is read again in Python, whole."""
    assert os.stat("/proc/self/cmdline").st_size == 0
    blobs = read_batch([(0, files[0], None), (1, "/proc/self/cmdline", None)])
    assert bytes(blobs[1]) == Path("/proc/self/cmdline").read_bytes() != b""  # type: ignore[arg-type]
    assert bytes(blobs[0]) == Path(files[0]).read_bytes()  # type: ignore[arg-type]


def test_a_stop_is_seen_between_calls_into_c(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On slow storage one call's files take a while: a batch is read in calls of a few files each,
    and a reader told to stop stops before the next call, not at the end of the batch."""
    paths = write_files(tmp_path, [b"x"] * 40)
    stop = threading.Event()
    calls = []
    read_files = _filereads.read_files

    def first_then_stop(chunk: list[str], flags: int) -> list[Any]:
        calls.append(len(chunk))
        stop.set()  # the loader's close, while this call reads
        return read_files(chunk, flags)

    monkeypatch.setattr(_filereads, "read_files", first_then_stop)
    result: list[BaseException] = []

    def reader() -> None:
        bind_cancel(stop)
        try:
            read_batch([(i, path, None) for i, path in enumerate(paths)])
        except BaseException as exc:  # Cancelled is a BaseException
            result.append(exc)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(10)
    assert len(result) == 1 and isinstance(result[0], Cancelled), result
    assert len(calls) == 1 and calls[0] < len(paths), calls


def _shard(tmp_path: Path, payloads: list[bytes]) -> Path:
    path = tmp_path / "000000.tar"
    with tarfile.open(path, "w") as archive:
        for key, payload in enumerate(payloads):
            info = tarfile.TarInfo(f"k{key}.jpg")
            info.size = len(payload)
            archive.addfile(info, io.BytesIO(payload))
    return path


def test_a_batchs_tar_members_are_read_in_c(
    tmp_path: Path, files: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local shard's members (40: three calls) come from C, not their own pread, beside files and bytes:
    each the bytes tarfile extracts."""
    path = _shard(tmp_path, [os.urandom(100 + 37 * i) for i in range(40)] + [b""])
    source = TarShards(path)
    members = [source[i] for i in range(41)]  # no target members: each item a TarMember

    def refuse(self: TarMember) -> bytes:
        raise AssertionError(f"read {self.origin} in Python")

    monkeypatch.setattr(TarMember, "read", refuse)
    batch = [(i, member, None) for i, member in enumerate(members)] + [
        (41, files[0], None),
        (42, b"raw", None),
    ]
    blobs = read_batch(batch)
    assert [blob for blob in blobs if isinstance(blob, SampleError)] == []
    with tarfile.open(path) as archive:
        expected = [archive.extractfile(f"k{i}.jpg").read() for i in range(41)]  # type: ignore[union-attr]
    assert [bytes(blob) for blob in blobs] == [*expected, Path(files[0]).read_bytes(), b"raw"]  # type: ignore[arg-type]


def test_read_ranges_reads_what_pread_reads(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    (tmp_path / "f").write_bytes(data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        ranges = [(fd, 0, 10), (fd, 9_990, 100), (fd, 20_000, 5), (fd, 123, 0), (fd, 4_000, 5_000)]
        got = _filereads.read_ranges(ranges)
        assert [bytes(view) for view in got] == [os.pread(fd, size, offset) for _, offset, size in ranges]  # type: ignore[arg-type]
        closed = os.open(tmp_path / "f", os.O_RDONLY)
        os.close(closed)
        with pytest.raises(OSError) as expected:
            os.pread(closed, 10, 0)
        [error, fine] = _filereads.read_ranges([(closed, 0, 10), (fd, 0, 3)])
        assert isinstance(error, OSError) and (error.errno, str(error)) == (
            expected.value.errno,
            str(expected.value),
        )
        assert bytes(fine) == data[:3]  # type: ignore[arg-type]
    finally:
        os.close(fd)
