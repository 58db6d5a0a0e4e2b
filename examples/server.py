"""An image-classification HTTP server whose decoding goes through threadloader.BatchDecoder.

    python examples/server.py --port 8000 [--mode batched|single|pillow] [--device cuda|cpu]

POST /predict with the raw image bytes as the body. The reply is JSON: the top-5 classes of a
torchvision ResNet-50 with random weights (``weights=None``: the point is the serving path, not the
answers), or, where torchvision is not installed, the decoded tensor's shape and checksum.
GET /stats returns the decoder's counters (batch-size histogram, latency percentiles); GET /health, ok.

Modes, so that the load test can compare them on one server:
    batched  BatchDecoder: requests from all connections decoded together in micro-batches.
    single   BatchDecoder with max_batch=1: every request decoded alone, otherwise the same path.
    pillow   Pillow decode and torch resize in the request's own thread, then a copy to the device.

Inference runs once per request (batching the model too is out of scope here). Each request runs on
its own CUDA stream; the decoded tensor is ready on it without a host sync. The server prints one line,
``listening on http://HOST:PORT``, when it accepts requests (``--port 0`` picks a free port), and stops
on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
from collections.abc import Callable
from contextlib import nullcontext
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from threadloader import BatchDecoder, LoaderClosedError, OutputFormat, SampleError
from threadloader.decode.pillow import decode_rgb
from threadloader.service import QueueFullError

SIZE = (224, 224)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MODES = ("batched", "single", "pillow")


class Classifier:
    """Bytes in, JSON-ready answer out; safe to call from every request thread at once."""

    def __init__(
        self, *, mode: str, device: str | None, max_batch: int, max_delay_ms: float, model: str = "resnet50"
    ) -> None:
        self.decoder: BatchDecoder | None = None
        if mode == "pillow":
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            output = OutputFormat(size=SIZE, dtype=torch.float32, mean=MEAN, std=STD)

            def decode_here(body: bytes) -> torch.Tensor:
                try:
                    pixels = decode_rgb(body)
                except Exception as exc:  # answered 400, as BatchDecoder's SampleError is
                    raise SampleError.from_exception(exc, index=0, origin="body", stage="decode") from exc
                return output.apply([torch.from_numpy(pixels).permute(2, 0, 1)])[0].to(self.device)

            self._decode: Callable[[bytes], torch.Tensor] = decode_here
        else:
            self.decoder = BatchDecoder(
                device=device,
                max_batch=max_batch if mode == "batched" else 1,
                max_delay_ms=max_delay_ms,
                size=SIZE,
                dtype=torch.float32,
                mean=MEAN,
                std=STD,
                channels_last=True,
            )
            self.device = self.decoder.device
            self._decode = self.decoder.decode
        # model="none" serves decoding alone: what the load test compares across modes.
        self.model, self.categories = _resnet50(self.device) if model == "resnet50" else (None, [])

    def predict(self, body: bytes) -> dict[str, Any]:
        """Decodes and classifies one image on a stream of its own."""
        cuda = self.device.type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream(self.device)) if cuda else nullcontext():
            image = self._decode(body)  # ready on this stream: BatchDecoder made it wait for the decode
            answer: dict[str, Any] = {"shape": list(image.shape)}
            if self.model is None:
                answer["checksum"] = round(float(image.double().sum()), 3)
                return answer
            batch = image.unsqueeze(0).contiguous(memory_format=torch.channels_last)
            autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else nullcontext()
            with torch.inference_mode(), autocast:
                scores, classes = self.model(batch).float().softmax(dim=1)[0].topk(5)
            answer["top5"] = [
                {"class": self.categories[c], "index": c, "score": round(s, 5)}
                for s, c in zip(scores.tolist(), classes.tolist(), strict=True)
            ]
            return answer

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.decoder.stats()) if self.decoder is not None else {}

    def close(self) -> None:
        if self.decoder is not None:
            self.decoder.close(cancel_pending=True)


def _resnet50(device: torch.device) -> tuple[torch.nn.Module | None, list[str]]:
    """A ResNet-50 with random weights and the ImageNet class names; ``(None, [])`` without torchvision."""
    try:
        from torchvision.models import ResNet50_Weights, resnet50
    except ImportError:
        return None, []
    model = resnet50(weights=None).eval().to(device, memory_format=torch.channels_last)
    return model, list(ResNet50_Weights.IMAGENET1K_V2.meta["categories"])


class Server(ThreadingHTTPServer):
    daemon_threads = True  # a client holding a connection open does not keep the process alive
    request_queue_size = 256  # listen backlog: many clients connect at once (the default is 5)

    def __init__(self, address: tuple[str, int], classifier: Classifier) -> None:
        super().__init__(address, Handler)
        self.classifier = classifier


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: load-test clients reuse their connection
    disable_nagle_algorithm = True  # else headers then body cost a 40 ms delayed-ACK round per reply
    server: Server

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/stats":
            self._reply(200, self.server.classifier.stats())
        else:
            self._reply(404, {"error": f"no such path {self.path!r}: POST /predict, GET /stats"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        if self.path != "/predict":
            self._reply(404, {"error": f"no such path {self.path!r}: POST the image to /predict"})
        elif not body:
            self._reply(400, {"error": "empty body: POST the image file's bytes"})
        else:
            try:
                self._reply(200, self.server.classifier.predict(body))
            except SampleError as error:
                self._reply(400, {"error": str(error)})
            except (QueueFullError, LoaderClosedError) as error:
                self._reply(503, {"error": str(error)})

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would cost more than the decode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--mode", choices=MODES, default="batched")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: GPU if usable)")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-delay-ms", type=float, default=2.0)
    parser.add_argument(
        "--model",
        choices=["resnet50", "none"],
        default="resnet50",
        help="none: decode only, answer a checksum",
    )
    args = parser.parse_args(argv)

    classifier = Classifier(
        mode=args.mode,
        device=args.device,
        max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        model=args.model,
    )
    server = Server((args.host, args.port), classifier)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops it as Ctrl-C does
    host, port = server.server_address[:2]
    model = "resnet50 (random weights)" if classifier.model is not None else "none: shape+checksum"
    print(f"listening on http://{host}:{port}", flush=True)
    print(f"mode={args.mode} device={classifier.device} model={model}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        classifier.close()


if __name__ == "__main__":
    main()
