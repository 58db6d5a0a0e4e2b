"""Decoders behind one small interface: nvImageCodec on the GPU, Pillow on the CPU.

A decoder of one's own (``decoder=`` of the front ends) subclasses :class:`ImageDecoder`; the contract
and every type in its signature are in ``base.py``, exported here.
"""

from .base import DecodedBatch, Encoded, ImageDecoder, Region, RegionOf, StageRecorder
from .nvimgcodec import BACKENDS, NvImageCodecDecoder
from .pillow import PillowDecoder

__all__ = [
    "BACKENDS",
    "DecodedBatch",
    "Encoded",
    "ImageDecoder",
    "NvImageCodecDecoder",
    "PillowDecoder",
    "Region",
    "RegionOf",
    "StageRecorder",
]
