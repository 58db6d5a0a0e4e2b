"""What a loader running beside it costs a main thread that keeps releasing and re-taking the GIL.

Usage: ``python -m benchmarks.gil [--quick] [--device cpu] [--out DIR] [--switch-intervals 0.005,0.0001]``

A training step in eager mode gives the GIL up around every torch op (about a thousand per ResNet-50
step) and must win it back each time from whichever thread holds it. This measures that cost with a
stand-in for the step: a main-thread loop of tiny torch ops (``x.add_(1)`` on a small CPU tensor, or
on a CUDA tensor: a kernel launch each), timed alone and then while a background load runs at full
speed beside it:

- ``threadloader``: a ThreadLoader over the varied set (resize to 224x224, float normalized, the
  training benchmark's pipeline), consumed by a background thread;
- ``dali``: DALI's pipeline of the same work (``benchmarks.loaders.dali``), consumed the same way, only
  when asked for (``--backgrounds dali``, with DALI installed): what a loader whose threads are C++,
  driving the same nvImageCodec, costs the loop, so that the part of ThreadLoader's delay that the GPU
  decoding itself makes (the driver's locks, the GPU) stands apart from the part its Python makes;
- ``decode``: a thread doing nothing but decoding in-memory bytes (nvImageCodec ``Decoder.decode()``
  in batches of 64 on a GPU; Pillow image by image on the CPU);
- ``spin``: a pure-Python loop, the worst case, for reference (it loads no images).

Reported per load: the loop's time per op alone and beside it, the load's images/s alone and beside
the loop, and the main thread's delay per image loaded: (loop time beside the load - the same ops'
time alone) / images loaded meanwhile. Each is measured at every ``--switch-intervals`` value
(``sys.setswitchinterval``: how long a thread that wants the GIL waits before the holder is asked
to drop it).

Every window starts once the load is past its start: a GPU ThreadLoader's batches are counted from
its first past the CPU start (``loaders.past_the_cpu_start`` drops the Pillow ones), so no window
falls inside nvImageCodec's start, and then after ``--settle`` seconds more: a ThreadLoader's decode
calls run slower over its first thousands of images, and windows right after its first batch
measured that ramp, not the steady state (docs/benchmarks.md, "The GIL beside a training loop"). A
window in which a load loaded nothing says so ("none in 1 s"), rather than 0 images/s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from PIL import Image

from benchmarks import common, loaders, report
from benchmarks.common import names
from benchmarks.datasets import OUTPUT_SIZE, ensure_dataset, list_images

SET = "varied"
BACKGROUNDS = ("threadloader", "dali", "decode", "spin")
DEFAULT_BACKGROUNDS = ("threadloader", "decode", "spin")
"""Without DALI, which few machines have installed: ``--backgrounds`` names it."""
OPS = ("cpu", "cuda")
_CHUNK = 10  # ops between clock reads: a spinning neighbour makes each op wait a switch interval
_START_TIMEOUT_S = 120.0


@dataclass
class GilRow:
    """One (switch interval, background load, op kind) measurement."""

    switch_interval_ms: float
    background: str  # "threadloader" (with its engine: "threadloader[capi]"), "dali", "decode" or "spin"
    ops: str
    op_us_alone: float
    op_us_beside: float
    images_per_s_alone: float | None  # the load with the main thread idle
    images_per_s_beside: float | None  # the load while the loop runs
    delay_us_per_image: float | None  # main-thread delay per image loaded meanwhile
    images_alone: int | None = None  # images loaded in the alone window (0: it was empty)
    images_beside: int | None = None  # images loaded in the beside window
    seconds_alone: float | None = None  # the windows' lengths
    seconds_beside: float | None = None

    @property
    def slowdown(self) -> float:
        return self.op_us_beside / self.op_us_alone


class Background:
    """A load in a thread of its own, counting the images it has loaded until stopped."""

    def __init__(self, work: Callable[[threading.Event, Background], None]) -> None:
        self.images = 0  # written by the load's thread only
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work,), name="gil-background", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[threading.Event, Background], None]) -> None:
        try:
            work(self._stop, self)
        except BaseException as e:  # reported by wait_started/stop in the main thread
            self.error = e

    def wait_started(self, *, counts_images: bool) -> None:
        """Returns once the load has produced something (its start-up is not measured)."""
        deadline = time.monotonic() + _START_TIMEOUT_S
        while counts_images and self.images == 0 and self.error is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the background load loaded nothing in {_START_TIMEOUT_S:.0f} s")
            self._stop.wait(0.05)
        if self.error is not None:
            raise RuntimeError("the background load failed") from self.error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=_START_TIMEOUT_S)
        if self.error is not None:
            raise RuntimeError("the background load failed") from self.error


def _spin(stop: threading.Event, _: Background) -> None:
    while not stop.is_set():
        pass


def _decode(blobs: list[bytes], device: str) -> Callable[[threading.Event, Background], None]:
    """Decoding in-memory bytes and nothing else, as a reader's decoder call would."""

    def on_gpu(stop: threading.Event, counter: Background) -> None:
        nv = common.import_optional("nvidia.nvimgcodec")
        decoder = nv.Decoder()
        params = nv.DecodeParams(color_spec=nv.SRGB, sample_format=nv.I_RGB)
        stream = torch.cuda.Stream()
        while not stop.is_set():
            for start in range(0, len(blobs), 64):
                batch = [nv.CodeStream(data) for data in blobs[start : start + 64]]
                decoder.decode(batch, params=params, cuda_stream=stream.cuda_stream)
                stream.synchronize()  # one wait a batch, so the queue stays short
                counter.images += len(batch)

    def on_cpu(stop: threading.Event, counter: Background) -> None:
        while not stop.is_set():
            for data in blobs:
                with Image.open(io.BytesIO(data)) as image:
                    image.convert("RGB")
                counter.images += 1

    return on_gpu if device == "cuda" else on_cpu


def _consumed(
    batches: Callable[[], loaders.Batches], device: str
) -> Callable[[threading.Event, Background], None]:
    """A loader's batches taken in the background thread, counted once the loader is past its start.

    Batches are taken on a stream of this thread's own, and waited for there, as the decode background
    waits for its own: taken on the default stream, they made the main thread's ops, queued on that
    stream too, wait for every batch, a delay the GIL had no part in.
    """

    def run(stop: threading.Event, counter: Background) -> None:
        side = torch.cuda.Stream() if device == "cuda" else None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            stream = batches()
            try:
                # The first batch is the start-up's (a ThreadLoader's stream hands the next one once it
                # is past its CPU start, loaders.past_the_cpu_start): counting from it starts the windows.
                next(stream)
                for images, _ in stream:
                    if side is not None:
                        side.synchronize()  # one wait a batch, so the queue stays short
                    counter.images += images.shape[0]
                    if stop.is_set():
                        break
            finally:
                stream.close()

    return run


def _threadloader(
    root: Path, device: str, batch_size: int, engine: str | None
) -> Callable[[threading.Event, Background], None]:
    work = loaders.Work(OUTPUT_SIZE[SET], batch_size, device, normalize=True)
    return _consumed(
        lambda: loaders.threadloader(root, work, num_threads=None, channels_last=True, engine=engine), device
    )


def _dali(
    root: Path, device: str, batch_size: int, workers: int
) -> Callable[[threading.Event, Background], None]:
    work = loaders.Work(OUTPUT_SIZE[SET], batch_size, device, normalize=True)
    return _consumed(lambda: loaders.dali(root, work, workers=workers), device)


def op_loop(ops: str, seconds: float) -> tuple[int, float]:
    """Runs tiny torch ops for about ``seconds``; returns how many and the wall seconds taken."""
    x = torch.zeros(4, device="cuda" if ops == "cuda" else "cpu")
    count, started = 0, time.perf_counter()
    deadline = started + seconds
    while True:
        for _ in range(_CHUNK):
            x.add_(1)
        count += _CHUNK
        if time.perf_counter() >= deadline:
            break
    if ops == "cuda":
        torch.cuda.current_stream().synchronize()  # its own ops, not the background's work
    return count, time.perf_counter() - started


def _op_us_alone(ops: str, seconds: float) -> float:
    """Median of three runs of the loop alone, in microseconds per op."""
    runs = []
    for _ in range(3):
        count, wall = op_loop(ops, seconds / 3)
        runs.append(1e6 * wall / count)
    return sorted(runs)[1]


def measure(args: argparse.Namespace) -> list[GilRow]:
    """Every (interval, background, ops) row; the switch interval is restored afterwards."""
    files = list_images(args.root)
    blobs = [path.read_bytes() for path, _ in files]
    loads: dict[str, Callable[[threading.Event, Background], None]] = {}
    for name in args.backgrounds:
        if name == "dali":
            loads[name] = _dali(args.root, args.device, args.batch_size, args.workers)
        elif name != "threadloader":
            loads[name] = _decode(blobs, args.device) if name == "decode" else _spin
        elif args.device != "cuda":
            loads[name] = _threadloader(args.root, args.device, args.batch_size, None)
        else:  # each engine a row: nvImageCodec's C API (the default) and its Python API
            for engine in args.engines:
                loads[f"threadloader[{engine}]"] = _threadloader(
                    args.root, args.device, args.batch_size, engine
                )
    previous, rows = sys.getswitchinterval(), []
    try:
        for interval in args.switch_intervals:
            sys.setswitchinterval(interval)
            alone = {ops: _op_us_alone(ops, args.seconds) for ops in args.ops}
            for name in loads:
                counts = name != "spin"
                load = Background(loads[name])
                try:
                    load.wait_started(counts_images=counts)
                    time.sleep(args.settle)
                    before = load.images
                    time.sleep(args.seconds)
                    idle_images = load.images - before
                    idle_rate = idle_images / args.seconds if counts else None
                    for ops in args.ops:
                        before = load.images
                        count, wall = op_loop(ops, args.seconds)
                        images = load.images - before
                        delay = wall - count * alone[ops] / 1e6
                        row = GilRow(
                            switch_interval_ms=1000 * interval,
                            background=name,
                            ops=ops,
                            op_us_alone=alone[ops],
                            op_us_beside=1e6 * wall / count,
                            images_per_s_alone=idle_rate,
                            images_per_s_beside=images / wall if counts else None,
                            delay_us_per_image=1e6 * delay / images if counts and images else None,
                            images_alone=idle_images if counts else None,
                            images_beside=images if counts else None,
                            seconds_alone=args.seconds,
                            seconds_beside=wall,
                        )
                        rows.append(row)
                        print(f"    {_line(row)}", file=sys.stderr, flush=True)
                finally:
                    load.stop()
    finally:
        sys.setswitchinterval(previous)
    return rows


def _line(row: GilRow) -> str:
    delay = "—" if row.delay_us_per_image is None else f"{row.delay_us_per_image:,.0f} us/image"
    empty = [
        f"no image loaded in its {name} window"
        for name, images in (("alone", row.images_alone), ("beside", row.images_beside))
        if images == 0
    ]
    return (
        f"switch {row.switch_interval_ms:g} ms, {row.background}, {row.ops} ops: "
        f"{row.op_us_alone:.2f} -> {row.op_us_beside:.2f} us/op ({row.slowdown:.1f}x), {delay}"
        + "".join(f"; {note}" for note in empty)
    )


SIZED = {  # option: (full run, --quick, what it is)
    "count": (1000, 32, "images in the varied set"),
    "batch_size": (64, 8, "ThreadLoader batch size"),
    "seconds": (1.0, 0.3, "length of each timed loop"),
    "workers": (8, 2, "DALI's CPU threads (the training benchmark's default)"),
    "settle": (3.0, 0.0, "seconds each load runs past its start before its windows"),
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse options."""
    p = common.parser("benchmarks.gil", __doc__, SIZED, "gil.md and gil.json")
    p.add_argument(
        "--switch-intervals",
        type=lambda text: [float(x) for x in text.split(",") if x],
        default=[0.005, 0.0001],
        help="sys.setswitchinterval values in seconds (default 0.005,0.0001)",
    )
    p.add_argument(
        "--backgrounds", type=names(BACKGROUNDS), default=list(DEFAULT_BACKGROUNDS),
        help=f"of {','.join(BACKGROUNDS)} (default {','.join(DEFAULT_BACKGROUNDS)}: dali only when named)",
    )  # fmt: skip
    p.add_argument(
        "--engines", type=names(common.ENGINES), default=list(common.ENGINES),
        help="nvImageCodec's C API, its Python API: a threadloader row each on a GPU (default both)",
    )  # fmt: skip
    p.add_argument("--ops", type=names(OPS), help="cpu,cuda (default: cuda too on a GPU)")
    args = common.parse(p, argv, SIZED)
    args.ops = args.ops or (list(OPS) if args.device == "cuda" else ["cpu"])
    if "cuda" in args.ops and args.device != "cuda":
        p.error("--ops cuda needs --device cuda")
    return args


def main(argv: Sequence[str] | None = None) -> list[GilRow]:
    """Measure, print the table, write it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.root = ensure_dataset(SET, count=args.count, root=args.data_root)
    started = time.perf_counter()
    rows = measure(args)
    data = {
        "command": common.command_line("benchmarks.gil", argv),
        "hardware": common.hardware(args.device),
        "config": {
            "set": SET,
            "count": args.count,
            "batch_size": args.batch_size,
            "seconds": args.seconds,
            "settle": args.settle,
            "device": args.device,
            "wall_s": round(time.perf_counter() - started),
        },
        "rows": [asdict(r) | {"slowdown": r.slowdown} for r in rows],
    }
    text = "\n".join(report.gil_tables([report.ResultFile((args.out or Path()) / "gil.json", data)]))
    print(text)
    if args.out:
        common.write_results(args.out, "gil", text, data)
    return rows


if __name__ == "__main__":
    main()
