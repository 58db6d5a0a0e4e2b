"""CPU decoding with Pillow: the CPU path, the GPU path's fallback, a GPU loader's first batches.

A GPU loader's first batches are Pillow's while nvImageCodec starts in the background.

Pillow releases the GIL while it decodes, so reader threads decode in parallel. The output contract is
the one the GPU path keeps: RGB, EXIF orientation applied, grayscale and CMYK converted to RGB, alpha
dropped, samples wider than 8 bits reduced to their high byte.
"""

from __future__ import annotations

import collections
import concurrent.futures.thread
import io
import itertools
import numbers
import re
import struct
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from typing import cast

import numpy as np
import torch
from PIL import Image, ImageFile, TiffImagePlugin, UnidentifiedImageError

from .._cancel import check_cancelled, in_own_thread
from .._stats import StatsRecorder
from ..errors import detached
from .base import (
    DEFAULT_MAX_PIXELS,
    DecodedBatch,
    Encoded,
    ImageDecoder,
    RegionOf,
    StageRecorder,
    check_pixel_limit,
    pixel_limit_error,
)

__all__ = ["PillowDecoder", "decode_rgb", "header_size"]


_SIXTEEN_BIT_GRAY = frozenset(["I;16", "I;16L", "I;16B", "I;16N"])
# Pillow opens 16-bit gray PGM (and, before 10, PNG) as 32-bit "I": 16-bit samples there, as those
# formats have no wider gray. A TIFF's "I" holds 32-bit or signed samples, which Pillow's own
# conversion clips to 0-255: shifted as 16-bit ones, 0-255 values went black and negative ones white.
_SIXTEEN_BIT_AS_I = frozenset(["PNG", "PPM"])

# max_pixels is the one pixel limit, whatever Pillow's own. Pillow has no per-call limit: its check,
# Image._decompression_bomb_check, reads the process-wide Image.MAX_IMAGE_PIXELS and is called by
# Image.open (from the header) and by plugins as they load (TIFF tiles, GIF frames); it warns between
# 1x and 2x that limit and raises past 2x. Changing the global around a decode would race with every
# other thread using Pillow, and warnings.catch_warnings is process-wide as well. So the check is
# wrapped once, here: in a thread inside _limited, it applies that call's max_pixels (no warning band,
# and None lifts it); in every other thread it is Pillow's own check, reading the global as before.
_NOT_SET = object()
_limit = threading.local()  # .max_pixels while this thread is inside _limited
_pillow_bomb_check = Image._decompression_bomb_check


def _bomb_check(size: tuple[int, int], **options: bool) -> None:
    max_pixels = getattr(_limit, "max_pixels", _NOT_SET)
    if max_pixels is _NOT_SET:
        _pillow_bomb_check(size, **options)
    else:
        _check_pixels(size, cast("int | None", max_pixels))


def _check_pixels(size: tuple[int, int], max_pixels: int | None) -> None:
    error = pixel_limit_error(size[0], size[1], max_pixels)
    if error is not None:
        raise Image.DecompressionBombError(error)


Image._decompression_bomb_check = _bomb_check


@contextmanager
def _limited(max_pixels: int | None) -> Iterator[None]:
    """Makes ``max_pixels`` the limit of Pillow's decompression-bomb check in this thread."""
    previous = getattr(_limit, "max_pixels", _NOT_SET)
    _limit.max_pixels = max_pixels
    try:
        yield
    finally:
        if previous is _NOT_SET:
            del _limit.max_pixels
        else:
            _limit.max_pixels = previous


def _open(data: Encoded) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        # Pillow's message names the BytesIO by its repr, a heap address: say what was given instead.
        raise UnidentifiedImageError(
            f"cannot identify image file ({memoryview(data).nbytes} bytes starting {bytes(data)[:8]!r}): "
            "not a format "
            "Pillow reads, or its header is damaged"
        ) from None


def header_size(data: Encoded) -> tuple[int, int]:
    """The ``(width, height)`` an image's header declares, read without decoding it; no pixel limit.

    Raises:
        Exception: Whatever Pillow raises for data it cannot identify.
    """
    with _limited(None), _open(data) as image:
        return image.size


#: Bytes of packed rows per step of :func:`_rgb_array`: few steps, and little memory beside the array.
_CHUNK = 1 << 20
#: The EXIF orientation tag, and what turns an image of each value upright (1, upright, is absent):
#: ImageOps.exif_transpose's, which also rewrites the image's EXIF without that tag and raised on
#: tags it cannot write back (a negative GPS altitude), failing an image whose pixels were fine.
_ORIENTATION = 0x0112
_UPRIGHT: dict[object, Image.Transpose] = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
#: The TIFF tag of each sample's bits.
_BITS_PER_SAMPLE = 258


def decode_rgb(data: Encoded, *, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decodes one image to an ``(H, W, 3)`` ``uint8`` RGB array, EXIF orientation applied.

    Alpha is dropped (not composited); palettes are expanded; 16-bit samples keep their high byte,
    as the GPU decoders scale them. ``max_pixels`` is the only pixel limit (Pillow's global is not
    consulted, and Pillow warns of nothing).

    Raises:
        PIL.Image.DecompressionBombError: If the header declares more than ``max_pixels`` pixels
            (nothing is decoded).
        Exception: Whatever Pillow raises for data it cannot decode.
    """
    with _limited(max_pixels), _open(data) as image:
        # Image.open has checked the header's size through _bomb_check; checked again so that the
        # limit holds whatever Pillow's plugins call.
        _check_pixels(image.size, max_pixels)
        tile = image.tile  # where a PPM's samples are (load() empties it)
        image.load()
        wide = _wide_rgb_ppm(image, tile, data)
        if wide is not None:
            return wide
        turn = _UPRIGHT.get(_orientation(image))
        oriented = image if turn is None else _replacing(image, image.transpose(turn))
        if oriented.mode in _SIXTEEN_BIT_GRAY or (oriented.mode == "I" and image.format in _SIXTEEN_BIT_AS_I):
            samples = np.asarray(oriented, dtype=np.uint32)
            maxval = _gray_maxval(image)
            if maxval != 65535:
                samples = (samples * 65535 + maxval // 2) // maxval
            gray = (samples >> 8).clip(0, 255).astype(np.uint8)
            return np.repeat(gray[..., None], 3, axis=2)
        rgb = oriented if oriented.mode == "RGB" else _replacing(oriented, oriented.convert("RGB"))
        return _rgb_array(rgb)


def _orientation(image: Image.Image) -> object:
    """The image's EXIF orientation as Pillow reads it; 1 (as stored) where its EXIF cannot be read.

    Pillow reads a PNG's or WebP's EXIF when asked, after the pixels, and raises for a damaged one
    (SyntaxError for a header that is not TIFF's, struct.error for one cut short, ValueError for a
    PNG's "Raw profile type exif" text that is not valid hex): such an image failed where Pillow's own
    decode and browsers show it as stored.
    """
    try:
        return image.getexif().get(_ORIENTATION, 1)
    except (SyntaxError, struct.error, ValueError):
        return 1


def _gray_maxval(image: Image.Image) -> int:
    """The largest sample a wide gray image's file can hold, as Pillow gives it: 65535 but for a TIFF.

    Pillow opens a 12-bit gray TIFF as I;16 with its samples as stored (0-4095): their high byte kept
    only 4 bits, near black. Scaled to 16 bits first, they follow the rule of a 12-bit PGM.
    """
    if not isinstance(image, TiffImagePlugin.TiffImageFile):
        return 65535
    bits = image.tag_v2.get(_BITS_PER_SAMPLE, 16)
    bits = bits[0] if isinstance(bits, tuple) else bits
    return (1 << bits) - 1 if isinstance(bits, int) and 8 < bits < 16 else 65535


def _wide_rgb_ppm(image: Image.Image, tile: list[ImageFile._Tile], data: Encoded) -> np.ndarray | None:
    """An RGB PPM's samples of more than 8 bits, each the high byte of the sample scaled to 16 bits.

    Pillow reads these to 8 bits by rounding (``v * 255 / maxval``), not by the rule every other wide
    image follows here (a 16-bit gray PGM, which Pillow scales to 16 bits: its high byte), so a 16-bit
    sample came out one higher in a quarter of the values. ``None`` for any other image. Called after
    ``load()``, which has checked their count; a binary file's samples above ``maxval`` (which Pillow's
    reader takes) are white, as Pillow and a gray PGM make them.
    """
    if image.format != "PPM" or image.mode != "RGB" or len(tile) != 1:
        return None
    codec, _, offset, args = tile[0]
    if codec not in ("ppm", "ppm_plain") or not isinstance(args, tuple) or args[-1] <= 255:
        return None
    maxval, (width, height) = int(args[-1]), image.size
    count = width * height * 3
    raw = memoryview(data).cast("B")[offset:]
    if codec == "ppm":
        samples = np.frombuffer(raw, dtype=">u2", count=count).astype(np.uint32)
    else:  # plain (ASCII) samples; comments may sit between them
        text = re.sub(rb"#[^\r\n]*", b" ", bytes(raw))
        samples = np.array(text.split()[:count], dtype=np.uint32)
    sixteen = np.minimum((samples * 65535 + maxval // 2) // maxval, 65535)
    return (sixteen >> 8).astype(np.uint8).reshape(height, width, 3)


def _replacing(image: Image.Image, replacement: Image.Image | None) -> Image.Image:
    """``replacement``, with ``image``'s pixels freed now.

    A large image's steps then never hold three copies at once: the decode, its replacement, the array.
    """
    if replacement is None or replacement is image:
        return image
    image.close()
    return replacement


def _rgb_array(rgb: Image.Image) -> np.ndarray:
    """An RGB image's pixels as a writable ``(H, W, 3)`` array (torch.from_numpy shares it), in one copy.

    ``np.array(image)`` goes through ``image.tobytes()``, which joins the packed rows into one bytes
    object and then copies it: the image, its packed chunks, their join and the array were all in
    memory at once, over three times the image's RGB size. Here Pillow's raw encoder, as ``tobytes``
    drives it, packs the rows straight into the array, a chunk at a time: Pillow's decode and the
    array are all there is. Where that encoder cannot be had, the array comes from ``np.array``.
    """
    width, height = rgb.size
    array = np.empty((height, width, 3), dtype=np.uint8)
    if not array.size:
        return array
    try:
        encoder = Image._getencoder("RGB", "raw", "RGB")
    except (AttributeError, OSError):
        return np.array(rgb)
    out = array.data.cast("B")
    filled = 0
    try:
        encoder.setimage(rgb.im, (0, 0, width, height))
        while True:
            _, status, chunk = encoder.encode(max(_CHUNK, width * 4))  # at least a row (RawEncode.c)
            out[filled : filled + len(chunk)] = chunk
            filled += len(chunk)
            if status:
                break
    finally:
        encoder.cleanup()
    if status < 0 or filled != array.size:
        raise RuntimeError(f"Pillow's raw encoder gave {filled} bytes of {array.size} (status {status})")
    return array


class PillowDecoder(ImageDecoder):
    """Decodes a batch image by image, in the calling thread or spread over threads of its own.

    Args:
        max_pixels: Images whose header declares more pixels are errors.
        device: Where the images go (a ``torch.device`` or its name): the CPU, or a CUDA device, for a
            GPU loader's first batches while nvImageCodec starts (seconds): each image is copied there
            on the calling thread's stream.
        threads: Threads that decode one call's images at once. 1, the default, decodes them in the
            calling thread: the CPU path's parallelism is its reader threads. More is for a GPU
            loader's first batches, which its few readers would otherwise decode one image at a time
            while the consumer waits; the threads are started for the call and joined before it returns.

    Raises:
        ValueError: If ``threads`` is not a positive int, or ``max_pixels`` neither one nor ``None``.
    """

    def __init__(
        self,
        *,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        device: torch.device | str | None = None,
        threads: int = 1,
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 1:
            raise ValueError(
                f"threads must be a positive int (1: decode in the calling thread), got {threads!r}"
            )
        check_pixel_limit(max_pixels)
        # Parsed as the front ends parse device=: a string ("cpu") broke them, and "cpu:0" is the CPU.
        parsed = torch.device("cpu") if device is None else torch.device(device)
        self.device = torch.device("cpu") if parsed.type == "cpu" else parsed
        self.threads: int = int(threads)
        self._max_pixels: int | None = max_pixels

    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StageRecorder | None = None,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        """Decodes each whole image with Pillow; see :meth:`ImageDecoder.decode` (regions, padding unused)."""
        on_gpu = self.device.type == "cuda"
        if on_gpu and stream is None:
            raise ValueError("PillowDecoder.decode needs the calling thread's CUDA stream to copy to the GPU")
        with (stats or StatsRecorder()).timed("decode"):
            if self.threads > 1 and len(encoded) > 1:
                decoded = self._on_threads(encoded)
            else:
                decoded = []
                for data in encoded:
                    check_cancelled()  # large images make a long batch: stop between them
                    decoded.append(self._one(data))
        images = [image if isinstance(image, torch.Tensor) else None for image in decoded]
        causes = {position: exc for position, exc in enumerate(decoded) if isinstance(exc, BaseException)}
        errors = {position: f"{type(exc).__name__}: {exc}" for position, exc in causes.items()}
        if on_gpu and stream is not None:
            images = _uploaded(images, self.device, stream)
        return DecodedBatch.of_images(images, errors, causes)

    def _one(self, data: Encoded) -> torch.Tensor | BaseException:
        """One image, or what decoding it raised (its frames dropped: they hold the whole batch)."""
        try:
            return torch.from_numpy(decode_rgb(data, max_pixels=self._max_pixels))
        except Exception as exc:
            return detached(exc)

    def _on_threads(self, encoded: Sequence[Encoded]) -> list[torch.Tensor | BaseException]:
        """Each image decoded on the call's own threads, in order; two images a thread handed out at most.

        A pool runs everything handed to it before its threads end, at the interpreter's exit too
        (``concurrent.futures`` joins them then, before any hook of ours runs): handed the whole batch,
        an exit during a GPU loader's CPU start waited for all of it. Images are handed out as results
        come in instead, and a cancel drops the ones not handed out.

        Once the interpreter's exit has begun, a pool takes no more work (``submit`` raises): see
        :meth:`_refused`. Raising printed a traceback at every exit that came during such a call, and a
        daemon thread unwinding through torch's frames while the interpreter finalized at times aborted
        the process.
        """
        workers = min(self.threads, len(encoded))
        images = iter(encoded)
        with ThreadPoolExecutor(workers, thread_name_prefix="threadloader-pillow") as pool:

            def hand(count: int) -> Iterator[Future[torch.Tensor | BaseException]]:
                for data in itertools.islice(images, count):
                    future: Future[torch.Tensor | BaseException] | None = None
                    # Refused once the pool takes no more work (the exit, or no thread to be had).
                    with suppress(RuntimeError):
                        future = pool.submit(self._one, data)
                    # Decoded outside the handler: a bad image's error would chain the refusal.
                    yield future if future is not None else self._refused(data)

            handed = collections.deque(hand(2 * workers))
            try:
                decoded = []
                while handed:
                    check_cancelled()  # stops at the next image; the ones under way end first
                    decoded.append(handed.popleft().result())
                    handed.extend(hand(1))
                return decoded
            finally:
                for future in handed:
                    future.cancel()

    def _refused(self, data: Encoded) -> Future[torch.Tensor | BaseException]:
        """An image the call's pool refused, decoded in the calling thread.

        A thread the interpreter waits for (a non-daemon one) gets its whole batch. A daemon thread of
        the user's, once the exit has begun, parks instead, as the library's pools park one
        (``_workers._exiting``): decoding, it would run torch while the interpreter finalizes. The
        library's own threads stop at the next image, once the exit hook cancels them.
        """
        check_cancelled()
        thread = threading.current_thread()
        if _exiting() and thread.daemon and not in_own_thread():
            threading.Event().wait()
        done: Future[torch.Tensor | BaseException] = Future()
        done.set_result(self._one(data))
        return done


def _exiting() -> bool:
    """Whether ``concurrent.futures`` has stopped taking work because the interpreter is exiting."""
    return bool(getattr(concurrent.futures.thread, "_shutdown", False))


def _uploaded(
    images: list[torch.Tensor | None], device: torch.device, stream: torch.cuda.Stream
) -> list[torch.Tensor | None]:
    """The images copied to ``device`` on ``stream``, one by one from their own (pageable) memory.

    Each copy makes the host wait for it, which is short next to Pillow's decode, and holds no pinned
    memory afterwards (torch keeps pinned blocks for the process's life; these are the first batches).
    """
    with torch.cuda.stream(stream):
        return [None if image is None else image.to(device) for image in images]
