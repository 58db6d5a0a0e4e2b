"""Decoders behind one small interface: nvImageCodec on the GPU, Pillow on the CPU."""

from .base import DecodedBatch, ImageDecoder
from .nvimgcodec import BACKENDS, NvImageCodecDecoder
from .pillow import PillowDecoder

__all__ = ["BACKENDS", "DecodedBatch", "ImageDecoder", "NvImageCodecDecoder", "PillowDecoder"]
