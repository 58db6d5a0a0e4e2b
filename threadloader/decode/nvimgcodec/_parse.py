"""The header pass over a batch: what each image is decoded as on the GPU, or why not there.

Every header is read by the engine in one pass (sizes, codec, EXIF orientation). Each position then
is an error (over the pixel limit: decoded by nobody), a sample for Pillow (with the reason), a
region (a random crop's part, drawn from the displayed size), or a whole image. Some inputs go to
Pillow on purpose, because the GPU would decode them wrongly or the contract needs it
(docs/design.md, "Nothing the GPU gives up on is an error yet"; docs/errors.md has the table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..._gil import Pacer
from ..base import Encoded, Region, RegionOf, pixel_limit_error
from ._engines import Engine, EngineBatch, Headers
from ._jpeg import has_end_marker, normalize_gray_sampling, xmp_orientation_only

__all__ = ["Parsed", "parse"]

#: Formats decoded on the GPU when they are plain 8-bit RGB; everything else goes to Pillow.
_GPU_FORMATS = frozenset(["jpeg", "jpeg2k", "png", "bmp", "tiff", "webp"])


@dataclass
class Parsed:
    """What each position of a batch is decoded as, or why not on the GPU.

    Attributes:
        batch: The engine's batch, its headers read (and regions set).
        shapes: Per position decoded on the GPU, the ``(height, width)`` it comes out at (a region's).
        regions: Positions decoded as their region.
        wholes: The whole images of ``regions``, as displayed, for a retry of the whole image.
        errors: Positions over the pixel limit, with the error: nobody decodes them.
        to_cpu: Positions for Pillow, with the reason.
        rewritten: Rewritten bitstreams, kept alive until decoded.
    """

    batch: EngineBatch
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    regions: set[int] = field(default_factory=set)
    wholes: dict[int, tuple[int, int]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    to_cpu: dict[int, str] = field(default_factory=dict)
    rewritten: list[Encoded] = field(default_factory=list)


def parse(
    engine: Engine, encoded: Sequence[Encoded], *, max_pixels: int | None, region_of: RegionOf | None
) -> Parsed:
    """Reads each header: over the pixel limit, for Pillow, or the image (or region) to decode."""
    batch = engine.parse(encoded)
    parsed = Parsed(batch)
    headers = batch.headers
    pacer = Pacer()
    for position, data in enumerate(encoded):
        pacer.tick()
        reason = headers.failures.get(position)
        if reason is not None:  # unparsable here: Pillow gets a try
            parsed.to_cpu[position] = reason
            continue
        height, width, codec = headers.heights[position], headers.widths[position], headers.codecs[position]
        limit = pixel_limit_error(width, height, max_pixels)
        if limit is not None:
            parsed.errors[position] = limit
            continue
        reason = _cpu_reason(headers, position, data)
        if reason is None and codec == "jpeg" and headers.channels[position] == 1:
            fixed = normalize_gray_sampling(data)
            if fixed is not data:
                parsed.rewritten.append(fixed)
                reason = batch.reparse(position, fixed)
        if reason is not None:
            parsed.to_cpu[position] = reason
            continue
        turned = headers.turned[position]
        shown = (width, height) if turned else (height, width)
        # Regions of JPEGs whose frame is known (the Python API may not know it before decoding).
        region = None
        if region_of is not None and codec == "jpeg" and turned is not None:
            region = _region(shown, position, region_of)
            if region is not None and not batch.crop(position, region):
                region = None
        if region is None:
            parsed.shapes[position] = shown
        else:
            parsed.wholes[position] = shown
            parsed.shapes[position] = (region[2], region[3])
            parsed.regions.add(position)
    return parsed


def _cpu_reason(headers: Headers, position: int, data: Encoded) -> str | None:
    """Why a sample should be decoded by Pillow instead, or ``None`` to decode it on the GPU.

    The GPU path takes what was checked against Pillow on the GPU: JPEG (grayscale, RGB, CMYK) with
    its end marker, and the other formats as 8-bit RGB. Alpha, palettes and 16-bit samples go to
    Pillow, which gives them the documented contract (alpha dropped, high byte kept).
    """
    if min(headers.heights[position], headers.widths[position]) < 1:  # a bind of no pixels fails the call
        return "the header declares no size (a JPEG whose height comes after its scan, in a DNL marker?)"
    codec = headers.codecs[position]
    if codec not in _GPU_FORMATS:
        return f"{codec or 'this'} format is not decoded on the GPU"
    if codec == "jpeg":
        if not has_end_marker(data):
            return "the JPEG has no end-of-image marker (truncated?)"
        if xmp_orientation_only(data):  # Pillow turns it; nvImageCodec reads EXIF's orientation only
            return "the JPEG's orientation is given in XMP only (tiff:Orientation), which Pillow applies"
        return None
    channels, eight_bit = headers.channels[position], headers.eight_bit[position]
    if channels != 3 or not eight_bit:
        samples = "8-bit" if eight_bit else "wider than 8-bit"
        return f"{codec} with {channels} channels of {samples} samples is decoded on the CPU"
    if headers.palette[position]:
        return f"palette {codec} is decoded on the CPU"
    return None


def _region(shown: tuple[int, int], position: int, region_of: RegionOf) -> Region | None:
    """The part of an image displayed as ``shown`` to decode: ``region_of``'s answer, unless the whole.

    Asked with the size as displayed: nvImageCodec crops after applying EXIF orientation (measured for
    every orientation), so a region is in the displayed frame. A region not inside the image is not
    decoded as one: the whole image is, and cropped after as on the CPU.
    """
    if min(shown) < 1:  # a header without a height (DNL): no size to draw a crop from
        return None
    region = region_of(position, shown)
    if region is None or region == (0, 0, *shown):
        return None
    top, left, height, width = region
    if min(top, left) < 0 or min(height, width) < 1 or top + height > shown[0] or left + width > shown[1]:
        return None  # not inside the image: the decoders give it up, which would count against regions
    return region
