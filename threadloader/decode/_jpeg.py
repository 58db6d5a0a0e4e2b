"""The few facts about a JPEG bitstream that nvImageCodec does not get right by itself.

Written by hand because it is a walk over a handful of header segments, a few microseconds, where
Pillow's parser costs tens of microseconds with the GIL held.
"""

from __future__ import annotations

__all__ = ["has_end_marker", "normalize_gray_sampling"]

_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not frames
_STANDALONE = frozenset([0x01, *range(0xD0, 0xD8)])  # TEM and RSTn carry no length


def normalize_gray_sampling(data: bytes | bytearray | memoryview) -> bytes | bytearray | memoryview:
    """Returns a single-component JPEG with its sampling factors set to 1x1, a copy only if needed.

    With nvImageCodec 0.9.0, grayscale JPEGs whose one component declares sampling factors other than
    1x1 (some encoders write 2x2) decode to wrong pixels (mean abs diff 50-65 against libjpeg). For a
    single component the factors do not change how the image is coded (its scan is non-interleaved,
    one block per MCU), so rewriting them to 1x1 is exact.
    """
    view = memoryview(data)
    position = 2
    if view[:2] != b"\xff\xd8":
        return data
    while position + 4 <= len(view):
        if view[position] != 0xFF:
            return data
        marker = view[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in _STANDALONE:
            position += 2
            continue
        length = (view[position + 2] << 8) | view[position + 3]
        if marker in _SOF_MARKERS:
            components = view[position + 9] if position + 9 < len(view) else 0
            sampling = position + 11
            if components != 1 or sampling >= len(view) or view[sampling] == 0x11:
                return data
            patched = bytearray(data)
            patched[sampling] = 0x11
            return bytes(patched)
        if marker == 0xDA:  # start of scan before any frame header: not a JPEG we can reason about
            return data
        position += 2 + length
    return data


def has_end_marker(data: bytes | bytearray | memoryview, *, tail: int = 1024) -> bool:
    """Whether the end-of-image marker (FF D9) is in the last ``tail`` bytes.

    nvImageCodec 0.9.0 decodes a JPEG cut in half "successfully", garbage in its lower half. Such
    files go to Pillow, which raises for truncation; files with data after the marker (motion photos)
    also go there and decode correctly, only slower. FF D9 cannot occur inside entropy-coded data.
    """
    end = bytes(data[-tail:])
    return b"\xff\xd9" in end
