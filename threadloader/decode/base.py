"""The small interface every decoder implements, GPU or CPU.

A decoder turns a batch of encoded images into RGB ``uint8`` HWC tensors on its device. Everything
after that (transforms, resize, dtype, normalize, layout) is device-agnostic tensor code in
``transforms`` and ``_output``, which is what makes the CPU and GPU paths give the same output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._regions import RegionOf
from .._stats import StatsRecorder

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "DecodedBatch",
    "Encoded",
    "ImageDecoder",
    "RegionOf",
    "pixel_limit_error",
]

Encoded = bytes | bytearray | memoryview

#: Default decompression-bomb guard: Pillow's own limit (about 89.5 million pixels, 9459 x 9459).
DEFAULT_MAX_PIXELS = 89_478_485


def pixel_limit_error(width: int, height: int, max_pixels: int | None) -> str | None:
    """The error for an image over the pixel limit, read from its header before anything is decoded."""
    if max_pixels is None or width * height <= max_pixels:
        return None
    return (
        f"{width}x{height} is {width * height:,} pixels, over the limit of {max_pixels:,} "
        "(decompression-bomb guard); pass a larger max_pixels=, or None, to allow it"
    )


@dataclass
class DecodedBatch:
    """A decoder's output for one batch, position by position.

    Attributes:
        images: RGB ``uint8`` tensors of shape ``(H, W, 3)`` on the decoder's device; ``None`` where the
            sample failed.
        errors: Position to the reason it failed, for each ``None`` in ``images``.
        stacked: A ``(B, H, W, 3)`` tensor whose slices are exactly ``images`` when every sample decoded
            to one shape, so later stages can work on the batch at once; otherwise ``None``.
        regions: Positions decoded as the region ``region_of`` asked for, not as the whole image.
        padded: When set, a ``(B, Hmax, Wmax, 3)`` tensor holding the image of each position in
            ``padded_rows`` at the top left of its row (the rest of a row is undefined), so images of
            different sizes can be resized at once. ``threadloader._regions`` has the whole contract of
            region decoding.
        padded_rows: Positions whose image is the top-left corner of its row of ``padded``.
    """

    images: list[torch.Tensor | None]
    errors: dict[int, str] = field(default_factory=dict)
    stacked: torch.Tensor | None = None
    regions: set[int] = field(default_factory=set)
    padded: torch.Tensor | None = None
    padded_rows: set[int] = field(default_factory=set)


class ImageDecoder(ABC):
    """Decodes whole batches; called concurrently from reader threads.

    Implementations must be safe to call from several threads at once: they serialize whatever their
    library cannot run concurrently themselves, so callers never need to know.
    """

    #: Where the decoded tensors live.
    device: torch.device

    #: Whether :meth:`decode` takes ``pad=``: decoders written before it existed are called without it.
    pads: bool = False

    @abstractmethod
    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StatsRecorder,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        """Decodes a batch.

        Args:
            encoded: Encoded images.
            stream: The calling thread's CUDA stream (``None`` on the CPU); all device work is queued on
                it and the returned tensors are ready once that stream reaches this point.
            stats: Where to add host time per stage.
            region_of: Lets a decoder that can decode part of an image (a random crop's region) ask
                which part; decoders that cannot ignore it and decode the whole image.
            pad: Given (as ``True``) only to decoders whose :attr:`pads` is set: the caller resizes the
                images as one batch, so images of different sizes may be decoded into
                ``DecodedBatch.padded``.

        Returns:
            One entry per input; a sample that cannot be decoded is reported in ``errors``, never raised.
        """
