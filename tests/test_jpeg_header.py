import io
import random

import numpy as np
import pytest
from PIL import Image

from threadloader.decode.nvimgcodec._jpeg import (
    exif_orientation,
    has_end_marker,
    normalize_gray_sampling,
    xmp_orientation_only,
)

from .conftest import encode, photo, pil_reference, with_gray_sampling, with_orientation


def test_gray_sampling_rewrite_is_exact() -> None:
    original = encode(photo(75, 100, 1), mode="L", quality=85)
    declared_2x2 = with_gray_sampling(original)
    assert declared_2x2 != original
    fixed = normalize_gray_sampling(declared_2x2)
    assert fixed == original
    np.testing.assert_array_equal(pil_reference(fixed), pil_reference(declared_2x2))


def test_other_files_are_returned_as_they_are() -> None:
    color = encode(photo(30, 40, 2), quality=90)
    gray = encode(photo(30, 40, 3), mode="L", quality=90)
    png = encode(photo(30, 40, 4), fmt="PNG")
    for data in (color, gray, png, b"", b"\xff\xd8", b"\xff\xd8\xff\xc0\x00"):
        assert normalize_gray_sampling(data) is data


def _exif_jpeg(orientation: int, order: bytes) -> bytes:
    """A JPEG whose APP1 carries one IFD entry, the orientation, in ``order`` ("II" or "MM")."""
    endian = "little" if order == b"II" else "big"
    tiff = order + (42).to_bytes(2, endian) + (8).to_bytes(4, endian) + (1).to_bytes(2, endian)
    tiff += (0x0112).to_bytes(2, endian) + (3).to_bytes(2, endian) + (1).to_bytes(4, endian)
    tiff += orientation.to_bytes(2, endian) + b"\x00\x00" + (0).to_bytes(4, endian)
    app1 = b"Exif\x00\x00" + tiff
    plain = encode(photo(8, 8, 5), quality=90)
    return plain[:2] + b"\xff\xe1" + (len(app1) + 2).to_bytes(2, "big") + app1 + plain[2:]


def test_exif_orientation_in_both_byte_orders() -> None:
    for orientation in range(1, 9):
        assert exif_orientation(with_orientation(photo(20, 30, 6), orientation)) == orientation
        for order in (b"II", b"MM"):
            data = _exif_jpeg(orientation, order)
            assert exif_orientation(data) == orientation
            assert pil_reference(data).shape[:2] == ((8, 8))
    assert exif_orientation(encode(photo(20, 30, 7), quality=90)) == 1  # no EXIF


def may_swap_sides(data: bytes | memoryview) -> bool:
    """What the Python API engine makes of a header: turned (5-8) or unsure, so checked once decoded."""
    orientation = exif_orientation(data)
    return orientation is None or orientation >= 5


def test_sides_may_swap_for_orientations_5_to_8_and_unsure_exif() -> None:
    # Pillow's transpose is the reference: the displayed image is the stored one turned on its side.
    for orientation in range(1, 9):
        data = with_orientation(photo(20, 30, 6), orientation)
        swapped = pil_reference(data).shape[:2] == (30, 20)
        assert may_swap_sides(data) is swapped
        assert may_swap_sides(memoryview(data)) is swapped
    assert may_swap_sides(encode(photo(20, 30, 7), quality=90)) is False  # no EXIF at all
    for orientation in (1, 6):  # EXIF after a header longer than the quick search: found by the walk
        exif = with_orientation(photo(20, 30, 6), orientation)
        app2 = b"\xff\xe2" + (40000).to_bytes(2, "big") + bytes(39998)  # an ICC profile's size
        late = exif[:2] + 2 * app2 + exif[2:]
        assert late.index(b"Exif") > 65536 and may_swap_sides(late) is (orientation == 6)
    # Bytes FF DA inside a segment before the EXIF (a thumbnail's, say) are not the start of the scan.
    decoy = b"\xff\xe0" + (8).to_bytes(2, "big") + b"JFXX\xff\xda"
    exif = with_orientation(photo(20, 30, 6), 6)
    assert may_swap_sides(exif[:2] + decoy + exif[2:]) is True
    broken = bytearray(_exif_jpeg(1, b"II"))
    broken[broken.index(b"II") : broken.index(b"II") + 2] = b"XX"  # EXIF that cannot be read: unsure
    assert may_swap_sides(bytes(broken)) is True


def test_exif_orientation_never_raises_on_damaged_headers() -> None:
    data = with_orientation(photo(20, 30, 8), 6)
    start = data.index(b"Exif")
    rng = random.Random(0)
    for _ in range(2000):
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 6)):
            damaged[rng.randrange(start - 4, start + 60)] = rng.randrange(256)
        assert exif_orientation(bytes(damaged)) in (None, *range(1, 9))
        assert exif_orientation(bytes(damaged[: rng.randrange(len(damaged))])) in (None, *range(1, 9))
    plain = encode(photo(20, 30, 10), quality=90)
    assert exif_orientation(plain[:2] + b"\x00" + plain[2:]) is None  # a walk cut short: unsure
    for junk in (b"", b"\xff\xd8", b"\xff\xd8\xff\xe1\x00\x02", b"\xff\xd8\xff\xe1\xff\xffExif\x00\x00II"):
        assert exif_orientation(junk) in (None, 1)


@pytest.mark.parametrize("orientation", range(1, 9))
def test_regions_are_asked_for_in_the_displayed_frame(orientation: int) -> None:
    """The C API engine reads the orientation from the header; a region is asked for with the size
    Pillow displays the image at (runs on the CPU: parsing needs no GPU)."""
    from threadloader.decode.nvimgcodec import _capi
    from threadloader.decode.nvimgcodec._engines import CApiEngine
    from threadloader.decode.nvimgcodec._parse import _region

    try:
        engine = CApiEngine(_capi.load())
    except _capi.Unsupported as exc:
        pytest.skip(f"nvImageCodec 0.9's C API is not usable here: {exc}")
    data = with_orientation(photo(20, 30, 9), orientation)
    headers = engine.parse([data]).headers
    shown = (
        (headers.widths[0], headers.heights[0])
        if headers.turned[0]
        else (headers.heights[0], headers.widths[0])
    )
    assert shown == pil_reference(data).shape[:2]
    asked = []

    def region_of(position: int, size: tuple[int, int]) -> tuple[int, int, int, int]:
        asked.append(size)
        return (1, 2, 3, 4)

    assert _region(shown, 0, region_of) == (1, 2, 3, 4)
    assert asked == [shown]
    assert _region(shown, 0, lambda position, size: (0, 0, *size)) is None  # the whole: not a region
    assert _region((0, 30), 0, region_of) is None  # a header without a height: nothing to draw from


@pytest.mark.parametrize(
    "region",
    [(-1, 0, 5, 5), (0, -2, 5, 5), (16, 0, 5, 5), (0, 26, 5, 5), (0, 0, 21, 5), (0, 0, 5, 31), (2, 2, 0, 5)],
    ids=["above", "left", "below", "right", "taller", "wider", "empty"],
)
def test_a_region_not_inside_the_image_is_decoded_whole(region: tuple[int, int, int, int]) -> None:
    """nvImageCodec takes such a region and its decoders give it up (libjpeg-turbo's, through the C API):
    each then counted as a region that failed where its whole image decoded, and 8 of them in a call
    turned region decoding off on the device. Decoded whole, the pipeline crops it as on the CPU."""
    from threadloader.decode.nvimgcodec._parse import _region

    assert _region((20, 30), 0, lambda position, size: region) is None
    assert _region((20, 30), 0, lambda position, size: (15, 25, 5, 5)) == (15, 25, 5, 5)  # the corner


def test_a_header_without_a_size_goes_to_pillow_alone() -> None:
    """A JPEG whose frame header gives height 0 (the height in a DNL marker after the scan): its
    memory of no pixels failed the C API's bind, and with it the whole call, so every image of it went
    to Pillow and the configuration counted as failing. Now only that image does."""
    import struct

    from threadloader.decode.nvimgcodec import _capi
    from threadloader.decode.nvimgcodec._engines import CApiEngine
    from threadloader.decode.nvimgcodec._parse import parse

    try:
        engine = CApiEngine(_capi.load())
    except _capi.Unsupported as exc:
        pytest.skip(f"nvImageCodec 0.9's C API is not usable here: {exc}")
    dnl = bytearray(encode(photo(16, 24, 3)))
    at = 2
    while dnl[at + 1] not in (0xC0, 0xC1, 0xC2):  # to the start of frame
        at += 2 + struct.unpack(">H", dnl[at + 2 : at + 4])[0]
    struct.pack_into(">H", dnl, at + 5, 0)
    encoded = [encode(photo(16, 24, 1)), bytes(dnl), encode(photo(20, 20, 2))]
    assert engine.parse(encoded).headers.heights == [16, 0, 20]  # nvImageCodec's header, as it is
    parsed = parse(engine, encoded, max_pixels=None, region_of=None)
    assert parsed.shapes == {0: (16, 24), 2: (20, 20)}
    assert list(parsed.to_cpu) == [1] and "no size" in parsed.to_cpu[1]


def test_end_marker_is_looked_for_in_the_tail_only() -> None:
    data = encode(photo(40, 60, 9), quality=90)
    whole = (data, memoryview(data), bytearray(data), data + b"motion photo", memoryview(data + b"x"))
    for blob in whole:
        assert has_end_marker(blob) is True
    cut = data[: len(data) // 2]
    with pytest.raises(OSError):  # Pillow, the reference: a file cut in half is truncated
        pil_reference(cut)
    for blob in (cut, memoryview(cut), bytearray(cut), b"", b"\xff"):
        assert has_end_marker(blob) is False
    assert has_end_marker(data + bytes(2000)) is False  # past the tail that is searched
    assert has_end_marker(data + bytes(2000), tail=4096) is True


def _with_segment(data: bytes, marker: int, payload: bytes) -> bytes:
    """``data`` with a segment put right after its start marker."""
    return data[:2] + bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:]


def _xmp(orientation: bytes) -> bytes:
    description = b'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/"' + orientation + b"/>"
    return b"http://ns.adobe.com/xap/1.0/\x00<x:xmpmeta><rdf:RDF>" + description + b"</rdf:RDF></x:xmpmeta>"


def test_an_orientation_in_xmp_only_is_pillows_to_apply() -> None:
    """Pillow turns a JPEG whose orientation only XMP gives; nvImageCodec reads EXIF's only, so the
    GPU path must not take it as unturned (it did: the paths gave (20, 30) and (30, 20))."""
    from threadloader.decode.nvimgcodec import _capi
    from threadloader.decode.nvimgcodec._engines import CApiEngine
    from threadloader.decode.nvimgcodec._parse import parse

    base = encode(photo(20, 30, 4), quality=90)
    only_xmp = _with_segment(base, 0xE1, _xmp(b' tiff:Orientation="6"'))
    assert Image.open(io.BytesIO(only_xmp)).getexif().get(0x0112) == 6  # the reference: Pillow reads it
    assert pil_reference(only_xmp).shape[:2] == (30, 20)
    assert xmp_orientation_only(only_xmp) and exif_orientation(only_xmp) is None
    for data in (memoryview(only_xmp), bytearray(only_xmp)):
        assert xmp_orientation_only(data)
    both = _with_segment(with_orientation(photo(20, 30, 4), 3), 0xE1, _xmp(b' tiff:Orientation="6"'))
    assert Image.open(io.BytesIO(both)).getexif().get(0x0112) == 3  # EXIF's wins in Pillow
    assert not xmp_orientation_only(both) and exif_orientation(both) == 3
    no_orientation = _with_segment(base, 0xE1, _xmp(b' tiff:Make="x"'))
    assert not xmp_orientation_only(no_orientation) and exif_orientation(no_orientation) == 1
    assert not xmp_orientation_only(base) and not xmp_orientation_only(base[:100])
    try:
        engine = CApiEngine(_capi.load())
    except _capi.Unsupported as exc:
        pytest.skip(f"nvImageCodec 0.9's C API is not usable here: {exc}")
    assert engine.parse([only_xmp]).headers.turned == [False]  # nvImageCodec: not turned
    parsed = parse(engine, [only_xmp, both], max_pixels=None, region_of=None)
    assert list(parsed.to_cpu) == [0] and "XMP" in parsed.to_cpu[0]


def test_an_end_marker_in_the_header_is_not_the_files_end() -> None:
    """An EXIF thumbnail ends with FF D9: a camera file cut early in its scan passed as whole."""
    thumbnail = encode(photo(8, 8, 5), quality=80)
    data = _with_segment(encode(photo(64, 64, 6), quality=90), 0xE2, b"thumbnail\x00" + thumbnail)
    scan = data.index(b"\xff\xda", len(thumbnail) + 20)
    for cut in (scan + 40, scan + 200):
        with pytest.raises(OSError):  # Pillow, the reference: truncated
            pil_reference(data[:cut])
        for blob in (data[:cut], memoryview(data[:cut]), bytearray(data[:cut])):
            assert has_end_marker(blob) is False
    assert has_end_marker(data) is True
    assert has_end_marker(data + b"motion photo") is True


def _gapped(data: bytes) -> memoryview:
    """A view of ``data``'s bytes with a gap after each: a slice of a larger buffer, not contiguous."""
    spread = np.zeros(2 * len(data), dtype=np.uint8)
    spread[::2] = np.frombuffer(data, dtype=np.uint8)
    return memoryview(spread[::2])


@pytest.mark.parametrize("marker", [0xFE, 0xEF])  # COM, APP15
def test_an_end_marker_in_a_segment_between_scans_is_not_the_files_end(marker: int) -> None:
    """A progressive file has segments between its scans: one whose payload holds FF D9 in the tail
    made a file cut in a later scan pass as whole (a fuzzer found it)."""
    data = encode(photo(64, 96, 7), quality=90, progressive=True)
    last = data.rindex(b"\xff\xda")  # FF DA never occurs in coded data: the last scan's header
    payload = b"ab\xff\xd9cd"
    segment = bytes([0xFF, marker]) + (len(payload) + 2).to_bytes(2, "big") + payload
    whole = data[:last] + segment + data[last:]
    assert len(whole) - last < 1024  # the segment's FF D9 is in the tail that is searched
    assert np.array_equal(pil_reference(whole), pil_reference(data))  # the reference: a whole file
    for blob in (whole, memoryview(whole), bytearray(whole), whole + b"motion photo", _gapped(whole)):
        assert has_end_marker(blob) is True
    after = last + len(segment)
    for cut in (last + 9, after + 2, after + (len(whole) - after) // 2, len(whole) - 1):
        with pytest.raises(OSError):  # Pillow, the reference: truncated
            pil_reference(whole[:cut])
        for blob in (whole[:cut], memoryview(whole[:cut]), bytearray(whole[:cut]), _gapped(whole[:cut])):
            assert has_end_marker(blob) is False, cut


def test_a_memoryview_of_wider_items_is_read_by_its_bytes() -> None:
    """Positions counted items: a valid JPEG seen through a uint32 or 2-D view had no end marker."""
    data = with_orientation(photo(20, 30, 4), 6)
    padded = data + bytes(-len(data) % 4)  # a whole number of uint32 items, the marker in the tail
    for view in (
        memoryview(np.frombuffer(padded, dtype=np.uint32)),
        memoryview(np.frombuffer(padded, dtype=np.uint8).reshape(-1, 4)),
    ):
        assert has_end_marker(view) is True
        assert exif_orientation(view) == 6 and not xmp_orientation_only(view)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # Pillow, on the damaged directory
def test_an_xmp_orientation_beside_exif_this_cannot_read_is_pillows() -> None:
    """Only EXIF read as having no orientation counted: a stray byte before a marker (Pillow skips it)
    or a damaged EXIF directory (Pillow keeps what it reads, then applies XMP) sent a turned photo to
    nvImageCodec, which ignores XMP."""
    base = encode(photo(20, 30, 4), quality=90)
    only_xmp = _with_segment(base, 0xE1, _xmp(b' tiff:Orientation="6"'))
    table = only_xmp.index(b"\xff\xc4")
    stray = only_xmp[:table] + b"\x00" + only_xmp[table:]
    entry = (0x010F).to_bytes(2, "little") + (2).to_bytes(2, "little") + (1).to_bytes(4, "little") + bytes(4)
    short = b"II*\x00" + (8).to_bytes(4, "little") + (5).to_bytes(2, "little") + entry + bytes(4)  # says 5
    damaged = _with_segment(only_xmp, 0xE1, b"Exif\x00\x00" + short)
    for data in (stray, damaged):
        assert pil_reference(data).shape[:2] == (30, 20)  # the reference: Pillow turns it
        assert xmp_orientation_only(data) and exif_orientation(data) is None
    assert not xmp_orientation_only(_with_segment(base, 0xE1, b"Exif\x00\x00" + short))  # no XMP: not


def test_views_of_other_items_find_the_xmp_orientation_and_the_end_marker() -> None:
    """xmp_orientation_only sliced a uint32 or 2-D view by byte positions (it read the wrong bytes),
    and a view of signed bytes compared unequal to every marker (a JPEG with no end marker)."""
    data = _with_segment(encode(photo(20, 30, 4), quality=90), 0xE1, _xmp(b' tiff:Orientation="6"'))
    padded = data + bytes(-len(data) % 4)
    for view in (
        memoryview(np.frombuffer(padded, dtype=np.uint32)),
        memoryview(np.frombuffer(padded, dtype=np.uint8).reshape(-1, 4)),
        memoryview(np.frombuffer(data, dtype=np.int8)),
        memoryview(data).cast("c"),
    ):
        assert xmp_orientation_only(view), view.format
        assert has_end_marker(view) is True and exif_orientation(view) is None
