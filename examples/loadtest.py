"""Load test for examples/server.py: concurrent HTTP clients on loopback for a bounded time.

    python examples/loadtest.py --modes batched,single,pillow --concurrency 1,8,32 --seconds 10 \
        [--device cuda] [--out results.json]
    python examples/loadtest.py --port 8000 --concurrency 8   # a server already on 127.0.0.1:8000

With ``--modes``, a server is started for each mode (``--port 0``, in a subprocess) and stopped after
its runs. Each client is a thread with one keep-alive ``http.client`` connection, POSTing JPEGs cut
from the bundled sample photographs in turn, for ``--seconds`` per concurrency level after a
``--warmup``. It reports requests per second, p50/p99 latency in milliseconds as the clients see it,
and the server's mean micro-batch size, as a markdown table (and JSON with ``--out``). Everything is
bounded: the levels, their duration, the client timeout, and the server start.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from threadloader.__main__ import sample_photos

HOST = "127.0.0.1"  # loopback only: this drives a local server, never anything else
SERVER = Path(__file__).with_name("server.py")
CLIENT_TIMEOUT = 30.0
SERVER_START_TIMEOUT = 300.0  # building ResNet-50 and a first CUDA context can take a while
SERVER_STOP_TIMEOUT = 10.0


def drive(port: int, payloads: list[bytes], clients: int, seconds: float) -> dict[str, Any]:
    """Runs ``clients`` threads against the server for ``seconds``; returns throughput and latency."""
    stop_at = time.perf_counter() + seconds
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients

    def client(number: int) -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=CLIENT_TIMEOUT)
        sent = number * 7  # clients start at different images
        try:
            while time.perf_counter() < stop_at:
                body = payloads[sent % len(payloads)]
                sent += 1
                started = time.perf_counter()
                try:
                    connection.request("POST", "/predict", body, {"Content-Type": "application/octet-stream"})
                    response = connection.getresponse()
                    response.read()
                except (OSError, http.client.HTTPException):
                    connection.close()  # reconnects on the next request
                    errors[number] += 1
                    continue
                if response.status == 200:
                    latencies[number].append(time.perf_counter() - started)
                else:
                    errors[number] += 1
        finally:
            connection.close()

    before = server_stats(port)
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), name=f"loadtest-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    done = np.array([x for per_client in latencies for x in per_client]) * 1000
    return {
        "concurrency": clients,
        "seconds": round(elapsed, 3),
        "requests": int(done.size),
        "errors": sum(errors),
        "req_per_s": round(done.size / elapsed, 1),
        "p50_ms": round(float(np.percentile(done, 50)), 2) if done.size else None,
        "p99_ms": round(float(np.percentile(done, 99)), 2) if done.size else None,
        "mean_batch": mean_batch(before, server_stats(port)),
    }


def server_stats(port: int) -> dict[str, Any]:
    """The server's decoder counters (empty for ``--mode pillow``)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=CLIENT_TIMEOUT)
    try:
        connection.request("GET", "/stats")
        return json.loads(connection.getresponse().read())
    finally:
        connection.close()


def mean_batch(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Mean micro-batch size between two /stats snapshots; ``None`` where the server does not batch."""
    if "batch_sizes" not in after:
        return None
    old = before.get("batch_sizes", {})
    counts = {int(size): n - old.get(size, 0) for size, n in after["batch_sizes"].items()}
    batches = sum(counts.values())
    return round(sum(size * n for size, n in counts.items()) / batches, 2) if batches else None


@contextmanager
def started_server(mode: str, args: argparse.Namespace) -> Iterator[int]:
    """Starts examples/server.py on a free loopback port; yields the port; stops it afterwards."""
    command = [sys.executable, str(SERVER), "--host", HOST, "--port", "0", "--mode", mode]
    command += ["--max-batch", str(args.max_batch), "--max-delay-ms", str(args.max_delay_ms)]
    command += ["--model", args.model]
    if args.device:
        command += ["--device", args.device]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        yield _announced_port(process)
    finally:
        process.terminate()
        try:
            process.wait(SERVER_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        process.stdout.close()  # type: ignore[union-attr]


def _announced_port(process: subprocess.Popen[str]) -> int:
    """Reads the server's ``listening on http://HOST:PORT`` line, within the start timeout."""
    lines: queue.Queue[str] = queue.Queue()
    # Ends with the line, or when the server's stdout closes (the process is stopped in every case).
    threading.Thread(target=lambda: lines.put(process.stdout.readline()), daemon=True).start()  # type: ignore[union-attr]
    try:
        line = lines.get(timeout=SERVER_START_TIMEOUT)
    except queue.Empty:
        raise TimeoutError(f"the server did not start within {SERVER_START_TIMEOUT:.0f} s") from None
    if not line.startswith("listening on "):
        raise RuntimeError(f"the server failed to start (exit code {process.poll()}); see its stderr above")
    return int(line.rsplit(":", 1)[1])


def markdown(rows: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    lines = [
        "| mode | clients | req/s | p50 ms | p99 ms | mean batch | errors |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        cells = [row[k] for k in ("mode", "concurrency", "req_per_s", "p50_ms", "p99_ms", "mean_batch")]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + f" | {row['errors']} |")
    return "\n".join(lines)


def run_levels(mode: str, port: int, payloads: list[bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Warms the server up, then measures each concurrency level."""
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.warmup > 0:
        drive(port, payloads, max(levels), args.warmup)
    rows = []
    for clients in levels:
        row = {"mode": mode, **drive(port, payloads, clients, args.seconds)}
        print(
            f"{mode:8} {clients:4} clients: {row['req_per_s']:9.1f} req/s  p50 {row['p50_ms']} ms  "
            f"p99 {row['p99_ms']} ms  mean batch {row['mean_batch']}  errors {row['errors']}",
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--port", type=int, help="drive a server already running on 127.0.0.1:PORT")
    target.add_argument("--modes", help="start a server for each of these modes, e.g. batched,single,pillow")
    parser.add_argument(
        "--device", default=None, help="passed to the servers started (default: GPU if usable)"
    )
    parser.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    parser.add_argument("--images", type=int, default=256, help="distinct JPEGs sent in turn")
    parser.add_argument("--side", type=int, default=256, help="side of the JPEGs sent")
    parser.add_argument("--max-batch", type=int, default=64, help="for the servers started")
    parser.add_argument("--max-delay-ms", type=float, default=2.0, help="for the servers started")
    parser.add_argument(
        "--model",
        choices=["resnet50", "none"],
        default="resnet50",
        help="for the servers started (none: decode only)",
    )
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)

    payloads = [data for data, _ in sample_photos(args.images, side=args.side)]
    rows: list[dict[str, Any]] = []
    if args.port is not None:
        rows += run_levels(f"port {args.port}", args.port, payloads, args)
    else:
        for mode in args.modes.split(","):
            with started_server(mode, args) as port:
                rows += run_levels(mode, port, payloads, args)
    table = markdown(rows)
    print(table)
    if args.out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        machine = {
            "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "python": platform.python_version(),
            "torch": torch.__version__,
        }
        args.out.write_text(json.dumps({"settings": settings, "machine": machine, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
