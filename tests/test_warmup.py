"""The background warm-up a front end starts when it is built (threadloader._warmup), on the CPU.

On a GPU it loads nvImageCodec, makes Decoders and compiles kernels while the caller builds the rest;
here a gated Pillow decoder stands in, and the front ends are told to warm up on the CPU, so what is
checked is the mechanism: it runs in the background, the readers wait for it, it counts nothing of the
user's, calls nothing of the user's, and stops with its owner.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from threadloader import BatchDecoder, ThreadLoader, _options, _runtime
from threadloader._cancel import Cancelled, bind_cancel, check_cancelled
from threadloader._handoff import ReaderStream
from threadloader._warmup import Warmup, warmup_source
from threadloader.decode import PillowDecoder
from threadloader.decode.base import DecodedBatch, ImageDecoder

from .conftest import GatedDecoder, encode, photo


@pytest.fixture
def decoder() -> Iterator[GatedDecoder]:
    made = GatedDecoder()
    yield made
    made.gate.set()  # never leave a thread blocked, whatever the test did


@pytest.fixture
def warming(decoder: GatedDecoder) -> None:
    """The gated decoder warms up, as the GPU decoder does (a decoder says so with ``warms_up``)."""
    decoder.warms_up = True  # type: ignore[misc]


def folder(tmp_path: Path, count: int = 6) -> Path:
    root = tmp_path / "images" / "a"
    root.mkdir(parents=True)
    for i in range(count):
        (root / f"{i}.jpg").write_bytes(encode(photo(32, 40, seed=i)))
    return tmp_path / "images"


def test_the_bundled_photos_are_jpegs_that_pillow_decodes() -> None:
    samples = warmup_source()
    names = sorted(
        p.name for p in (resources.files("threadloader") / "_sample").iterdir() if p.name.endswith(".jpg")
    )
    assert len(samples) == len(names) >= 4
    sizes = set()
    for data, target in samples:
        with Image.open(__import__("io").BytesIO(data)) as image:
            assert image.format == "JPEG" and target == 0
            image.load()
            sizes.add(image.size)
    assert len(sizes) > 1  # images of different sizes: the padded path, as a real first batch takes


@pytest.mark.usefixtures("warming")
def test_a_loader_warms_up_in_the_background_and_its_readers_wait_for_it(
    tmp_path: Path, decoder: GatedDecoder
) -> None:
    collated: list[list[object]] = []

    def collate(targets: list[object]) -> list[object]:
        collated.append(targets)
        return targets

    started = time.monotonic()
    with ThreadLoader(
        folder(tmp_path), batch_size=3, decoder=decoder, num_threads=2, collate_fn=collate
    ) as built:
        assert decoder.entered.wait(5)
        assert time.monotonic() - started < 5  # built while the warm-up's decode is still blocked
        assert decoder.threads == ["threadloader-warmup-0"] and decoder.sizes == [len(warmup_source())]
        batches: list[object] = []
        consumer = threading.Thread(target=lambda: batches.extend(built))
        consumer.start()
        time.sleep(0.3)
        assert len(decoder.sizes) == 1 and not batches  # the readers wait for the warm-up
        decoder.gate.set()
        consumer.join(10)
        assert not consumer.is_alive()
        assert len(batches) == 2
        readers = set(decoder.threads[1:])
        assert readers and all(name.startswith("threadloader-e0") for name in readers)
        stats = built.stats()
        assert stats.samples == 6 and stats.batches == 2  # the warm-up's four are not the user's
        assert collated == [[0, 0, 0], [0, 0, 0]]  # the user's collate_fn saw only the user's batches


@pytest.mark.usefixtures("warming")
@pytest.mark.parametrize("starting", [True, False])
def test_while_nvimgcodec_starts_the_readers_decode_with_pillow_instead_of_waiting(
    tmp_path: Path, decoder: GatedDecoder, monkeypatch: pytest.MonkeyPatch, starting: bool
) -> None:
    """The gated decoder stands in for nvImageCodec, its warm-up blocked as nvImageCodec's start would
    be (seconds). While it is starting the readers decode with Pillow and count it; once it has started
    in the process (a later loader's case), they wait for the warm-up and decode with it, as before."""
    decoder.starting = starting  # type: ignore[misc]
    with ThreadLoader(folder(tmp_path), batch_size=3, decoder=decoder, num_threads=2) as built:
        assert decoder.entered.wait(5)
        batches: list[object] = []
        consumer = threading.Thread(target=lambda: batches.extend(built))
        consumer.start()
        consumer.join(0.5 if not starting else 10)
        assert len(batches) == (2 if starting else 0)  # Pillow's, or waiting for the warm-up
        assert built.stats().started_on_cpu == (6 if starting else 0)
        assert decoder.threads == ["threadloader-warmup-0"]  # the readers did not call it
        decoder.starting = False  # type: ignore[misc]
        decoder.gate.set()
        consumer.join(10)
        assert not consumer.is_alive() and len(batches) == 2
        again = list(built)  # nvImageCodec has started: the readers decode with it
        assert len(again) == 2 and len(decoder.threads) == (3 if starting else 5)
        assert built.stats().started_on_cpu == (6 if starting else 0)


@pytest.mark.usefixtures("warming")
@pytest.mark.parametrize(("cpus", "on_threads"), [(4, True), (2, False)])
def test_the_cpu_start_spreads_a_group_over_the_cores_the_readers_share(
    tmp_path: Path, decoder: GatedDecoder, monkeypatch: pytest.MonkeyPatch, cpus: int, on_threads: bool
) -> None:
    """Two readers on 4 cores: each decodes its groups on 2 threads of its own (the consumer waits for
    the first group, which one reader would decode image by image); on 2 cores, each in itself."""
    from threadloader.decode import pillow

    monkeypatch.setattr(_runtime, "available_cpus", lambda: cpus)
    decoder.starting = True  # type: ignore[misc]
    threads: list[str] = []
    original = pillow.decode_rgb

    def decode_rgb(data: bytes, **options: object) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return original(data, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(pillow, "decode_rgb", decode_rgb)
    with ThreadLoader(folder(tmp_path), batch_size=3, decoder=decoder, num_threads=2) as built:
        assert decoder.entered.wait(5)
        assert len(list(built)) == 2 and built.stats().started_on_cpu == 6
        reader = [name.startswith("threadloader-e0") for name in threads]
        pool = [name.startswith("threadloader-pillow") for name in threads]
        assert len(threads) == 6 and (all(pool) if on_threads else all(reader)), threads
        decoder.gate.set()


class EndlessDecoder(ImageDecoder):
    """A decode that takes 10 s, checking between images whether its thread was asked to stop."""

    warms_up = True

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.entered = threading.Event()

    def decode(self, encoded: Sequence[bytes], **_kwargs: object) -> DecodedBatch:  # type: ignore[override]
        self.entered.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            check_cancelled()
            time.sleep(0.01)
        raise AssertionError("the warm-up was never cancelled")


@pytest.mark.parametrize("front_end", ["loader", "service"])
def test_closing_a_front_end_stops_its_warm_up(tmp_path: Path, front_end: str) -> None:
    endless = EndlessDecoder()
    if front_end == "loader":
        built: ThreadLoader | BatchDecoder = ThreadLoader(folder(tmp_path), batch_size=3, decoder=endless)
    else:
        built = BatchDecoder(decoder=endless, num_threads=1)
    assert endless.entered.wait(5)
    started = time.monotonic()
    built.close()
    while (
        any(t.name == "threadloader-warmup-0" for t in threading.enumerate())
        and time.monotonic() - started < 5
    ):
        time.sleep(0.01)
    assert time.monotonic() - started < 2


@pytest.mark.usefixtures("warming")
def test_a_service_answers_its_first_request_after_its_warm_up(decoder: GatedDecoder) -> None:
    data = encode(photo(16, 24))
    with BatchDecoder(decoder=decoder, num_threads=1, max_delay_ms=0) as served:
        assert decoder.entered.wait(5)
        future = served.submit(data)
        time.sleep(0.2)
        assert not future.done() and len(decoder.sizes) == 1
        decoder.gate.set()
        image = future.result(10)
    reference = np.asarray(Image.open(__import__("io").BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(image.permute(1, 2, 0).numpy(), reference)
    assert served.stats().completed == 1


def test_a_failed_warm_up_is_logged_and_the_readers_go_on(caplog: pytest.LogCaptureFixture) -> None:
    def broken(**_kwargs: object) -> object:
        raise RuntimeError("no codec here")

    with caplog.at_level("DEBUG", logger="threadloader"):
        warmup = Warmup(broken, [ReaderStream(torch.device("cpu"))])  # type: ignore[arg-type]
        warmup.wait()
    assert warmup.done
    assert any("warm-up failed" in r.getMessage() and r.exc_info for r in caplog.records)


def test_a_reader_waiting_for_the_warm_up_stops_when_cancelled() -> None:
    release = threading.Event()

    class Blocked:
        def produce(self, *_args: object, **_kwargs: object) -> None:
            release.wait(10)

    warmup = Warmup(lambda **_kwargs: Blocked(), [ReaderStream(torch.device("cpu"))])  # type: ignore[arg-type,return-value]
    flag = threading.Event()
    outcome: list[str] = []

    def reader() -> None:
        bind_cancel(flag)
        try:
            warmup.wait()
            outcome.append("returned")
        except Cancelled:
            outcome.append("cancelled")

    thread = threading.Thread(target=reader)
    thread.start()
    time.sleep(0.1)
    flag.set()
    thread.join(5)
    release.set()
    warmup.wait()
    assert outcome == ["cancelled"]


def test_the_built_in_cpu_decoder_and_a_decoder_that_does_not_warm_up_are_not_warmed(
    tmp_path: Path, decoder: GatedDecoder
) -> None:
    decoder.gate.set()
    for built in (
        ThreadLoader(folder(tmp_path), batch_size=3, device="cpu"),
        ThreadLoader(folder(tmp_path / "b"), batch_size=3, decoder=decoder),
    ):
        with built:
            assert not built._runtime.warming_up
            assert not any(t.name.startswith("threadloader-warmup") for t in threading.enumerate())
            assert sum(len(images) for images, _ in built) == 6
    assert not any(name.startswith("threadloader-warmup") for name in decoder.threads)


def test_warm_up_batches_run_at_once_and_wait_returns_after_the_last() -> None:
    """Each Decoder the readers lease at once is made and has decoded: one batch per thread, together."""
    together = threading.Barrier(2, timeout=5)
    finished: list[str] = []
    release = threading.Event()

    readers = [ReaderStream(torch.device("cpu")) for _ in range(2)]
    streams: list[ReaderStream] = []

    class Producer:
        def produce(self, _batches: object, reader: ReaderStream, **_kwargs: object) -> None:
            streams.append(reader)
            together.wait()  # both batches are in flight at the same time
            if threading.current_thread().name.endswith("-1"):
                assert release.wait(10)
            finished.append(threading.current_thread().name)

    warmup = Warmup(lambda **_kwargs: Producer(), readers, threads=2)  # type: ignore[arg-type,return-value]
    deadline = time.monotonic() + 5
    while not finished and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished == ["threadloader-warmup-0"] and not warmup.done  # one of two ended: still warming
    release.set()
    warmup.wait()
    assert sorted(finished) == ["threadloader-warmup-0", "threadloader-warmup-1"]
    assert sorted(map(id, streams)) == sorted(
        map(id, readers)
    )  # each on a reader's stream, not one of its own


@pytest.mark.usefixtures("warming")
def test_the_environment_turns_the_warm_up_off(
    tmp_path: Path, decoder: GatedDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """THREADLOADER_WARMUP=0: for a script that captures a CUDA graph while its loader would warm up.

    Otherwise a batch per call the decoder runs at once: the GPU decoder's Decoders (the pool's
    default, 2, of 4 readers), one for a decoder that does not say.
    """
    decoder.gate.set()
    for env, concurrent, threads in (("1", None, 1), ("1", 2, 2), ("0", 2, 0)):
        monkeypatch.setenv(_options.WARMUP_ENV, env)
        if concurrent is not None:
            decoder.gpu_decoders = concurrent  # type: ignore[attr-defined]
        folder_of_run = tmp_path / f"{env}-{concurrent}"
        with ThreadLoader(folder(folder_of_run), batch_size=3, decoder=decoder, num_threads=4) as built:
            assert built._runtime.warming_up == bool(threads)
            assert sum(len(images) for images, _ in built) == 6
        assert sum(name.startswith("threadloader-warmup") for name in decoder.threads) == threads
        decoder.threads.clear()


def test_prepare_runs_beside_the_batches_on_a_reader_stream_and_readers_wait_for_it() -> None:
    """The work that needs no decoder (compiling the output's kernel) runs at the same time as the
    batches, not after them, on the first reader's stream, and ``wait()`` returns only once it has
    ended too."""
    prepare_started, release = threading.Event(), threading.Event()
    overlapped: list[bool] = []
    active: list[tuple[int, str]] = []

    class Recording(ReaderStream):
        def active(self):  # type: ignore[no-untyped-def]
            active.append((readers.index(self), threading.current_thread().name))
            return super().active()

    readers = [Recording(torch.device("cpu")) for _ in range(2)]

    class Producer:
        def produce(self, *_args: object, **_kwargs: object) -> None:
            overlapped.append(prepare_started.wait(2))  # False if prepare waits for the batches

    def prepare() -> None:
        prepare_started.set()
        assert release.wait(10)

    warmup = Warmup(lambda **_kwargs: Producer(), readers, threads=1, prepare=prepare)  # type: ignore[arg-type,return-value]
    deadline = time.monotonic() + 5
    while not overlapped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert overlapped == [True]
    time.sleep(0.1)
    assert not warmup.done  # the batch has ended; prepare has not
    release.set()
    warmup.wait()
    assert active == [(0, "threadloader-warmup-1")]


class _StuckDecoder(PillowDecoder):
    """Pillow's decode once ``gate`` opens: a decoder stuck in a call (a hung read, a driver wait)."""

    def __init__(self, *, warms_up: bool) -> None:
        super().__init__()
        self.warms_up = warms_up
        self.gate = threading.Event()
        self.entered = threading.Event()

    def decode(self, encoded, **options):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.gate.wait(30)
        return super().decode(encoded, **options)


def _timed(call: Callable[[], object]) -> float:
    started = time.monotonic()
    call()
    return time.monotonic() - started


def test_only_the_first_close_waits_and_it_waits_once_for_everything(tmp_path: Path) -> None:
    """A stuck warm-up made close(), a second close(), __exit__ and the finalizer wait a second each;
    three live iterators over a stuck decoder made close() wait a second for each in turn."""
    images = folder(tmp_path)
    stuck = _StuckDecoder(warms_up=False)
    loader = ThreadLoader(images, batch_size=3, decoder=stuck, num_threads=1)
    iterators = [iter(loader) for _ in range(3)]
    assert stuck.entered.wait(5)
    try:
        assert 0.8 < _timed(loader.close) < 1.6  # the threads get a second, all together
        assert _timed(loader.close) < 0.2
    finally:
        stuck.gate.set()
    del iterators
    warming = _StuckDecoder(warms_up=True)
    with ThreadLoader(images, batch_size=3, decoder=warming) as built:
        assert warming.entered.wait(5)
        try:
            assert 0.8 < _timed(built.close) < 1.6
            assert _timed(built.close) < 0.2
            assert _timed(lambda: built.__exit__(None, None, None)) < 0.2
        finally:
            warming.gate.set()
    service_stuck = _StuckDecoder(warms_up=True)
    served = BatchDecoder(decoder=service_stuck, num_threads=1)
    assert service_stuck.entered.wait(5)
    try:
        assert 0.8 < _timed(lambda: served.close(cancel_pending=True)) < 1.6  # the warm-up's second too
        assert _timed(lambda: served.close(cancel_pending=True)) < 0.2
    finally:
        service_stuck.gate.set()


def test_a_warm_up_that_raises_a_base_exception_logs_it_and_prints_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only Exception was caught: "Exception in thread threadloader-warmup-0" went to stderr."""

    class Abort(BaseException):
        pass

    class Aborting(PillowDecoder):
        warms_up = True

        def decode(self, encoded, **options):  # type: ignore[no-untyped-def]
            if threading.current_thread().name.startswith("threadloader-warmup"):
                raise Abort("a library's own BaseException")
            return super().decode(encoded, **options)

    printed: list[object] = []
    monkeypatch.setattr(threading, "excepthook", printed.append)
    with ThreadLoader(folder(tmp_path), batch_size=3, decoder=Aborting()) as loader:
        assert len(list(loader)) == 2  # the readers decode as ever
    assert printed == []


def test_a_close_meanwhile_in_another_thread_waits_with_the_first(tmp_path: Path) -> None:
    """A second close that returned at once left the warm-up's thread running under its caller."""
    warming = _StuckDecoder(warms_up=True)
    built = ThreadLoader(folder(tmp_path), batch_size=3, decoder=warming)
    assert warming.entered.wait(5)
    try:
        first = threading.Thread(target=built.close)
        first.start()
        time.sleep(0.2)
        assert 0.5 < _timed(built.close) < 1.2  # until the first's deadline, not a second of its own
        first.join(5)
    finally:
        warming.gate.set()


class _LockedStart(_StuckDecoder):
    """A built decoder whose close waits for a call in progress, as the GPU decoder's waits for its start
    (nvImageCodec's load and self-test, seconds): it records whether it was closed under a call."""

    def __init__(self) -> None:
        super().__init__(warms_up=True)
        self.lock = threading.Lock()
        self.closed_by: list[str] = []

    def decode(self, encoded, **options):  # type: ignore[no-untyped-def]
        with self.lock:
            return super().decode(encoded, **options)

    def close(self) -> None:
        with self.lock:
            self.closed_by.append(threading.current_thread().name)


def test_close_waits_for_a_warm_up_call_and_closes_the_decoder_after_it_not_under_it(
    tmp_path: Path,
) -> None:
    """A notebook closes a loader for its device memory back: the close waits for the warm-up's call
    (nvImageCodec's start, seconds past the close's second) and returns with the decoder closed, by the
    warm-up's thread as its call ends, never under it. A close that returned first (b04a5ad) left 20
    loaders' Decoders on the GPU a while after each close (tests/test_gpu_registry.py)."""
    built = _LockedStart()
    loader = _built_loader(tmp_path, built)
    opened = threading.Timer(1.5, built.gate.set)  # the call ends half a second past the deadline
    opened.start()
    try:
        assert 1.3 < _timed(loader.close) < 2.5
        assert built.closed_by == ["threadloader-warmup-0"]
    finally:
        built.gate.set()
        opened.cancel()
    loader.close()  # again, once the warm-up has ended: closed here (a decoder's close is idempotent)
    assert built.closed_by == ["threadloader-warmup-0", "MainThread"]


def test_a_warm_up_call_past_the_release_wait_closes_the_decoder_as_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start stuck past RELEASE_WAIT does not hold the close: its thread closes the decoder later."""
    monkeypatch.setattr(_runtime, "RELEASE_WAIT", 0.3)
    built = _LockedStart()
    loader = _built_loader(tmp_path, built)
    try:
        assert 1.1 < _timed(loader.close) < 1.9  # the warm-up's second, then the release wait
        assert built.closed_by == []  # not under the call still running
    finally:
        built.gate.set()
    deadline = time.monotonic() + 5
    while not built.closed_by and time.monotonic() < deadline:
        time.sleep(0.01)
    assert built.closed_by == ["threadloader-warmup-0"]


def _built_loader(tmp_path: Path, built: _LockedStart) -> ThreadLoader:
    """A loader over ``built``, once its warm-up is inside its first call."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_runtime, "build_decoder", lambda *_args, **_kwargs: built)
        loader = ThreadLoader(folder(tmp_path), batch_size=3, device="cpu")
    assert built.entered.wait(5)
    return loader
