"""The decoder contract: what every decoder, GPU or CPU, built in or a user's own, implements and returns.

A decoder turns a batch of encoded images into RGB ``uint8`` HWC tensors on its device. Everything
after that (transforms, resize, dtype, normalize, layout) is device-agnostic tensor code in
``transforms`` and ``_output``, which is what makes the CPU and GPU paths give the same output. A
decoder of one's own (``decoder=`` of the front ends) subclasses :class:`ImageDecoder`; every type
named here is exported by ``threadloader.decode``.

Region decoding, a random crop's region decoded alone instead of the whole image and a crop, is part
of the contract; each part of it acts where its data is:

1. A transform says which part of an image it reads: ``Transform.split_region(params)`` returns the
   region and the parameters that give the same output from the region alone (``transforms/``).
   Its ``apply_many`` must then accept a batch tensor of regions padded to one size, each at the top
   left of its row; the padding holds arbitrary finite values.
2. The pipeline draws a sample's parameters from the size in the header and asks the transform for its
   region: a :data:`RegionOf` that the decoder calls (``_pipeline.py``).
3. A decoder that can decode part of an image asks ``region_of`` with the size as displayed and
   reports what it decoded as a region: :attr:`DecodedBatch.regions`, :attr:`DecodedBatch.batch` and
   its ``rows`` and ``extents``; a region it gave up on is decoded whole and left out of ``regions``,
   so the pipeline crops it with the parameters drawn from the whole image.
4. The GPU decoder puts regions of different sizes at the top-left corners of one padded
   ``(B, Hmax, Wmax, 3)`` tensor, which the crop's resampling reads as one batch.

docs/design.md ("Region decoding for random crops") says why.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "DecodedBatch",
    "Encoded",
    "ImageDecoder",
    "Region",
    "RegionOf",
    "StageRecorder",
    "check_decoded",
    "check_pixel_limit",
    "pixel_limit_error",
]

#: A region of an image: ``(top, left, height, width)``.
Region = tuple[int, int, int, int]

#: Asked by a decoder that can decode part of an image, with a sample's position in the batch and its
#: displayed ``(height, width)``: the region to decode, or ``None``.
RegionOf = Callable[[int, tuple[int, int]], Region | None]


class StageRecorder(Protocol):
    """Where a decoder tells its host time per stage and its counts (a loader's ``stats()``).

    The stages a decoder times are ``"parse"``, ``"decode_lock"``, ``"decode"`` and ``"fallback"``;
    its counts ``"cpu_fallbacks"`` and ``"region_decodes"`` (``threadloader.LoaderStats`` says what each
    means).
    """

    def timed(self, stage: str) -> AbstractContextManager[None]:
        """Times the body as host seconds of ``stage`` (and the thread's CPU seconds in it)."""
        ...

    def count(self, name: str, n: int = 1) -> None:
        """Adds ``n`` to the counter ``name``."""
        ...


Encoded = bytes | bytearray | memoryview

#: Default decompression-bomb guard: Pillow's own limit (about 89.5 million pixels, 9459 x 9459).
DEFAULT_MAX_PIXELS = 89_478_485


def check_pixel_limit(max_pixels: object) -> None:
    """Raises unless ``max_pixels`` is a pixel count of at least 1 or ``None`` (no limit).

    Checked where it is given: a wrong type met later, inside Pillow's format probing, made every
    image read as "not a format Pillow reads".
    """
    if max_pixels is None:
        return
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, numbers.Integral) or max_pixels < 1:
        raise ValueError(
            f"max_pixels must be an int of at least 1 (pixels), or None for no limit, got {max_pixels!r}"
        )


def pixel_limit_error(width: int, height: int, max_pixels: int | None) -> str | None:
    """The error for an image over the pixel limit, read from its header before anything is decoded."""
    if max_pixels is None or width * height <= max_pixels:
        return None
    return (
        f"{width}x{height} is {width * height:,} pixels, over the limit of {max_pixels:,} "
        "(decompression-bomb guard); pass a larger max_pixels=, or None, to allow it"
    )


@dataclass
class DecodedBatch:
    """A decoder's output for one batch, position by position.

    Images that fit are rows of one batch tensor, so later stages work on the batch at once and nothing
    makes a tensor per image: a batch of one size is ``batch`` itself; images of different sizes (random
    crops' regions, or whole images that the output resizes) sit at the top-left corner of their row,
    ``extents`` saying how much of it each fills. Images decoded on their own (a fallback, an image far
    larger than the rest) are in ``own``.

    Attributes:
        extents: Per position, the ``(height, width)`` of its decoded image; ``None`` where it failed.
        errors: Position to the reason it failed, for each ``None`` in ``extents``.
        batch: A ``(B, H, W, 3)`` ``uint8`` tensor on the decoder's device; row ``p`` holds the image of
            each position ``p`` in ``rows`` at its top left (the rest of the row is undefined).
        rows: Positions whose image is in ``batch``.
        own: Position to its own ``(H, W, 3)`` tensor, for images that decoded outside ``batch``.
        regions: Positions decoded as the region ``region_of`` asked for, not as the whole image
            (the module's notes have that contract).
        causes: Position to the exception behind its error, where there is one (a decoder library's
            status code is not): the pipeline chains it as the ``SampleError``'s ``__cause__``.
    """

    extents: list[tuple[int, int] | None]
    errors: dict[int, str] = field(default_factory=dict)
    batch: torch.Tensor | None = None
    rows: set[int] = field(default_factory=set)
    own: dict[int, torch.Tensor] = field(default_factory=dict)
    regions: set[int] = field(default_factory=set)
    causes: dict[int, BaseException] = field(default_factory=dict)

    @classmethod
    def of_images(
        cls,
        images: Sequence[torch.Tensor | None],
        errors: dict[int, str] | None = None,
        causes: dict[int, BaseException] | None = None,
    ) -> DecodedBatch:
        """The output of a decoder that decodes image by image: each image its own tensor."""
        return cls(
            extents=[
                None if image is None else (int(image.shape[0]), int(image.shape[1])) for image in images
            ],
            errors=dict(errors or {}),
            own={p: image for p, image in enumerate(images) if image is not None},
            causes=dict(causes or {}),
        )

    def image(self, position: int) -> torch.Tensor | None:
        """The ``(H, W, 3)`` image at ``position`` (a view, for rows of ``batch``); ``None`` if it failed."""
        extent = self.extents[position]
        if extent is None:
            return None
        own = self.own.get(position)
        if own is not None:
            return own
        assert self.batch is not None
        return self.batch[position, : extent[0], : extent[1]]

    @property
    def stacked(self) -> torch.Tensor | None:
        """``batch`` when it is exactly the images: all positions, all of its size; else ``None``."""
        if self.batch is None or len(self.rows) != len(self.extents):
            return None
        size = (int(self.batch.shape[1]), int(self.batch.shape[2]))
        return self.batch if all(extent == size for extent in self.extents) else None


def check_decoded(decoded: object, count: int, decoder: object) -> DecodedBatch:
    """``decoded``, once it keeps :class:`DecodedBatch`'s contract for ``count`` inputs; else the error.

    A decoder of one's own that breaks it (a forgotten ``return``, an entry short, CHW or RGBA images)
    gave an empty epoch, a bare ``IndexError`` or 4-channel batches downstream, far from its cause.

    Raises:
        TypeError: If ``decoded`` is not a :class:`DecodedBatch`, or an image not a ``uint8`` tensor.
        ValueError: If its entries do not match the inputs, or an image its extent.
    """
    name = f"{type(decoder).__name__}.decode"
    if not isinstance(decoded, DecodedBatch):
        raise TypeError(f"{name} returned {type(decoded).__name__}, not a DecodedBatch (one entry per input)")
    extents = decoded.extents
    if len(extents) != count:
        raise ValueError(f"{name} returned {len(extents)} extents for {count} inputs: one per input")
    unexplained = [p for p, extent in enumerate(extents) if extent is None and p not in decoded.errors]
    if unexplained:
        raise ValueError(f"{name} failed positions {unexplained[:5]} without a reason in errors")
    if decoded.rows:
        batch = decoded.batch
        if not _rgb(batch, 4) or not 0 <= min(decoded.rows) <= max(decoded.rows) < batch.shape[0]:  # type: ignore[union-attr]
            rows = sorted(decoded.rows)[:5]
            raise TypeError(
                f"{name}: rows {rows} need a (B, H, W, 3) uint8 batch that holds them, got {_kind(batch)}"
            )
        height, width = batch.shape[1:3]  # type: ignore[union-attr]
        for position in decoded.rows:
            extent = extents[position]
            if extent is None or extent[0] > height or extent[1] > width:
                raise ValueError(
                    f"{name}: position {position}'s extent {extent} is not in a row of {height}x{width}"
                )
    for position, image in decoded.own.items():
        if not _rgb(image, 3) or not 0 <= position < count or tuple(image.shape[:2]) != extents[position]:
            raise TypeError(
                f"{name}: image {position} must be an (H, W, 3) uint8 tensor of its extent, got "
                f"{_kind(image)}"
            )
    lost = [
        p for p, e in enumerate(extents) if e is not None and p not in decoded.rows and p not in decoded.own
    ]
    if lost:
        raise ValueError(f"{name}: positions {lost[:5]} have an extent but no image, in rows or own")
    return decoded


def _rgb(value: object, ndim: int) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.uint8
        and value.ndim == ndim
        and value.shape[-1] == 3
    )


def _kind(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return type(value).__name__


class ImageDecoder(ABC):
    """Decodes whole batches; called concurrently from reader threads.

    Implementations must be safe to call from several threads at once: they serialize whatever their
    library cannot run concurrently themselves, so callers never need to know.
    """

    #: Where the decoded tensors live.
    device: torch.device

    #: Whether a front end starts this decoder in the background when it is built, because its first
    #: calls cost seconds (nvImageCodec's start): a batch of the bundled photos per reader that decodes
    #: at once, which the readers wait for, and meanwhile, while :attr:`starting`, Pillow decodes their
    #: batches. ``THREADLOADER_WARMUP=0`` turns it off.
    warms_up: bool = False

    @property
    def starting(self) -> bool:
        """Whether the decoder is still starting (a front end that warms it up decodes with Pillow)."""
        return False

    @abstractmethod
    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StageRecorder | None = None,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        """Decodes a batch.

        Args:
            encoded: Encoded images.
            stream: The calling thread's CUDA stream (``None`` on the CPU); all device work is queued on
                it and the returned tensors are ready once that stream reaches this point.
            stats: Where to add host time per stage, if anywhere.
            region_of: Lets a decoder that can decode part of an image (a random crop's region) ask
                which part; decoders that cannot ignore it and decode the whole image.
            pad: The caller resizes the images as one batch, so images of different sizes may be
                decoded into the rows of one ``batch``; decoders that cannot ignore it.

        Returns:
            One entry per input; a sample that cannot be decoded is reported in ``errors``, never raised.
        """

    def consumer_ahead(self, ahead: bool) -> None:  # noqa: B027  # most decoders decode one way only
        """Told by a front end whether its consumer is the slower side (batches wait for it).

        A decoder with several ways to decode may then choose the one that takes least from the
        consumer (the GPU decoder's ``backend="auto"``) rather than the fastest.
        """

    def close(self) -> None:  # noqa: B027  # most decoders hold nothing to let go of
        """Lets go of what the decoder holds (the GPU decoder's nvImageCodec Decoders, their memory).

        A front end closes the decoder it built when it is closed; one passed in with ``decoder=`` is
        its owner's to close. Calls after it may still decode, making anew what they need.
        """
