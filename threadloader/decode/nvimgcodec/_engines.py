"""Two ways into nvImageCodec behind one batch interface: its C API (the default) and its Python API.

The decoder (``nvimgcodec.py``) decides what to decode, as what and where; an engine does the talking
to nvImageCodec: it reads a batch's headers, narrows images to a region, and decodes positions into
memory the decoder allocated. :class:`CApiEngine` does the per-image steps without letting go of the
GIL (``_capi.py``). :class:`PythonApiEngine` is the fallback where that binding cannot be used (another
nvImageCodec version, a failed self-test); it lets go of the GIL about four times per image, each time a
hand-off that a training loop beside it pays.
"""

from __future__ import annotations

import functools
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from ..base import Encoded, Region
from . import _allocators, _capi
from ._jpeg import exif_orientation

__all__ = [
    "BACKENDS",
    "CONFIGS",
    "ENGINES",
    "HARDWARE_SHARE",
    "OPTIONS_ENV",
    "CApiEngine",
    "Engine",
    "EngineBatch",
    "Headers",
    "Memory",
    "Pending",
    "PythonApiEngine",
    "decoder_options",
    "engine_named",
    "import_nvimgcodec",
    "uses_engine",
]

#: The engines by name: ``"capi"``, the default where it loads and passes its self-test, and ``"python"``.
ENGINES = ("capi", "python")

#: Share of each batch the JPEG engine takes under ``backend="split"``: DALI's ``hw_decoder_load`` default.
HARDWARE_SHARE = 0.65

#: Every backend kind but the JPEG engine: what ``backend="auto"`` allows. Beside a training step that
#: keeps the GPU's SMs busy, the JPEG engine's Decoders fell far behind what they do alone, while
#: nvJPEG's CUDA decoder kept most of its speed, and alone the two were as fast on photos of ImageNet's
#: sizes (docs/design.md, "Decoder engines", has the measurements).
_ALL_BUT_THE_ENGINE = (("GPU_ONLY", 1.0), ("HYBRID_CPU_GPU", 1.0), ("CPU_ONLY", 1.0))

#: The option that turns smooth (interpolated) chroma upsampling off, for each of nvImageCodec's JPEG
#: decoders: nvJPEG's two and its CPU decoder (libjpeg-turbo).
_NO_FANCY_UPSAMPLING = " ".join(
    f"{decoder}:fancy_upsampling=0"
    for decoder in ("nvjpeg_cuda_decoder", "nvjpeg_hw_decoder", "libjpeg_turbo_decoder")
)


#: nvImageCodec options (``"decoder_id:option=value ..."``, as nvImageCodec's ``options=`` takes them)
#: appended to every Decoder's own, read when a Decoder is made: nvImageCodec's knobs (its decoders'
#: memory paddings and preallocation, the engine's batch hints) tried without a code change.
OPTIONS_ENV = "THREADLOADER_NVIMGCODEC_OPTIONS"


#: Extra pinned host memory (bytes) nvJPEG's CUDA decoder adds to each of its staging buffers when one
#: grows, DALI's ``host_memory_padding`` default. Without it a buffer grows by what each larger photo
#: needs, and every growth frees the old one with ``cudaFreeHost``, which waits for the whole GPU: beside
#: a busy training step, a wait for the step's queued kernels (docs/benchmarks.md, "Host calls that wait
#: for the GPU").
HOST_MEMORY_PADDING = 8 << 20


def decoder_options(*, fancy_upsampling: bool, batch: int, allocators: bool = False) -> str:
    """nvImageCodec's options string for a Decoder, with :data:`OPTIONS_ENV`'s appended (later wins).

    nvImageCodec upsamples JPEG chroma smoothly by default, as libjpeg and Pillow do. With that on, its
    JPEG engine decodes a batch of mixed chroma subsamplings one image at a time, waiting for the GPU
    after each (nvImageCodec 0.9's "batch-single" path), at about half its speed alone and a fraction
    of it beside a busy GPU; off, it decodes the batch in one call, as DALI does by default
    (``jpeg_fancy_upsampling=False``). docs/benchmarks.md has the measurements. Images that Pillow
    decodes instead (those nvImageCodec gives up on) are upsampled smoothly either way.

    As DALI does, the CUDA decoder's staging buffers grow with :data:`HOST_MEMORY_PADDING` to spare,
    and the JPEG engine's buffers are made for ``batch`` images up front (``0``: nvImageCodec's
    default of one). A Decoder given allocators (``allocators``; ``_allocators.py``) also pads the CUDA
    decoder's device buffers and makes its buffers up front, as DALI has it do: nvImageCodec ignores
    both without allocators.
    """
    parts = [f"nvjpeg_cuda_decoder:host_memory_padding={HOST_MEMORY_PADDING}"]
    if allocators:
        parts.append(f"nvjpeg_cuda_decoder:device_memory_padding={_allocators.DEVICE_MEMORY_PADDING}")
        parts.append("nvjpeg_cuda_decoder:preallocate_buffers=1")
    if batch > 0:
        parts.append(f"nvjpeg_hw_decoder:preallocate_batch_size={batch}")
    if not fancy_upsampling:
        parts.append(_NO_FANCY_UPSAMPLING)
    parts.append(os.environ.get(OPTIONS_ENV, "").strip())
    return " ".join(part for part in parts if part)


#: The Decoder configurations pools are made of: the nvImageCodec backend kinds each allows, with their
#: load hints (the share of a batch each takes); ``None``: all of them, nvImageCodec choosing per image.
#: nvImageCodec 0.8 and 0.9 have no JPEG decoder of kind GPU_ONLY: nvJPEG's CUDA decoder registers as
#: HYBRID_CPU_GPU (Huffman decoding on the CPU below a size threshold, on the GPU above), and kinds
#: match exactly, so ``"hybrid"`` is that decoder.
CONFIGS: dict[str, tuple[tuple[str, float], ...] | None] = {
    "all": None,  # nvImageCodec's own choice: the JPEG engine first where the GPU has one
    "cuda": _ALL_BUT_THE_ENGINE,  # JPEGs on nvJPEG's CUDA decoder; other formats where nvImageCodec can
    "hardware": (("HW_GPU_ONLY", 1.0),),  # the GPU's JPEG engine (A100, H100, H200...)
    "hybrid": (("HYBRID_CPU_GPU", 1.0),),
    "cpu": (("CPU_ONLY", 1.0),),
    # the JPEG engine takes a fixed share of each batch and nvJPEG's CUDA decoder the rest, at once
    "split": (("HW_GPU_ONLY", HARDWARE_SHARE), ("HYBRID_CPU_GPU", 1.0)),
}

#: Accepted ``backend=`` values: the configurations a decoder chooses between, call by call, by their
#: pace (``_pace.py``); one is a fixed choice.
BACKENDS: dict[str, tuple[str, ...]] = {
    "auto": ("all", "cuda"),  # the JPEG engine where it keeps up, nvJPEG's CUDA decoder where it does not
    **{name: (name,) for name in CONFIGS},
}


def uses_engine(config: str) -> bool:
    """Whether a configuration's Decoders decode JPEGs on the GPU's JPEG engine (where it has one).

    nvImageCodec 0.9 sizes the engine's share of a call from a Decoder's first call and keeps it, so
    such Decoders are made for a batch size (``nvimgcodec.new_decoder`` primes them with it).
    """
    kinds = CONFIGS[config]
    return kinds is None or any(kind == "HW_GPU_ONLY" for kind, _ in kinds)


@dataclass
class Headers:
    """What a batch's headers say, per position (zeros and ``""`` where ``failures`` has the position).

    Attributes:
        codecs: nvImageCodec's codec name: ``"jpeg"``, ``"png"``...
        heights: As stored (before EXIF orientation).
        widths: As stored.
        channels: Colour channels of the encoded image (3 for RGB or YCbCr, 1 for gray, 4 for CMYK).
        eight_bit: Whether its samples are 8-bit.
        palette: Whether it is a palette image.
        turned: Whether it is displayed with height and width swapped (EXIF orientations 5-8);
            ``None`` where that is only known once decoded.
        failures: Positions nvImageCodec could not parse, with the reason.
    """

    codecs: list[str]
    heights: list[int]
    widths: list[int]
    channels: list[int]
    eight_bit: list[bool]
    palette: list[bool]
    turned: list[bool | None]
    failures: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Memory:
    """Where one image decodes to: its first pixel, its ``(height, width)``, the bytes between its rows."""

    address: int
    shape: tuple[int, int]
    row_stride: int


class EngineBatch(ABC):
    """One batch inside an engine, from its headers to its decode; used by one thread."""

    headers: Headers

    #: Positions whose decoded shape may differ from the one their headers give (their EXIF
    #: orientation is not known before decoding): such an image cannot decode into a padded row.
    uncertain: set[int]

    @abstractmethod
    def reparse(self, position: int, data: Encoded) -> str | None:
        """Decodes ``data`` at ``position`` instead (a rewritten header); the reason if it does not parse."""

    @abstractmethod
    def crop(self, position: int, region: Region) -> bool:
        """Decodes only ``region`` (display coordinates) of the image at ``position``; whether it can."""

    @abstractmethod
    def uncrop(self, positions: Sequence[int]) -> None:
        """Decodes the whole images at ``positions`` again."""

    @abstractmethod
    def submit(self, decoder: Any, memory: dict[int, Memory], stream: int) -> Pending:
        """Starts decoding each position of ``memory`` into it, in one call, ordered on ``stream``.

        Raises:
            Exception: If the call as a whole failed.
        """

    def decode(
        self, decoder: Any, memory: dict[int, Memory], stream: int
    ) -> dict[int, tuple[int, int] | None]:
        """:meth:`submit`, then its :meth:`Pending.result`."""
        return self.submit(decoder, memory, stream).result()


class Pending(ABC):
    """A call of :meth:`EngineBatch.submit`, under way or done."""

    #: Whether the Decoder may still be working on the call after ``submit`` returned: it can take the
    #: next call meanwhile (nvImageCodec starts it when this one's host work is done), but must not be
    #: destroyed before :meth:`result` returns.
    queued: bool

    @abstractmethod
    def result(self) -> dict[int, tuple[int, int] | None]:
        """Waits for the call; per position, the ``(height, width)`` it decoded as, or ``None``.

        The shape is its memory's, unless the position is in :attr:`EngineBatch.uncertain`; ``None``
        where nvImageCodec gave up on it. Once this returns, the device work is ordered before later
        work on the stream. Later calls return the same.

        Raises:
            Exception: If the call as a whole failed.
        """


class _Done(Pending):
    """A call that was over when ``submit`` returned (the Python API's decode waits)."""

    queued = False

    def __init__(self, extents: dict[int, tuple[int, int] | None]) -> None:
        self._extents = extents

    def result(self) -> dict[int, tuple[int, int] | None]:
        return self._extents


class Engine(ABC):
    """A way into nvImageCodec: makes Decoders, and batches that decode with them."""

    #: Part of every Decoder's pool key: Decoders of one engine are no use to the other.
    name: str

    @abstractmethod
    def new_decoder(
        self, device_index: int, config: str, cpu_threads: int, fancy_upsampling: bool, batch: int
    ) -> Any:
        """A new Decoder on the device, limited to ``config``'s kinds (see :data:`CONFIGS`).

        ``fancy_upsampling``: smooth JPEG chroma upsampling, as Pillow's; ``batch``: the images per call
        it is made for (see :func:`decoder_options`).
        """

    def destroy(self, decoder: Any) -> None:  # noqa: B027  # the Python API's are freed with their object
        """Frees a Decoder this engine made, once no thread will call it again."""

    @abstractmethod
    def parse(self, encoded: Sequence[Encoded], *, apart: bool = False) -> EngineBatch:
        """Reads the headers of a batch (the bytes must outlive the batch's :meth:`EngineBatch.decode`).

        ``apart``: in handles of the batch's own rather than the calling thread's, which a batch being
        decoded by that thread may hold (a Decoder made, and primed, in the middle of its call).
        """


class CApiEngine(Engine):
    """nvImageCodec through its C API (``_capi.py``): no GIL hand-off per image, two per decoder call.

    Each reader thread has a :class:`_capi.Workspace` of its own, reused batch after batch.
    """

    name = "capi"

    def __init__(self, instance: _capi.Instance) -> None:
        self._instance = instance
        self._local = threading.local()

    def new_decoder(
        self, device_index: int, config: str, cpu_threads: int, fancy_upsampling: bool, batch: int
    ) -> _capi.Decoder:
        kinds = CONFIGS[config]
        backends = None if kinds is None else [(getattr(_capi, kind), hint) for kind, hint in kinds]
        with torch.cuda.device(device_index):
            allocators = _allocators.for_device(device_index)
            return _capi.Decoder(
                self._instance,
                device_id=device_index,
                backends=backends,
                cpu_threads=cpu_threads,
                options=decoder_options(
                    fancy_upsampling=fancy_upsampling, batch=batch, allocators=allocators is not None
                ),
                allocators=None if allocators is None else (allocators.device, allocators.pinned),
            )

    def destroy(self, decoder: Any) -> None:
        decoder.destroy()
        _allocators.trim(decoder.device_id)

    def parse(self, encoded: Sequence[Encoded], *, apart: bool = False) -> EngineBatch:
        if apart:
            return _CApiBatch(_capi.Workspace(self._instance), encoded)
        workspace = getattr(self._local, "workspace", None)
        if workspace is None:
            workspace = self._local.workspace = _capi.Workspace(self._instance)
        return _CApiBatch(workspace, encoded)


class _CApiBatch(EngineBatch):
    def __init__(self, workspace: _capi.Workspace, encoded: Sequence[Encoded]) -> None:
        self._workspace = workspace
        statuses = workspace.parse(encoded)
        self.uncertain = set()
        self.headers = _headers_of(workspace.infos[: len(encoded)], statuses)

    def reparse(self, position: int, data: Encoded) -> str | None:
        status = self._workspace.reparse(position, data)
        if status == 0:
            return None
        return f"nvImageCodec cannot parse the rewritten header ({_capi.status_name(status)})"

    def crop(self, position: int, region: Region) -> bool:
        return self._workspace.crop(position, *region) == 0

    def uncrop(self, positions: Sequence[int]) -> None:
        self._workspace.uncrop(positions)

    def submit(self, decoder: Any, memory: dict[int, Memory], stream: int) -> Pending:
        positions = list(memory)
        places = list(memory.values())
        bound = self._workspace.bind(
            positions,
            [place.address for place in places],
            [place.shape for place in places],
            [place.row_stride for place in places],
            stream=stream,
            host=decoder.host,
        )
        ready = [p for p, status in zip(positions, bound, strict=True) if status == 0]
        return _CApiPending(self._workspace.submit(decoder, ready), memory, ready)


class _CApiPending(Pending):
    queued = True

    def __init__(self, submitted: _capi.Submitted, memory: dict[int, Memory], ready: list[int]) -> None:
        self._submitted = submitted
        self._memory = memory
        self._ready = ready

    def result(self) -> dict[int, tuple[int, int] | None]:
        extents: dict[int, tuple[int, int] | None] = dict.fromkeys(self._memory)
        for position, decoded in zip(self._ready, self._submitted.wait(), strict=True):
            if decoded:
                extents[position] = self._memory[position].shape
        return extents


def _headers_of(infos: Any, statuses: list[int]) -> Headers:
    """The headers of a batch from nvImageCodec's ImageInfo records, one vectorised read per field."""
    codecs = [codec.decode("ascii", "replace") for codec in infos["codec"].tolist()]
    return Headers(
        codecs=codecs,
        heights=infos["height"].tolist(),
        widths=infos["width"].tolist(),
        channels=(infos["num_planes"] * infos["num_channels"]).tolist(),  # planar: one channel a plane
        eight_bit=(infos["sample_type"] == _capi.UINT8).tolist(),
        palette=(infos["color_spec"] == _capi.PALETTE).tolist(),
        turned=(infos["rotated"] % 180 == 90).tolist(),
        failures={
            p: f"nvImageCodec cannot parse it ({_capi.status_name(status)})"
            for p, status in enumerate(statuses)
            if status
        },
    )


class PythonApiEngine(Engine):
    """nvImageCodec through its Python API: the fallback, about four GIL hand-offs per image.

    EXIF orientation is read from the JPEG header here (``_jpeg.py``), and checked against the shape
    each result reports, since this API only tells once decoded.
    """

    name = "python"

    def __init__(self, nvimgcodec: ModuleType) -> None:
        self._nv = nvimgcodec
        self._params = nvimgcodec.DecodeParams(
            apply_exif_orientation=True, color_spec=nvimgcodec.SRGB, sample_format=nvimgcodec.I_RGB
        )

    def new_decoder(
        self, device_index: int, config: str, cpu_threads: int, fancy_upsampling: bool, batch: int
    ) -> Any:
        nv, kinds = self._nv, CONFIGS[config]
        backends = None
        if kinds is not None:
            backends = [
                nv.Backend(getattr(nv, kind), load_hint=hint, load_hint_policy=nv.LoadHintPolicy.FIXED)
                for kind, hint in kinds
            ]
        with torch.cuda.device(device_index):
            return nv.Decoder(
                device_id=device_index,
                max_num_cpu_threads=cpu_threads,
                backends=backends,
                options=decoder_options(fancy_upsampling=fancy_upsampling, batch=batch),
            )

    def parse(self, encoded: Sequence[Encoded], *, apart: bool = False) -> EngineBatch:
        return _PythonBatch(self._nv, self._params, encoded)  # its objects are always its own


class _PythonBatch(EngineBatch):
    def __init__(self, nvimgcodec: ModuleType, params: Any, encoded: Sequence[Encoded]) -> None:
        self._nv = nvimgcodec
        self._params = params
        self._streams: dict[int, Any] = {}
        self._wholes: dict[int, Any] = {}
        self._kept: list[Encoded] = []  # rewritten headers, alive until decoded
        count = len(encoded)
        self.headers = Headers(
            [""] * count,
            [0] * count,
            [0] * count,
            [0] * count,
            [False] * count,
            [False] * count,
            [None] * count,
        )
        self.uncertain = set()
        for position, data in enumerate(encoded):
            self._read(position, data)

    def _read(self, position: int, data: Encoded) -> str | None:
        """Parses one image into :attr:`headers`; the reason it cannot be, if not."""
        headers = self.headers
        try:
            stream = _code_stream(self._nv, data)
        except Exception as exc:  # unparsable here: Pillow gets a try
            headers.failures[position] = reason = f"nvImageCodec cannot parse it ({exc})"
            return reason
        headers.failures.pop(position, None)
        self._streams[position] = stream
        # Each property read crosses into nvImageCodec (a GIL round trip): only what the batch needs.
        codec = headers.codecs[position] = stream.codec_name
        headers.heights[position], headers.widths[position] = stream.height, stream.width
        headers.channels[position] = stream.num_channels
        if codec == "jpeg":
            headers.eight_bit[position] = True
            orientation = exif_orientation(data)
            headers.turned[position] = None if orientation is None else orientation >= 5
            if orientation is None or orientation >= 5:
                self.uncertain.add(position)  # the result's shape tells what nvImageCodec made of it
        else:
            headers.eight_bit[position] = str(stream.dtype) == "uint8"
            headers.palette[position] = stream.color_spec == self._nv.ColorSpec.PALETTE
            self.uncertain.add(position)
        return None

    def reparse(self, position: int, data: Encoded) -> str | None:
        self._kept.append(data)
        return self._read(position, data)

    def crop(self, position: int, region: Region) -> bool:
        top, left, height, width = region
        whole = self._streams[position]
        try:
            self._streams[position] = whole.get_sub_code_stream(
                region=self._nv.Region(top, left, top + height, left + width)
            )
        except Exception:
            return False
        self._wholes[position] = whole
        return True

    def uncrop(self, positions: Sequence[int]) -> None:
        for position in positions:
            self._streams[position] = self._wholes.pop(position)

    def submit(self, decoder: Any, memory: dict[int, Memory], stream: int) -> Pending:
        positions = list(memory)
        wrapped = self._nv.as_images([_DeviceBuffer(memory[p]) for p in positions], cuda_stream=stream)
        results = decoder.decode(
            [self._streams[p] for p in positions], images=wrapped, params=self._params, cuda_stream=stream
        )
        extents: dict[int, tuple[int, int] | None] = {}
        for position, result in zip(positions, results, strict=True):
            place = memory[position]
            extents[position] = (
                None
                if result is None
                else _extent_in(result, place)
                if position in self.uncertain
                else place.shape
            )
        return _Done(extents)


def _extent_in(result: Any, place: Memory) -> tuple[int, int] | None:
    """The ``(height, width)`` that ``result`` was decoded as into ``place``, if it is there.

    nvImageCodec reports the shape it produced, which differs from the header's when EXIF orientation
    swaps height and width; it then writes a contiguous image of that shape into the same memory.
    """
    height, width = int(result.shape[0]), int(result.shape[1])
    if (height, width) == place.shape:
        return place.shape
    interface = result.__cuda_array_interface__
    strides = interface.get("strides")
    contiguous = strides is None or tuple(strides) == (width * 3, 3, 1)
    fits = place.row_stride == place.shape[1] * 3 and height * width == place.shape[0] * place.shape[1]
    return (height, width) if interface["data"][0] == place.address and contiguous and fits else None


class _DeviceBuffer:
    """An ``(H, W, 3)`` uint8 CUDA buffer described by ``__cuda_array_interface__`` (version 3).

    Rows may be padded (a region in a padded batch): nvImageCodec writes to strided outputs. Plain
    numbers, not a torch tensor's own interface, which costs far more per image. The memory is kept
    alive by the decoder's allocation, not by this object, until the decode is done.
    """

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, place: Memory) -> None:
        height, width = place.shape
        self.__cuda_array_interface__ = {
            "shape": (height, width, 3),
            "typestr": "|u1",
            "data": (place.address, False),
            "strides": None if place.row_stride == width * 3 else (place.row_stride, 3, 1),
            "stream": None,  # ordering is given by as_images(cuda_stream=...) and decode's stream
            "version": 3,
        }


def _code_stream(nvimgcodec: ModuleType, data: Encoded) -> Any:
    """Parses the header; raises for data nvImageCodec does not recognize."""
    stream = nvimgcodec.CodeStream(data if isinstance(data, bytes) else np.frombuffer(data, dtype=np.uint8))
    _ = stream.height  # some formats (GIF) construct but fail on first access: fail here
    return stream


def import_nvimgcodec() -> ModuleType:
    """Imports nvImageCodec's Python API, or explains how to install it."""
    try:
        from nvidia import nvimgcodec
    except ImportError as exc:
        raise ImportError(
            "GPU decoding needs nvImageCodec for your torch's CUDA (python -c \"import torch; "
            "print(torch.version.cuda)\"): pip install 'nvidia-nvimgcodec-cu13[nvjpeg]' for CUDA 13, "
            "'nvidia-nvimgcodec-cu12[nvjpeg]' for CUDA 12 (in a threadloader checkout: pip install -e "
            "'.[cu13]' or '.[cu12]'); or pass device='cpu'"
        ) from exc
    return nvimgcodec


@functools.cache
def _python_engine() -> PythonApiEngine:
    return PythonApiEngine(import_nvimgcodec())


@functools.cache
def _capi_engine() -> CApiEngine:
    return CApiEngine(_capi.load())  # raises _capi.Unsupported, the same on every call (not cached)


def engine_named(name: str) -> Engine:
    """The process's engine called ``name`` (one of :data:`ENGINES`), made on first use.

    Raises:
        _capi.Unsupported: For ``"capi"`` where the C API cannot be used, saying why.
        ImportError: For ``"python"`` without nvImageCodec.
    """
    if name == "capi":
        return _capi_engine()
    if name == "python":
        return _python_engine()
    raise ValueError(f"engine must be one of {ENGINES}, got {name!r}")
