"""The options both front ends take, and what they build from them: the output format and the decoder.

``ThreadLoader`` and ``BatchDecoder`` take the same output arguments (size, dtype, mean, std,
channels_last), decoding arguments (device, num_threads, backend, decode_threads, gpu_decoders,
max_pixels, region_decode, decoder) and ``transform=`` and hand them here, so that each means the same
thing in both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._device import (
    default_decode_batch_size,
    default_decode_threads,
    default_num_threads,
    make_decoder,
    resolve_device,
)
from ._output import OutputFormat
from .decode.base import DEFAULT_MAX_PIXELS, ImageDecoder
from .decode.nvimgcodec import DEFAULT_GPU_DECODERS, REGION_DECODE_ENV
from .transforms import Compose, Transform

__all__ = ["WARMUP_ENV", "Setup", "as_transform", "region_decode_default", "set_up", "stacking_size"]


@dataclass(frozen=True)
class Setup:
    """What a front end runs on: its device, reader threads, decoder, output format and images per call.

    ``warm_up``: the batches a :class:`~threadloader._warmup.Warmup` decodes at once (0: none): for the
    GPU decoder built here, whose first batch costs seconds, as many as readers lease Decoders at
    once; none for the CPU, nor for a decoder passed in (its first call is its own business, and a test
    double's calls are counted), nor where ``THREADLOADER_WARMUP=0``.
    """

    device: torch.device
    num_threads: int
    decoder: ImageDecoder
    output: OutputFormat
    decode_batch_size: int
    warm_up: int = 0


#: Set to 0 to build front ends without the background warm-up (read when one is built): for a script
#: that captures a CUDA graph in torch's default (global) mode while its loader would be warming up,
#: where another thread's CUDA calls break the capture.
WARMUP_ENV = "THREADLOADER_WARMUP"


def region_decode_default() -> bool:
    """``region_decode=None``'s meaning: on, unless the environment sets ``THREADLOADER_REGION_DECODE=0``."""
    return os.environ.get(REGION_DECODE_ENV, "1") != "0"


def as_transform(transform: Transform | Sequence[Transform] | None) -> Transform | None:
    """A front end's ``transform=`` argument as one transform (a list becomes a :class:`Compose`)."""
    if transform is None or isinstance(transform, Transform):
        return transform
    if isinstance(transform, Sequence):
        return Compose(transform)
    raise TypeError(
        f"transform must be a threadloader transform or a list of them, got {type(transform).__name__}; "
        "torchvision transforms draw from the global RNG, which is not reproducible across threads"
    )


def stacking_size(size: tuple[int, int] | None, transform: Transform | None) -> tuple[int, int] | None:
    """The output size of a front end: ``size`` if given, else a transform's fixed output size.

    A crop or a resize to (H, W) thus gives stacked batches; ``None`` keeps a list of images.
    """
    if size is not None or transform is None:
        return size
    return transform.output_size(None)


def set_up(
    transform: Transform | None,
    *,
    size: tuple[int, int] | None,
    dtype: torch.dtype,
    mean: Sequence[float] | None,
    std: Sequence[float] | None,
    channels_last: bool,
    device: str | torch.device | int | None,
    num_threads: int | None,
    backend: str,
    decode_threads: int | None,
    gpu_decoders: int | None,
    jpeg_fancy_upsampling: bool,
    max_pixels: int | None,
    region_decode: bool | None,
    decoder: ImageDecoder | None,
    batch_size: int,
    decode_batch_size: int | None,
) -> Setup:
    """Checks the options and builds the output format, device, thread count and decoder from them.

    ``batch_size`` is the front end's batch, ``decode_batch_size`` its images per decoder call (``None``:
    the device's default for that batch). The environment is read here, once: a front end keeps the
    region decoding it was built with.
    """
    output = OutputFormat(
        size=stacking_size(size, transform), dtype=dtype, mean=mean, std=std, channels_last=channels_last
    )
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    if not isinstance(jpeg_fancy_upsampling, bool):
        raise TypeError(f"jpeg_fancy_upsampling must be True or False, got {jpeg_fancy_upsampling!r}")
    if decode_batch_size is not None and decode_batch_size < 1:
        raise ValueError(f"decode_batch_size must be at least 1, got {decode_batch_size}")
    if decoder is not None:
        resolved = _decoder_device(
            decoder,
            device=device,
            backend=backend,
            decode_threads=decode_threads,
            gpu_decoders=gpu_decoders,
            jpeg_fancy_upsampling=jpeg_fancy_upsampling,
            max_pixels=max_pixels,
            region_decode=region_decode,
        )
        per_call = decode_batch_size or default_decode_batch_size(resolved, batch_size)
        return Setup(resolved, num_threads or default_num_threads(resolved), decoder, output, per_call)
    resolved = resolve_device(device)
    per_call = decode_batch_size or default_decode_batch_size(resolved, batch_size)
    threads = num_threads or default_num_threads(resolved)
    if decode_threads is not None and decode_threads < 1:
        raise ValueError(f"decode_threads must be at least 1 (or None for the default), got {decode_threads}")
    # A gpu_decoders that is not a positive int is refused by make_decoder, with the reason.
    pool = gpu_decoders if isinstance(gpu_decoders, int) and gpu_decoders > 0 else DEFAULT_GPU_DECODERS
    built = make_decoder(
        resolved,
        backend=backend,
        cpu_threads=decode_threads or default_decode_threads(threads, min(threads, pool)),
        fancy_upsampling=jpeg_fancy_upsampling,
        gpu_decoders=gpu_decoders,
        max_pixels=max_pixels,
        region_decode=region_decode_default() if region_decode is None else region_decode,
        batch_size=per_call,
    )
    warm = min(threads, gpu_decoders or DEFAULT_GPU_DECODERS) if resolved.type == "cuda" else 0
    if os.environ.get(WARMUP_ENV, "1") == "0":
        warm = 0
    return Setup(resolved, threads, built, output, per_call, warm_up=warm)


def _decoder_device(
    decoder: ImageDecoder,
    *,
    device: str | torch.device | int | None,
    backend: str,
    decode_threads: int | None,
    gpu_decoders: int | None,
    jpeg_fancy_upsampling: bool,
    max_pixels: int | None,
    region_decode: bool | None,
) -> torch.device:
    """The device of a decoder passed in, refusing the options that configure the built-in one."""
    ignored = [
        name
        for name, value, default in (
            ("backend", backend, "auto"),
            ("decode_threads", decode_threads, None),
            ("gpu_decoders", gpu_decoders, None),
            ("jpeg_fancy_upsampling", jpeg_fancy_upsampling, True),
            ("max_pixels", max_pixels, DEFAULT_MAX_PIXELS),
            ("region_decode", region_decode, None),
        )
        if value != default
    ]
    if ignored:
        raise ValueError(
            f"{', '.join(ignored)} configure the built-in decoder, but decoder={decoder!r} was passed; "
            "leave them unset and configure that decoder itself"
        )
    if device is not None and resolve_device(device) != decoder.device:
        raise ValueError(
            f"device={str(device)!r} but decoder={decoder!r} decodes on {decoder.device}; leave device "
            "unset or pass a decoder for that device"
        )
    return decoder.device
