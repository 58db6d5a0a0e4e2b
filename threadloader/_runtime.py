"""What a front end runs on, built once from its options: device, decoder, output, reader streams, start.

``ThreadLoader`` and ``BatchDecoder`` differ in where batches come from (a sampler's groups; requests
gathered into micro-batches), not in what makes them. Both build a :class:`Runtime`: the device, the
reader threads' count and CUDA streams, the decoder (nvImageCodec on a GPU, Pillow on the CPU, or the
caller's own), the output format, and, for a decoder that ``warms_up`` (the GPU decoder), its start in
the background: the warm-up (``_warmup.py``) and, while it is ``starting``, Pillow for the first
batches. A front end asks it for producers and has each group made through :meth:`Runtime.produce`;
neither front end names a concrete decoder.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._device import available_cpus, resolve_device
from ._handoff import ReaderStream
from ._options import DEFAULTS, Options, decode_batch_size_on, warm_up_wanted
from ._pipeline import Batch, BatchProducer, Outcome
from ._warmup import Warmup
from ._workers import uninterrupted
from .decode.base import ImageDecoder
from .decode.nvimgcodec import NvImageCodecDecoder
from .decode.pillow import PillowDecoder
from .transforms import Transform

__all__ = ["Runtime", "build_decoder"]

#: Seconds a consumer waits at most for a group that was ready: it is then the slower side.
_READY = 0.0005
#: Groups in a row that say the other side is slower before the decoder is told (not one odd group).
_STREAK = 4

#: Longest :meth:`Runtime.close` waits for a warm-up call still running past its deadline (nvImageCodec's
#: start: seconds) to end, so that the decoder is closed, and its Decoders' device memory back, when the
#: close returns. Past it the warm-up's last thread closes the decoder as it ends.
RELEASE_WAIT = 15.0

#: Pillow threads per reader for a GPU front end's first batches (the cores the readers share, up to
#: this): a group is one or two batches, so more would mostly start threads.
_CPU_START_THREADS = 8


class Runtime:
    """A front end's device, threads, decoder, output format, reader streams and background start.

    Args:
        options: The front end's options.
        batch_size: Its batch (the GPU decoder's default images per call follow it); ``None`` where the
            batches' size is not known before they come (a ``batch_sampler`` that does not say it).
        decode_batch_size: Images per decoder call; ``None``: the device's default for ``batch_size``.

    Attributes:
        device: Where batches are made (the decoder's, for a decoder passed in).
        num_threads: Reader (or worker) threads, one per entry of ``readers``.
        decode_batch_size: Images per decoder call, at most (a larger batch is one call); ``None``: one
            batch a call, of a size not known before it comes (the CPU's default for ``batch_size=None``).
        decoder: The decoder.
        output: The output format.
        readers: One CUDA stream per reader thread (nothing on the CPU).

    Raises:
        ValueError: For a ``device`` another than the decoder passed in decodes on, an nvImageCodec
            ``backend`` on the CPU, or a ``THREADLOADER_REGION_DECODE`` or ``THREADLOADER_WARMUP`` that
            is not 1 or 0 (on every device).
    """

    def __init__(
        self, options: Options, *, batch_size: int | None, decode_batch_size: int | None = None
    ) -> None:
        # Both read here on every device, though only a GPU decoder uses them: a typo in either raised on
        # a GPU machine only, after the script had run without complaint on the CPU.
        options.regions()
        warm_up = warm_up_wanted()
        self.options = options
        decoder = options.decoder
        self.device = resolve_device(options.device) if decoder is None else _device_of(decoder, options)
        self.num_threads = options.threads_on(self.device)
        self.decode_batch_size = decode_batch_size_on(self.device, batch_size, decode_batch_size)
        self.output = options.output_format()
        self._cpu_start: PillowDecoder | None = None
        self._warmup: Warmup | None = None
        self._side_lock = threading.Lock()
        self._consumer_ahead = False  # told to the decoder; changed after _STREAK groups say otherwise
        self._streak = 0
        self._built = decoder is None
        self._decoder_closed = threading.Event()  # set once the decoder built here has been closed
        if decoder is None:
            # ``None`` only on the CPU, whose decoder takes no batch size.
            batch = self.decode_batch_size or 1
            decoder = build_decoder(options, self.device, threads=self.num_threads, batch=batch)
        self.decoder = decoder
        # Leased once the decoder is built, which may raise; from here a failure gives them back.
        self.readers = [ReaderStream(self.device) for _ in range(self.num_threads)]
        try:
            if self.decoder.warms_up and warm_up:
                self._start_warmup(options)
        except BaseException:  # no runtime for the caller to close: the streams back, the decoder closed
            self.close()
            raise

    def _start_warmup(self, options: Options) -> None:
        # Loads the decoder, on the readers' streams, while the caller builds the rest; meanwhile the
        # readers decode with Pillow, copied to the GPU.
        self._warmup = Warmup(
            self.producer,
            self.readers,
            # A batch per call the decoder runs at once (the GPU decoder's Decoders; one for others).
            threads=min(self.num_threads, getattr(self.decoder, "gpu_decoders", 1)),
            prepare=functools.partial(self.output.prepare, self.device),
        )
        self._cpu_start = PillowDecoder(
            max_pixels=options.max_pixels,
            device=self.device,
            threads=min(_CPU_START_THREADS, max(1, available_cpus() // self.num_threads)),
        )

    @property
    def transform(self) -> Transform | None:
        """The user's transforms as one (``None``: none)."""
        return self.options.chain

    @property
    def warming_up(self) -> bool:
        """Whether a background warm-up was started (a decoder that ``warms_up``)."""
        return self._warmup is not None

    @property
    def started(self) -> bool:
        """Whether the background start, if any, has ended: the readers decode with the decoder."""
        return self._warmup is None or self._warmup.done

    def producer(self, **arguments: Any) -> BatchProducer:
        """A producer on this runtime's decoder, output format and transforms.

        ``arguments`` are the rest of :class:`BatchProducer`'s (source, stats, on_error...).
        """
        return BatchProducer(decoder=self.decoder, output=self.output, transform=self.transform, **arguments)

    def produce(
        self, producer: BatchProducer, batches: Sequence[Sequence[int]], thread: int, *, epoch: int = 0
    ) -> list[Outcome]:
        """``producer``'s outcomes for a group, made by reader ``thread`` on its stream.

        While nvImageCodec is still starting on this device (the process's first seconds), Pillow decodes
        the group (``stats().started_on_cpu`` counts its samples); after, the reader waits for the rest
        of the warm-up (milliseconds, once) and decodes on the GPU.
        """
        reader = self.readers[thread]
        warmup, cpu = self._warmup, self._cpu_start
        if warmup is not None and cpu is not None and not warmup.done and self.decoder.starting:
            # No local holds the outcomes: an error among them holds this frame (see loader._produce_on).
            return _counted_on_cpu(producer, producer.using(cpu).produce(batches, reader, epoch=epoch))
        if warmup is not None:
            warmup.wait()  # returns at once after the first group: the warm-up ran once, at construction
        return producer.produce(batches, reader, epoch=epoch)

    def consumer_waited(self, seconds: float) -> None:
        """Tells how long the consumer waited for a group: the decoder learns which side is slower.

        A group ready when asked for (a training step slower than the readers) says the consumer is
        ahead; after :data:`_STREAK` groups in a row say the other side is, the decoder is told.
        """
        ahead = seconds < _READY
        with self._side_lock:
            if ahead == self._consumer_ahead:
                self._streak = 0
                return
            self._streak += 1
            if self._streak < _STREAK:
                return
            self._consumer_ahead, self._streak = ahead, 0
        self.decoder.consumer_ahead(ahead)

    def close(self, *, until: float | None = None) -> None:
        """Stops the warm-up, and lets the decoder built here go (its Decoders' memory). Idempotent.

        The decoder is closed once no warm-up thread is in a call to it: here, or by the last of them as
        it ends, when one is still in a step past the deadline (nvImageCodec's start), which this waits
        for up to :data:`RELEASE_WAIT`.

        ``until``: the deadline of the wait for the warm-up's threads (see :meth:`Warmup.close`).
        Then gives the readers' streams back for later loaders (the owner has stopped its readers).
        """
        warmup = self._warmup
        steps: list[Callable[[], object]] = []
        if warmup is not None:
            steps.append(functools.partial(warmup.close, until=until))
        if self._built:  # not under a warm-up call still running past the deadline: its thread closes it
            closing = self._close_decoder if warmup is None else functools.partial(self._hand_over, warmup)
            steps.append(closing)
        steps.extend(reader.release for reader in self.readers)
        uninterrupted(*steps)  # a Ctrl-C skips none

    def _close_decoder(self) -> None:
        try:
            self.decoder.close()
        finally:
            self._decoder_closed.set()

    def _hand_over(self, warmup: Warmup) -> None:
        """Closes the decoder, or hands that to the warm-up's last thread, and waits for it.

        A notebook closes a loader to get its device memory back, and a test of that measured it right
        after: the close waits up to :data:`RELEASE_WAIT` for the warm-up's call (not at interpreter
        exit, whose hooks have their own waits).
        """
        if not warmup.then(self._close_decoder) and not sys.is_finalizing():
            self._decoder_closed.wait(RELEASE_WAIT)


def _counted_on_cpu(producer: BatchProducer, outcomes: list[Outcome]) -> list[Outcome]:
    """``outcomes``, their batches' samples counted as ``started_on_cpu``."""
    started = sum(len(outcome.indices) for outcome in outcomes if isinstance(outcome, Batch))
    producer.stats.count("started_on_cpu", started)
    return outcomes


def build_decoder(options: Options, device: torch.device, *, threads: int, batch: int) -> ImageDecoder:
    """The built-in decoder for ``device``: nvImageCodec on a GPU, Pillow (whole images) on the CPU.

    Each decoding option reaches the GPU decoder under its own name; ``threads`` readers decode calls
    of ``batch`` images.
    """
    if device.type == "cpu":
        # With device=None (no usable GPU here) it is ignored, as the other GPU options are: a script
        # written for a GPU runs where there is none. Asked for with device="cpu", it is a mistake.
        if options.backend != DEFAULTS.backend and options.device is not None:
            raise ValueError(
                f"backend={options.backend!r} selects an nvImageCodec backend; with device='cpu' Pillow "
                "decodes"
            )
        return PillowDecoder(max_pixels=options.max_pixels)
    return NvImageCodecDecoder(
        device,
        backend=options.backend,
        decode_threads=options.decode_threads_for(threads),
        jpeg_fancy_upsampling=options.jpeg_fancy_upsampling,
        max_pixels=options.max_pixels,
        region_decode=options.regions(),
        gpu_decoders=options.gpu_decoders,
        batch_size=batch,
    )


def _device_of(decoder: ImageDecoder, options: Options) -> torch.device:
    """The device of a decoder passed in, refusing another ``device``."""
    if options.device is not None and resolve_device(options.device) != decoder.device:
        raise ValueError(
            f"device={str(options.device)!r} but decoder={decoder!r} decodes on {decoder.device}; leave "
            "device unset or pass a decoder for that device"
        )
    return decoder.device
