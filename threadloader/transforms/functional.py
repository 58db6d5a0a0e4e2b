"""The transforms' kernels: pure functions on image tensors, with no parameters drawn.

The same torch code runs on the CPU and the GPU, so both paths produce the same output from the same
pixels. Work is done on the whole batch where shapes allow: one resize kernel for a same-size batch,
not one op chain per image. The classes of :mod:`threadloader.transforms` draw parameters and call
these; the output format (``threadloader._output``) calls them too.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from functools import lru_cache

import torch
import torch.nn.functional as F

from ..decode.base import Region
from . import _kernels
from ._checks import check_std
from ._transfer import to_device

__all__ = [
    "CAST_DTYPES",
    "SCALED_DTYPES",
    "Images",
    "center_crop",
    "horizontal_flip",
    "horizontal_flip_rows",
    "normalization",
    "normalize",
    "resample_many",
    "resize",
    "resize_many",
    "resized_crop",
    "to_dtype",
]

#: Images of a batch: a ``(B, C, H, W)`` tensor, or a list of ``(C, H, W)`` tensors of any sizes.
Images = torch.Tensor | list[torch.Tensor]


def resize(images: torch.Tensor, size: tuple[int, int], *, antialias: bool = True) -> torch.Tensor:
    """Bilinear resize of ``(..., C, H, W)`` images, as torchvision's ``resize`` on tensors.

    ``uint8`` images on the CPU go through torch's own ``uint8`` kernel (what torchvision uses there):
    several times faster than converting to float, and within 1 of the float result rounded. Other
    integer images, a 1x1 output, and all on the GPU, are resized in float32 and rounded back.
    """
    if tuple(images.shape[-2:]) == tuple(size):
        return images
    shape = images.shape
    work = images.reshape(-1, *shape[-3:])
    # torch's uint8 kernel fails an internal assert for a 1x1 output of an image in (C, H, W) memory.
    if work.dtype == torch.uint8 and work.device.type == "cpu" and tuple(size) != (1, 1):
        # Fastest on channels_last input, which a decoded HWC image permuted to CHW already is.
        out = F.interpolate(work, size=size, mode="bilinear", antialias=antialias, align_corners=False)
        return out.reshape(*shape[:-2], *size)
    # torch's CPU kernel has no half precision: those resize in float32, as torchvision's do.
    half_on_cpu = work.device.type == "cpu" and work.dtype in (torch.float16, torch.bfloat16)
    floating = work if work.is_floating_point() and not half_on_cpu else work.float()
    if antialias and floating.device.type == "cpu" and size[1] == 1 and size[0] > 1:
        # torch's CPU kernel repeats the first row of an antialiased output one pixel wide (the uint8
        # kernel and the GPU's do not); transposed, the same resize is one pixel high, which it gets right.
        wide = floating.transpose(-1, -2)
        out = F.interpolate(wide, size=(1, size[0]), mode="bilinear", antialias=True, align_corners=False)
        out = out.transpose(-1, -2)
    else:
        out = F.interpolate(floating, size=size, mode="bilinear", antialias=antialias, align_corners=False)
    return _rounded_to(out, images.dtype).reshape(*shape[:-2], *size)


def _rounded_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float results as ``dtype``: integers rounded and clamped to the type's range (uint8's 0-255)."""
    if dtype.is_floating_point:
        return values.to(dtype)
    info = torch.iinfo(dtype)
    return values.round_().clamp_(info.min, info.max).to(dtype)


def to_dtype(images: torch.Tensor, dtype: torch.dtype, *, scale: bool) -> torch.Tensor:
    """Converts images; with ``scale`` as torchvision's, keeping the value range's meaning.

    An integer type's range maps to and from [0, 1] floats (``uint8``'s 0-255), and integer types
    convert by shifting their value bits. Half-precision floats scale to and from integers in float32:
    in their own precision 1.0 times 255.999 rounds to 256, which wraps to 0 (torchvision's white turns
    black), and float16 holds at most 65504, so uint16's 65535 (torchvision's white) turns to inf.

    Types past 15 value bits scale from floats in float64, where their largest value is exact.

    Raises:
        RuntimeError: For float32 (and so float16 and bfloat16) to int32, uint32 or int64 and float64 to
            int64, which cannot be scaled exactly, as torchvision refuses them. ``dtype`` is one of
            :data:`SCALED_DTYPES` with ``scale``, else of :data:`CAST_DTYPES` (``ToDtype`` checks).
        TypeError: With ``scale``, for complex images, bool images to an integer type (to a float type
            they are cast, as torchvision's), and uint64 images to an integer type.
    """
    if images.dtype == dtype:
        return images
    source_floating = images.is_floating_point()
    if not scale or (source_floating and dtype.is_floating_point):
        return images.to(dtype)
    if images.dtype == torch.bool and dtype.is_floating_point:
        return images.to(dtype)  # torchvision's: bool's largest value is 1, so True is 1.0
    # Types ToDtype makes by a plain cast with no range torch can scale (uint64: no shifts to integers).
    no_range = images.dtype == torch.bool or images.dtype.is_complex
    if no_range or (images.dtype == torch.uint64 and not dtype.is_floating_point):
        raise TypeError(
            f"to_dtype(scale=True) to {dtype} needs images of a float or integer type with a range to "
            f"scale, got {images.dtype} images: use scale=False for a plain cast, or scale them to a "
            "float type first"
        )
    if dtype.is_floating_point:  # exact: a multiply by 1/255 is one ulp off for half the bytes
        work = images.float() if dtype.itemsize < 4 else images.to(dtype)  # half precision: see above
        return work.div_(torch.iinfo(images.dtype).max).to(dtype)
    if source_floating:
        if (images.dtype, dtype) in _UNSAFE:
            raise RuntimeError(f"The conversion from {images.dtype} to {dtype} cannot be performed safely.")
        # float32 holds 24 bits: uint16's 65535.999 rounds up to 65536 there and 1.0 wraps to 0.
        if _value_bits(dtype) > 15:
            work = images.double()
        else:
            work = images.float() if images.dtype.itemsize < 4 else images
        return work.mul(torch.iinfo(dtype).max + 1 - 1e-3).to(dtype)  # torchvision's rule
    shift = _value_bits(dtype) - _value_bits(images.dtype)
    if images.dtype in _NO_SHIFTS or dtype in _NO_SHIFTS:  # torch has no bit shifts for them
        wide = images.to(torch.int64)
        return (wide << shift if shift >= 0 else wide >> -shift).to(dtype)
    if shift >= 0:
        return images.to(dtype).bitwise_left_shift_(shift)
    return images.bitwise_right_shift(-shift).to(dtype)


#: Float to integer conversions whose scaling is not exact: torchvision refuses the first three, and
#: half-precision floats scale in float32 (above), so they are float32's conversions too.
_UNSAFE = {
    (torch.float32, torch.int32),
    (torch.float32, torch.int64),
    (torch.float64, torch.int64),
    (torch.float32, torch.uint32),  # as int32: float32 cannot tell its neighbouring values apart
    *(
        (half, wide)
        for half in (torch.float16, torch.bfloat16)
        for wide in (torch.int32, torch.uint32, torch.int64)
    ),
}
#: What :func:`to_dtype` converts to with ``scale``: torch has no bit shifts for uint64 (nor can int64
#: shift its 64 value bits), and no arithmetic for float8 on the CPU; bool and complex have no range.
SCALED_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.uint16,
    torch.int32,
    torch.uint32,
    torch.int64,
)
#: What it converts to without ``scale``, a plain cast: torch has no copy into sub-byte, bit and
#: quantized types.
CAST_DTYPES = (
    *SCALED_DTYPES,
    torch.uint64,
    torch.bool,
    torch.complex64,
    torch.complex128,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
#: Integer types whose values torch cannot shift: they shift as int64 (wide enough for their values).
_NO_SHIFTS = (torch.uint16, torch.uint32)


def _value_bits(dtype: torch.dtype) -> int:
    """Bits that carry an integer type's non-negative values (7 for int8, 8 for uint8)."""
    info = torch.iinfo(dtype)
    return info.bits - (info.min < 0)


def normalize(
    images: torch.Tensor, mean: Sequence[float], std: Sequence[float], *, inplace: bool = False
) -> torch.Tensor:
    """``(images - mean) / std`` per channel, on float images; ``inplace`` for a tensor the caller owns.

    Raises:
        ValueError: For a ``std`` that is zero in the images' dtype, as torchvision's ``normalize``.
    """
    if not images.is_floating_point():
        raise TypeError(
            f"normalize needs float images, got {images.dtype}: convert with ToDtype(torch.float32, "
            "scale=True) first"
        )
    if images.ndim < 3:  # a (C, 1, 1) constant would broadcast a (H, W) image into (C, H, W)
        raise ValueError(f"normalize needs images of (..., C, H, W), got shape {tuple(images.shape)}")
    channels = images.shape[-3]
    if channels != 1 and len(mean) not in (1, channels):  # one channel broadcasts, as torchvision's
        raise ValueError(
            f"normalize got {len(mean)} means and stds for images of {channels} channels: one per channel"
        )
    stds = tuple(float(s) for s in std)
    check_std(stds, images.dtype)  # a std that underflows in the images' type gives inf or NaN
    mean_t = _channel_constant(tuple(float(m) for m in mean), images.device, images.dtype)
    std_t = _channel_constant(stds, images.device, images.dtype)
    if inplace:
        return images.sub_(mean_t).div_(std_t)
    return (images - mean_t) / std_t


def normalization(mean: object, std: object) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``mean`` and ``std`` as tuples of floats, one per channel, checked: what ``normalize`` takes.

    Raises:
        ValueError: Naming which is not a sequence of finite numbers, or a ``std`` with a zero.
    """
    checked = []
    for name, values in (("mean", mean), ("std", std)):
        try:
            if isinstance(values, str | bytes | numbers.Number):
                raise TypeError
            floats = tuple(float(value) for value in values)  # type: ignore[attr-defined]
        except (TypeError, ValueError):
            floats = ()
        if not floats or not all(math.isfinite(value) for value in floats):
            raise ValueError(f"{name} must be a sequence of finite numbers, one per channel, got {values!r}")
        checked.append(floats)
    if len(checked[0]) != len(checked[1]):
        raise ValueError(f"mean and std need one value per channel each, got {mean!r} and {std!r}")
    if 0 in checked[1]:
        raise ValueError(f"std must not contain zeros, got {std!r}")
    return checked[0], checked[1]


@lru_cache(maxsize=64)
def _channel_constant(values: tuple[float, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A ``(C, 1, 1)`` tensor on ``device``, made once: a copy to the GPU per batch would sync the host."""
    return torch.tensor(values, dtype=dtype, device=device).view(-1, 1, 1)


#: Float elements (16 MiB of float32) that one chunk of the matrix products may hold at once, or as many
#: as the batch's result has if that is more: padding large images of different sizes to one, their
#: float copies, products and weights then hold about as many elements as the result (a chunk holds
#: at least one image, however large).
_RESAMPLE_ELEMENTS = 2**22


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
    return _resample_batched(images, regions, sizes, size, antialias, dtype)


def _resample_batched(
    images: Images,
    regions: Sequence[Region],
    sizes: Sequence[tuple[int, ...]],
    size: tuple[int, int],
    antialias: bool,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """:func:`resample_many` on the GPU: one Triton kernel, else matrix products in chunks of bounded memory.

    A chunk builds its own weights: all of a large group's at once took more memory than its images
    (twenty-odd small kernels per chunk are the price, on this path only). Runs on any device; the CPU
    tests call it directly, as CI has no GPU.
    """
    if antialias and isinstance(images, torch.Tensor):
        fused = _kernels.resample(images, regions, size, dtype=dtype or images.dtype)
        if fused is not None:
            return fused
    height = max(h for h, _ in sizes)
    width = max(w for _, w in sizes)
    channels = images.shape[-3] if isinstance(images, torch.Tensor) else images[0].shape[-3]
    target = dtype or images[0].dtype
    compute = torch.float64 if torch.float64 in (images[0].dtype, target) else torch.float32
    (out_h, out_w) = size
    spans = [(top, h, out_h) for top, _, h, _ in regions] + [(left, w, out_w) for _, left, _, w in regions]
    on_device = to_device(torch.tensor(spans, dtype=compute), images[0].device)  # one copy for all chunks
    count = len(images)
    budget = max(_RESAMPLE_ELEMENTS, count * channels * out_h * out_w)
    step = max(1, budget // _elements_per_image(channels, (height, width), size))
    out: torch.Tensor | None = None
    for start in range(0, count, step):
        end = min(start + step, count)
        chunk = torch.cat((on_device[start:end], on_device[count + start : count + end]))
        weights = _filter_weights(chunk, max(out_h, out_w), max(height, width), antialias)
        rows, columns = weights[: end - start, :out_h], weights[end - start :, :out_w]
        part = _resample(images[start:end], rows, columns, compute, target)
        if end - start == count:
            return part
        if out is None:  # each chunk written in place: no list of parts to concatenate at the end
            out = torch.empty((count, *part.shape[1:]), dtype=target, device=part.device)
        out[start:end] = part
    assert out is not None
    return out


def _elements_per_image(channels: int, padded: tuple[int, int], size: tuple[int, int]) -> int:
    """Float elements :func:`_resample` and :func:`_filter_weights` hold at once for one padded image.

    Its float copy, the two products' results (one transposed copy), the output and its conversion,
    and the row and column weights with the temporaries that build them (about four times their size).
    """
    (height, width), (out_h, out_w) = padded, size
    pixels = height * width + 2 * out_h * width + 2 * out_h * out_w
    return channels * pixels + 8 * max(out_h, out_w) * max(height, width)


def _resample(
    images: Images, rows: torch.Tensor, columns: torch.Tensor, compute: torch.dtype, target: torch.dtype
) -> torch.Tensor:
    """Resamples a chunk of images with its weights, ``rows`` ``(B, out_h, >=H)`` and ``columns``."""
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
    batch, height, width, channels = hwc.shape
    out_h, out_w = rows.shape[1], columns.shape[1]
    # Two batched products over (B, H, W*C) views: rows first, then columns after one transpose.
    work = hwc.reshape(batch, height, width * channels).to(compute)
    tall = torch.bmm(rows[:, :, :height], work).view(batch, out_h, width, channels)
    wide = tall.transpose(1, 2).reshape(batch, width, out_h * channels)
    out = torch.bmm(columns[:, :, :width], wide).view(batch, out_w, out_h, channels).permute(0, 3, 2, 1)
    return _rounded_to(out, target)


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
            resized = _rounded_to(resize(crop.to(compute), size, antialias=antialias), target)
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


def resize_many(
    images: Images, size: tuple[int, int], *, antialias: bool = True, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Resizes every image, of any sizes, to ``size`` as one batch: :func:`resample_many` of the whole."""
    whole = [(0, 0, int(image.shape[-2]), int(image.shape[-1])) for image in images]
    return resample_many(images, whole, size, antialias=antialias, dtype=dtype)


def resized_crop(
    images: torch.Tensor, region: Region, size: tuple[int, int], *, antialias: bool = True
) -> torch.Tensor:
    """Crops ``(..., C, H, W)`` images to one region and resizes it to ``size``."""
    batch = images.reshape(-1, *images.shape[-3:])  # any leading dimensions, one region for all
    out = resample_many(batch, [region] * len(batch), size, antialias=antialias)
    return out.reshape(*images.shape[:-2], *size)


def center_crop(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Crops the center ``(H, W)``, padding with zeros where the image is smaller, as torchvision's."""
    height, width = images.shape[-2:]
    crop_h, crop_w = size
    if crop_h > height or crop_w > width:
        pad_top, pad_left = max(crop_h - height, 0) // 2, max(crop_w - width, 0) // 2
        pad = [pad_left, max(crop_w - width, 0) - pad_left, pad_top, max(crop_h - height, 0) - pad_top]
        images = F.pad(images, pad)
        height, width = images.shape[-2:]
    top = round((height - crop_h) / 2.0)
    left = round((width - crop_w) / 2.0)
    return images[..., top : top + crop_h, left : left + crop_w]


#: Types the flips can be given (``ToDtype`` makes them) for which torch's CPU ``flip`` has no kernel,
#: nor ``where`` before torch 2.13: flipped as the signed integers of their size, the same bytes moved.
_FLIPPED_AS = {
    torch.uint16: torch.int16,
    torch.uint32: torch.int32,
    torch.uint64: torch.int64,
    torch.float8_e4m3fn: torch.int8,
    torch.float8_e5m2: torch.int8,
}


def horizontal_flip(images: torch.Tensor) -> torch.Tensor:
    """Flips ``(..., C, H, W)`` images left-right, of any type ``ToDtype`` makes."""
    same_bytes = _FLIPPED_AS.get(images.dtype)
    if same_bytes is None:
        return images.flip(-1)
    return images.view(same_bytes).flip(-1).view(images.dtype)


def horizontal_flip_rows(batch: torch.Tensor, flips: Sequence[bool]) -> torch.Tensor:
    """Flips left-right the images of a ``(B, C, H, W)`` batch where ``flips`` says so.

    One select between the batch and its mirror image, not a flip per image.
    """
    if not any(flips):
        return batch
    if all(flips):
        return horizontal_flip(batch)
    same_bytes = _FLIPPED_AS.get(batch.dtype)
    if same_bytes is not None:
        return horizontal_flip_rows(batch.view(same_bytes), flips).view(batch.dtype)
    mask = to_device(torch.tensor(flips, dtype=torch.bool), batch.device)
    return torch.where(mask.view(-1, 1, 1, 1), horizontal_flip(batch), batch)
