"""GPU decoding with nvImageCodec: a batch through phases that each return what the next one takes.

Read the headers and classify (``_parse.py``), allocate one output for the batch (``_memory.py``),
decode on leased Decoders of the shared pools (``_registry.py``; which pool, for ``backend="auto"``,
``_pace.py`` says), retry failed regions whole, fall back to Pillow (``_fallback.py``). The talking to
nvImageCodec is an engine's (``_engines.py``): its C API through ctypes by default, which costs a
training loop no GIL hand-off per image, or its Python API where the C API's self-test fails on a
device (``_startup.py``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..._checks import check_count, check_switch, env_flag
from ..._stats import StatsRecorder
from ..base import DEFAULT_MAX_PIXELS, DecodedBatch, Encoded, ImageDecoder, RegionOf, StageRecorder
from . import _capi
from ._engines import BACKENDS, CONFIGS, ENGINES, Engine, EngineBatch, Memory, engine_named, uses_engine
from ._fallback import decode_on_cpu
from ._memory import Assembly, Outputs, allocate, dense, output_memory
from ._pace import Pace, Turn
from ._parse import parse
from ._registry import DecoderKey, DecoderRegistry
from ._startup import SHARED, region_check, self_test

__all__ = [
    "CAPI_ENV",
    "DEFAULT_BACKEND",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_GPU_DECODERS",
    "QUEUE_ENV",
    "REGION_BACKEND",
    "NvImageCodecDecoder",
    "check_options",
]

#: The backend a decoder uses unless told otherwise: each call on the configuration fastest lately.
DEFAULT_BACKEND = "auto"

#: Decoders per device and configuration that reader threads decode on at once, by default: the count
#: measured fastest on an H200 (docs/design.md, "Decoder engines"). More Decoders cost device memory.
DEFAULT_GPU_DECODERS = 2

#: Images per decoder call that a decoder is made for by default: the front ends' GPU decode batch.
DEFAULT_BATCH_SIZE = 64

#: The configuration that decodes regions where a backend allows several kinds (``"auto"``, ``"all"``,
#: ``"cuda"``, ``"split"``): with nvImageCodec 0.9.0 the only one faster on regions than on whole images
#: (docs/benchmarks.md has the measurements).
REGION_BACKEND = "hybrid"

#: The configuration ``backend="auto"`` decodes on while the consumer is the slower side: beside ResNet-50
#: steps, eager and graphed, the steps ran faster beside it than beside the JPEG engine's (H200,
#: docs/benchmarks.md), though the engine's calls returned sooner.
_BESIDE_A_BUSY_GPU = "cuda"

#: Fewest regions in a decoder call for its failures to turn region decoding off (see _regions_failed).
_REGIONS_TO_JUDGE = 8

#: Set to 0 to decode through nvImageCodec's Python API instead of its C API (read when a decoder is
#: built): the escape hatch, should the binding misbehave where its self-test passed.
CAPI_ENV = "THREADLOADER_CAPI"

#: Set to 1 to return a Decoder to its pool once a call is submitted rather than once it returns, so the
#: next reader's call queues inside nvImageCodec (read when a decoder is built). Off until measured on a
#: GPU against the default (docs/design.md, "Queued decode calls").
QUEUE_ENV = "THREADLOADER_QUEUED_DECODE"

logger = logging.getLogger("threadloader")


def check_options(
    *,
    backend: object,
    gpu_decoders: object,
    decode_threads: object = None,
    jpeg_fancy_upsampling: object = True,
    batch_size: object = DEFAULT_BATCH_SIZE,
) -> None:
    """Raises for a value a decoding option does not take, naming the option and what was got.

    The one check of each, for this decoder and for the front ends' options, on the CPU too, where
    they select nothing but a script that passes them should fail the same way it would on a GPU.
    ``decode_threads=None`` is the front ends' "derive it".
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    check_count("gpu_decoders", gpu_decoders, optional=False)
    check_count("decode_threads", decode_threads)
    check_count("batch_size", batch_size, optional=False)
    check_switch("jpeg_fancy_upsampling", jpeg_fancy_upsampling)


#: Devices on which a decoder of this process has started nvImageCodec (its engine chosen and first
#: Decoder made): later decoders there start in milliseconds, the first in seconds.
_started_on: set[int] = set()
_started_lock = threading.Lock()


@dataclass(frozen=True)
class _Prepared:
    """What a decoder's first call chose: its engine, its pools' keys by configuration, its regions' pool."""

    engine: Engine
    keys: dict[str, DecoderKey]
    region_key: DecoderKey

    @property
    def claimed(self) -> list[DecoderKey]:
        """Every pool the decoder decodes on."""
        return [*self.keys.values(), self.region_key]


@dataclass
class _Decoded:
    """Decoder calls' results: the extent of each position (``None`` where given up on) and why."""

    extents: dict[int, tuple[int, int] | None] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)


class NvImageCodecDecoder(ImageDecoder):
    """Decodes batches on one GPU through the shared pools of nvImageCodec Decoders.

    Samples nvImageCodec cannot parse or gives up on are decoded with Pillow and uploaded, so they
    count as errors only when Pillow fails too. :meth:`close` (or dropping the decoder) lets the
    pools it alone used go, with their Decoders' memory.

    Args:
        device: An indexed CUDA device, or its name (``"cuda:0"``).
        backend: One of :data:`BACKENDS`: ``"auto"`` sends each call to the configuration that has
            been fastest lately (``_pace.py``), the others fix one.
        decode_threads: nvImageCodec's own CPU threads per Decoder.
        jpeg_fancy_upsampling: Smooth JPEG chroma upsampling, as Pillow's; off, nvImageCodec's JPEG
            engine decodes a batch in one call (see ``_engines.decoder_options``).
        max_pixels: Images whose header declares more pixels are errors, decoded by nobody.
        region_decode: Decode the region a random crop asks for instead of the whole image (where the
            device passes the region check).
        gpu_decoders: Most Decoders this decoder makes for each configuration (engine, device,
            configuration, CPU threads, upsampling, and for the JPEG engine's the batch size), each
            called by one thread at a time. Pools are process-wide: decoders of one configuration
            share them, and regions have a pool of their own.
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
        device: torch.device | str,
        *,
        backend: str = DEFAULT_BACKEND,
        decode_threads: int,
        jpeg_fancy_upsampling: bool = True,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        region_decode: bool = True,
        gpu_decoders: int = DEFAULT_GPU_DECODERS,
        batch_size: int = DEFAULT_BATCH_SIZE,
        engine: str | None = None,
        registry: DecoderRegistry = SHARED,
    ) -> None:
        check_options(
            backend=backend,
            gpu_decoders=gpu_decoders,
            decode_threads=decode_threads,
            jpeg_fancy_upsampling=jpeg_fancy_upsampling,
            batch_size=batch_size,
        )
        if decode_threads is None:
            raise ValueError("decode_threads must be an int of at least 1, got None")
        device = torch.device(device)  # a name, as the front ends and PillowDecoder take (AttributeError)
        if device.type != "cuda" or device.index is None:
            raise ValueError(
                f"NvImageCodecDecoder needs an indexed CUDA device, got {device}: "
                "pass torch.device('cuda', 0) or 'cuda:0'"
            )
        if engine is not None and engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES} or None, got {engine!r}")
        self.device = device
        self.backend = backend
        self.decode_threads = decode_threads
        self.jpeg_fancy_upsampling = bool(jpeg_fancy_upsampling)
        self.max_pixels = max_pixels
        self.region_decode = region_decode
        self.gpu_decoders = gpu_decoders
        self.batch_size = batch_size
        if engine is None:  # the environment is read now, as the rest of the configuration
            engine = "capi" if env_flag(CAPI_ENV, default=True) else "python"
        self._wanted = engine
        self._queue_calls = env_flag(QUEUE_ENV, default=False)
        self._registry = registry
        configs = BACKENDS[backend]
        self._pace = Pace(configs, settled=_BESIDE_A_BUSY_GPU) if len(configs) > 1 else None
        self._started = threading.Lock()
        self._prepared: _Prepared | None = None
        self._closed = False
        # The pools it claimed are let go when it is dropped unclosed too; not at exit, where
        # destroying Decoders would race the CUDA runtime's own teardown. Never waiting for the
        # registry's lock: a finalizer (this one, or a loader's that closes it) may run inside that
        # lock's own code, in the thread that holds it.
        self._release = weakref.finalize(self, registry.unclaim_soon, [])
        self._release.atexit = False

    #: nvImageCodec's start (its instance, the self-test, the first Decoder) takes seconds.
    warms_up = True

    def __repr__(self) -> str:
        return f"NvImageCodecDecoder({self.device}, backend={self.backend!r})"

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

    def pace(self) -> dict[str, float]:
        """Seconds per image of a call alone there, lately, in each configuration ``"auto"`` chooses between.

        Empty for a fixed backend, and before the first measurement. For diagnostics and benchmarks:
        the choice itself is automatic.
        """
        return {} if self._pace is None else self._pace.seconds_per_image()

    def consumer_ahead(self, ahead: bool) -> None:
        """While the consumer is the slower side, ``backend="auto"`` decodes on nvJPEG's CUDA decoder.

        A training step that keeps the GPU busy ran faster beside it than beside the JPEG engine's
        configuration; a consumer that waits for batches gets them from the fastest lately.
        """
        if self._pace is not None:
            self._pace.settle(ahead)

    def close(self) -> None:
        """Lets the pools this decoder claimed go, with the Decoders no other decoder uses.

        Those are destroyed at once if idle, else once their calls have returned; where another thread
        is inside the registry at that instant, by that thread as it leaves. Idempotent; a later call
        decodes on new Decoders.
        """
        with self._started:
            self._closed = True
            self._release()

    def _start(self) -> _Prepared:
        """The engine and the pools' keys, chosen by the first call, which also makes a Decoder in each pool.

        Not in the constructor: loading nvImageCodec, its self-test and a Decoder take seconds, which a
        front end spends in the background (``threadloader._warmup``) while its caller sets up the
        rest. Later callers wait for the first; a call that raises leaves the next one to try again.
        Every configuration the backend may pick gets its Decoder now: one made later is made by a
        reader's call while the others wait for that pool, beside a training step that is already busy.
        """
        prepared = self._prepared  # set once, under the lock, to an immutable tuple: safe to read without it
        if prepared is not None:
            return prepared
        with self._started:
            if self._prepared is None:
                engine = self._choose_engine(self._wanted)
                configs = BACKENDS[self.backend]
                keys = {config: self._pool_key(engine, config) for config in configs}
                # Configurations of several kinds: regions take the one fastest at regions.
                mixed = any(CONFIGS[config] is None or len(CONFIGS[config] or ()) > 1 for config in configs)
                prepared = _Prepared(
                    engine, keys, self._pool_key(engine, REGION_BACKEND if mixed else configs[0])
                )
                first = keys[configs[0]]
                with self._registry.claimed(keys.values()):  # a Decoder made now outlives a failure after it
                    for key in keys.values():
                        self._registry.release(key, self._registry.acquire(key, self.gpu_decoders))
                    if not self._closed:  # claimed until close, or until the decoder is dropped
                        self._registry.claim(prepared.claimed)
                        self._release.detach()
                        self._release = weakref.finalize(self, self._registry.unclaim_soon, prepared.claimed)
                        self._release.atexit = False
                self._prepared = prepared
                with _started_lock:
                    _started_on.add(first[1])
            return self._prepared

    def _pool_key(self, engine: Engine, config: str) -> DecoderKey:
        """The key of the pool of Decoders that ``engine`` makes in ``config`` for this decoder's options."""
        index = self.device.index
        assert index is not None  # a CUDA device's index, set by the constructor
        batch = self.batch_size if uses_engine(config) else 0
        return (engine.name, index, config, self.decode_threads, self.jpeg_fancy_upsampling, batch)

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
        """The C API's self-test on this device, once per process; a failure is said in a warning."""
        key = self._pool_key(engine, "cuda")  # no JPEG engine: any batch size shares it
        try:
            with self._registry.claimed([key]):  # its Decoder goes with the test, unless a decoder uses it
                reason = self_test(engine, self._registry, key, self.gpu_decoders, self.device)
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
        stats: StageRecorder | None = None,
        region_of: RegionOf | None = None,
        pad: bool = False,
    ) -> DecodedBatch:
        """Decodes a batch on ``stream``; see :meth:`ImageDecoder.decode`.

        JPEGs are decoded as the region ``region_of`` asks for, when region decoding passed its check
        on this device; a region that fails is decoded whole (on the GPU, else by Pillow) and not
        reported in ``regions``, so the caller crops it. With ``pad``, whole images of different sizes
        are decoded into the rows of one batch where it costs at most ``_memory.PAD_MEMORY`` times the
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
        return self.region_decode and self._registry.verdict(
            ("regions", *self._start().region_key), self._check_regions
        )

    def _check_regions(self) -> bool:
        """The region check on this device and backend, once, before the first region; logs a failure."""
        prepared = self._start()
        # Leased outside the check: a Decoder that cannot be made is an error, not a verdict on regions.
        with (
            self._registry.lease(prepared.region_key, self.gpu_decoders) as decoder,
            torch.cuda.device(self.device),
        ):
            reason = region_check(prepared.engine, decoder, self.device)
        if reason is not None:
            logger.warning(
                "region decoding does not work on %s (%s); decoding whole images and cropping instead",
                self.device,
                reason,
            )
        return reason is None

    def _decode_on(
        self,
        stream: torch.cuda.Stream,
        encoded: Sequence[Encoded],
        stats: StageRecorder,
        region_of: RegionOf | None,
        pad: bool,
    ) -> DecodedBatch:
        """The phases: parse and classify, allocate, decode on leased Decoders, retry regions, fall back."""
        prepared = self._start()
        with stats.timed("parse"):
            parsed = parse(prepared.engine, encoded, max_pixels=self.max_pixels, region_of=region_of)
            uncertain = parsed.batch.uncertain.intersection(parsed.shapes)
            outputs = allocate(
                parsed.shapes,
                count=len(encoded),
                regions=bool(parsed.regions) and len(parsed.regions) == len(parsed.shapes),
                pad=pad and not uncertain,
                memory=self._output_memory,
            )
        handle = stream.cuda_stream
        calls: list[tuple[DecoderKey, Turn | None, dict[int, Memory]]] = []
        whole = {p: outputs.memory[p] for p in parsed.shapes if p not in parsed.regions}
        if whole:
            calls.append((*self._whole_key(prepared), whole))
        if parsed.regions:
            calls.append((prepared.region_key, None, {p: outputs.memory[p] for p in parsed.regions}))
        decoded = self._decode_leased(calls, parsed.batch, handle, stats)
        assembly = Assembly([None] * len(encoded))
        for position, extent in decoded.extents.items():
            if extent is not None:
                assembly.place(position, extent, outputs)
        reasons = {**parsed.to_cpu, **decoded.reasons}
        regions = set(parsed.regions)
        failed = [p for p in sorted(regions) if assembly.extents[p] is None]
        wholes = Outputs()
        if failed:  # regions the GPU gave up on: decode those images whole on the GPU, crop after
            parsed.batch.uncrop(failed)
            wholes = dense({p: parsed.wholes[p] for p in failed}, self._output_memory)
            retried = self._decode_leased(
                [(*self._whole_key(prepared), wholes.memory)], parsed.batch, handle, stats
            )
            reasons = {p: reason for p, reason in reasons.items() if p not in failed}
            reasons.update(retried.reasons)
            for position, extent in retried.extents.items():
                if extent is not None:
                    assembly.place(position, extent, wholes)
            # Only failures whose whole image decoded count against region decoding: not bad files.
            self._regions_failed(sum(assembly.extents[p] is not None for p in failed), len(regions))
            regions.difference_update(failed)
        for position, error in parsed.errors.items():
            assembly.fail(position, error)
        if reasons:
            with stats.timed("fallback"):
                decode_on_cpu(
                    encoded,
                    reasons,
                    assembly,
                    [wholes, outputs],
                    device=self.device,
                    max_pixels=self.max_pixels,
                    stats=stats,
                )
            regions.difference_update(reasons)  # Pillow decodes the whole image: the caller crops it
        if regions:
            stats.count("region_decodes", len(regions))
        return assembly.result(outputs, regions)

    def _whole_key(self, prepared: _Prepared) -> tuple[DecoderKey, Turn | None]:
        """The pool the next call's whole images decode on, and the turn whose pace it tells (``auto``)."""
        if self._pace is None:
            return next(iter(prepared.keys.values())), None
        turn = self._pace.choose()
        return prepared.keys[turn.arm], turn

    def _decode_leased(
        self,
        calls: list[tuple[DecoderKey, Turn | None, dict[int, Memory]]],
        batch: EngineBatch,
        handle: int,
        stats: StageRecorder,
    ) -> _Decoded:
        """Calls a leased Decoder of each pool with its positions and their memory.

        With :data:`QUEUE_ENV` set to ``1``, the lease ends once the call is submitted, not when it
        returns: the next reader's call queues inside nvImageCodec (``_registry.py`` says why). A
        sample a Decoder gives up on gets ``None`` and a reason, for Pillow. The time spent waiting for
        a free Decoder is the ``decode_lock`` stage. A call with a turn is timed for the pace of
        ``backend="auto"`` from before that wait: a configuration whose Decoders are all busy is slower
        to the next reader by the wait, and timing from the lease made a queue there look fast.
        """
        decoded = _Decoded()
        for key, turn, memory in calls:
            started = time.perf_counter()
            try:
                with stats.timed("decode_lock"):
                    decoder = self._registry.acquire(key, self.gpu_decoders)
            except BaseException:
                if turn is not None and self._pace is not None:
                    self._pace.abandon(turn)
                raise
            extents: dict[int, tuple[int, int] | None] = dict.fromkeys(memory)
            took, queued, pending = None, None, None
            try:
                with stats.timed("decode"):
                    pending = batch.submit(decoder, memory, handle)
                    if pending.queued and self._queue_calls:
                        self._registry.release(key, decoder, pending=True)
                        queued = pending
                    extents = pending.result()
                took = time.perf_counter() - started
            except Exception as exc:  # the whole call failed: each sample to Pillow
                decoded.reasons.update(dict.fromkeys(memory, f"nvImageCodec failed ({exc})"))
                took = 0.0
            finally:
                if queued is None:
                    if took is None and pending is not None:  # interrupted (Ctrl-C) before its wait
                        with contextlib.suppress(Exception):
                            pending.result()  # nvImageCodec's threads still use the Decoder and our memory
                    self._registry.release(key, decoder)
                else:
                    try:
                        with contextlib.suppress(Exception):  # a failure is each sample's reason already
                            queued.result()  # waited for even when interrupted: its threads read our memory
                    finally:
                        self._registry.settle(key, decoder)
                if turn is not None and self._pace is not None:
                    if took is None:  # cancelled or interrupted: no measurement
                        self._pace.abandon(turn)
                    else:
                        self._pace.record(turn, sum(e is not None for e in extents.values()), took)
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
        if not self._registry.revoke(("regions", *self._start().region_key)):
            return
        logger.warning(
            "region decoding failed for %d of %d images on %s; decoding whole images and cropping "
            "from now on (pass region_decode=False to skip region decoding altogether)",
            failed,
            total,
            self.device,
        )

    def _output_memory(self, shape: tuple[int, ...]) -> torch.Tensor:
        """Decode memory of ``shape`` that no queued work still reads (``_memory.output_memory``)."""
        return output_memory(shape, self.device, self._registry.allocation_stream(self.device))


@functools.cache
def _warn_once(reason: str) -> None:
    logger.warning(
        "%s; decoding through nvImageCodec's Python API instead, which lets go of the GIL about four "
        "times per image (set %s=0 to use it without this check)",
        reason,
        CAPI_ENV,
    )
