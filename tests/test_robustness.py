"""Bad inputs, other formats, faults and long runs on the CPU path (the GPU twin is test_gpu_robustness)."""

from __future__ import annotations

import gc
import io
import logging
import os
import pickle
import sys
import threading
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from PIL import Image, ImageDraw

from threadloader import ImageFolder, SampleError, ThreadLoader
from threadloader._stats import StatsRecorder
from threadloader.decode.pillow import PillowDecoder, decode_rgb

from .conftest import encode, mean_abs_diff, photo, reader_threads
from .robustness_cases import (
    BAD_INPUTS,
    GOOD,
    HEAP_ADDRESS,
    MUTATIONS,
    corrupted_entropy_jpeg,
    exit_with_a_loader_open,
    fifo_named_jpg,
    load_other_format,
    mutate,
    other_formats,
    release_fifo,
)

T = TypeVar("T")


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises_naming_the_sample(case: str, tmp_path: Path) -> None:
    make, stage = BAD_INPUTS[case]
    bad = make(tmp_path)
    samples = [(GOOD[0], 0), (GOOD[1], 1), (bad, 2), (GOOD[2], 3)]
    seen = []
    with ThreadLoader(samples, batch_size=2, device="cpu") as loader:
        with pytest.raises(SampleError) as caught:
            for _, targets in loader:
                seen.append(targets.tolist())
        assert seen == [[0, 1]]
        error = caught.value
        assert error.index == 2 and error.stage == stage and error.origin == bad
        assert bad in str(error) and error.reason
        assert [t.tolist() for _, (_, t) in zip(range(1), loader, strict=False)] == [[0, 1]]  # iterable again


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_skipped_and_counted(
    case: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make, _ = BAD_INPUTS[case]
    bad = make(tmp_path)
    samples = [(GOOD[0], 0), (bad, 1), (GOOD[1], 2)]
    loader = ThreadLoader(samples, batch_size=3, device="cpu", on_error="skip")
    with caplog.at_level(logging.WARNING, logger="threadloader"), loader:
        (images, targets), *rest = list(loader)
        stats = loader.stats()
    assert not rest and targets.tolist() == [0, 2] and len(images) == 2
    assert stats.skipped == 1 and stats.errors == 1 and stats.samples == 2
    assert sum(bad in record.getMessage() for record in caplog.records) == 1


def test_pixel_limit_is_checked_before_decoding() -> None:
    big = encode(photo(120, 100, 1), quality=90)  # 12,000 pixels
    limited = ThreadLoader([(big, 0)], batch_size=1, device="cpu", max_pixels=10_000)
    with limited, pytest.raises(SampleError, match="over the limit of 10,000") as caught:
        list(limited)
    assert "max_pixels" in str(caught.value)
    with ThreadLoader([(big, 0)], batch_size=1, device="cpu", max_pixels=None) as loader:
        assert len(list(loader)) == 1


def test_default_pixel_limit_is_pillows() -> None:
    from PIL import Image

    assert ThreadLoader([GOOD[0]], device="cpu")._producer._decoder._max_pixels == Image.MAX_IMAGE_PIXELS  # type: ignore[attr-defined]


def test_corrupted_entropy_data_does_not_crash() -> None:
    """libjpeg accepts some corruption inside entropy-coded data and returns a damaged image; the
    contract is no crash and no hang: the sample either decodes or is a SampleError."""
    with ThreadLoader([(corrupted_entropy_jpeg(), 0)], batch_size=1, device="cpu", on_error="skip") as loader:
        batches = list(loader)
        stats = loader.stats()
    assert len(batches) + stats.skipped == 1


@pytest.mark.parametrize("name", sorted(other_formats()))
def test_other_formats_follow_the_output_contract(name: str) -> None:
    image, expected = load_other_format(name, "cpu")
    assert tuple(image.shape) == (3, *expected.shape[:2])
    assert mean_abs_diff(image, expected) == 0


def test_dataset_exception_is_a_sample_error() -> None:
    class Broken:
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> tuple[bytes, int]:
            if index == 3:
                raise ZeroDivisionError("user bug")
            return GOOD[index % 3], index

    loader = ThreadLoader(Broken(), batch_size=2, device="cpu")
    with loader, pytest.raises(SampleError, match="ZeroDivisionError: user bug") as caught:
        list(loader)
    assert isinstance(caught.value.__cause__, ZeroDivisionError) and caught.value.stage == "fetch"
    # Kept without the reader's frames (they hold its group), its traceback kept as text.
    assert caught.value.__cause__.__traceback__ is None
    if sys.version_info >= (3, 11):
        notes = "".join(caught.value.__cause__.__notes__)
        assert "in __getitem__" in notes and 'raise ZeroDivisionError("user bug")' in notes


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes came in Python 3.11")
def test_an_exception_a_source_keeps_and_raises_again_keeps_one_traceback_note() -> None:
    """A dataset that caches its failures raises one exception object every epoch: each time it was
    detached again, and its notes grew by a traceback every epoch (memory, and an error printing them all)."""

    class CachedFailure:
        def __init__(self) -> None:
            self.failure = OSError("shard unreachable")

        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> tuple[bytes, int]:
            if index == 3:
                raise self.failure
            return GOOD[index % 3], index

    source = CachedFailure()
    with ThreadLoader(source, batch_size=2, device="cpu", on_error="skip") as loader:
        for _ in range(5):
            assert [t.tolist() for _, t in loader] == [[0, 1], [2]]
    notes = source.failure.__notes__
    assert len(notes) == 1 and "raise self.failure" in notes[0]


def test_a_sample_errors_notes_survive_pickling() -> None:
    """Its traceback as text is a note: pickled (a logging handler, another process) it was dropped."""
    error = SampleError(index=3, origin="a.jpg", stage="decode", reason="broken")
    if sys.version_info >= (3, 11):
        error.add_note("Traceback (as text; its frames released):\n  File x")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.index, copy.origin, copy.stage, copy.reason, str(copy)) == (
        3,
        "a.jpg",
        "decode",
        "broken",
        str(error),
    )
    assert getattr(copy, "__notes__", None) == getattr(error, "__notes__", None)


def _pillows_exception(data: bytes) -> BaseException:
    """What Pillow itself raises when asked for the pixels of ``data``: the independent reference."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.convert("RGB").load()
    except Exception as exc:
        return exc
    raise AssertionError("Pillow decoded it")


def test_a_decode_failure_chains_the_decoders_exception() -> None:
    """A sample no decoder can decode is a SampleError whose __cause__ is the exception it failed with."""
    bad = b"\xff\xd8\xff\xe0 not really a jpeg" * 4
    reference = _pillows_exception(bad)
    loader = ThreadLoader([(GOOD[0], 0), (bad, 1)], batch_size=2, device="cpu")
    with loader, pytest.raises(SampleError) as caught:
        list(loader)
    error = caught.value
    assert error.stage == "decode" and error.index == 1
    assert isinstance(error.__cause__, type(reference))  # Pillow's kind of error, from Pillow's own answer
    assert str(error.__cause__) in error.reason


def test_a_kept_cause_does_not_keep_its_batch_alive() -> None:
    """An on_skip or a server may keep a sample's error, cause and all; that must not keep the rest of
    its batch in memory, nor leave it to the garbage collector (a cycle through the traceback)."""
    import weakref

    bad = b"not an image at all"
    gc.disable()
    try:
        decoded = PillowDecoder().decode([GOOD[0], bad], stream=None)
        good = weakref.ref(decoded.own[0])
        cause = decoded.causes[1]
        del decoded
        assert good() is None, "the good image outlived its batch: the cause's traceback holds it"
    finally:
        gc.enable()
    assert isinstance(cause, Exception)


def test_the_gpu_decoders_pillow_fallback_keeps_pillows_exception() -> None:
    """On the GPU path a sample nvImageCodec gives up on goes to Pillow; if Pillow fails too, its
    exception is the cause (nvImageCodec reports a status, not an exception). Runs without a GPU: the
    fallback touches no device memory for a sample Pillow cannot decode."""
    from threadloader.decode.nvimgcodec._fallback import decode_on_cpu
    from threadloader.decode.nvimgcodec._memory import Assembly, Outputs

    bad = b"GIF89a truncated"
    assembly = Assembly([None])
    decode_on_cpu(
        [bad],
        {0: "nvImageCodec gave up"},
        assembly,
        [Outputs()],
        device=torch.device("cuda", 0),
        max_pixels=None,
        stats=StatsRecorder(),
    )
    errors, causes = assembly.errors, assembly.causes
    reference = _pillows_exception(bad)
    assert errors[0].startswith("nvImageCodec gave up; Pillow: ")
    assert isinstance(causes[0], type(reference)) and str(causes[0]) in errors[0]
    assert causes[0].__traceback__ is None  # its frames, and the batch's device memory they hold, released


def test_interpreter_exit_with_a_loader_open(tmp_path: Path) -> None:
    """A script that leaves a loader mid-epoch exits promptly, cleanly and silently."""
    result = exit_with_a_loader_open(tmp_path, "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "started"
    assert result.stderr == ""


def test_fifty_epochs_without_growth() -> None:
    samples = [(GOOD[i % 3], i) for i in range(12)]
    before_threads = threading.active_count()
    with ThreadLoader(samples, batch_size=4, num_threads=3, device="cpu") as loader:
        for _ in range(5):  # warm-up: allocator pools, imports, caches
            list(loader)
        gc.collect()
        tracemalloc.start()
        start, _ = tracemalloc.get_traced_memory()
        for _ in range(45):
            for _images, _targets in loader:
                pass
            assert threading.active_count() == before_threads
        gc.collect()
        end, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        stats = loader.stats()
    assert stats.samples == 50 * 12 and stats.batches == 50 * 3 and stats.errors == 0
    assert end - start < 256 * 1024, f"host memory grew by {(end - start) / 1024:.0f} KiB over 45 epochs"
    assert not reader_threads()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**MUTATIONS)
def test_fuzz_mutated_jpegs_never_escape_the_decoder(edits: list[tuple[int, int]], cut: int) -> None:
    mutated = mutate(GOOD[0], edits, cut)
    batch = PillowDecoder().decode([mutated, GOOD[1]], stream=None, stats=StatsRecorder())
    assert batch.image(1) is not None  # the good neighbour is unaffected
    image = batch.image(0)
    assert (image is None) == (0 in batch.errors)
    if image is not None:
        assert image.dtype == torch.uint8 and image.shape[2] == 3


# --- max_pixels is the one pixel limit, whatever Pillow's global (issue #13, finding 3) ---

#: Pillow's limit in these tests, so that images past it stay small.
PILLOW_LIMIT = 10_000


def _pillow_rgb(data: bytes, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """The reference: Pillow itself, with its limit lifted for this one call."""
    with monkeypatch.context() as lifted:
        lifted.setattr(Image, "MAX_IMAGE_PIXELS", None)
        with Image.open(io.BytesIO(data)) as image:
            return np.array(image.convert("RGB"))


@pytest.fixture
def small_pillow_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PILLOW_LIMIT)


@pytest.mark.parametrize("max_pixels", [None, 40_000])
@pytest.mark.usefixtures("small_pillow_limit")
def test_max_pixels_none_or_above_pillows_limit_decodes(
    max_pixels: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = encode(photo(150, 200, 3), "PNG")  # 30,000 pixels: past 2x Pillow's limit, where Pillow raises
    with ThreadLoader([data], batch_size=1, device="cpu", max_pixels=max_pixels) as loader:
        ((images, _),) = list(loader)
    assert mean_abs_diff(images[0], _pillow_rgb(data, monkeypatch)) == 0


@pytest.mark.usefixtures("small_pillow_limit")
def test_no_decompression_bomb_warning_between_1x_and_2x_pillows_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data = encode(photo(100, 120, 4), "PNG")  # 12,000 pixels: where Pillow warns
    with warnings.catch_warnings(record=True) as caught:  # records the reader threads' warnings too
        warnings.simplefilter("always")
        direct = decode_rgb(data, max_pixels=20_000)
        with ThreadLoader([data], batch_size=1, device="cpu", max_pixels=None) as loader:
            ((images, _),) = list(loader)
    assert [str(w.message) for w in caught if issubclass(w.category, Image.DecompressionBombWarning)] == []
    reference = _pillow_rgb(data, monkeypatch)
    assert np.array_equal(direct, reference) and mean_abs_diff(images[0], reference) == 0


@pytest.mark.usefixtures("small_pillow_limit")
def test_pixel_limit_error_names_the_sample_the_limit_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "big.png"
    path.write_bytes(encode(photo(150, 200, 5), "PNG"))  # 30,000 pixels, past 2x Pillow's limit too
    loader = ThreadLoader([str(path)], batch_size=1, device="cpu", max_pixels=25_000)
    with loader, pytest.raises(SampleError) as caught:
        list(loader)
    message = str(caught.value)
    assert message.startswith(f"sample 0 ({path}): decode failed: ")
    assert "200x150 is 30,000 pixels, over the limit of 25,000" in message
    assert "pass a larger max_pixels=, or None" in message


@pytest.mark.usefixtures("small_pillow_limit")
def test_pillows_own_limit_still_holds_in_other_threads() -> None:
    """Lifting the limit for the loader's decodes must not lift it for other code using Pillow, even
    while they run: a decode that set Pillow's global for its duration would let these opens through."""
    data = encode(photo(150, 200, 6), "PNG")
    stop = threading.Event()
    decoded = []

    def decode_in_a_loop() -> None:
        while not stop.is_set():
            decoded.append(decode_rgb(data, max_pixels=None).shape)

    thread = threading.Thread(target=decode_in_a_loop)
    thread.start()
    try:
        for _ in range(200):
            with pytest.raises(Image.DecompressionBombError):
                Image.open(io.BytesIO(data))
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and decoded and set(decoded) == {(150, 200, 3)}
    assert Image.MAX_IMAGE_PIXELS == PILLOW_LIMIT


def test_a_14000_square_png_decodes_with_max_pixels_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case at its real size (196 million pixels, over 2x Pillow's default limit)."""
    side = 14_000
    drawing = Image.new("L", (side, side), 40)
    for i in range(0, side, 1000):
        ImageDraw.Draw(drawing).rectangle([i, i // 2, i + 500, i // 2 + 700], fill=i // 60 % 256)
    out = io.BytesIO()
    drawing.save(out, "PNG", compress_level=1)
    del drawing
    with ThreadLoader([out.getvalue()], batch_size=1, device="cpu", max_pixels=None) as loader:
        ((images, _),) = list(loader)
    with monkeypatch.context() as lifted:
        lifted.setattr(Image, "MAX_IMAGE_PIXELS", None)
        reference = torch.from_numpy(np.array(Image.open(out)))  # gray: each channel must equal it
    assert images[0].shape == (3, side, side)
    assert all(torch.equal(channel, reference) for channel in images[0])


# --- no heap addresses in errors (finding 4) ---


def test_sample_errors_carry_no_heap_address(tmp_path: Path) -> None:
    paths = [make(tmp_path) for make, _ in BAD_INPUTS.values()]
    blobs = [Path(path).read_bytes() for path in paths if Path(path).is_file()]
    over_the_limit = encode(photo(120, 100, 1), quality=90)  # 12,000 pixels against max_pixels=10,000

    class ShowsAnObject:
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: int) -> bytes:
            raise LookupError(f"no label for {object()}")  # a default repr: <object object at 0x...>

    messages = []
    for source in [[sample] for sample in [*paths, *blobs, over_the_limit]] + [ShowsAnObject()]:
        loader = ThreadLoader(source, batch_size=1, device="cpu", max_pixels=10_000)
        with loader, pytest.raises(SampleError) as caught:
            list(loader)
        messages.append(str(caught.value))
        assert caught.value.reason in messages[-1]
    assert len(messages) == len(paths) + len(blobs) + 2
    assert [m for m in messages if HEAP_ADDRESS.search(m)] == []
    assert "<object object>" in messages[-1]  # the repr keeps its type


# --- directory sources take regular files only; symlinked folders once (finding 5) ---


def _within(seconds: float, work: Callable[[], T], *, release: Callable[[], None]) -> T:
    """Runs ``work`` in a thread; fails the test (after ``release`` unblocks it) if it takes longer."""
    outcome: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        release()
        thread.join(10)
        pytest.fail(f"still blocked after {seconds} s")
    if failure:
        raise failure[0]
    return outcome[0]


def test_a_fifo_in_a_folder_is_left_out_at_listing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.jpg").write_bytes(GOOD[0])
    fifo = fifo_named_jpg(tmp_path / "cat")

    def load() -> tuple[list[tuple[str, int]], list[list[int]]]:
        with ThreadLoader(str(tmp_path), batch_size=4, device="cpu") as loader:
            return loader.source.samples, [targets.tolist() for _, targets in loader]  # type: ignore[attr-defined]

    with caplog.at_level(logging.WARNING, logger="threadloader"):
        samples, batches = _within(20, load, release=lambda: release_fifo(fifo))
    assert samples == [(str(tmp_path / "cat" / "a.jpg"), 0)] and batches == [[0]]
    assert any(repr(fifo) in record.getMessage() for record in caplog.records)


def test_a_fifo_or_device_given_as_a_path_is_a_read_error(tmp_path: Path) -> None:
    fifo = fifo_named_jpg(tmp_path)
    for path, kind in ((fifo, "a FIFO"), (os.devnull, "a character device")):

        def load(path: str = path) -> SampleError:
            loader = ThreadLoader([(GOOD[0], 0), (path, 1)], batch_size=1, device="cpu")
            with loader, pytest.raises(SampleError) as caught:
                list(loader)
            return caught.value

        error = _within(20, load, release=lambda: release_fifo(fifo))
        assert (error.index, error.origin, error.stage) == (1, path, "read")
        assert f"not a regular file ({kind})" in error.reason


def test_a_folder_given_as_a_path_is_a_read_error_and_leaks_no_descriptor(tmp_path: Path) -> None:
    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    with ThreadLoader([(str(tmp_path), 0)], batch_size=1, device="cpu", num_threads=1) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
        assert (caught.value.stage, caught.value.origin) == ("read", str(tmp_path))
        assert "not a regular file (a directory)" in caught.value.reason
        before = open_descriptors()
        for _ in range(20):
            with pytest.raises(SampleError):
                list(loader)
        assert open_descriptors() <= before


def test_links_that_loop_on_themselves_are_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A link that resolves to itself makes ``is_dir()`` raise ELOOP (a broken link only gives False):
    the whole listing failed on one bad entry, a class folder or a file."""
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "ok.jpg").write_bytes(GOOD[0])
    (tmp_path / "cat" / "self.jpg").symlink_to(tmp_path / "cat" / "self.jpg")
    (tmp_path / "dogs").symlink_to(tmp_path / "dogs")
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        folder = ImageFolder(tmp_path)
    assert folder.classes == ["cat"] and folder.samples == [(str(tmp_path / "cat" / "ok.jpg"), 0)]
    messages = " ".join(record.getMessage() for record in caplog.records)
    assert repr(str(tmp_path / "dogs")) in messages and repr(str(tmp_path / "cat" / "self.jpg")) in messages


@pytest.mark.parametrize("path", ["bad\x00name.jpg", "\ud800.jpg"])
def test_a_path_python_cannot_open_is_its_samples_read_error(path: str) -> None:
    """``os.open`` raises ValueError (a NUL) or UnicodeEncodeError (a lone surrogate) for such a path,
    not OSError: the whole batch failed, also with ``on_error="skip"``, naming no sample."""
    with ThreadLoader([(GOOD[0], 0), (path, 1)], batch_size=2, device="cpu", on_error="skip") as loader:
        assert [targets.tolist() for _, targets in loader] == [[0]]
        assert loader.stats().skipped == 1
    loader = ThreadLoader([(GOOD[0], 0), (path, 1)], batch_size=2, device="cpu")
    with loader, pytest.raises(SampleError) as caught:
        list(loader)
    assert (caught.value.index, caught.value.stage) == (1, "read")


def test_symlinked_folders_are_followed_once_and_loops_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    for folder in (root / "cat" / "sub", root / "dog" / "real", outside):
        folder.mkdir(parents=True)
    for name in ("cat/a.jpg", "cat/sub/b.jpg", "dog/d.jpg", "dog/real/e.jpg"):
        (root / name).write_bytes(GOOD[0])
    (outside / "c.jpg").write_bytes(GOOD[1])
    (root / "cat" / "sub" / "loop").symlink_to(root / "cat")  # back to an ancestor
    (root / "cat" / "everything").symlink_to(root)  # the root: every class, this one included
    (root / "cat" / "ext").symlink_to(outside)  # a folder elsewhere: followed
    (root / "dog" / "alias").symlink_to(root / "dog" / "real")  # one real folder, two paths: listed once
    with caplog.at_level(logging.WARNING, logger="threadloader"):  # os.walk would list for hours
        folder = _within(20, lambda: ImageFolder(root), release=lambda: None)
    expected = [("cat/a.jpg", 0), ("cat/ext/c.jpg", 0), ("cat/sub/b.jpg", 0), ("dog/d.jpg", 1)]
    expected.append(("dog/alias/e.jpg", 1))  # a folder's own files first, as torchvision lists them
    assert [(os.path.relpath(path, root), target) for path, target in folder.samples] == expected
    loops = sorted(record.getMessage() for record in caplog.records if "symlink loop" in record.getMessage())
    assert len(loops) == 2 and repr(str(root / "cat" / "everything")) in loops[0]


def test_a_class_folder_that_links_to_the_root_is_no_class(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only links inside the class folders were checked: a class folder linking to the root filed every
    image again under its own label."""
    root = tmp_path / "root"
    for name in ("cat/a.jpg", "dog/d.jpg"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(GOOD[0])
    (root / "zz_all").symlink_to(root)
    with caplog.at_level(logging.WARNING, logger="threadloader"):
        folder = ImageFolder(root)
    assert folder.classes == ["cat", "dog"]
    assert [(os.path.relpath(path, root), target) for path, target in folder.samples] == [
        ("cat/a.jpg", 0),
        ("dog/d.jpg", 1),
    ]
    assert any(
        "symlink loop" in record.getMessage() and "zz_all" in record.getMessage() for record in caplog.records
    )


class _Broken(PillowDecoder):
    """Pillow's output, broken the way a decoder of one's own can break it."""

    def __init__(self, breaking: Callable[[object, int], object]) -> None:
        super().__init__()
        self.breaking = breaking

    def decode(self, encoded, *, stream, stats=None, region_of=None, pad=False):  # type: ignore[no-untyped-def]
        return self.breaking(super().decode(encoded, stream=stream), len(encoded))


def _rows(decoded: object, count: int) -> object:
    from threadloader.decode import DecodedBatch

    return DecodedBatch(extents=[(8, 8)] * count, rows=set(range(count)))  # rows, but no batch


def _chw(decoded: object, count: int) -> object:
    from threadloader.decode import DecodedBatch

    return DecodedBatch.of_images([image.permute(2, 0, 1).contiguous() for image in decoded.own.values()])  # type: ignore[attr-defined]


def _rgba(decoded: object, count: int) -> object:
    from threadloader.decode import DecodedBatch

    images = [torch.cat([image, image[..., :1]], dim=2) for image in decoded.own.values()]  # type: ignore[attr-defined]
    return DecodedBatch.of_images(images)


def _failed_without_reason(decoded: object, count: int) -> object:
    from threadloader.decode import DecodedBatch

    return DecodedBatch(extents=[None] * count)


@pytest.mark.parametrize(
    ("breaking", "error", "message"),
    [
        # a forgotten return gave an empty epoch, no error, nothing counted
        (lambda decoded, count: None, TypeError, r"_Broken\.decode returned NoneType, not a DecodedBatch"),
        (lambda decoded, count: list(decoded.own.values()), TypeError, "returned list, not a DecodedBatch"),
        # an entry short: a bare IndexError in the pipeline
        (
            lambda decoded, count: type(decoded).of_images([decoded.own[0]]),
            ValueError,
            "1 extents for 2 inputs",
        ),
        (_rows, TypeError, r"rows \[0, 1\] need a \(B, H, W, 3\) uint8 batch that holds them, got NoneType"),
        # CHW and RGBA images came out as batches of the wrong shape, with no error
        (_chw, TypeError, r"image 0 must be an \(H, W, 3\) uint8 tensor of its extent, got .* shape \(3, "),
        (_rgba, TypeError, r"image 0 must be an \(H, W, 3\) uint8 tensor of its extent, got .*, 4\)"),
        (_failed_without_reason, ValueError, r"failed positions \[0, 1\] without a reason in errors"),
    ],
    ids=["None", "a list", "an entry short", "rows without a batch", "CHW", "RGBA", "no reason"],
)
def test_a_decoder_that_breaks_the_contract_is_named_at_its_batch(
    breaking: Callable[[object, int], object], error: type[Exception], message: str
) -> None:
    samples = [(GOOD[0], 0), (GOOD[1], 1)]
    broken = ThreadLoader(samples, batch_size=2, device="cpu", decoder=_Broken(breaking))
    with broken, pytest.raises(error, match=message):
        next(iter(broken))
    with ThreadLoader(samples, batch_size=2, device="cpu", decoder=_Broken(lambda d, c: d)) as loader:
        assert [targets.tolist() for _, targets in loader] == [[0, 1]]  # the same decoder, unbroken
