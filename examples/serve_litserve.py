"""Image classification on LitServe: LitServe batches the requests, threadloader decodes each batch.

    python examples/serve_litserve.py --port 8000 [--device cuda|cpu] [--model resnet50|none] \
        [--max-batch 64] [--batch-timeout-ms 5]

POST /predict with JSON ``{"image": "<the image file, base64>"}`` (LitServe parses request bodies as
JSON); the reply is serve_fastapi.py's: ``{"top5": [...]}`` from a ResNet-50 with random weights (bf16
on CUDA), or ``{"shape": ..., "mean": ...}`` with ``--model none``. A bad image or request is 400,
``{"detail": ...}``, and fails only its own answer: LitServe answers a whole batch with what its hooks
raise, so a bad one's reply is handed through ``predict`` as its answer instead.

LitServe's own batching (``max_batch_size``, ``batch_timeout``) gathers the requests in its inference
worker process; ``predict`` gets a list of bodies and decodes them together through a
``threadloader.BatchDecoder`` (one micro-batch: they are submitted at once), then runs the model once on
the batch. The server prints ``listening on http://HOST:PORT`` once /health answers (``--port 0``
picks a free port), and stops on SIGTERM or Ctrl-C.
"""

# No `from __future__ import annotations`: LitServe builds its endpoint from decode_request's annotation,
# read at run time.
import argparse
import base64
import binascii
import http.client
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import litserve as ls
import torch
from fastapi.responses import JSONResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_fastapi import Settings, model_stage
from server import MEAN, SIZE, STD

from threadloader import BatchDecoder, SampleError


class Classifier(ls.LitAPI):
    """LitServe's API: body -> bytes, a batch of bytes -> one decode and one model call -> answers."""

    def __init__(self, settings: Settings, *, batch_timeout_s: float) -> None:
        super().__init__(max_batch_size=settings.max_batch, batch_timeout=batch_timeout_s)
        self.settings = settings

    def setup(self, device: str) -> None:
        """In LitServe's inference worker: serve_fastapi.py's model stage, and a decoder."""
        self.device = torch.device(self.settings.device or device)
        self.head = model_stage(self.settings.model, self.device)
        self.decoder = BatchDecoder(
            device=self.device,
            max_batch=self.settings.max_batch,
            max_delay_ms=0,  # LitServe has gathered the batch: decode what is submitted together
            size=SIZE,
            dtype=torch.float32,
            mean=MEAN,
            std=STD,
            max_pixels=self.settings.limits.max_pixels,
        )

    def decode_request(self, request: dict[str, Any]) -> bytes | JSONResponse:
        try:
            return base64.b64decode(request["image"], validate=True)
        except (KeyError, TypeError, binascii.Error):
            return bad_request('send JSON {"image": "<the image file, base64>"}')

    def predict(self, bodies: list[bytes | JSONResponse]) -> list[Any]:
        """One decode of the whole batch (a bad image fails only its own answer), one model call."""
        futures = {i: self.decoder.submit(body) for i, body in enumerate(bodies) if isinstance(body, bytes)}
        images: dict[int, torch.Tensor] = {}
        answers: list[Any] = list(bodies)  # a bad request's reply is its answer
        for position, future in futures.items():
            try:
                images[position] = future.result()
            except SampleError as exc:
                answers[position] = bad_request(f"the body is not an image this server decodes: {exc.reason}")
        if images:
            for position, answer in zip(images, self.head(list(images.values())), strict=True):
                answers[position] = answer
        return answers

    def encode_response(self, output: Any) -> Any:  # Any: a dict, or a bad request's JSONResponse
        return output


def bad_request(detail: str) -> JSONResponse:
    """A 400 in LitServe's error format, returned as an answer: raised, it would answer the whole batch."""
    return JSONResponse({"detail": detail}, status_code=400)


def announce_when_healthy(host: str, port: int, timeout: float = 300.0) -> None:
    """Prints ``listening on`` once /health answers 200 (LitServe's workers are up), from a thread."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        connection = http.client.HTTPConnection(host, port, timeout=2)
        try:
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                print(f"listening on http://{host}:{port}", flush=True)
                return
        except (OSError, http.client.HTTPException):
            pass
        finally:
            connection.close()
        time.sleep(0.2)


def free_port(host: str) -> int:
    """A port free now (LitServe binds its own socket: another process could take it first)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: GPU if usable")
    parser.add_argument("--model", choices=["resnet50", "none"], default="resnet50", help="none: decode only")
    parser.add_argument("--max-batch", type=int, default=64, help="LitServe's max_batch_size")
    parser.add_argument("--batch-timeout-ms", type=float, default=5.0, help="LitServe's batch_timeout")
    parser.add_argument("--timeout", type=float, default=30.0, help="LitServe's request timeout, s")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = Settings(device=device, model=args.model, max_batch=args.max_batch)
    api = Classifier(settings, batch_timeout_s=args.batch_timeout_ms / 1000)
    server = ls.LitServer(api, accelerator=device, devices=1, workers_per_device=1, timeout=args.timeout)
    port = args.port or free_port(args.host)
    threading.Thread(target=announce_when_healthy, args=(args.host, port), daemon=True).start()
    # SIGTERM as Ctrl-C: LitServe's run then stops its server and worker processes.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server.run(host=args.host, port=port, log_level="warning", generate_client_file=False)


if __name__ == "__main__":
    main()
