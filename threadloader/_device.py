"""Choosing the device, and how many CPUs there are to run on.

Shared by every front end so that ``device=None`` means the same thing everywhere: the GPU when one is
usable (a CUDA device and nvImageCodec), else the CPU with Pillow.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
import sys
import warnings

import torch

from ._workers import available_cpus
from .decode.nvimgcodec import check_cuda_versions
from .errors import CPUFallbackWarning

__all__ = ["available_cpus", "gpu_decoding_advice", "parse_device", "resolve_device", "usable"]


def _nvimgcodec_installed() -> bool:
    """Whether nvImageCodec is installed, found without importing it (its Python API takes a second)."""
    if "nvidia.nvimgcodec" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):
        return False


def parse_device(device: str | torch.device | int) -> torch.device:
    """The CPU or a CUDA device, as ``device`` names it; a ValueError that names the argument otherwise.

    ``'cpu:0'`` is the one CPU device: it comes back as ``cpu``, which a decoder's device must match.
    An int (numpy's too) is a CUDA device's index, as ``torch.device(0)`` is on a CUDA machine; on one
    without, torch refused it with "Cannot access accelerator device" and this said ints are not taken.
    """
    integer = isinstance(device, numbers.Integral) and not isinstance(device, bool)
    try:
        parsed = torch.device("cuda", int(device)) if integer else torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or None, got {device!r} ({exc})") from exc
    # torch keeps an index's low 8 bits: 'cuda:257' was cuda:1, another GPU than the one asked for.
    if integer:
        given: int | None = int(device)  # type: ignore[arg-type]
    elif isinstance(device, str) and device.rpartition(":")[2].isdigit():
        given = int(device.rpartition(":")[2])
    else:
        given = None  # a torch.device holds what torch holds
    # An index of 255 (mod 256) comes back as None, the current GPU: it is compared too.
    if given is not None and given != parsed.index:
        raise ValueError(
            f"device={device!r} names a CUDA device index that torch cannot hold (it read {parsed}); "
            "pass the index of one of this machine's GPUs"
        )
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {parsed}")
    return parsed


def resolve_device(device: str | torch.device | int | None) -> torch.device:
    """Turns the user's ``device`` into an indexed ``torch.device`` that can be used.

    ``None`` under torchrun (``LOCAL_RANK`` set) means ``cuda:LOCAL_RANK``, one GPU per local process,
    unless fewer GPUs are visible (a launcher that gives each process its own): then the current one.
    With a GPU but no nvImageCodec it means the CPU, with a :class:`CPUFallbackWarning`: a GPU run
    that decodes on the CPU is slow, and should not go unnoticed.

    Raises:
        RuntimeError: For a CUDA device on a machine where none is usable.
        ImportError: For a CUDA device without nvImageCodec installed.
        ValueError: For ``device=None`` with a GPU and a ``LOCAL_RANK`` that is not a rank.
    """
    if device is None:
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if not _nvimgcodec_installed():
            warnings.warn(
                "a CUDA GPU is available, but nvImageCodec is not installed, so images are decoded on the "
                f"CPU: {gpu_decoding_advice()}, or pass device='cpu' to decode on the CPU without this "
                "warning",
                CPUFallbackWarning,
                stacklevel=4,  # the user's ThreadLoader(...) or BatchDecoder(...), through Runtime
            )
            return torch.device("cpu")
        device = _local_rank_device()
    resolved = usable(parse_device(device))
    if resolved.type == "cuda":
        check_cuda_versions()
    return resolved


def gpu_decoding_advice() -> str:
    """How to decode on the GPU here: nvImageCodec's wheels, and the pip extras, are for CUDA 12 and 13."""
    cuda = torch.version.cuda
    major = int(cuda.split(".")[0]) if cuda else None
    if major in (12, 13):
        return (
            f"pip install 'nvidia-nvimgcodec-cu{major}[nvjpeg]' (in a threadloader checkout: "
            f"pip install -e '.[cu{major}]') to decode on the GPU"
        )
    built = f"is built for CUDA {cuda}" if cuda else "has no CUDA version (a ROCm build)"
    return (
        f"nvImageCodec's wheels are for CUDA 12 and 13, and this torch {built}; "
        "to decode on the GPU, install a torch built for CUDA 12 or 13, then "
        "pip install 'nvidia-nvimgcodec-cu12[nvjpeg]' or '-cu13[nvjpeg]' to match it"
    )


def _local_rank_device() -> str:
    """``device=None``'s GPU with one: ``cuda:LOCAL_RANK`` under torchrun, else the current one.

    Also the current one for a ``LOCAL_RANK`` past the visible GPUs (a launcher that gives each process
    its own). Surrounding spaces are dropped (``" 1"`` was GPU 0 for every rank).

    Raises:
        ValueError: For a ``LOCAL_RANK`` that is not a non-negative integer, naming it.
    """
    local_rank = os.environ.get("LOCAL_RANK", "").strip()
    if not local_rank:
        return "cuda"
    if not (local_rank.isascii() and local_rank.isdecimal()):
        raise ValueError(
            f"LOCAL_RANK must be this process's local rank, a non-negative integer, got "
            f"{os.environ['LOCAL_RANK']!r}; unset it, fix its launcher, or pass device= explicitly"
        )
    index = int(local_rank)
    return f"cuda:{index}" if index < torch.cuda.device_count() else "cuda"


def usable(device: torch.device) -> torch.device:
    """A parsed ``device``, indexed if a CUDA one, once it is known to exist here.

    Raises:
        RuntimeError: For a CUDA device on a machine where none is usable, or past the last one.
    """
    if device.type == "cpu":
        return device
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device={str(device)!r} but no CUDA GPU is usable here; pass device='cpu' (or None)"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise RuntimeError(
            f"device={str(device)!r} but only {torch.cuda.device_count()} CUDA device(s) exist"
        )
    return torch.device("cuda", index)
