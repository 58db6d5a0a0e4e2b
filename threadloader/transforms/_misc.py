"""Value transforms: per-channel normalization and dtype conversion."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ._transform import Transform
from .functional import CAST_DTYPES, SCALED_DTYPES, normalization, normalize, to_dtype

__all__ = ["Normalize", "ToDtype"]


class Normalize(Transform):
    """``(image - mean) / std`` per channel, on float images."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean, self.std = normalization(mean, std)

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Normalizes ``images``."""
        return normalize(images, self.mean, self.std)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"


class ToDtype(Transform):
    """Converts the dtype; with ``scale``, uint8 0-255 maps to float [0, 1] and back.

    Raises:
        TypeError: For ``dtype`` not a ``torch.dtype``.
        ValueError: For a dtype the conversion cannot produce (uint64 with ``scale``, torch's sub-byte
            types), when built rather than at the first batch.
    """

    def __init__(self, dtype: torch.dtype, *, scale: bool = False) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"ToDtype takes a torch.dtype (say torch.float32), got {dtype!r}")
        # Refused here, not with torch's NotImplementedError at the first batch, deep in a reader thread.
        accepted = SCALED_DTYPES if scale else CAST_DTYPES
        if dtype not in accepted:
            names = ", ".join(str(each).removeprefix("torch.") for each in accepted)
            without = " (or scale=False for a plain cast)" if dtype in CAST_DTYPES else ""
            raise ValueError(
                f"ToDtype(scale={scale}) converts to {names}, got {dtype}; use one of those{without}"
            )
        self.dtype = dtype
        self.scale = scale

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Converts ``images``."""
        return to_dtype(images, self.dtype, scale=self.scale)

    def __repr__(self) -> str:
        return f"ToDtype({self.dtype}, scale={self.scale})"
