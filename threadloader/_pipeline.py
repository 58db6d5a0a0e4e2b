"""What a reader thread does with one group of batches: fetch, read, decode, transform, format, seal.

Shared by every front end (the training loader, the inference service): they differ in where batches
come from, not in how a batch is made. Everything here runs in a reader thread, on that thread's CUDA
stream, and ends with the event that the consumer's stream waits on.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.utils.data import default_collate

from ._cancel import check_cancelled
from ._handoff import ReaderStream, Ready
from ._output import OutputFormat
from ._sampling import PlannedBatch
from ._seeding import sample_generator
from ._sources import Blob, Fetched, Source, fetch_batch, origin_of, read_batch
from ._stats import StatsRecorder
from ._workers import consumer_error
from .decode.base import DecodedBatch, Encoded, ImageDecoder, Region, check_decoded
from .errors import SampleError
from .transforms import Transform
from .transforms.functional import Images

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


#: What a reader thread hands over for each batch of a group (see :meth:`BatchProducer.produce`): the
#: batch; ``None`` when every sample of it was skipped; or the error the consumer raises when it reaches
#: that batch (a :class:`SampleError`, or what the user's transform or ``collate_fn`` raised).
Outcome = Batch | Exception | None


class BatchProducer:
    """Makes batches from sample indices; safe to call from many threads at once.

    Args:
        source: Indexed by reader threads.
        decoder: Decodes a batch on the thread's stream.
        output: Resize, dtype, normalization and layout of every batch.
        on_error: ``"raise"`` makes the batch fail with the sample's :class:`SampleError`; ``"skip"`` counts
            the sample, leaves it out and passes its error to ``on_skip``.
        stats: Where counters and stage times go.
        on_skip: Called with each skipped sample's error, in the reader thread; default: log a warning the
            first time a sample is skipped (:class:`_SkipLog`).
        transform: Applied to each decoded ``(3, H, W)`` image before ``output``; random parameters come
            from a generator seeded by (``seed``, epoch, sample index) and the image's size, which the
            decoder may know from the header: a random crop then decodes only its region.
        seed: See ``transform``.
        collate: Turns the list of a batch's targets into its ``targets``; what it raises is that batch's
            outcome, as a transform's is.
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
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self._source = source
        self._collate = collate or collate_targets
        self._transform = transform
        self._seed = seed
        self._decoder = decoder
        self._output = output
        self._on_error = on_error
        self._stats = self.stats = stats
        self._on_skip = on_skip or _skip_log_of(stats)

    def using(self, decoder: ImageDecoder) -> BatchProducer:
        """The same producer decoding with ``decoder`` (a GPU loader's first batches: Pillow's)."""
        other = copy.copy(self)
        other._decoder = decoder
        return other

    def produce(
        self, batches: Sequence[Sequence[int]], reader: ReaderStream, *, epoch: int = 0
    ) -> list[Outcome]:
        """Makes consecutive batches with one decoder call, on ``reader``'s stream.

        Decoding several output batches at once keeps the GPU decoder on large batches (it is faster
        per image) while the consumer gets the batch size it asked for. A group decoded into one padded
        tensor (random-crop regions, or images of different sizes), with no failed sample, is also
        transformed and formatted at once
        (the transforms' host cost is mostly per call, not per image); each batch is then a copy of its
        rows, so it owns its memory as a batch formatted alone does. Where that raises, the batches are
        formatted one by one (:meth:`_format_group`).

        Returns:
            One outcome per batch, in order: the :class:`Batch`; ``None`` when every sample of it was
            skipped; with ``on_error="raise"``, the :class:`SampleError` of its first bad sample; or the
            exception the transform or ``collate`` raised making it (a ``StopIteration`` as a
            ``RuntimeError``). The consumer raises an error when it reaches its batch, so the batches
            before it are handed out; the batches after it are made all the same (see :meth:`_split`).

        Raises:
            Cancelled: The thread was asked to stop; neither it nor a ``KeyboardInterrupt`` (any
                ``BaseException`` but an ``Exception``) is a batch's outcome: they fail the group.
            Exception: What failed the group as a whole (the decoder call, say): raised at its first batch.
        """
        group = self._read(batches)
        check_cancelled()
        plans = None if self._transform is None else _Plans(self._transform, self._seed, epoch, group)
        with reader.active() as stream:
            decoded = self._decode(group, stream, plans)
            check_cancelled()
            return self._split(group, decoded, plans, reader)

    def _read(self, batches: Sequence[Sequence[int]]) -> _Group:
        """Fetches and reads every sample of a group; a sample that fails keeps its place as its error."""
        group = _Group()
        # Timed per batch: a timer per sample costs about as much as a fetch. Wall and CPU seconds.
        fetching = [0.0, 0.0]
        reading = [0.0, 0.0]
        for indices in batches:
            started = time.perf_counter(), time.thread_time()
            fetched = fetch_batch(self._source, indices)
            middle = time.perf_counter(), time.thread_time()
            blobs = read_batch(fetched)
            ended = time.perf_counter(), time.thread_time()
            for total, since, until in ((fetching, started, middle), (reading, middle, ended)):
                total[0] += until[0] - since[0]
                total[1] += until[1] - since[1]
            group.add(fetched, blobs, indices.repeats if isinstance(indices, PlannedBatch) else None)
        self._stats.add_time("fetch", *fetching)
        self._stats.add_time("read", *reading)
        return group

    def _decode(
        self, group: _Group, stream: torch.cuda.Stream | None, plans: _Plans | None
    ) -> DecodedBatch | None:
        """Decodes the samples read, in one decoder call; ``None`` when none could be read."""
        if not group.blobs:
            return None
        decoded = self._decoder.decode(
            group.blobs,
            stream=stream,
            stats=self._stats,
            region_of=plans.region_of if plans is not None and plans.random else None,
            # Without a transform, the output's resize reads images of different sizes in one batch.
            pad=self._transform is None and self._output.size is not None,
        )
        return check_decoded(decoded, len(group.blobs), self._decoder)

    def _split(
        self, group: _Group, decoded: DecodedBatch | None, plans: _Plans | None, reader: ReaderStream
    ) -> list[Outcome]:
        """Splits a decoded group into its batches: transformed, formatted and sealed, or their errors."""
        errors = group.errors(decoded)
        # Transformed at once only for padded groups of regions (the transforms' host cost is per
        # call); the output format alone is one kernel per batch on the GPU, so batches are formatted
        # one by one and own their memory without a copy.
        formatted = (
            self._format_group(decoded, plans)
            if self._transform is not None
            and decoded is not None
            and not any(errors)
            and len(group.batches) > 1
            and _all_padded(decoded)
            else None
        )
        outcomes: list[Outcome] = []
        first = 0
        for size, failed in zip(group.sizes, errors, strict=True):
            check_cancelled()
            last = first + size
            if failed and self._on_error == "raise":
                # The batches after it are still made: a resumed pass drops the head of its first
                # group, and an error in a batch delivered before the checkpoint must not take them.
                # So are they after a transform's or collate's error (_batch), for the same reason.
                self._stats.count("errors", len(failed))
                outcomes.append(failed[0])
                first = last
                continue
            # Errors and skips in one lock hold: no snapshot sees a batch's errors without its skips.
            self._stats.count_many(errors=len(failed), skipped=len(failed))
            for error in failed:
                self._on_skip(error)
            kept = [] if decoded is None else _kept(decoded, first, last)
            if decoded is None or not kept:
                outcomes.append(None)
            else:
                outcomes.append(self._batch(group, decoded, kept, (first, last), plans, formatted, reader))
            first = last
        try:
            return outcomes
        finally:  # an error among them holds this frame (its traceback's frames' f_back): not them in turn
            del outcomes

    def _format_group(self, decoded: DecodedBatch, plans: _Plans | None) -> Images | None:
        """The whole group transformed and formatted at once; ``None`` where that raises.

        An error there is on some image of the group, but of which batch is unknown: raised at the
        group's first batch, it would take the batches before the failing one. So the batches are
        then formatted one by one, as a group of other images is, and each gets its own outcome. A
        transform that fails only on a whole group (out of memory, say) then fails no batch; one that
        fails on an image fails that image's batch again (its parameters were drawn once: the same).
        ``Cancelled`` and ``KeyboardInterrupt`` are not caught.
        """
        try:
            return self._format(decoded, 0, len(decoded.extents), plans)
        except Exception:
            return None

    def _batch(
        self,
        group: _Group,
        decoded: DecodedBatch,
        kept: list[int],
        span: tuple[int, int],
        plans: _Plans | None,
        formatted: Images | None,
        reader: ReaderStream,
    ) -> Batch | Exception:
        """The batch of decoder positions ``span`` (``kept``: those decoded), made and sealed; or its error.

        What the transform, the format or ``collate`` raises making it is this batch's outcome alone, as
        a bad sample's error is: the consumer gets the batches before it, then the exception, unchanged
        (its traceback runs from here to where it was raised). ``Cancelled`` and ``KeyboardInterrupt``
        (an ``Exception`` only is caught) are no batch's: they stop the group.
        """
        first, last = span
        try:
            images = (
                self._format(decoded, first, last, plans)
                if formatted is None
                else _own_rows(formatted, first, last)
            )
            # Collated before the seal: a collate_fn's CUDA tensors are made on this stream too.
            targets = self._collate([group.refs[p][2] for p in kept])
            return Batch(
                images=images,
                targets=targets,
                indices=[group.refs[p][0] for p in kept],
                ready=reader.seal(images if isinstance(images, list) else [images], targets),
            )
        except Exception as exc:
            return consumer_error(exc)

    def _format(self, decoded: DecodedBatch, first: int, last: int, plans: _Plans | None) -> Images:
        """Transforms and formats the decoded images at positions ``first:last`` (those not failed)."""
        kept = _kept(decoded, first, last)
        with self._stats.timed("transform"):
            images: Images
            extents: list[tuple[int, int]] | None = None
            whole = len(kept) == last - first
            stacked = decoded.stacked
            if whole and stacked is not None:
                images = stacked[first:last].permute(0, 3, 1, 2)
            elif whole and decoded.batch is not None and decoded.rows.issuperset(kept):
                # Images at the top left of their rows: a region-reading first transform takes them as
                # they are (regions); without a transform, the output's resize reads each one's extent.
                images = decoded.batch[first:last].permute(0, 3, 1, 2)
                if self._transform is None:
                    extents = [decoded.extents[p] for p in kept]  # type: ignore[misc]  # kept: not None
            else:
                images = [decoded.image(p).permute(2, 0, 1) for p in kept]  # type: ignore[union-attr]
            if self._transform is not None and plans is not None:
                images = self._transform.apply_many(images, [plans.params(p, decoded) for p in kept])
                check_cancelled()
            return self._output.apply(images, extents=extents)


@dataclass
class _Group:
    """A group's samples as read: the decoder's input, and each batch's samples in their order."""

    refs: list[Fetched] = field(default_factory=list)  # the samples read, by decoder position
    repeats: list[int] = field(default_factory=list)  # each one's times in its epoch before (PlannedBatch)
    blobs: list[Encoded] = field(default_factory=list)
    #: Per batch, each sample's decoder position, or the error that kept it from being read.
    batches: list[list[int | SampleError]] = field(default_factory=list)
    #: Per batch, how many of its samples were read (its decoder positions are consecutive).
    sizes: list[int] = field(default_factory=list)

    def add(
        self, fetched: list[Fetched | SampleError], blobs: list[Blob | SampleError], repeats: list[int] | None
    ) -> None:
        """Adds one batch: its samples as fetched, what reading each gave, and each one's repeat."""
        samples: list[int | SampleError] = []
        start = len(self.blobs)
        for position, (sample, blob) in enumerate(zip(fetched, blobs, strict=True)):
            if isinstance(blob, SampleError):
                samples.append(blob)
            else:
                samples.append(len(self.blobs))
                self.refs.append(sample)  # type: ignore[arg-type]
                self.repeats.append(repeats[position] if repeats is not None else 0)
                self.blobs.append(blob)
        self.batches.append(samples)
        self.sizes.append(len(self.blobs) - start)

    def errors(self, decoded: DecodedBatch | None) -> list[list[SampleError]]:
        """Each batch's errors in its samples' order, those of reading and those of decoding."""
        if decoded is None:
            return [
                [sample for sample in samples if isinstance(sample, SampleError)] for samples in self.batches
            ]
        return [
            [
                sample if isinstance(sample, SampleError) else self._decode_error(sample, decoded)
                for sample in samples
                if isinstance(sample, SampleError) or sample in decoded.errors
            ]
            for samples in self.batches
        ]

    def _decode_error(self, position: int, decoded: DecodedBatch) -> SampleError:
        """The error of a sample the decoder failed, its exception chained where the decoder kept one."""
        error = SampleError(
            index=self.refs[position][0],
            origin=origin_of(self.refs[position][1]),
            stage="decode",
            reason=decoded.errors[position],
        )
        error.__cause__ = decoded.causes.get(position)
        return error


class _Plans:
    """The transform's parameters for each sample of a group, drawn once per sample.

    Drawn from the image's size alone: when the decoder asks which region to decode, from the size in
    the header, else from the decoded image. Both are the displayed size, so a sample gets the same
    parameters on every path (GPU region, GPU whole, CPU) and thread count.
    """

    def __init__(self, transform: Transform, seed: int, epoch: int, group: _Group) -> None:
        self._transform = transform
        self.random = transform.random
        self._seed = seed
        self._epoch = epoch
        self._refs = group.refs
        self._repeats = group.repeats
        self._drawn: dict[int, tuple[tuple[int, int], Any]] = {}
        self._in_region: dict[int, Any] = {}

    def region_of(self, position: int, size: tuple[int, int]) -> Region | None:
        """The region to decode for the sample at ``position``; see :data:`~.decode.base.RegionOf`."""
        split = self._transform.split_region(self._draw(position, size))
        if split is None:
            return None
        region, self._in_region[position] = split
        return region

    def params(self, position: int, decoded: DecodedBatch) -> Any:
        """The parameters to apply to the decoded image at ``position``."""
        if position in decoded.regions:
            return self._in_region[position]
        size = decoded.extents[position]
        assert size is not None
        drawn = self._drawn.get(position)
        return drawn[1] if drawn is not None and drawn[0] == size else self._draw(position, size)

    def _draw(self, position: int, size: tuple[int, int]) -> Any:
        index, repeat = self._refs[position][0], self._repeats[position]
        generator = sample_generator(self._seed, self._epoch, index, repeat) if self.random else None
        params = self._transform.sample(size, generator)
        self._drawn[position] = (size, params)
        return params


def _kept(decoded: DecodedBatch, first: int, last: int) -> list[int]:
    """The positions in ``first:last`` that decoded."""
    return [p for p in range(first, last) if decoded.extents[p] is not None]


def _own_rows(images: Images, first: int, last: int) -> Images:
    """Rows ``first:last`` of a group's output as a batch with memory of its own."""
    if isinstance(images, torch.Tensor):
        return images[first:last].clone()
    return [image.clone() for image in images[first:last]]


def _all_padded(decoded: DecodedBatch) -> bool:
    """Whether every image of a decoded group is at the top left of its row of the batch tensor."""
    return decoded.batch is not None and len(decoded.rows) == len(decoded.extents)


class _SkipLog:
    """The default ``on_skip``: one warning per bad sample, however many epochs skip it again.

    A bad file is a fact about the data set: said once, it is known; said every epoch, it buries the
    other lines of a long run. ``stats().skipped`` and ``.errors`` still count every skip.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: set[int] = set()

    def __call__(self, error: SampleError) -> None:
        with self._lock:
            if error.index in self._logged:
                return
            self._logged.add(error.index)
        logger.warning("skipping %s", error)


#: The skip log of each loader, found by its StatsRecorder: the producers a loader makes (its CPU
#: start's, another seed's after load_state_dict) share that recorder and no other object of the loader.
_skip_logs: weakref.WeakKeyDictionary[StatsRecorder, _SkipLog] = weakref.WeakKeyDictionary()
_skip_logs_lock = threading.Lock()


def _skip_log_of(stats: StatsRecorder) -> _SkipLog:
    """The skip log shared by every producer that counts into ``stats``."""
    with _skip_logs_lock:
        log = _skip_logs.get(stats)
        if log is None:
            log = _skip_logs[stats] = _SkipLog()
        return log


def collate_targets(targets: list[Any]) -> Any:
    """Collates targets like ``default_collate``; ``None`` when the source has none; a list otherwise.

    Ints become a ``LongTensor``, tensors are stacked, and what ``default_collate`` cannot handle stays
    a plain list: types it refuses (``TypeError``), tensors of different shapes (``RuntimeError``), dicts
    without the first one's keys (``KeyError``), ints too large for a tensor (``ValueError``).
    """
    if all(target is None for target in targets):
        return None
    try:
        return default_collate(targets)
    except (TypeError, RuntimeError, KeyError, ValueError):
        return list(targets)
