"""Bad inputs, other formats, fuzzing and a soak on the GPU path (CPU twin: test_robustness.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from threadloader import SampleError, ThreadLoader
from threadloader._stats import StatsRecorder
from threadloader.decode import ImageDecoder

from .conftest import encode, gpu_mismatch, header_only_png, photo, resident_bytes
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

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_bad_input(case: str, on_error: str, tmp_path: Path) -> None:
    make, stage = BAD_INPUTS[case]
    bad = make(tmp_path)
    samples = [(GOOD[0], 0), (bad, 1), (GOOD[1], 2)]
    with ThreadLoader(samples, batch_size=3, device="cuda", on_error=on_error) as loader:  # type: ignore[arg-type]
        if on_error == "raise":
            with pytest.raises(SampleError) as caught:
                list(loader)
            assert caught.value.index == 1 and caught.value.stage == stage and bad in str(caught.value)
        else:
            (images, targets), *rest = list(loader)
            assert not rest and targets.tolist() == [0, 2]
            assert gpu_mismatch(images[1], expected_rgb("", GOOD[1])) is None
            assert loader.stats().skipped == 1


@pytest.mark.parametrize("kind", ["jpeg", "header_only_png"])
def test_pixel_limit_on_the_gpu(kind: str) -> None:
    """Checked from the header: the PNG has no pixel data, so decoding it would fail otherwise."""
    big = encode(photo(120, 100, 1), quality=90) if kind == "jpeg" else header_only_png(4000, 3000)
    loader = ThreadLoader([(big, 0)], batch_size=1, device="cuda", max_pixels=10_000)
    with loader, pytest.raises(SampleError, match="over the limit of 10,000"):
        list(loader)


def test_corrupted_entropy_data_does_not_crash() -> None:
    with ThreadLoader(
        [(corrupted_entropy_jpeg(), 0)], batch_size=1, device="cuda", on_error="skip"
    ) as loader:
        batches = list(loader)
        assert len(batches) + loader.stats().skipped == 1


@pytest.mark.parametrize("name", sorted(other_formats()))
def test_other_formats_match_the_cpu_contract(name: str) -> None:
    data = other_formats()[name]
    with ThreadLoader([(data, 0)], batch_size=1, device="cuda") as loader:
        (images, _), *_ = list(loader)
    expected = expected_rgb(name, data)
    assert images[0].is_cuda and tuple(images[0].shape) == (3, *expected.shape[:2])
    assert gpu_mismatch(images[0], expected) is None


def test_fifty_epochs_without_growth() -> None:
    """Neither device memory (torch's allocator) nor host memory (RSS) grows over 47 epochs."""
    samples = [(GOOD[i % 3], i) for i in range(24)]
    threads_before = threading.active_count()
    with ThreadLoader(samples, batch_size=4, size=(64, 80), dtype=torch.float32, device="cuda") as loader:
        for _ in range(3):
            list(loader)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated()
        resident = resident_bytes()
        for _ in range(47):
            for _batch in loader:
                pass
            assert threading.active_count() == threads_before
        del _batch
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        device_growth = torch.cuda.memory_allocated() - allocated
        host_growth = resident_bytes() - resident
        print(f"over 47 epochs: device memory {device_growth:+,} bytes, RSS {host_growth / 2**20:+.1f} MiB")
        assert device_growth <= 0
        assert host_growth < 48 * 2**20
        assert loader.stats().samples == 50 * 24


@pytest.fixture(scope="module")
def fuzz_decoder() -> Iterator[tuple[ImageDecoder, torch.cuda.Stream]]:
    from threadloader.decode.nvimgcodec import NvImageCodecDecoder

    decoder = NvImageCodecDecoder(torch.device("cuda", 0), decode_threads=2)
    yield decoder, torch.cuda.Stream()
    decoder.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**MUTATIONS)
def test_fuzz_mutated_jpegs_through_nvimagecodec(
    fuzz_decoder: tuple[ImageDecoder, torch.cuda.Stream], edits: list[tuple[int, int]], cut: int
) -> None:
    """A mutated JPEG fails alone: the good image beside it and the decoder's later batches are intact.

    One decoder takes every example: a decoder an example spent 0.44 s of each making and ending its
    pools, which the registry's tests cover.
    """
    decoder, stream = fuzz_decoder
    mutated = mutate(GOOD[0], edits, cut)
    batch = decoder.decode([mutated, GOOD[1]], stream=stream, stats=StatsRecorder())
    stream.synchronize()
    assert (batch.extents[0] is None) == (0 in batch.errors)
    good = batch.image(1)
    assert good is not None and gpu_mismatch(good, expected_rgb("", GOOD[1])) is None


def test_interpreter_exit_with_a_gpu_loader_open(tmp_path: Path) -> None:
    """A script that leaves a GPU loader mid-epoch exits promptly, cleanly and without native messages."""
    result = exit_with_a_loader_open(tmp_path, "cuda")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "started"
    # nvImageCodec may print notices when imported (optional libraries); nothing may go wrong at exit.
    alarms = ("traceback", "exception", "terminate", "error", "fault", "abort")
    assert not [line for line in result.stderr.splitlines() if any(a in line.lower() for a in alarms)]
