"""URLs through fsspec: files and tar shards on memory://, file:// and a local HTTP server (127.0.0.1)."""

from __future__ import annotations

import functools
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from threadloader import SampleError, ShardError, TarShards, ThreadLoader

from .conftest import distinct_jpegs, encode, photo, pil_reference, run_script, wait_for_no_reader_threads
from .test_tar import member_offset, sample, write_shard

fsspec = pytest.importorskip("fsspec", reason="remote sources need fsspec: pip install -e '.[remote]'")

N = 8


@pytest.fixture(scope="module")
def blobs() -> list[bytes]:
    return distinct_jpegs(N, 16, 24, first_seed=500)


@pytest.fixture
def memory() -> Iterator[str]:
    """A fresh folder of fsspec's in-memory file system (process-wide), removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/threadloader-test-{uuid.uuid4().hex}"
    yield root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def check(loader: ThreadLoader, blobs: list[bytes], expected: list[int]) -> None:
    seen = []
    for images, targets in loader:
        for image, target in zip(images, targets.tolist(), strict=True):
            np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), pil_reference(blobs[target]))
            seen.append(target)
    assert seen == expected


# ---------------------------------------------------------------------------------------- files by URL


def test_memory_urls_with_targets(memory: str, blobs: list[bytes]) -> None:
    fs = fsspec.filesystem("memory")
    urls = []
    for i, data in enumerate(blobs):
        fs.pipe(f"{memory}/img{i}.jpg", data)
        urls.append((f"memory://{memory}/img{i}.jpg", i))
    check(ThreadLoader(urls, batch_size=3, num_threads=3), blobs, list(range(N)))


def test_file_urls(tmp_path: Path, blobs: list[bytes]) -> None:
    urls = []
    for i, data in enumerate(blobs):
        (tmp_path / f"{i}.jpg").write_bytes(data)
        urls.append(((tmp_path / f"{i}.jpg").as_uri(), i))
    check(ThreadLoader(urls, batch_size=4, num_threads=2), blobs, list(range(N)))


def test_dataset_returning_urls(memory: str, blobs: list[bytes]) -> None:
    fs = fsspec.filesystem("memory")
    for i, data in enumerate(blobs):
        fs.pipe(f"{memory}/{i}.jpg", data)

    class Remote:
        def __len__(self) -> int:
            return N

        def __getitem__(self, index: int) -> tuple[str, int]:
            return f"memory://{memory}/{index}.jpg", index

    check(ThreadLoader(Remote(), batch_size=8), blobs, list(range(N)))


def test_unreadable_url_is_a_sample_error_naming_it(memory: str, blobs: list[bytes]) -> None:
    fs = fsspec.filesystem("memory")
    urls = []
    for i in range(4):
        fs.pipe(f"{memory}/{i}.jpg", blobs[i])
        urls.append((f"memory://{memory}/{i}.jpg", i))
    urls[2] = (f"memory://{memory}/missing.jpg", 2)
    with pytest.raises(SampleError) as info:
        list(ThreadLoader(urls, batch_size=1))
    error = info.value
    assert (error.index, error.stage, error.origin) == (2, "read", f"memory://{memory}/missing.jpg")
    assert isinstance(error.__cause__, FileNotFoundError)
    skipping = ThreadLoader(urls, batch_size=4, on_error="skip")
    check(skipping, blobs, [0, 1, 3])
    assert skipping.stats().skipped == 1


# ------------------------------------------------------------------------------------------ shards by URL


def write_memory_shards(memory: str, tmp_path: Path, blobs: list[bytes], shards: int = 2) -> str:
    fs = fsspec.filesystem("memory")
    per = N // shards
    for s in range(shards):
        local = write_shard(tmp_path / f"{s:06d}.tar", [sample(blobs, s * per + k) for k in range(per)])
        fs.pipe(f"{memory}/{s:06d}.tar", local.read_bytes())
    return f"memory://{memory}/{{000000..{shards - 1:06d}}}.tar"


def test_memory_shards(memory: str, tmp_path: Path, blobs: list[bytes]) -> None:
    spec = write_memory_shards(memory, tmp_path, blobs)
    loader = ThreadLoader(spec, batch_size=3, num_threads=3)
    assert isinstance(loader.source, TarShards) and loader.source.shards[1] == f"memory://{memory}/000001.tar"
    check(loader, blobs, list(range(N)))
    member, target = loader.source[5]
    assert member.origin == f"memory://{memory}/000001.tar:s0005.jpg" and target == 5
    shuffled = [ThreadLoader(spec, batch_size=3, shuffle=True, seed=3, num_threads=t) for t in (1, 4)]
    orders = [[t for _, ts in loader for t in ts.tolist()] for loader in shuffled]
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(N)) and orders[0] != list(range(N))


def test_file_url_shards(tmp_path: Path, blobs: list[bytes]) -> None:
    write_shard(tmp_path / "000000.tar", [sample(blobs, i) for i in range(N)])
    check(ThreadLoader([(tmp_path / "000000.tar").as_uri()], batch_size=5), blobs, list(range(N)))


def test_truncated_memory_shard(memory: str, tmp_path: Path, blobs: list[bytes]) -> None:
    local = write_shard(
        tmp_path / "x.tar", [(f"s{i:04d}", {"cls": b"%d" % i, "jpg": blobs[i]}) for i in range(3)]
    )
    _, data_offset = member_offset(local, "s0002.jpg")
    fsspec.filesystem("memory").pipe(f"{memory}/x.tar", local.read_bytes()[: data_offset + 10])
    with pytest.raises(SampleError) as info:
        list(ThreadLoader(f"memory://{memory}/x.tar", batch_size=1))
    error = info.value
    assert (error.index, error.stage, error.origin) == (2, "read", f"memory://{memory}/x.tar:s0002.jpg")
    assert "truncated" in error.reason


def test_missing_remote_shard_raises_at_construction(memory: str) -> None:
    with pytest.raises(ShardError, match="cannot index the shard: FileNotFoundError") as info:
        TarShards(f"memory://{memory}/nothing.tar")
    assert info.value.shard == f"memory://{memory}/nothing.tar"


# ---------------------------------------------------------------------------------------------- HTTP


class _RangeHandler(SimpleHTTPRequestHandler):
    """Serves a folder with single byte ranges (``Range: bytes=a-b``), as object stores do."""

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        wanted = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if wanted is None:
            super().do_GET()
            return
        try:
            data = Path(self.translate_path(self.path)).read_bytes()
        except OSError:
            self.send_error(404)
            return
        start = int(wanted[1])
        end = min(int(wanted[2]) if wanted[2] else len(data) - 1, len(data) - 1)
        body = data[start : end + 1]
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _PlainHandler(SimpleHTTPRequestHandler):
    """Ignores Range: answers every GET with the whole file."""

    def log_message(self, *args: object) -> None:
        pass


class _NoLengthHandler(_RangeHandler):
    """Serves byte ranges but no Content-Length (a chunked answer): the shard's size is unknown."""

    def send_header(self, keyword: str, value: str) -> None:
        if keyword.lower() != "content-length":
            super().send_header(keyword, value)

    def end_headers(self) -> None:
        self.close_connection = True  # without a length, the answer ends with the connection
        super().end_headers()


class _Server(ThreadingHTTPServer):
    """Takes a batch's connections at once: with the default backlog of 5, the sixth waited for TCP's
    retry, a second later."""

    request_queue_size = 64


def _serve(root: Path, handler: type[SimpleHTTPRequestHandler]) -> Iterator[tuple[Path, str]]:
    """Serves the new folder ``root`` over HTTP while the fixture lasts: ``(root, base URL)``."""
    pytest.importorskip("aiohttp", reason="fsspec's http needs aiohttp: pip install -e '.[remote]'")
    root.mkdir()
    server = _Server(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def http(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    yield from _serve(tmp_path / "www", _RangeHandler)


@pytest.fixture
def plain_http(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    yield from _serve(tmp_path / "plain", _PlainHandler)


def test_an_http_shard_of_unknown_size_names_what_it_lacks(tmp_path: Path, blobs: list[bytes]) -> None:
    """fsspec reports no size without a Content-Length: int(None) raised a bare TypeError."""
    for root, base in _serve(tmp_path / "nolength", _NoLengthHandler):
        write_shard(root / "x.tar", [sample(blobs, 0)])
        with pytest.raises(
            ShardError, match=r"x\.tar: cannot index the shard: OSError: .*\(no Content-Length\)"
        ):
            TarShards(f"{base}/x.tar")


def test_http_files_and_a_missing_one(http: tuple[Path, str], blobs: list[bytes]) -> None:
    root, base = http
    for i, data in enumerate(blobs):
        (root / f"{i}.jpg").write_bytes(data)
    check(
        ThreadLoader([(f"{base}/{i}.jpg", i) for i in range(N)], batch_size=3, num_threads=3),
        blobs,
        list(range(N)),
    )
    with pytest.raises(SampleError) as info:
        list(ThreadLoader([(f"{base}/0.jpg", 0), (f"{base}/nope.jpg", 1)], batch_size=1))
    assert (info.value.index, info.value.stage, info.value.origin) == (1, "read", f"{base}/nope.jpg")


def _slow_handler(pause: float) -> type[_RangeHandler]:
    """A range handler that answers each GET after ``pause`` seconds, counting the GETs in flight."""

    class Slow(_RangeHandler):
        lock = threading.Lock()
        in_flight = most = 0

        def do_GET(self) -> None:
            with Slow.lock:
                Slow.in_flight += 1
                Slow.most = max(Slow.most, Slow.in_flight)
            try:
                time.sleep(pause)
                super().do_GET()
            finally:
                with Slow.lock:
                    Slow.in_flight -= 1

    return Slow


@pytest.mark.parametrize("shards", [False, True], ids=["files", "shards"])
def test_one_readers_batch_is_requested_at_once(tmp_path: Path, blobs: list[bytes], shards: bool) -> None:
    """One reader thread, a batch of 8 URLs (or members of an HTTP shard): all 8 requests are in flight
    together, so the batch waits about one round trip, not eight; a missing one fails alone."""
    handler = _slow_handler(0.3)
    for root, base in _serve(tmp_path / "slow", handler):
        if shards:
            write_shard(root / "x.tar", [sample(blobs, i) for i in range(N)])
            source: object = TarShards(f"{base}/x.tar")
            expected = list(range(N))
        else:
            for i, data in enumerate(blobs[:-1]):
                (root / f"{i}.jpg").write_bytes(data)
            source = [(f"{base}/{i}.jpg", i) for i in range(N)]  # the last one is missing
            expected = list(range(N - 1))
        handler.most = 0  # after the shard's indexing
        loader = ThreadLoader(source, batch_size=N, num_threads=1, on_error="skip")
        started = time.perf_counter()
        check(loader, blobs, expected)
        took = time.perf_counter() - started
        assert handler.most == N, f"{handler.most} requests in flight at most"
        assert took < N * 0.3, f"{took:.2f} s: the requests were not in flight together"
        assert loader.stats().skipped == N - len(expected)


def test_a_shard_url_with_a_query_is_a_shard(http: tuple[Path, str], blobs: list[bytes]) -> None:
    """A signed URL ends in its query: '...x.tar?sig=...' was refused as not tar shards."""
    root, base = http
    write_shard(root / "x.tar", [sample(blobs, i) for i in range(3)])
    loader = ThreadLoader(f"{base}/x.tar?sig=abc#part", batch_size=3, num_threads=1)
    check(loader, blobs[:3], list(range(3)))


def test_http_shards(http: tuple[Path, str], blobs: list[bytes]) -> None:
    root, base = http
    for s in range(2):
        write_shard(root / f"{s:06d}.tar", [sample(blobs, s * 4 + k) for k in range(4)])
    loader = ThreadLoader(f"{base}/{{000000..000001}}.tar", batch_size=3, num_threads=2)
    check(loader, blobs, list(range(N)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_http_shards_read_in_a_forked_child(
    http: tuple[Path, str], blobs: list[bytes], tmp_path: Path
) -> None:
    """fsspec's HTTP file system refuses to work in a forked child; a shard source that kept the one
    it indexed with failed every sample there, where a plain URL's file works (``multiprocessing``'s
    fork start method, a fork-based server)."""
    root, base = http
    write_shard(root / "x.tar", [sample(blobs, i) for i in range(2)])
    (tmp_path / "expected.jpg").write_bytes(blobs[1])
    script = f"""
import os, sys
from threadloader import TarShards

source = TarShards({base + "/x.tar"!r})
member, _ = source[1]
expected = open(sys.argv[1], "rb").read()
assert member.read() == expected  # the parent's file system is made and used
pid = os.fork()
if pid == 0:
    try:
        os._exit(0 if member.read() == expected else 1)
    except BaseException as exc:
        print(type(exc).__name__, exc, file=sys.stderr, flush=True)
        os._exit(2)
_, status = os.waitpid(pid, 0)
print(os.waitstatus_to_exitcode(status))
"""
    done = run_script(tmp_path, script, str(tmp_path / "expected.jpg"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"], done.stderr


def test_http_server_without_ranges_is_named(plain_http: tuple[Path, str], blobs: list[bytes]) -> None:
    root, base = plain_http
    write_shard(root / "x.tar", [sample(blobs, i) for i in range(2)])
    with pytest.raises(SampleError, match="ignores range requests"):
        list(ThreadLoader(f"{base}/x.tar", batch_size=2))


@pytest.fixture(params=["no answer", "headers only"])
def stalling(request: pytest.FixtureRequest) -> Iterator[tuple[str, threading.Event]]:
    """A server that takes each request and then sends nothing, or its headers and 10 of 1,000 bytes:
    ``(base URL, set once a request came)``. Its connections close when the test ends."""
    pytest.importorskip("aiohttp", reason="fsspec's http needs aiohttp: pip install -e '.[remote]'")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    asked, stop, connections = threading.Event(), threading.Event(), []

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            connections.append(connection)
            connection.recv(65536)
            if request.param == "headers only":
                connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 10)
            asked.set()

    thread = threading.Thread(target=serve, name="test-stalling-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", asked
    finally:
        stop.set()
        thread.join()
        listener.close()
        for connection in connections:
            connection.close()


def test_a_stalled_http_read_ends_at_close(stalling: tuple[str, threading.Event]) -> None:
    """fsspec's cat_file waits until the request ends, aiohttp's 5 minutes by default: after close()
    (which returned at its 1 s deadline) the reader stayed in it, and the interpreter's exit waited for
    it, for those 5 minutes."""
    base, asked = stalling
    loader = ThreadLoader([(f"{base}/a.jpg", 0)], batch_size=1, num_threads=1)
    iterator = iter(loader)
    assert asked.wait(10), "the reader never asked"
    started = time.monotonic()
    loader.close()
    assert wait_for_no_reader_threads(2.0) == [], "the reader is still waiting for the server"
    assert time.monotonic() - started < 2.0
    del iterator


def test_a_stalled_http_read_times_out_as_configured(
    stalling: tuple[str, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsspec's configuration sets aiohttp's time limit (sources.md); running out of it was the
    SampleError "read failed: FSTimeoutError", which said neither what ran out nor how to change it."""
    base, _ = stalling
    monkeypatch.setitem(fsspec.config.conf, "http", {"timeout": 0.3})
    started = time.monotonic()
    with pytest.raises(SampleError) as info:
        list(ThreadLoader([(f"{base}/a.jpg", 0)], batch_size=1, num_threads=1))
    assert time.monotonic() - started < 5.0
    assert (info.value.stage, info.value.origin) == ("read", f"{base}/a.jpg")
    assert "time limit" in str(info.value) and "FSSPEC_HTTP" in str(info.value), str(info.value)


def test_a_shard_whose_server_stalls_at_construction_names_the_time_limit(
    stalling: tuple[str, threading.Event], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Indexing a shard reads it through fsspec's file object, not ``cat_file``: running out of the time
    limit there was "cannot index the shard: FSTimeoutError: ", which said neither what ran out nor
    how to change it."""
    base, _ = stalling
    monkeypatch.setitem(fsspec.config.conf, "http", {"timeout": 0.3})
    started = time.monotonic()
    with pytest.raises(ShardError) as info:
        TarShards(f"{base}/x.tar")
    assert time.monotonic() - started < 5.0
    assert info.value.shard == f"{base}/x.tar"
    assert "time limit" in str(info.value) and "FSSPEC_HTTP" in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------- without fsspec


@pytest.fixture
def no_fsspec(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "fsspec" or m.startswith("fsspec.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError


def test_without_fsspec_the_error_names_the_package(no_fsspec: None) -> None:
    with pytest.raises(ImportError, match=r"pip install 'fsspec\[http\]'"):
        ThreadLoader(["s3://bucket/a.jpg"])
    with pytest.raises(ImportError, match=r"pip install 'fsspec\[http\]'"):
        ThreadLoader("gs://bucket/{0..3}.tar")

    class Remote:  # no early check for a dataset: the read raises it, as a set-up error, not a sample's
        def __len__(self) -> int:
            return 2

        def __getitem__(self, index: int) -> str:
            return "https://example.invalid/a.jpg"

    loader = ThreadLoader(Remote(), batch_size=2)
    with pytest.raises(ImportError, match=r"pip install 'fsspec\[http\]'"):
        next(iter(loader))
    loader.close()


@pytest.mark.parametrize(
    "source",
    [["s3://bucket/a.jpg"], [("s3://bucket/a.jpg", 0)], [["s3://bucket/a.jpg", 0]]],
    ids=["urls", "tuple pairs", "list pairs"],
)
def test_without_the_protocols_package_a_list_fails_at_construction(
    monkeypatch: pytest.MonkeyPatch, source: list[object]
) -> None:
    """With fsspec but no s3fs, a list of s3:// URLs built fine and its first batch raised fsspec's
    ImportError, on_error="skip" or not: now the construction says it, as it does for fsspec. Pairs
    given as lists were still let through: the check looked inside tuples only."""
    import fsspec

    def missing(protocol: str) -> None:  # s3fs missing, as fsspec reports it (whether or not it is here)
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec, "get_filesystem_class", missing)
    with pytest.raises(ImportError, match=r"needs the package of its protocol: Install s3fs to access S3"):
        ThreadLoader(source, on_error="skip")


def test_without_the_protocols_package_a_list_of_chained_urls_fails_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A chain's protocols went unchecked: a list of ``simplecache::s3://`` URLs without s3fs built
    fine, and its first batch raised fsspec's bare "Install s3fs", naming no URL."""
    import fsspec

    known = fsspec.get_filesystem_class

    def s3_missing(protocol: str) -> type:  # s3fs missing, as fsspec reports it; the others as they are
        if protocol == "s3":
            raise ImportError("Install s3fs to access S3")
        return known(protocol)

    monkeypatch.setattr(fsspec, "get_filesystem_class", s3_missing)
    url = "simplecache::s3://bucket/a.jpg"
    expected = re.escape(f"reading {url!r} needs the package of its protocol: Install s3fs to access S3")
    for source in ([url], [(url, 0)]):
        with pytest.raises(ImportError, match=expected):
            ThreadLoader(source, on_error="skip", device="cpu")


# ---------------------------------------------------------------------------------- resolved filesystems


class _HostFileSystem(pytest.importorskip("fsspec.implementations.memory").MemoryFileSystem):  # type: ignore[misc]
    """A memory file system whose URLs carry a host (``tlhost://HOST/path``), as sftp's or ftp's do."""

    protocol = "tlhost"

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, str]:
        return {"host": path.split("://", 1)[1].split("/", 1)[0]}


@pytest.fixture
def host_protocol() -> Iterator[str]:
    fsspec.register_implementation("tlhost", _HostFileSystem, clobber=True)
    yield "tlhost"
    sys.modules["fsspec.registry"]._registry.pop("tlhost", None)


def test_filesystems_are_fsspecs_own_for_each_url_and_options(host_protocol: str) -> None:
    from threadloader._remote import filesystem

    cases = [
        ("memory://a/x.jpg", None),
        ("memory://b/y.jpg", {}),
        ("memory://a/x.jpg", {"token": "one"}),
        ("memory://a/x.jpg", {"token": "two"}),
        ("memory://a/x.jpg", {"token": "one", "client_kwargs": {"region": "eu"}}),
        ("memory://a/x.jpg", {"token": "one", "client_kwargs": {"region": "us"}}),
        ("memory://a/x.jpg", {"timeout": 1}),
        ("memory://a/x.jpg", {"timeout": "1"}),
        ("memory://a/x.jpg", {"anon": True}),
        ("memory://a/x.jpg", {"anon": 1}),
        ("tlhost://h1/x.jpg", None),
        ("tlhost://h2/x.jpg", None),
    ]
    for _ in range(2):  # the second round from this thread's cache
        for url, options in cases:
            expected_fs, expected_path = fsspec.core.url_to_fs(url, **(options or {}))
            fs, path = filesystem(url, options)
            assert fs is expected_fs and path == expected_path, (url, options)
    assert len({id(filesystem(url, options)[0]) for url, options in cases}) == 11  # None and {}: the same

    seen: list[object] = []  # another thread: its own, as fsspec gives it
    thread = threading.Thread(
        target=lambda: seen.extend(
            [filesystem("memory://a/x.jpg")[0], fsspec.core.url_to_fs("memory://a/x.jpg")[0]]
        )
    )
    thread.start()
    thread.join()
    assert seen[0] is seen[1] and seen[0] is not filesystem("memory://a/x.jpg")[0]


def test_a_thread_resolves_a_filesystem_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from threadloader._remote import filesystem

    calls: list[str] = []
    resolve = fsspec.core.url_to_fs

    def counting(url: str, **options: object) -> object:
        calls.append(url)
        return resolve(url, **options)

    def work() -> None:
        paths = [filesystem(f"memory://once/{i}.jpg")[1] for i in range(5)]
        assert paths == [f"/once/{i}.jpg" for i in range(5)]
        filesystem("memory://once/0.jpg", {"token": "t"})
        filesystem("simplecache::memory://once/0.jpg")  # chained: resolved every time

    monkeypatch.setattr(fsspec.core, "url_to_fs", counting)
    thread = threading.Thread(target=work)  # a fresh thread: nothing resolved yet
    thread.start()
    thread.join()
    assert calls == ["memory://once/0.jpg", "memory://once/0.jpg", "simplecache::memory://once/0.jpg"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_file_url_of_a_fifo_is_its_samples_read_error(tmp_path: Path) -> None:
    """fsspec opened it for reading, which waits for a writer forever: the reader thread, and the
    process's exit behind it, hung (a plain path was refused already)."""
    pipe = tmp_path / "pipe.jpg"
    os.mkfifo(pipe)
    url = pipe.as_uri()
    with pytest.raises(SampleError) as info:
        list(ThreadLoader([url], batch_size=1, device="cpu"))
    assert (info.value.stage, info.value.origin) == ("read", url)
    assert "not a regular file" in info.value.reason


def test_an_unknown_protocol_is_its_samples_read_error_wherever_it_stands() -> None:
    """The construction's check of the first URL's protocol raised fsspec's bare ValueError for one it
    does not know, so the list's order decided between that and a skipped sample."""
    import fsspec

    with fsspec.open("memory://threadloader-known.png", "wb") as f:
        f.write(encode(photo(8, 8, 1), fmt="PNG"))
    for urls in (
        ["foo://x.png", "memory://threadloader-known.png"],
        ["memory://threadloader-known.png", "foo://x.png"],
    ):
        with ThreadLoader([(u, 0) for u in urls], batch_size=2, on_error="skip", device="cpu") as loader:
            assert sum(len(targets) for _, targets in loader) == 1
            assert loader.stats().skipped == 1
