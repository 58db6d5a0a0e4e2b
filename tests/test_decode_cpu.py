"""The Pillow path's pixels: parity with Pillow over the corpus, resize, dtype, normalization, layout."""

from __future__ import annotations

import io
import struct
import threading
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile, PngImagePlugin

from threadloader import SampleError, ThreadLoader
from threadloader.decode import PillowDecoder, pillow

from .conftest import encode, header_only_png, mean_abs_diff, photo, pil_reference


@pytest.fixture(scope="module")
def references(corpus: dict[str, bytes]) -> dict[str, np.ndarray]:
    return {name: pil_reference(data) for name, data in corpus.items()}


def load_all(corpus: dict[str, bytes], batch_size: int = 4, **options) -> dict[str, torch.Tensor]:
    """Every corpus image through a loader, by name (the names are the targets)."""
    out: dict[str, torch.Tensor] = {}
    loader = ThreadLoader(
        list((data, name) for name, data in corpus.items()), batch_size=batch_size, **options
    )
    for images, names in loader:
        assert isinstance(names, list) and len(images) == len(names)
        for image, name in zip(images, names, strict=True):
            out[name] = image
    assert list(out) == list(corpus)
    return out


def resized_reference(reference: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """The torchvision-free reference: antialiased bilinear on the Pillow pixels, float (1, 3, H, W)."""
    x = torch.from_numpy(reference).permute(2, 0, 1).unsqueeze(0).float()
    return F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)


def uint8_resized(reference: np.ndarray, size: tuple[int, int]) -> torch.Tensor:
    """The CPU path's uint8 resize: torch's own uint8 kernel (fixed point), (1, 3, H, W)."""
    x = torch.from_numpy(reference).permute(2, 0, 1).unsqueeze(0)
    return F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    return x.round().clamp(0, 255).to(torch.uint8)


def pil_bilinear(reference: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return np.array(Image.fromarray(reference).resize((size[1], size[0]), Image.Resampling.BILINEAR))


def test_corpus_covers_the_hard_cases(references: dict[str, np.ndarray]) -> None:
    assert references["gray_333x222_q75"].shape == (222, 333, 3)
    assert references["cmyk"].shape == (300, 400, 3)
    assert references["rgb_1x1"].shape == (1, 1, 3)
    for orientation in range(1, 9):  # 5-8 swap the sides of the 60x90 original
        assert references[f"exif_{orientation}"].shape == ((60, 90, 3) if orientation <= 4 else (90, 60, 3))


@pytest.mark.parametrize("num_threads", [1, 3])
def test_pillow_parity_every_corpus_case(
    corpus: dict[str, bytes], references: dict[str, np.ndarray], num_threads: int
) -> None:
    images = load_all(corpus, num_threads=num_threads)
    shapes = {name: tuple(image.shape) for name, image in images.items()}
    assert shapes == {name: (3, ref.shape[0], ref.shape[1]) for name, ref in references.items()}
    diffs = {name: mean_abs_diff(images[name], references[name]) for name in corpus}
    assert {name: d for name, d in diffs.items() if d != 0} == {}
    for name, image in images.items():
        assert image.dtype == torch.uint8
        assert torch.equal(image, torch.from_numpy(references[name]).permute(2, 0, 1)), name


def test_pillow_parity_from_files(
    tmp_path, corpus: dict[str, bytes], references: dict[str, np.ndarray]
) -> None:
    names = ["cmyk", "gray_progressive", "exif_6", "exif_8", "odd_257x193"]
    paths = []
    for name in names:
        path = tmp_path / f"{name}.jpg"
        path.write_bytes(corpus[name])
        paths.append(path)
    ((images, targets),) = list(ThreadLoader(paths, batch_size=5, num_threads=2))
    assert targets is None
    for image, name in zip(images, names, strict=True):
        assert mean_abs_diff(image, references[name]) == 0, name


@pytest.mark.parametrize("size", [(24, 40), (61, 97), (300, 400)])
@pytest.mark.parametrize("batch_size", [1, 5])
def test_resize_parity(
    corpus: dict[str, bytes], references: dict[str, np.ndarray], size: tuple[int, int], batch_size: int
) -> None:
    images = load_all(corpus, batch_size=batch_size, size=size, num_threads=2)
    mismatched, far_from_pil = {}, {}
    for name, reference in references.items():
        image = images[name]
        assert image.shape == (3, *size) and image.dtype == torch.uint8
        # torch's uint8 kernel on each image alone, whatever else is in its batch; it works in fixed
        # point, so within 1 of the float resize rounded.
        expected = uint8_resized(reference, size)[0]
        rounded = to_uint8(resized_reference(reference, size))[0]
        if not torch.equal(image, expected) or (image.int() - rounded.int()).abs().max() > 1:
            mismatched[name] = (image.int() - expected.int()).abs().max().item()
        diff = mean_abs_diff(image, pil_bilinear(reference, size))
        if diff > 1.0:
            far_from_pil[name] = diff
    assert mismatched == {}
    assert far_from_pil == {}


def test_resize_of_a_same_size_batch_is_one_stacked_batch() -> None:
    data = [encode(photo(32, 48, seed), quality=90) for seed in range(6)]
    refs = [pil_reference(b) for b in data]
    ((images, _),) = list(ThreadLoader(data, batch_size=6, size=(20, 30), num_threads=1))
    assert isinstance(images, torch.Tensor) and images.shape == (6, 3, 20, 30)
    assert torch.equal(images, torch.cat([uint8_resized(r, (20, 30)) for r in refs]))
    for image, reference in zip(images, refs, strict=True):
        assert mean_abs_diff(image, pil_bilinear(reference, (20, 30))) <= 1.0


def test_size_equal_to_the_original_is_exact() -> None:
    data = [encode(photo(32, 48, seed), quality=90) for seed in range(3)]
    ((images, _),) = list(ThreadLoader(data, batch_size=3, size=(32, 48)))
    for image, blob in zip(images, data, strict=True):
        assert torch.equal(image, torch.from_numpy(pil_reference(blob)).permute(2, 0, 1))


SUBSET = ["gray_333x222_q95", "cmyk", "rgb_420", "odd_257x193", "exif_6", "rgb_1x1"]


@pytest.fixture(scope="module")
def subset(corpus: dict[str, bytes]) -> dict[str, bytes]:
    return {name: corpus[name] for name in SUBSET}


def assert_exactly(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    diff = (actual.double() - expected.double()).abs()
    assert diff.max().item() == 0, (
        f"{name}: {int((diff > 0).sum())} of {diff.numel()} values differ, by up to {diff.max().item():.3g}"
    )


def uint8_chw(references: dict[str, np.ndarray], name: str) -> torch.Tensor:
    return torch.from_numpy(references[name]).permute(2, 0, 1)


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    ],
)
def test_float_dtypes_are_exactly_uint8_over_255(
    subset: dict[str, bytes], references: dict[str, np.ndarray], dtype: torch.dtype
) -> None:
    images = load_all(subset, dtype=dtype, num_threads=2)
    for name, image in images.items():
        assert image.dtype == dtype
        reference = uint8_chw(references, name)
        expected = reference.float() / 255 if dtype != torch.float64 else reference.double() / 255
        assert_exactly(image, expected.to(dtype), name)
        # Scaled back, every value rounds to its uint8 source, and none leaves [0, 1].
        assert torch.equal(to_uint8(image * 255), reference)
        assert image.min() >= 0.0 and image.max() <= 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_resized_float_is_the_float_resize_scaled(
    subset: dict[str, bytes], references: dict[str, np.ndarray], dtype: torch.dtype
) -> None:
    size = (40, 56)
    images = load_all(subset, batch_size=3, dtype=dtype, size=size, num_threads=2)
    for name, image in images.items():
        assert image.dtype == dtype and image.shape == (3, *size)
        expected = (resized_reference(references[name], size)[0] / 255).to(dtype)
        # resample_many sums the same weights in another order than interpolate: a few float32 ulps.
        torch.testing.assert_close(image, expected, rtol=0, atol=max(torch.finfo(dtype).eps, 1e-6))
        uint8 = to_uint8(resized_reference(references[name], size)[0])
        # Nothing is rounded to uint8 on the way: the float output keeps the interpolated fractions.
        assert (image.float() * 255 - uint8.float()).abs().max() <= 0.5 + 255 * torch.finfo(dtype).eps


MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def normalized(reference_uint8: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The manual formula: (x / 255 - mean) / std, per channel."""
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return ((reference_uint8.float() / 255 - mean) / std).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [None, (32, 32)])
def test_mean_std_normalization(
    subset: dict[str, bytes], references: dict[str, np.ndarray], dtype: torch.dtype, size
) -> None:
    images = load_all(subset, batch_size=3, dtype=dtype, mean=MEAN, std=STD, size=size, num_threads=2)
    for name, image in images.items():
        assert image.dtype == dtype
        if size is None:
            base = uint8_chw(references, name).float()
        else:
            base = resized_reference(references[name], size)[0]
        expected = normalized(base, dtype)
        # After a resize, a few float32 ulps of resample_many's other summation order, scaled by 1/std.
        atol = 1e-6 if size is None else 1e-5
        torch.testing.assert_close(image.float(), expected.float(), rtol=torch.finfo(dtype).eps, atol=atol)
        # Normalization really happened: values leave [0, 1] in the expected direction.
        if name == "rgb_1x1":
            continue
        assert image.float().min() < 0 < image.float().max()


def test_mean_std_normalization_is_exact_in_float32(
    subset: dict[str, bytes], references: dict[str, np.ndarray]
) -> None:
    images = load_all(subset, batch_size=3, dtype=torch.float32, mean=MEAN, std=STD, num_threads=2)
    for name, image in images.items():
        assert_exactly(image, normalized(uint8_chw(references, name)), name)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [(32, 48), (24, 24), (100, 150)])
def test_channels_last_layout_and_values(subset: dict[str, bytes], dtype: torch.dtype, size) -> None:
    common = {"batch_size": 3, "dtype": dtype, "size": size, "num_threads": 2}
    if dtype != torch.uint8:
        common.update(mean=MEAN, std=STD)
    data = [(blob, name) for name, blob in subset.items()]
    plain = list(ThreadLoader(data, **common))
    packed = list(ThreadLoader(data, channels_last=True, **common))
    assert len(plain) == len(packed) == 2
    for (a, names_a), (b, names_b) in zip(plain, packed, strict=True):
        assert names_a == names_b
        assert a.shape == b.shape == (3, 3, *size)
        assert a.is_contiguous()
        assert b.is_contiguous(memory_format=torch.channels_last)
        assert not b.is_contiguous() or size == (1, 1)
        assert b.stride() == a.contiguous(memory_format=torch.channels_last).stride()
        assert torch.equal(a, b)


def test_channels_last_of_an_unresized_same_size_batch() -> None:
    data = [encode(photo(32, 48, seed), quality=90) for seed in range(4)]
    refs = [pil_reference(b) for b in data]
    ((images, _),) = list(ThreadLoader(data, batch_size=4, size=(32, 48), channels_last=True))
    assert images.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(images, torch.stack([torch.from_numpy(r).permute(2, 0, 1) for r in refs]))


def test_pixel_limit_is_checked_from_the_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bomb is refused without decoding: its data is absent (decoding would fail otherwise) and
    Pillow's decoder is never called for it."""
    bomb = header_only_png(4000, 3000)
    loads: list[tuple[int, int]] = []
    real_load = ImageFile.ImageFile.load

    def spy(image: ImageFile.ImageFile):  # type: ignore[no-untyped-def]
        loads.append(image.size)
        return real_load(image)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    good = encode(photo(40, 50), quality=90)
    loader = ThreadLoader([good, bomb], batch_size=2, max_pixels=1_000_000, num_threads=1)
    with loader, pytest.raises(SampleError) as caught:
        list(loader)
    error = caught.value
    assert (error.index, error.stage) == (1, "decode")
    assert "limit" in error.reason.lower()
    assert (4000, 3000) not in loads and (50, 40) in loads  # the good image was decoded, the bomb not
    # Under the limit, the same file reaches the decoder, which fails on it: the header alone spoke.
    loader = ThreadLoader([bomb], batch_size=1, max_pixels=None)
    with loader, pytest.raises(SampleError) as caught:
        list(loader)
    assert "limit" not in caught.value.reason.lower() and (4000, 3000) in loads


def test_pillow_on_several_threads_keeps_order_pixels_and_errors(
    corpus: dict[str, bytes], references: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``PillowDecoder(threads=4)`` (a GPU loader's first batches) decodes a call's images at once, on
    threads of its own, and returns what the calling thread alone would: each image at its position,
    a bad sample's error at its own."""
    names = list(corpus)
    samples = [corpus[name] for name in names]
    samples.insert(2, b"not an image")
    first_two = threading.Barrier(2, timeout=5)  # broken, and an error, unless both run at once
    threads: set[str] = set()
    original = pillow.decode_rgb

    def decode_rgb(data: bytes, **options: object) -> np.ndarray:
        threads.add(threading.current_thread().name)
        if data is samples[0] or data is samples[1]:
            first_two.wait()
        return original(data, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(pillow, "decode_rgb", decode_rgb)
    decoded = PillowDecoder(threads=4).decode(samples, stream=None)
    assert list(decoded.errors) == [2] and "cannot identify image file" in decoded.errors[2]
    assert len(threads) > 1 and all(name.startswith("threadloader-pillow") for name in threads)
    positions = [position for position in range(len(samples)) if position != 2]
    for position, name in zip(positions, names, strict=True):
        image = decoded.image(position)
        assert image is not None and tuple(image.shape) == references[name].shape, name
        assert torch.equal(image, torch.from_numpy(references[name])), name


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "4"])
def test_pillow_threads_must_be_a_positive_int(threads: object) -> None:
    with pytest.raises(ValueError, match=f"threads must be a positive int .*got {threads!r}"):
        PillowDecoder(threads=threads)  # type: ignore[arg-type]


@pytest.mark.parametrize("max_pixels", ["1e6", 0, -5, True, 1.5e6])
def test_pillow_max_pixels_is_checked_where_it_is_given(max_pixels: object) -> None:
    # Met only inside Pillow's format probing, a wrong type made every image read as unidentifiable.
    with pytest.raises(ValueError, match=f"max_pixels must be an int of at least 1 .*got {max_pixels!r}"):
        PillowDecoder(max_pixels=max_pixels)  # type: ignore[arg-type]


def test_numpy_integers_count_as_ints() -> None:
    png = encode(np.full((4, 6, 3), (200, 10, 30), np.uint8), "PNG")
    decoded = PillowDecoder(threads=np.int64(2), max_pixels=np.int64(24)).decode([png], stream=None)
    image = decoded.image(0)
    assert image is not None and image.shape == (4, 6, 3) and image[0, 0].tolist() == [200, 10, 30]
    over = PillowDecoder(max_pixels=np.int64(23)).decode([png], stream=None)
    assert over.image(0) is None


def test_gray_images_pillow_opens_as_32_bit_are_scaled_by_what_their_file_holds() -> None:
    """Pillow opens a 16-bit PGM as 32-bit "I", and a 32-bit or signed TIFF too: only the first holds
    16-bit samples (reduced to their high byte, as PNG's I;16). Shifted as 16-bit, the TIFF's 0-255
    values went black and its negative ones white; Pillow's own conversion clips them to 0-255."""
    sixteen = np.array([[0, 255, 256, 4660, 65535]], np.uint16)
    pgm = io.BytesIO()
    Image.fromarray(sixteen).save(pgm, "PPM")
    assert Image.open(io.BytesIO(pgm.getvalue())).mode == "I"
    assert pillow.decode_rgb(pgm.getvalue())[0, :, 0].tolist() == [0, 0, 1, 18, 255]
    wide = np.array([[-20000, -1, 0, 121, 255, 300, 70000]], np.int32)
    tiff = io.BytesIO()
    Image.fromarray(wide, "I").save(tiff, "TIFF")
    with Image.open(io.BytesIO(tiff.getvalue())) as image:
        assert image.mode == "I"
        reference = np.asarray(image.convert("RGB"))
    assert reference[0, :, 0].tolist() == [0, 0, 0, 121, 255, 255, 255]  # Pillow clips
    assert np.array_equal(pillow.decode_rgb(tiff.getvalue()), reference)


def test_a_16_bit_rgb_ppm_keeps_each_samples_high_byte() -> None:
    """Pillow reads a 16-bit RGB PPM to 8 bits by rounding (0xFF00 gave 254, 0x00FF gave 1)."""
    values = np.arange(65536, dtype=np.uint32)
    rgb = np.stack([values, values[::-1], (values * 7) % 65536], axis=1).reshape(256, 256, 3)
    ppm = b"P6 256 256 65535\n" + rgb.astype(">u2").tobytes()
    assert np.array_equal(pillow.decode_rgb(ppm), (rgb >> 8).astype(np.uint8))


@pytest.mark.parametrize("plain", [False, True], ids=["binary", "plain"])
def test_a_10_bit_rgb_ppm_reads_as_pillow_reads_the_same_samples_gray(plain: bool) -> None:
    """The rule of a gray PGM of the same depth: Pillow scales it to 16 bits, and its high byte is kept."""
    rng = np.random.default_rng(3)
    rgb = rng.integers(0, 1024, (5, 7, 3), dtype=np.uint32)
    rgb[0, :3] = [[0, 1023, 512], [1, 1022, 511], [4, 3, 2]]
    if plain:
        ppm = b"P3\n# a comment\n7 5\n1023\n" + b" ".join(b"%d" % v for v in rgb.ravel())
    else:
        ppm = b"P6 7 5 1023\n" + rgb.astype(">u2").tobytes()
    for channel in range(3):
        pgm = b"P5 7 5 1023\n" + rgb[..., channel].astype(">u2").tobytes()
        with Image.open(io.BytesIO(pgm)) as gray:  # the reference: Pillow's 16-bit scaling of gray
            expected = np.asarray(gray, dtype=np.uint32) >> 8
        assert np.array_equal(pillow.decode_rgb(ppm)[..., channel], expected)


def test_samples_above_a_wide_ppms_maxval_are_white_as_in_the_gray_pgm() -> None:
    """Pillow's binary reader takes samples above maxval: scaled past 16 bits, their high byte wrapped
    (1024 of 1023 came out 0, black), where the gray PGM of the same samples clips them to white."""
    rgb = np.array([[[1023, 1024, 2047], [4095, 65535, 512]]], np.uint32)
    ppm = b"P6 2 1 1023\n" + rgb.astype(">u2").tobytes()
    for channel in range(3):
        pgm = b"P5 2 1 1023\n" + rgb[..., channel].astype(">u2").tobytes()
        with Image.open(io.BytesIO(pgm)) as gray:
            expected = np.asarray(gray, dtype=np.uint32) >> 8
        assert np.array_equal(pillow.decode_rgb(ppm)[..., channel], expected), channel
    assert pillow.decode_rgb(ppm).tolist() == [[[255, 255, 255], [255, 255, 128]]]


def test_an_8_bit_ppm_is_pillows() -> None:
    rgb = np.random.default_rng(4).integers(0, 256, (4, 6, 3), dtype=np.uint8)
    ppm = b"P6 6 4 255\n" + rgb.tobytes()
    assert np.array_equal(pillow.decode_rgb(ppm), rgb)


def _with_exif(jpeg: bytes, tiff: bytes) -> bytes:
    """``jpeg`` with an APP1 EXIF segment holding the little-endian TIFF structure ``tiff``."""
    payload = b"Exif\0\0" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + jpeg[2:]


#: What each EXIF orientation shows, as numpy turns an (H, W, 3) array (the EXIF specification's).
UPRIGHT = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, -1),
    7: lambda a: a.transpose(1, 0, 2)[::-1, ::-1],
    8: lambda a: np.rot90(a, 1),
}


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_is_applied_whatever_else_the_exif_holds(orientation: int) -> None:
    """A phone photo below sea level stores its GPS altitude as a negative SRATIONAL. Pillow reads it,
    but ImageOps.exif_transpose, which wrote the EXIF back without the orientation, raised on it
    (struct.error): a photo that any viewer shows failed to decode."""
    pixels = photo(24, 40, 9)
    jpeg = encode(pixels, "JPEG", quality=95)
    gps_at = 8 + 2 + 2 * 12 + 4  # after the first directory: orientation and the GPS pointer
    altitude_at = gps_at + 2 + 12 + 4
    tiff = (
        b"II*\0" + struct.pack("<I", 8)
        + struct.pack("<H", 2)
        + struct.pack("<HHIHH", 0x0112, 3, 1, orientation, 0)  # Orientation, SHORT
        + struct.pack("<HHII", 0x8825, 4, 1, gps_at)  # GPSInfo IFD, LONG
        + b"\0\0\0\0"
        + struct.pack("<H", 1)
        + struct.pack("<HHII", 6, 10, 1, altitude_at)  # GPSAltitude, SRATIONAL
        + b"\0\0\0\0"
        + struct.pack("<ii", -12, 1)
    )  # fmt: skip
    with Image.open(io.BytesIO(jpeg)) as image:  # the stored pixels, decoded plainly
        stored = np.asarray(image.convert("RGB"))
    expected = np.ascontiguousarray(UPRIGHT[orientation](stored))
    assert np.array_equal(pillow.decode_rgb(_with_exif(jpeg, tiff)), expected)


def _gray_12_bit_tiff(samples: np.ndarray) -> bytes:
    """An uncompressed little-endian TIFF of 12-bit gray ``samples``, packed most significant bit first."""
    height, width = samples.shape
    bits = np.unpackbits(samples.astype(">u2").view(np.uint8).reshape(height, width, 2), axis=2)
    rows = bits.reshape(height, width, 16)[..., 4:].reshape(height, -1)
    data = b"".join(np.packbits(row).tobytes() for row in rows)
    tags = [(256, width), (257, height), (258, 12), (259, 1), (262, 1), (273, 0), (277, 1), (278, height)]
    tags.append((279, len(data)))
    data_at = 8 + 2 + 12 * len(tags) + 4
    entries = b"".join(
        struct.pack("<HHII", tag, 4, 1, data_at if tag == 273 else value) for tag, value in tags
    )
    return b"II*\0" + struct.pack("<IH", 8, len(tags)) + entries + b"\0\0\0\0" + data


def test_a_12_bit_gray_tiff_reads_as_pillow_reads_the_same_samples_as_a_pgm() -> None:
    """Pillow opens a 12-bit TIFF as I;16 with its samples as stored (0-4095): their high byte kept 4
    bits of 12, an image near black (4095 gave 15). The documented rule is a 12-bit PGM's."""
    samples = np.arange(4096, dtype=np.uint16).reshape(64, 64)
    tiff = _gray_12_bit_tiff(samples)
    with Image.open(io.BytesIO(tiff)) as image:
        assert image.mode == "I;16" and np.array_equal(np.asarray(image), samples)  # read as stored
    pgm = b"P5 64 64 4095\n" + samples.astype(">u2").tobytes()
    with Image.open(io.BytesIO(pgm)) as gray:  # the reference: Pillow's 16-bit scaling of gray
        expected = (np.asarray(gray, dtype=np.uint32) >> 8).astype(np.uint8)
    assert expected[-1, -1] == 255
    assert np.array_equal(pillow.decode_rgb(tiff), np.repeat(expected[..., None], 3, axis=2))


def _with_png_exif(png: bytes, exif: bytes) -> bytes:
    """``png`` with an eXIf chunk holding ``exif``, right after its IHDR."""
    crc = struct.pack(">I", zlib.crc32(b"eXIf" + exif))
    return png[:33] + struct.pack(">I", len(exif)) + b"eXIf" + exif + crc + png[33:]


@pytest.mark.parametrize("exif", [b"garbage", b"II*\0"], ids=["not TIFF", "cut short"])
@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
def test_an_image_whose_exif_cannot_be_read_is_decoded_as_stored(fmt: str, exif: bytes) -> None:
    """Pillow reads a PNG's or WebP's EXIF only when asked, and raises for a damaged one: the image
    failed (SyntaxError, struct.error) where Pillow's own decode shows it, as stored."""
    pixels = photo(24, 40, 10)
    if fmt == "PNG":
        data = _with_png_exif(encode(pixels, "PNG"), exif)
    else:
        data = encode(pixels, "WEBP", lossless=True, exif=exif)
    with Image.open(io.BytesIO(data)) as image:  # Pillow used plainly
        expected = np.asarray(image.convert("RGB"))
    assert np.array_equal(expected, pixels)
    assert np.array_equal(pillow.decode_rgb(data), expected)


@pytest.mark.parametrize("hex_digits", ["zz12", "4d4d0"], ids=["not hex", "odd length"])
def test_a_png_whose_legacy_exif_text_cannot_be_read_is_decoded_as_stored(hex_digits: str) -> None:
    """ImageMagick stores a PNG's EXIF as hex in a "Raw profile type exif" text chunk, which Pillow
    reads only when asked, with bytes.fromhex: damaged digits raised ValueError and failed an image
    that Pillow's own decode shows, as stored (docs/errors.md: unreadable EXIF gives no orientation)."""
    pixels = photo(24, 40, 11)
    info = PngImagePlugin.PngInfo()
    info.add_text("Raw profile type exif", f"\nexif\n      20\n{hex_digits}\n", zip=True)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG", pnginfo=info)
    with Image.open(io.BytesIO(out.getvalue())) as image:  # Pillow used plainly
        expected = np.asarray(image.convert("RGB"))
    assert np.array_equal(expected, pixels)
    assert np.array_equal(pillow.decode_rgb(out.getvalue()), expected)
