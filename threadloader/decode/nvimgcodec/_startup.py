"""What is done once before nvImageCodec decodes for us: making Decoders, and checking that it works.

A new Decoder first decodes a batch of the pool's size (:func:`new_decoder`); before the first decode on
a device the C API binding decodes a photo turned by EXIF into guarded memory and compares it with
Pillow's (:func:`self_test`); before the first region, a region is compared with the same crop of the
whole image (:func:`region_check`); and where nvImageCodec and torch are built for different CUDA
major versions, a warning says so (:func:`check_cuda_versions`). Each answers once per process (the
registry keeps the verdicts); a failure is a warning and a slower path, not an error.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Hashable
from importlib import resources
from typing import Any

import torch

from ..pillow import decode_rgb
from . import _capi
from ._engines import Engine, Memory, engine_named
from ._jpeg import with_exif_orientation
from ._memory import dense
from ._registry import DecoderKey, DecoderRegistry

__all__ = ["SHARED", "check_cuda_versions", "new_decoder", "region_check", "sample", "self_test"]

logger = logging.getLogger("threadloader")

#: Images a new Decoder whose configuration leaves out the JPEG engine first decodes: enough to
#: initialize its decoders (they do so on first use) before a reader's call is timed for its pace.
_PRIME_IMAGES = 8

#: Guard bytes around the self-test's image, and how many columns of them past each row.
_GUARD, _GUARD_PIXELS = 0xA5, 4
#: Mean absolute difference from Pillow that the self-test allows: nvJPEG's and libjpeg's IDCT and
#: chroma upsampling differ slightly (measured well below 1 on an H200).
_SELF_TEST_TOLERANCE = 2.0
#: The region the region check decodes from ``astronaut.jpg``: ``(top, left, height, width)``.
_CHECKED_REGION = (37, 51, 101, 143)


def sample(name: str) -> bytes:
    """A photo bundled with the package (``threadloader/_sample``)."""
    return (resources.files("threadloader") / "_sample" / name).read_bytes()


def new_decoder(
    engine: str, device_index: int, config: str, cpu_threads: int, fancy_upsampling: bool, batch: int
) -> object:
    """A new Decoder of ``engine`` on the device, limited to ``config``'s kinds: the pools' factory.

    Before anyone leases it, it decodes a batch of ``batch`` images (or a few, for a configuration
    without the JPEG engine): nvImageCodec 0.9 sizes the engine's share of every call from a Decoder's
    first call and keeps it. A Decoder whose first call was the warm-up's 4 photos then sent 60 of
    every 64 images to nvJPEG's CUDA decoder, at three times the CPU (docs/design.md, "Decoder
    engines"); DALI makes its first call with its own batch size for the same reason.
    """
    made = engine_named(engine)
    decoder = made.new_decoder(device_index, config, cpu_threads, fancy_upsampling, batch)
    try:
        _prime(made, decoder, torch.device("cuda", device_index), batch or _PRIME_IMAGES)
    except Exception:  # the first real call decodes, or falls back, as it would have
        logger.debug("threadloader: priming a new nvImageCodec Decoder failed", exc_info=True)
    except BaseException:  # a Ctrl-C: the Decoder is no one's yet, its memory and threads freed here
        made.destroy(decoder)
        raise
    return decoder


def _prime(engine: Engine, decoder: object, device: torch.device, count: int) -> None:
    """Decodes ``count`` copies of a bundled photo with ``decoder`` and waits for them.

    In handles of its own (a reader may make a Decoder in the middle of its call), on the allocation
    stream, which nothing else runs on, so the memory freed after is reused by decode outputs.
    """
    batch = engine.parse([sample("chelsea.jpg")] * count, apart=True)
    height, width = batch.headers.heights[0], batch.headers.widths[0]
    stream = SHARED.allocation_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        memory = torch.empty((count, height, width, 3), dtype=torch.uint8, device=device)
        step = height * width * 3
        places = {p: Memory(memory.data_ptr() + p * step, (height, width), width * 3) for p in range(count)}
        batch.decode(decoder, places, stream.cuda_stream)
        stream.synchronize()  # once per Decoder: the memory is free for the next output


def _destroy(key: Hashable, decoder: Any) -> None:
    """Frees a Decoder of a pool that no decoder uses any more (``key[0]`` is its engine's name)."""
    assert isinstance(key, tuple)
    engine_named(key[0]).destroy(decoder)


#: The registry every decoder of the library shares.
SHARED = DecoderRegistry(new_decoder, _destroy)


def self_test(
    engine: Engine, registry: DecoderRegistry, key: DecoderKey, limit: int, device: torch.device
) -> str | None:
    """What is wrong with ``engine`` on ``device``, decoding a photo turned by EXIF; ``None`` if nothing.

    Decodes a bundled photo with EXIF orientation 6 into memory with guard bytes around it, and
    compares it with Pillow's: a wrong struct layout, a missing orientation or a wrong output size
    shows as a refused call, wrong pixels or a touched guard byte.
    """
    data = with_exif_orientation(sample("chelsea.jpg"), 6)  # stored 451x300, shown 300 wide, 451 high
    expected = torch.from_numpy(decode_rgb(data))
    shown = (int(expected.shape[0]), int(expected.shape[1]))
    with registry.lease(key, limit) as decoder, torch.cuda.device(device):
        batch = engine.parse([data])
        headers = batch.headers
        got = (
            headers.failures.get(0),
            headers.codecs[0],
            headers.heights[0],
            headers.widths[0],
            headers.turned[0],
        )
        want = (None, "jpeg", shown[1], shown[0], True)
        if got != want:
            return f"its header reads (error, codec, height, width, turned) {got}, expected {want}"
        stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):  # guard bytes: a row past the image, and columns past each row
            memory = torch.full(
                (shown[0] + 1, shown[1] + _GUARD_PIXELS, 3), _GUARD, dtype=torch.uint8, device=device
            )
        place = Memory(memory.data_ptr(), shown, (shown[1] + _GUARD_PIXELS) * 3)
        extent = batch.decode(decoder, {0: place}, stream.cuda_stream)[0]
        stream.synchronize()  # once per process: a host sync is fine here
        host = memory.cpu()
    if extent != shown:
        return f"it decoded the image as {extent}, expected {shown}"
    if (host[shown[0]] != _GUARD).any() or (host[:, shown[1] :] != _GUARD).any():
        return "it wrote outside the image's memory (a wrong output size or stride)"
    difference = float((host[: shown[0], : shown[1]].float() - expected.float()).abs().mean())
    if difference > _SELF_TEST_TOLERANCE:
        return (
            f"its pixels differ from Pillow's by {difference:.1f} on average (a wrong orientation or format?)"
        )
    return None


def region_check(engine: Engine, decoder: object, device: torch.device) -> str | None:
    """What is wrong with decoding regions with ``decoder``; ``None`` if a region equals its crop.

    Decodes a region of a bundled photo and the whole photo, on the current stream, and compares the
    region with the same crop of the whole: a GPU where region decoding gives wrong pixels or fails
    (nvImageCodec issue #55) then decodes whole images.
    """
    data = sample("astronaut.jpg")
    top, left, height, width = _CHECKED_REGION
    try:
        batch = engine.parse([data, data])
        whole_size = (batch.headers.heights[0], batch.headers.widths[0])
        if not batch.crop(1, _CHECKED_REGION):
            return "the region was refused"
        outputs = dense(
            {0: whole_size, 1: (height, width)},
            lambda shape: torch.empty(shape, dtype=torch.uint8, device=device),
        )
        extents = batch.decode(decoder, outputs.memory, torch.cuda.current_stream(device).cuda_stream)
        if extents[0] is None or extents[1] is None:
            return f"nvImageCodec gave up on the {'whole image' if extents[0] is None else 'region'}"
        expected = outputs.view(0)[top : top + height, left : left + width]
        difference = float((outputs.view(1).float() - expected.float()).abs().mean())
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None if difference <= 1.0 else f"the region differed from the crop by {difference:.1f} on average"


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
            "codec for torch's CUDA (pip install 'nvidia-nvimgcodec-cu%d[nvjpeg]', then pip uninstall "
            "nvidia-nvimgcodec-cu%d) or a torch build for CUDA %d",
            codec,
            ours,
            ours,
            codec,
            codec,
        )
