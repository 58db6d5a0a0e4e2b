"""Images of different sizes decoded into one padded batch and resized from it, on the CPU.

The GPU decoder decodes whole images of different sizes into one padded tensor when the output resizes
them (tests/test_gpu.py checks its pixels); this is the pipeline's side, with a Pillow decoder that pads
the way the GPU does, against independent references: plain torch on Pillow's pixels.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from threadloader import ThreadLoader
from threadloader._output import OutputFormat
from threadloader.decode import DecodedBatch, PillowDecoder
from threadloader.transforms import Resize

from .conftest import encode, photo, pil_reference

SIZES = [(30, 40), (52, 33), (41, 41), (64, 20), (17, 70), (33, 52), (48, 48)]
SAMPLES = [(encode(photo(h, w, seed=i), quality=90), i) for i, (h, w) in enumerate(SIZES)]
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


class PaddingDecoder(PillowDecoder):
    """Pillow, then every image at the top left of a padded batch with junk around it, as the GPU pads."""

    def __init__(self) -> None:
        super().__init__()
        self.pad_given: list[bool] = []

    def decode(self, encoded, *, stream, stats=None, region_of=None, pad=False):  # type: ignore[no-untyped-def]
        self.pad_given.append(pad)
        batch = super().decode(encoded, stream=stream, stats=stats)
        if not pad:
            return batch
        height = max(image.shape[0] for image in batch.own.values())
        width = max(image.shape[1] for image in batch.own.values())
        padded = torch.full((len(encoded), height, width, 3), 255, dtype=torch.uint8)  # junk
        for position, image in batch.own.items():
            padded[position, : image.shape[0], : image.shape[1]] = image
        return DecodedBatch(extents=batch.extents, errors=batch.errors, batch=padded, rows=set(batch.own))


def _expected(data: bytes, size: tuple[int, int]) -> torch.Tensor:
    """torchvision's float recipe written out: Pillow's pixels, antialiased bilinear, scale, normalize."""
    pixels = torch.from_numpy(pil_reference(data)).permute(2, 0, 1).float()[None]
    resized = F.interpolate(pixels, size=size, mode="bilinear", antialias=True, align_corners=False)[0]
    return (resized / 255 - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)


@pytest.mark.parametrize("decode_batch_size", [3, 7])
def test_a_padded_batch_is_resized_from_each_image_alone(decode_batch_size: int) -> None:
    decoder = PaddingDecoder()
    options = dict(batch_size=3, size=(24, 32), dtype=torch.float32, mean=MEAN, std=STD, num_threads=2)
    with ThreadLoader(SAMPLES, decoder=decoder, decode_batch_size=decode_batch_size, **options) as loader:
        got = {
            t: image for images, targets in loader for image, t in zip(images, targets.tolist(), strict=True)
        }
    assert decoder.pad_given and all(decoder.pad_given)
    assert sorted(got) == list(range(len(SAMPLES)))
    for target, image in got.items():
        torch.testing.assert_close(image, _expected(SAMPLES[target][0], (24, 32)), atol=2e-4, rtol=0)


def test_a_padded_group_with_a_bad_sample_resizes_its_other_batches_from_the_padding() -> None:
    # The second batch holds the bad sample (its images are resized one by one); the first and the
    # last are read from the padded tensor; every image as the reference has it.
    samples = [*SAMPLES[:4], (b"not an image", 99), *SAMPLES[4:]]
    options = dict(batch_size=3, size=(24, 32), dtype=torch.float32, mean=MEAN, std=STD)
    with ThreadLoader(
        samples, decoder=PaddingDecoder(), decode_batch_size=9, on_error="skip", **options
    ) as loader:
        batches = [(images, targets.tolist()) for images, targets in loader]
        assert loader.stats().skipped == 1
    assert [targets for _, targets in batches] == [[0, 1, 2], [3, 4], [5, 6]]
    for images, targets in batches:
        for image, target in zip(images, targets, strict=True):
            torch.testing.assert_close(image, _expected(SAMPLES[target][0], (24, 32)), atol=2e-4, rtol=0)


def test_pad_is_asked_only_where_the_output_resizes_without_a_transform() -> None:
    for options, asked in (
        (dict(size=(24, 32)), True),
        (dict(), False),  # a list of images at their own sizes
        (dict(transform=[Resize((24, 32))]), False),  # the transform takes the images
    ):
        decoder = PaddingDecoder()
        with ThreadLoader(SAMPLES, batch_size=4, decoder=decoder, **options) as loader:
            assert sum(len(targets) for _, targets in loader) == len(SAMPLES)
        assert set(decoder.pad_given) == {asked}, options


def test_extents_are_checked() -> None:
    output = OutputFormat(size=(8, 8))
    with pytest.raises(ValueError, match=r"one extent per row; got size=\(8, 8\), Tensor of 2, 1 extents"):
        output.apply(torch.zeros(2, 3, 10, 10, dtype=torch.uint8), extents=[(5, 5)])
    with pytest.raises(ValueError, match="got size=None"):
        OutputFormat().apply(torch.zeros(1, 3, 10, 10, dtype=torch.uint8), extents=[(5, 5)])
