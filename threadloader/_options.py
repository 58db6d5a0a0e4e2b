"""Every option both front ends take, declared once: its default, its check, what it derives.

``ThreadLoader`` and ``BatchDecoder`` take the same output arguments (size, dtype, mean, std,
channels_last, transform) and decoding arguments (device, num_threads, backend, decode_threads,
gpu_decoders, jpeg_fancy_upsampling, max_pixels, region_decode, decoder). Each front end's signature
names them with :data:`DEFAULTS`' values and hands them over as one frozen :class:`Options`
(``Options.of(arguments)``), checked here; the runtime (``_runtime.py``) builds what they describe. The
environment variables that change a default are named and read here too, once, when a front end is
built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_count, check_switch, env_flag
from ._device import available_cpus
from ._output import OutputFormat
from .decode.base import DEFAULT_MAX_PIXELS, ImageDecoder, check_pixel_limit
from .decode.nvimgcodec import DEFAULT_BACKEND, DEFAULT_BATCH_SIZE, DEFAULT_GPU_DECODERS, check_options
from .transforms import Compose, Normalize, ToDtype, Transform

__all__ = ["DEFAULTS", "REGION_DECODE_ENV", "WARMUP_ENV", "Options", "as_transform"]

#: Set to 0 to decode whole images and crop afterwards, should region decoding misbehave on a GPU
#: (nvImageCodec issue #55 reports failures and crashes of region decoding on some GPUs with 0.9.0):
#: the meaning of ``region_decode=None``, read when a front end is built.
REGION_DECODE_ENV = "THREADLOADER_REGION_DECODE"

#: Set to 0 to build front ends without the background warm-up (read when one is built): for a script
#: that captures a CUDA graph in torch's default (global) mode while its loader would be warming up,
#: where another thread's CUDA calls break the capture.
WARMUP_ENV = "THREADLOADER_WARMUP"

#: The options that configure the built-in decoders: refused beside a decoder of one's own.
_DECODER_OPTIONS = (
    "backend",
    "decode_threads",
    "gpu_decoders",
    "jpeg_fancy_upsampling",
    "max_pixels",
    "region_decode",
)


@dataclass(frozen=True)
class Options:
    """The options both front ends take (their docstrings say what each means), checked when made.

    Raises:
        ValueError, TypeError: For a value an option does not take; the message names it and what was
            got.
    """

    size: tuple[int, int] | None = None
    dtype: torch.dtype = torch.uint8
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    channels_last: bool = False
    transform: Transform | Sequence[Transform] | None = None
    device: str | torch.device | int | None = None
    num_threads: int | None = None
    backend: str = DEFAULT_BACKEND
    decode_threads: int | None = None
    gpu_decoders: int = DEFAULT_GPU_DECODERS
    jpeg_fancy_upsampling: bool = True
    max_pixels: int | None = DEFAULT_MAX_PIXELS
    region_decode: bool | None = None
    decoder: ImageDecoder | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "transform", as_transform(self.transform))
        # Checks size, dtype, mean, std and channels_last, and keeps the last as a plain bool.
        object.__setattr__(self, "channels_last", self.output_format().channels_last)
        _check_normalize_on_floats(self.chain)
        normalize = _normalized_by(self.chain)
        if normalize is not None and not self.dtype.is_floating_point:
            raise ValueError(
                f"the transform ends in normalized values ({normalize!r}), which dtype={self.dtype} cannot "
                "hold: pass a float dtype (e.g. dtype=torch.float32)"
            )
        check_count("num_threads", self.num_threads)
        check_pixel_limit(self.max_pixels)
        check_options(
            backend=self.backend,
            gpu_decoders=self.gpu_decoders,
            decode_threads=self.decode_threads,
            jpeg_fancy_upsampling=self.jpeg_fancy_upsampling,
        )
        # Checked there, kept here as a plain bool (1, numpy's True).
        object.__setattr__(self, "jpeg_fancy_upsampling", bool(self.jpeg_fancy_upsampling))
        if self.region_decode is not None:  # None: decided by the transform
            object.__setattr__(
                self, "region_decode", check_switch("region_decode", self.region_decode, also="or None")
            )
        if self.decoder is not None:
            if not isinstance(self.decoder, ImageDecoder):
                raise TypeError(
                    f"decoder must be a threadloader.decode.ImageDecoder, got {type(self.decoder).__name__}"
                )
            changed = [name for name in _DECODER_OPTIONS if getattr(self, name) != getattr(DEFAULTS, name)]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} configure the built-in decoder, but decoder={self.decoder!r} was "
                    "passed; leave them unset and configure that decoder itself"
                )

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> Options:
        """The options among a front end's ``arguments`` (its ``locals()``), by name."""
        return cls(**{field.name: arguments[field.name] for field in dataclasses.fields(cls)})

    @property
    def chain(self) -> Transform | None:
        """``transform`` as one transform (a list became a :class:`Compose`)."""
        assert self.transform is None or isinstance(self.transform, Transform)  # made so by __post_init__
        return self.transform

    def output_format(self) -> OutputFormat:
        """The output format: ``size`` if given, else a transform's fixed output size (stacked batches)."""
        chain = self.chain
        size = self.size if self.size is not None or chain is None else chain.output_size(None)
        return OutputFormat(
            size=size, dtype=self.dtype, mean=self.mean, std=self.std, channels_last=self.channels_last
        )

    def threads_on(self, device: torch.device) -> int:
        """Reader threads: ``num_threads``, else 2 on a GPU, the CPU count (at most 32) on the CPU.

        On the GPU the rest of a batch's work holds the GIL, so more threads only contend: 2 were
        fastest (docs/benchmarks.md). On the CPU each thread decodes with the GIL released.
        """
        if self.num_threads is not None:
            return self.num_threads
        cpus = available_cpus()
        return min(2, cpus) if device.type == "cuda" else min(32, cpus)

    def decode_threads_for(self, readers: int) -> int:
        """nvImageCodec's CPU threads per Decoder: ``decode_threads``, else the free cores shared.

        The cores the ``readers`` leave free, shared by the Decoders that decode at once (a reader calls
        one at a time, so at most as many as the readers): each Decoder has a pool of its own, and
        pools that each took every free core put several threads on each core, which beside a graphed
        training step fed it less (docs/design.md, "Decoder engines").
        """
        if self.decode_threads is not None:
            return self.decode_threads
        return max(1, (available_cpus() - readers) // min(readers, self.gpu_decoders))

    def regions(self) -> bool:
        """Whether region decoding is on: ``region_decode``, else unless ``THREADLOADER_REGION_DECODE=0``."""
        if self.region_decode is not None:
            return self.region_decode
        return env_flag(REGION_DECODE_ENV, default=True)


def decode_batch_size_on(
    device: torch.device, batch_size: int | None, decode_batch_size: int | None
) -> int | None:
    """Images per decoder call: ``decode_batch_size``, else 64 on a GPU (or the batch), one batch on the CPU.

    A call holds whole batches, so a ``decode_batch_size`` below the batch is one batch a call: what it
    says is what the calls get (it said 2 where every call decoded the batch's 8).

    The GPU decoder is faster per image on larger calls (docs/benchmarks.md), but a group's decoded
    images and outputs are all in device memory at once: 128 at a time doubled the loader's memory
    and did not feed a training step any faster than 64.

    ``batch_size`` is ``None`` where the batches' size is not known before they come (a
    ``batch_sampler`` that does not say it): a given value and the GPU's 64 are then bounds that a
    larger batch still exceeds alone, and the CPU's one batch a call has no number, so it is ``None``
    (it said 1, which no call held).
    """
    if decode_batch_size is not None:
        check_count("decode_batch_size", decode_batch_size)
        return max(int(decode_batch_size), batch_size or 1)
    if device.type == "cuda":
        return max(DEFAULT_BATCH_SIZE, batch_size or 1)
    return batch_size


def warm_up_wanted() -> bool:
    """Whether a front end warms its GPU decoder up in the background (unless ``THREADLOADER_WARMUP=0``)."""
    return env_flag(WARMUP_ENV, default=True)


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


def _check_normalize_on_floats(chain: Transform | None) -> None:
    """Refuses a :class:`Normalize` that would see the decoders' ``uint8`` images (at the first batch)."""
    floating = False
    for transform in _steps(chain):
        if isinstance(transform, ToDtype):
            floating = transform.dtype.is_floating_point
        elif isinstance(transform, Normalize) and not floating:
            raise ValueError(
                f"{transform!r} would see uint8 images: put ToDtype(torch.float32, scale=True) before it, "
                "or pass mean= and std= to the loader instead (its output step normalizes in float)"
            )


def _normalized_by(chain: Transform | None) -> Normalize | None:
    """The chain's :class:`Normalize` whose values reach the output (no ``ToDtype`` to integers after it)."""
    found = None
    for transform in _steps(chain):
        if isinstance(transform, Normalize):
            found = transform
        elif isinstance(transform, ToDtype) and not transform.dtype.is_floating_point:
            found = None
    return found


def _steps(chain: Transform | None) -> list[Transform]:
    """A chain's transforms in order, nested :class:`Compose` flattened."""
    if chain is None:
        return []
    if isinstance(chain, Compose):
        return [step for transform in chain.transforms for step in _steps(transform)]
    return [chain]


#: Every option's default: the front ends' signatures name these.
DEFAULTS = Options()
