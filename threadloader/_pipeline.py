"""What a reader thread does with one batch: fetch, read, decode, format, seal.

Shared by every front end (the training loader, the inference service): they differ in where batches
come from, not in how a batch is made. Everything here runs in a reader thread, on that thread's CUDA
stream, and ends with the event that the consumer's stream waits on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import default_collate

from ._handoff import ReaderStream, Ready
from ._sources import SampleRef, Source, fetch, read_bytes
from ._stats import StatsRecorder
from .decode.base import Encoded, ImageDecoder
from .errors import SampleError
from .transforms import OutputFormat

__all__ = ["Batch", "BatchProducer", "OnError", "collate_targets"]

OnError = Literal["raise", "skip"]
logger = logging.getLogger("threadloader")


@dataclass
class Batch:
    """A finished batch, not yet safe to use on the consumer's stream until ``ready.receive()``."""

    images: torch.Tensor | list[torch.Tensor]
    targets: Any
    indices: list[int]
    ready: Ready


class BatchProducer:
    """Makes batches from sample indices; safe to call from many threads at once.

    Args:
        source: Indexed by reader threads.
        decoder: Decodes a batch on the thread's stream.
        output: Resize, dtype, normalization and layout of every batch.
        on_error: ``"raise"`` makes the batch fail with the sample's :class:`SampleError`; ``"skip"`` logs
            a warning, counts the sample and leaves it out.
        stats: Where counters and stage times go.
    """

    def __init__(
        self,
        *,
        source: Source,
        decoder: ImageDecoder,
        output: OutputFormat,
        on_error: OnError,
        stats: StatsRecorder,
    ) -> None:
        self._source = source
        self._decoder = decoder
        self._output = output
        self._on_error = on_error
        self._stats = stats

    def produce(self, indices: Sequence[int], reader: ReaderStream) -> Batch | None:
        """Makes the batch of ``indices`` on ``reader``'s stream; ``None`` when every sample was skipped.

        Raises:
            SampleError: For the first bad sample, with ``on_error="raise"``.
        """
        refs: list[SampleRef] = []
        blobs: list[Encoded] = []
        fetching = reading = 0.0  # summed here and recorded once: a timer per sample costs more than a read
        for index in indices:
            started = time.perf_counter()
            try:
                ref = fetch(self._source, index)
                fetched = time.perf_counter()
                fetching += fetched - started
                blob = read_bytes(ref)
                reading += time.perf_counter() - fetched
            except SampleError as error:
                self._reject(error)
                continue
            refs.append(ref)
            blobs.append(blob)
        self._stats.add_time("fetch", fetching)
        self._stats.add_time("read", reading)
        if not refs:
            return None

        with reader.active() as stream:
            decoded = self._decoder.decode(blobs, stream=stream, stats=self._stats)
            for position, reason in decoded.errors.items():
                ref = refs[position]
                self._reject(SampleError(index=ref.index, origin=ref.origin, stage="decode", reason=reason))
            kept = [p for p, image in enumerate(decoded.images) if image is not None]
            if not kept:
                return None
            with self._stats.timed("transform"):
                stacked = decoded.stacked if len(kept) == len(refs) else None
                images = self._output.apply([decoded.images[p] for p in kept], stacked)  # type: ignore[misc]
            ready = reader.seal(images if isinstance(images, list) else [images])
        return Batch(
            images=images,
            targets=collate_targets([refs[p].target for p in kept]),
            indices=[refs[p].index for p in kept],
            ready=ready,
        )

    def _reject(self, error: SampleError) -> None:
        self._stats.count("errors")
        if self._on_error == "raise":
            raise error
        self._stats.count("skipped")
        logger.warning("skipping %s", error)


def collate_targets(targets: list[Any]) -> Any:
    """Collates targets like ``default_collate``; ``None`` when the source has none; a list otherwise.

    Ints become a ``LongTensor``, tensors are stacked, and what ``default_collate`` cannot handle stays
    a plain list.
    """
    if all(target is None for target in targets):
        return None
    try:
        return default_collate(targets)
    except (TypeError, RuntimeError):
        return list(targets)
