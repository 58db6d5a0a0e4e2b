"""ThreadLoader: a drop-in for ``torch.utils.data.DataLoader`` over images, with threads, not processes.

One process, one CUDA context, one shared decoder: reader threads fetch and read samples, decode whole
batches (on the GPU through nvImageCodec, serialized; on the CPU with Pillow, in parallel), format them
on their own CUDA stream and hand them over with an event. Nothing is pickled, so datasets and
functions defined in a notebook work as they are.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from ._device import default_decode_batch_size, set_up_decoding
from ._handoff import ReaderStream
from ._pipeline import Batch, BatchProducer, OnError, Outcome
from ._sampling import BatchPlan, group_batches
from ._sources import as_source
from ._stats import LoaderStats, StatsRecorder
from ._workers import OrderedPool
from .decode.base import DEFAULT_MAX_PIXELS
from .errors import LoaderClosedError, SampleError
from .transforms import OutputFormat, Transform, as_transform, stacking_size

__all__ = ["ThreadLoader"]

Images = torch.Tensor | list[torch.Tensor]


class ThreadLoader:
    """Loads batches of decoded images from a pool of threads in this process.

    Iterating yields ``(images, targets)``: ``images`` is a ``(B, 3, H, W)`` tensor on ``device`` when
    ``size`` is set (else a list of ``(3, H, W)`` tensors); ``targets`` is collated like
    ``default_collate`` (ints become a ``LongTensor``), or ``None`` for a source without targets.
    Batches come in exactly the sampler's order, whatever the threads' timing.

    Args:
        source: A sequence of paths or encoded bytes; a sequence of ``(path | bytes, target)``; a
            map-style dataset whose ``__getitem__`` returns either; or a directory with one sub-folder
            per class (:class:`ImageFolder` order).
        batch_size: Samples per batch.
        shuffle: Reshuffle every epoch; the order is a function of ``(seed, epoch)`` only.
        seed: Seed of the shuffle; ``None`` draws one from torch's global generator at construction, so
            ``torch.manual_seed`` makes it reproducible.
        sampler: Yields sample indices (exclusive with ``shuffle``); ``set_epoch`` is forwarded to it.
        batch_sampler: Yields lists of indices (exclusive with the four options before it).
        drop_last: Drop the last batch when it is smaller than ``batch_size``.
        num_threads: Reader threads; default 2 on a GPU (decoding is serialized there and more threads
            only contend for the GIL; see docs/benchmarks.md), the CPU count on
            the CPU.
        prefetch: Decode groups in flight per thread, decoded or being decoded: the memory knob. At most
            ``num_threads * prefetch`` groups of up to ``decode_batch_size`` images are held at once.
        device: ``None`` picks ``"cuda"`` when a GPU and nvImageCodec are usable, else ``"cpu"``; also
            ``"cuda:1"`` or a ``torch.device``.
        size: ``(H, W)``: every image resized to it (bilinear, antialiased) and stacked.
        dtype: ``torch.uint8``, or a float type scaled to [0, 1].
        mean: Per-channel mean to subtract (float dtypes, with ``std``), on the [0, 1] scale.
        std: Per-channel standard deviation to divide by.
        channels_last: Stacked batches in ``torch.channels_last`` memory format (free on the GPU path,
            whose decoder writes HWC).
        on_error: ``"raise"``: a bad sample raises :class:`SampleError` in the consumer at its batch.
            ``"skip"``: it is logged, counted in :meth:`stats` and left out of its batch (a batch left
            empty is not yielded).
        backend: GPU decoding backend: ``"auto"``, ``"hardware"`` (the JPEG engine), ``"cuda"``,
            ``"hybrid"`` or ``"cpu"`` (nvImageCodec's CPU decoder).
        decode_threads: nvImageCodec's own CPU threads; default: the cores the readers leave free.
        decode_batch_size: Images per decoder call: consecutive batches are decoded together up to this
            many images, then split (the GPU decoder is faster on large batches). Default 128 on a
            GPU, ``batch_size`` on the CPU (each Pillow thread decodes one batch).
        transform: A transform or a list of them (``threadloader.transforms``: Resize, CenterCrop,
            RandomResizedCrop, RandomHorizontalFlip, Normalize, ToDtype), applied to each image after
            decoding, on the reader's stream. Random parameters are a function of (seed, epoch, sample
            index): the same on every run and thread count. With a fixed output size (a crop, a
            resize to (H, W)) and ``size=None``, batches are stacked at that size.
        max_pixels: Decompression-bomb guard: an image whose header declares more pixels is a sample
            error, decoded by nobody. Default: Pillow's limit (about 89.5 million); ``None``: no limit.

    Example:
        >>> with ThreadLoader("train/", batch_size=64, shuffle=True, size=(224, 224),
        ...                   dtype=torch.float32) as loader:  # doctest: +SKIP
        ...     for images, targets in loader:
        ...         loss = model(images).loss(targets.cuda())
    """

    def __init__(
        self,
        source: Any,
        *,
        batch_size: int | None = 32,
        shuffle: bool = False,
        seed: int | None = None,
        sampler: Iterable[int] | None = None,
        batch_sampler: Iterable[list[int]] | None = None,
        drop_last: bool = False,
        num_threads: int | None = None,
        prefetch: int = 2,
        device: str | torch.device | int | None = None,
        size: tuple[int, int] | None = None,
        dtype: torch.dtype = torch.uint8,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        channels_last: bool = False,
        on_error: OnError = "raise",
        backend: str = "auto",
        decode_threads: int | None = None,
        decode_batch_size: int | None = None,
        max_pixels: int | None = DEFAULT_MAX_PIXELS,
        transform: Transform | Sequence[Transform] | None = None,
    ) -> None:
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if decode_batch_size is not None and decode_batch_size < 1:
            raise ValueError(f"decode_batch_size must be at least 1, got {decode_batch_size}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1 (batches in flight per thread), got {prefetch}")
        if seed is not None and (not isinstance(seed, int) or seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
        self._source = as_source(source)
        seed = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        self._transform = as_transform(transform)
        self._plan = BatchPlan(
            num_samples=len(self._source),
            # The default batch_size means "unset" next to a batch_sampler, which decides batch sizes.
            batch_size=None if batch_sampler is not None and batch_size == 32 else batch_size,
            shuffle=shuffle,
            seed=seed,
            sampler=sampler,
            batch_sampler=batch_sampler,
            drop_last=drop_last,
        )
        self._output = OutputFormat(
            size=stacking_size(size, self._transform),
            dtype=dtype,
            mean=mean,
            std=std,
            channels_last=channels_last,
        )
        self.device, self.num_threads, decoder = set_up_decoding(
            device=device,
            num_threads=num_threads,
            backend=backend,
            decode_threads=decode_threads,
            max_pixels=max_pixels,
        )
        self.prefetch = prefetch
        self.decode_batch_size = decode_batch_size or default_decode_batch_size(self.device, batch_size or 1)
        self._stats = StatsRecorder()
        self._producer = BatchProducer(
            source=self._source,
            decoder=decoder,
            output=self._output,
            on_error=on_error,
            stats=self._stats,
            transform=self._transform,
            seed=seed,
        )
        self._readers = [ReaderStream(self.device) for _ in range(self.num_threads)]
        self._next_epoch = 0
        self._iterators: weakref.WeakSet[_EpochIterator] = weakref.WeakSet()
        self._closed = False

    @property
    def source(self) -> Any:
        """The source being loaded (an :class:`ImageFolder` when a directory was given)."""
        return self._source

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._plan)

    def __iter__(self) -> Iterator[tuple[Images, Any]]:
        """Starts an epoch: the epoch set by :meth:`set_epoch`, else the previous one plus one."""
        if self._closed:
            raise LoaderClosedError("this ThreadLoader was closed; create a new one to iterate again")
        epoch = self._next_epoch
        self._next_epoch += 1
        self._plan.set_epoch(epoch)
        pool: OrderedPool[list[Outcome]] = OrderedPool(
            tasks=group_batches(self._plan.batches(epoch), self.decode_batch_size),
            # Threads see only the producer and the streams, never the loader: dropping the loader
            # and its iterators closes the pool.
            work=functools.partial(_produce_on, self._producer, self._readers, epoch),
            num_threads=self.num_threads,
            window=self.num_threads * self.prefetch,
            name=f"threadloader-e{epoch}",
        )
        iterator = _EpochIterator(self, pool, epoch)
        self._iterators.add(iterator)
        return iterator

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch of the next iteration (its shuffle order); later ones count on from it."""
        self._next_epoch = int(epoch)

    def stats(self) -> LoaderStats:
        """Counters and per-stage host time since construction: samples, skipped, errors, fallbacks."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Stops every iteration of this loader, from any thread. Idempotent.

        Reader threads stop at their next step (a sample, an image, a batch); this waits up to a second
        for them. An iteration's next ``next()``, and one already waiting in another thread, raises
        :class:`LoaderClosedError` rather than ending the loop as if the epoch were complete.
        """
        self._closed = True
        for iterator in list(self._iterators):
            iterator.close(error=_closed_error)

    def __enter__(self) -> ThreadLoader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # An interpreter tearing down may have cleared the module globals close() needs.
        if getattr(self, "_iterators", None) is not None:
            self.close()

    def __repr__(self) -> str:
        return (
            f"ThreadLoader(samples={len(self._source)}, batches={len(self)}, device={self.device}, "
            f"num_threads={self.num_threads}, prefetch={self.prefetch}, output={self._output})"
        )


def _produce_on(
    producer: BatchProducer, readers: list[ReaderStream], epoch: int, batches: list[list[int]], thread: int
) -> list[Outcome]:
    return producer.produce(batches, readers[thread], epoch=epoch)


class _EpochIterator:
    """One pass over the loader; hands batches out in order and closes its pool when done or dropped."""

    def __init__(self, loader: ThreadLoader, pool: OrderedPool[list[Outcome]], epoch: int) -> None:
        self._loader = loader  # keeps a loader used only through its iterator alive
        self._pool = pool
        self._stats = loader._stats
        self._pending: collections.deque[Outcome] = collections.deque()
        self.epoch = epoch

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> tuple[Images, Any]:
        try:
            batch = self._next_batch()
        except BaseException:
            self.close()
            raise
        batch.ready.receive()
        self._stats.count("batches")
        self._stats.count("samples", len(batch.indices))
        return batch.images, batch.targets

    def _next_batch(self) -> Batch:
        while True:
            # A closed pool raises what it was closed with, even with batches of its last group left.
            if self._pool.closed or not self._pending:
                with self._stats.timed("wait"):
                    self._pending.extend(self._pool.next())
                continue
            try:
                outcome = self._pending.popleft()
            except IndexError:  # emptied by close() in another thread
                continue
            if isinstance(outcome, SampleError):
                raise outcome
            if outcome is not None:
                return outcome

    def close(self, *, error: Callable[[], BaseException] = StopIteration) -> None:
        """Stops this pass; ``next()`` then raises ``error()`` (the first close decides).

        The default ends the pass as a closed generator does; reader threads stop at their next step.
        """
        self._pending.clear()
        self._pool.close(error)

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self.close()


def _closed_error() -> LoaderClosedError:
    return LoaderClosedError(
        "this ThreadLoader was closed while this pass was running (close(), or its with block ended); "
        "create a new one to iterate again"
    )
