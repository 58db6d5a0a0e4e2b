"""GPU decoding with nvImageCodec: a small pool of Decoders per device, each called by one thread at a time.

Why one thread per Decoder: with nvImageCodec 0.9.0, two threads calling ``decode()`` on one Decoder
at once crashed the process (segmentation fault, nvjpeg "execution failed"). Separate Decoders on one
device decode at the same time safely, and two of them decode more images per second than one
(docs/design.md, "Decoder engines"). So a reader thread leases a Decoder from its device's pool for each
call; everything else (parsing headers, allocating outputs, post-processing, the CPU fallback) runs in
the reader threads in parallel. ``decode()`` releases the GIL, so the other threads keep working while
one decodes.

Outputs are decoded straight into torch-allocated memory on the calling thread's stream: the batch
tensor is allocated first, each slice is wrapped with ``nvimgcodec.as_image`` on that same stream (a
different stream would make nvImageCodec synchronize the host), and passed as ``images=``.

The process-wide state (Decoder pools, allocation streams, region verdicts) is one
:class:`DecoderRegistry`. A batch goes through phases that each return what the next one takes:
parse and classify, allocate, decode on leased Decoders, retry failed regions whole, fall back to Pillow.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from types import ModuleType
from typing import Any

import numpy as np
import torch

from .._stats import StatsRecorder
from ._jpeg import exif_orientation, has_end_marker, may_swap_sides, normalize_gray_sampling
from .base import DEFAULT_MAX_PIXELS, DecodedBatch, Encoded, ImageDecoder, RegionOf, pixel_limit_error
from .pillow import decode_rgb

__all__ = [
    "BACKENDS",
    "DEFAULT_GPU_DECODERS",
    "HARDWARE_SHARE",
    "REGION_BACKEND",
    "REGION_DECODE_ENV",
    "SHARED",
    "DecoderRegistry",
    "NvImageCodecDecoder",
    "check_gpu_decoders",
    "import_nvimgcodec",
    "new_nvimgcodec_decoder",
]

#: Accepted ``backend=`` values and the nvImageCodec backend kinds they allow.
BACKENDS = {
    "auto": None,  # all backends, nvImageCodec's own choice per image
    "hardware": ("HW_GPU_ONLY",),  # the GPU's JPEG engine (A100, H100, H200...)
    "cuda": ("GPU_ONLY",),  # CUDA kernels
    "hybrid": ("HYBRID_CPU_GPU",),  # Huffman on the CPU, the rest on the GPU
    "cpu": ("CPU_ONLY",),
    # the JPEG engine takes a share of each batch and the CUDA and hybrid decoders the rest, at once
    "split": ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"),
}

#: Share of each batch the JPEG engine takes under ``backend="split"``: DALI's ``hw_decoder_load`` default.
HARDWARE_SHARE = 0.65

#: Decoders per device and configuration that reader threads decode on at once, by default: the count
#: measured fastest on an H200 (docs/design.md, "Decoder engines"). More Decoders cost device memory.
DEFAULT_GPU_DECODERS = 2

#: The backend that decodes regions under ``backend="auto"`` and ``"split"``: with nvImageCodec 0.9.0 the
#: only one faster on regions than on whole images (docs/benchmarks.md has the measurements).
REGION_BACKEND = "hybrid"

#: Fewest regions in a decoder call for its failures to turn region decoding off (see _regions_failed).
_REGIONS_TO_JUDGE = 8

#: Set to 0 to decode whole images and crop afterwards, should region decoding misbehave on a GPU
#: (nvImageCodec issue #55 reports failures and crashes of region decoding on some GPUs with 0.9.0);
#: read by the front ends when they are built, as the default of their ``region_decode=``.
REGION_DECODE_ENV = "THREADLOADER_REGION_DECODE"

logger = logging.getLogger("threadloader")

#: ``(device index, backend, CPU threads)``: what a Decoder is made for, and what region verdicts are about.
DecoderKey = tuple[int, str, int]


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


def new_nvimgcodec_decoder(device_index: int, backend: str, cpu_threads: int) -> Any:
    """A new nvImageCodec Decoder on the device, limited to ``backend``'s kinds (see :data:`BACKENDS`)."""
    nvimgcodec = import_nvimgcodec()
    kinds = BACKENDS[backend]
    backends = None if kinds is None else [nvimgcodec.Backend(getattr(nvimgcodec, k)) for k in kinds]
    if backends and backend == "split":  # the first backend's load hint is its share; the rest: the others
        backends[0] = nvimgcodec.Backend(
            nvimgcodec.HW_GPU_ONLY, load_hint=HARDWARE_SHARE, load_hint_policy=nvimgcodec.LoadHintPolicy.FIXED
        )
    with torch.cuda.device(device_index):
        return nvimgcodec.Decoder(device_id=device_index, max_num_cpu_threads=cpu_threads, backends=backends)


def check_gpu_decoders(count: object) -> None:
    """Raises for a ``gpu_decoders`` that is not a positive int."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"gpu_decoders must be an int of at least 1, got {count!r}")


class DecoderRegistry:
    """Process-wide nvImageCodec state: Decoder pools, allocation streams, region verdicts.

    Decoders are leased: a thread holds one for a call and returns it, so no two calls into one Decoder
    run at once, whichever loader or service makes them, while different Decoders decode in parallel.
    A pool makes Decoders only when every one it has is busy, up to the limit its caller gives: a single
    reader thread never costs the memory of a second Decoder. The library uses one registry,
    :data:`SHARED`; another (with its own pools) is for tests, which pass it to
    :class:`NvImageCodecDecoder` to decode with Decoders of their own making.

    Args:
        new_decoder: Makes a Decoder for ``(device index, backend, CPU threads)``.
    """

    def __init__(self, new_decoder: Callable[[int, str, int], Any] = new_nvimgcodec_decoder) -> None:
        self._new_decoder = new_decoder
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._idle: dict[DecoderKey, list[Any]] = {}
        self._made: dict[DecoderKey, int] = {}
        self._region_verdicts: dict[DecoderKey, bool] = {}
        self._allocation_streams: dict[int, torch.cuda.Stream] = {}

    def acquire(self, key: DecoderKey, limit: int) -> Any:
        """A Decoder for ``key`` that no other thread calls until :meth:`release`.

        An idle one if there is one; else a new one while fewer than ``limit`` exist for ``key``; else
        waits for one to be released (every holder releases it when its call returns).
        """
        if limit < 1:
            raise ValueError(f"a Decoder pool needs a limit of at least 1, got {limit}")
        with self._returned:
            idle = self._idle.setdefault(key, [])
            while not idle and self._made.get(key, 0) >= limit:
                self._returned.wait()
            if idle:
                return idle.pop()  # the most recently used: others stay idle, and unmade under light load
            self._made[key] = self._made.get(key, 0) + 1
        try:
            return self._new_decoder(*key)  # outside the lock: making one takes a while
        except BaseException:
            with self._returned:
                self._made[key] -= 1
                self._returned.notify()
            raise

    def release(self, key: DecoderKey, decoder: Any) -> None:
        """Returns a Decoder from :meth:`acquire` to its pool."""
        with self._returned:
            self._idle[key].append(decoder)
            self._returned.notify()

    @contextmanager
    def lease(self, key: DecoderKey, limit: int) -> Iterator[Any]:
        """:meth:`acquire` and :meth:`release` around a block."""
        decoder = self.acquire(key, limit)
        try:
            yield decoder
        finally:
            self.release(key, decoder)

    def made(self, key: DecoderKey) -> int:
        """How many Decoders exist for ``key``."""
        with self._lock:
            return self._made.get(key, 0)

    def regions_work(self, key: DecoderKey, check: Callable[[], bool]) -> bool:
        """Whether region decoding works for ``key``: the verdict, or ``check()``'s on first asking.

        ``check`` runs outside the registry's lock (it decodes); two threads may both run it, and the
        first verdict stored stands.
        """
        with self._lock:
            works = self._region_verdicts.get(key)
        if works is None:
            checked = check()
            with self._lock:
                works = self._region_verdicts.setdefault(key, checked)
        return works

    def stop_regions(self, key: DecoderKey) -> bool:
        """Turns region decoding off for ``key``; whether this call did (it was not off already)."""
        with self._lock:
            if self._region_verdicts.get(key) is False:
                return False
            self._region_verdicts[key] = False
        return True

    def allocation_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The device's stream that decode outputs are allocated on (see ``_output_memory``)."""
        with self._lock:
            stream = self._allocation_streams.get(device.index)
            if stream is None:
                stream = self._allocation_streams[device.index] = torch.cuda.Stream(device)
        return stream


#: The registry every decoder of the library shares.
SHARED = DecoderRegistry()


@dataclass
class _Parsed:
    """The header pass over a batch: what each position is decoded as, or why not on the GPU."""

    code_streams: dict[int, Any] = field(default_factory=dict)  # to decode on the GPU, in position order
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)  # of each output (a region's own)
    regions: set[int] = field(default_factory=set)  # positions decoded as their region
    wholes: dict[int, tuple[Any, tuple[int, int]]] = field(default_factory=dict)  # regions' whole images
    errors: dict[int, str] = field(default_factory=dict)  # over the pixel limit: nobody decodes them
    to_cpu: dict[int, str] = field(default_factory=dict)  # for Pillow, with the reason
    # Whole images that may come out with height and width swapped, which a padded slot cannot hold: a
    # JPEG whose EXIF says so or cannot be read, or another format (its orientation is not checked).
    # Only their results' shapes are read back: each read is a GIL round trip into nvImageCodec.
    may_swap: set[int] = field(default_factory=set)
    rewritten: list[Encoded] = field(default_factory=list)  # keeps rewritten bitstreams alive until decoded


@dataclass
class _Outputs:
    """Decode memory for a batch: a slot per position, and the batch tensor the slots are rows of."""

    slots: dict[int, torch.Tensor]
    stacked: torch.Tensor | None = None
    padded: torch.Tensor | None = None


@dataclass
class _Decoded:
    """Decoder calls' results: pixels (``None`` where given up on) and, for those, why."""

    images: dict[int, torch.Tensor | None] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)


class NvImageCodecDecoder(ImageDecoder):
    """Decodes batches on one GPU through the shared pool of nvImageCodec Decoders.

    Samples nvImageCodec cannot parse or returns ``None`` for are decoded with Pillow and uploaded, so
    they count as errors only when Pillow fails too.

    Args:
        device: An indexed CUDA device.
        backend: One of :data:`BACKENDS`.
        cpu_threads: nvImageCodec's own CPU threads.
        max_pixels: Images whose header declares more pixels are errors, decoded by nobody.
        region_decode: Decode the region a random crop asks for instead of the whole image (where the
            device passes the region check).
        gpu_decoders: Most Decoders this decoder makes for its configuration (device, backend, CPU
            threads), each called by one thread at a time. The pool is process-wide: decoders of one
            configuration share it, and regions have a pool of their own.
        registry: Where Decoders and region verdicts come from: the process's, unless a test brings
            its own.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        backend: str = "auto",
        cpu_threads: int,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        region_decode: bool = True,
        gpu_decoders: int = DEFAULT_GPU_DECODERS,
        registry: DecoderRegistry = SHARED,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"NvImageCodecDecoder needs an indexed CUDA device, got {device}")
        check_gpu_decoders(gpu_decoders)
        self._nvimgcodec = import_nvimgcodec()
        self.device = device
        self._max_pixels = max_pixels
        self._region_decode = region_decode
        self.pads = True
        self._registry = registry
        self._gpu_decoders = gpu_decoders
        self._key = (device.index, backend, cpu_threads)
        # Made now, not by the first reader: a Decoder that cannot be made fails the constructor.
        registry.release(self._key, registry.acquire(self._key, gpu_decoders))
        region_backend = REGION_BACKEND if backend in ("auto", "split") else backend
        self._region_key = (device.index, region_backend, cpu_threads)
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
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        """Decodes a batch on ``stream``; see :meth:`ImageDecoder.decode`.

        JPEGs are decoded as the region ``region_of`` asks for, when region decoding passed its check
        on this device; a region that fails is decoded whole (on the GPU, else by Pillow) and not
        reported in ``regions``, so the caller crops it. With ``pad``, whole images of different sizes
        are decoded into one padded tensor where it costs at most :data:`_PAD_MEMORY` times the memory
        of the images themselves.
        """
        if stream is None:
            raise ValueError("NvImageCodecDecoder.decode needs the calling thread's CUDA stream")
        regions = region_of is not None and self._regions_work()
        with torch.cuda.stream(stream):
            return self._decode_on(stream, encoded, stats, region_of if regions else None, pad)

    def _regions_work(self) -> bool:
        """Whether to decode regions: region decoding is on, and passed its check on this device."""
        return self._region_decode and self._registry.regions_work(self._region_key, self._check_regions)

    def _check_regions(self) -> bool:
        """Decodes a region of a bundled photo and compares it with the same crop of the whole image.

        Once per device and backend, before the first region: a GPU where region decoding gives wrong
        pixels or fails (nvImageCodec issue #55) then decodes whole images, with a warning.
        """
        nv = self._nvimgcodec
        data = (resources.files("threadloader") / "_sample" / "astronaut.jpg").read_bytes()
        top, left, height, width = 37, 51, 101, 143
        # Leased outside the check: a Decoder that cannot be made is an error, not a verdict on regions.
        with (
            self._registry.lease(self._region_key, self._gpu_decoders) as decoder,
            torch.cuda.device(self.device),
        ):
            try:
                whole = decoder.decode(nv.CodeStream(data), params=self._params)
                part = decoder.decode(
                    nv.CodeStream(data).get_sub_code_stream(
                        region=nv.Region(top, left, top + height, left + width)
                    ),
                    params=self._params,
                )
                expected = torch.as_tensor(whole, device=self.device)[top : top + height, left : left + width]
                got = torch.as_tensor(part, device=self.device)
                same = (
                    got.shape == expected.shape
                    and float((got.float() - expected.float()).abs().mean()) <= 1.0
                )
                reason = "" if same else f"a {tuple(got.shape)} region differed from the crop"
            except Exception as exc:
                same, reason = False, f"{type(exc).__name__}: {exc}"
        if not same:
            logger.warning(
                "region decoding does not work on %s (%s); decoding whole images and cropping instead",
                self.device,
                reason,
            )
        return same

    def _decode_on(
        self,
        stream: torch.cuda.Stream,
        encoded: Sequence[Encoded],
        stats: StatsRecorder,
        region_of: RegionOf | None,
        pad: bool,
    ) -> DecodedBatch:
        """The phases: parse and classify, allocate, decode on leased Decoders, retry regions, fall back."""
        nv = self._nvimgcodec
        with stats.timed("parse"):
            parsed = self._parse(encoded, region_of)
            pad_wholes = pad and not parsed.regions and not parsed.may_swap
            outputs = self._allocate(parsed.shapes, parsed.regions, len(encoded), pad_wholes)
            positions = list(parsed.code_streams)
            handle = stream.cuda_stream
            # torch's own __cuda_array_interface__ costs far more per tensor than a plain description.
            wrapped = nv.as_images([_DeviceBuffer(outputs.slots[p]) for p in positions], cuda_stream=handle)

        calls = [
            (key, [p for p in positions if (p in parsed.regions) == is_region])
            for key, is_region in ((self._key, False), (self._region_key, True))
        ]
        wrapped_of = dict(zip(positions, wrapped, strict=True))
        decoded = self._decode_leased(
            [(key, chosen, [wrapped_of[p] for p in chosen]) for key, chosen in calls if chosen],
            parsed.code_streams,
            outputs.slots,
            parsed.may_swap,
            handle,
            stats,
        )
        images = dict(decoded.images)
        reasons = {**parsed.to_cpu, **decoded.reasons}
        slots = outputs.slots
        regions = set(parsed.regions)
        failed = [p for p in sorted(regions) if images[p] is None]
        if failed:  # regions the GPU gave up on: decode those images whole on the GPU, crop after
            whole_slots, retried = self._retry_regions(failed, parsed.wholes, handle, stats)
            slots = {**slots, **whole_slots}  # for Pillow, should the GPU fail again
            reasons = {p: reason for p, reason in reasons.items() if p not in failed}
            reasons.update(retried.reasons)
            images.update(retried.images)
            # Only failures whose whole image decoded count against region decoding: not bad files.
            self._regions_failed(sum(images[p] is not None for p in failed), len(regions))
            regions.difference_update(failed)
        errors = dict(parsed.errors)
        if reasons:
            with stats.timed("fallback"):
                on_cpu, cpu_errors = self._decode_on_cpu(encoded, reasons, slots, stats)
            images.update(on_cpu)
            errors.update(cpu_errors)
            regions.difference_update(reasons)  # Pillow decodes the whole image: the caller crops it
        if regions:
            stats.count("region_decodes", len(regions))
        # Which images are their slots: a row of ``stacked``, or the top left of a ``padded`` row.
        in_slots = {p for p, slot in outputs.slots.items() if images.get(p) is slot}
        return DecodedBatch(
            images=[images.get(p) for p in range(len(encoded))],
            errors=errors,
            stacked=outputs.stacked if len(in_slots) == len(encoded) else None,
            regions=regions,
            padded=outputs.padded,
            padded_rows=(regions if parsed.regions else in_slots) if outputs.padded is not None else set(),
        )

    def _parse(self, encoded: Sequence[Encoded], region_of: RegionOf | None) -> _Parsed:
        """Reads each header: over the pixel limit, for Pillow, or the code stream (or region) to decode.

        Also which whole images may come out with their sides swapped (``may_swap``).
        """
        nv = self._nvimgcodec
        parsed = _Parsed()
        for position, data in enumerate(encoded):
            try:
                code_stream = _code_stream(nv, data)
            except Exception as exc:  # unparsable here: Pillow gets a try
                parsed.to_cpu[position] = f"nvImageCodec cannot parse it ({exc})"
                continue
            # Each property read crosses into nvImageCodec: read once (the loop runs per image).
            height, width, codec = code_stream.height, code_stream.width, code_stream.codec_name
            limit = pixel_limit_error(width, height, self._max_pixels)
            if limit is not None:
                parsed.errors[position] = limit
                continue
            cpu_reason = _cpu_reason(nv, code_stream, codec, data)
            if cpu_reason is not None:
                parsed.to_cpu[position] = cpu_reason
                continue
            if codec == "jpeg" and code_stream.num_channels == 1:
                fixed = normalize_gray_sampling(data)
                if fixed is not data:
                    parsed.rewritten.append(fixed)
                    code_stream = _code_stream(nv, fixed)
            region = None
            if region_of is not None and codec == "jpeg":
                region = _region((height, width), data, position, region_of)
            if region is None and (codec != "jpeg" or may_swap_sides(data)):
                parsed.may_swap.add(position)
            if region is None:
                parsed.shapes[position] = (height, width)
            else:
                parsed.wholes[position] = (code_stream, (height, width))
                top, left, height, width = region
                code_stream = code_stream.get_sub_code_stream(
                    region=nv.Region(top, left, top + height, left + width)
                )
                parsed.shapes[position] = (height, width)
                parsed.regions.add(position)
            parsed.code_streams[position] = code_stream
        return parsed

    def _decode_leased(
        self,
        calls: list[tuple[DecoderKey, list[int], list[Any]]],
        code_streams: dict[int, Any],
        slots: dict[int, torch.Tensor],
        may_swap: set[int],
        handle: int,
        stats: StatsRecorder,
    ) -> _Decoded:
        """Calls a leased Decoder of each configuration with its positions and outputs.

        A sample a Decoder gives up on gets ``None`` and a reason, for Pillow. Only the positions in
        ``may_swap`` can come out in another shape than their slot's, so only their shapes are read. The
        time spent waiting for a free Decoder is the ``decode_lock`` stage.
        """
        decoded = _Decoded()
        for key, positions, outputs in calls:
            with stats.timed("decode_lock"):
                decoder = self._registry.acquire(key, self._gpu_decoders)
            try:
                try:
                    with stats.timed("decode"):
                        results = decoder.decode(
                            [code_streams[p] for p in positions],
                            images=outputs,
                            params=self._params,
                            cuda_stream=handle,
                        )
                except Exception as exc:  # the whole call failed: each sample to Pillow
                    results = [None] * len(positions)
                    decoded.reasons.update(dict.fromkeys(positions, f"nvImageCodec failed ({exc})"))
                for position, result in zip(positions, results, strict=True):
                    pixels: torch.Tensor | None = slots[position]
                    if result is None or position in may_swap:
                        pixels = _pixels_in(result, slots[position])
                    if pixels is None:
                        decoded.reasons.setdefault(position, "nvImageCodec returned no image")
                    decoded.images[position] = pixels
            finally:
                self._registry.release(key, decoder)
        return decoded

    def _retry_regions(
        self,
        failed: list[int],
        wholes: dict[int, tuple[Any, tuple[int, int]]],
        handle: int,
        stats: StatsRecorder,
    ) -> tuple[dict[int, torch.Tensor], _Decoded]:
        """Decodes the whole images of the regions the GPU gave up on; their slots and the results."""
        whole_slots = self._flat_slots({p: wholes[p][1] for p in failed})
        nv = self._nvimgcodec
        retry = nv.as_images([_DeviceBuffer(whole_slots[p]) for p in failed], cuda_stream=handle)
        decoded = self._decode_leased(
            [(self._key, failed, retry)],
            {p: wholes[p][0] for p in failed},
            whole_slots,
            set(failed),  # whole images now: their EXIF was not checked for it
            handle,
            stats,
        )
        return whole_slots, decoded

    def _regions_failed(self, failed: int, total: int) -> None:
        """Stops region decoding on this device once most regions of a call fail (issue #55's kind).

        ``failed`` counts regions that failed where the whole image decoded; a call of fewer than
        :data:`_REGIONS_TO_JUDGE` regions is not judged, so one odd file in a small batch is not taken
        for a broken decoder.
        """
        if total < _REGIONS_TO_JUDGE or failed * 2 <= total:
            return
        if not self._registry.stop_regions(self._region_key):
            return
        logger.warning(
            "region decoding failed for %d of %d images on %s; decoding whole images and cropping "
            "from now on (pass region_decode=False, or set %s=0, to skip region decoding altogether)",
            failed,
            total,
            self.device,
            REGION_DECODE_ENV,
        )

    def _allocate(
        self, shapes: dict[int, tuple[int, int]], regions: set[int], count: int, pad: bool
    ) -> _Outputs:
        """Allocates outputs with one allocation per batch.

        Rows of a ``(B, H, W, 3)`` tensor when all shapes agree: every row is returned, so a CPU
        fallback of that shape fills its own. Regions of different sizes, and with ``pad`` whole images
        of different sizes where padding costs at most :data:`_PAD_MEMORY` times their own memory, go
        to the top-left corners of a padded ``(B, Hmax, Wmax, 3)`` tensor, which the resize then reads
        as one batch without copying each image (``threadloader._regions`` has that contract for
        regions). Other images of different sizes: views into one flat buffer.
        """
        if not shapes:
            return _Outputs({})
        if len(set(shapes.values())) == 1:
            height, width = next(iter(shapes.values()))
            stacked = self._output_memory((count, height, width, 3))
            return _Outputs(dict(enumerate(stacked.unbind(0))), stacked=stacked)
        height = max(h for h, _ in shapes.values())
        width = max(w for _, w in shapes.values())
        own = sum(h * w for h, w in shapes.values())
        if (regions and len(regions) == len(shapes)) or (pad and count * height * width <= _PAD_MEMORY * own):
            padded = self._output_memory((count, height, width, 3))
            # as_strided: cheaper on the host than an indexing view, and it runs once per image
            strides, start = (width * 3, 3, 1), padded.storage_offset()
            slots = {
                p: padded.as_strided((h, w, 3), strides, start + p * height * width * 3)
                for p, (h, w) in shapes.items()
            }
            return _Outputs(slots, padded=padded)
        return _Outputs(self._flat_slots(shapes))

    def _flat_slots(self, shapes: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
        """Contiguous ``(H, W, 3)`` views into one allocation, one per position."""
        sizes = [h * w * 3 for h, w in shapes.values()]
        flat = self._output_memory((sum(sizes),))
        return {
            p: chunk.view(h, w, 3)
            for (p, (h, w)), chunk in zip(shapes.items(), flat.split(sizes), strict=True)
        }

    def _output_memory(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Memory for nvImageCodec to decode into, never memory that queued work may still read.

        nvImageCodec does not always wait for work queued earlier on ``cuda_stream`` before it writes
        into ``images=`` (docs/design.md, "Decode memory that no queued work still reads"). Memory
        allocated on the calling stream can be an earlier group's, freed while that stream still has
        work reading it. So it is allocated from a stream that runs nothing and marked as used by the
        calling stream: torch's allocator then reuses it only once the calling stream has passed the
        point where it was freed, without a host sync.
        """
        with torch.cuda.stream(self._registry.allocation_stream(self.device)):
            memory = torch.empty(shape, dtype=torch.uint8, device=self.device)
        memory.record_stream(torch.cuda.current_stream(self.device))
        return memory

    def _decode_on_cpu(
        self,
        encoded: Sequence[Encoded],
        reasons: dict[int, str],
        slots: dict[int, torch.Tensor],
        stats: StatsRecorder,
    ) -> tuple[dict[int, torch.Tensor], dict[int, str]]:
        """Decodes the samples the GPU gave up on with Pillow, uploading into their slots where they fit.

        Returns:
            The pixels of those Pillow decoded, and the errors of those it could not.
        """
        images: dict[int, torch.Tensor] = {}
        errors: dict[int, str] = {}
        for position, reason in reasons.items():
            try:
                pixels = torch.from_numpy(decode_rgb(encoded[position], max_pixels=self._max_pixels))
            except Exception as exc:
                errors[position] = f"{reason}; Pillow: {type(exc).__name__}: {exc}"
                continue
            slot = slots.get(position)
            if slot is not None and slot.shape == pixels.shape:
                images[position] = slot.copy_(pixels)
            else:
                images[position] = pixels.to(self.device)
            stats.count("cpu_fallbacks")
        return images, errors


class _DeviceBuffer:
    """An ``(H, W, 3)`` uint8 CUDA buffer described by ``__cuda_array_interface__`` (version 3).

    Rows may be padded (a region in a padded batch): nvImageCodec writes to strided outputs (checked
    on an H200: identical to its own allocations).

    The tensor it describes is kept alive by the batch, not by this object, until the decode is done.
    """

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "strides": None if tensor.is_contiguous() else tuple(tensor.stride()),  # uint8: bytes
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
    if not buffer.is_contiguous():  # a padded region slot: nothing else fits in it
        return None
    interface = output.__cuda_array_interface__
    contiguous = interface.get("strides") is None or tuple(interface["strides"]) == (
        shape[1] * shape[2],
        shape[2],
        1,
    )
    if interface["data"][0] == buffer.data_ptr() and contiguous and np.prod(shape) == buffer.numel():
        return buffer.view(shape)
    return None


#: Most memory a padded batch of whole images may take, as a multiple of the images' own: beyond it,
#: images of very different sizes are decoded into a flat buffer and resized one by one.
_PAD_MEMORY = 2.5

#: Formats decoded on the GPU when they are plain 8-bit RGB; everything else goes to Pillow.
_GPU_FORMATS = frozenset(["jpeg", "jpeg2k", "png", "bmp", "tiff", "webp"])


def _cpu_reason(nvimgcodec: ModuleType, code_stream: Any, codec: str, data: Encoded) -> str | None:
    """Why a sample should be decoded by Pillow instead, or ``None`` to decode it on the GPU.

    The GPU path takes what was checked against Pillow on the GPU: JPEG (grayscale, RGB, CMYK) with
    its end marker, and the other formats as 8-bit RGB. Alpha, palettes and 16-bit samples go to
    Pillow, which gives them the documented contract (alpha dropped, high byte kept).
    """
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


def _region(
    stored: tuple[int, int], data: Encoded, position: int, region_of: RegionOf
) -> tuple[int, int, int, int] | None:
    """The part of a JPEG of ``stored`` (height, width) to decode, asked with the size as displayed.

    Regions are in the displayed frame (measured: with every EXIF orientation nvImageCodec crops after
    orienting), so orientations 5-8 swap the stored size. Unreadable EXIF: decode the whole image.
    """
    orientation = exif_orientation(data)
    if orientation is None or min(stored) < 1:  # unsure of the frame; or no size to draw from
        return None
    size = (stored[1], stored[0]) if orientation >= 5 else stored
    region = region_of(position, size)
    if region is None or region == (0, 0, *size):
        return None
    return region


def _code_stream(nvimgcodec: ModuleType, data: Encoded) -> Any:
    """Parses the header; raises for data nvImageCodec does not recognize."""
    code_stream = nvimgcodec.CodeStream(
        data if isinstance(data, bytes) else np.frombuffer(data, dtype=np.uint8)
    )
    _ = code_stream.height  # some formats (GIF) construct but fail on first access: fail here
    return code_stream
