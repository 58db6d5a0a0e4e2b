"""Image classification on FastAPI + uvicorn: decode and model micro-batched together, in one process.

    python examples/serve_fastapi.py --port 8000 [--device cuda|cpu] [--host 127.0.0.1] \
        [--mode batched|per-request|pillow] [--model resnet50|none]

POST /predict with the raw image bytes as the body; the reply is ``{"top5": [class indices]}`` from a
torchvision ResNet-50 with random weights (``weights=None``: the point is the serving path), bf16 on
CUDA, float32 on the CPU. ``--model none`` decodes only and answers ``{"shape": [3, 224, 224], "mean":
...}``. GET /stats: the stages' counters and the GPU's memory; GET /health: ok.

Modes, so that the load test compares them in one server:
    batched      threadloader.BatchDecoder decodes requests from all connections in micro-batches;
                 a threadloader.MicroBatcher runs the model once per micro-batch of decoded images.
    per-request  the baseline: each request alone in a thread pool, torchvision.io.decode_jpeg on the
                 device, then the model on a batch of one.
    pillow       Pillow decodes and torch resizes in a thread pool; the model is micro-batched as in
                 ``batched``.

Nothing in the event loop waits for the GPU: the decoder's and the batcher's workers do, and a client
that goes away cancels its request, which gives up its place in the decode queue and the model batch.
When a stage's queue is full, the request is answered at once with 503 and ``Retry-After``: no queue
grows without bound, and no request waits for room. The limits are examples/server.py's (its
``Limits``), through uvicorn's own settings where it has them. The server prints
``listening on http://HOST:PORT`` once it accepts (``--port 0`` picks a free port), and on SIGTERM or
Ctrl-C stops accepting, answers the requests in flight, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples/server.py: the limits and the model

from server import MEAN, SIZE, STD, Limits, Refused, add_limit_arguments, checked_pixels, limits_from

from threadloader import (
    BatchDecoder,
    LoaderClosedError,
    MicroBatcher,
    OutputFormat,
    QueueFullError,
    SampleError,
)
from threadloader.decode import ImageDecoder
from threadloader.decode.pillow import decode_rgb

MODES = ("batched", "per-request", "pillow")
RETRY_AFTER_S = 1  # what a 503 asks the client to wait: about one queue's worth of batches
GRACEFUL_SHUTDOWN_S = 10.0  # on SIGTERM, longest the requests in flight are waited for
# uvicorn's limit_concurrency counts open connections (idle kept-alive ones too) and requests, and refuses
# at the limit itself: 256 clients need more than 256. A connection costs a few KB here, not a thread.
MAX_CONNECTIONS = 512
ROUTES = "POST /predict, GET /stats, GET /health"


@dataclasses.dataclass(frozen=True)
class Settings:
    """What the service is built with (the command line's options)."""

    mode: str = "batched"
    device: str | None = None
    model: str = "resnet50"
    max_batch: int = 64
    max_delay_ms: float = 2.0
    max_queue: int = 256
    threads: int = min(32, os.cpu_count() or 1)
    limits: Limits = dataclasses.field(default_factory=Limits)


class Overloaded(Exception):
    """The request was refused to bound memory: 503 with Retry-After."""


Stage = Callable[[list[torch.Tensor]], list[Any]]


class Service:
    """Bytes in, a JSON-ready answer out, within the limits; everything async runs in one event loop."""

    def __init__(
        self, settings: Settings, model: torch.nn.Module | None = None, decoder: ImageDecoder | None = None
    ) -> None:
        self.settings = settings
        self.limits = settings.limits
        default = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(settings.device or default)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.pixels_in_flight = 0  # changed only in the event loop: no lock
        self.in_flight = 0  # requests in the thread pool (per-request and pillow modes)
        self.head = model_stage(settings.model, self.device, model)
        self.decoder: BatchDecoder | None = None
        self.batcher: MicroBatcher[torch.Tensor, Any] | None = None
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._streams = threading.local()  # per-request mode: each pool thread's CUDA stream
        self._mean = torch.tensor(MEAN, device=self.device).view(3, 1, 1)  # per-request mode's normalization
        self._std = torch.tensor(STD, device=self.device).view(3, 1, 1)
        self._output = OutputFormat(size=SIZE, dtype=torch.float32, mean=MEAN, std=STD)  # pillow mode
        if settings.mode == "per-request":  # checked here, not at the first request (every one a 500)
            try:
                import torchvision.io  # noqa: F401
            except ImportError:
                sys.exit("--mode per-request needs torchvision (pip install torchvision); or --mode batched")
        if settings.mode != "batched":
            self.pool = concurrent.futures.ThreadPoolExecutor(settings.threads, settings.mode)
        else:
            # A decoder of the caller's (tests) is configured by the caller, its pixel limit too.
            guard = {"decoder": decoder} if decoder is not None else {"max_pixels": self.limits.max_pixels}
            self.decoder = BatchDecoder(
                device=self.device,
                max_batch=settings.max_batch,
                max_delay_ms=settings.max_delay_ms,
                max_queue=settings.max_queue,
                when_full="raise",
                size=SIZE,
                dtype=torch.float32,
                mean=MEAN,
                std=STD,
                **guard,  # type: ignore[arg-type]
            )
        if settings.mode != "per-request":
            self.batcher = MicroBatcher(
                self.head,
                max_batch=settings.max_batch,
                max_delay_ms=settings.max_delay_ms,
                max_queue=settings.max_queue,
                when_full="raise",
                device=self.device,
            )

    async def predict(self, body: bytes) -> dict[str, Any]:
        """Decodes and classifies one image, holding its pixels in the in-flight budget meanwhile."""
        pixels = checked_pixels(body, self.limits.max_pixels)
        if self.pixels_in_flight + pixels > self.limits.max_pixels_in_flight:
            raise Overloaded("the server is decoding as many pixels as it allows")
        self.pixels_in_flight += pixels
        try:
            if self.settings.mode == "per-request":
                return await self._in_pool(self._alone, body)
            assert self.batcher is not None
            if self.decoder is not None:
                image = await self.decoder.adecode(body)
            else:
                image = await self._in_pool(self._pillow, body)
        finally:
            self.pixels_in_flight -= pixels
        answer: dict[str, Any] = await self.batcher.arun(image)
        return answer

    async def _in_pool(self, work: Callable[[bytes], Any], body: bytes) -> Any:
        """``work(body)`` in the thread pool, refused (503) when ``max_queue`` requests are there."""
        if self.in_flight >= self.settings.max_queue:
            raise Overloaded(f"{self.in_flight} requests are being served")
        self.in_flight += 1
        try:
            assert self.pool is not None
            return await asyncio.get_running_loop().run_in_executor(self.pool, work, body)
        finally:
            self.in_flight -= 1

    def _pillow(self, body: bytes) -> torch.Tensor:
        """Pillow's decode and torch's resize in a pool thread, then the copy to the device."""
        try:
            pixels = decode_rgb(body, max_pixels=self.limits.max_pixels)
        except Exception as exc:
            raise SampleError.from_exception(exc, index=0, origin="body", stage="decode") from exc
        return self._output.apply([torch.from_numpy(pixels).permute(2, 0, 1)])[0].to(self.device)

    def _alone(self, body: bytes) -> dict[str, Any]:
        """The baseline: torchvision decodes this request alone on the device, the model runs on it alone."""
        from torchvision.io import ImageReadMode, decode_jpeg

        cuda = self.device.type == "cuda"
        if cuda and getattr(self._streams, "stream", None) is None:
            self._streams.stream = torch.cuda.Stream(self.device)  # each pool thread on a stream of its own
        with torch.cuda.stream(self._streams.stream) if cuda else contextlib.nullcontext():
            try:
                data = torch.frombuffer(bytearray(body), dtype=torch.uint8)
                image = decode_jpeg(data, mode=ImageReadMode.RGB, device=self.device)
            except Exception as exc:
                raise SampleError.from_exception(exc, index=0, origin="body", stage="decode") from exc
            resized = torch.nn.functional.interpolate(
                image.unsqueeze(0).float(), size=SIZE, mode="bilinear", antialias=True, align_corners=False
            )
            result: dict[str, Any] = self.head([(resized[0] / 255 - self._mean) / self._std])[0]
            return result

    def stats(self) -> dict[str, Any]:
        """The stages' counters, the pixels in flight, the process's memory and the GPU's high-water marks."""
        with open("/proc/self/statm") as statm:  # Linux: resident pages, the second field
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        stats: dict[str, Any] = {
            "mode": self.settings.mode,
            "rss_bytes": rss,
            "pixels_in_flight": self.pixels_in_flight,
            "in_pool": self.in_flight,
        }
        if self.decoder is not None:
            stats["decoder"] = dataclasses.asdict(self.decoder.stats())
        if self.batcher is not None:
            stats["model"] = dataclasses.asdict(self.batcher.stats())
        if self.device.type == "cuda":
            stats["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
            stats["cuda_memory_reserved"] = torch.cuda.memory_reserved(self.device)
        return stats

    def close(self) -> None:
        """Stops every stage; what is still queued is cancelled (uvicorn has answered what was in flight)."""
        for stage in (self.decoder, self.batcher):
            if stage is not None:
                stage.close(cancel_pending=True)
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def model_stage(name: str, device: torch.device, model: torch.nn.Module | None = None) -> Stage:
    """The model stage on a list of decoded images: ResNet-50's top-5 indices (``model`` in its place,
    if given), or with ``name="none"`` each image's shape and mean."""
    if model is None:
        if name == "none":
            return _summaries
        model = _resnet50()
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = model.eval().to(device, dtype=dtype, memory_format=torch.channels_last)

    def top5(images: list[torch.Tensor]) -> list[Any]:
        batch = torch.stack(images).to(dtype).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            return [{"top5": row} for row in model(batch).float().topk(5, dim=1).indices.tolist()]

    return top5


def _summaries(images: list[torch.Tensor]) -> list[Any]:
    """Decode only: each image's shape and mean, from one reduction over the batch."""
    means = torch.stack(images).mean(dim=(1, 2, 3)).tolist()
    return [
        {"shape": list(image.shape), "mean": round(mean, 5)}
        for image, mean in zip(images, means, strict=True)
    ]


def _resnet50() -> torch.nn.Module:
    try:
        from torchvision.models import resnet50
    except ImportError:
        sys.exit("--model resnet50 needs torchvision (pip install torchvision); or serve --model none")
    return resnet50(weights=None)


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """Every error reply: one line of JSON."""
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def overloaded(why: str) -> JSONResponse:
    return error(503, f"{why}; retry after {RETRY_AFTER_S} s", {"Retry-After": str(RETRY_AFTER_S)})


async def read_body(request: Request, limits: Limits) -> bytes:
    """The body, refused before it is read when its declared length is over the limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise Refused(
            413, f"the body is {int(declared):,} bytes; this server takes at most {limits.max_body_bytes:,}"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise Refused(413, f"the body is over {limits.max_body_bytes:,} bytes, this server's limit")
        chunks.append(chunk)
    if size == 0:
        raise Refused(400, "empty body: POST the image file's bytes")
    return b"".join(chunks)


async def unless_disconnected(request: Request, work: Awaitable[dict[str, Any]]) -> dict[str, Any] | None:
    """``work``'s answer, or ``None`` once the client has gone away: then ``work`` is cancelled, which
    cancels its queued request and frees its slot (ASGI tells of the disconnect through ``receive``)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # its cancellation reaches the queues before this returns
    return None if task.cancelled() else task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    settings: Settings, model: torch.nn.Module | None = None, decoder: ImageDecoder | None = None
) -> FastAPI:
    """The ASGI app; ``model`` stands in for ResNet-50, ``decoder`` for the GPU's (tests). Its service
    is ``app.state.service``."""
    service = Service(settings, model, decoder)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        service.close()

    app = FastAPI(lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.service = service
    limits = settings.limits

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        path, allowed = request.url.path[:100], (exc.headers or {}).get("Allow")
        if exc.status_code == 405 and allowed:  # with its Allow header (RFC 9110, 15.5.6)
            return error(405, f"{request.method} {path} is not served: use {allowed} {path}", exc.headers)
        if exc.status_code == 404:
            return error(404, f"no such path {path!r}: this server serves {ROUTES}")
        return error(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error(422, str(exc.errors())[:300])

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        traceback.print_exception(exc)  # the details stay here; the client learns only that it failed
        return error(500, "internal error")

    @app.post("/predict")
    async def predict(request: Request) -> JSONResponse:
        try:
            body = await asyncio.wait_for(read_body(request, limits), limits.request_timeout_s)
            answer = await unless_disconnected(request, service.predict(body))
        except asyncio.TimeoutError:
            return error(
                408, f"the body did not arrive within {limits.request_timeout_s:g} s: send it in one go"
            )
        except Refused as refused:
            return error(refused.status, str(refused), refused.headers)
        except SampleError as exc:  # its reason alone: the index and origin are the service's own
            return error(400, f"the body is not an image this server decodes: {exc.reason}")
        except (QueueFullError, Overloaded) as exc:  # QueueFullError's message is for the operator
            return overloaded("the server is overloaded" if isinstance(exc, QueueFullError) else str(exc))
        except LoaderClosedError:
            return error(503, "the server is shutting down; retry later")
        if answer is None:
            return error(499, "the client closed the connection")  # nobody reads it
        return JSONResponse(answer)

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        return service.stats()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return app


def _json_service_unavailable() -> None:
    """uvicorn answers past ``limit_concurrency`` with a plain-text 503; this makes it JSON, as every
    other error, with Retry-After (uvicorn has no setting for that reply, so its function is replaced)."""
    import importlib

    async def service_unavailable(scope: Any, receive: Any, send: Any) -> None:
        await overloaded("too many connections")(scope, receive, send)

    for name in ("h11_impl", "httptools_impl"):  # httptools_impl imports only where httptools is installed
        with contextlib.suppress(ImportError):
            importlib.import_module(
                f"uvicorn.protocols.http.{name}"
            ).service_unavailable = service_unavailable


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: GPU if usable)")
    parser.add_argument("--mode", choices=MODES, default="batched")
    parser.add_argument("--model", choices=["resnet50", "none"], default="resnet50", help="none: decode only")
    parser.add_argument("--max-batch", type=int, default=Settings.max_batch)
    parser.add_argument("--max-delay-ms", type=float, default=Settings.max_delay_ms)
    parser.add_argument("--max-queue", type=int, default=Settings.max_queue, help="per stage; more: 503")
    parser.add_argument("--threads", type=int, default=Settings.threads, help="pool (per-request, pillow)")
    add_limit_arguments(parser, max_connections=MAX_CONNECTIONS, request_clock="its headers' arrival")
    args = parser.parse_args(argv)
    limits = limits_from(parser, args)
    settings = Settings(
        mode=args.mode,
        device=args.device,
        model=args.model,
        max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        max_queue=args.max_queue,
        threads=args.threads,
        limits=limits,
    )
    # A signal before uvicorn takes them over (while the model loads) ends the process at once; uvicorn
    # raises the signal it handled again once it has shut down, which then lands here: exit 0.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: sys.exit(0))
    app = create_app(settings)
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))
    _json_service_unavailable()
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        backlog=2048,
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=int(limits.socket_timeout_s),
        timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_S),
    )
    host, port = listener.getsockname()[:2]

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                print(f"listening on http://{host}:{port}", flush=True)
                print(
                    f"mode={settings.mode} device={app.state.service.device} model={settings.model}",
                    file=sys.stderr,
                )

    Announcing(config).run(sockets=[listener])


if __name__ == "__main__":
    main()
