"""Choosing the device and the decoder for it, and thread-count defaults.

Shared by every front end so that ``device=None`` means the same thing everywhere: the GPU when one is
usable (a CUDA device and nvImageCodec), else the CPU with Pillow.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import sys
import warnings

import torch

from .decode import _capi
from .decode.base import DEFAULT_MAX_PIXELS, ImageDecoder
from .decode.nvimgcodec import DEFAULT_BATCH_SIZE, DEFAULT_GPU_DECODERS, NvImageCodecDecoder, check_options
from .decode.pillow import PillowDecoder
from .errors import CPUFallbackWarning

__all__ = [
    "available_cpus",
    "check_cuda_versions",
    "default_decode_batch_size",
    "default_decode_threads",
    "default_num_threads",
    "make_decoder",
    "resolve_device",
]

logger = logging.getLogger("threadloader")


def available_cpus() -> int:
    """CPUs this process may run on (respects affinity and container limits where the OS reports them)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_num_threads(device: torch.device) -> int:
    """Default reader threads.

    On the GPU the rest of a batch's work holds the GIL, so more threads only contend: 2 were fastest
    (docs/benchmarks.md). On the CPU each thread decodes with the GIL
    released.
    """
    cpus = available_cpus()
    return min(2, cpus) if device.type == "cuda" else min(32, cpus)


def default_decode_batch_size(device: torch.device, batch_size: int) -> int:
    """Images per decoder call: 64 on the GPU (or one batch, if larger), one output batch on the CPU.

    The GPU decoder is faster per image on larger calls (docs/benchmarks.md), but a group's decoded
    images and outputs are all in device memory at once: 128 at a time doubled the loader's memory
    and did not feed a training step any faster than 64.
    """
    return max(64, batch_size) if device.type == "cuda" else batch_size


def default_decode_threads(num_threads: int, decoders: int) -> int:
    """nvImageCodec's CPU threads per Decoder (Huffman decoding, CPU fallback) for a GPU loader.

    The cores the readers leave free, shared by the ``decoders`` that decode at once (a reader calls
    one at a time, so at most as many as the readers): each Decoder has a pool of its own, and pools
    that each took every free core put several threads on each core, which beside a graphed training
    step fed it less (docs/design.md, "Decoder engines").
    """
    return max(1, (available_cpus() - num_threads) // decoders)


def _nvimgcodec_installed() -> bool:
    """Whether nvImageCodec is installed, found without importing it (its Python API takes a second)."""
    if "nvidia.nvimgcodec" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):
        return False


def _codec_cuda_major() -> int | None:
    """The CUDA major version nvImageCodec is built for: from its C library, else its Python API."""
    try:
        return _cuda_major(_capi.library().cudart_version)
    except _capi.Unsupported:
        pass
    try:
        from nvidia import nvimgcodec
    except ImportError:
        return None  # the decoder's own error says how to install it
    return _cuda_major(getattr(nvimgcodec, "__cuda_version__", None))


def _cuda_major(version: object) -> int | None:
    """The major version from ``"12.8"`` (torch) or ``12080`` (a CUDA runtime number), else ``None``."""
    if isinstance(version, int):
        return version // 1000 if version >= 1000 else version
    if isinstance(version, str) and version.split(".")[0].isdigit():
        return int(version.split(".")[0])
    return None


@functools.cache
def check_cuda_versions() -> None:
    """Warns, once, where nvImageCodec and torch are built for different CUDA major versions.

    pip installs torch for the newest CUDA by default and ``[cu12]`` a codec for CUDA 12: two CUDA
    runtimes in one process, which fails in ways that do not name the cause (a driver too old for one
    of them, or libraries that do not load).
    """
    codec = _codec_cuda_major()
    ours = _cuda_major(torch.version.cuda)
    if codec is not None and ours is not None and codec != ours:
        logger.warning(
            "nvImageCodec is built for CUDA %d but torch for CUDA %d: GPU decoding may fail; install the "
            "codec for torch's CUDA (pip install 'threadloader[cu%d]', then pip uninstall "
            "nvidia-nvimgcodec-cu%d) or a torch build for CUDA %d",
            codec,
            ours,
            ours,
            codec,
            codec,
        )


def resolve_device(device: str | torch.device | int | None) -> torch.device:
    """Turns the user's ``device`` into an indexed ``torch.device`` that can be used.

    ``None`` under torchrun (``LOCAL_RANK`` set) means ``cuda:LOCAL_RANK``, one GPU per local process,
    unless fewer GPUs are visible (a launcher that gives each process its own): then the current one.
    With a GPU but no nvImageCodec it means the CPU, with a :class:`CPUFallbackWarning`: a GPU run
    that decodes on the CPU is slow, and should not go unnoticed.

    Raises:
        RuntimeError: For a CUDA device on a machine where none is usable.
        ImportError: For a CUDA device without nvImageCodec installed.
    """
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if not _nvimgcodec_installed():
            major = _cuda_major(torch.version.cuda)
            extra = f"'threadloader[cu{major}]'" if major in (12, 13) else "'threadloader[cu12]' or '[cu13]'"
            warnings.warn(
                "a CUDA GPU is available, but nvImageCodec is not installed, so images are decoded on the "
                f"CPU: pip install {extra} to decode on the GPU, or pass device='cpu' to decode on the CPU "
                "without this warning",
                CPUFallbackWarning,
                stacklevel=4,  # the user's ThreadLoader(...) or BatchDecoder(...), through set_up
            )
            return torch.device("cpu")
        local_rank = os.environ.get("LOCAL_RANK", "")
        device = (
            f"cuda:{local_rank}"
            if local_rank.isdigit() and int(local_rank) < torch.cuda.device_count()
            else "cuda"
        )
    resolved = torch.device(device)
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {resolved}")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(resolved)!r} but no CUDA GPU is usable here; pass device='cpu' (or None)"
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"device={str(resolved)!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
        )
    check_cuda_versions()
    return torch.device("cuda", index)


def make_decoder(
    device: torch.device,
    *,
    backend: str,
    cpu_threads: int,
    fancy_upsampling: bool = True,
    gpu_decoders: int | None = None,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    region_decode: bool = True,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> ImageDecoder:
    """The decoder for ``device``: nvImageCodec on a GPU, Pillow on the CPU (which decodes whole images).

    ``batch_size``: the images per decoder call the GPU decoder is made for.

    ``backend`` and ``gpu_decoders`` are checked once, by :func:`check_options`: by the GPU decoder, or
    here on the CPU, where they mean nothing but a script that sets them should fail as on a GPU.
    """
    count = DEFAULT_GPU_DECODERS if gpu_decoders is None else gpu_decoders
    if device.type == "cpu":
        check_options(backend=backend, gpu_decoders=count)
        if backend != "auto":
            raise ValueError(
                f"backend={backend!r} selects an nvImageCodec backend; with device='cpu' Pillow decodes"
            )
        return PillowDecoder(max_pixels=max_pixels)
    return NvImageCodecDecoder(
        device,
        backend=backend,
        cpu_threads=cpu_threads,
        fancy_upsampling=fancy_upsampling,
        gpu_decoders=count,
        max_pixels=max_pixels,
        region_decode=region_decode,
        batch_size=batch_size,
    )
