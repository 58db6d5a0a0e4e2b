"""The GPU's resampling kernel (transforms/_kernels.py) against torch's own resize.

On a GPU the kernel runs compiled; without one, Triton's interpreter runs it on CPU tensors (conftest
sets TRITON_INTERPRET=1 before Triton is imported), so CI checks its arithmetic too: crops,
antialiased downscaling and upscaling, flips, scaling, normalization and layout, each against
``F.interpolate(..., antialias=True)`` on the crop, written out here. Skipped without Triton.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from threadloader.transforms import _kernels

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def on_cpu_too(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(_kernels, "_ON_CPU", True)  # interpreted: see the module's docstring
    yield


def _reference(batch: torch.Tensor, region: tuple[int, int, int, int], size: tuple[int, int]) -> torch.Tensor:
    top, left, height, width = region
    crop = batch[None, :, top : top + height, left : left + width].float().cpu()
    return F.interpolate(crop, size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def _padded(sizes: list[tuple[int, int]], seed: int) -> torch.Tensor:
    """A decoded batch as the GPU decoder leaves it: HWC memory, images at the top left, junk around."""
    generator = torch.Generator().manual_seed(seed)
    height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
    hwc = torch.randint(0, 256, (len(sizes), height, width, 3), dtype=torch.uint8, generator=generator)
    return hwc.permute(0, 3, 1, 2).to(DEVICE)  # (B, 3, H, W) over HWC memory


def test_crops_resized_down_and_flipped_round_as_torch() -> None:
    sizes = [(40, 61), (37, 29), (50, 50), (11, 70)]
    batch = _padded(sizes, 0)
    regions = [(2, 3, h - 5, w - 4) for h, w in sizes]
    flips = [False, True, False, True]
    out = _kernels.resample(batch, regions, (17, 23), dtype=torch.uint8, flips=flips)
    assert out is not None and out.shape == (4, 3, 17, 23) and out.dtype == torch.uint8
    for image, region, flip, got in zip(batch, regions, flips, out.cpu(), strict=True):
        expected = _reference(image, region, (17, 23)).round().clamp(0, 255)
        expected = expected.flip(-1) if flip else expected
        assert (got.int() - expected.int()).abs().max() <= 1  # rounding half-way cases


def test_float_output_is_scaled_normalized_and_laid_out() -> None:
    sizes = [(30, 44), (21, 33)]
    batch = _padded(sizes, 1)
    regions = [(0, 0, h, w) for h, w in sizes]
    out = _kernels.resample(
        batch, regions, (12, 9), dtype=torch.float32, divide=255.0, mean=MEAN, std=STD, channels_last=True
    )
    assert out is not None and out.is_contiguous(memory_format=torch.channels_last)
    mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
    for image, region, got in zip(batch, regions, out.cpu(), strict=True):
        expected = (_reference(image, region, (12, 9)) / 255 - mean) / std
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_upscaling_is_torchs_bilinear() -> None:
    batch = _padded([(9, 13)], 2)
    out = _kernels.resample(batch, [(1, 2, 7, 10)], (20, 31), dtype=torch.float32)
    assert out is not None
    torch.testing.assert_close(out[0].cpu(), _reference(batch[0], (1, 2, 7, 10), (20, 31)), rtol=0, atol=1e-4)


def test_what_the_kernel_does_not_cover_is_left_to_torch() -> None:
    batch = _padded([(8, 8)], 3)
    assert _kernels.resample(batch.double(), [(0, 0, 8, 8)], (4, 4), dtype=torch.float64) is None
    assert _kernels.resample(batch[:, :1], [(0, 0, 8, 8)], (4, 4), dtype=torch.uint8) is None  # one channel


def test_each_image_gets_the_taps_of_its_own_downscale() -> None:
    """Each program walks its own image's taps: a batch of a large image among small ones (factors of 1
    to 9) must come out as each image resized alone, the large one with all its taps, the small ones
    unaffected by the large one's."""
    sizes = [(12, 14), (90, 117), (16, 10), (9, 9)]
    batch = _padded(sizes, 4)
    regions = [(0, 0, h, w) for h, w in sizes]
    out = _kernels.resample(batch, regions, (10, 13), dtype=torch.float32)
    assert out is not None
    for image, region, got in zip(batch, regions, out.cpu(), strict=True):
        # float32 sums over up to 21 x 21 taps: the last bits differ from torch's two passes
        torch.testing.assert_close(got, _reference(image, region, (10, 13)), rtol=1e-5, atol=1e-3)


def test_what_the_kernel_would_clamp_or_not_scale_is_left_to_torch() -> None:
    """Integers wider than uint8 would come out clamped to 0-255; float [0, 1] to uint8 as 0 or 1."""
    batch = _padded([(8, 8)], 5)
    for dtype in (torch.int16, torch.int32, torch.int8):
        assert _kernels.resample(batch.to(dtype), [(0, 0, 8, 8)], (4, 4), dtype=dtype) is None, dtype
    floats = batch.float() / 255
    assert _kernels.resample(floats, [(0, 0, 8, 8)], (4, 4), dtype=torch.uint8) is None
    assert _kernels.resample(batch, [(0, 0, 8, 8)], (4, 4), dtype=torch.int16) is None
    assert _kernels.resample(floats, [(0, 0, 8, 8)], (4, 4), dtype=torch.float16) is not None


def test_float_images_formatted_to_uint8_keep_their_range() -> None:
    """OutputFormat takes float images in [0, 1] (as ToDtype(scale=True) leaves them): to uint8, 0-255."""
    from threadloader import _output

    batch = _padded([(12, 12), (12, 12)], 6).float() / 255
    out = _output.OutputFormat(size=(6, 6), dtype=torch.uint8).apply(batch)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.uint8
    expected = F.interpolate(batch.cpu(), size=(6, 6), mode="bilinear", antialias=True) * 255
    assert (out.cpu().int() - expected.round().int()).abs().max() <= 1
