"""Decode memory: one torch allocation per batch, where each image goes in it, and which stream owns it.

Outputs are decoded straight into torch memory, as rows of one batch tensor where they fit
(``DecodedBatch``), so no tensor is made per image: each would cost GIL hand-offs (docs/design.md,
"GIL releases per image"). nvImageCodec checks nothing of that memory, so where each image goes is
decided here, and the GPU tests decode into guarded memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..base import DecodedBatch
from ._engines import Memory

__all__ = ["PAD_MEMORY", "Assembly", "Outputs", "allocate", "dense", "output_memory"]

#: Most memory a padded batch of whole images may take, as a multiple of the images' own: beyond it,
#: images of very different sizes are decoded into a flat buffer and resized one by one.
PAD_MEMORY = 2.5

Allocate = Callable[[tuple[int, ...]], torch.Tensor]


@dataclass
class Outputs:
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

    def holds(self, position: int, extent: tuple[int, int]) -> bool:
        """Whether ``position`` has memory here of exactly ``extent``."""
        place = self.memory.get(position)
        return place is not None and place.shape == extent


def allocate(
    shapes: dict[int, tuple[int, int]], *, count: int, regions: bool, pad: bool, memory: Allocate
) -> Outputs:
    """The outputs of a batch of ``count`` positions, in one allocation made by ``memory``.

    Rows of a ``(B, H, W, 3)`` tensor when all shapes agree: every row is there, so an image that Pillow
    decodes to that size fills its own. Regions of different sizes (``regions``: every shape is one),
    and with ``pad`` whole images of different sizes where padding costs at most :data:`PAD_MEMORY`
    times their own memory, go to the top-left corners of the rows of a ``(B, Hmax, Wmax, 3)`` tensor,
    which the resize then reads as one batch (the region contract of ``decode/base.py``). Other images
    of different sizes: one after the other in one flat buffer.
    """
    outputs = Outputs()
    if not shapes:
        return outputs
    height = max(h for h, _ in shapes.values())
    width = max(w for _, w in shapes.values())
    same = len(set(shapes.values())) == 1
    own = sum(h * w for h, w in shapes.values())
    if not (same or regions or (pad and count * height * width <= PAD_MEMORY * own)):
        return dense(shapes, memory)
    outputs.tensor = memory((count, height, width, 3))
    outputs.rows = True
    base, step = outputs.tensor.data_ptr(), height * width * 3
    outputs.memory = {p: Memory(base + p * step, shape, width * 3) for p, shape in shapes.items()}
    if same:  # every row: an image that Pillow decodes to that size fills its own
        outputs.memory.update(
            (p, Memory(base + p * step, (height, width), width * 3)) for p in range(count) if p not in shapes
        )
    return outputs


def dense(shapes: dict[int, tuple[int, int]], memory: Allocate) -> Outputs:
    """Images of ``shapes`` one after the other in one flat buffer made by ``memory``."""
    sizes = [h * w * 3 for h, w in shapes.values()]
    flat = memory((sum(sizes),))
    outputs = Outputs(tensor=flat, rows=False)
    address = flat.data_ptr()
    for (position, shape), size in zip(shapes.items(), sizes, strict=True):
        outputs.memory[position] = Memory(address, shape, shape[1] * 3)
        address += size
    return outputs


def output_memory(
    shape: tuple[int, ...], device: torch.device, allocation_stream: torch.cuda.Stream
) -> torch.Tensor:
    """Memory for nvImageCodec to decode into, never memory that queued work may still read.

    nvImageCodec does not always wait for work queued earlier on ``cuda_stream`` before it writes
    into the output (docs/design.md, "Decode memory that no queued work still reads"). Memory
    allocated on the calling stream can be an earlier group's, freed while that stream still has
    work reading it. So it is allocated from a stream that runs nothing and marked as used by the
    calling stream: torch's allocator then reuses it only once the calling stream has passed the
    point where it was freed, without a host sync.
    """
    with torch.cuda.stream(allocation_stream):
        memory = torch.empty(shape, dtype=torch.uint8, device=device)
    memory.record_stream(torch.cuda.current_stream(device))
    return memory


@dataclass
class Assembly:
    """A batch's result as it is put together: where each position's image is, or why it has none."""

    extents: list[tuple[int, int] | None]
    rows: set[int] = field(default_factory=set)
    own: dict[int, torch.Tensor] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    causes: dict[int, BaseException] = field(default_factory=dict)

    def place(self, position: int, extent: tuple[int, int], outputs: Outputs) -> None:
        """``position`` decoded as ``extent`` into ``outputs``: a row of its batch, or a view of its own.

        A row if it fills its memory there; else (a flat buffer's image, a turned one, a whole image
        after a region) a view.
        """
        self.extents[position] = extent
        if outputs.rows and outputs.holds(position, extent):
            self.rows.add(position)
            self.own.pop(position, None)
        else:
            self.own[position] = outputs.view(position, extent)

    def keep(self, position: int, image: torch.Tensor) -> None:
        """``position`` decoded into a tensor of its own."""
        self.extents[position] = (int(image.shape[0]), int(image.shape[1]))
        self.rows.discard(position)
        self.own[position] = image

    def fail(self, position: int, error: str, cause: BaseException | None = None) -> None:
        """``position`` could not be decoded, for this reason."""
        self.errors[position] = error
        if cause is not None:
            self.causes[position] = cause

    def result(self, outputs: Outputs, regions: set[int]) -> DecodedBatch:
        """The decoder's output: ``outputs``' batch tensor, if it has rows, and what was placed."""
        return DecodedBatch(
            extents=self.extents,
            errors=self.errors,
            batch=outputs.tensor if outputs.rows else None,
            rows=self.rows,
            own=self.own,
            regions=regions,
            causes=self.causes,
        )
