"""CPU decoding with Pillow: the path for machines without a GPU, and the GPU path's fallback.

Pillow releases the GIL while it decodes, so reader threads decode in parallel. The output contract is
the one the GPU path keeps: RGB, EXIF orientation applied, grayscale and CMYK converted to RGB, alpha
dropped.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image, ImageOps

from .._stats import StatsRecorder
from .base import DecodedBatch, Encoded, ImageDecoder

__all__ = ["PillowDecoder", "decode_rgb"]


def decode_rgb(data: Encoded) -> np.ndarray:
    """Decodes one image to an ``(H, W, 3)`` ``uint8`` RGB array, EXIF orientation applied.

    Raises:
        Exception: Whatever Pillow raises for data it cannot decode.
    """
    with Image.open(io.BytesIO(data)) as image:
        image.load()
        oriented = ImageOps.exif_transpose(image)
        rgb = oriented if oriented.mode == "RGB" else oriented.convert("RGB")
        return np.array(rgb)  # writable, so torch.from_numpy can share it


class PillowDecoder(ImageDecoder):
    """Decodes a batch image by image in the calling thread."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StatsRecorder,
    ) -> DecodedBatch:
        """Decodes each image with Pillow; see :meth:`ImageDecoder.decode`."""
        batch = DecodedBatch(images=[])
        with stats.timed("decode"):
            for position, data in enumerate(encoded):
                try:
                    batch.images.append(torch.from_numpy(decode_rgb(data)))
                except Exception as exc:
                    batch.images.append(None)
                    batch.errors[position] = f"{type(exc).__name__}: {exc}"
        return batch
