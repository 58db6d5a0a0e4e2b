"""From decoded RGB ``uint8`` HWC images to the tensors the consumer asked for.

The same torch code runs on the CPU and the GPU, so both paths produce the same output from the same
pixels. Work is done on the whole batch where shapes allow: one resize kernel for a same-size batch,
not one op chain per image. On the GPU it runs on the reader thread's stream, before the hand-off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

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
        """Formats decoded images.

        Args:
            images: RGB ``uint8`` tensors of shape ``(H, W, 3)``, all on one device; at least one.
            stacked: Optionally the same images as one ``(B, H, W, 3)`` tensor, which saves a copy.

        Returns:
            A ``(B, 3, H, W)`` tensor when ``size`` is set, else a list of ``(3, H, W)`` tensors.
        """
        if not images:
            raise ValueError("OutputFormat.apply needs at least one image")
        if self.size is None:
            return [
                self._finish(image.permute(2, 0, 1).unsqueeze(0), None)[0].contiguous() for image in images
            ]
        if stacked is None and images and all(image.shape == images[0].shape for image in images):
            stacked = torch.stack(list(images))
        if stacked is not None:
            return self._layout(self._finish(stacked.permute(0, 3, 1, 2), self.size))
        rows = [self._finish(image.permute(2, 0, 1).unsqueeze(0), self.size) for image in images]
        return self._layout(torch.cat(rows))

    @property
    def _memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def _layout(self, batch: torch.Tensor) -> torch.Tensor:
        return batch.contiguous(memory_format=self._memory_format)

    def _finish(self, batch: torch.Tensor, size: tuple[int, int] | None) -> torch.Tensor:
        """Resizes a ``(B, 3, H, W)`` uint8 batch if needed, then converts and normalizes it."""
        resize = size is not None and tuple(batch.shape[-2:]) != size
        if not resize and self.dtype == torch.uint8:
            return batch
        work = batch.float()
        if resize:
            work = F.interpolate(work, size=size, mode="bilinear", antialias=True, align_corners=False)
        if self.dtype == torch.uint8:
            return work.round_().clamp_(0, 255).to(torch.uint8)
        work = work.to(self.dtype) if self.dtype == torch.float64 else work
        work = work.div_(255)  # exact: a multiply by 1/255 is one ulp off for half the bytes
        if self.mean is not None and self.std is not None:
            work = work.sub_(_channel_constant(self.mean, work.device)).div_(
                _channel_constant(self.std, work.device)
            )
        return work.to(self.dtype)


@lru_cache(maxsize=64)
def _channel_constant(values: tuple[float, float, float], device: torch.device) -> torch.Tensor:
    """A ``(1, 3, 1, 1)`` float32 tensor on ``device``, made once: a copy to the GPU per batch would sync."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(1, 3, 1, 1)
