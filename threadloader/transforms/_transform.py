"""The transform protocol (:class:`Transform`) and the chain of transforms (:class:`Compose`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._seeding import RandomSource
from ..decode.base import Region
from .functional import Images

__all__ = ["Compose", "Transform"]


class Transform:
    """A transform of ``(..., C, H, W)`` image tensors with torchvision.transforms.v2 semantics.

    Random transforms draw their parameters from a :data:`~threadloader._seeding.RandomSource` and the
    image's size only, before touching pixels: in a loader the generator is seeded from (seed, epoch,
    sample index), so crops do not depend on thread timing, and the parameters could be known from the
    header alone.
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
        padding holds arbitrary finite values (the decoder's are ``uint8``). The whole contract of region
        decoding is in ``threadloader.decode.base``.

        Returns:
            The region and the parameters that give the same output from the region alone; ``None``
            when the transform reads the whole image.
        """
        return None


class Compose(Transform):
    """Applies transforms in order; parameters are drawn in that order from the one generator."""

    def __init__(self, transforms: Sequence[Transform]) -> None:
        if isinstance(transforms, Transform) or not isinstance(transforms, Sequence):
            raise TypeError(f"Compose takes a list of transforms, got {transforms!r}: write Compose([...])")
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
        before: Transform | None = None
        for transform in self.transforms:
            if current is None:  # a transform of the user's that did not say its output's size
                raise TypeError(
                    f"{type(before).__name__}.output_size() returned None for a known input size, so "
                    f"{type(transform).__name__} after it cannot draw its parameters: return the output's "
                    "(height, width) from output_size"
                )
            params.append(transform.sample(current, generator))
            current, before = transform.output_size(current), transform
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
