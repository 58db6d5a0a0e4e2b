"""Load test for the example servers: concurrent HTTP clients on loopback for a bounded time.

    python examples/loadtest.py --modes batched,single,pillow --concurrency 1,8,32 --seconds 10 \
        [--device cuda] [--out results.json]
    python examples/loadtest.py --server fastapi --modes batched,per-request,pillow --concurrency 1,8,32
    python examples/loadtest.py --port 8000 --concurrency 8   # a server already on 127.0.0.1:8000

With ``--modes``, a server (examples/server.py, or serve_fastapi.py with ``--server fastapi``) is
started for each mode (``--port 0``, in a subprocess) and stopped after its runs. Each client is a
thread with one keep-alive ``http.client`` connection, POSTing JPEGs in turn (cut from the bundled
sample photographs, or ``--images-from DIR``), for ``--seconds`` per concurrency level after a
``--warmup``; ``--procs`` spreads the clients over processes, so that one Python client process does
not bound what is measured. It reports requests per second, p50/p99 latency in milliseconds as the
clients see it, the answers that were not 200 by status (503, the designed refusal, apart), the
server's mean micro-batch size and its GPU memory where its GET /stats tells them, as a markdown table
(and JSON with ``--out``). Everything is bounded: the levels, their duration, the client timeout, and
the server start.
"""

from __future__ import annotations

import argparse
import base64
import collections
import concurrent.futures
import http.client
import json
import multiprocessing
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
SERVERS = {
    "stdlib": Path(__file__).with_name("server.py"),
    "fastapi": Path(__file__).with_name("serve_fastapi.py"),
}
CLIENT_TIMEOUT = 30.0
SERVER_START_TIMEOUT = 300.0  # building ResNet-50 and a first CUDA context can take a while
SERVER_STOP_TIMEOUT = 10.0


def drive(
    port: int, payloads: list[bytes], clients: int, seconds: float, *, procs: int = 1, body: str = "raw"
) -> dict[str, Any]:
    """Runs ``clients`` clients (threads, over ``procs`` processes) against the server for ``seconds``.

    ``body="b64json"`` sends ``{"image": base64}`` as JSON (LitServe's request format) instead of the raw
    bytes. Returns throughput, latency and the answers by status.
    """
    before = server_stats(port)
    procs = max(1, min(procs, clients))
    shares = [range(i, clients, procs) for i in range(procs)]
    started = time.perf_counter()
    if procs == 1:
        parts = [_clients(port, payloads, list(shares[0]), seconds, body)]
    else:
        context = multiprocessing.get_context("fork")  # the payloads are shared, not pickled
        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=context) as pool:
            futures = [pool.submit(_clients, port, payloads, list(share), seconds, body) for share in shares]
            parts = [future.result() for future in futures]
    elapsed = time.perf_counter() - started
    done = np.array([x for latencies, _ in parts for x in latencies]) * 1000
    statuses: collections.Counter[str] = collections.Counter()
    for _, counts in parts:
        statuses.update(counts)
    after = server_stats(port)
    return {
        "concurrency": clients,
        "seconds": round(elapsed, 3),
        "requests": int(done.size),
        "errors": sum(n for status, n in statuses.items() if status not in ("200", "503")),
        "rejected_503": statuses.get("503", 0),
        "statuses": dict(sorted(statuses.items())),
        "req_per_s": round(done.size / elapsed, 1),
        "p50_ms": round(float(np.percentile(done, 50)), 2) if done.size else None,
        "p99_ms": round(float(np.percentile(done, 99)), 2) if done.size else None,
        "mean_batch": mean_batch(before, after),
        "gpu_max_allocated_gib": _gib(after.get("cuda_max_memory_allocated")),
        "gpu_reserved_gib": _gib(after.get("cuda_memory_reserved")),
    }


def _clients(
    port: int, payloads: list[bytes], numbers: list[int], seconds: float, body: str
) -> tuple[list[float], dict[str, int]]:
    """Client threads ``numbers`` for ``seconds``: the latencies of their 200s and every answer's count by
    status (``conn`` for a connection that failed)."""
    stop_at = time.perf_counter() + seconds
    latencies: list[list[float]] = [[] for _ in numbers]
    statuses: list[collections.Counter[str]] = [collections.Counter() for _ in numbers]
    if body == "b64json":
        encoded = [json.dumps({"image": base64.b64encode(data).decode()}).encode() for data in payloads]
        headers = {"Content-Type": "application/json"}
    else:
        encoded, headers = payloads, {"Content-Type": "application/octet-stream"}

    def client(slot: int) -> None:
        connection = http.client.HTTPConnection(HOST, port, timeout=CLIENT_TIMEOUT)
        sent = numbers[slot] * 7  # clients start at different images
        try:
            while time.perf_counter() < stop_at:
                data = encoded[sent % len(encoded)]
                sent += 1
                started = time.perf_counter()
                try:
                    connection.request("POST", "/predict", data, headers)
                    response = connection.getresponse()
                    response.read()
                except (OSError, http.client.HTTPException):
                    connection.close()  # reconnects on the next request
                    statuses[slot]["conn"] += 1
                    continue
                statuses[slot][str(response.status)] += 1
                if response.status == 200:
                    latencies[slot].append(time.perf_counter() - started)
                elif response.getheader("Connection", "").lower() == "close":
                    connection.close()
        finally:
            connection.close()

    threads = [
        threading.Thread(target=client, args=(i,), name=f"loadtest-{n}") for i, n in enumerate(numbers)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    total: collections.Counter[str] = collections.Counter()
    for counts in statuses:
        total.update(counts)
    return [x for per_client in latencies for x in per_client], dict(total)


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / 2**30, 3)


def server_stats(port: int) -> dict[str, Any]:
    """The server's GET /stats (empty where it has none, as LitServe)."""
    connection = http.client.HTTPConnection(HOST, port, timeout=CLIENT_TIMEOUT)
    try:
        connection.request("GET", "/stats")
        response = connection.getresponse()
        stats = json.loads(response.read()) if response.status == 200 else {}
        return stats if isinstance(stats, dict) else {}
    except (OSError, http.client.HTTPException, ValueError):
        return {}
    finally:
        connection.close()


def mean_batch(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """Mean micro-batch size between two /stats snapshots (the model stage's where the server has one,
    else the decoder's); ``None`` where the server does not batch."""
    stage = next((key for key in ("model", "decoder") if key in after), None)
    if stage is not None:
        before, after = before.get(stage, {}), after[stage]
    if "batch_sizes" not in after:
        return None
    old = before.get("batch_sizes", {})
    counts = {int(size): n - old.get(size, 0) for size, n in after["batch_sizes"].items()}
    batches = sum(counts.values())
    return round(sum(size * n for size, n in counts.items()) / batches, 2) if batches else None


@contextmanager
def started_server(command: list[str], log: Path | None = None) -> Iterator[int]:
    """Starts a server (its command, which must take ``--port 0``); yields its port; stops it afterwards.

    It is stopped with SIGTERM, then killed if it has not exited within the stop timeout. Its stderr
    goes to ``log`` where given."""
    stderr = log.open("w") if log is not None else None
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
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
        if stderr is not None:
            stderr.close()


def server_command(server: str, mode: str, args: argparse.Namespace) -> list[str]:
    """The command that starts ``server`` (stdlib or fastapi) in ``mode`` on a free loopback port."""
    command = [sys.executable, str(SERVERS[server]), "--host", HOST, "--port", "0", "--mode", mode]
    command += ["--max-batch", str(args.max_batch), "--max-delay-ms", str(args.max_delay_ms)]
    command += ["--model", args.model]
    if args.device:
        command += ["--device", args.device]
    return command


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
    keys = ("mode", "concurrency", "req_per_s", "p50_ms", "p99_ms", "mean_batch", "gpu_max_allocated_gib")
    lines = [
        "| mode | clients | req/s | p50 ms | p99 ms | mean batch | GPU max alloc GiB | 503 | other errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        cells = [row.get(key) for key in keys]
        others = ", ".join(f"{s}: {n}" for s, n in row.get("statuses", {}).items() if s not in ("200", "503"))
        cells += [row.get("rejected_503", 0), others or 0]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def run_levels(mode: str, port: int, payloads: list[bytes], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Warms the server up, then measures each concurrency level."""
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.warmup > 0:
        drive(port, payloads, max(levels), args.warmup, procs=args.procs, body=args.body)
    rows = []
    for clients in levels:
        row = {"mode": mode, **drive(port, payloads, clients, args.seconds, procs=args.procs, body=args.body)}
        print(
            f"{mode:12} {clients:4} clients: {row['req_per_s']:9.1f} req/s  p50 {row['p50_ms']} ms  "
            f"p99 {row['p99_ms']} ms  mean batch {row['mean_batch']}  503 {row['rejected_503']}  "
            f"statuses {row['statuses']}",
            flush=True,
        )
        rows.append(row)
    return rows


def load_payloads(args: argparse.Namespace) -> list[bytes]:
    """The JPEGs to send: ``--images-from``'s files (sorted, at most ``--images``), else sample cuts."""
    if args.images_from is not None:
        files = sorted(p for p in args.images_from.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg"))
        if not files:
            raise SystemExit(f"--images-from {args.images_from}: no .jpg files there")
        return [path.read_bytes() for path in files[: args.images]]
    return [data for data, _ in sample_photos(args.images, side=args.side)]


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--port", type=int, help="drive a server already running on 127.0.0.1:PORT")
    target.add_argument("--modes", help="start a server for each of these modes, e.g. batched,single,pillow")
    parser.add_argument(
        "--server", choices=sorted(SERVERS), default="stdlib", help="the server --modes starts"
    )
    parser.add_argument(
        "--device", default=None, help="passed to the servers started (default: GPU if usable)"
    )
    parser.add_argument("--concurrency", default="1,8,32", help="client counts, comma-separated")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each level")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of load before measuring")
    parser.add_argument("--procs", type=int, default=1, help="client processes the clients are spread over")
    parser.add_argument(
        "--body", choices=["raw", "b64json"], default="raw", help="b64json: LitServe's format"
    )
    parser.add_argument("--images", type=int, default=256, help="distinct JPEGs sent in turn")
    parser.add_argument("--images-from", type=Path, help="a folder of JPEGs to send (else sample cuts)")
    parser.add_argument("--side", type=int, default=256, help="side of the sample JPEGs sent")
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

    payloads = load_payloads(args)
    rows: list[dict[str, Any]] = []
    if args.port is not None:
        rows += run_levels(f"port {args.port}", args.port, payloads, args)
    else:
        for mode in args.modes.split(","):
            with started_server(server_command(args.server, mode, args)) as port:
                rows += run_levels(mode, port, payloads, args)
    table = markdown(rows)
    print(table)
    if args.out:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"settings": settings, "machine": machine(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
