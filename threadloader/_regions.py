"""Region decoding: a random crop's region decoded alone, instead of the whole image and a crop.

The contract's types live here; each part of it acts where its data is:

1. A transform says which part of an image it reads: ``Transform.split_region(params)`` returns the
   region and the parameters that give the same output from the region alone (``transforms/``).
   Its ``apply_many`` must then accept a batch tensor of regions padded to one size, each at the top
   left of its row; the padding holds arbitrary finite values.
2. The pipeline draws a sample's parameters from the size in the header and asks the transform for its
   region: ``_Plans.region_of``, a :data:`RegionOf` that the decoder calls (``_pipeline.py``).
3. A decoder that can decode part of an image asks ``region_of`` with the size as displayed and
   reports what it decoded as a region: ``DecodedBatch.regions``, ``DecodedBatch.batch`` and its
   ``rows`` and ``extents`` (``decode/base.py``); a region it gave up on is decoded whole and left out of
   ``regions``, so the pipeline crops it with the parameters drawn from the whole image.
4. The GPU decoder puts regions of different sizes at the top-left corners of one padded
   ``(B, Hmax, Wmax, 3)`` tensor, which the crop's resampling reads as one batch:
   ``NvImageCodecDecoder._allocate`` (``decode/nvimgcodec.py``).

docs/design.md ("Region decoding for random crops") says why.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Region", "RegionOf"]

#: A region of an image: ``(top, left, height, width)``.
Region = tuple[int, int, int, int]

#: Asked by a decoder that can decode part of an image, with a sample's position in the batch and its
#: displayed ``(height, width)``: the region to decode, or ``None``.
RegionOf = Callable[[int, tuple[int, int]], Region | None]
