"""GPU decoding with nvImageCodec: one Decoder per device and configuration, calls serialized.

Why serialized: with nvImageCodec 0.9.0, two threads calling ``decode()`` on one Decoder at once
crashed the process (segmentation fault, nvjpeg "execution failed"). So every call into a Decoder on
a device holds that device's lock, and everything else (parsing headers, allocating outputs,
post-processing, the CPU fallback) runs in the reader threads in parallel. ``decode()`` releases the
GIL, so the other threads keep working while one decodes.

Outputs are decoded straight into torch-allocated memory on the calling thread's stream: the batch
tensor is allocated first, each slice is wrapped with ``nvimgcodec.as_image`` on that same stream (a
different stream would make nvImageCodec synchronize the host), and passed as ``images=``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from .._stats import StatsRecorder
from ._jpeg import has_end_marker, normalize_gray_sampling
from .base import DEFAULT_MAX_PIXELS, DecodedBatch, Encoded, ImageDecoder, pixel_limit_error
from .pillow import decode_rgb

__all__ = ["BACKENDS", "NvImageCodecDecoder", "import_nvimgcodec"]

#: Accepted ``backend=`` values and the nvImageCodec backend kinds they allow.
BACKENDS = {
    "auto": None,  # all backends, nvImageCodec's own choice per image
    "hardware": ("HW_GPU_ONLY",),  # the GPU's JPEG engine (A100, H100, H200...)
    "cuda": ("GPU_ONLY",),  # CUDA kernels
    "hybrid": ("HYBRID_CPU_GPU",),  # Huffman on the CPU, the rest on the GPU
    "cpu": ("CPU_ONLY",),
}

_registry_lock = threading.Lock()
_device_locks: dict[int, threading.Lock] = {}
_decoders: dict[tuple[int, str, int], Any] = {}


def import_nvimgcodec() -> ModuleType:
    """Imports nvImageCodec, or explains how to install it."""
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        raise ImportError(
            "GPU decoding needs nvImageCodec: pip install 'threadloader[cu12]' (CUDA 12) or "
            "'threadloader[cu13]' (CUDA 13), matching your torch build; or pass device='cpu'"
        ) from exc
    return nvimgcodec


def _shared_decoder(device_index: int, backend: str, cpu_threads: int) -> tuple[Any, threading.Lock]:
    """Returns the process-wide Decoder for this configuration and its device's lock.

    One lock per device, shared by every Decoder on it: no two calls into nvImageCodec on one device
    run at once, whichever loader or service makes them.
    """
    nvimgcodec = import_nvimgcodec()
    key = (device_index, backend, cpu_threads)
    with _registry_lock:
        lock = _device_locks.setdefault(device_index, threading.Lock())
        decoder = _decoders.get(key)
        if decoder is None:
            kinds = BACKENDS[backend]
            backends = None if kinds is None else [nvimgcodec.Backend(getattr(nvimgcodec, k)) for k in kinds]
            with torch.cuda.device(device_index):
                decoder = nvimgcodec.Decoder(
                    device_id=device_index, max_num_cpu_threads=cpu_threads, backends=backends
                )
            _decoders[key] = decoder
    return decoder, lock


class NvImageCodecDecoder(ImageDecoder):
    """Decodes batches on one GPU through the shared nvImageCodec Decoder.

    Samples nvImageCodec cannot parse or returns ``None`` for are decoded with Pillow and uploaded, so
    they count as errors only when Pillow fails too.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        backend: str = "auto",
        cpu_threads: int,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"NvImageCodecDecoder needs an indexed CUDA device, got {device}")
        self._nvimgcodec = import_nvimgcodec()
        self.device = device
        self._max_pixels = max_pixels
        self._decoder, self._lock = _shared_decoder(device.index, backend, cpu_threads)
        nv = self._nvimgcodec
        self._params = nv.DecodeParams(
            apply_exif_orientation=True, color_spec=nv.SRGB, sample_format=nv.I_RGB
        )

    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StatsRecorder,
    ) -> DecodedBatch:
        """Decodes a batch on ``stream``; see :meth:`ImageDecoder.decode`."""
        if stream is None:
            raise ValueError("NvImageCodecDecoder.decode needs the calling thread's CUDA stream")
        with torch.cuda.stream(stream):
            return self._decode_on(stream, encoded, stats)

    def _decode_on(
        self, stream: torch.cuda.Stream, encoded: Sequence[Encoded], stats: StatsRecorder
    ) -> DecodedBatch:
        nv = self._nvimgcodec
        batch = DecodedBatch(images=[None] * len(encoded))
        reasons: dict[int, str] = {}
        with stats.timed("parse"):
            code_streams: dict[int, Any] = {}
            shapes: dict[int, tuple[int, int]] = {}
            rewritten: list[Encoded] = []  # keeps rewritten bitstreams alive until decoded
            for position, data in enumerate(encoded):
                try:
                    code_stream = _code_stream(nv, data)
                except Exception as exc:  # unparsable here: Pillow gets a try
                    reasons[position] = f"nvImageCodec cannot parse it ({exc})"
                    continue
                limit = pixel_limit_error(code_stream.width, code_stream.height, self._max_pixels)
                if limit is not None:
                    batch.errors[position] = limit
                    continue
                cpu_reason = _cpu_reason(nv, code_stream, data)
                if cpu_reason is not None:
                    reasons[position] = cpu_reason
                    continue
                if code_stream.num_channels == 1 and code_stream.codec_name == "jpeg":
                    fixed = normalize_gray_sampling(data)
                    if fixed is not data:
                        rewritten.append(fixed)
                        code_stream = _code_stream(nv, fixed)
                shapes[position] = (code_stream.height, code_stream.width)
                code_streams[position] = code_stream
            slots = self._allocate(batch, shapes, len(encoded))
            positions = list(code_streams)
            handle = stream.cuda_stream
            # torch's own __cuda_array_interface__ costs ~20 us a tensor; a plain description costs ~1.
            outputs = nv.as_images([_DeviceBuffer(slots[p]) for p in positions], cuda_stream=handle)

        if positions:
            with stats.timed("decode_lock"):
                self._lock.acquire()
            try:
                with stats.timed("decode"):
                    sources = [code_streams[p] for p in positions]
                    results = self._decoder.decode(
                        sources, images=outputs, params=self._params, cuda_stream=handle
                    )
            except Exception as exc:  # the whole call failed: each sample to Pillow
                results = [None] * len(positions)
                reasons.update(dict.fromkeys(positions, f"nvImageCodec failed ({exc})"))
            finally:
                self._lock.release()
            for position, result in zip(positions, results, strict=True):
                pixels = _pixels_in(result, slots[position])
                if pixels is None:
                    reasons.setdefault(position, "nvImageCodec returned no image")
                batch.images[position] = pixels
        if reasons:
            with stats.timed("fallback"):
                self._decode_on_cpu(encoded, reasons, batch, slots, stats)
        if batch.stacked is not None and not all(
            image is not None and image.data_ptr() == row.data_ptr() and image.shape == row.shape
            for image, row in zip(batch.images, batch.stacked, strict=True)
        ):
            batch.stacked = None
        return batch

    def _allocate(
        self, batch: DecodedBatch, shapes: dict[int, tuple[int, int]], count: int
    ) -> dict[int, torch.Tensor]:
        """Allocates outputs with one allocation per batch.

        Rows of a ``(B, H, W, 3)`` tensor when all shapes agree, else views into one flat buffer.
        Every row of the batch tensor is returned, so a CPU fallback of the same shape fills its own.
        """
        if not shapes:
            return {}
        if len(set(shapes.values())) == 1:
            height, width = next(iter(shapes.values()))
            batch.stacked = torch.empty((count, height, width, 3), dtype=torch.uint8, device=self.device)
            return dict(enumerate(batch.stacked.unbind(0)))
        sizes = [h * w * 3 for h, w in shapes.values()]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        return {
            p: chunk.view(h, w, 3)
            for (p, (h, w)), chunk in zip(shapes.items(), flat.split(sizes), strict=True)
        }

    def _decode_on_cpu(
        self,
        encoded: Sequence[Encoded],
        reasons: dict[int, str],
        batch: DecodedBatch,
        slots: dict[int, torch.Tensor],
        stats: StatsRecorder,
    ) -> None:
        """Decodes the samples the GPU gave up on with Pillow, uploading into their slots where they fit."""
        for position, reason in reasons.items():
            try:
                pixels = torch.from_numpy(decode_rgb(encoded[position], max_pixels=self._max_pixels))
            except Exception as exc:
                batch.errors[position] = f"{reason}; Pillow: {type(exc).__name__}: {exc}"
                continue
            slot = slots.get(position)
            if slot is not None and slot.shape == pixels.shape:
                batch.images[position] = slot.copy_(pixels)
            else:
                batch.images[position] = pixels.to(self.device)
            stats.count("cpu_fallbacks")


class _DeviceBuffer:
    """An ``(H, W, 3)`` uint8 CUDA buffer described by ``__cuda_array_interface__`` (version 3).

    The tensor it describes is kept alive by the batch, not by this object, until the decode is done.
    """

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "strides": None,
            "stream": None,  # ordering is given by as_images(cuda_stream=...) and decode's stream
            "version": 3,
        }


def _pixels_in(output: Any, buffer: torch.Tensor) -> torch.Tensor | None:
    """Returns the decoded pixels that ``output`` wrote into ``buffer``, as a view of it.

    nvImageCodec reports the shape it produced, which differs from the header's when EXIF orientation
    swaps height and width; it then writes a contiguous image of that shape into the same memory.
    """
    if output is None:
        return None
    shape = tuple(output.shape)
    if shape == tuple(buffer.shape):
        return buffer
    interface = output.__cuda_array_interface__
    contiguous = interface.get("strides") is None or tuple(interface["strides"]) == (
        shape[1] * shape[2],
        shape[2],
        1,
    )
    if interface["data"][0] == buffer.data_ptr() and contiguous and np.prod(shape) == buffer.numel():
        return buffer.view(shape)
    return None


#: Formats decoded on the GPU when they are plain 8-bit RGB; everything else goes to Pillow.
_GPU_FORMATS = frozenset(["jpeg", "jpeg2k", "png", "bmp", "tiff", "webp"])


def _cpu_reason(nvimgcodec: ModuleType, code_stream: Any, data: Encoded) -> str | None:
    """Why a sample should be decoded by Pillow instead, or ``None`` to decode it on the GPU.

    The GPU path takes what was checked against Pillow on the GPU: JPEG (grayscale, RGB, CMYK) with
    its end marker, and the other formats as 8-bit RGB. Alpha, palettes and 16-bit samples go to
    Pillow, which gives them the documented contract (alpha dropped, high byte kept).
    """
    codec = code_stream.codec_name
    if codec not in _GPU_FORMATS:
        return f"{codec or 'this'} format is not decoded on the GPU"
    if codec == "jpeg":
        return None if has_end_marker(data) else "the JPEG has no end-of-image marker (truncated?)"
    if code_stream.num_channels != 3 or str(code_stream.dtype) != "uint8":
        return (
            f"{codec} with {code_stream.num_channels} channels of {code_stream.dtype} is decoded on the CPU"
        )
    if code_stream.color_spec == nvimgcodec.ColorSpec.PALETTE:
        return f"palette {codec} is decoded on the CPU"
    return None


def _code_stream(nvimgcodec: ModuleType, data: Encoded) -> Any:
    """Parses the header; raises for data nvImageCodec does not recognize."""
    code_stream = nvimgcodec.CodeStream(
        data if isinstance(data, bytes) else np.frombuffer(data, dtype=np.uint8)
    )
    _ = code_stream.height  # some formats (GIF) construct but fail on first access: fail here
    return code_stream
