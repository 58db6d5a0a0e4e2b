"""Bad inputs, other formats, faults and long runs on the CPU path (the GPU twin is test_gpu_robustness)."""

from __future__ import annotations

import gc
import logging
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from threadloader import SampleError, ThreadLoader
from threadloader._stats import StatsRecorder
from threadloader.decode.pillow import PillowDecoder

from .conftest import encode, mean_abs_diff, photo, reader_threads
from .robustness_cases import (
    BAD_INPUTS,
    GOOD,
    MUTATIONS,
    corrupted_entropy_jpeg,
    exit_with_a_loader_open,
    expected_rgb,
    mutate,
    other_formats,
)


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
    data = other_formats()[name]
    with ThreadLoader([(data, 0)], batch_size=1, device="cpu") as loader:
        (images, _), *_ = list(loader)
    expected = expected_rgb(name, data)
    assert tuple(images[0].shape) == (3, *expected.shape[:2])
    assert mean_abs_diff(images[0], expected) == 0


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
    assert batch.images[1] is not None  # the good neighbour is unaffected
    image = batch.images[0]
    assert (image is None) == (0 in batch.errors)
    if image is not None:
        assert image.dtype == torch.uint8 and image.shape[2] == 3
