"""CPU decoding with Pillow: the path for machines without a GPU, and the GPU path's fallback.

Pillow releases the GIL while it decodes, so reader threads decode in parallel. The output contract is
the one the GPU path keeps: RGB, EXIF orientation applied, grayscale and CMYK converted to RGB, alpha
dropped, 16-bit samples reduced to their high byte.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from .._stats import StatsRecorder
from .base import DEFAULT_MAX_PIXELS, DecodedBatch, Encoded, ImageDecoder, RegionOf, pixel_limit_error

__all__ = ["PillowDecoder", "decode_rgb"]


_SIXTEEN_BIT_GRAY = frozenset(["I;16", "I;16L", "I;16B", "I;16N", "I"])

#: The EXIF orientation tag, and its values that flip or rotate the image (1 is upright).
_ORIENTATION = 0x0112
_TURNS = frozenset(range(2, 9))


def decode_rgb(data: Encoded, *, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decodes one image to an ``(H, W, 3)`` ``uint8`` RGB array, EXIF orientation applied.

    Alpha is dropped (not composited); palettes are expanded; 16-bit samples keep their high byte,
    as the GPU decoders scale them.

    Raises:
        ValueError: If the header declares more than ``max_pixels`` pixels (nothing is decoded).
        Exception: Whatever Pillow raises for data it cannot decode.
    """
    with Image.open(io.BytesIO(data)) as image:
        limit = pixel_limit_error(image.width, image.height, max_pixels)
        if limit is not None:
            raise ValueError(limit)
        image.load()
        # exif_transpose copies an image it does not turn: only call it for an orientation that turns.
        turned = image.getexif().get(_ORIENTATION, 1) in _TURNS
        oriented = ImageOps.exif_transpose(image) if turned else image
        if oriented.mode in _SIXTEEN_BIT_GRAY:
            gray = (np.asarray(oriented, dtype=np.uint32) >> 8).clip(0, 255).astype(np.uint8)
            return np.repeat(gray[..., None], 3, axis=2)
        rgb = oriented if oriented.mode == "RGB" else oriented.convert("RGB")
        return np.array(rgb)  # writable, so torch.from_numpy can share it


class PillowDecoder(ImageDecoder):
    """Decodes a batch image by image in the calling thread."""

    def __init__(self, *, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> None:
        self.device = torch.device("cpu")
        self._max_pixels = max_pixels

    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StatsRecorder,
        region_of: RegionOf | None = None,
    ) -> DecodedBatch:
        """Decodes each whole image with Pillow; see :meth:`ImageDecoder.decode` (``region_of`` unused)."""
        batch = DecodedBatch(images=[])
        with stats.timed("decode"):
            for position, data in enumerate(encoded):
                try:
                    batch.images.append(torch.from_numpy(decode_rgb(data, max_pixels=self._max_pixels)))
                except Exception as exc:
                    batch.images.append(None)
                    batch.errors[position] = f"{type(exc).__name__}: {exc}"
        return batch
