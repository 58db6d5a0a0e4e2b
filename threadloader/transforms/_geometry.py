"""Geometric transforms: they draw their parameters and call the kernels of :mod:`.functional`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch

from .._seeding import RandomSource, draws
from ..decode.base import Region
from . import functional as F
from ._transform import Transform
from .functional import Images

__all__ = ["CenterCrop", "RandomHorizontalFlip", "RandomResizedCrop", "Resize"]


def _sides(size: object, transform: str) -> tuple[int, int]:
    """``(H, W)`` from an int or a sequence of one (square) or two, as torchvision reads it; each >= 1."""
    sides = [size] if isinstance(size, numbers.Integral) else size
    if (
        isinstance(size, bool)
        or not isinstance(sides, Sequence)
        or isinstance(sides, str)
        or len(sides) not in (1, 2)
        or not all(_is_side(side) for side in sides)
    ):
        raise ValueError(
            f"{transform}: size must be an int of at least 1, or a sequence of one or two of them "
            f"(height, width), got {size!r}"
        )
    return int(sides[0]), int(sides[-1])


def _is_side(side: object) -> bool:
    return isinstance(side, numbers.Integral) and not isinstance(side, bool) and int(side) >= 1


class Resize(Transform):
    """Resizes to ``(H, W)``, or the shorter side to ``size`` keeping the aspect ratio (bilinear).

    Args:
        size: ``(H, W)``, or an int for the shorter side.
        max_size: With an int ``size``, the longer side is capped at this.
        antialias: Antialiased downscaling, as torchvision's default.
    """

    def __init__(
        self, size: int | Sequence[int], *, max_size: int | None = None, antialias: bool = True
    ) -> None:
        if size is None:
            raise ValueError(
                "Resize: size=None (the longer side to max_size) is not supported; pass the shorter "
                "side as an int, with max_size to cap the longer one"
            )
        height, width = _sides(size, "Resize")
        # torchvision reads an int, or a sequence of one, as the shorter side.
        shorter = isinstance(size, numbers.Integral) or len(size) == 1  # type: ignore[arg-type]
        self.size: int | tuple[int, int] = height if shorter else (height, width)
        self.max_size = max_size
        self.antialias = antialias
        if max_size is not None and not shorter:
            raise ValueError(f"Resize: max_size only with an int size (the shorter side), got size={size!r}")
        if max_size is not None and (not _is_side(max_size) or max_size <= height):
            raise ValueError(f"Resize: max_size must be an int larger than size ({height}), got {max_size!r}")

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """torchvision's rule for the resized size."""
        if not isinstance(self.size, int):
            return self.size
        if size is None:
            return None
        height, width = size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size, int(self.size * long / short)
        if self.max_size is not None and new_long > self.max_size:
            new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        out = (new_long, new_short) if width <= height else (new_short, new_long)
        if new_short < 1:  # torchvision's rule gives 0 too (max_size), and torch's resize failed on it
            raise ValueError(
                f"Resize({self.size}, max_size={self.max_size}) makes a {height}x{width} image "
                f"{out[0]}x{out[1]}: its sides are too unequal for that max_size; raise max_size, or crop "
                "the image first"
            )
        return out

    def __call__(self, images: torch.Tensor, *, generator: RandomSource = None) -> torch.Tensor:
        """Resizes ``images``."""
        return F.resize(images, self.output_size(tuple(images.shape[-2:])), antialias=self.antialias)  # type: ignore[arg-type]

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Resizes ``images`` (no parameters)."""
        return self(images)

    def apply_many(self, images: Images, params: Sequence[Any]) -> Images:
        """A list of images of different sizes to one ``(H, W)`` is resampled as one batch."""
        if isinstance(images, torch.Tensor) or isinstance(self.size, int):
            return super().apply_many(images, params)
        return F.resize_many(images, self.output_size(None), antialias=self.antialias)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"Resize({self.size!r}, max_size={self.max_size}, antialias={self.antialias})"


class CenterCrop(Transform):
    """Crops the center ``(H, W)`` (an int: square), padding with zeros where the image is smaller."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = _sides(size, "CenterCrop")

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """Always the crop size."""
        return self.size

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Crops the center, as torchvision's ``center_crop``."""
        return F.center_crop(images, self.size)

    def __repr__(self) -> str:
        return f"CenterCrop({self.size!r})"


class RandomResizedCrop(Transform):
    """Crops a random region of random area and aspect ratio, then resizes it to ``size``.

    The region is drawn by torchvision's rule (ten tries at an area in ``scale`` and a log-uniform
    aspect ratio in ``ratio``, else a central crop), from the generator only: with a ``torch.Generator``
    seeded as ``torch.manual_seed(s)`` seeds the global one, the regions are torchvision's (the aspect
    ratio's exponential is taken in double precision, torchvision's in single: about one region in
    100,000 differs by a pixel).
    """

    random = True

    def __init__(
        self,
        size: int | Sequence[int],
        *,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        antialias: bool = True,
    ) -> None:
        self.size = _sides(size, "RandomResizedCrop")
        for name, pair in (("scale", scale), ("ratio", ratio)):
            numeric = isinstance(pair, Sequence) and all(isinstance(v, numbers.Real) for v in pair)
            if not (numeric and len(pair) == 2):
                raise TypeError(f"RandomResizedCrop's {name} must be a (min, max) of numbers, got {pair!r}")
        finite = all(math.isfinite(v) for v in (*scale, *ratio))
        if not (finite and 0 <= scale[0] <= scale[1] and 0 < ratio[0] <= ratio[1]):
            raise ValueError(
                "RandomResizedCrop needs scale=(min, max) with 0 <= min <= max and ratio=(min, max) with "
                f"0 < min <= max, got scale={scale} and ratio={ratio}"
            )
        self.scale = scale
        self.ratio = ratio
        self.antialias = antialias
        self._log_ratio = [float(r) for r in torch.log(torch.tensor(ratio))]  # float32, as torchvision

    def sample(self, size: tuple[int, int], generator: RandomSource) -> tuple[int, int, int, int]:
        """The region ``(top, left, height, width)`` for an image of ``size``."""
        height, width = size
        area = height * width
        drawn = draws(generator)
        for _ in range(10):
            target_area = area * drawn.uniform(self.scale[0], self.scale[1])
            aspect_ratio = math.exp(drawn.uniform(self._log_ratio[0], self._log_ratio[1]))
            crop_w = round(math.sqrt(target_area * aspect_ratio))
            crop_h = round(math.sqrt(target_area / aspect_ratio))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                top = drawn.randrange(0, height - crop_h + 1)
                left = drawn.randrange(0, width - crop_w + 1)
                return top, left, crop_h, crop_w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            crop_w, crop_h = width, round(width / min(self.ratio))
        elif in_ratio > max(self.ratio):
            crop_h, crop_w = height, round(height * max(self.ratio))
        else:
            crop_w, crop_h = width, height
        return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """Always the crop size."""
        return self.size

    def apply(self, images: torch.Tensor, params: Region) -> torch.Tensor:
        """Crops the region and resizes it."""
        return F.resized_crop(images, params, self.size, antialias=self.antialias)

    def apply_many(self, images: Images, params: Sequence[Region]) -> Images:
        """Crops and resizes every image, each its own region, as one batch."""
        return F.resample_many(images, params, self.size, antialias=self.antialias)

    def split_region(self, params: Region) -> tuple[Region, Region]:
        """Reads only the crop: from the crop alone, the crop is the whole image."""
        _, _, height, width = params
        return params, (0, 0, height, width)

    def __repr__(self) -> str:
        return (
            f"RandomResizedCrop({self.size!r}, scale={self.scale}, ratio={self.ratio}, "
            f"antialias={self.antialias})"
        )


class RandomHorizontalFlip(Transform):
    """Flips left-right with probability ``p``."""

    random = True

    def __init__(self, p: float = 0.5) -> None:
        if not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a probability, a number from 0 to 1, got {p!r}")
        self.p: float = p

    def sample(self, size: tuple[int, int], generator: RandomSource) -> bool:
        """Whether to flip (torchvision's draw: one uniform number)."""
        return draws(generator).random() < self.p

    def apply(self, images: torch.Tensor, params: bool) -> torch.Tensor:
        """Flips when ``params`` says so."""
        return F.horizontal_flip(images) if params else images

    def apply_many(self, images: Images, params: Sequence[bool]) -> Images:
        """On a batch: one select between the batch and its mirror image, not a flip per image."""
        if not isinstance(images, torch.Tensor):
            return super().apply_many(images, params)
        return F.horizontal_flip_rows(images, params)

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"
