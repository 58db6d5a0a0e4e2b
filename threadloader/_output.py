"""The pipeline's output settings: from decoded RGB ``uint8`` images to the tensors the consumer asked for.

Resize, dtype, normalization and layout, the last step of every batch on both paths, after the user's
transforms: the same torch kernels (:mod:`threadloader.transforms.functional`) on the CPU and the GPU,
on the reader thread's stream before the hand-off.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._checks import check_switch
from .decode.base import Region
from .transforms._checks import check_std
from .transforms._kernels import resample
from .transforms.functional import (
    Images,
    normalization,
    normalize,
    resample_many,
    resize,
    resize_many,
    to_dtype,
)

__all__ = ["FLOAT_DTYPES", "OutputFormat"]

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
            object.__setattr__(self, "size", _checked_size(self.size))
        if self.dtype != torch.uint8 and self.dtype not in FLOAT_DTYPES:
            # Named one by one: "a float type" refused torch.float8_e4m3fn, which is one.
            named = ", ".join(str(dtype) for dtype in FLOAT_DTYPES[:-1])
            raise ValueError(f"dtype must be torch.uint8, {named} or {FLOAT_DTYPES[-1]}, got {self.dtype}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("give mean and std together (normalization needs both)")
        if self.mean is not None and self.std is not None:
            if self.dtype == torch.uint8:
                raise ValueError(
                    "mean/std need a float dtype (e.g. dtype=torch.float32): uint8 cannot hold them"
                )
            mean, std = normalization(self.mean, self.std)
            for name, values in (("mean", mean), ("std", std)):
                if len(values) != 3:
                    raise ValueError(f"{name} needs one value per RGB channel, got {values!r}")
            # Refused when built, not at the first batch: a std that is zero in the type it divides in
            # (float32, float64 for float64 output) would make every pixel inf.
            check_std(tuple(std), torch.float64 if self.dtype == torch.float64 else torch.float32)
            object.__setattr__(self, "mean", mean)
            object.__setattr__(self, "std", std)
        object.__setattr__(self, "channels_last", check_switch("channels_last", self.channels_last))
        if self.channels_last and self.size is None:
            raise ValueError("channels_last needs size=(H, W): it is a layout of stacked 4-D batches")

    def apply(self, images: Images, *, extents: Sequence[tuple[int, int]] | None = None) -> Images:
        """Formats images.

        Args:
            images: ``(3, H, W)`` tensors on one device, or a ``(B, 3, H, W)`` batch of them; at least one.
                ``uint8`` (0-255), or float already in [0, 1] (as ``ToDtype(..., scale=True)`` leaves them).
            extents: For a batch of images of different sizes padded to one (needs ``size``): each
                image's ``(height, width)`` at the top left of its row. The padding is never read.

        Returns:
            A ``(B, 3, H, W)`` tensor when ``size`` is set, else a list of ``(3, H, W)`` tensors.
        """
        if len(images) == 0:
            raise ValueError("OutputFormat.apply needs at least one image")
        if extents is not None:
            if self.size is None or not isinstance(images, torch.Tensor) or len(extents) != len(images):
                raise ValueError(
                    f"extents= needs size=(H, W) and a padded batch tensor with one extent per row; got "
                    f"size={self.size}, {type(images).__name__} of {len(images)}, {len(extents)} extents"
                )
            regions = [(0, 0, height, width) for height, width in extents]
            fused = self._fused(images, regions)
            return fused if fused is not None else self._layout(self._finish(images, self.size, regions))
        if self.size is None:
            if isinstance(images, torch.Tensor):
                return list(self._finish(images, None).contiguous().unbind(0))
            return [self._finish(image.unsqueeze(0), None)[0].contiguous() for image in images]
        if not isinstance(images, torch.Tensor) and all(image.shape == images[0].shape for image in images):
            images = torch.stack(images)
        if isinstance(images, torch.Tensor):
            whole = [(0, 0, int(images.shape[-2]), int(images.shape[-1]))] * len(images)
            fused = self._fused(images, whole)
            if fused is not None:
                return fused
        return self._layout(self._finish(images, self.size))

    def prepare(self, device: torch.device) -> None:
        """Formats a tiny padded batch on ``device``: its GPU kernel is compiled before a batch needs it.

        The kernel's first launch compiles it (most of a second); nothing here needs a decoded image, so
        a warm-up runs it beside nvImageCodec's start rather than after the first decode. The kernel is
        compiled per input dtype, output dtype and normalization, whatever the batch's sizes: this
        compiles the one for ``uint8`` input, what the decoders produce.
        """
        if device.type != "cuda" or self.size is None:
            return
        height, width = self.size
        pixels = torch.zeros((1, height + 1, width + 1, 3), dtype=torch.uint8, device=device)
        self.apply(pixels.permute(0, 3, 1, 2), extents=[(height + 1, width + 1)])

    def _fused(self, batch: torch.Tensor, regions: list[Region]) -> torch.Tensor | None:
        """The whole format (resize, dtype, normalization, layout) in one GPU kernel; ``None`` elsewhere.

        Each torch op a reader thread dispatches lets go of the GIL, a hand-off a training loop pays
        (``transforms/_kernels.py``); this is one launch per batch instead of a dozen ops.
        """
        assert self.size is not None
        scale = not batch.is_floating_point() and self.dtype != torch.uint8
        return resample(
            batch,
            regions,
            self.size,
            dtype=self.dtype,
            divide=float(torch.iinfo(batch.dtype).max) if scale else 1.0,
            mean=self.mean,
            std=self.std,
            channels_last=self.channels_last,
        )

    @property
    def _memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def _layout(self, batch: torch.Tensor) -> torch.Tensor:
        """``batch`` in the output's memory format, in memory of its own.

        A batch already in that format (no resize, no cast) is rows of its decoder call's output: as a
        view it would keep the whole group's images alive for as long as the consumer holds it.
        """
        out = batch.contiguous(memory_format=self._memory_format)
        if out.untyped_storage().nbytes() > out.nbytes:
            return out.clone(memory_format=self._memory_format)
        return out

    def _finish(
        self, batch: Images, size: tuple[int, int] | None, regions: Sequence[Region] | None = None
    ) -> torch.Tensor:
        """Resizes a batch to ``size`` if needed, then converts and normalizes it.

        ``batch`` is a ``(B, 3, H, W)`` tensor, or a list of images of different sizes, which are
        resampled together (on the CPU, each alone: :func:`~.transforms.functional.resize_many`); with
        ``regions``, a batch tensor whose rows are resampled from those regions only. Float outputs are
        resized in float, without rounding to integers first.
        """
        source = batch[0].dtype
        if self.dtype == torch.uint8:
            work_dtype = source
        else:
            work_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        if regions is not None:
            assert size is not None
            work = resample_many(batch, regions, size, dtype=work_dtype)
        elif isinstance(batch, list):
            assert size is not None
            work = resize_many(batch, size, dtype=work_dtype)
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
        if not source.is_floating_point:  # an integer type's own range, as ToDtype(scale=True) has it
            work = work.div_(torch.iinfo(source).max)  # a new tensor here; exact, unlike a multiply
        if self.mean is not None and self.std is not None:
            work = normalize(work, self.mean, self.std, inplace=work is not batch)  # never the caller's
        return work.to(self.dtype)


def _checked_size(size: object) -> tuple[int, int]:
    """``size`` as ``(H, W)`` ints, or a ValueError naming the fix (an int is ambiguous: which side?)."""
    sides = tuple(size) if isinstance(size, Sequence) and not isinstance(size, str) else ()
    if len(sides) != 2 or not all(
        isinstance(side, numbers.Integral) and not isinstance(side, bool) and int(side) >= 1 for side in sides
    ):
        raise ValueError(
            f"size must be (height, width), two ints of at least 1, got {size!r}; for a square output "
            "pass (224, 224), to resize the shorter side keeping the aspect ratio transform=Resize(224)"
        )
    return int(sides[0]), int(sides[1])
