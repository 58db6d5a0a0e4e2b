"""The ctypes binding of nvImageCodec 0.9's C API, on the CPU: layouts, headers, pixels, guard bytes.

nvImageCodec's instance, parsers and CPU decoders (libjpeg-turbo) run without a GPU, into host memory,
so CI checks the binding itself here: the struct layouts against the gcc-printed table of the 0.9
header, the headers it reads against Pillow's, the pixels it decodes against Pillow's, and that it
writes nothing outside the memory it is given. The GPU path (device memory, EXIF, the self-test, the
fallback) is in test_gpu_capi.py. Skipped where nvImageCodec 0.9 is not installed.
"""

from __future__ import annotations

import ctypes
import io

import numpy as np
import pytest
from PIL import Image

from threadloader.decode.nvimgcodec import _capi
from threadloader.decode.nvimgcodec._jpeg import with_exif_orientation

from .conftest import encode, photo, pil_reference

try:
    INSTANCE = _capi.load()
except _capi.Unsupported as exc:
    pytest.skip(f"nvImageCodec 0.9's C API is not usable here: {exc}", allow_module_level=True)

GUARD = 0xA5


@pytest.fixture(scope="module")
def cpu_decoder() -> _capi.Decoder:
    return _capi.Decoder(
        INSTANCE, device_id=_capi.DEVICE_CPU_ONLY, backends=[(_capi.CPU_ONLY, 1.0)], cpu_threads=1
    )


def test_the_structs_have_the_layout_of_nvimgcodec_09() -> None:
    # From nvimgcodec-0.9-layout.txt: gcc's sizeof and offsetof over the 0.9 header, x86-64.
    sizes = {
        _capi._Properties: 32,
        _capi._InstanceCreateInfo: 64,
        _capi._Backend: 64,
        _capi._ExecutionParams: 80,
        _capi._ImageInfo: 2160,
        _capi._CodeStreamView: 152,
        _capi._Region: 112,
        _capi._DecodeParams: 32,
    }
    assert {s.__name__: ctypes.sizeof(s) for s in sizes} == {s.__name__: n for s, n in sizes.items()}
    offsets = {
        "codec": 24,
        "color_spec": 280,
        "chroma": 284,
        "sample_format": 288,
        "rotated": 296 + 24,
        "flip_x": 296 + 28,
        "flip_y": 296 + 32,
        "num_planes": 336,
        "width": 344 + 24,
        "height": 344 + 28,
        "row_stride": 344 + 32,
        "num_channels": 344 + 40,
        "sample_type": 344 + 44,
        "precision": 344 + 48,
        "buffer": 2136,
        "buffer_kind": 2144,
        "cuda_stream": 2152,
    }
    assert {name: _capi.IMAGE_INFO.fields[name][1] for name in offsets} == offsets
    assert _capi.IMAGE_INFO.itemsize == 2160
    assert (_capi._ExecutionParams.device_id.offset, _capi._ExecutionParams.backends.offset) == (56, 72)
    assert (_capi._CodeStreamView.region.offset, _capi._CodeStreamView.bitstream_offset.offset) == (32, 144)


def test_the_version_is_09() -> None:
    assert INSTANCE.library.version // 100 == 9


def test_headers_are_pillows() -> None:
    samples = {
        "rgb": encode(photo(193, 257, 1), quality=90),
        "gray": encode(photo(50, 70, 2), mode="L"),
        "cmyk": encode(photo(40, 30, 3), mode="CMYK"),
        "progressive": encode(photo(64, 48, 4), progressive=True),
        "png": encode(photo(31, 17, 5), "PNG"),
        "1x1": encode(photo(1, 1, 6)),
    }
    workspace = _capi.Workspace(INSTANCE)
    assert workspace.parse(list(samples.values())) == [0] * len(samples)
    infos = workspace.infos[: len(samples)]
    for (name, data), info in zip(samples.items(), infos, strict=True):
        with Image.open(io.BytesIO(data)) as image:
            assert (int(info["width"]), int(info["height"])) == image.size, name
            assert info["codec"] == (b"png" if name == "png" else b"jpeg"), name
            channels = int(info["num_planes"]) * int(info["num_channels"])
            assert channels == len(image.getbands()), name
            assert int(info["sample_type"]) == 0x0802, name  # uint8


@pytest.mark.parametrize(
    ("orientation", "expected"),
    # EXIF orientation -> (counter-clockwise degrees, flipped left-right, flipped top-bottom), the
    # header's own documentation of nvimgcodecOrientation_t; 5-8 turn the image on its side.
    [(1, (0, 0, 0)), (2, (0, 1, 0)), (3, (180, 0, 0)), (4, (0, 0, 1)),
     (5, (90, 0, 1)), (6, (270, 0, 0)), (7, (270, 0, 1)), (8, (90, 0, 0))],
)  # fmt: skip
def test_exif_orientation_is_read_from_the_header(orientation: int, expected: tuple[int, int, int]) -> None:
    data = with_exif_orientation(encode(photo(30, 50, 7)), orientation)
    with Image.open(io.BytesIO(data)) as image:  # the EXIF written is the EXIF Pillow reads
        assert image.getexif().get(0x0112) == orientation
    workspace = _capi.Workspace(INSTANCE)
    assert workspace.parse([data]) == [0]
    info = workspace.infos[0]
    assert (int(info["rotated"]), int(info["flip_x"]), int(info["flip_y"])) == expected
    assert (int(info["width"]), int(info["height"])) == (50, 30)  # as stored


def _decode_into_host(
    workspace: _capi.Workspace, decoder: _capi.Decoder, shapes: list[tuple[int, int]], positions: list[int]
) -> tuple[np.ndarray, list[bool]]:
    """Decodes ``positions`` into the rows of one padded host buffer, guard bytes all around."""
    height = max(h for h, _ in shapes) + 1  # a guard row under the tallest image
    width = max(w for _, w in shapes) + 3  # guard columns right of the widest
    memory = np.full((len(positions), height, width, 3), GUARD, dtype=np.uint8)
    addresses = [memory.ctypes.data + i * memory.strides[0] for i in range(len(positions))]
    bound = workspace.bind(positions, addresses, shapes, [width * 3] * len(positions), stream=None, host=True)
    assert bound == [0] * len(positions)
    return memory, workspace.submit(decoder, positions).wait()


def test_decodes_pillows_pixels_into_padded_rows_and_nowhere_else(cpu_decoder: _capi.Decoder) -> None:
    sizes = [(193, 257), (50, 70), (1, 1), (64, 48), (300, 200)]
    blobs = [encode(photo(h, w, 10 + i), quality=92) for i, (h, w) in enumerate(sizes)]
    blobs[1] = bytearray(blobs[1])  # any buffer, not only bytes
    # A writable view of a larger buffer, not at the buffer's start.
    group = bytearray(b"\xff" * 7 + bytes(blobs[3]) + b"\xd8" * 5)
    blobs[3] = memoryview(group)[7 : 7 + len(blobs[3])]
    workspace = _capi.Workspace(INSTANCE)
    assert workspace.parse(blobs) == [0] * len(blobs)
    memory, decoded = _decode_into_host(workspace, cpu_decoder, sizes, list(range(len(sizes))))
    assert decoded == [True] * len(sizes)
    for row, ((h, w), data) in enumerate(zip(sizes, blobs, strict=True)):
        np.testing.assert_array_equal(memory[row, :h, :w], pil_reference(bytes(data)))
        outside = memory[row].copy()
        outside[:h, :w] = GUARD
        assert (outside == GUARD).all(), f"row {row} written outside its {h}x{w} image"


def test_a_region_decodes_to_pillows_crop(cpu_decoder: _capi.Decoder) -> None:
    data = encode(photo(120, 160, 20), quality=95, subsampling=0)
    workspace = _capi.Workspace(INSTANCE)
    assert workspace.parse([data]) == [0]
    top, left, height, width = 17, 31, 50, 70
    assert workspace.crop(0, top, left, height, width) == 0
    memory, decoded = _decode_into_host(workspace, cpu_decoder, [(height, width)], [0])
    assert decoded == [True]
    expected = pil_reference(data)[top : top + height, left : left + width].astype(int)
    assert np.abs(memory[0, :height, :width].astype(int) - expected).max() <= 2  # decoded alone: edges
    assert (memory[0, height] == GUARD).all() and (memory[0, :, width:] == GUARD).all()
    workspace.uncrop([0])  # the whole image again
    memory, decoded = _decode_into_host(workspace, cpu_decoder, [(120, 160)], [0])
    assert decoded == [True]
    np.testing.assert_array_equal(memory[0, :120, :160], pil_reference(data))


def test_bad_input_is_a_status_and_the_rest_of_the_batch_decodes(cpu_decoder: _capi.Decoder) -> None:
    good = encode(photo(40, 60, 30), quality=90)
    blobs = [b"not an image at all", good, b"\xff\xd8\xff", b"", good]
    workspace = _capi.Workspace(INSTANCE)
    statuses = workspace.parse(blobs)
    assert statuses[1] == statuses[4] == 0
    assert all(statuses[p] != 0 for p in (0, 2, 3)), statuses
    memory, decoded = _decode_into_host(workspace, cpu_decoder, [(40, 60)] * 2, [1, 4])
    assert decoded == [True, True]
    for row in range(2):
        np.testing.assert_array_equal(memory[row, :40, :60], pil_reference(good))


def test_a_corrupt_image_fails_alone_in_its_call(cpu_decoder: _capi.Decoder) -> None:
    good = encode(photo(40, 60, 31), quality=90)
    corrupt = bytearray(good)
    corrupt[len(good) // 2 : len(good) // 2 + 200] = b"\xff\x00" * 100  # entropy-coded data garbled
    corrupt = bytes(corrupt[: len(good) // 2 + 200])  # and cut short
    workspace = _capi.Workspace(INSTANCE)
    assert workspace.parse([good, corrupt]) == [0, 0]  # the header is intact
    _, decoded = _decode_into_host(workspace, cpu_decoder, [(40, 60)] * 2, [0, 1])
    assert decoded[0] is True


def test_a_call_submitted_while_the_decoder_works_on_another_decodes_both() -> None:
    """The registry returns a Decoder once a call is submitted (``_registry.py``): a second thread's
    call then starts before the first has been waited for. Each workspace keeps its code streams until
    its own wait, whichever thread waits first, and both batches get Pillow's pixels."""
    decoder = _capi.Decoder(
        INSTANCE, device_id=_capi.DEVICE_CPU_ONLY, backends=[(_capi.CPU_ONLY, 1.0)], cpu_threads=3
    )
    sizes = [(480, 640), (300, 200), (640, 480), (50, 70), (512, 512), (257, 193)]
    batches = [
        [encode(photo(h, w, seed * 10 + i), quality=90) for i, (h, w) in enumerate(sizes)] for seed in (1, 2)
    ]
    try:
        submitted = []
        for blobs in batches:
            workspace = _capi.Workspace(INSTANCE)
            assert workspace.parse(blobs) == [0] * len(blobs)
            memory = [np.full((h, w, 3), GUARD, dtype=np.uint8) for h, w in sizes]
            bound = workspace.bind(
                range(len(sizes)),
                [m.ctypes.data for m in memory],
                sizes,
                [w * 3 for _, w in sizes],
                stream=None,
                host=True,
            )
            assert bound == [0] * len(sizes)
            submitted.append((workspace.submit(decoder, range(len(sizes))), memory, blobs))
        for call, memory, blobs in reversed(submitted):  # the later call waited for first
            assert call.wait() == [True] * len(sizes)
            assert call.wait() == [True] * len(sizes)  # the same results again, not a second wait
            for image, data in zip(memory, blobs, strict=True):
                np.testing.assert_array_equal(image, pil_reference(data))
    finally:
        decoder.destroy()


def test_handles_are_reused_batch_after_batch() -> None:
    workspace = _capi.Workspace(INSTANCE)
    blobs = [encode(photo(20, 30, 40 + i)) for i in range(5)]
    workspace.parse(blobs)
    first = list(workspace._streams[:5])
    workspace.parse(blobs[::-1])
    assert list(workspace._streams[:5]) == first and all(first)
    workspace.parse(blobs * 30)  # grows: the handles made so far are kept
    assert list(workspace._streams[:5]) == first
    workspace.close()
    assert not any(workspace._streams)


def test_a_library_that_does_not_load_is_unsupported(tmp_path: object) -> None:
    with pytest.raises(_capi.Unsupported, match="cannot load"):
        _capi.Library(tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fancy", "extra"), [(True, ""), (False, ""), (True, "libjpeg_turbo_decoder:fancy_upsampling=0")]
)
def test_the_upsampling_option_reaches_nvimgcodecs_cpu_jpeg_decoder(
    fancy: bool, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jpeg_fancy_upsampling=False``'s options string repeats each 4:2:0 chroma sample on the CPU
    decoder too; on, the decoder interpolates as Pillow does. The image's chroma is constant in 2x2
    blocks, so repeating restores the image encoded (the reference) and interpolating does not.
    ``THREADLOADER_NVIMGCODEC_OPTIONS`` reaches nvImageCodec the same way: its option turns it off."""
    from threadloader.decode.nvimgcodec._engines import decoder_options

    monkeypatch.setenv("THREADLOADER_NVIMGCODEC_OPTIONS", extra)
    fancy_result = fancy and not extra

    original = np.random.default_rng(3).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    original = original.repeat(2, axis=0).repeat(2, axis=1)
    data = encode(original, quality=100, subsampling=2)
    decoder = _capi.Decoder(
        INSTANCE,
        device_id=_capi.DEVICE_CPU_ONLY,
        backends=[(_capi.CPU_ONLY, 1.0)],
        cpu_threads=1,
        options=decoder_options(fancy_upsampling=fancy, batch=0),
    )
    workspace = _capi.Workspace(INSTANCE)
    assert workspace.parse([data]) == [0]
    memory, decoded = _decode_into_host(workspace, decoder, [(80, 96)], [0])
    assert decoded == [True]
    error = float(np.abs(memory[0, :80, :96].astype(float) - original).mean())
    if fancy_result:
        assert error > 10.0, error  # Pillow's own decode is about 26 levels off
    else:
        assert error < 4.0, error
