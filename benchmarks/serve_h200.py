"""The serving load test on one GPU (issue 38's rows): each server variant in turn, over loopback.

    source .carry/gpu-env.sh    # nvImageCodec, for BatchDecoder on the GPU
    OUT=/some/dir python3 -m benchmarks.serve_h200 [--seconds 5] [--soak-seconds 40] [--budget 230]

Rows, each after the server's warm-up, with ``--images`` JPEGs of benchmarks.datasets' "varied" set
(photo crops of mixed sizes, qualities and subsamplings) sent in turn:

- ``fastapi-batched``: examples/serve_fastapi.py, decode (BatchDecoder) and ResNet-50 (MicroBatcher)
  micro-batched, at 1/8/32/128/256 clients; then the soak, 256 clients for ``--soak-seconds`` in
  windows of ``--soak-window`` seconds, each window's GPU memory and resident memory recorded;
- ``fastapi-per-request``: the same server with ``--mode per-request`` (torchvision's decode_jpeg on
  the GPU and the model per request: the baseline);
- ``fastapi-pillow``: ``--mode pillow`` (Pillow in a thread pool, the model micro-batched);
- ``litserve``: examples/serve_litserve.py (LitServe's batching), skipped where LitServe is missing;
- ``fastapi-decode-only``: ``--model none`` at 64 clients.

Each server is started on a free port, waited for (``listening on``), and stopped with SIGTERM. The
rows go to ``$OUT/serve_h200.json`` and ``serve_h200.md``, the progress to stdout, each server's stderr
to ``$OUT/server-<variant>.log``. ``--budget`` bounds the whole run: a row that would end past it is
skipped, and says so; a server that fails to start is recorded as such, and the run goes on.
``--model none`` runs every variant decode-only (a smoke run where torchvision is missing).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.datasets import ensure_dataset, list_images

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
loadtest: Any = importlib.import_module("loadtest")  # examples/loadtest.py: the clients and the table

LEVELS = (1, 8, 32, 128, 256)
START_ALLOWANCE_S = 20.0  # a server's start and warm-up, in the budget's estimate


def variants(device: str, model: str) -> list[tuple[str, list[str], tuple[int, ...], str]]:
    """``(name, command, client levels, body format)`` for each server, in the order they run."""
    common = ["--port", "0", "--device", device, "--model", model]
    fastapi = [sys.executable, str(EXAMPLES / "serve_fastapi.py"), *common]
    litserve = [sys.executable, str(EXAMPLES / "serve_litserve.py"), *common]
    rows = [
        ("fastapi-batched", [*fastapi, "--mode", "batched"], LEVELS, "raw"),
        ("fastapi-per-request", [*fastapi, "--mode", "per-request"], LEVELS, "raw"),
        ("fastapi-pillow", [*fastapi, "--mode", "pillow"], LEVELS, "raw"),
        ("litserve", litserve, LEVELS, "b64json"),
        ("fastapi-decode-only", [*fastapi, "--mode", "batched", "--model", "none"], (64,), "raw"),
    ]
    if importlib.util.find_spec("litserve") is None:
        print("litserve is not installed: its rows are skipped", flush=True)
        rows = [row for row in rows if row[0] != "litserve"]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", choices=["resnet50", "none"], default="resnet50")
    parser.add_argument("--seconds", type=float, default=5.0, help="each row's measured window")
    parser.add_argument("--warmup", type=float, default=2.0, help="load before a server's first row")
    parser.add_argument("--soak-seconds", type=float, default=40.0, help="256 clients on fastapi-batched")
    parser.add_argument("--soak-window", type=float, default=5.0, help="seconds per soak sample")
    parser.add_argument("--images", type=int, default=300, help="varied JPEGs sent in turn")
    parser.add_argument("--procs", type=int, default=4, help="client processes")
    parser.add_argument("--budget", type=float, default=230.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="serve_h200-"))
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget

    root = ensure_dataset("varied", count=args.images, root=Path(tempfile.gettempdir()) / "serve-h200-data")
    payloads = [path.read_bytes() for path, _ in list_images(root)]
    plan = variants(args.device, args.model)
    rows_planned = sum(len(levels) for _, _, levels, _ in plan)
    estimate = rows_planned * args.seconds + len(plan) * (START_ALLOWANCE_S + args.warmup) + args.soak_seconds
    print(
        f"{len(payloads)} varied JPEGs; {rows_planned} rows; about {estimate:.0f} s; "
        f"budget {args.budget:.0f} s"
    )

    rows: list[dict[str, Any]] = []
    soak: list[dict[str, Any]] = []
    for name, command, levels, body in plan:
        if time.monotonic() + START_ALLOWANCE_S + args.seconds > deadline:
            print(f"{name}: skipped, past the budget", flush=True)
            rows.append({"mode": name, "skipped": "budget"})
            continue
        try:
            rows_of, soak_of = serve_variant(name, command, levels, body, payloads, args, out, deadline)
        except (RuntimeError, TimeoutError) as exc:  # the server did not start: its log says why
            print(f"{name}: {exc}; see {out / f'server-{name}.log'}", flush=True)
            rows_of, soak_of = [{"mode": name, "failed": str(exc)}], []
        rows += rows_of
        soak += soak_of
    measured = [row for row in rows if "skipped" not in row and "failed" not in row]
    table = loadtest.markdown(measured)
    soak_table = markdown_soak(soak)
    print(table, soak_table, sep="\n\n")
    report = {"settings": vars(args), "machine": loadtest.machine(), "rows": rows, "soak": soak}
    (out / "serve_h200.json").write_text(json.dumps(report, indent=2))
    (out / "serve_h200.md").write_text(f"{table}\n\n{soak_table}\n")
    print(f"written: {out / 'serve_h200.json'}, {out / 'serve_h200.md'}")


def serve_variant(
    name: str,
    command: list[str],
    levels: tuple[int, ...],
    body: str,
    payloads: list[bytes],
    args: argparse.Namespace,
    out: Path,
    deadline: float,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Starts one server, warms it up, measures its levels (and the soak, for fastapi-batched), stops it."""
    rows: list[dict[str, Any]] = []
    soak: list[dict[str, Any]] = []
    started = time.monotonic()
    with loadtest.started_server(command, log=out / f"server-{name}.log") as port:
        print(f"{name}: started in {time.monotonic() - started:.1f} s on port {port}", flush=True)
        if args.warmup > 0:
            loadtest.drive(port, payloads, max(levels), args.warmup, procs=args.procs, body=body)
        for clients in levels:
            if time.monotonic() + args.seconds > deadline:
                rows.append({"mode": name, "concurrency": clients, "skipped": "budget"})
                continue
            row = {
                "mode": name,
                **loadtest.drive(port, payloads, clients, args.seconds, procs=args.procs, body=body),
            }
            print(
                f"{name:20} {clients:4} clients: {row['req_per_s']:9.1f} req/s  p50 {row['p50_ms']} ms  "
                f"p99 {row['p99_ms']} ms  batch {row['mean_batch']}  statuses {row['statuses']}  "
                f"GPU {row['gpu_max_allocated_gib']} GiB",
                flush=True,
            )
            rows.append(row)
        if name == "fastapi-batched":
            soak = run_soak(port, payloads, args, deadline)
    return rows, soak


def run_soak(
    port: int, payloads: list[bytes], args: argparse.Namespace, deadline: float
) -> list[dict[str, Any]]:
    """256 clients in windows: each window's throughput, statuses and memory, to see memory stay flat."""
    windows: list[dict[str, Any]] = []
    ends = min(time.monotonic() + args.soak_seconds, deadline - 5)
    while time.monotonic() + args.soak_window <= ends:
        row = loadtest.drive(port, payloads, 256, args.soak_window, procs=args.procs)
        stats = loadtest.server_stats(port)
        row["rss_gib"] = round(stats.get("rss_bytes", 0) / 2**30, 3)
        row["at_s"] = round(sum(w["seconds"] for w in windows) + row["seconds"], 1)
        print(
            f"soak {row['at_s']:6.1f} s: {row['req_per_s']:9.1f} req/s  p99 {row['p99_ms']} ms  "
            f"statuses {row['statuses']}  "
            f"GPU {row['gpu_max_allocated_gib']} / {row['gpu_reserved_gib']} GiB  "
            f"RSS {row['rss_gib']} GiB",
            flush=True,
        )
        windows.append(row)
    return windows


def markdown_soak(windows: list[dict[str, Any]]) -> str:
    lines = [
        "| soak at s | req/s | p50 ms | p99 ms | 503 | other errors | GPU max alloc GiB | GPU reserved GiB "
        "| RSS GiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    keys = ("at_s", "req_per_s", "p50_ms", "p99_ms", "rejected_503", "errors", "gpu_max_allocated_gib")
    for window in windows:
        cells = [window.get(key) for key in (*keys, "gpu_reserved_gib", "rss_gib")]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
