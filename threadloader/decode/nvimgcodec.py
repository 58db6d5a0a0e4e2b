"""GPU decoding with nvImageCodec: what each image is decoded as, into which memory, on which Decoder.

A batch goes through phases that each return what the next one takes: read the headers and classify
(over the pixel limit, for Pillow, a region of it, or whole), allocate one output for the batch, decode
on leased Decoders, retry failed regions whole, fall back to Pillow. The talking to nvImageCodec is an
engine's (``_engines.py``): its C API through ctypes by default, which costs a training loop no GIL
hand-off per image, or its Python API where the C API's self-test fails on a device.

Outputs are decoded straight into torch memory on the calling thread's stream, as rows of one batch
tensor where they fit (``DecodedBatch``), so no tensor is made per image: each would cost GIL
hand-offs (docs/design.md, "GIL releases per image").
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from types import ModuleType

import torch

from .._gil import Pacer
from .._regions import Region
from .._stats import StatsRecorder
from ..errors import detached
from . import _capi
from ._engines import (
    BACKENDS,
    CONFIGS,
    HARDWARE_SHARE,
    CApiEngine,
    Engine,
    EngineBatch,
    Headers,
    Memory,
    PythonApiEngine,
    uses_engine,
)
from ._jpeg import has_end_marker, normalize_gray_sampling, with_exif_orientation
from ._pace import Pace, Turn
from ._registry import DecoderKey, DecoderRegistry
from .base import DEFAULT_MAX_PIXELS, DecodedBatch, Encoded, ImageDecoder, RegionOf, pixel_limit_error
from .pillow import decode_rgb

__all__ = [
    "BACKENDS",
    "CAPI_ENV",
    "DEFAULT_GPU_DECODERS",
    "ENGINES",
    "HARDWARE_SHARE",
    "REGION_BACKEND",
    "REGION_DECODE_ENV",
    "SHARED",
    "DecoderRegistry",
    "NvImageCodecDecoder",
    "check_options",
    "engine_named",
    "import_nvimgcodec",
    "new_decoder",
]

#: Decoders per device and configuration that reader threads decode on at once, by default: the count
#: measured fastest on an H200 (docs/design.md, "Decoder engines"). More Decoders cost device memory.
DEFAULT_GPU_DECODERS = 2

#: The configuration that decodes regions where a backend allows several kinds (``"auto"``, ``"all"``,
#: ``"cuda"``, ``"split"``): with nvImageCodec 0.9.0 the only one faster on regions than on whole images
#: (docs/benchmarks.md has the measurements).
REGION_BACKEND = "hybrid"

#: Images per decoder call that a decoder is made for by default: the front ends' GPU decode batch.
DEFAULT_BATCH_SIZE = 64

#: Images a new Decoder whose configuration leaves out the JPEG engine first decodes: enough to
#: initialize its decoders (they do so on first use) before a reader's call is timed for its pace.
_PRIME_IMAGES = 8

#: Fewest regions in a decoder call for its failures to turn region decoding off (see _regions_failed).
_REGIONS_TO_JUDGE = 8

#: Set to 0 to decode whole images and crop afterwards, should region decoding misbehave on a GPU
#: (nvImageCodec issue #55 reports failures and crashes of region decoding on some GPUs with 0.9.0);
#: read by the front ends when they are built, as the default of their ``region_decode=``.
REGION_DECODE_ENV = "THREADLOADER_REGION_DECODE"

#: Set to 0 to decode through nvImageCodec's Python API instead of its C API (read when a decoder is
#: built): the escape hatch, should the binding misbehave where its self-test passed.
CAPI_ENV = "THREADLOADER_CAPI"

#: The engines by name: ``"capi"``, the default where it loads and passes its self-test, and ``"python"``.
ENGINES = ("capi", "python")

logger = logging.getLogger("threadloader")


def import_nvimgcodec() -> ModuleType:
    """Imports nvImageCodec's Python API, or explains how to install it."""
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        raise ImportError(
            "GPU decoding needs nvImageCodec: pip install 'threadloader[cu12]' (CUDA 12) or "
            "'threadloader[cu13]' (CUDA 13), matching your torch build; or pass device='cpu'"
        ) from exc
    return nvimgcodec


@functools.cache
def _python_engine() -> PythonApiEngine:
    return PythonApiEngine(import_nvimgcodec())


@functools.cache
def _capi_engine() -> CApiEngine:
    return CApiEngine(_capi.load())  # raises _capi.Unsupported, the same on every call (not cached)


def engine_named(name: str) -> Engine:
    """The process's engine called ``name`` (one of :data:`ENGINES`).

    Raises:
        _capi.Unsupported: For ``"capi"`` where the C API cannot be used, saying why.
        ImportError: For ``"python"`` without nvImageCodec.
    """
    if name == "capi":
        return _capi_engine()
    if name == "python":
        return _python_engine()
    raise ValueError(f"engine must be one of {ENGINES}, got {name!r}")


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
    decoder = made.new_decoder(device_index, config, cpu_threads, fancy_upsampling)
    try:
        _prime(made, decoder, torch.device("cuda", device_index), batch or _PRIME_IMAGES)
    except Exception:  # the first real call decodes, or falls back, as it would have
        logger.debug("threadloader: priming a new nvImageCodec Decoder failed", exc_info=True)
    return decoder


def _prime(engine: Engine, decoder: object, device: torch.device, count: int) -> None:
    """Decodes ``count`` copies of a bundled photo with ``decoder`` and waits for them.

    In handles of its own (a reader may make a Decoder in the middle of its call), on the allocation
    stream, which nothing else runs on, so the memory freed after is reused by decode outputs.
    """
    data = _sample("chelsea.jpg")
    batch = engine.parse([data] * count, apart=True)
    height, width = batch.headers.heights[0], batch.headers.widths[0]
    stream = SHARED.allocation_stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        memory = torch.empty((count, height, width, 3), dtype=torch.uint8, device=device)
        step = height * width * 3
        places = {p: Memory(memory.data_ptr() + p * step, (height, width), width * 3) for p in range(count)}
        batch.decode(decoder, places, stream.cuda_stream)
        stream.synchronize()  # once per Decoder: the memory is free for the next output


def check_options(*, backend: str, gpu_decoders: object) -> None:
    """Raises for a ``backend`` not in :data:`BACKENDS` or a ``gpu_decoders`` that is not a positive int.

    The one check of both, for this decoder and for a front end on the CPU, where they select nothing
    but a script that passes them should fail the same way it would on a GPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    if isinstance(gpu_decoders, bool) or not isinstance(gpu_decoders, int) or gpu_decoders < 1:
        raise ValueError(f"gpu_decoders must be an int of at least 1, got {gpu_decoders!r}")


#: The registry every decoder of the library shares.
SHARED = DecoderRegistry(new_decoder)

#: Devices on which a decoder of this process has started nvImageCodec (its engine chosen and first
#: Decoder made): later decoders there start in milliseconds, the first in seconds.
_started_on: set[int] = set()
_started_lock = threading.Lock()


@dataclass
class _Parsed:
    """The header pass over a batch: what each position is decoded as, or why not on the GPU."""

    batch: EngineBatch
    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)  # of each output (a region's own)
    regions: set[int] = field(default_factory=set)  # positions decoded as their region
    wholes: dict[int, tuple[int, int]] = field(default_factory=dict)  # regions' whole images, as shown
    errors: dict[int, str] = field(default_factory=dict)  # over the pixel limit: nobody decodes them
    to_cpu: dict[int, str] = field(default_factory=dict)  # for Pillow, with the reason
    rewritten: list[Encoded] = field(default_factory=list)  # keeps rewritten bitstreams alive until decoded


@dataclass
class _Outputs:
    """Decode memory for a batch: one allocation, and where in it each position decodes.

    With ``rows``, ``tensor`` is a ``(B, H, W, 3)`` batch and each position decodes to the top left of
    its row; otherwise it is a flat buffer of images one after the other.
    """

    tensor: torch.Tensor | None = None
    memory: dict[int, Memory] = field(default_factory=dict)
    rows: bool = False

    def view(self, position: int, extent: tuple[int, int] | None = None) -> torch.Tensor:
        """A ``(H, W, 3)`` tensor over the memory of ``position``, shaped ``extent`` (default: its own)."""
        assert self.tensor is not None
        place = self.memory[position]
        height, width = extent or place.shape
        row = place.row_stride if (height, width) == place.shape else width * 3  # a swapped image: dense
        offset = self.tensor.storage_offset() + place.address - self.tensor.data_ptr()
        return self.tensor.as_strided((height, width, 3), (row, 3, 1), offset)


@dataclass(frozen=True)
class _Prepared:
    """What a decoder's first call chose: its engine, its pools' keys by configuration, its regions' pool."""

    engine: Engine
    keys: dict[str, DecoderKey]
    region_key: DecoderKey


@dataclass
class _Decoded:
    """Decoder calls' results: the extent of each position (``None`` where given up on) and why."""

    extents: dict[int, tuple[int, int] | None] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)


class NvImageCodecDecoder(ImageDecoder):
    """Decodes batches on one GPU through the shared pool of nvImageCodec Decoders.

    Samples nvImageCodec cannot parse or gives up on are decoded with Pillow and uploaded, so they
    count as errors only when Pillow fails too.

    Args:
        device: An indexed CUDA device.
        backend: One of :data:`BACKENDS`: ``"auto"`` sends each call to the configuration that has
            been fastest lately (``_pace.py``), the others fix one.
        cpu_threads: nvImageCodec's own CPU threads.
        fancy_upsampling: Smooth JPEG chroma upsampling, as Pillow's; off, nvImageCodec's JPEG engine
            decodes a batch in one call (see ``_engines.decoder_options``).
        max_pixels: Images whose header declares more pixels are errors, decoded by nobody.
        region_decode: Decode the region a random crop asks for instead of the whole image (where the
            device passes the region check).
        gpu_decoders: Most Decoders this decoder makes for each configuration (engine, device, backend,
            CPU threads, upsampling, and for the JPEG engine's the batch size), each called by one
            thread at a time. Pools are process-wide: decoders of one configuration share them, and
            regions have a pool of their own.
        batch_size: The images per call this decoder is mostly given: a Decoder with the JPEG engine
            decodes at most about that many per call on it (nvImageCodec sizes the engine's share from
            a Decoder's first call, which is made with this many).
        engine: ``"capi"`` or ``"python"`` (:data:`ENGINES`); ``None``: the C API, unless
            ``THREADLOADER_CAPI=0`` (read here), where it loads and passes its self-test on the device
            (once per process), else the Python API, with a warning saying why. Chosen, and the first
            Decoder made, on first use (a front end does it in the background when it is built), so
            an nvImageCodec that cannot make a Decoder fails the first batch, not this constructor.
        registry: Where Decoders and verdicts come from: the process's, unless a test brings its own.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        backend: str = "auto",
        cpu_threads: int,
        fancy_upsampling: bool = True,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        region_decode: bool = True,
        gpu_decoders: int = DEFAULT_GPU_DECODERS,
        batch_size: int = DEFAULT_BATCH_SIZE,
        engine: str | None = None,
        registry: DecoderRegistry = SHARED,
    ) -> None:
        check_options(backend=backend, gpu_decoders=gpu_decoders)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int of at least 1, got {batch_size!r}")
        if device.type != "cuda" or device.index is None:
            raise ValueError(f"NvImageCodecDecoder needs an indexed CUDA device, got {device}")
        if engine is not None and engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES} or None, got {engine!r}")
        self.device = device
        self._backend = backend
        self._max_pixels = max_pixels
        self._region_decode = region_decode
        self._registry = registry
        self._gpu_decoders = gpu_decoders
        self._cpu_threads = cpu_threads
        if not isinstance(fancy_upsampling, bool):
            raise TypeError(f"fancy_upsampling must be True or False, got {fancy_upsampling!r}")
        self._fancy_upsampling = fancy_upsampling
        if engine is None:  # the environment is read now, as the rest of the configuration
            engine = "python" if os.environ.get(CAPI_ENV, "1") == "0" else "capi"
        self._wanted = engine
        self._batch_size = batch_size
        configs = BACKENDS[backend]
        self._pace = Pace(configs) if len(configs) > 1 else None
        self._started = threading.Lock()
        self._prepared: _Prepared | None = None

    @property
    def starting(self) -> bool:
        """Whether nvImageCodec has yet to start on this device in this process (the seconds it takes).

        A front end that starts it in the background decodes its first batches with Pillow meanwhile.
        """
        with _started_lock:
            return self.device.index not in _started_on

    @property
    def engine(self) -> str:
        """The engine this decoder decodes with: ``"capi"`` or ``"python"`` (chosen on first use)."""
        return self._start().engine.name

    def _start(self) -> _Prepared:
        """The engine and the pools' keys, chosen by the first call, which also makes the first Decoder.

        Not in the constructor: loading nvImageCodec, its self-test and a Decoder take seconds, which a
        front end spends in the background (``threadloader._warmup``) while its caller sets up the
        rest. Later callers wait for the first; a call that raises leaves the next one to try again.
        """
        prepared = self._prepared  # set once, under the lock, to an immutable tuple: safe to read without it
        if prepared is not None:
            return prepared
        with self._started:
            if self._prepared is None:
                engine = self._choose_engine(self._wanted)
                configs = BACKENDS[self._backend]
                keys = {config: self._pool_key(engine, config) for config in configs}
                first = keys[configs[0]]
                self._registry.release(first, self._registry.acquire(first, self._gpu_decoders))
                # Configurations of several kinds: regions take the one fastest at regions.
                mixed = any(CONFIGS[config] is None or len(CONFIGS[config] or ()) > 1 for config in configs)
                region_key = self._pool_key(engine, REGION_BACKEND if mixed else configs[0])
                self._prepared = _Prepared(engine, keys, region_key)
                with _started_lock:
                    _started_on.add(first[1])
            return self._prepared

    def _pool_key(self, engine: Engine, config: str) -> DecoderKey:
        """The key of the pool of Decoders that ``engine`` makes in ``config`` for this decoder's options."""
        index = self.device.index
        assert index is not None  # a CUDA device's index, set by the constructor
        batch = self._batch_size if uses_engine(config) else 0
        return (engine.name, index, config, self._cpu_threads, self._fancy_upsampling, batch)

    @property
    def _engine(self) -> Engine:
        return self._start().engine

    @property
    def _region_key(self) -> DecoderKey:
        return self._start().region_key

    def _whole_key(self) -> tuple[DecoderKey, Turn | None]:
        """The pool the next call's whole images decode on, and the turn whose pace it tells (``auto``)."""
        keys = self._start().keys
        if self._pace is None:
            return next(iter(keys.values())), None
        turn = self._pace.choose()
        return keys[turn.arm], turn

    def pace(self) -> dict[str, float]:
        """Seconds per image lately of each configuration ``backend="auto"`` chooses between (measured ones).

        Empty for a fixed backend. For diagnostics and benchmarks: the choice itself is automatic.
        """
        return {} if self._pace is None else self._pace.seconds_per_image()

    def _choose_engine(self, wanted: str) -> Engine:
        """The engine asked for: the C API where it works on this device, else the Python API."""
        if wanted == "python":
            return engine_named("python")
        try:
            engine = engine_named("capi")
        except _capi.Unsupported as exc:
            _warn_once(f"nvImageCodec's C API cannot be used here: {exc}")
            return engine_named("python")
        if self._registry.verdict(("capi", self.device.index), lambda: self._capi_works(engine)):
            return engine
        return engine_named("python")

    def _capi_works(self, engine: Engine) -> bool:
        """The C API's self-test on this device, once per process; a failure is said in a warning.

        Decodes a bundled photo with EXIF orientation 6 into memory with guard bytes around it, and
        compares it with Pillow's: a wrong struct layout, a missing orientation or a wrong output size
        shows as a refused call, wrong pixels or a touched guard byte.
        """
        try:
            # The default backend's pool, which the warm-up fills anyway.
            reason = _self_test(
                engine, self._registry, self._pool_key(engine, "cuda"), self._gpu_decoders, self.device
            )
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            _warn_once(f"nvImageCodec's C API failed its self-test on {self.device}: {reason}")
        return reason is None

    def decode(
        self,
        encoded: Sequence[Encoded],
        *,
        stream: torch.cuda.Stream | None,
        stats: StatsRecorder | None = None,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        """Decodes a batch on ``stream``; see :meth:`ImageDecoder.decode`.

        JPEGs are decoded as the region ``region_of`` asks for, when region decoding passed its check
        on this device; a region that fails is decoded whole (on the GPU, else by Pillow) and not
        reported in ``regions``, so the caller crops it. With ``pad``, whole images of different sizes
        are decoded into the rows of one batch where it costs at most :data:`_PAD_MEMORY` times the
        memory of the images themselves.
        """
        if stream is None:
            raise ValueError("NvImageCodecDecoder.decode needs the calling thread's CUDA stream")
        regions = region_of is not None and self._regions_work()
        with torch.cuda.stream(stream):
            return self._decode_on(
                stream, encoded, stats or StatsRecorder(), region_of if regions else None, pad
            )

    def _regions_work(self) -> bool:
        """Whether to decode regions: region decoding is on, and passed its check on this device."""
        return self._region_decode and self._registry.verdict(
            ("regions", *self._region_key), self._check_regions
        )

    def _check_regions(self) -> bool:
        """Decodes a region of a bundled photo and compares it with the same crop of the whole image.

        Once per device and backend, before the first region: a GPU where region decoding gives wrong
        pixels or fails (nvImageCodec issue #55) then decodes whole images, with a warning.
        """
        data = _sample("astronaut.jpg")
        top, left, height, width = 37, 51, 101, 143
        # Leased outside the check: a Decoder that cannot be made is an error, not a verdict on regions.
        with (
            self._registry.lease(self._region_key, self._gpu_decoders) as decoder,
            torch.cuda.device(self.device),
        ):
            try:
                batch = self._engine.parse([data, data])
                whole_size = (batch.headers.heights[0], batch.headers.widths[0])
                if not batch.crop(1, (top, left, height, width)):
                    raise RuntimeError("the region was refused")
                outputs = _Outputs()
                _dense(self.device, {0: whole_size, 1: (height, width)}, outputs)
                stream = torch.cuda.current_stream(self.device)
                extents = batch.decode(decoder, outputs.memory, stream.cuda_stream)
                if extents[0] is None or extents[1] is None:
                    part = "whole image" if extents[0] is None else "region"
                    raise RuntimeError(f"nvImageCodec gave up on the {part}")
                expected = outputs.view(0)[top : top + height, left : left + width]
                difference = float((outputs.view(1).float() - expected.float()).abs().mean())
                same = difference <= 1.0
                reason = "" if same else f"the region differed from the crop by {difference:.1f} on average"
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
        with stats.timed("parse"):
            parsed = self._parse(encoded, region_of)
            uncertain = parsed.batch.uncertain.intersection(parsed.shapes)
            outputs = self._allocate(parsed.shapes, parsed.regions, len(encoded), pad and not uncertain)
        handle = stream.cuda_stream
        calls: list[tuple[DecoderKey, Turn | None, dict[int, Memory]]] = []
        whole = {p: outputs.memory[p] for p in parsed.shapes if p not in parsed.regions}
        if whole:
            calls.append((*self._whole_key(), whole))
        if parsed.regions:
            calls.append((self._region_key, None, {p: outputs.memory[p] for p in parsed.regions}))
        decoded = self._decode_leased(calls, parsed.batch, handle, stats)
        extents: list[tuple[int, int] | None] = [None] * len(encoded)
        rows: set[int] = set()
        own: dict[int, torch.Tensor] = {}
        for position, extent in decoded.extents.items():
            if extent is None:
                continue
            extents[position] = extent
            if outputs.rows and extent == outputs.memory[position].shape:
                rows.add(position)
            else:
                own[position] = outputs.view(position, extent)
        reasons = {**parsed.to_cpu, **decoded.reasons}
        regions = set(parsed.regions)
        failed = [p for p in sorted(regions) if extents[p] is None]
        wholes = _Outputs()
        if failed:  # regions the GPU gave up on: decode those images whole on the GPU, crop after
            parsed.batch.uncrop(failed)
            _dense(self.device, {p: parsed.wholes[p] for p in failed}, wholes, self._output_memory)
            retried = self._decode_leased([(*self._whole_key(), wholes.memory)], parsed.batch, handle, stats)
            reasons = {p: reason for p, reason in reasons.items() if p not in failed}
            reasons.update(retried.reasons)
            for position, extent in retried.extents.items():
                if extent is not None:
                    extents[position], own[position] = extent, wholes.view(position, extent)
            # Only failures whose whole image decoded count against region decoding: not bad files.
            self._regions_failed(sum(extents[p] is not None for p in failed), len(regions))
            regions.difference_update(failed)
        errors = dict(parsed.errors)
        causes: dict[int, BaseException] = {}
        if reasons:
            with stats.timed("fallback"):
                errors.update(
                    self._decode_on_cpu(encoded, reasons, outputs, wholes, extents, rows, own, stats, causes)
                )
            regions.difference_update(reasons)  # Pillow decodes the whole image: the caller crops it
        if regions:
            stats.count("region_decodes", len(regions))
        return DecodedBatch(
            extents=extents,
            errors=errors,
            batch=outputs.tensor if outputs.rows else None,
            rows=rows,
            own=own,
            regions=regions,
            causes=causes,
        )

    def _parse(self, encoded: Sequence[Encoded], region_of: RegionOf | None) -> _Parsed:
        """Reads each header: over the pixel limit, for Pillow, or the image (or region) to decode."""
        batch = self._engine.parse(encoded)
        parsed = _Parsed(batch)
        headers = batch.headers
        pacer = Pacer()
        for position, data in enumerate(encoded):
            pacer.tick()
            reason = headers.failures.get(position)
            if reason is not None:  # unparsable here: Pillow gets a try
                parsed.to_cpu[position] = reason
                continue
            height, width, codec = (
                headers.heights[position],
                headers.widths[position],
                headers.codecs[position],
            )
            limit = pixel_limit_error(width, height, self._max_pixels)
            if limit is not None:
                parsed.errors[position] = limit
                continue
            reason = _cpu_reason(headers, position, data)
            if reason is None and codec == "jpeg" and headers.channels[position] == 1:
                fixed = normalize_gray_sampling(data)
                if fixed is not data:
                    parsed.rewritten.append(fixed)
                    reason = batch.reparse(position, fixed)
            if reason is not None:
                parsed.to_cpu[position] = reason
                continue
            turned = headers.turned[position]
            shown = (width, height) if turned else (height, width)
            # Regions of JPEGs whose frame is known (the Python API may not know it before decoding).
            region = None
            if region_of is not None and codec == "jpeg" and turned is not None:
                region = _region(shown, position, region_of)
                if region is not None and not batch.crop(position, region):
                    region = None
            if region is None:
                parsed.shapes[position] = shown
            else:
                parsed.wholes[position] = shown
                parsed.shapes[position] = (region[2], region[3])
                parsed.regions.add(position)
        return parsed

    def _decode_leased(
        self,
        calls: list[tuple[DecoderKey, Turn | None, dict[int, Memory]]],
        batch: EngineBatch,
        handle: int,
        stats: StatsRecorder,
    ) -> _Decoded:
        """Calls a leased Decoder of each configuration with its positions and their memory.

        A sample a Decoder gives up on gets ``None`` and a reason, for Pillow. The time spent waiting
        for a free Decoder is the ``decode_lock`` stage. A call whose configuration is named is timed
        for the pace of ``backend="auto"``.
        """
        decoded = _Decoded()
        for key, turn, memory in calls:
            try:
                with stats.timed("decode_lock"):
                    decoder = self._registry.acquire(key, self._gpu_decoders)
            except BaseException:
                if turn is not None and self._pace is not None:
                    self._pace.abandon(turn)
                raise
            extents: dict[int, tuple[int, int] | None] = dict.fromkeys(memory)
            started, timed = time.perf_counter(), None
            try:
                with stats.timed("decode"):
                    extents = batch.decode(decoder, memory, handle)
                timed = time.perf_counter() - started
            except Exception as exc:  # the whole call failed: each sample to Pillow
                decoded.reasons.update(dict.fromkeys(memory, f"nvImageCodec failed ({exc})"))
                timed = 0.0
            finally:
                self._registry.release(key, decoder)
                if turn is not None and self._pace is not None:
                    if timed is None:  # cancelled or interrupted: no measurement
                        self._pace.abandon(turn)
                    else:
                        self._pace.record(turn, sum(e is not None for e in extents.values()), timed)
            for position, extent in extents.items():
                if extent is None:
                    decoded.reasons.setdefault(position, "nvImageCodec returned no image")
            decoded.extents.update(extents)
        return decoded

    def _regions_failed(self, failed: int, total: int) -> None:
        """Stops region decoding on this device once most regions of a call fail (issue #55's kind).

        ``failed`` counts regions that failed where the whole image decoded; a call of fewer than
        :data:`_REGIONS_TO_JUDGE` regions is not judged, so one odd file in a small batch is not taken
        for a broken decoder.
        """
        if total < _REGIONS_TO_JUDGE or failed * 2 <= total:
            return
        if not self._registry.revoke(("regions", *self._region_key)):
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
        """Allocates the outputs of a batch with one allocation.

        Rows of a ``(B, H, W, 3)`` tensor when all shapes agree: every row is there, so a CPU fallback
        of that shape fills its own. Regions of different sizes, and with ``pad`` whole images of
        different sizes where padding costs at most :data:`_PAD_MEMORY` times their own memory, go to
        the top-left corners of the rows of a ``(B, Hmax, Wmax, 3)`` tensor, which the resize then
        reads as one batch (``threadloader._regions`` has that contract for regions). Other images of
        different sizes: one after the other in one flat buffer.
        """
        outputs = _Outputs()
        if not shapes:
            return outputs
        height = max(h for h, _ in shapes.values())
        width = max(w for _, w in shapes.values())
        same = len(set(shapes.values())) == 1
        own = sum(h * w for h, w in shapes.values())
        if (
            same
            or (regions and len(regions) == len(shapes))
            or (pad and count * height * width <= _PAD_MEMORY * own)
        ):
            outputs.tensor = self._output_memory((count, height, width, 3))
            outputs.rows = True
            base, step = outputs.tensor.data_ptr(), height * width * 3
            outputs.memory = {p: Memory(base + p * step, shape, width * 3) for p, shape in shapes.items()}
            if same:  # every row: an image that Pillow decodes to that size fills its own
                outputs.memory.update(
                    (p, Memory(base + p * step, (height, width), width * 3))
                    for p in range(count)
                    if p not in shapes
                )
            return outputs
        _dense(self.device, shapes, outputs, self._output_memory)
        return outputs

    def _output_memory(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Memory for nvImageCodec to decode into, never memory that queued work may still read.

        nvImageCodec does not always wait for work queued earlier on ``cuda_stream`` before it writes
        into the output (docs/design.md, "Decode memory that no queued work still reads"). Memory
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
        outputs: _Outputs,
        wholes: _Outputs,
        extents: list[tuple[int, int] | None],
        rows: set[int],
        own: dict[int, torch.Tensor],
        stats: StatsRecorder,
        causes: dict[int, BaseException],
    ) -> dict[int, str]:
        """Decodes the samples the GPU gave up on with Pillow, uploading into their memory where it fits.

        Fills ``extents``, ``rows`` and ``own`` for those Pillow decoded; returns the errors of those
        it could not, and puts Pillow's exception for each in ``causes`` (nvImageCodec gives a status).
        """
        errors: dict[int, str] = {}
        for position, reason in reasons.items():
            try:
                pixels = torch.from_numpy(decode_rgb(encoded[position], max_pixels=self._max_pixels))
            except Exception as exc:
                errors[position] = f"{reason}; Pillow: {type(exc).__name__}: {exc}"
                causes[position] = detached(exc)  # its frames hold the whole batch
                continue
            extent = (int(pixels.shape[0]), int(pixels.shape[1]))
            extents[position] = extent
            target = wholes if position in wholes.memory else outputs
            place = target.memory.get(position)
            if place is not None and place.shape == extent:
                target.view(position).copy_(pixels)
                if target.rows:
                    rows.add(position)
                    own.pop(position, None)
                else:
                    own[position] = target.view(position)
            else:
                own[position] = pixels.to(self.device)
            stats.count("cpu_fallbacks")
        return errors


#: Most memory a padded batch of whole images may take, as a multiple of the images' own: beyond it,
#: images of very different sizes are decoded into a flat buffer and resized one by one.
_PAD_MEMORY = 2.5

#: Formats decoded on the GPU when they are plain 8-bit RGB; everything else goes to Pillow.
_GPU_FORMATS = frozenset(["jpeg", "jpeg2k", "png", "bmp", "tiff", "webp"])


def _dense(
    device: torch.device,
    shapes: dict[int, tuple[int, int]],
    outputs: _Outputs,
    allocate: Callable[[tuple[int, ...]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Fills ``outputs`` with images of ``shapes`` one after the other in one flat buffer; the buffer."""
    sizes = [h * w * 3 for h, w in shapes.values()]
    flat = (allocate or (lambda shape: torch.empty(shape, dtype=torch.uint8, device=device)))((sum(sizes),))
    outputs.tensor, outputs.rows = flat, False
    address = flat.data_ptr()
    for (position, shape), size in zip(shapes.items(), sizes, strict=True):
        outputs.memory[position] = Memory(address, shape, shape[1] * 3)
        address += size
    return flat


def _cpu_reason(headers: Headers, position: int, data: Encoded) -> str | None:
    """Why a sample should be decoded by Pillow instead, or ``None`` to decode it on the GPU.

    The GPU path takes what was checked against Pillow on the GPU: JPEG (grayscale, RGB, CMYK) with
    its end marker, and the other formats as 8-bit RGB. Alpha, palettes and 16-bit samples go to
    Pillow, which gives them the documented contract (alpha dropped, high byte kept).
    """
    codec = headers.codecs[position]
    if codec not in _GPU_FORMATS:
        return f"{codec or 'this'} format is not decoded on the GPU"
    if codec == "jpeg":
        return None if has_end_marker(data) else "the JPEG has no end-of-image marker (truncated?)"
    channels, eight_bit = headers.channels[position], headers.eight_bit[position]
    if channels != 3 or not eight_bit:
        samples = "8-bit" if eight_bit else "wider than 8-bit"
        return f"{codec} with {channels} channels of {samples} samples is decoded on the CPU"
    if headers.palette[position]:
        return f"palette {codec} is decoded on the CPU"
    return None


def _region(shown: tuple[int, int], position: int, region_of: RegionOf) -> Region | None:
    """The part of an image displayed as ``shown`` to decode: ``region_of``'s answer, unless the whole.

    Asked with the size as displayed: nvImageCodec crops after applying EXIF orientation (measured for
    every orientation), so a region is in the displayed frame.
    """
    if min(shown) < 1:  # a header without a height (DNL): no size to draw a crop from
        return None
    region = region_of(position, shown)
    return None if region == (0, 0, *shown) else region


def _sample(name: str) -> bytes:
    """A photo bundled with the package (``threadloader/_sample``)."""
    return (resources.files("threadloader") / "_sample" / name).read_bytes()


def _self_test(
    engine: Engine, registry: DecoderRegistry, key: DecoderKey, limit: int, device: torch.device
) -> str | None:
    """What is wrong with ``engine`` on ``device``, decoding a photo turned by EXIF; ``None`` if nothing."""
    data = with_exif_orientation(_sample("chelsea.jpg"), 6)  # stored 451x300, shown 300 wide, 451 high
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


_GUARD, _GUARD_PIXELS = 0xA5, 4
#: Mean absolute difference from Pillow that the self-test allows: nvJPEG's and libjpeg's IDCT and
#: chroma upsampling differ slightly (measured well below 1 on an H200).
_SELF_TEST_TOLERANCE = 2.0


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning(
        "%s; decoding through nvImageCodec's Python API instead, which lets go of the GIL about four "
        "times per image (set %s=0 to use it without this check)",
        reason,
        CAPI_ENV,
    )
