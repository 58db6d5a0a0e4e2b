"""One Triton kernel for the GPU's resampling: crop, resize, flip, scale, normalize and layout at once.

Why a kernel of our own: written in torch, resampling a padded batch of images of different sizes is
some twenty small kernels for the filter weights and a dozen per chunk of images, and each torch op a
reader thread dispatches lets go of the GIL (about four times, counting the freeing of its result),
each time a hand-off that a training loop beside it pays. This is one launch per batch, reading the
decoded ``uint8`` pixels where they are (any strides, each image at the top left of its row) and
writing the output in its final dtype and layout, with no float copy of the input in between.

The filter is torch's antialiased bilinear (``F.interpolate(..., antialias=True)``, as torchvision's
resize on tensors): a triangle widened by the downscale factor, renormalized over the taps inside the
region. Triton is part of torch's CUDA builds on Linux; without it (or on the CPU, or for what the
kernel does not cover), :func:`resample` returns ``None`` and the caller uses torch's ops.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ..decode.base import Region
from ._checks import check_std
from ._transfer import to_device

__all__ = ["resample"]

#: Output pixels per program; each program reads one image's taps for them.
_BLOCK = 256

#: The dtypes it reads and writes. Integers other than ``uint8`` would be clamped to 0-255, and a float
#: input's integer output is a scaled conversion (``[0, 1]`` to 0-255) that its rounding does not do.
_TAKES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32)

#: Run on CPU tensors too: only the tests without a GPU, under Triton's interpreter (TRITON_INTERPRET=1).
_ON_CPU = False


#: The kernel's numbers that differ between batches, and its pointers (an image's rows start anywhere).
_VARYING = ("s_b", "s_c", "s_h", "s_w", "o_b", "o_c", "o_h", "o_w", "out_h", "out_w")
_POINTERS = ("source", "out", "boxes")


@functools.cache
def _kernel() -> Any:
    """The compiled kernel, or ``None`` without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    # Not specialized on its numbers' values nor on its pointers' alignment (Triton would compile a
    # variant for each divisibility by 16): they change from batch to batch, and a compile takes a second.
    @triton.jit(do_not_specialize=_VARYING, do_not_specialize_on_alignment=_POINTERS)
    def resample_kernel(
        source,
        out,
        boxes,  # int32 (B, 5): top, left, height, width, flip
        s_b,
        s_c,
        s_h,
        s_w,
        o_b,
        o_c,
        o_h,
        o_w,
        out_h,
        out_w,
        divide,
        mean0,
        mean1,
        mean2,
        std0,
        std1,
        std2,
        ROUND: tl.constexpr,
        NORMALIZE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        image = tl.program_id(0)
        pixels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        valid = pixels < out_h * out_w
        oy = pixels // out_w
        ox = pixels % out_w
        top = tl.load(boxes + image * 5)
        left = tl.load(boxes + image * 5 + 1)
        height = tl.load(boxes + image * 5 + 2)
        width = tl.load(boxes + image * 5 + 3)
        flip = tl.load(boxes + image * 5 + 4)
        scale_y = height.to(tl.float32) / out_h
        scale_x = width.to(tl.float32) / out_w
        support_y = tl.maximum(scale_y, 1.0)
        support_x = tl.maximum(scale_x, 1.0)
        # This image's own taps (a tap past them has no weight): a batch's largest image would make
        # every program walk its taps, the square of its downscale factor per output pixel.
        taps_y = tl.ceil(2.0 * support_y).to(tl.int32) + 2
        taps_x = tl.ceil(2.0 * support_x).to(tl.int32) + 2
        sx = tl.where(flip != 0, out_w - 1 - ox, ox)  # the output column a flipped image reads from
        center_y = (oy.to(tl.float32) + 0.5) * scale_y
        center_x = (sx.to(tl.float32) + 0.5) * scale_x
        first_y = tl.maximum(tl.floor(center_y - support_y + 0.5), 0.0).to(tl.int32)
        first_x = tl.maximum(tl.floor(center_x - support_x + 0.5), 0.0).to(tl.int32)
        base = source + image.to(tl.int64) * s_b
        acc0 = tl.zeros((BLOCK,), dtype=tl.float32)
        acc1 = tl.zeros((BLOCK,), dtype=tl.float32)
        acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        ty = 0
        while ty < taps_y:  # while, not range: Triton's interpreter (the CPU tests) needs it
            y = first_y + ty
            weight_y = tl.maximum(1.0 - tl.abs((y.to(tl.float32) + 0.5 - center_y) / support_y), 0.0)
            weight_y = tl.where(y < height, weight_y, 0.0)
            row = base + (top + y).to(tl.int64) * s_h
            tx = 0
            while tx < taps_x:
                x = first_x + tx
                weight_x = tl.maximum(1.0 - tl.abs((x.to(tl.float32) + 0.5 - center_x) / support_x), 0.0)
                weight = weight_y * tl.where(x < width, weight_x, 0.0)
                used = valid & (weight > 0.0)
                at = row + (left + x).to(tl.int64) * s_w
                acc0 += weight * tl.load(at, mask=used, other=0).to(tl.float32)
                acc1 += weight * tl.load(at + s_c, mask=used, other=0).to(tl.float32)
                acc2 += weight * tl.load(at + 2 * s_c, mask=used, other=0).to(tl.float32)
                total += weight
                tx += 1
            ty += 1
        total = tl.maximum(total, 1e-30)
        value0 = acc0 / total
        value1 = acc1 / total
        value2 = acc2 / total
        if ROUND:
            value0 = tl.minimum(tl.maximum(tl.floor(value0 + 0.5), 0.0), 255.0)
            value1 = tl.minimum(tl.maximum(tl.floor(value1 + 0.5), 0.0), 255.0)
            value2 = tl.minimum(tl.maximum(tl.floor(value2 + 0.5), 0.0), 255.0)
        value0 = value0 / divide
        value1 = value1 / divide
        value2 = value2 / divide
        if NORMALIZE:
            value0 = (value0 - mean0) / std0
            value1 = (value1 - mean1) / std1
            value2 = (value2 - mean2) / std2
        target = out + image.to(tl.int64) * o_b + oy.to(tl.int64) * o_h + ox.to(tl.int64) * o_w
        element = out.dtype.element_ty
        tl.store(target, value0.to(element), mask=valid)
        tl.store(target + o_c, value1.to(element), mask=valid)
        tl.store(target + 2 * o_c, value2.to(element), mask=valid)

    return resample_kernel


def resample(
    images: torch.Tensor,
    regions: Sequence[Region],
    size: tuple[int, int],
    *,
    dtype: torch.dtype,
    flips: Sequence[bool] | None = None,
    divide: float = 1.0,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    channels_last: bool = False,
) -> torch.Tensor | None:
    """Crops, resizes (antialiased bilinear), flips, scales and normalizes a batch in one launch.

    Each image is cropped to its region and resized to ``size``; the rows ``flips`` says are flipped
    left-right; the values are divided by ``divide``, then normalized. Integer outputs are rounded
    after resizing, as :func:`~.functional.resample_many` rounds them.

    Args:
        images: ``(B, 3, H, W)`` on a CUDA device, any strides (a permuted HWC batch is fine), ``uint8``
            or float.
        regions: ``(top, left, height, width)`` inside each image.
        size: Output ``(height, width)``.
        dtype: The output's.
        flips: Per image, whether to flip it left-right after resizing.
        divide: Applied after resizing (and rounding): 255 scales 0-255 to [0, 1].
        mean: Per channel, subtracted last.
        std: Per channel, divided by last.
        channels_last: The output's memory format.

    Returns:
        A ``(B, 3, *size)`` tensor, or ``None`` where this kernel does not apply (no Triton, not on a
        GPU, not three channels, a dtype in or out other than ``uint8``, float16, bfloat16 and float32,
        or float in and ``uint8`` out): the caller then computes the same with torch's ops.

    Raises:
        ValueError: For a ``std`` that is zero in float32, as :func:`~.functional.normalize` refuses it.
    """
    if images.device.type != "cuda" and not _ON_CPU:
        return None
    kernel = _kernel()
    if (
        kernel is None
        or images.dim() != 4
        or images.shape[1] != 3
        or images.dtype not in _TAKES
        or dtype not in _TAKES
        or (images.dtype.is_floating_point and not dtype.is_floating_point)
        or len(images) == 0
    ):
        return None
    means = tuple(mean) if mean is not None else (0.0, 0.0, 0.0)
    stds = tuple(float(s) for s in std) if std is not None else (1.0, 1.0, 1.0)
    # The kernel divides in float32 (its float arguments are float32): refused as the torch path refuses.
    check_std(stds, torch.float32)
    count = len(images)
    out_h, out_w = size
    boxes = [
        value
        for (top, left, height, width), flip in zip(regions, flips or [False] * count, strict=True)
        for value in (top, left, height, width, int(flip))
    ]
    layout = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((count, 3, out_h, out_w), dtype=dtype, device=images.device, memory_format=layout)
    kernel[(count, -(-out_h * out_w // _BLOCK))](
        images,
        out,
        _boxes(boxes, images.device),
        *images.stride(),
        *out.stride(),
        out_h,
        out_w,
        float(divide),
        *means,
        *stds,
        ROUND=not dtype.is_floating_point,
        NORMALIZE=mean is not None,
        BLOCK=_BLOCK,
    )
    return out


def _boxes(values: list[int], device: torch.device) -> torch.Tensor:
    """The per-image int32 parameters on ``device``, copied without waiting for the stream."""
    return to_device(torch.tensor(values, dtype=torch.int32), device)
