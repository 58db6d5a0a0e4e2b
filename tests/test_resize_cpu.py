"""The CPU resize of images of mixed sizes: each image is torch's resize of that image alone.

References are plain ``F.interpolate`` calls written here, one image at a time (torch's bilinear
filter with antialias, what torchvision's ``Resize`` runs on tensors). The images are laid out as the
Pillow decoder gives them: ``(H, W, 3)`` memory seen as ``(3, H, W)``.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from threadloader import OutputFormat, ThreadLoader
from threadloader.transforms import RandomResizedCrop, Resize

from .conftest import encode, photo

SIZE = (56, 64)
#: Smaller, larger and equal to SIZE, on either side: downscales, upscales and mixed.
SHAPES = [(75, 101), (120, 64), (33, 47), (56, 64), (20, 30), (300, 410), (61, 200)]
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def decoded(height: int, width: int, seed: int = 0) -> torch.Tensor:
    """A ``(3, H, W)`` uint8 view of ``(H, W, 3)`` memory, as the decoders hand images on."""
    return torch.from_numpy(photo(height, width, seed)).permute(2, 0, 1)


IMAGES = [decoded(h, w, seed) for seed, (h, w) in enumerate(SHAPES)]


def interpolated(image: torch.Tensor, size: tuple[int, int] = SIZE) -> torch.Tensor:
    """torch's antialiased bilinear resize of one ``(3, H, W)`` image, in its own dtype."""
    return F.interpolate(image[None], size=size, mode="bilinear", antialias=True, align_corners=False)[0]


def float_reference(image: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float output's definition: resized in float, scaled to [0, 1], normalized; never rounded."""
    scaled = interpolated(image.to(dtype)) / 255
    return (scaled - torch.tensor(MEAN, dtype=dtype).view(3, 1, 1)) / torch.tensor(STD, dtype=dtype).view(
        3, 1, 1
    )


@pytest.mark.parametrize("layout", ["decoded", "contiguous"])
def test_uint8_images_of_mixed_sizes_are_torchs_uint8_resize_of_each(layout: str) -> None:
    images = IMAGES if layout == "decoded" else [image.contiguous() for image in IMAGES]
    batch = OutputFormat(size=SIZE).apply(images)
    assert isinstance(batch, torch.Tensor) and batch.shape == (len(images), 3, *SIZE)
    assert batch.dtype == torch.uint8 and batch.is_contiguous()
    for out, image in zip(batch, images, strict=True):
        assert torch.equal(out, interpolated(image))
        # torch's uint8 kernel works in fixed point: never more than 1 from the float resize rounded.
        rounded = interpolated(image.float()).round().clamp(0, 255)
        assert (out.float() - rounded).abs().max() <= 1


@pytest.mark.parametrize("layout", ["decoded", "contiguous"])
def test_a_1x1_uint8_output_is_the_float_resize_rounded(layout: str) -> None:
    # torch's own uint8 kernel fails an internal assert for a 1x1 output of contiguous images.
    images = IMAGES if layout == "decoded" else [image.contiguous() for image in IMAGES]
    batch = OutputFormat(size=(1, 1)).apply(images)
    assert isinstance(batch, torch.Tensor) and batch.shape == (len(images), 3, 1, 1)
    for out, image in zip(batch, images, strict=True):
        expected = interpolated(image.float(), (1, 1)).round().clamp(0, 255).to(torch.uint8)
        assert torch.equal(out, expected)


def test_a_1x1_output_of_same_size_photos_loads() -> None:
    blobs = [encode(photo(20, 30, seed), "JPEG") for seed in range(3)]
    (images, _), *rest = ThreadLoader(blobs, batch_size=3, size=(1, 1), device="cpu")
    assert images.shape == (3, 3, 1, 1) and images.dtype == torch.uint8 and not rest


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
def test_float_outputs_of_mixed_sizes_are_the_float_resize_of_each(
    dtype: torch.dtype, channels_last: bool
) -> None:
    batch = OutputFormat(size=SIZE, dtype=dtype, mean=MEAN, std=STD, channels_last=channels_last).apply(
        IMAGES
    )
    assert isinstance(batch, torch.Tensor) and batch.dtype == dtype
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert batch.is_contiguous(memory_format=layout)
    for out, image in zip(batch, IMAGES, strict=True):
        torch.testing.assert_close(out, float_reference(image, dtype), rtol=0, atol=1e-5)


def test_float_outputs_are_not_rounded_to_integers_on_the_way() -> None:
    batch = OutputFormat(size=SIZE, dtype=torch.float32).apply(IMAGES)
    for out, image in zip(batch, IMAGES, strict=True):
        expected = interpolated(image.float()) / 255
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
        if tuple(image.shape[-2:]) != SIZE:  # a resized image keeps fractions of a 0-255 step
            assert (out * 255 - (out * 255).round()).abs().max() > 0.1


def test_resize_transform_on_a_list_resizes_each_image() -> None:
    out = Resize(SIZE).apply_many(IMAGES, [None] * len(IMAGES))
    for row, image in zip(out, IMAGES, strict=True):
        assert torch.equal(row, interpolated(image))


def test_random_resized_crops_are_each_crop_resized_alone() -> None:
    crop = RandomResizedCrop(SIZE)
    generator = torch.Generator().manual_seed(3)
    regions = [crop.sample((image.shape[-2], image.shape[-1]), generator) for image in IMAGES]
    assert len({region[2:] for region in regions}) > 1  # crops of several sizes in one batch
    crops = [
        image[:, t : t + h, left : left + w] for image, (t, left, h, w) in zip(IMAGES, regions, strict=True)
    ]
    out = crop.apply_many(IMAGES, regions)
    for row, part in zip(out, crops, strict=True):
        assert torch.equal(row, interpolated(part))
    # Float images (after a ToDtype) are resampled in float.
    floats = [image.float() / 255 for image in IMAGES]
    out = crop.apply_many(floats, regions)
    for row, part in zip(out, crops, strict=True):
        torch.testing.assert_close(row, interpolated(part.float() / 255), rtol=0, atol=1e-6)


def _formats() -> list[OutputFormat]:
    return [OutputFormat(size=SIZE), OutputFormat(size=SIZE, dtype=torch.float32, mean=MEAN, std=STD)]


@pytest.mark.parametrize("output", _formats(), ids=["uint8", "float32"])
def test_an_image_gives_the_same_pixels_whatever_else_is_in_its_batch(output: OutputFormat) -> None:
    image = IMAGES[0]
    twin = decoded(*SHAPES[0], seed=99)  # same size: a batch of the two is one stacked tensor
    batches: dict[str, tuple[Any, int]] = {  # each batch, and where the image is in it
        "alone": ([image], 0),
        "with larger and smaller": ([IMAGES[5], image, IMAGES[4]], 1),
        "with every size": ([*IMAGES[1:], image], len(IMAGES) - 1),
        "stacked, same size": (torch.stack([twin, image]), 1),
        "list, same size": ([twin, image, twin], 1),
    }
    rows = {name: output.apply(batch)[position] for name, (batch, position) in batches.items()}
    differ = [name for name, row in rows.items() if not torch.equal(row, rows["alone"])]
    assert differ == []


def test_random_resized_crop_of_an_image_does_not_depend_on_its_batch() -> None:
    crop = RandomResizedCrop(SIZE)
    region = (10, 20, 50, 70)
    alone = crop.apply_many([IMAGES[0]], [region])[0]
    mixed = crop.apply_many([IMAGES[5], IMAGES[0], IMAGES[2]], [(0, 0, 300, 410), region, (1, 2, 30, 40)])[1]
    assert torch.equal(alone, mixed)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_the_loader_gives_an_image_the_same_pixels_in_any_batch(dtype: torch.dtype) -> None:
    """End to end: decoded by Pillow, then batched with different neighbours (or none)."""
    blobs = [encode(photo(h, w, seed), quality=90) for seed, (h, w) in enumerate(SHAPES)]
    options: dict[str, Any] = {"size": SIZE, "dtype": dtype, "num_threads": 2, "device": "cpu"}
    if dtype != torch.uint8:
        options |= {"mean": MEAN, "std": STD}
    seen: dict[int, list[torch.Tensor]] = {}
    for batch_size in (1, 3, len(blobs)):
        with ThreadLoader(
            [(blob, i) for i, blob in enumerate(blobs)], batch_size=batch_size, **options
        ) as loader:
            for images, targets in loader:
                for image, target in zip(images, targets.tolist(), strict=True):
                    seen.setdefault(target, []).append(image)
    assert sorted(seen) == list(range(len(blobs)))
    for target, versions in seen.items():
        assert len(versions) == 3 and all(torch.equal(v, versions[0]) for v in versions), target


@pytest.mark.parametrize("per_chunk", [1, 2, 5])
def test_the_gpu_resampling_kernel_in_chunks_is_each_crop_resized_alone(
    per_chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's batched kernel (matrix products, in chunks of bounded memory, each with its own
    weights), run here on the CPU as CI has no GPU: each image gets its own weights. Reference:
    torch's own antialiased interpolate of each crop, in float."""
    from threadloader.transforms import functional

    sizes = ((40, 60), (90, 33), (75, 101), (64, 64), (33, 90))
    images = [torch.from_numpy(photo(h, w, 20 + i)).permute(2, 0, 1) for i, (h, w) in enumerate(sizes)]
    regions = [(0, 0, 40, 60), (10, 3, 50, 20), (5, 7, 60, 80), (0, 0, 64, 64), (3, 10, 30, 70)]
    per_image = functional._elements_per_image(3, (90, 101), (24, 28))  # at the padded size
    monkeypatch.setattr(functional, "_RESAMPLE_ELEMENTS", per_chunk * per_image)
    got = functional._resample_batched(images, regions, sizes, (24, 28), True, torch.float32)
    for image, (top, left, height, width), row in zip(images, regions, got, strict=True):
        crop = image[:, top : top + height, left : left + width].float()[None]
        expected = F.interpolate(crop, size=(24, 28), mode="bilinear", antialias=True, align_corners=False)
        torch.testing.assert_close(row, expected[0], rtol=0, atol=1e-3)
    as_uint8 = functional._resample_batched(images, regions, sizes, (24, 28), True, None)
    assert as_uint8.dtype == torch.uint8
    assert (as_uint8.int() - got.round().int()).abs().max() <= 1


def test_the_gpu_resampling_kernel_in_chunks_reads_a_padded_batch_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decoded batch tensor (each image at the top left of its row) in chunks of one and two rows,
    to float64: each row's region resampled alone. Reference: torch's interpolate of each crop."""
    from threadloader.transforms import functional

    extents = ((40, 60), (90, 33), (75, 101))
    batch = torch.zeros((3, 3, 90, 101), dtype=torch.uint8)
    for row, (i, (h, w)) in zip(batch, enumerate(extents), strict=True):
        row[:, :h, :w] = torch.from_numpy(photo(h, w, 30 + i)).permute(2, 0, 1)
    regions = [(0, 0, 40, 60), (10, 3, 50, 20), (5, 7, 60, 80)]
    per_image = functional._elements_per_image(3, (90, 101), (24, 28))
    for per_chunk in (1, 2):
        monkeypatch.setattr(functional, "_RESAMPLE_ELEMENTS", per_chunk * per_image)
        got = functional._resample_batched(batch, regions, [(90, 101)] * 3, (24, 28), False, torch.float64)
        assert got.dtype == torch.float64
        for row, image, (top, left, height, width) in zip(got, batch, regions, strict=True):
            crop = image[:, top : top + height, left : left + width].double()[None]
            expected = F.interpolate(
                crop, size=(24, 28), mode="bilinear", antialias=False, align_corners=False
            )
            torch.testing.assert_close(row, expected[0], rtol=0, atol=1e-6, msg=str(per_chunk))


class _PeakMemory(TorchDispatchMode):
    """Bytes of the tensors that torch's ops make inside the block and that are still alive: the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self._seen:
                    self._seen.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, size)
        return out


def test_the_gpu_resampling_kernel_holds_about_its_result_in_memory() -> None:
    """The matrix products (the GPU's path for images of different sizes, and for everything without
    Triton) on large photos: their float copies, products and weights, chunk by chunk, must not hold
    much more memory than the result. Building every image's weights at once, or padding the whole
    batch to float at once, takes several times more. Pixels: torch's interpolate of each image."""
    from threadloader.transforms import functional

    sizes = [(512, 640), (300, 451), (400, 600), (427, 640)] * 4
    images = [torch.from_numpy(photo(h, w, i)).permute(2, 0, 1) for i, (h, w) in enumerate(sizes)]
    regions = [(0, 0, h, w) for h, w in sizes]
    with _PeakMemory() as memory:
        got = functional._resample_batched(images, regions, sizes, (256, 256), True, torch.float32)
    result = got.numel() * got.element_size()
    assert memory.peak <= 3 * result, (memory.peak / 2**20, result / 2**20)
    for image, row in zip(images, got, strict=True):
        expected = F.interpolate(
            image.float()[None], size=(256, 256), mode="bilinear", antialias=True, align_corners=False
        )
        torch.testing.assert_close(row, expected[0], rtol=0, atol=1e-2)
