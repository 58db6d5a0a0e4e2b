"""Image classification on Ray Serve: ``@serve.batch`` gathers the requests, threadloader decodes them.

    pip install "ray[serve]"
    python examples/serve_ray.py --port 8000 [--device cuda|cpu] [--model resnet50|none] [--replicas N]

POST /predict with the raw image bytes; the reply is serve_fastapi.py's (``{"top5": [...]}``, or
``{"shape": ..., "mean": ...}`` with ``--model none``), a bad image 400. Each replica is a Ray actor
with one GPU (``--replicas`` up to the GPUs Ray sees: the path past one GPU), its own
``threadloader.BatchDecoder`` and serve_fastapi.py's model stage; Ray Serve's ``@serve.batch`` gathers
up to ``--max-batch`` requests (or what came within ``--batch-wait-ms``), which are decoded as one
micro-batch and run through the model in one call. The server prints ``listening on http://HOST:PORT``
once the deployment is ready (``--port 0`` picks a free port), and on SIGTERM or Ctrl-C shuts Ray
Serve down and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_fastapi import model_stage
from serve_litserve import free_port
from server import MEAN, SIZE, STD

from threadloader import BatchDecoder, SampleError


class Classifier:
    """One replica: a decoder and the model; requests batched by Ray Serve."""

    def __init__(self, device: str, model: str, max_batch: int, batch_wait_s: float) -> None:
        self.batched.set_max_batch_size(max_batch)
        self.batched.set_batch_wait_timeout_s(batch_wait_s)
        self.device = torch.device(device)
        self.head = model_stage(model, self.device)
        self.decoder = BatchDecoder(
            device=self.device,
            max_batch=max_batch,
            max_delay_ms=0,  # Ray Serve has gathered the batch: decode what is submitted together
            size=SIZE,
            dtype=torch.float32,
            mean=MEAN,
            std=STD,
        )

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.005)  # set from the command line in __init__
    async def batched(self, bodies: list[bytes]) -> list[Any]:
        """One decode of the batch (a bad image fails only its own answer), one model call off the loop."""
        decoded = await asyncio.gather(
            *(self.decoder.adecode(body) for body in bodies), return_exceptions=True
        )
        good = [i for i, image in enumerate(decoded) if isinstance(image, torch.Tensor)]
        answers: list[Any] = list(decoded)
        if good:
            outputs = await asyncio.to_thread(self.head, [decoded[i] for i in good])
            for position, answer in zip(good, outputs, strict=True):
                answers[position] = answer
        return answers

    async def __call__(self, request: Request) -> JSONResponse:
        if request.method != "POST":
            return JSONResponse(
                {"error": f"{request.method} is not served: use POST"}, 405, {"Allow": "POST"}
            )
        body = await request.body()
        if not body:
            return JSONResponse({"error": "empty body: POST the image file's bytes"}, 400)
        answer = await self.batched(body)
        if isinstance(answer, SampleError):
            return JSONResponse(
                {"error": f"the body is not an image this server decodes: {answer.reason}"}, 400
            )
        if isinstance(answer, BaseException):
            raise answer
        return JSONResponse(answer)


def main(argv: list[str] | None = None) -> None:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: GPU if usable")
    parser.add_argument("--model", choices=["resnet50", "none"], default="resnet50", help="none: decode only")
    parser.add_argument("--replicas", type=int, default=1, help="one GPU each")
    parser.add_argument("--max-batch", type=int, default=64, help="@serve.batch's max_batch_size")
    parser.add_argument(
        "--batch-wait-ms", type=float, default=5.0, help="@serve.batch's batch_wait_timeout_s"
    )
    parser.add_argument("--num-cpus", type=int, default=None, help="for ray.init (default: all)")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    port = args.port or free_port(args.host)

    deployment = serve.deployment(
        Classifier,
        num_replicas=args.replicas,
        ray_actor_options={"num_gpus": 1 if device == "cuda" else 0},
        max_ongoing_requests=4 * args.max_batch,
    )
    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(signum, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": port})
        app = deployment.bind(device, args.model, args.max_batch, args.batch_wait_ms / 1000)
        serve.run(app, route_prefix="/predict")
        print(f"listening on http://{args.host}:{port}", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
