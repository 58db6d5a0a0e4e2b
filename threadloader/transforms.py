"""From decoded RGB ``uint8`` HWC images to the tensors the consumer asked for.

The same torch code runs on the CPU and the GPU, so both paths produce the same output from the same
pixels. Work is done on the whole batch where shapes allow: one resize kernel for a same-size batch,
not one op chain per image. On the GPU it runs on the reader thread's stream, before the hand-off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "FLOAT_DTYPES",
    "CenterCrop",
    "Compose",
    "Normalize",
    "OutputFormat",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "ToDtype",
    "Transform",
    "as_transform",
    "normalize",
    "resize",
    "sample_generator",
    "stacking_size",
    "to_dtype",
]

#: Floating-point output types; values are scaled to [0, 1] before normalization.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class OutputFormat:
    """What every batch looks like when it reaches the consumer.

    Attributes:
        size: ``(H, W)`` to resize every image to (bilinear with antialias, as torchvision's Resize on
            tensors) and stack into ``(B, 3, H, W)``; ``None`` keeps each image's size and returns a list
            of ``(3, H, W)`` tensors.
        dtype: ``torch.uint8`` (0-255), or a float type scaled to [0, 1].
        mean: Per-channel mean subtracted after scaling (float outputs only).
        std: Per-channel standard deviation divided by after subtracting ``mean``.
        channels_last: Return stacked batches in ``torch.channels_last`` memory format.
    """

    size: tuple[int, int] | None = None
    dtype: torch.dtype = torch.uint8
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    channels_last: bool = False

    def __post_init__(self) -> None:
        if self.size is not None:
            size = tuple(int(s) for s in self.size)
            if len(size) != 2 or min(size) < 1:
                raise ValueError(f"size must be (height, width) with positive sides, got {self.size!r}")
            object.__setattr__(self, "size", size)
        if self.dtype != torch.uint8 and self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be torch.uint8 or a float type, got {self.dtype}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("give mean and std together (normalization needs both)")
        if self.mean is not None and self.std is not None:
            if self.dtype == torch.uint8:
                raise ValueError(
                    "mean/std need a float dtype (e.g. dtype=torch.float32): uint8 cannot hold them"
                )
            for name, values in (("mean", self.mean), ("std", self.std)):
                if len(values) != 3:
                    raise ValueError(f"{name} needs one value per RGB channel, got {values!r}")
            if any(s == 0 for s in self.std):
                raise ValueError(f"std must not contain zeros, got {self.std!r}")
            object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
            object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if self.channels_last and self.size is None:
            raise ValueError("channels_last needs size=(H, W): it is a layout of stacked 4-D batches")

    def apply(
        self, images: Sequence[torch.Tensor], stacked: torch.Tensor | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """Formats images.

        Args:
            images: ``(3, H, W)`` tensors, all on one device; at least one. ``uint8`` (0-255), or float
                already in [0, 1] (as a ``ToDtype(..., scale=True)`` transform leaves them).
            stacked: Optionally the same images as one ``(B, 3, H, W)`` tensor, which saves a copy.

        Returns:
            A ``(B, 3, H, W)`` tensor when ``size`` is set, else a list of ``(3, H, W)`` tensors.
        """
        if not images:
            raise ValueError("OutputFormat.apply needs at least one image")
        if self.size is None:
            return [self._finish(image.unsqueeze(0), None)[0].contiguous() for image in images]
        if stacked is None and all(image.shape == images[0].shape for image in images):
            stacked = torch.stack(list(images))
        if stacked is not None:
            return self._layout(self._finish(stacked, self.size))
        return self._layout(torch.cat([self._finish(image.unsqueeze(0), self.size) for image in images]))

    @property
    def _memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def _layout(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.contiguous(memory_format=self._memory_format)

    def _finish(self, batch: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
        """Resizes a ``(B, 3, H, W)`` batch if needed, then converts and normalizes it."""
        resizing = size is not None and tuple(batch.shape[-2:]) != size
        if self.dtype == torch.uint8:
            return to_dtype(resize(batch, size) if resizing else batch, torch.uint8, scale=True)  # type: ignore[arg-type]
        work = batch.to(torch.float64 if self.dtype == torch.float64 else torch.float32)
        if resizing:
            work = resize(work, size)  # type: ignore[arg-type]
        if not batch.is_floating_point():
            work = work.div_(255)  # a new tensor here; exact, unlike a multiply by 1/255
        if self.mean is not None and self.std is not None:
            work = normalize(work, self.mean, self.std, inplace=True)  # work is this method's own tensor
        return work.to(self.dtype)


class Transform:
    """A transform of ``(..., C, H, W)`` image tensors with torchvision.transforms.v2 semantics.

    Random transforms draw their parameters from a ``torch.Generator`` and from the image's size only,
    before touching pixels: in a loader the generator is seeded from (seed, epoch, sample index), so
    crops do not depend on thread timing, and the parameters could be known from the header alone.
    A batch ``(B, C, H, W)`` gets one set of parameters, as in torchvision.
    """

    #: Whether parameters are drawn at random (per sample in a loader).
    random = False

    def __call__(self, images: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Applies the transform; random parameters come from ``generator`` (torch's default if None)."""
        return self.apply(images, self.sample(tuple(images.shape[-2:]), generator))  # type: ignore[arg-type]

    def sample(self, size: tuple[int, int], generator: torch.Generator | None) -> Any:
        """Parameters for an image of ``size`` (height, width); ``None`` for deterministic transforms."""
        return None

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """The output's (height, width) for an input of ``size`` (``None``: unknown), or ``None``."""
        return size

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Applies the transform with given parameters."""
        raise NotImplementedError


class Compose(Transform):
    """Applies transforms in order; parameters are drawn in that order from the one generator."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        for transform in transforms:
            if not isinstance(transform, Transform):
                raise TypeError(
                    f"{type(transform).__name__} is not a threadloader transform; use those of "
                    "threadloader.transforms (Resize, CenterCrop, RandomResizedCrop, RandomHorizontalFlip, "
                    "Normalize, ToDtype)"
                )
        self.transforms = list(transforms)
        self.random = any(t.random for t in self.transforms)

    def __call__(self, images: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Applies each transform in turn, each drawing from ``generator``."""
        for transform in self.transforms:
            images = transform(images, generator=generator)
        return images

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """The size along the chain (``None`` once it depends on an unknown input)."""
        for transform in self.transforms:
            size = transform.output_size(size)
        return size

    def __repr__(self) -> str:
        return f"Compose({self.transforms!r})"


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
        self.size = size
        self.max_size = max_size
        self.antialias = antialias
        if isinstance(size, int):
            if max_size is not None and max_size <= size:
                raise ValueError(f"max_size ({max_size}) must be larger than size ({size})")
        elif len(size) != 2 or max_size is not None:
            raise ValueError(
                "size must be an int (shorter side) or (height, width); max_size only with an int"
            )

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """torchvision's rule for the resized size."""
        if not isinstance(self.size, int):
            return (int(self.size[0]), int(self.size[1]))
        if size is None:
            return None
        height, width = size
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size, int(self.size * long / short)
        if self.max_size is not None and new_long > self.max_size:
            new_short, new_long = int(self.max_size * new_short / new_long), self.max_size
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, images: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """Resizes ``images``."""
        return resize(images, self.output_size(tuple(images.shape[-2:])), antialias=self.antialias)  # type: ignore[arg-type]

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Resizes ``images`` (no parameters)."""
        return self(images)

    def __repr__(self) -> str:
        return f"Resize({self.size!r}, max_size={self.max_size}, antialias={self.antialias})"


class CenterCrop(Transform):
    """Crops the center ``(H, W)`` (an int: square), padding with zeros where the image is smaller."""

    def __init__(self, size: int | Sequence[int]) -> None:
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """Always the crop size."""
        return self.size

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Crops the center, as torchvision's ``center_crop``."""
        height, width = images.shape[-2:]
        crop_h, crop_w = self.size
        if crop_h > height or crop_w > width:
            pad_top, pad_left = max(crop_h - height, 0) // 2, max(crop_w - width, 0) // 2
            pad = [pad_left, max(crop_w - width, 0) - pad_left, pad_top, max(crop_h - height, 0) - pad_top]
            images = F.pad(images, pad)
            height, width = images.shape[-2:]
        top = round((height - crop_h) / 2.0)
        left = round((width - crop_w) / 2.0)
        return images[..., top : top + crop_h, left : left + crop_w]

    def __repr__(self) -> str:
        return f"CenterCrop({self.size!r})"


class RandomResizedCrop(Transform):
    """Crops a random region of random area and aspect ratio, then resizes it to ``size``.

    The region is drawn by torchvision's rule (ten tries at an area in ``scale`` and a log-uniform
    aspect ratio in ``ratio``, else a central crop), from the generator only: with a generator seeded
    as ``torch.manual_seed(s)`` seeds the global one, the regions are exactly torchvision's.
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
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if scale[0] > scale[1] or ratio[0] > ratio[1]:
            raise ValueError(f"scale and ratio must be (min, max), got {scale} and {ratio}")
        self.scale = scale
        self.ratio = ratio
        self.antialias = antialias
        self._log_ratio = torch.log(torch.tensor(ratio))

    def sample(self, size: tuple[int, int], generator: torch.Generator | None) -> tuple[int, int, int, int]:
        """The region ``(top, left, height, width)`` for an image of ``size``."""
        height, width = size
        area = height * width
        for _ in range(10):
            target_area = (
                area * torch.empty(1).uniform_(self.scale[0], self.scale[1], generator=generator).item()
            )
            log_ratio = torch.empty(1).uniform_(
                float(self._log_ratio[0]), float(self._log_ratio[1]), generator=generator
            )
            aspect_ratio = torch.exp(log_ratio).item()
            crop_w = round(math.sqrt(target_area * aspect_ratio))
            crop_h = round(math.sqrt(target_area / aspect_ratio))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                top = int(torch.randint(0, height - crop_h + 1, size=(1,), generator=generator).item())
                left = int(torch.randint(0, width - crop_w + 1, size=(1,), generator=generator).item())
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

    def apply(self, images: torch.Tensor, params: tuple[int, int, int, int]) -> torch.Tensor:
        """Crops the region and resizes it."""
        top, left, height, width = params
        return resize(
            images[..., top : top + height, left : left + width], self.size, antialias=self.antialias
        )

    def __repr__(self) -> str:
        return f"RandomResizedCrop({self.size!r}, scale={self.scale}, ratio={self.ratio})"


class RandomHorizontalFlip(Transform):
    """Flips left-right with probability ``p``."""

    random = True

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a probability, got {p}")
        self.p = p

    def sample(self, size: tuple[int, int], generator: torch.Generator | None) -> bool:
        """Whether to flip (torchvision's draw: one uniform number)."""
        return bool(torch.rand(1, generator=generator).item() < self.p)

    def apply(self, images: torch.Tensor, params: bool) -> torch.Tensor:
        """Flips when ``params`` says so."""
        return images.flip(-1) if params else images

    def __repr__(self) -> str:
        return f"RandomHorizontalFlip(p={self.p})"


class Normalize(Transform):
    """``(image - mean) / std`` per channel, on float images."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        if any(s == 0 for s in std):
            raise ValueError(f"std must not contain zeros, got {std!r}")
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Normalizes ``images``."""
        return normalize(images, self.mean, self.std)

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean}, std={self.std})"


class ToDtype(Transform):
    """Converts the dtype; with ``scale``, uint8 0-255 maps to float [0, 1] and back."""

    def __init__(self, dtype: torch.dtype, *, scale: bool = False) -> None:
        self.dtype = dtype
        self.scale = scale

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Converts ``images``."""
        return to_dtype(images, self.dtype, scale=self.scale)

    def __repr__(self) -> str:
        return f"ToDtype({self.dtype}, scale={self.scale})"


def stacking_size(size: tuple[int, int] | None, transform: Transform | None) -> tuple[int, int] | None:
    """The output size of a front end: ``size`` if given, else a transform's fixed output size.

    A crop or a resize to (H, W) thus gives stacked batches; ``None`` keeps a list of images.
    """
    if size is not None or transform is None:
        return size
    return transform.output_size(None)


def as_transform(transform: Transform | Sequence[Transform] | None) -> Transform | None:
    """A loader's ``transform=`` argument as one transform (a list becomes a :class:`Compose`)."""
    if transform is None or isinstance(transform, Transform):
        return transform
    if isinstance(transform, Sequence):
        return Compose(transform)
    raise TypeError(
        f"transform must be a threadloader transform or a list of them, got {type(transform).__name__}; "
        "torchvision transforms draw from the global RNG, which is not reproducible across threads"
    )


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator for one sample's random parameters: a function of (seed, epoch, index) only."""
    mixed = 0x9E3779B97F4A7C15
    for value in (seed, epoch, index):
        mixed = ((mixed ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        mixed ^= mixed >> 31
    return torch.Generator().manual_seed(mixed & 0x7FFFFFFFFFFFFFFF)


_MASK64 = (1 << 64) - 1


def resize(images: torch.Tensor, size: tuple[int, int], *, antialias: bool = True) -> torch.Tensor:
    """Bilinear resize of ``(..., C, H, W)`` images, as torchvision's ``resize`` on tensors.

    Integer images are resized in float32 and rounded back, so every device gives the same result.
    """
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    shape = images.shape
    work = images.reshape(-1, *shape[-3:])
    floating = work if work.is_floating_point() else work.float()
    out = F.interpolate(floating, size=size, mode="bilinear", antialias=antialias, align_corners=False)
    if not images.is_floating_point():
        out = out.round_().clamp_(0, 255).to(images.dtype)
    return out.reshape(*shape[:-2], *size)


def to_dtype(images: torch.Tensor, dtype: torch.dtype, *, scale: bool) -> torch.Tensor:
    """Converts images, scaling ``uint8`` 0-255 to and from [0, 1] floats when ``scale`` is set."""
    if images.dtype == dtype:
        return images
    if not scale or images.is_floating_point() == dtype.is_floating_point:
        return images.to(dtype)
    if dtype.is_floating_point:
        return images.to(dtype).div_(255)  # exact: a multiply by 1/255 is one ulp off for half the bytes
    return images.mul(255 + 1 - 1e-3).to(dtype)  # torchvision's rule for float to uint8


def normalize(
    images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *, inplace: bool = False
) -> torch.Tensor:
    """``(images - mean) / std`` per channel, on float images; ``inplace`` for a tensor the caller owns."""
    if not images.is_floating_point():
        raise TypeError("normalize needs float images: convert with ToDtype(torch.float32, scale=True) first")
    mean_t = _channel_constant(tuple(float(m) for m in mean), images.device, images.dtype)
    std_t = _channel_constant(tuple(float(s) for s in std), images.device, images.dtype)
    if inplace:
        return images.sub_(mean_t).div_(std_t)
    return (images - mean_t) / std_t


@lru_cache(maxsize=64)
def _channel_constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A ``(C, 1, 1)`` tensor on ``device``, made once: a copy to the GPU per batch would sync the host."""
    return torch.tensor(values, dtype=dtype, device=device).view(-1, 1, 1)
