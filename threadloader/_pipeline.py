"""What a reader thread does with one batch: fetch, read, decode, format, seal.

Shared by every front end (the training loader, the inference service): they differ in where batches
come from, not in how a batch is made. Everything here runs in a reader thread, on that thread's CUDA
stream, and ends with the event that the consumer's stream waits on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils.data import default_collate

from ._handoff import ReaderStream, Ready
from ._sources import SampleRef, Source, fetch, read_bytes
from ._stats import StatsRecorder
from .decode.base import DecodedBatch, Encoded, ImageDecoder
from .errors import SampleError
from .transforms import OutputFormat, Transform, sample_generator

__all__ = ["Batch", "BatchProducer", "OnError", "Outcome", "collate_targets"]

OnError = Literal["raise", "skip"]
logger = logging.getLogger("threadloader")


@dataclass
class Batch:
    """A finished batch, not yet safe to use on the consumer's stream until ``ready.receive()``."""

    images: torch.Tensor | list[torch.Tensor]
    targets: Any
    indices: list[int]
    ready: Ready


#: What a reader thread hands over for each batch of a group (see :meth:`BatchProducer.produce`).
Outcome = Batch | SampleError | None


class BatchProducer:
    """Makes batches from sample indices; safe to call from many threads at once.

    Args:
        source: Indexed by reader threads.
        decoder: Decodes a batch on the thread's stream.
        output: Resize, dtype, normalization and layout of every batch.
        on_error: ``"raise"`` makes the batch fail with the sample's :class:`SampleError`; ``"skip"`` counts
            the sample, leaves it out and passes its error to ``on_skip``.
        stats: Where counters and stage times go.
        on_skip: Called with each skipped sample's error, in the reader thread; default: log a warning.
        transform: Applied to each decoded ``(3, H, W)`` image before ``output``; random parameters come
            from a generator seeded by (``seed``, epoch, sample index).
        seed: See ``transform``.
    """

    def __init__(
        self,
        *,
        source: Source,
        decoder: ImageDecoder,
        output: OutputFormat,
        on_error: OnError,
        stats: StatsRecorder,
        on_skip: Callable[[SampleError], None] | None = None,
        transform: Transform | None = None,
        seed: int = 0,
    ) -> None:
        self._source = source
        self._transform = transform
        self._seed = seed
        self._decoder = decoder
        self._output = output
        self._on_error = on_error
        self._stats = stats
        self._on_skip = on_skip or _log_skip

    def produce(
        self, batches: Sequence[Sequence[int]], reader: ReaderStream, *, epoch: int = 0
    ) -> list[Outcome]:
        """Makes consecutive batches with one decoder call, on ``reader``'s stream.

        Decoding several output batches at once keeps the GPU decoder on large batches (it is faster
        per image) while the consumer gets the batch size it asked for.

        Returns:
            One outcome per batch, in order: the :class:`Batch`; ``None`` when every sample of it was
            skipped; or, with ``on_error="raise"``, the :class:`SampleError` of its first bad sample, which
            ends the list (the consumer raises it when it reaches that batch).
        """
        refs: list[SampleRef] = []
        blobs: list[Encoded] = []
        owner: list[int] = []  # batch number of each read sample
        failures: dict[int, list[SampleError]] = {}
        fetching = reading = 0.0  # summed here and recorded once: a timer per sample costs more than a read
        for number, indices in enumerate(batches):
            for index in indices:
                started = time.perf_counter()
                try:
                    ref = fetch(self._source, index)
                    fetched = time.perf_counter()
                    fetching += fetched - started
                    blob = read_bytes(ref)
                    reading += time.perf_counter() - fetched
                except SampleError as error:
                    failures.setdefault(number, []).append(error)
                    continue
                refs.append(ref)
                blobs.append(blob)
                owner.append(number)
        self._stats.add_time("fetch", fetching)
        self._stats.add_time("read", reading)

        outcomes: list[Outcome] = []
        with reader.active() as stream:
            decoded = self._decoder.decode(blobs, stream=stream, stats=self._stats) if blobs else None
            if decoded is not None:
                for position, reason in sorted(decoded.errors.items()):
                    ref = refs[position]
                    error = SampleError(index=ref.index, origin=ref.origin, stage="decode", reason=reason)
                    failures.setdefault(owner[position], []).append(error)
            first = 0
            for number in range(len(batches)):
                last = first
                while last < len(owner) and owner[last] == number:
                    last += 1
                errors = failures.get(number, [])
                if len(errors) > 1:  # fetch errors were found before decode errors: put them in batch order
                    order = {index: position for position, index in enumerate(batches[number])}
                    errors.sort(key=lambda error: order[error.index])
                self._stats.count("errors", len(errors))
                if errors and self._on_error == "raise":
                    outcomes.append(errors[0])
                    break
                for error in errors:
                    self._stats.count("skipped")
                    self._on_skip(error)
                outcomes.append(self._finish(refs, decoded, first, last, reader, epoch) if decoded else None)
                first = last
        return outcomes

    def _finish(
        self,
        refs: list[SampleRef],
        decoded: DecodedBatch,
        first: int,
        last: int,
        reader: ReaderStream,
        epoch: int,
    ) -> Batch | None:
        """Formats positions ``first:last`` of a decoded group as one batch and seals it."""
        kept = [p for p in range(first, last) if decoded.images[p] is not None]
        if not kept:
            return None
        with self._stats.timed("transform"):
            whole = len(kept) == last - first and decoded.stacked is not None
            stacked = decoded.stacked[first:last].permute(0, 3, 1, 2) if whole else None  # type: ignore[index]
            chw = [decoded.images[p].permute(2, 0, 1) for p in kept]  # type: ignore[union-attr]
            if self._transform is not None:
                chw, stacked = self._transformed(chw, stacked, [refs[p].index for p in kept], epoch)
            images = self._output.apply(chw, stacked)
        return Batch(
            images=images,
            targets=collate_targets([refs[p].target for p in kept]),
            indices=[refs[p].index for p in kept],
            ready=reader.seal(images if isinstance(images, list) else [images]),
        )

    def _transformed(
        self, images: list[torch.Tensor], stacked: torch.Tensor | None, indices: list[int], epoch: int
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Applies the transform: once to a same-size batch when it is not random, else per image."""
        transform = self._transform
        assert transform is not None
        if stacked is not None and not transform.random:
            stacked = transform(stacked)
            return list(stacked.unbind(0)), stacked
        return [
            transform(
                image, generator=sample_generator(self._seed, epoch, index) if transform.random else None
            )
            for image, index in zip(images, indices, strict=True)
        ], None


def _log_skip(error: SampleError) -> None:
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
