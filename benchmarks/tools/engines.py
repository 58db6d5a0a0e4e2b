"""Decoder engines per device: one Decoder, one whose backends split each batch, two Decoders in two threads.

Usage: ``python -m benchmarks.tools.engines [--sets fixed,varied] [--count 2048] [--out FILE]``

nvImageCodec alone on bytes already in memory (and, for the read rows, on files), whole images,
batches of ``--batch`` images; every row decodes the same images once after a warm-up call and
counts only the images that came back. This is the measurement behind the decode layer's choice of
engines (docs/design.md): whether a second Decoder, or the hardware JPEG engine sharing each batch with
the CUDA decoder (``Backend(HW_GPU_ONLY, load_hint=...)``, DALI's ``hw_decoder_load``), decodes more
images per second than the one Decoder the library calls today, and whether letting nvImageCodec read
the files (``CodeStream(path)``) costs less than reading them in Python.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.datasets import ensure_dataset, list_images
from benchmarks.run import hardware

Engine = Callable[[Any], Any]


def _backends(nv: Any, spec: str) -> list[Any] | None:
    """The backends of one engine set-up.

    ``all``: nvImageCodec's defaults, every backend (the library's ``backend="all"``); ``split-F``: the
    hardware engine takes a fraction F of each batch (fixed), the CUDA and hybrid decoders the rest;
    ``adaptive-F``: the same, balanced by nvImageCodec to minimize idle time; or one backend kind's name.
    """
    if spec == "all":
        return None
    policy_of = {"split": nv.LoadHintPolicy.FIXED, "adaptive": nv.LoadHintPolicy.ADAPTIVE_MINIMIZE_IDLE_TIME}
    kind, _, share = spec.partition("-")
    if kind in policy_of:
        return [
            nv.Backend(nv.BackendKind.HW_GPU_ONLY, load_hint=float(share), load_hint_policy=policy_of[kind]),
            nv.Backend(nv.BackendKind.GPU_ONLY, load_hint=1.0),
            nv.Backend(nv.BackendKind.HYBRID_CPU_GPU, load_hint=1.0),
        ]
    return [nv.Backend(getattr(nv.BackendKind, kind))]


def _decode_all(decoder: Any, sources: Sequence[Any], params: Any, batch: int, stream: int) -> int:
    decoded = 0
    for start in range(0, len(sources), batch):
        outs = decoder.decode(sources[start : start + batch], params=params, cuda_stream=stream)
        decoded += sum(out is not None for out in outs)
    return decoded


def _timed_threads(work: list[Callable[[], int]]) -> tuple[float, int]:
    """Runs each callable in its own thread, started together; returns (seconds, images decoded)."""
    counts = [0] * len(work)
    barrier = threading.Barrier(len(work) + 1)

    def run(i: int) -> None:
        barrier.wait()
        counts[i] = work[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(work))]
    for thread in threads:
        thread.start()
    torch.cuda.synchronize()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    torch.cuda.synchronize()
    return time.perf_counter() - started, sum(counts)


def engine_rows(
    root: Path, *, count: int, batch: int, specs: Sequence[str], pools: Sequence[int] = (1, 2)
) -> list[dict[str, Any]]:
    """One row per engine set-up over the same images."""
    from nvidia import nvimgcodec as nv

    paths = [path for path, _ in list_images(root)][:count]
    blobs = [path.read_bytes() for path in paths]
    params = nv.DecodeParams(apply_exif_orientation=True, color_spec=nv.SRGB, sample_format=nv.I_RGB)
    rows: list[dict[str, Any]] = []

    def add(name: str, seconds: float, decoded: int) -> None:
        rows.append({"engine": name, "img_per_s": decoded / seconds, "decoded": decoded, "of": len(blobs)})
        print(f"  {name}: {decoded / seconds:,.0f} img/s ({decoded}/{len(blobs)} decoded)", flush=True)

    for spec in specs:
        for decoders in pools:
            engines = [nv.Decoder(backends=_backends(nv, spec)) for _ in range(decoders)]
            streams = [torch.cuda.Stream() for _ in engines]
            share = [blobs[i::decoders] for i in range(decoders)]
            for engine, stream, part in zip(engines, streams, share, strict=True):
                _decode_all(engine, part[:batch], params, batch, stream.cuda_stream)  # warm-up
            seconds, decoded = _timed_threads(
                [
                    partial(_decode_all, engine, part, params, batch, stream.cuda_stream)
                    for engine, stream, part in zip(engines, streams, share, strict=True)
                ]
            )
            add(f"{spec} x{decoders} decoder(s), {decoders} thread(s)", seconds, decoded)

    # Reading: Python reads the file, then CodeStream(bytes); against CodeStream(path), read in C++.
    decoder = nv.Decoder()
    read_stream = torch.cuda.Stream().cuda_stream
    for label, make in (
        ("read in Python + CodeStream(bytes)", lambda p: nv.CodeStream(p.read_bytes())),
        ("CodeStream(path)", lambda p: nv.CodeStream(str(p))),
    ):
        _decode_all(decoder, [make(p) for p in paths[:batch]], params, batch, read_stream)
        torch.cuda.synchronize()
        started, decoded = time.perf_counter(), 0
        for start in range(0, len(paths), batch):
            decoded += _decode_all(
                decoder, [make(p) for p in paths[start : start + batch]], params, batch, read_stream
            )
        torch.cuda.synchronize()
        add(f"all, {label}", time.perf_counter() - started, decoded)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Prints a row per engine set-up and set; writes them as JSON with ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", default="fixed,varied")
    parser.add_argument("--count", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument(
        "--engines", default="all,split-0.65,adaptive-0.65,HW_GPU_ONLY,GPU_ONLY,HYBRID_CPU_GPU"
    )
    parser.add_argument("--decoders", default="1,2", help="Decoders (each in its own thread) per row")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"hardware": hardware("cuda"), "batch": args.batch, "sets": {}}
    for name in args.sets.split(","):
        print(f"{name} set, {args.count} images, batches of {args.batch}:", flush=True)
        root = ensure_dataset(name, count=args.count)
        report["sets"][name] = engine_rows(
            root,
            count=args.count,
            batch=args.batch,
            specs=args.engines.split(","),
            pools=[int(n) for n in args.decoders.split(",")],
        )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
