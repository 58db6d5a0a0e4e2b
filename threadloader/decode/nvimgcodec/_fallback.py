"""The images the GPU gave up on, decoded by Pillow and uploaded: an error only if Pillow fails too.

nvImageCodec returns no image for some inputs it parses (a corrupt scan, a format variant its
decoders refuse), and the header pass sends others to Pillow on purpose (``_parse.py``). Each is
decoded with Pillow and copied into the memory its position had on the GPU where it fits (so a batch
of one size stays one tensor), else uploaded as a tensor of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ...errors import detached
from ..base import Encoded, StageRecorder
from ..pillow import decode_rgb
from ._memory import Assembly, Outputs

__all__ = ["decode_on_cpu"]


def decode_on_cpu(
    encoded: Sequence[Encoded],
    reasons: Mapping[int, str],
    assembly: Assembly,
    memories: Sequence[Outputs],
    *,
    device: torch.device,
    max_pixels: int | None,
    stats: StageRecorder,
) -> None:
    """Decodes each position of ``reasons`` with Pillow into ``assembly``, or fails it there.

    An image goes into the first of ``memories`` that has memory of its size for its position; one
    that Pillow cannot decode either fails with both reasons, Pillow's exception as its cause
    (nvImageCodec gives only a status).
    """
    for position, reason in reasons.items():
        try:
            pixels = torch.from_numpy(decode_rgb(encoded[position], max_pixels=max_pixels))
        except Exception as exc:
            assembly.fail(position, f"{reason}; Pillow: {type(exc).__name__}: {exc}", detached(exc))
            continue  # detached: its frames hold the whole batch
        extent = (int(pixels.shape[0]), int(pixels.shape[1]))
        target = next((memory for memory in memories if memory.holds(position, extent)), None)
        if target is None:
            assembly.keep(position, pixels.to(device))
        else:
            target.view(position).copy_(pixels)
            assembly.place(position, extent, target)
        stats.count("cpu_fallbacks")
