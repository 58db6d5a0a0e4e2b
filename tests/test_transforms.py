"""Transforms: torchvision.transforms.v2 parity (where torchvision is installed), exact checks without
it, and reproducible random crops in the loader whatever the thread count."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from threadloader import ThreadLoader
from threadloader._options import as_transform
from threadloader._seeding import sample_generator
from threadloader.decode import DecodedBatch, ImageDecoder, PillowDecoder
from threadloader.transforms import (
    CenterCrop,
    Compose,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToDtype,
    Transform,
)
from threadloader.transforms.functional import resize

from .conftest import encode, photo, pil_reference

IMAGE = torch.from_numpy(photo(75, 101, 3)).permute(2, 0, 1).contiguous()  # (3, 75, 101) uint8


def mean_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().mean())


# -- without torchvision: exact expectations ------------------------------------------------------


@pytest.mark.parametrize("size", [(40, 60), (75, 101), (80, 110), (10, 200)])
def test_center_crop_matches_slicing_and_pads_with_zeros(size: tuple[int, int]) -> None:
    out = CenterCrop(size)(IMAGE)
    assert tuple(out.shape) == (3, *size)
    padded = np.zeros((3, max(75, size[0]), max(101, size[1])), dtype=np.uint8)
    top_pad, left_pad = max(size[0] - 75, 0) // 2, max(size[1] - 101, 0) // 2
    padded[:, top_pad : top_pad + 75, left_pad : left_pad + 101] = IMAGE.numpy()
    top = round((padded.shape[1] - size[0]) / 2.0)
    left = round((padded.shape[2] - size[1]) / 2.0)
    np.testing.assert_array_equal(out.numpy(), padded[:, top : top + size[0], left : left + size[1]])


def test_flip_is_exact_and_follows_the_generator() -> None:
    flipped = RandomHorizontalFlip(p=1.0)(IMAGE)
    np.testing.assert_array_equal(flipped.numpy(), IMAGE.numpy()[:, :, ::-1])
    assert torch.equal(RandomHorizontalFlip(p=0.0)(IMAGE), IMAGE)
    draws = [RandomHorizontalFlip().sample((1, 1), torch.Generator().manual_seed(s)) for s in range(200)]
    assert 60 < sum(draws) < 140


@pytest.mark.parametrize(
    ("size", "max_size", "expected"),
    [(50, None, (50, 67)), ((30, 40), None, (30, 40)), (60, 70, (52, 70)), (100, None, (100, 134))],
)
def test_resize_output_size_rule(size, max_size, expected) -> None:  # type: ignore[no-untyped-def]
    transform = Resize(size, max_size=max_size)
    assert transform.output_size((75, 101)) == expected
    assert tuple(transform(IMAGE).shape[-2:]) == expected


def test_random_resized_crop_region_rule_and_reproducibility() -> None:
    transform = RandomResizedCrop(32, scale=(0.2, 0.9), ratio=(0.5, 2.0))
    for seed in range(100):
        top, left, height, width = transform.sample((75, 101), torch.Generator().manual_seed(seed))
        assert top >= 0 and top + height <= 75 and left >= 0 and left + width <= 101
        out = transform.apply(IMAGE, (top, left, height, width))
        expected = resize(IMAGE[:, top : top + height, left : left + width], (32, 32))
        assert (out.int() - expected.int()).abs().max() <= 1  # resample_many: same filter, other sum order
    same = [transform(IMAGE, generator=torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(same[0], same[1])


def test_random_resized_crop_falls_back_to_a_central_crop() -> None:
    # No region of 90-100% of the area has an aspect ratio within (3, 4) in a square image.
    transform = RandomResizedCrop(8, scale=(0.9, 1.0), ratio=(3.0, 4.0))
    assert transform.sample((60, 60), torch.Generator().manual_seed(0)) == (20, 0, 20, 60)


def test_normalize_and_to_dtype() -> None:
    floats = ToDtype(torch.float32, scale=True)(IMAGE)
    assert torch.equal(floats, IMAGE.float() / 255)
    normalized = Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.5))(floats)
    expected = (floats - torch.tensor([0.5, 0.4, 0.3]).view(3, 1, 1)) / torch.tensor([0.2, 0.25, 0.5]).view(
        3, 1, 1
    )
    torch.testing.assert_close(normalized, expected, rtol=0, atol=1e-6)
    with pytest.raises(TypeError, match="float"):
        Normalize((0.5,) * 3, (0.5,) * 3)(IMAGE)


def test_batches_get_one_set_of_parameters() -> None:
    batch = torch.stack([IMAGE, IMAGE.flip(-1)])
    out = RandomResizedCrop(16)(batch, generator=torch.Generator().manual_seed(3))
    single = RandomResizedCrop(16)(IMAGE, generator=torch.Generator().manual_seed(3))
    assert torch.equal(out[0], single)


def test_compose_and_as_transform() -> None:
    chain = as_transform([RandomResizedCrop(20), RandomHorizontalFlip(), ToDtype(torch.float32, scale=True)])
    assert isinstance(chain, Compose) and chain.random and chain.output_size(None) == (20, 20)
    assert Compose([Resize(30)]).output_size(None) is None
    assert not Compose([CenterCrop(10), Normalize((0,) * 3, (1,) * 3)]).random
    with pytest.raises(TypeError, match="not a threadloader transform"):
        as_transform([lambda image: image])  # type: ignore[list-item]


# -- in the loader --------------------------------------------------------------------------------

SAMPLES = [(encode(photo(60 + 7 * (i % 3), 80, seed=400 + i), quality=90), i) for i in range(20)]
REFERENCES = [torch.from_numpy(pil_reference(data)).permute(2, 0, 1) for data, _ in SAMPLES]


def _epoch(
    num_threads: int, epoch: int, decoder: ImageDecoder | None = None
) -> list[tuple[torch.Tensor, list[int]]]:
    transform = [RandomResizedCrop(24), RandomHorizontalFlip()]
    loader = ThreadLoader(
        SAMPLES,
        batch_size=6,
        shuffle=True,
        seed=11,
        num_threads=num_threads,
        transform=transform,
        device="cpu",
        decoder=decoder,
    )
    with loader:
        loader.set_epoch(epoch)
        return [(images, targets.tolist()) for images, targets in loader]


def test_random_crops_are_the_same_for_any_thread_count_and_run() -> None:
    one, four, again = _epoch(1, 0), _epoch(4, 0), _epoch(4, 0)
    for (a, ta), (b, tb), (c, tc) in zip(one, four, again, strict=True):
        assert ta == tb == tc
        assert torch.equal(a, b) and torch.equal(a, c)
        assert a.shape[1:] == (3, 24, 24)  # a fixed-size transform gives stacked batches


def test_random_crops_are_exactly_the_transform_of_the_decoded_image() -> None:
    transform = Compose([RandomResizedCrop(24), RandomHorizontalFlip()])
    for images, targets in _epoch(2, 3):
        for image, index in zip(images, targets, strict=True):
            expected = transform(REFERENCES[index], generator=sample_generator(11, 3, index))
            # The same crop and flip; the batch is resampled at once, so a pixel may round otherwise.
            assert (image.int() - expected.int()).abs().max() <= 1


class RegionDecoder(PillowDecoder):
    """Decodes with Pillow, then keeps only the region asked for, in a padded batch as the GPU does."""

    def decode(self, encoded, *, stream, stats=None, region_of=None, pad=False):  # type: ignore[no-untyped-def]
        whole = super().decode(encoded, stream=stream, stats=stats)
        assert region_of is not None and not whole.errors
        regions = {}
        for position, extent in enumerate(whole.extents):
            region = region_of(position, extent)
            assert region is not None
            regions[position] = region
        height = max(h for _, _, h, _ in regions.values())
        width = max(w for _, _, _, w in regions.values())
        padded = torch.full((len(encoded), height, width, 3), 255, dtype=torch.uint8)  # junk margins
        for position, (top, left, h, w) in regions.items():
            padded[position, :h, :w] = whole.own[position][top : top + h, left : left + w]
        return DecodedBatch(
            extents=[(h, w) for _, _, h, w in regions.values()],
            batch=padded,
            rows=set(regions),
            regions=set(regions),
        )


def test_a_decoder_of_regions_gives_the_crops_of_whole_decoding() -> None:
    """The pipeline's side of region decoding, which CI can run: regions asked for by the transform,
    decoded into a padded batch, resized at once; the same crops as decoding whole images."""
    whole = _epoch(2, 3)
    regions = _epoch(2, 3, RegionDecoder())
    for (a, ta), (b, tb) in zip(whole, regions, strict=True):
        assert ta == tb
        assert (a.int() - b.int()).abs().max() <= 1


def test_random_crops_differ_between_epochs() -> None:
    first, second = _epoch(2, 0), _epoch(2, 1)
    by_index = {t: img for images, targets in first for img, t in zip(images, targets, strict=True)}
    changed = sum(
        not torch.equal(by_index[t], img)
        for images, targets in second
        for img, t in zip(images, targets, strict=True)
    )
    assert changed > 15


def test_deterministic_transform_on_a_same_size_batch_equals_per_image() -> None:
    same_size = [(encode(photo(60, 80, seed=500 + i), quality=90), i) for i in range(8)]
    options = dict(batch_size=4, transform=[CenterCrop((40, 50)), ToDtype(torch.float32, scale=True)])
    with ThreadLoader(same_size, dtype=torch.float32, device="cpu", **options) as loader:  # type: ignore[arg-type]
        batches = [images for images, _ in loader]
    for batch, start in zip(batches, (0, 4), strict=True):
        for row, (data, _) in zip(batch, same_size[start : start + 4], strict=True):
            reference = torch.from_numpy(pil_reference(data)).permute(2, 0, 1)
            assert torch.equal(row, CenterCrop((40, 50))(reference).float() / 255)


# -- parity with torchvision.transforms.v2 (skipped where torchvision is not installed) ----------


@pytest.fixture(scope="module")
def v2():  # type: ignore[no-untyped-def]
    return pytest.importorskip("torchvision.transforms.v2")


@pytest.mark.parametrize("size", [50, (33, 47), (120, 160)])
def test_resize_parity(v2, size) -> None:  # type: ignore[no-untyped-def]
    ours = Resize(size)(IMAGE)
    theirs = v2.Resize(size, antialias=True)(IMAGE)
    assert ours.shape == theirs.shape
    assert mean_abs_diff(ours, theirs) <= 1.0
    floats = IMAGE.float() / 255
    torch.testing.assert_close(
        Resize(size)(floats), v2.Resize(size, antialias=True)(floats), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("size", [(40, 60), (75, 101), (80, 110), 33])
def test_center_crop_parity(v2, size) -> None:  # type: ignore[no-untyped-def]
    assert torch.equal(CenterCrop(size)(IMAGE), v2.CenterCrop(size)(IMAGE))


@pytest.mark.parametrize("seed", range(20))
def test_random_resized_crop_parity(v2, seed: int) -> None:  # type: ignore[no-untyped-def]
    options = {"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3)}
    torch.manual_seed(seed)
    theirs = v2.RandomResizedCrop(32, antialias=True, **options)(IMAGE)
    ours = RandomResizedCrop(32, **options)(IMAGE, generator=torch.Generator().manual_seed(seed))
    assert mean_abs_diff(ours, theirs) <= 1.0
    torch.manual_seed(seed)
    region = v2.RandomResizedCrop(32, **options).make_params([IMAGE])
    expected = (region["top"], region["left"], region["height"], region["width"])
    assert RandomResizedCrop(32, **options).sample((75, 101), torch.Generator().manual_seed(seed)) == expected


@pytest.mark.parametrize("seed", range(10))
def test_flip_parity(v2, seed: int) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    theirs = v2.RandomHorizontalFlip()(IMAGE)
    assert torch.equal(RandomHorizontalFlip()(IMAGE, generator=torch.Generator().manual_seed(seed)), theirs)


def test_normalize_and_dtype_parity(v2) -> None:  # type: ignore[no-untyped-def]
    theirs = v2.Compose(
        [v2.ToDtype(torch.float32, scale=True), v2.Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.5))]
    )
    ours = Compose([ToDtype(torch.float32, scale=True), Normalize((0.5, 0.4, 0.3), (0.2, 0.25, 0.5))])
    torch.testing.assert_close(ours(IMAGE), theirs(IMAGE), atol=1e-6, rtol=0)


def test_normalize_refuses_a_std_zero_in_the_dtype_as_torchvision(v2) -> None:  # type: ignore[no-untyped-def]
    """As torchvision's tensor ``normalize`` refuses it (v2's checks the Python floats only, and lets
    1e-8 through to divide float16 images by zero)."""
    from torchvision.transforms import functional

    images = torch.rand(3, 4, 5, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"std evaluated to zero after conversion to torch\.float16"):
        functional.normalize(images, [0.5] * 3, [1e-8] * 3)
    with pytest.raises(ValueError, match=r"std evaluated to zero after conversion to torch\.float16"):
        Normalize((0.5,) * 3, (1e-8,) * 3)(images)


def test_random_resized_crop_takes_any_leading_dimensions() -> None:
    stack = torch.stack([IMAGE, IMAGE.flip(-1)]).unsqueeze(0)  # (1, 2, 3, H, W)
    out = RandomResizedCrop(16).apply(stack, (3, 4, 50, 60))
    assert out.shape == (1, 2, 3, 16, 16)
    assert torch.equal(out[0, 1], RandomResizedCrop(16).apply(IMAGE.flip(-1), (3, 4, 50, 60)))


def test_a_chain_that_normalizes_needs_a_float_output() -> None:
    """uint8, the default output, cannot hold normalized values: they were wrapped into 0-255."""
    jpeg = encode(photo(24, 32))
    normalize = Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    with pytest.raises(ValueError, match=r"normalized values .* dtype=torch.uint8 .* dtype=torch.float32"):
        ThreadLoader([jpeg], device="cpu", transform=[ToDtype(torch.float32, scale=True), normalize])
    chain = [CenterCrop(16), ToDtype(torch.float32, scale=True), normalize]
    with ThreadLoader([jpeg], device="cpu", dtype=torch.float32, transform=chain) as loader:
        images, _ = next(iter(loader))
    assert images.dtype == torch.float32 and images.min() < 0
    back = [ToDtype(torch.float32, scale=True), normalize, ToDtype(torch.uint8)]  # the chain itself goes back
    ThreadLoader([jpeg], device="cpu", transform=back).close()


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_integer_images_past_uint8_keep_their_range_when_resized(dtype: torch.dtype) -> None:
    images = torch.randint(0, 30000, (1, 3, 40, 60), generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = torch.nn.functional.interpolate(
        images.double(), size=(20, 30), mode="bilinear", antialias=True, align_corners=False
    )
    got = Resize((20, 30))(images)
    assert got.dtype == dtype and got.max() > 255
    assert (got.double() - expected.round()).abs().max() <= 1


def test_to_dtype_scales_by_the_integer_types_own_range() -> None:
    """As torchvision's ``to_dtype(scale=True)``: an integer type's range is [0, 1] in floats, and
    integers convert by shifting their value bits (15 for int16, 8 for uint8)."""
    int16 = torch.tensor([0, 1000, 32767], dtype=torch.int16)
    assert torch.allclose(ToDtype(torch.float32, scale=True)(int16), int16.float() / 32767)
    halves = torch.tensor([0.0, 0.5, 1.0])
    assert ToDtype(torch.int16, scale=True)(halves).tolist() == [0, 16383, 32767]
    assert ToDtype(torch.int16, scale=True)(torch.tensor([0, 128, 255], dtype=torch.uint8)).tolist() == [
        0,
        128 << 7,
        255 << 7,
    ]
    assert ToDtype(torch.uint8, scale=True)(torch.tensor([0, 16384, 32767], dtype=torch.int16)).tolist() == [
        0,
        128,
        255,
    ]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_images_resize_on_the_cpu(dtype: torch.dtype) -> None:
    """torch's CPU kernel has no half precision: resized in float32 and cast back, as torchvision does."""
    images = torch.rand(2, 3, 32, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    expected = torch.nn.functional.interpolate(
        images.float(), size=(16, 20), mode="bilinear", antialias=True, align_corners=False
    ).to(dtype)
    assert torch.equal(Resize((16, 20))(images), expected)


def test_sizes_are_read_as_torchvision_reads_them() -> None:
    image = torch.zeros(1, 3, 40, 60, dtype=torch.uint8)
    assert CenterCrop([20])(image).shape[-2:] == (20, 20)
    assert RandomResizedCrop([20]).output_size((40, 60)) == (20, 20)
    assert Resize([20])(image).shape[-2:] == (20, 30)  # the shorter side
    assert CenterCrop(np.int64(20)).size == (20, 20)
    for transform in (CenterCrop, RandomResizedCrop, Resize):
        with pytest.raises(ValueError, match=r"sequence of one or two of them .* got \(20, 30, 99\)"):
            transform((20, 30, 99))


@pytest.mark.parametrize("size", [0, -3, (10, 0), (-4, 4), 224.0, (10.0, 10), True, "224", None])
@pytest.mark.parametrize("transform", [CenterCrop, RandomResizedCrop, Resize])
def test_sizes_that_are_no_image_sizes_are_refused_naming_the_transform(
    transform: type, size: object
) -> None:
    """They were taken, and failed later: at the output's size= (which the user never passed), at the
    first batch with torch's error, or with "object of type 'float' has no len()"."""
    with pytest.raises(ValueError, match=rf"^{transform.__name__}: size"):
        transform(size)


@pytest.mark.parametrize("max_size", [20, 10, 0, 30.5, True])
def test_a_max_size_not_above_the_size_is_refused(max_size: object) -> None:
    with pytest.raises(ValueError, match=r"Resize: max_size must be an int larger than size \(20\)"):
        Resize(20, max_size=max_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_size only with an int size"):
        Resize((20, 30), max_size=40)


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
def test_half_precision_images_scale_back_to_their_bytes(half: torch.dtype) -> None:
    """1.0 times 255.999 in half precision rounds to 256, which wrapped to 0: white turned black."""
    import io

    from PIL import Image

    pixels = np.array([[[255, 254, 128], [0, 1, 200]]], dtype=np.uint8)  # (1, 2, 3): two pixels
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    loader = ThreadLoader(
        [buffer.getvalue()], batch_size=1, device="cpu", transform=ToDtype(half, scale=True)
    )
    ((image,), _), *rest = loader  # without a size, a list of each image
    assert image.dtype == torch.uint8 and not rest
    assert torch.equal(image.permute(1, 2, 0), torch.from_numpy(pixels))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_a_resize_one_pixel_wide_keeps_the_columns_profile(dtype: torch.dtype) -> None:
    """torch's antialiased CPU kernel repeated the first row of a float output one pixel wide. Rows
    of one value each: every column of the resize is the profile, which the 2-wide resize (a size the
    kernel gets right) gives."""
    column = torch.linspace(0, 1, 40, dtype=torch.float64)
    images = column.view(1, 1, 40, 1).expand(2, 3, 40, 30).to(dtype)
    profile = torch.nn.functional.interpolate(
        images.float(), size=(4, 2), mode="bilinear", antialias=True, align_corners=False
    )[..., :1]
    resized = Resize((4, 1))(images)
    assert resized.shape == (2, 3, 4, 1) and resized.dtype == dtype
    torch.testing.assert_close(
        resized.float(), profile, rtol=0, atol=2e-3 if dtype == torch.float16 else 1e-6
    )
    assert resized[0, 0, :, 0].diff().min() > 0.1  # not one row repeated


@pytest.mark.parametrize(
    ("source", "target", "values", "expected"),
    [  # each computed here as torchvision does: value bits shifted, through int32
        (torch.uint8, torch.uint16, [0, 1, 128, 255], [0, 256, 32768, 65280]),
        (torch.uint16, torch.uint8, [0, 256, 32768, 65535], [0, 1, 128, 255]),
        (torch.uint16, torch.int16, [0, 256, 32768, 65535], [0, 128, 16384, 32767]),
        (torch.int16, torch.uint16, [0, 128, 16384, 32767], [0, 256, 32768, 65534]),
    ],
)
def test_integer_types_torch_cannot_shift_convert_by_their_value_bits(
    source: torch.dtype, target: torch.dtype, values: list[int], expected: list[int]
) -> None:
    """uint16 raised torch's NotImplementedError ("lshift_cpu" not implemented for 'UInt16')."""
    out = ToDtype(target, scale=True)(torch.tensor(values, dtype=torch.int64).to(source).view(1, 1, 1, -1))
    assert out.dtype == target
    assert out.flatten().to(torch.int64).tolist() == expected


@pytest.mark.parametrize(
    ("source", "target"),
    [
        (torch.float32, torch.int32),
        (torch.float32, torch.int64),
        (torch.float64, torch.int64),
        # half precision scales in float32: the same conversions
        (torch.float16, torch.int32),
        (torch.bfloat16, torch.int64),
        # as int32: 1.0 came out as 0
        (torch.float32, torch.uint32),
        (torch.bfloat16, torch.uint32),
    ],
)
def test_float_to_wide_integers_is_refused_as_torchvision_refuses_it(
    source: torch.dtype, target: torch.dtype
) -> None:
    """1.0 came out as -2147483648."""
    with pytest.raises(RuntimeError, match="cannot be performed safely"):
        ToDtype(target, scale=True)(torch.ones(1, 1, 1, 2, dtype=source))


def test_normalize_refuses_means_for_another_number_of_channels() -> None:
    """Three means on four channels raised torch's broadcast error; one channel takes them all."""
    with pytest.raises(ValueError, match="got 3 means and stds for images of 4 channels"):
        Normalize((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))(torch.rand(4, 5, 6))
    gray = torch.rand(1, 5, 6)
    out = Normalize((0.5, 0.4, 0.3), (0.2, 0.2, 0.2))(gray)
    expected = (gray - torch.tensor([0.5, 0.4, 0.3]).view(3, 1, 1)) / 0.2
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    ("arguments", "error", "match"),
    [
        ({"scale": 0.5}, TypeError, r"scale must be a \(min, max\) of numbers, got 0.5"),
        ({"ratio": (1.0,)}, TypeError, r"ratio must be a \(min, max\) of numbers"),
        ({"scale": (-1.0, 1.0)}, ValueError, r"0 <= min <= max .* got scale=\(-1.0, 1.0\)"),
        ({"ratio": (0.0, 1.0)}, ValueError, r"0 < min <= max, got .* ratio=\(0.0, 1.0\)"),
        ({"scale": (0.5, 0.1)}, ValueError, r"got scale=\(0.5, 0.1\)"),
        ({"ratio": (1.0, float("inf"))}, ValueError, r"ratio=\(1.0, inf\)"),
    ],
)
def test_random_resized_crop_names_a_bad_scale_or_ratio(
    arguments: dict[str, object], error: type[Exception], match: str
) -> None:
    """These raised 'float' object is not subscriptable, a math domain error or torch's bounds error."""
    with pytest.raises(error, match=match):
        RandomResizedCrop(8, **arguments)  # type: ignore[arg-type]


@pytest.mark.parametrize("p", ["0.5", 2, -0.1])
def test_flip_names_a_probability_that_is_not_one(p: object) -> None:
    with pytest.raises(ValueError, match=f"p must be a probability, a number from 0 to 1, got {p!r}"):
        RandomHorizontalFlip(p)  # type: ignore[arg-type]


def test_compose_names_a_transform_given_without_its_list() -> None:
    """Compose(Resize(4)) raised "'Resize' object is not iterable"."""
    with pytest.raises(
        TypeError, match=r"Compose takes a list of transforms, got Resize\(.*\): write Compose"
    ):
        Compose(Resize(4))  # type: ignore[arg-type]


def test_resize_names_an_image_that_max_size_would_make_empty() -> None:
    """A 1x1000 image under Resize(10, max_size=11) comes out 0 pixels high by torchvision's rule
    (``int(11 * 1 / 1000)``): torch's resize then failed with a message about neither."""
    with pytest.raises(
        ValueError, match=r"Resize\(10, max_size=11\) makes a 1x1000 image 0x11: .* raise max_size"
    ):
        Resize(10, max_size=11)(torch.zeros(3, 1, 1000, dtype=torch.uint8))
    assert Resize(10, max_size=1000)(torch.zeros(3, 1, 1000, dtype=torch.uint8)).shape == (3, 1, 1000)


def test_compose_names_a_transform_of_unknown_output_before_a_random_one() -> None:
    """A transform of the user's whose ``output_size`` gives None, before a random crop, failed on a bare
    assert in the reader thread; the error names it and the method to fix."""

    class Pad(Transform):
        def apply(self, images: torch.Tensor, params: object) -> torch.Tensor:
            return torch.nn.functional.pad(images, (1, 1, 1, 1))

        def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
            return None

    chain = Compose([Pad(), RandomResizedCrop(8)])
    with pytest.raises(TypeError, match=r"Pad.output_size\(\) returned None .* RandomResizedCrop after it"):
        chain(torch.zeros(3, 16, 16, dtype=torch.uint8))


def test_to_dtype_names_a_dtype_that_is_not_one() -> None:
    """ToDtype("float32") was built, then failed at its first batch with an AttributeError."""
    with pytest.raises(TypeError, match=r"ToDtype takes a torch.dtype \(say torch.float32\), got 'float32'"):
        ToDtype("float32", scale=True)  # type: ignore[arg-type]


def test_normalize_names_the_integer_type_it_was_given() -> None:
    with pytest.raises(
        TypeError, match=r"float images, got torch\.uint8: convert with ToDtype\(torch\.float32"
    ):
        Normalize((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))(IMAGE)


def test_normalize_refuses_an_image_without_channels() -> None:
    """A (H, W) tensor came back (C, H, W), broadcast against the (C, 1, 1) constants."""
    with pytest.raises(ValueError, match=r"\(\.\.\., C, H, W\), got shape \(4, 5\)"):
        Normalize((0.5, 0.5, 0.5), (0.2, 0.2, 0.2))(torch.rand(4, 5))


@pytest.mark.parametrize(("mean", "std"), [(0.5, (0.2,)), ((0.5,), (float("inf"),)), ((0.5, 0.4), (0.2,))])
def test_normalize_checks_its_values_when_built(mean: object, std: object) -> None:
    with pytest.raises(ValueError, match=r"(mean|std) (must|need)"):
        Normalize(mean, std)  # type: ignore[arg-type]
    assert Normalize(np.array([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.2, 0.2])).mean == (0.5, 0.4, 0.3)


@pytest.mark.parametrize(
    ("dtype", "scale"),
    [
        (torch.uint64, True),  # torch has no bit shifts for it: "lshift_cpu" not implemented for 'UInt64'
        (torch.bool, True),
        (torch.complex64, True),
        (torch.float8_e4m3fn, True),  # "div_cpu_reduced_float" not implemented
        (torch.int4, False),  # "copy_" not implemented for 'Int4'
        (torch.uint2, False),
        (torch.bits8, False),
        (torch.qint8, False),
    ],
)
def test_to_dtype_refuses_when_built_what_it_cannot_produce(dtype: torch.dtype, scale: bool) -> None:
    """ToDtype(torch.uint64, scale=True) was built, then raised torch's NotImplementedError at a batch."""
    with pytest.raises(
        ValueError, match=rf"converts to float32, .*uint8, .*got {re.escape(str(dtype))}; use one of those"
    ):
        ToDtype(dtype, scale=scale)


def test_to_dtype_still_makes_the_conversions_torch_can() -> None:
    """Not refused: plain casts to uint64, bool and complex, and uint16 and uint32 scaled."""
    image = IMAGE[:, :4, :5]
    for dtype in (torch.uint64, torch.bool, torch.complex64):
        got = ToDtype(dtype)(image)
        assert got.dtype == dtype and torch.equal(got, image.to(dtype))
    # Shifted by their value bits, past uint8's 8.
    assert torch.equal(ToDtype(torch.uint16, scale=True)(image).to(torch.int64), image.to(torch.int64) << 8)
    assert torch.equal(ToDtype(torch.uint32, scale=True)(image).to(torch.int64), image.to(torch.int64) << 24)
    halves = torch.tensor([0.0, 1.0], dtype=torch.float64).view(1, 1, 1, -1)
    assert ToDtype(torch.uint32, scale=True)(halves).flatten().tolist() == [0, 2**32 - 1]


def test_uint16_images_come_back_from_floats_unchanged() -> None:
    """Scaled in float32, 1.0 times 65535.999 rounded to 65536 and wrapped to 0 (white turned black)."""
    every = torch.arange(2**16, dtype=torch.int64).to(torch.uint16).view(1, 1, 1, -1)
    floats = ToDtype(torch.float32, scale=True)(every)
    back = ToDtype(torch.uint16, scale=True)(floats)
    assert torch.equal(back.to(torch.int64), every.to(torch.int64))


@pytest.mark.parametrize(
    ("dtype", "std"), [(torch.float32, 1e-46), (torch.float16, 1e-8), (torch.bfloat16, 1e-45)]
)
def test_normalize_refuses_a_std_that_is_zero_in_the_images_dtype(dtype: torch.dtype, std: float) -> None:
    """Nonzero as Python floats, these are zero in the images' type: every pixel came out inf or NaN."""
    assert torch.tensor(std, dtype=dtype).item() == 0  # the premise, in plain torch
    normalize = Normalize((0.5, 0.5, 0.5), (0.2, std, 0.2))  # the dtype is not known yet
    with pytest.raises(
        ValueError, match=rf"zero after conversion to {re.escape(str(dtype))},.*got std=.*{std!r}"
    ):
        normalize(torch.rand(3, 4, 5).to(dtype))


def test_normalize_takes_a_tiny_std_its_dtype_holds() -> None:
    """As torchvision: a std is refused only where it is zero; float64 holds 1e-300, float32 1e-45."""
    images = torch.rand(3, 4, 5, dtype=torch.float64)
    got = Normalize((0.5,), (1e-300,))(images)
    torch.testing.assert_close(got, (images - 0.5) / 1e-300)
    assert torch.tensor(1e-45, dtype=torch.float32).item() != 0
    Normalize((0.5,), (1e-45,))(images.float())  # no error, whatever the values


@pytest.mark.parametrize("fused", [False, True])
def test_output_normalization_refuses_a_std_zero_in_float32_on_both_paths(
    fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's mean/std: torch's ops (CPU) and the GPU's kernel both compute in float32 and refuse
    the same std; the kernel divided by zero, giving inf."""
    from threadloader._output import OutputFormat

    if fused:
        pytest.importorskip("triton")
        from threadloader.transforms import _kernels

        monkeypatch.setattr(_kernels, "_ON_CPU", True)  # interpreted: tests/test_kernels.py says how
    with pytest.raises(ValueError, match=r"conversion to torch\.float32,.*1e-46"):  # when built
        OutputFormat(size=(4, 4), dtype=torch.float16, mean=(0.5,) * 3, std=(0.2, 1e-46, 0.2))
    output = OutputFormat(size=(4, 4), dtype=torch.float16, mean=(0.5,) * 3, std=(0.2, 0.2, 0.2))
    object.__setattr__(output, "std", (0.2, 1e-46, 0.2))  # past that check: each path refuses it too
    with pytest.raises(ValueError, match=r"conversion to torch\.float32,.*1e-46"):
        output.apply(torch.stack([IMAGE, IMAGE]))


@pytest.mark.parametrize("integer", [torch.int8, torch.int16, torch.uint16, torch.int32])
@pytest.mark.parametrize("size", [None, (4, 6)])
def test_a_float_output_scales_a_transforms_integer_type_by_its_own_range(
    integer: torch.dtype, size: tuple[int, int] | None
) -> None:
    """ToDtype(int16, scale=True) then a float output is that integer over 32767, not over 255 (which
    made white 128.5); torchvision's two ToDtypes in a row, in plain torch."""
    pixels = np.random.default_rng(3).integers(0, 256, (8, 12, 3), dtype=np.uint8)
    loader = ThreadLoader(
        [encode(pixels, "PNG")],
        batch_size=1,
        device="cpu",
        transform=ToDtype(integer, scale=True),
        size=size,
        dtype=torch.float32,
    )
    with loader:
        (got,), _ = next(iter(loader))
    shift = torch.iinfo(integer).bits - (1 if integer.is_signed else 0) - 8  # value bits past uint8's
    wide = torch.from_numpy(pixels).permute(2, 0, 1).to(torch.int64)
    as_integer = (wide << shift if shift >= 0 else wide >> -shift).to(integer)
    expected = as_integer.double() / torch.iinfo(integer).max
    if size is not None:
        expected = torch.nn.functional.interpolate(
            expected[None], size=size, mode="bilinear", antialias=True, align_corners=False
        )[0]
    assert got.dtype == torch.float32 and got.max() <= 1.0 + 1e-6
    assert (got.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("source", [torch.uint16, torch.int32, torch.uint32, torch.int64])
def test_wide_integers_scale_to_float16_without_inf(source: torch.dtype) -> None:
    """uint16's 65535 is past float16's largest value (65504): cast before the division, white was inf."""
    top = torch.iinfo(source).max
    values = [0, top // 3, top // 2, top - 1, top]
    images = torch.tensor(values, dtype=torch.int64).to(source).view(1, 1, 1, -1)
    got = ToDtype(torch.float16, scale=True)(images)
    expected = (np.array(values, dtype=np.float64) / top).astype(np.float16)  # numpy, rounded once
    assert got.dtype == torch.float16
    np.testing.assert_allclose(got.flatten().numpy(), expected, rtol=2**-10, atol=0)
    assert got.flatten()[-1].item() == 1.0


def test_every_uint16_value_scales_to_float16_within_its_precision() -> None:
    every = torch.arange(2**16, dtype=torch.int64).to(torch.uint16).view(1, 1, 1, -1)
    got = ToDtype(torch.float16, scale=True)(every).flatten().numpy()
    expected = (np.arange(2**16, dtype=np.float64) / 65535).astype(np.float16)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=2**-10, atol=0)


@pytest.mark.parametrize(
    "dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_flips_take_every_type_to_dtype_makes(dtype: torch.dtype) -> None:
    """torch's CPU flip has no kernel for them: NotImplementedError "flip_cpu" not implemented for
    'UInt16', after ToDtype(torch.uint16, scale=True) made the images."""
    top = 8 if dtype.is_floating_point else 2**16  # float8 holds the integers below 8 exactly
    pixels = np.random.default_rng(5).integers(0, top, (2, 3, 4, 5)).astype(np.int64)
    images = torch.from_numpy(pixels).to(dtype)
    got = RandomHorizontalFlip(p=1.0)(images[0])
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.to(torch.int64).numpy(), pixels[0, :, :, ::-1])
    rows = RandomHorizontalFlip().apply_many(images, [True, False])
    assert rows.dtype == dtype
    np.testing.assert_array_equal(rows.to(torch.int64).numpy(), np.stack([pixels[0, :, :, ::-1], pixels[1]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_masks_scale_to_floats_as_torchvision_scales_them(dtype: torch.dtype) -> None:
    """ToDtype(torch.bool) then ToDtype(float, scale=True) raised torch.iinfo's "torch.bool is not
    supported" deep in a reader thread; torchvision's to_dtype gives the plain cast (bool's largest
    value is 1: True is white)."""
    mask = torch.rand(2, 3, 4, 5) > 0.5
    got = ToDtype(dtype, scale=True)(mask)
    assert got.dtype == dtype and torch.equal(got, mask.to(dtype))


@pytest.mark.parametrize(
    ("source", "target"),
    [(torch.bool, torch.uint8), (torch.complex64, torch.uint8), (torch.uint64, torch.uint8)],
)
def test_scaling_images_of_a_type_without_a_range_names_the_type_and_the_fix(
    source: torch.dtype, target: torch.dtype
) -> None:
    """Types ToDtype makes with a plain cast: scaled to integers they raised torch's TypeError of
    torch.iinfo (bool, as torchvision's own TypeError; complex) or NotImplementedError "rshift_cpu" not
    implemented for 'UInt64', naming neither the images' type nor what to do."""
    images = ToDtype(source)(IMAGE[None, :, :2, :3])
    with pytest.raises(TypeError, match=rf"got {re.escape(str(source))} images.*scale=False"):
        ToDtype(target, scale=True)(images)
