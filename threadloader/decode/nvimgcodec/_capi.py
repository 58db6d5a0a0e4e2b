"""nvImageCodec 0.9's C API through ctypes: a decode core that keeps the GIL for microseconds per batch.

Why not the Python API: it lets go of the GIL about four times per image (a ``CodeStream``, its first
field read, an ``as_images`` wrapper, a result), and each time a training loop waiting for the GIL takes
it and the reader has to win it back (docs/design.md, "GIL releases per image"). Here the per-image
calls (a code stream over the bytes, its header, an output image) are host work of microseconds on
memory, made through :class:`ctypes.PyDLL`, which keeps the GIL; only the per-batch calls that block
(making a Decoder, decoding, waiting) go through :class:`ctypes.CDLL`, which lets go of it.

The binding mirrors the C structs of nvImageCodec 0.9 exactly, and the ABI changed at every minor
release from 0.5 to 0.9, so :func:`load` accepts only 0.9.x, checks the size of every mirrored struct,
and the caller runs a functional self-test before trusting it (``_startup.py``); anything else is
:class:`Unsupported`, and the Python API is used instead. The facts behind every layout and call are in
``nvimgcodec.h`` of the 0.9.0 wheel.

Lifetimes: one :class:`Instance` per process, never destroyed (destroying it at exit would race the
CUDA runtime's own teardown); a :class:`Decoder` is destroyed by the pool that made it once no decoder
uses its configuration (``_registry.py``), never at exit; code streams and images live in a
:class:`Workspace` of one thread, reused batch after batch (the C API re-initializes a non-NULL handle in
place), destroyed with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import sys
import threading
from collections.abc import Sequence
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_float,
    c_int,
    c_int32,
    c_size_t,
    c_uint8,
    c_uint32,
    c_void_p,
    sizeof,
)
from pathlib import Path
from typing import Any

import numpy as np

from ..._gil import Pacer

__all__ = [
    "CPU_ONLY",
    "DEVICE_CPU_ONLY",
    "GPU_ONLY",
    "HW_GPU_ONLY",
    "HYBRID_CPU_GPU",
    "IMAGE_INFO",
    "PALETTE",
    "UINT8",
    "BackendSpec",
    "Decoder",
    "Instance",
    "Library",
    "Submitted",
    "Unsupported",
    "Workspace",
    "load",
    "status_name",
]

# Structure types (nvimgcodecStructureType_t), 0.6 and later.
_PROPERTIES, _INSTANCE_CREATE_INFO, _DECODE_PARAMS = 1, 2, 5
_REGION, _CODE_STREAM_VIEW, _IMAGE_INFO = 8, 9, 11
_BACKEND, _BACKEND_PARAMS, _EXECUTION_PARAMS = 17, 29, 30

#: Backend kinds (nvimgcodecBackendKind_t). Kinds match exactly: nvJPEG's CUDA decoder is HYBRID_CPU_GPU.
CPU_ONLY, GPU_ONLY, HYBRID_CPU_GPU, HW_GPU_ONLY = 1, 2, 3, 4
_LOAD_HINT_FIXED = 2
#: ``device_id`` of a Decoder that decodes into host memory with the CPU backends only.
DEVICE_CPU_ONLY = -99999

#: nvimgcodecSampleDataType_t's 8-bit unsigned samples, and nvimgcodecColorSpec_t's palette: what a
#: header says of an image's samples.
UINT8, PALETTE = 0x0802, 6
_I_RGB, _SRGB, _SAMPLING_NONE = 8, 1, 0
_DEVICE_BUFFER, _HOST_BUFFER = 1, 2  # nvimgcodecImageBufferKind_t: strided device / host memory
_SUCCESS = 1  # nvimgcodecProcessingStatus_t: every failure code has bit 0 set too; compare with ==
_SEVERITY = 0x1000 | 0x10000 | 0x100000  # warnings, errors, fatal errors on stderr
_CATEGORY_ALL = 0x0FFFFFFF

#: nvimgcodecStatus_t's names (0 is success), for messages that say more than a number.
_STATUS_NAMES = (
    "SUCCESS", "NOT_INITIALIZED", "INVALID_PARAMETER", "BAD_CODESTREAM", "CODESTREAM_UNSUPPORTED",
    "ALLOCATOR_FAILURE", "EXECUTION_FAILED", "ARCH_MISMATCH", "INTERNAL_ERROR", "IMPLEMENTATION_UNSUPPORTED",
    "MISSED_DEPENDENCIES", "EXTENSION_NOT_INITIALIZED", "EXTENSION_INVALID_PARAMETER",
    "EXTENSION_BAD_CODE_STREAM", "EXTENSION_CODESTREAM_UNSUPPORTED", "EXTENSION_ALLOCATOR_FAILURE",
    "EXTENSION_ARCH_MISMATCH", "EXTENSION_INTERNAL_ERROR", "EXTENSION_IMPLEMENTATION_NOT_SUPPORTED",
    "EXTENSION_INCOMPLETE_BITSTREAM", "EXTENSION_EXECUTION_FAILED", "EXTENSION_CUDA_CALL_ERROR",
)  # fmt: skip


def status_name(status: int) -> str:
    """``"status 3 (BAD_CODESTREAM)"``: an nvimgcodecStatus_t as a message shows it."""
    name = _STATUS_NAMES[status] if 0 <= status < len(_STATUS_NAMES) else "unknown"
    return f"status {status} ({name})"


_HEADER: list[tuple[str, Any]] = [
    ("struct_type", c_int32),
    ("struct_size", c_size_t),
    ("struct_next", c_void_p),
]


class _Properties(Structure):
    _fields_ = [*_HEADER, ("version", c_uint32), ("cudart_version", c_uint32)]


class _InstanceCreateInfo(Structure):
    _fields_ = [
        *_HEADER,
        ("load_builtin_modules", c_int),
        ("load_extension_modules", c_int),
        ("extension_modules_path", c_char_p),
        ("create_debug_messenger", c_int),
        ("debug_messenger_desc", c_void_p),
        ("message_severity", c_uint32),
        ("message_category", c_uint32),
    ]


class _BackendParams(Structure):
    _fields_ = [*_HEADER, ("load_hint", c_float), ("load_hint_policy", c_int32)]


class _Backend(Structure):
    _fields_ = [*_HEADER, ("kind", c_int32), ("params", _BackendParams)]


class _ExecutionParams(Structure):
    _fields_ = [
        *_HEADER,
        ("device_allocator", c_void_p),
        ("pinned_allocator", c_void_p),
        ("max_num_cpu_threads", c_int),
        ("executor", c_void_p),
        ("device_id", c_int),
        ("pre_init", c_int),
        ("skip_pre_sync", c_int),
        ("num_backends", c_int),
        ("backends", POINTER(_Backend)),
    ]


class _Orientation(Structure):
    _fields_ = [*_HEADER, ("rotated", c_int), ("flip_x", c_int), ("flip_y", c_int)]


class _ImagePlaneInfo(Structure):
    _fields_ = [
        *_HEADER,
        ("width", c_uint32),
        ("height", c_uint32),
        ("row_stride", c_size_t),
        ("num_channels", c_uint32),
        ("sample_type", c_int32),
        ("precision", c_uint8),
    ]


class _ImageInfo(Structure):
    _fields_ = [
        *_HEADER,
        ("codec_name", ctypes.c_char * 256),
        ("color_spec", c_int32),
        ("chroma_subsampling", c_int32),
        ("sample_format", c_int32),
        ("orientation", _Orientation),
        ("num_planes", c_uint32),
        ("plane_info", _ImagePlaneInfo * 32),
        ("buffer", c_void_p),
        ("buffer_kind", c_int32),
        ("cuda_stream", c_void_p),
    ]


class _OutOfBoundsSample(Structure):
    _fields_ = [("value", c_uint32), ("type", c_int32)]


class _Region(Structure):
    _fields_ = [
        *_HEADER,
        ("ndim", c_int),
        ("start", c_int * 5),
        ("end", c_int * 5),
        ("out_of_bounds_policy", c_int32),
        ("out_of_bounds_samples", _OutOfBoundsSample * 5),
    ]


class _CodeStreamView(Structure):
    _fields_ = [*_HEADER, ("image_idx", c_size_t), ("region", _Region), ("bitstream_offset", c_size_t)]


class _DecodeParams(Structure):
    _fields_ = [*_HEADER, ("apply_exif_orientation", c_int)]


#: sizeof() of each struct in nvImageCodec 0.9's header, printed by gcc on x86-64.
_SIZES = {
    _Properties: 32,
    _InstanceCreateInfo: 64,
    _BackendParams: 32,
    _Backend: 64,
    _ExecutionParams: 80,
    _Orientation: 40,
    _ImagePlaneInfo: 56,
    _ImageInfo: 2160,
    _Region: 112,
    _CodeStreamView: 152,
    _DecodeParams: 32,
}


def _offset(*path: str) -> int:
    """Byte offset of a (nested) field of ImageInfo, e.g. ``("orientation", "rotated")``."""
    offset, struct = 0, _ImageInfo
    for name in path:
        offset += getattr(struct, name).offset
        kind: Any = dict(struct._fields_)[name]  # type: ignore[arg-type]
        struct = getattr(kind, "_type_", kind)  # an array's element type (plane_info[0])
    return offset


#: The ImageInfo fields this module reads or writes: (name here, numpy type, path in the C struct).
_INFO_FIELDS = (
    ("struct_type", "<i4", ("struct_type",)),
    ("struct_size", "<u8", ("struct_size",)),
    ("struct_next", "<u8", ("struct_next",)),
    ("codec", "S8", ("codec_name",)),  # the name's first 8 bytes: "jpeg", "jpeg2k", "png"...
    ("color_spec", "<i4", ("color_spec",)),
    ("chroma", "<i4", ("chroma_subsampling",)),
    ("sample_format", "<i4", ("sample_format",)),
    ("rotated", "<i4", ("orientation", "rotated")),  # counter-clockwise degrees, from EXIF
    ("flip_x", "<i4", ("orientation", "flip_x")),
    ("flip_y", "<i4", ("orientation", "flip_y")),
    ("num_planes", "<u4", ("num_planes",)),
    ("width", "<u4", ("plane_info", "width")),  # of the first plane: the image's, as stored
    ("height", "<u4", ("plane_info", "height")),
    ("row_stride", "<u8", ("plane_info", "row_stride")),
    ("num_channels", "<u4", ("plane_info", "num_channels")),
    ("sample_type", "<i4", ("plane_info", "sample_type")),
    ("precision", "u1", ("plane_info", "precision")),
    ("buffer", "<u8", ("buffer",)),
    ("buffer_kind", "<i4", ("buffer_kind",)),
    ("cuda_stream", "<u8", ("cuda_stream",)),
)

#: ImageInfo as a numpy record, so that a batch's headers are read, and its outputs described, with
#: one vectorised step per field instead of a ctypes access per image and field.
IMAGE_INFO = np.dtype(
    {
        "names": [name for name, _, _ in _INFO_FIELDS],
        "formats": [kind for _, kind, _ in _INFO_FIELDS],
        "offsets": [_offset(*path) for _, _, path in _INFO_FIELDS],
        "itemsize": sizeof(_ImageInfo),
    }
)


class Unsupported(RuntimeError):
    """The C API cannot be used here; the message says why (the Python API is used instead)."""


#: Each entry point: (name, argument types, whether it may block and so must let go of the GIL).
_FUNCTIONS = (
    ("nvimgcodecGetProperties", [c_void_p], False),
    ("nvimgcodecInstanceCreate", [c_void_p, c_void_p], True),
    ("nvimgcodecDecoderCreate", [c_void_p, c_void_p, c_void_p, c_char_p], True),
    ("nvimgcodecDecoderDestroy", [c_void_p], True),  # joins its threads, frees its CUDA resources
    ("nvimgcodecCodeStreamCreateFromHostMem", [c_void_p, c_void_p, c_void_p, c_size_t, c_void_p], False),
    ("nvimgcodecCodeStreamGetImageInfo", [c_void_p, c_void_p], False),
    ("nvimgcodecCodeStreamGetSubCodeStream", [c_void_p, c_void_p, c_void_p], False),
    ("nvimgcodecCodeStreamDestroy", [c_void_p], False),
    ("nvimgcodecImageCreate", [c_void_p, c_void_p, c_void_p], False),
    ("nvimgcodecImageDestroy", [c_void_p], False),
    ("nvimgcodecDecoderDecode", [c_void_p, c_void_p, c_void_p, c_int, c_void_p, c_void_p], True),
    ("nvimgcodecFutureWaitForAll", [c_void_p], True),
    ("nvimgcodecFutureGetProcessingStatus", [c_void_p, c_void_p, c_void_p], False),
    ("nvimgcodecFutureDestroy", [c_void_p], False),
)


class Library:
    """``libnvimgcodec.so.0`` of an installed nvImageCodec, each entry point bound once.

    Loaded by absolute path from the package's folder, so that the Python API, if imported too, shares
    the same copy of the library, and no other copy on the search path is picked up.

    Raises:
        Unsupported: The library does not load, lacks an entry point, or is not 0.9.x.
    """

    def __init__(self, directory: Path) -> None:
        path = directory / "libnvimgcodec.so.0"
        self.extensions = directory / "extensions"
        try:
            held, released = ctypes.PyDLL(str(path)), ctypes.CDLL(str(path))
            for name, argtypes, blocks in _FUNCTIONS:
                function = getattr(released if blocks else held, name)
                function.argtypes, function.restype = argtypes, c_int
                setattr(self, name.removeprefix("nvimgcodec"), function)
        except (OSError, AttributeError) as exc:
            raise Unsupported(f"cannot load {path}: {exc}") from exc
        properties = _Properties(_PROPERTIES, sizeof(_Properties), None)
        status = self.GetProperties(ctypes.byref(properties))
        if status != 0:
            raise Unsupported(
                f"nvimgcodecGetProperties failed with {status_name(status)} (nvImageCodec < 0.6?)"
            )
        self.version = properties.version  # major * 1000 + minor * 100 + patch
        self.cudart_version = properties.cudart_version
        if self.version // 100 != 9:
            major, minor, patch = self.version // 1000, self.version // 100 % 10, self.version % 100
            raise Unsupported(
                f"nvImageCodec {major}.{minor}.{patch} is installed; the C API binding is for 0.9.x only "
                "(its structs change at every minor release)"
            )

    GetProperties: Any
    InstanceCreate: Any
    DecoderCreate: Any
    DecoderDestroy: Any
    CodeStreamCreateFromHostMem: Any
    CodeStreamGetImageInfo: Any
    CodeStreamGetSubCodeStream: Any
    CodeStreamDestroy: Any
    ImageCreate: Any
    ImageDestroy: Any
    DecoderDecode: Any
    FutureWaitForAll: Any
    FutureGetProcessingStatus: Any
    FutureDestroy: Any


class Instance:
    """An nvImageCodec instance (its codec registry and extension modules); one per process.

    Raises:
        Unsupported: If it cannot be created.
    """

    def __init__(self, library: Library) -> None:
        self.library = library
        self._extensions = str(library.extensions).encode()  # kept alive during the call
        info = _InstanceCreateInfo(
            _INSTANCE_CREATE_INFO,
            sizeof(_InstanceCreateInfo),
            None,
            1,  # the built-in modules are the format parsers: without them nothing parses
            1,
            self._extensions,  # explicit: an inherited NVIMGCODEC_EXTENSIONS_PATH does not apply
            1,
            None,
            _SEVERITY,
            _CATEGORY_ALL,
        )
        handle = c_void_p()
        status = library.InstanceCreate(ctypes.byref(handle), ctypes.byref(info))
        if status != 0 or not handle.value:
            raise Unsupported(f"nvimgcodecInstanceCreate failed with {status_name(status)}")
        self.handle: int = handle.value


#: A backend a Decoder may use: ``(kind, load hint)``, the hint being the share of each batch it takes.
BackendSpec = tuple[int, float]


class Decoder:
    """An nvImageCodec Decoder: one thread submits to it at a time (its pool, ``_registry.py``, ensures it).

    Args:
        instance: The process's instance.
        device_id: A CUDA device index, or :data:`DEVICE_CPU_ONLY`.
        backends: The backends it may use; ``None`` lets it use all, nvImageCodec choosing per image.
        cpu_threads: Its own CPU threads (Huffman decoding, CPU codecs).
        options: Decoder options (``"nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"``); ``""`` keeps
            each decoder's defaults.
        allocators: Addresses of an ``nvimgcodecDeviceAllocator_t`` and an
            ``nvimgcodecPinnedAllocator_t`` that outlive the Decoder (``_allocators.py``); ``None``:
            nvImageCodec's own.

    Raises:
        RuntimeError: If nvImageCodec cannot make it (the status names the reason).
    """

    def __init__(
        self,
        instance: Instance,
        *,
        device_id: int,
        backends: Sequence[BackendSpec] | None,
        cpu_threads: int,
        options: str = "",
        allocators: tuple[int, int] | None = None,
    ) -> None:
        self.instance = instance
        self.device_id = device_id
        self.host = device_id == DEVICE_CPU_ONLY
        chosen = (_Backend * max(1, len(backends or ())))()
        for slot, (kind, load_hint) in zip(chosen, backends or (), strict=False):
            slot.struct_type, slot.struct_size, slot.kind = _BACKEND, sizeof(_Backend), kind
            slot.params = _BackendParams(
                _BACKEND_PARAMS, sizeof(_BackendParams), None, load_hint, _LOAD_HINT_FIXED
            )
        params = _ExecutionParams(
            _EXECUTION_PARAMS,
            sizeof(_ExecutionParams),
            None,
            *(allocators or (None, None)),
            cpu_threads,
            None,
            device_id,
            1,  # pre_init: codecs made now, not inside the first decode
            0,  # skip_pre_sync off: its streams wait for ours, which orders torch's allocations first
            len(backends or ()),
            chosen if backends else None,
        )
        handle = c_void_p()
        status = instance.library.DecoderCreate(
            instance.handle, ctypes.byref(handle), ctypes.byref(params), options.encode()
        )
        if status != 0 or not handle.value:
            raise RuntimeError(
                f"nvImageCodec could not make a Decoder on device {device_id} with backends {backends} "
                f"({status_name(status)})"
            )
        self.handle: int = handle.value

    def destroy(self) -> None:
        """Frees the Decoder: its threads, its device memory. Idempotent; never while it decodes."""
        handle, self.handle = self.handle, 0
        if handle:
            self.instance.library.DecoderDestroy(handle)


_MAX_RESULT_POSITIONS = 1 << 16


class Workspace:
    """One thread's code streams, output images and their ImageInfos, reused batch after batch.

    Owned by one thread at a time: nothing here is locked. Positions are a batch's indices; a batch is
    parsed (:meth:`parse`), given its outputs (:meth:`bind`), and decoded (:meth:`submit`, then
    :meth:`Submitted.wait`) before the next one reuses the handles.

    Attributes:
        infos: Per position, the header nvImageCodec read (:meth:`parse`), then the output it is
            decoded as (:meth:`bind`), as :data:`IMAGE_INFO` records.
    """

    def __init__(self, instance: Instance) -> None:
        self._instance = instance
        self._library = instance.library
        self._capacity = 0
        # Handles, per position: code streams, their regions' sub-streams, output images (0: none yet).
        self._streams = self._regions = self._images = np.zeros(0, dtype=np.uint64)
        self._streams_at = self._regions_at = self._images_at = self._infos_at = 0
        self._chosen = np.zeros(0, dtype=np.uint64)  # per position: what is decoded, a stream or a region
        self.infos = np.zeros(0, IMAGE_INFO)
        self._data: list[Any] = []  # what each code stream reads: kept alive until the next parse
        self._count = 0  # positions of the batch parsed last
        self._view = _CodeStreamView(_CODE_STREAM_VIEW, sizeof(_CodeStreamView), None)
        self._view.region.struct_type, self._view.region.struct_size = _REGION, sizeof(_Region)
        self._view.region.ndim = 2
        self._params = _DecodeParams(_DECODE_PARAMS, sizeof(_DecodeParams), None, 1)  # EXIF applied

    def _reserve(self, count: int) -> None:
        """Grows the handle and info arrays to ``count`` positions, keeping the handles made so far."""
        if count <= self._capacity:
            return
        capacity = max(count, 2 * self._capacity, 64)
        grow = functools.partial(np.pad, pad_width=(0, capacity - self._capacity))
        self._streams, self._regions, self._images = (
            grow(self._streams),
            grow(self._regions),
            grow(self._images),
        )
        self._chosen = np.zeros(capacity, dtype=np.uint64)
        self.infos = np.zeros(capacity, IMAGE_INFO)
        self.infos["struct_type"], self.infos["struct_size"] = _IMAGE_INFO, IMAGE_INFO.itemsize
        self._capacity = capacity
        # Addresses read once: each ``.ctypes`` access makes a Python object, about a microsecond.
        self._streams_at, self._regions_at = self._streams.ctypes.data, self._regions.ctypes.data
        self._images_at, self._infos_at = self._images.ctypes.data, self.infos.ctypes.data

    def parse(self, data: Sequence[Any]) -> list[int]:
        """Makes a code stream over each encoded image and reads its header into :attr:`infos`.

        Args:
            data: Encoded images, ``bytes`` or any object with the buffer protocol; each must stay
                alive and unchanged until the call :meth:`submit` starts has been waited for.

        Returns:
            Per position, 0 where the header was read, else nvImageCodec's status (an unknown format,
            a corrupt header).
        """
        count = len(data)
        self._reserve(count)
        self._count = count
        self.infos[:count]["struct_next"] = 0
        self._data = [None] * count
        statuses = []
        pacer = Pacer()
        for position, item in enumerate(data):
            statuses.append(self._parse_one(position, item))
            pacer.tick()
        self._chosen[:count] = self._streams[:count]
        return statuses

    def reparse(self, position: int, data: Any) -> int:
        """Parses other bytes at ``position`` (a rewritten header); nvImageCodec's status, 0 if read."""
        self._check_positions([position])
        status = self._parse_one(position, data)
        self._chosen[position] = self._streams[position]
        return status

    def _parse_one(self, position: int, item: Any) -> int:
        """Points the code stream at ``position`` to ``item`` and reads its header; the status."""
        if isinstance(item, bytes):
            pointer: Any = item  # ctypes passes a pointer to the bytes themselves
        else:  # a bytearray, a memoryview: its address
            item = np.frombuffer(item, dtype=np.uint8)
            pointer = item.ctypes.data
        self._data[position] = item
        library = self._library
        status = library.CodeStreamCreateFromHostMem(
            self._instance.handle, self._streams_at + 8 * position, pointer, len(item), None
        )
        if status == 0:
            status = library.CodeStreamGetImageInfo(
                int(self._streams[position]), self._infos_at + IMAGE_INFO.itemsize * position
            )
        return status

    def crop(self, position: int, top: int, left: int, height: int, width: int) -> int:
        """Decodes only a region of the image at ``position`` (display coordinates, EXIF applied).

        Returns:
            nvImageCodec's status, 0 if the region was set; the whole image is decoded otherwise.
        """
        self._check_positions([position])
        region = self._view.region
        region.start[0], region.start[1], region.end[0], region.end[1] = top, left, top + height, left + width
        status = self._library.CodeStreamGetSubCodeStream(
            int(self._streams[position]), self._regions_at + 8 * position, ctypes.byref(self._view)
        )
        if status == 0:
            self._chosen[position] = self._regions[position]
        return status

    def uncrop(self, positions: Sequence[int]) -> None:
        """Decodes the whole images at ``positions`` again (regions the decoder gave up on)."""
        self._check_positions(positions)
        index = np.asarray(positions, dtype=np.intp)
        self._chosen[index] = self._streams[index]

    def bind(
        self,
        positions: Sequence[int],
        addresses: Sequence[int],
        shapes: Sequence[tuple[int, int]],
        row_strides: Sequence[int],
        *,
        stream: int | None,
        host: bool = False,
    ) -> list[int]:
        """Describes the memory each position decodes into, as interleaved RGB ``uint8``.

        nvImageCodec writes ``height`` rows of ``width * 3`` bytes, ``row_stride`` bytes apart, from the
        address, and nothing there checks that the memory is that large: the caller allocates it (the
        tests check with guard bytes). What is checked here is what this binding writes itself: each
        position is one of the batch parsed last (its handles and ImageInfo are slots of arrays of that
        size), and each description is an image (a positive size, rows that do not overlap, an address).
        ``shapes`` are the decoded sizes: a region's, or the image's as displayed.

        Args:
            positions: Positions parsed without error.
            addresses: Where each one's first pixel goes.
            shapes: ``(height, width)`` of each.
            row_strides: Bytes from one row to the next, at least ``3 * width``.
            stream: The CUDA stream the decode is ordered on (its raw handle), for device memory.
            host: Whether the memory is host memory (a Decoder made with :data:`DEVICE_CPU_ONLY`).

        Returns:
            Per position, nvImageCodec's status: 0 where the output image was made.

        Raises:
            ValueError: For a position not of the batch parsed last, lists of different lengths, or an
                image that is not one (nothing has been written then).
        """
        self._check_positions(positions)
        if not len(positions) == len(addresses) == len(shapes) == len(row_strides):
            raise ValueError(
                f"bind needs one address, shape and row stride per position: got {len(positions)} "
                f"positions, {len(addresses)} addresses, {len(shapes)} shapes, {len(row_strides)} strides"
            )
        for position, address, (height, width), stride in zip(
            positions, addresses, shapes, row_strides, strict=True
        ):
            if height < 1 or width < 1 or stride < 3 * width or not address:
                raise ValueError(
                    f"position {position}: {height}x{width} at address {address:#x} with rows {stride} "
                    "bytes apart is not an image's memory (a positive size, rows of at least 3 * width "
                    "bytes, an address)"
                )
        index = np.asarray(positions, dtype=np.intp)
        infos = self.infos
        heights, widths = zip(*shapes, strict=True) if len(shapes) else ((), ())
        chosen = infos[index]
        for name, value in (
            ("struct_type", _IMAGE_INFO),
            ("struct_size", IMAGE_INFO.itemsize),
            ("struct_next", 0),
            ("color_spec", _SRGB),
            ("chroma", _SAMPLING_NONE),
            ("sample_format", _I_RGB),
            ("num_planes", 1),
            ("num_channels", 3),
            ("sample_type", UINT8),
            ("precision", 0),
            ("height", heights),
            ("width", widths),
            ("row_stride", row_strides),
            ("buffer", addresses),
            ("buffer_kind", _HOST_BUFFER if host else _DEVICE_BUFFER),
            ("cuda_stream", stream or 0),
        ):
            chosen[name] = value
        infos[index] = chosen  # the orientation read from the header stays: the decoder applies it from here
        make, instance = self._library.ImageCreate, self._instance.handle
        images, infos_at, size = self._images_at, self._infos_at, IMAGE_INFO.itemsize
        statuses = []
        pacer = Pacer()
        for position in positions:
            statuses.append(make(instance, images + 8 * position, infos_at + size * position))
            pacer.tick()
        return statuses

    def _check_positions(self, positions: Sequence[int]) -> None:
        """Raises for a position outside the batch parsed last, before anything writes there."""
        outside = [p for p in positions if not 0 <= p < self._count]
        if outside:
            raise ValueError(
                f"positions {outside} are not of the batch parsed last ({self._count} images): parse the "
                "batch before binding, cropping or decoding its positions"
            )

    def submit(self, decoder: Decoder, positions: Sequence[int]) -> Submitted:
        """Starts decoding the bound positions in one call; :meth:`Submitted.wait` gives the results.

        Once this returns, another thread may submit to the same Decoder: nvImageCodec starts that
        call when this one's host work is done, without waiting for this thread to come back for its
        results. Until :meth:`Submitted.wait` returns, this workspace must not parse or bind again.

        Raises:
            RuntimeError: If the call itself fails (not an image: those are ``False`` in the results).
        """
        count = len(positions)
        if count == 0:
            return Submitted(self, None, 0)
        self._check_positions(positions)
        if count > _MAX_RESULT_POSITIONS:
            raise ValueError(f"at most {_MAX_RESULT_POSITIONS} images per decode call, got {count}")
        index = np.asarray(positions, dtype=np.intp)
        streams = self._chosen[index]  # fancy indexing: contiguous copies, kept until the wait
        images = self._images[index]
        future = c_void_p()
        status = self._library.DecoderDecode(
            decoder.handle, streams.ctypes.data, images.ctypes.data, count, ctypes.byref(self._params),
            ctypes.byref(future),
        )  # fmt: skip
        if status != 0 or not future.value:
            raise RuntimeError(f"nvimgcodecDecoderDecode failed with {status_name(status)}")
        return Submitted(self, future, count, (streams, images))

    def close(self) -> None:
        """Destroys the code streams and images (never while a decode of this workspace runs)."""
        library = self._library
        for handles, destroy in (
            (self._regions, library.CodeStreamDestroy),  # sub-streams first: they share their parent's
            (self._streams, library.CodeStreamDestroy),
            (self._images, library.ImageDestroy),
        ):
            for handle in handles[handles != 0].tolist():
                destroy(handle)
            handles[:] = 0
        self._data = []

    def __del__(self) -> None:
        # At interpreter exit the library may already be going away: the process frees it all anyway.
        if not sys.is_finalizing():
            self.close()


class Submitted:
    """A decode call under way, from :meth:`Workspace.submit`: its results once its host work is done.

    Waiting is the submitting thread's, once: the future, the workspace's code streams and the decode
    parameters stay alive until then, as nvImageCodec needs (its worker threads read them).
    """

    def __init__(
        self, workspace: Workspace, future: c_void_p | None, count: int, keep: tuple[Any, ...] = ()
    ) -> None:
        self._workspace = workspace
        self._future = future
        self._count = count
        self._keep = keep
        self._results: list[bool] | None = None if future is not None else []

    def wait(self) -> list[bool]:
        """Waits for the call's host work (the GIL let go); whether each position decoded.

        Once this returns, the device work is ordered before later work on the stream given to
        :meth:`Workspace.bind`. Later calls return the same results.

        Raises:
            RuntimeError: If nvImageCodec reports the call as a whole failed (raised once).
        """
        if self._results is not None:
            return self._results
        future = self._future
        if future is None:
            raise RuntimeError("this decode call's wait already failed")
        library = self._workspace._library
        count = self._count
        try:  # the future stays ours until here: an interrupt before leaves it to __del__ to wait for
            status = library.FutureWaitForAll(future)
            results = (c_uint32 * count)()
            got = c_size_t()
            if status == 0:
                status = library.FutureGetProcessingStatus(future, results, ctypes.byref(got))
        finally:
            self._future = None
            library.FutureDestroy(future)
            self._keep = ()
        if status != 0 or got.value != count:
            raise RuntimeError(
                f"nvImageCodec's decode failed with {status_name(status)} ({got.value} results)"
            )
        self._results = [result == _SUCCESS for result in results]
        return self._results

    def __del__(self) -> None:
        # Dropped unwaited (its thread interrupted): wait, so the workspace is not reused or freed under
        # nvImageCodec's threads. At interpreter exit the library may already be going away.
        if self._future is not None and not sys.is_finalizing():
            with contextlib.suppress(RuntimeError):
                self.wait()


def _package_directory() -> Path:
    """The folder of the installed ``nvidia.nvimgcodec`` package, found without importing it."""
    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except (ImportError, ValueError) as exc:
        raise Unsupported(f"nvImageCodec is not installed ({exc})") from exc
    if spec is None or not spec.submodule_search_locations:
        raise Unsupported("nvImageCodec is not installed (no nvidia.nvimgcodec package)")
    return Path(next(iter(spec.submodule_search_locations)))


_lock = threading.Lock()
_library: Library | Unsupported | None = None
_loaded: Instance | Unsupported | None = None


def library() -> Library:
    """The installed nvImageCodec's library, loaded and checked on first call, without an instance.

    Enough for its version and CUDA runtime (a front end's check when it is built); the instance,
    which loads the codecs' own libraries, is :func:`load`'s.

    Raises:
        Unsupported: Why the C API cannot be used here (the same reason on every call).
    """
    global _library
    with _lock:
        if _library is None:
            try:
                mismatched = {s.__name__: (sizeof(s), n) for s, n in _SIZES.items() if sizeof(s) != n}
                if mismatched or IMAGE_INFO.itemsize != sizeof(_ImageInfo):
                    raise Unsupported(
                        f"the mirrored structs do not have nvImageCodec 0.9's sizes: {mismatched}"
                    )
                _library = Library(_package_directory())
            except Unsupported as exc:
                _library = exc
        if isinstance(_library, Unsupported):
            raise _library
        return _library


def load() -> Instance:
    """The process's instance over the installed nvImageCodec, made on first call.

    Raises:
        Unsupported: Why the C API cannot be used here (the same reason on every call).
    """
    global _loaded
    loaded = library()
    with _lock:
        if _loaded is None:
            try:
                _loaded = Instance(loaded)
            except Unsupported as exc:
                _loaded = exc
        if isinstance(_loaded, Unsupported):
            raise _loaded
        return _loaded
