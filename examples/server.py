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

Bounds, each a constant below and a command-line option: the body's size (413 past it; Content-Length
required, 411, and checked, 400), an idle socket's life (a client silent that long is dropped), the time
a whole request may take to arrive (``--request-timeout``, 30 s from the connection's accept or the
previous reply: request line, headers and body; past it, 408 and the connection closed, so a client
trickling a byte at a time cannot hold a connection for ever), open connections (503 past them),
pixels per image (413, read from the header before decoding) and pixels being decoded at once across
requests, which bounds decode memory (503 after waiting too long for room). Every error is one line of
JSON, ``{"error": "..."}``, those of http.server's own parsing too (400 for a bad request line, 501 for
a method not served, 505 for a request line without an HTTP version, 431 for huge headers): never an
HTML page, a traceback, or the decoder's internals (its request numbers). A path served by another
method is 405 with an ``Allow`` header (``GET /predict``: ``Allow: POST``); a path not served, 404.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError
from contextlib import contextmanager, nullcontext, suppress
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from threadloader import BatchDecoder, LoaderClosedError, OutputFormat, SampleError
from threadloader.decode.pillow import decode_rgb, header_size
from threadloader.service import QueueFullError

SIZE = (224, 224)
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
MODES = ("batched", "single", "pillow")

MAX_BODY_MB = 32.0  # a larger body is refused (413) before it is read
MAX_PIXELS = 50_000_000  # per image, from its header (about 8660 x 5770)
MAX_PIXELS_IN_FLIGHT = 100_000_000  # decoded at once, all requests together: the decode-memory bound
SOCKET_TIMEOUT_S = 10.0  # a client that sends nothing for this long is disconnected
REQUEST_TIMEOUT_S = 30.0  # a request (line, headers, body) not all in by then: 408, disconnected
MAX_CONNECTIONS = 256  # connections served at once (a thread each); more are answered 503
DECODE_WAIT_S = 30.0  # longest a request waits for room among the pixels in flight (then 503)


@dataclasses.dataclass(frozen=True)
class Limits:
    max_body_bytes: int = int(MAX_BODY_MB * 2**20)
    max_pixels: int = MAX_PIXELS
    max_pixels_in_flight: int = MAX_PIXELS_IN_FLIGHT
    socket_timeout_s: float = SOCKET_TIMEOUT_S
    request_timeout_s: float = REQUEST_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    decode_wait_s: float = DECODE_WAIT_S


#: The method each path is served by.
ROUTES = {"/health": "GET", "/stats": "GET", "/predict": "POST"}


class Refused(Exception):
    """A request the server will not serve, with the HTTP status that says why (and its headers)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def checked_pixels(body: bytes, max_pixels: int) -> int:
    """The image's pixels from its header alone (nothing decoded), refused (413) past ``max_pixels``."""
    try:
        width, height = header_size(body)
    except Exception as exc:
        raise SampleError.from_exception(exc, index=0, origin="body", stage="decode") from exc
    if width * height > max_pixels:
        raise Refused(
            413,
            f"the image is {width}x{height}, {width * height:,} pixels; this server decodes at most "
            f"{max_pixels:,} pixels per image: send a smaller image",
        )
    return width * height


class PixelBudget:
    """A semaphore counted in pixels: decode memory grows with an image's pixels, whatever its file size
    (a 9000x9000 PNG of one colour is a few hundred KB), so this bounds it across all requests."""

    def __init__(self, pixels: int) -> None:
        self.free = self.limit = pixels
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, pixels: int, *, timeout: float) -> Iterator[None]:
        with self._changed:
            if not self._changed.wait_for(lambda: self.free >= pixels, timeout):
                raise Refused(503, "the server is decoding as many pixels as it allows; retry later")
            self.free -= pixels
        try:
            yield
        finally:
            with self._changed:
                self.free += pixels
                self._changed.notify_all()


class Classifier:
    """Bytes in, JSON-ready answer out; safe to call from every request thread at once."""

    def __init__(
        self,
        *,
        mode: str,
        device: str | None,
        max_batch: int,
        max_delay_ms: float,
        model: str = "resnet50",
        limits: Limits = Limits(),
    ) -> None:
        self.decoder: BatchDecoder | None = None
        self.limits = limits
        self.budget = PixelBudget(limits.max_pixels_in_flight)
        if mode == "pillow":
            self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
            output = OutputFormat(size=SIZE, dtype=torch.float32, mean=MEAN, std=STD)

            def decode_here(body: bytes) -> torch.Tensor:
                try:
                    pixels = decode_rgb(body, max_pixels=limits.max_pixels)
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
                max_pixels=limits.max_pixels,
            )
            self.device = self.decoder.device
            self._decode = self.decoder.decode
        # model="none" serves decoding alone: what the load test compares across modes.
        self.model, self.categories = _resnet50(self.device) if model == "resnet50" else (None, [])

    def predict(self, body: bytes) -> dict[str, Any]:
        """Decodes and classifies one image on a stream of its own, within the pixel limits."""
        pixels = checked_pixels(body, self.limits.max_pixels)
        cuda = self.device.type == "cuda"
        with torch.cuda.stream(torch.cuda.Stream(self.device)) if cuda else nullcontext():
            with self.budget.hold(pixels, timeout=self.limits.decode_wait_s):
                image = self._decode(body)  # ready on this stream: BatchDecoder made it wait for it
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
        self.limits = classifier.limits
        self._connections = threading.BoundedSemaphore(self.limits.max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._connections.acquire(blocking=False):  # refused here, without a thread
            request.settimeout(1.0)
            with suppress(OSError):
                request.sendall(_response(503, {"error": "too many connections; retry later"}))
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._connections.release()


class DeadlineReader(io.RawIOBase):
    """The connection's reads, each bounded by the idle timeout and together by the request's deadline.

    A per-read timeout alone lets a client that sends one byte just before each timeout (slowloris) keep
    its connection, and its slot among ``max_connections``, for ever; the deadline bounds the whole.
    """

    def __init__(self, sock: Any, *, idle_s: float) -> None:
        super().__init__()
        self._sock = sock
        self._idle_s = idle_s
        self.deadline = math.inf  # time.monotonic() by which the request must be in
        self.expired = False  # a read ran past the deadline: the connection is to be dropped

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.expired = True
            raise TimeoutError("the request's deadline passed")
        try:
            self._sock.settimeout(min(self._idle_s, left))
            return int(self._sock.recv_into(buffer))
        except TimeoutError:
            self.expired = left <= self._idle_s  # the deadline, not the idle timeout, ended this wait
            raise
        finally:
            self._sock.settimeout(self._idle_s)  # writes keep the idle timeout alone


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: load-test clients reuse their connection
    disable_nagle_algorithm = True  # else headers then body cost a 40 ms delayed-ACK round per reply
    server: Server

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.limits.socket_timeout_s)  # each read and write; then dropped
        self.rfile.close()  # the socket's own reader, replaced by one that keeps the request's deadline
        self._reader = DeadlineReader(self.connection, idle_s=self.server.limits.socket_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """One request, which must arrive whole within ``request_timeout_s``: else 408 and hang up.

        The deadline starts when the server starts waiting for the request (the connection's accept, or
        the previous reply on a kept-alive connection), so a kept-alive connection may serve any number."""
        limit = self.server.limits.request_timeout_s
        self._reader.deadline = time.monotonic() + limit
        super().handle_one_request()  # a timeout there closes the connection (close_connection)
        if self._reader.expired:  # the request was still arriving, so no final reply to it has been sent
            self.connection.settimeout(0)  # sent only if the socket has room now: no waiting on the client
            with suppress(OSError):
                error = f"the request did not arrive whole within {limit:g} s: send it in one go"
                self.connection.sendall(_response(408, {"error": error}))

    def parse_request(self) -> bool:
        """The request line and headers, or the error reply; a line without an HTTP version is refused.

        http.server would take such a line (HTTP/0.9) and then wait for headers that an HTTP/0.9 client
        never sends, so the client would get no answer until the idle timeout dropped it."""
        self.command = None  # as http.server's own parse does first: the error below has no method
        if len(self.raw_requestline.split()) == 2:
            line = self.raw_requestline.decode("latin-1").strip()[:100]
            self.send_error(505, f"{line!r} has no HTTP version (HTTP/0.9): send 'GET /health HTTP/1.1'")
            return False
        return super().parse_request()

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The errors http.server itself answers (a bad request line, a method not served, huge headers),
        as JSON like every other reply, instead of its HTML page."""
        self.close_connection = True
        if code == 501:
            message = f"method {self.command!r} is not served: GET /health, GET /stats or POST /predict"
        error = (message or HTTPStatus(code).phrase) + (f" ({explain})" if explain else "")
        self.wfile.write(_response(code, {"error": error[:300]}, body=self.command != "HEAD"))

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        elif self.path == "/stats":
            budget = self.server.classifier.budget
            pixels = {"pixels_in_flight": budget.limit - budget.free, "max_pixels_in_flight": budget.limit}
            self._reply(200, {**self.server.classifier.stats(), **pixels})
        else:
            refused = self._not_served()
            self._reply(refused.status, {"error": str(refused)}, refused.headers)

    def do_POST(self) -> None:
        try:
            if self.path != "/predict":
                raise self._not_served()
            self._reply(200, self.server.classifier.predict(self._body()))
        except Refused as refused:
            self._reply(refused.status, {"error": str(refused)}, refused.headers)
        except SampleError as error:  # its reason alone: the index and origin are the service's own
            self._reply(400, {"error": f"the body is not an image this server decodes: {error.reason}"})
        except QueueFullError:  # its message is for the operator (max_queue), not the client
            self._reply(503, {"error": "the server is overloaded; retry later"})
        except (LoaderClosedError, CancelledError):  # CancelledError: queued when shutdown closed the decoder
            self._reply(503, {"error": "the server is shutting down; retry later"})
        except OSError:
            raise  # the connection failed (a timeout drops the client): there is no one to answer
        except Exception:
            traceback.print_exc()  # the details stay here; the client learns only that it failed
            self._reply(500, {"error": "internal error"})

    def _not_served(self) -> Refused:
        """405 with ``Allow`` for a path that another method serves (RFC 9110, 15.5.6), else 404."""
        path = self.path[:100]
        allowed = ROUTES.get(self.path)
        if allowed is None:
            served = ", ".join(f"{method} {route}" for route, method in ROUTES.items())
            return Refused(404, f"no such path {path!r}: this server serves {served}")
        return Refused(405, f"{self.command} {path} is not served: use {allowed} {path}", {"Allow": allowed})

    def _body(self) -> bytes:
        """The request body, read only once its declared length is known to be acceptable."""
        if "Transfer-Encoding" in self.headers:
            raise Refused(411, "send the body with a Content-Length (chunked bodies are not accepted)")
        lengths = self.headers.get_all("Content-Length", [])
        if not lengths:
            raise Refused(411, "Content-Length required: POST the image file's bytes")
        if len(lengths) > 1:
            got = ", ".join(_as_sent(length)[:40] for length in lengths)
            raise Refused(400, f"Content-Length must be given once, got {len(lengths)}: {got}")
        if not (lengths[0].isascii() and lengths[0].isdigit()):
            got = _as_sent(lengths[0])[:40]
            raise Refused(400, f"Content-Length must be a non-negative integer in ASCII digits, got {got!r}")
        length, limit = int(lengths[0]), self.server.limits.max_body_bytes
        if length > limit:
            raise Refused(413, f"the body is {length:,} bytes; this server takes at most {limit:,}")
        if length == 0:
            raise Refused(400, "empty body: POST the image file's bytes")
        body = self.rfile.read(length)
        if len(body) < length:
            raise Refused(400, f"the body ended after {len(body):,} of {length:,} bytes")
        return body

    def _reply(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        if status >= 400:
            self.close_connection = True  # any body left unread must not be taken for the next request
        self.wfile.write(_response(status, payload, close=self.close_connection, headers=headers))

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would cost more than the decode


def _response(
    status: int,
    payload: dict[str, Any],
    *,
    close: bool = True,
    body: bool = True,
    headers: dict[str, str] | None = None,
) -> bytes:
    """A whole HTTP/1.1 response, so it goes out in one write; ``body=False`` for a HEAD request."""
    content = json.dumps(payload).encode()
    head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head += f"Content-Length: {len(content)}\r\n" + ("Connection: close\r\n" if close else "") + "\r\n"
    return head.encode() + (content if body else b"")


def _as_sent(value: str) -> str:
    """A header value as the client wrote it: http.client decodes header bytes as Latin-1, which turns
    UTF-8 (digits of other scripts included) into mojibake."""
    return value.encode("latin-1", "replace").decode("utf-8", "replace")


def add_limit_arguments(
    parser: argparse.ArgumentParser,
    *,
    max_connections: int = MAX_CONNECTIONS,
    request_clock: str = "the connection's accept or the previous reply",
) -> None:
    """The options of :class:`Limits`, for this server and the examples that reuse its limits.

    ``request_clock`` says from when a server counts ``--request-timeout``, which differs between them.
    """
    parser.add_argument("--max-body-mb", type=float, default=MAX_BODY_MB, help="larger bodies: 413")
    parser.add_argument("--max-pixels", type=int, default=MAX_PIXELS, help="per image, from its header")
    parser.add_argument(
        "--max-pixels-in-flight",
        type=int,
        default=MAX_PIXELS_IN_FLIGHT,
        help="pixels decoded at once across requests (bounds decode memory); at least --max-pixels",
    )
    parser.add_argument("--timeout", type=float, default=SOCKET_TIMEOUT_S, help="seconds a client may idle")
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=REQUEST_TIMEOUT_S,
        help=f"seconds for a whole request (line, headers, body) to arrive, from {request_clock}; past "
        "it: 408 and disconnected (however often the client sends a byte)",
    )
    parser.add_argument("--max-connections", type=int, default=max_connections, help="more: 503")


def limits_from(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Limits:
    """The :class:`Limits` that :func:`add_limit_arguments`' options ask for; a bad pair exits as usage."""
    if not args.request_timeout > 0:
        parser.error(f"--request-timeout must be a positive number of seconds, got {args.request_timeout}")
    if args.max_pixels_in_flight < args.max_pixels:
        parser.error("--max-pixels-in-flight must be at least --max-pixels, or the largest images never fit")
    return Limits(
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_pixels=args.max_pixels,
        max_pixels_in_flight=args.max_pixels_in_flight,
        socket_timeout_s=args.timeout,
        request_timeout_s=args.request_timeout,
        max_connections=args.max_connections,
    )


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
    add_limit_arguments(parser)
    args = parser.parse_args(argv)
    limits = limits_from(parser, args)

    classifier = Classifier(
        mode=args.mode,
        device=args.device,
        max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        model=args.model,
        limits=limits,
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
