"""The few facts about a JPEG bitstream that nvImageCodec does not get right by itself.

Written by hand because it is a walk over a handful of header segments, far cheaper than Pillow's
parser, which holds the GIL (docs/benchmarks.md).
"""

from __future__ import annotations

import re

__all__ = [
    "exif_orientation",
    "has_end_marker",
    "normalize_gray_sampling",
    "with_exif_orientation",
    "xmp_orientation_only",
]

_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not frames
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])  # TEM and RSTn carry no length
_APP1 = 0xE1
_SOS = 0xDA
_ORIENTATION_TAG = 0x0112
_SHORT = 3  # the TIFF type the orientation tag has
_ABSENT = 0  # _tiff_orientation's answer for a directory without the tag
_XMP = b"http://ns.adobe.com/xap/1.0/\x00"
_END = re.compile(rb"\xff\xd9")
_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")  # in coded data FF is followed by 00 or RSTn


def _octets(data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """``data`` indexed by byte, which every position here counts in.

    A memoryview of other items (a uint32 array's, or signed bytes, which never equal 0xFF), of several
    dimensions or with gaps (which ``re`` cannot search) becomes one of its unsigned bytes.
    """
    if not isinstance(data, memoryview) or (data.format == "B" and data.ndim == 1 and data.c_contiguous):
        return data
    return data.cast("B") if data.c_contiguous else memoryview(data.tobytes())


def _segments(data: bytes | bytearray | memoryview) -> list[tuple[int, int, int]]:
    """``(marker, position, length)`` of each header segment, up to and with the first scan's.

    A list made by one plain loop: asked of every JPEG the GPU decodes (:func:`xmp_orientation_only`),
    where a generator's per-segment cost was most of the answer's.
    """
    data = _octets(data)
    if data[:2] != b"\xff\xd8":
        return []
    found = []
    position, size = 2, len(data)
    while position + 4 <= size:
        marker = data[position + 1]
        if data[position] != 0xFF:
            break
        if marker == 0xFF:  # fill byte
            position += 1
        elif marker in _STANDALONE:
            position += 2
        else:
            length = (data[position + 2] << 8) | data[position + 3]
            found.append((marker, position, length))
            if marker == _SOS:
                break
            position += 2 + length
    return found


def normalize_gray_sampling(data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """Returns a single-component JPEG with its sampling factors set to 1x1, a copy only if needed.

    With nvImageCodec 0.9.0, grayscale JPEGs whose one component declares sampling factors other than
    1x1 (some encoders write 2x2) decode to wrong pixels (mean abs diff 50-65 against libjpeg). For a
    single component the factors do not change how the image is coded (its scan is non-interleaved,
    one block per MCU), so rewriting them to 1x1 is exact.
    """
    view = memoryview(_octets(data))
    for marker, position, _ in _segments(view):
        if marker == _SOS:  # a scan before any frame header: not a JPEG we can reason about
            return data
        if marker in _SOF_MARKERS:
            components = view[position + 9] if position + 9 < len(view) else 0
            sampling = position + 11
            if components != 1 or sampling >= len(view) or view[sampling] == 0x11:
                return data
            patched = bytearray(data)
            patched[sampling] = 0x11
            return bytes(patched)
    return data


def exif_orientation(data: bytes | bytearray | memoryview) -> int | None:
    """The EXIF orientation (1-8) of a JPEG; 1 without EXIF; ``None`` when unsure.

    nvImageCodec applies the orientation but reports the stored size: orientations 5-8 swap height and
    width. A region to decode is given in the displayed frame, so the displayed size must be known first.
    Unsure (a header walk that stops before the scan, EXIF that is not well formed, an orientation given
    only in XMP, which Pillow applies): ``None``, and the caller decodes the whole image, which is
    right whatever a decoder makes of such a header.
    """
    orientation, xmp_only = _orientation(data)
    return None if xmp_only else orientation


def xmp_orientation_only(data: bytes | bytearray | memoryview) -> bool:
    """Whether a JPEG's orientation is given in XMP (``tiff:Orientation``) and not in EXIF.

    Pillow applies it (it reads XMP where EXIF has no orientation); nvImageCodec reads EXIF only, so
    such a JPEG would come out turned on one path and not on the other. EXIF this cannot read (damaged,
    or a header walk that stops early) beside an XMP orientation counts too: Pillow may apply it.
    """
    data = _octets(data)
    return (
        any(
            marker == _APP1 and bytes(data[position + 4 : position + 4 + len(_XMP)]) == _XMP
            for marker, position, _ in _segments(data)
        )
        and _orientation(data)[1]
    )


def _orientation(data: bytes | bytearray | memoryview) -> tuple[int | None, bool]:
    """EXIF's orientation (1 where it has none; ``None`` unsure), and whether XMP gives one EXIF does not.

    EXIF does not when it has none, or has one this cannot read.
    """
    view = memoryview(_octets(data))
    exif: bytes | None = None
    xmp = False
    for marker, position, length in _segments(view):
        if marker == _SOS:
            if exif is None:
                return 1, xmp
            orientation = _tiff_orientation(exif)
            return (1 if orientation == _ABSENT else orientation), xmp and orientation in (None, _ABSENT)
        if marker != _APP1:
            continue
        if exif is None and bytes(view[position + 4 : position + 10]) == b"Exif\x00\x00":
            exif = bytes(view[position + 10 : position + 2 + length])
        elif not xmp and bytes(view[position + 4 : position + 4 + len(_XMP)]) == _XMP:
            xmp = bytes(view[position + 4 : position + 2 + length]).find(b"tiff:Orientation") >= 0
    return None, xmp  # a walk that stopped before the scan: unsure, Pillow's if XMP turns it


def _tiff_orientation(tiff: bytes) -> int | None:
    """The orientation tag of a TIFF structure's first directory (EXIF's layout); :data:`_ABSENT`."""
    order = {b"II": "little", b"MM": "big"}.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return None

    def number(at: int, size: int) -> int:
        return int.from_bytes(tiff[at : at + size], order)  # type: ignore[arg-type]

    if number(2, 2) != 42:  # TIFF's magic number
        return None
    directory = number(4, 4)
    if directory + 2 > len(tiff):
        return None
    for entry in range(directory + 2, directory + 2 + 12 * number(directory, 2), 12):
        if entry + 12 > len(tiff):
            return None
        if number(entry, 2) == _ORIENTATION_TAG:
            if number(entry + 2, 2) != _SHORT or number(entry + 4, 4) != 1:
                return None
            value = number(entry + 8, 2)
            return value if 1 <= value <= 8 else None
    return _ABSENT


def has_end_marker(data: bytes | bytearray | memoryview, *, tail: int = 1024) -> bool:
    """Whether the end-of-image marker (FF D9) is in the last ``tail`` bytes, after the scan's start.

    nvImageCodec 0.9.0 decodes a JPEG cut in half "successfully", garbage in its lower half. Such
    files go to Pillow, which raises for truncation; files with data after the marker (motion photos)
    also go there and decode correctly, only slower. FF D9 cannot occur inside entropy-coded data, but
    it does inside a segment: an EXIF thumbnail ends with one, and a progressive file has tables and
    comments between its scans, so a file cut in a later scan would have passed. The walk from the
    first scan skips each segment by its length; ``re`` finds the markers in the coded data, so no
    Python loop runs over its bytes. A file that ends with FF D9 (nearly every one) is not walked:
    only one cut right after those bytes inside a segment gets past that.
    """
    data = _octets(data)
    if data[-2:] == b"\xff\xd9":  # where nearly every file has it
        return True
    scan = next(((position, length) for marker, position, length in _segments(data) if marker == _SOS), None)
    if scan is None:  # no scan: nothing was decoded to end
        return False
    start = max(scan[0], len(data) - tail)
    if _END.search(data, start) is None:  # no copy of the tail, and no walk
        return False
    position = scan[0] + 2 + scan[1]  # the first scan's coded data
    while (found := _MARKER.search(data, position)) is not None:
        position = found.start()
        marker = data[position + 1]
        if marker == 0xD9:
            return position >= start
        if marker in _STANDALONE:
            position += 2
        elif position + 4 > len(data):  # cut in a segment's length
            return False
        else:
            position += 2 + ((data[position + 2] << 8) | data[position + 3])
    return False  # coded data or a segment runs to the end: cut


def with_exif_orientation(data: bytes, orientation: int) -> bytes:
    """A JPEG with an EXIF segment saying ``orientation`` (1-8) put after its start marker.

    For the decoders' self-tests: a photo that must come out turned shows whether a decoder applies
    EXIF orientation, and reports the shape it made.
    """
    entry = _ORIENTATION_TAG.to_bytes(2, "big") + _SHORT.to_bytes(2, "big") + (1).to_bytes(4, "big")
    directory = (1).to_bytes(2, "big") + entry + orientation.to_bytes(2, "big") + bytes(2) + bytes(4)
    payload = b"Exif\x00\x00" + b"MM\x00\x2a" + (8).to_bytes(4, "big") + directory
    return data[:2] + b"\xff\xe1" + (len(payload) + 2).to_bytes(2, "big") + payload + data[2:]
