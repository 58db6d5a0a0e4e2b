"""From decoded RGB ``uint8`` HWC images to the tensors the consumer asked for.

The same torch code runs on the CPU and the GPU, so both paths produce the same output from the same
pixels. Work is done on the whole batch where shapes allow: one resize kernel for a same-size batch,
not one op chain per image. On the GPU it runs on the reader thread's stream, before the hand-off.
"""

from __future__ import annotations

import math
import random
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
    "Images",
    "Normalize",
    "OutputFormat",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RandomSource",
    "Region",
    "Resize",
    "ToDtype",
    "Transform",
    "as_transform",
    "normalize",
    "resample_many",
    "resize",
    "sample_generator",
    "stacking_size",
    "to_dtype",
]

#: Where random parameters come from: a ``random.Random`` (what a loader uses for each sample: a few
#: microseconds for all of a sample's draws), a ``torch.Generator`` (torchvision's own draws, so the same
#: seed gives torchvision's regions; tens of microseconds), or ``None``: torch's global generator.
RandomSource = random.Random | torch.Generator | None

#: A region of an image: ``(top, left, height, width)``.
Region = tuple[int, int, int, int]

#: Images of a batch: a ``(B, C, H, W)`` tensor, or a list of ``(C, H, W)`` tensors of any sizes.
Images = torch.Tensor | list[torch.Tensor]

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

    def apply(self, images: Images) -> Images:
        """Formats images.

        Args:
            images: ``(3, H, W)`` tensors on one device, or a ``(B, 3, H, W)`` batch of them; at least one.
                ``uint8`` (0-255), or float already in [0, 1] (as ``ToDtype(..., scale=True)`` leaves them).

        Returns:
            A ``(B, 3, H, W)`` tensor when ``size`` is set, else a list of ``(3, H, W)`` tensors.
        """
        if len(images) == 0:
            raise ValueError("OutputFormat.apply needs at least one image")
        if self.size is None:
            if isinstance(images, torch.Tensor):
                return list(self._finish(images, None).contiguous().unbind(0))
            return [self._finish(image.unsqueeze(0), None)[0].contiguous() for image in images]
        if not isinstance(images, torch.Tensor) and all(image.shape == images[0].shape for image in images):
            images = torch.stack(images)
        return self._layout(self._finish(images, self.size))

    @property
    def _memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def _layout(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.contiguous(memory_format=self._memory_format)

    def _finish(self, batch: Images, size: tuple[int, int] | None) -> torch.Tensor:
        """Resizes a batch to ``size`` if needed, then converts and normalizes it.

        ``batch`` is a ``(B, 3, H, W)`` tensor, or a list of images of different sizes, which are
        resampled together (on the CPU, each alone: :func:`resample_many`). Float outputs are resized
        in float, without rounding to integers first.
        """
        integer = not batch[0].is_floating_point()
        if self.dtype == torch.uint8:
            work_dtype = batch[0].dtype
        else:
            work_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        if isinstance(batch, list):
            assert size is not None
            work = resample_many(batch, [_whole(image) for image in batch], size, dtype=work_dtype)
        else:
            work = batch.to(work_dtype)
            if size is not None and tuple(work.shape[-2:]) != size:
                work = resize(work, size)
        if self.dtype == torch.uint8:
            return to_dtype(work, torch.uint8, scale=True)
        if work.device.type == "cpu":
            # On a channels_last batch the per-channel constants broadcast along the innermost
            # dimension, a slow path on the CPU: the arithmetic is several times faster on NCHW.
            work = work.contiguous()
        if integer:
            work = work.div_(255)  # a new tensor here; exact, unlike a multiply by 1/255
        if self.mean is not None and self.std is not None:
            work = normalize(work, self.mean, self.std, inplace=work is not batch)  # never the caller's
        return work.to(self.dtype)


class Transform:
    """A transform of ``(..., C, H, W)`` image tensors with torchvision.transforms.v2 semantics.

    Random transforms draw their parameters from a :data:`RandomSource` and the image's size only,
    before touching pixels: in a loader the generator is seeded from (seed, epoch, sample index), so
    crops do not depend on thread timing, and the parameters could be known from the header alone.
    A batch ``(B, C, H, W)`` gets one set of parameters, as in torchvision.
    """

    #: Whether parameters are drawn at random (per sample in a loader).
    random = False

    def __call__(self, images: torch.Tensor, *, generator: RandomSource = None) -> torch.Tensor:
        """Applies the transform; random parameters come from ``generator`` (torch's default if None)."""
        return self.apply(images, self.sample(tuple(images.shape[-2:]), generator))  # type: ignore[arg-type]

    def sample(self, size: tuple[int, int], generator: RandomSource) -> Any:
        """Parameters for an image of ``size`` (height, width); ``None`` for deterministic transforms."""
        return None

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """The output's (height, width) for an input of ``size`` (``None``: unknown), or ``None``."""
        return size

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Applies the transform with given parameters."""
        raise NotImplementedError

    def apply_many(self, images: Images, params: Sequence[Any]) -> Images:
        """Applies the transform to many images, each with its own parameters.

        Args:
            images: A list of ``(C, H, W)`` tensors, or a ``(B, C, H, W)`` batch of them.
            params: One entry of :meth:`sample` per image.

        Returns:
            A batch tensor where the result has one size, which later stages then treat at once; else a
            list. The default runs once on a batch when there are no parameters, else per image.
        """
        if isinstance(images, torch.Tensor) and not self.random:
            return self.apply(images, None)
        return [self.apply(image, p) for image, p in zip(images, params, strict=True)]

    def split_region(self, params: Any) -> tuple[Region, Any] | None:
        """The part of the image this transform reads, for decoders that can decode only that part.

        A transform that returns a region must accept, in :meth:`apply_many`, a batch tensor of
        regions padded to one size, each at the top left of its row (its new parameters say where); the
        padding holds arbitrary finite values (the decoder's are ``uint8``).

        Returns:
            The region and the parameters that give the same output from the region alone; ``None``
            when the transform reads the whole image.
        """
        return None


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

    def sample(self, size: tuple[int, int], generator: RandomSource) -> list[Any]:
        """Each transform's parameters in order, for the size it will see: all known from ``size``."""
        params = []
        current: tuple[int, int] | None = size
        for transform in self.transforms:
            assert current is not None  # output_size of a known size is known
            params.append(transform.sample(current, generator))
            current = transform.output_size(current)
        return params

    def apply(self, images: torch.Tensor, params: list[Any]) -> torch.Tensor:
        """Applies each transform with its parameters."""
        for transform, own in zip(self.transforms, params, strict=True):
            images = transform.apply(images, own)
        return images

    def apply_many(self, images: Images, params: Sequence[list[Any]]) -> Images:
        """Applies each transform in turn to all images, so each step can batch its work."""
        for step, transform in enumerate(self.transforms):
            images = transform.apply_many(images, [own[step] for own in params])
        return images

    def split_region(self, params: list[Any]) -> tuple[Region, list[Any]] | None:
        """The first transform's region, when it reads only part of the image."""
        if not self.transforms:
            return None
        split = self.transforms[0].split_region(params[0])
        if split is None:
            return None
        region, first = split
        return region, [first, *params[1:]]

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

    def __call__(self, images: torch.Tensor, *, generator: RandomSource = None) -> torch.Tensor:
        """Resizes ``images``."""
        return resize(images, self.output_size(tuple(images.shape[-2:])), antialias=self.antialias)  # type: ignore[arg-type]

    def apply(self, images: torch.Tensor, params: Any) -> torch.Tensor:
        """Resizes ``images`` (no parameters)."""
        return self(images)

    def apply_many(self, images: Images, params: Sequence[Any]) -> Images:
        """A list of images of different sizes to one ``(H, W)`` is resampled as one batch."""
        if isinstance(images, torch.Tensor) or isinstance(self.size, int):
            return super().apply_many(images, params)
        return resample_many(
            images,
            [_whole(image) for image in images],
            self.output_size(None),  # type: ignore[arg-type]
            antialias=self.antialias,
        )

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
        self.size = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
        if scale[0] > scale[1] or ratio[0] > ratio[1]:
            raise ValueError(f"scale and ratio must be (min, max), got {scale} and {ratio}")
        self.scale = scale
        self.ratio = ratio
        self.antialias = antialias
        self._log_ratio = [float(r) for r in torch.log(torch.tensor(ratio))]  # float32, as torchvision

    def sample(self, size: tuple[int, int], generator: RandomSource) -> tuple[int, int, int, int]:
        """The region ``(top, left, height, width)`` for an image of ``size``."""
        height, width = size
        area = height * width
        draws = _draws(generator)
        for _ in range(10):
            target_area = area * draws.uniform(self.scale[0], self.scale[1])
            aspect_ratio = math.exp(draws.uniform(self._log_ratio[0], self._log_ratio[1]))
            crop_w = round(math.sqrt(target_area * aspect_ratio))
            crop_h = round(math.sqrt(target_area / aspect_ratio))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                top = draws.randrange(0, height - crop_h + 1)
                left = draws.randrange(0, width - crop_w + 1)
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
        batch = images.reshape(-1, *images.shape[-3:])  # any leading dimensions, one region for all
        out = resample_many(batch, [params] * len(batch), self.size, antialias=self.antialias)
        return out.reshape(*images.shape[:-2], *self.size)

    def apply_many(self, images: Images, params: Sequence[Region]) -> Images:
        """Crops and resizes every image, each its own region, as one batch."""
        return resample_many(images, params, self.size, antialias=self.antialias)

    def split_region(self, params: Region) -> tuple[Region, Region]:
        """Reads only the crop: from the crop alone, the crop is the whole image."""
        _, _, height, width = params
        return params, (0, 0, height, width)

    def __repr__(self) -> str:
        return f"RandomResizedCrop({self.size!r}, scale={self.scale}, ratio={self.ratio})"


class RandomHorizontalFlip(Transform):
    """Flips left-right with probability ``p``."""

    random = True

    def __init__(self, p: float = 0.5) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a probability, got {p}")
        self.p = p

    def sample(self, size: tuple[int, int], generator: RandomSource) -> bool:
        """Whether to flip (torchvision's draw: one uniform number)."""
        return _draws(generator).random() < self.p

    def apply(self, images: torch.Tensor, params: bool) -> torch.Tensor:
        """Flips when ``params`` says so."""
        return images.flip(-1) if params else images

    def apply_many(self, images: Images, params: Sequence[bool]) -> Images:
        """On a batch: one select between the batch and its mirror image, not a flip per image."""
        if not isinstance(images, torch.Tensor):
            return super().apply_many(images, params)
        if not any(params):
            return images
        if all(params):
            return images.flip(-1)
        flips = _to_device(torch.tensor(params, dtype=torch.bool), images.device)
        return torch.where(flips.view(-1, 1, 1, 1), images.flip(-1), images)

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


def sample_generator(seed: int, epoch: int, index: int) -> random.Random:
    """A generator for one sample's random parameters: a function of (seed, epoch, index) only.

    A ``random.Random``: a sample's draws cost a few microseconds, against tens with torch's.
    """
    mixed = 0x9E3779B97F4A7C15
    for value in (seed, epoch, index):
        mixed = ((mixed ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9) & _MASK64
        mixed ^= mixed >> 31
    return random.Random(mixed)


class _TorchDraws:
    """torchvision's draws from a torch generator, under ``random.Random``'s method names."""

    __slots__ = ("_generator",)

    def __init__(self, generator: torch.Generator | None) -> None:
        self._generator = generator

    def uniform(self, low: float, high: float) -> float:
        return torch.empty(1).uniform_(low, high, generator=self._generator).item()

    def randrange(self, start: int, stop: int) -> int:
        return int(torch.randint(start, stop, size=(1,), generator=self._generator).item())

    def random(self) -> float:
        return torch.rand(1, generator=self._generator).item()


def _draws(generator: RandomSource) -> random.Random | _TorchDraws:
    return generator if isinstance(generator, random.Random) else _TorchDraws(generator)


_MASK64 = (1 << 64) - 1


def resize(images: torch.Tensor, size: tuple[int, int], *, antialias: bool = True) -> torch.Tensor:
    """Bilinear resize of ``(..., C, H, W)`` images, as torchvision's ``resize`` on tensors.

    ``uint8`` images on the CPU go through torch's own ``uint8`` kernel (what torchvision uses there):
    several times faster than converting to float, and within 1 of the float result rounded. Other
    integer images, and all on the GPU, are resized in float32 and rounded back.
    """
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    shape = images.shape
    work = images.reshape(-1, *shape[-3:])
    if work.dtype == torch.uint8 and work.device.type == "cpu":
        # Fastest on channels_last input, which a decoded HWC image permuted to CHW already is.
        out = F.interpolate(work, size=size, mode="bilinear", antialias=antialias, align_corners=False)
        return out.reshape(*shape[:-2], *size)
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


#: Most float elements one :func:`resample_many` step works on at once (128 MiB of float32), to bound
#: the memory of padding a batch of large, different-size images to one size.
_RESAMPLE_ELEMENTS = 2**25


def resample_many(
    images: Images,
    regions: Sequence[Region],
    size: tuple[int, int],
    *,
    antialias: bool = True,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Crops each image to its region and resizes that to ``size``: one batch of work for all images.

    On the GPU, computes what :func:`resize` computes on each crop (torch's bilinear filter,
    antialiased when downscaling), but as two matrix products per image, ``Wy @ image @ Wx.T``, whose
    weight matrices also select the region. Images of different sizes are padded to one size and
    handled together, so a batch costs a fixed number of kernels instead of a chain of them per image.
    Results equal :func:`resize` of each crop to within float rounding (at most 1 in 0-255 after
    rounding). On the CPU, where a kernel call costs little and the padded products do many times the
    work of torch's resize, each crop goes through :func:`resize` alone, so an image's result does not
    depend on the other images of the batch.

    Args:
        images: ``(C, H, W)`` tensors on one device, or a ``(B, C, H, W)`` batch.
        regions: ``(top, left, height, width)`` inside each image.
        size: Output ``(height, width)``.
        antialias: Antialiased downscaling, as :func:`resize`.
        dtype: Of the result; default the images' (integers are rounded back).

    Returns:
        A ``(B, C, *size)`` tensor.
    """
    if len(images) != len(regions) or len(images) == 0:
        raise ValueError(
            f"resample_many needs one region per image and at least one image, got "
            f"{len(images)} images and {len(regions)} regions"
        )
    # Sizes without iterating a batch tensor: that makes a view per image, several microseconds each.
    sizes = (
        [tuple(images.shape[-2:])] * len(images)
        if isinstance(images, torch.Tensor)
        else [tuple(image.shape[-2:]) for image in images]
    )
    for region, (image_height, image_width) in zip(regions, sizes, strict=True):
        top, left, height, width = region
        if (
            height < 1
            or width < 1
            or top < 0
            or left < 0
            or top + height > image_height
            or left + width > image_width
        ):
            raise ValueError(f"region {region} is not inside an image of size {(image_height, image_width)}")
    if images[0].device.type == "cpu":
        return _resample_each(images, regions, size, antialias, dtype)
    height = max(h for h, _ in sizes)
    width = max(w for _, w in sizes)
    channels = images.shape[-3] if isinstance(images, torch.Tensor) else images[0].shape[-3]
    step = max(1, _RESAMPLE_ELEMENTS // (channels * height * width))
    parts = [
        _resample(images[start : start + step], regions[start : start + step], size, antialias, dtype)
        for start in range(0, len(images), step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _resample(
    images: Images,
    regions: Sequence[Region],
    size: tuple[int, int],
    antialias: bool,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    if isinstance(images, torch.Tensor):
        hwc = images.permute(0, 2, 3, 1)  # decoded batches are HWC memory: then a view
    elif all(image.shape == images[0].shape for image in images):
        hwc = torch.stack(images).permute(0, 2, 3, 1)
    else:
        height = max(image.shape[-2] for image in images)
        width = max(image.shape[-1] for image in images)
        # Padding gets zero weight; zeros only where garbage could be NaN (floats): 0 * NaN is NaN.
        blank = torch.zeros if images[0].is_floating_point() else torch.empty
        hwc = blank(
            (len(images), height, width, images[0].shape[-3]), dtype=images[0].dtype, device=images[0].device
        )
        for row, image in zip(hwc, images, strict=True):
            row[: image.shape[-2], : image.shape[-1]].copy_(image.permute(1, 2, 0))
    target = dtype or hwc.dtype
    compute = torch.float64 if torch.float64 in (hwc.dtype, target) else torch.float32
    batch, height, width, channels = hwc.shape
    (out_h, out_w) = size
    # One call builds the weights of both axes: (top, height, out_h) per region, then (left, width, out_w).
    spans = [(top, h, out_h) for top, _, h, _ in regions] + [(left, w, out_w) for _, left, _, w in regions]
    on_device = _to_device(torch.tensor(spans, dtype=compute), hwc.device)
    weights = _filter_weights(on_device, max(out_h, out_w), max(height, width), antialias)
    rows = weights[:batch, :out_h, :height]  # (B, out_h, H)
    columns = weights[batch:, :out_w, :width]  # (B, out_w, W)
    # Two batched products over (B, H, W*C) views: rows first, then columns after one transpose.
    work = hwc.reshape(batch, height, width * channels).to(compute)
    tall = torch.bmm(rows, work).view(batch, out_h, width, channels)
    wide = tall.transpose(1, 2).reshape(batch, width, out_h * channels)
    out = torch.bmm(columns, wide).view(batch, out_w, out_h, channels).permute(0, 3, 2, 1)
    if not target.is_floating_point:
        out = out.round_().clamp_(0, 255)
    return out.to(target)


def _resample_each(
    images: Images,
    regions: Sequence[Region],
    size: tuple[int, int],
    antialias: bool,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """:func:`resample_many` on the CPU: each crop resized alone, into one contiguous batch.

    ``uint8`` to ``uint8`` stays integer (torch's fast kernel); otherwise a crop is resized in float32
    (float64 when either side is), as :func:`_resample` computes, and rounded back to integers.
    """
    target = dtype or images[0].dtype
    out = torch.empty((len(images), images[0].shape[-3], *size), dtype=target)
    for row, image, (top, left, height, width) in zip(out, images, regions, strict=True):
        crop = image[..., top : top + height, left : left + width].unsqueeze(0)  # keeps its strides
        if crop.dtype == target == torch.uint8:
            resized = resize(crop, size, antialias=antialias)
        else:
            compute = torch.float64 if torch.float64 in (crop.dtype, target) else torch.float32
            resized = resize(crop.to(compute), size, antialias=antialias)
            if not target.is_floating_point:
                resized = resized.round().clamp_(0, 255)
        row.copy_(resized[0])
    return out


def _filter_weights(spans: torch.Tensor, out_size: int, padded: int, antialias: bool) -> torch.Tensor:
    """``(N, out_size, padded)`` bilinear weights, one matrix per ``(start, length, out)`` row of ``spans``.

    Row ``i`` of a matrix samples output pixel ``i`` of ``out`` (later ones are unused) from the span
    ``[start, start + length)``, by torch's interpolation rule: output pixel ``i`` is centred at
    ``(i + 0.5) * scale`` in the span; antialiased, the triangle filter is widened by the downscale
    factor and renormalized where it leaves the span; plain bilinear clamps at the edges instead.
    """
    start, length, out = (spans[:, k, None, None] for k in range(3))
    scale = length / out
    centers = (torch.arange(out_size, device=spans.device, dtype=spans.dtype)[None, :, None] + 0.5) * scale
    offsets = torch.arange(padded, device=spans.device, dtype=spans.dtype)[None, None, :] - start
    inside = (offsets >= 0) & (offsets < length)
    if antialias:
        distance = (offsets + 0.5 - centers) / scale.clamp(min=1.0)
        weights = (1 - distance.abs()).clamp_(min=0) * inside
        return weights / weights.sum(-1, keepdim=True).clamp_(min=torch.finfo(spans.dtype).tiny)
    source = (centers - 0.5).clamp(min=0)
    low = source.floor()
    fraction = source - low
    high = torch.minimum(low + 1, length - 1)
    return ((offsets == low) * (1 - fraction) + (offsets == high) * fraction) * inside


def _whole(image: torch.Tensor) -> Region:
    return (0, 0, int(image.shape[-2]), int(image.shape[-1]))


def _to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copies a small host tensor to ``device`` without waiting for the stream.

    Through pinned memory from torch's host cache, which keeps it until the copy has run; a pageable
    copy would wait. Staged by hand: ``Tensor.pin_memory()`` first asks the driver whether the tensor is
    pinned already, about 90 us on an H200 host.
    """
    if device.type == "cpu":
        return values
    staged = torch.empty(values.shape, dtype=values.dtype, device="cpu", pin_memory=True).copy_(values)
    return staged.to(device, non_blocking=True)
