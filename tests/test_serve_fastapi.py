"""examples/serve_fastapi.py: the ASGI app in this process (httpx), and the server in a subprocess.

Skipped, with the reason, where the ``serve`` extra (FastAPI, uvicorn, httpx) is not installed; CI
installs it. The model is a small seeded network (torchvision is not needed), checked against plain
torch on Pillow's pixels.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import GatedDecoder, encode, header_only_png, photo, pil_reference

pytest.importorskip("fastapi", reason="the FastAPI example's tests need pip install -e '.[serve]'")
pytest.importorskip("uvicorn", reason="the FastAPI example's tests need pip install -e '.[serve]'")
httpx = pytest.importorskip("httpx", reason="the FastAPI example's tests need pip install -e '.[serve]'")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))
import serve_fastapi  # noqa: E402
from server import Limits  # noqa: E402

MEAN = torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)
STD = torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)


class TinyNet(torch.nn.Module):
    """10 classes from a 4x4 average pool: cheap, seeded, and its answer depends on the image."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Sequential(
            torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 10)
        )
        self.gate, self.entered, self.batches = gate, threading.Event(), []

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        self.batches.append(len(batch))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(10), "the test never opened the gate"
        return self.head(batch)


def reference(net: TinyNet, data: bytes) -> tuple[list[int], float]:
    """Plain torch on Pillow's pixels: resize (antialiased bilinear) and normalize; top-5 and its margin."""
    image = torch.from_numpy(pil_reference(data)).permute(2, 0, 1).unsqueeze(0).float()
    resized = torch.nn.functional.interpolate(image, size=(224, 224), mode="bilinear", antialias=True)
    with torch.inference_mode():
        logits = net.head((resized / 255 - MEAN) / STD)[0]
    ordered = logits.sort(descending=True).values
    return logits.topk(5).indices.tolist(), float((ordered[:5] - ordered[1:6]).min())


async def send_all(app: Any, requests: list[tuple[str, str, bytes]]) -> list[Any]:
    """The requests, all at once, to the app in this process: ``(method, path, body)`` each."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
        return await asyncio.gather(*(client.request(m, path, content=body) for m, path, body in requests))


def served(app: Any, requests: list[tuple[str, str, bytes]]) -> list[Any]:
    return asyncio.run(send_all(app, requests))


@pytest.fixture
def blobs() -> list[bytes]:
    return [encode(photo(120 + 17 * i, 160 + 23 * i, seed=i), quality=90) for i in range(6)]


@pytest.fixture
def classify() -> Iterator[tuple[Any, TinyNet]]:
    net = TinyNet()
    app = serve_fastapi.create_app(
        serve_fastapi.Settings(device="cpu", max_batch=8, max_delay_ms=20), model=net
    )
    yield app, net
    app.state.service.close()


def test_good_bodies_get_the_top5_of_plain_torch_on_pillows_pixels(
    classify: tuple[Any, TinyNet], blobs: list[bytes]
) -> None:
    app, net = classify

    for response, data in zip(
        served(app, [("POST", "/predict", data) for data in blobs]), blobs, strict=True
    ):
        assert response.status_code == 200, response.text
        expected, margin = reference(net, data)
        assert margin > 1e-3  # the order is decided by the image, not by rounding
        assert response.json() == {"top5": expected}
    assert sum(net.batches) == len(blobs) and len(net.batches) < len(blobs)  # one model call per batch
    stats = app.state.service.stats()
    assert stats["model"]["batches"] == len(net.batches) and stats["decoder"]["completed"] == len(blobs)


def test_the_per_request_mode_without_torchvision_stops_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """It started and answered every request 500 (torchvision.io, imported per request, missing)."""
    monkeypatch.setitem(sys.modules, "torchvision.io", None)  # import raises ImportError, as uninstalled
    with pytest.raises(SystemExit, match="--mode per-request needs torchvision"):
        serve_fastapi.create_app(serve_fastapi.Settings(mode="per-request", device="cpu", model="none"))


@pytest.mark.parametrize("mode", ["batched", "pillow"])
def test_decode_only_answers_shape_and_mean_of_pillows_pixels(mode: str, blobs: list[bytes]) -> None:
    app = serve_fastapi.create_app(serve_fastapi.Settings(mode=mode, device="cpu", model="none"))
    try:
        responses = served(app, [("POST", "/predict", data) for data in blobs])
    finally:
        app.state.service.close()
    for response, data in zip(responses, blobs, strict=True):
        image = torch.from_numpy(pil_reference(data)).permute(2, 0, 1).unsqueeze(0).float()
        resized = torch.nn.functional.interpolate(image, size=(224, 224), mode="bilinear", antialias=True)
        answer = response.json()
        assert answer["shape"] == [3, 224, 224]
        assert answer["mean"] == pytest.approx(float(((resized / 255 - MEAN) / STD).mean()), abs=2e-3)


def test_bad_requests_get_one_line_of_json() -> None:
    limits = Limits(max_body_bytes=50_000, max_pixels=1_000_000)
    app = serve_fastapi.create_app(serve_fastapi.Settings(device="cpu", limits=limits), model=TinyNet())
    requests = [
        ("POST", "/predict", b"not an image"),
        ("POST", "/predict", b""),
        ("POST", "/predict", b"\xff" * 50_001),
        ("POST", "/predict", header_only_png(2000, 1000)),
        ("GET", "/predict", b""),
        ("GET", "/nowhere", b""),
    ]
    statuses = []
    try:
        responses = served(app, requests)
        allowed = served(app, [requests[4]])[0].headers["allow"]
    finally:
        app.state.service.close()
    for response in responses:
        assert response.headers["content-type"] == "application/json"
        assert list(response.json()) == ["error"] and "\n" not in response.text
        statuses.append((response.status_code, response.json()["error"]))
    assert statuses[0][0] == 400 and "is not an image this server decodes" in statuses[0][1]
    assert statuses[1] == (400, "empty body: POST the image file's bytes")
    assert statuses[2][0] == 413 and "at most 50,000" in statuses[2][1]
    assert statuses[3][0] == 413 and "2000x1000, 2,000,000 pixels" in statuses[3][1]
    assert statuses[4] == (405, "GET /predict is not served: use POST /predict")
    assert allowed == "POST"
    assert statuses[5][0] == 404 and "/nowhere" in statuses[5][1]


async def asgi_call(app: Any, body: bytes, leave: asyncio.Event | None = None) -> list[dict[str, Any]]:
    """POST /predict straight through ASGI, as uvicorn calls the app; once ``leave`` is set the client is
    gone (ASGI's ``http.disconnect``). Returns what the app sent."""
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await (leave or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/predict",
        "raw_path": b"/predict",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    return sent


async def until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        await asyncio.sleep(0.005)


async def plugged(app: Any, gated: GatedDecoder) -> list[asyncio.Future[list[dict[str, Any]]]]:
    """A request blocked in each decoder worker, sent one at a time so that none is batched with another."""
    plugs = []
    for number in range(app.state.service.decoder.num_threads):
        plugs.append(asyncio.ensure_future(asgi_call(app, encode(photo(8, 8 + number)))))
        await until(lambda n=number: sum(gated.sizes) == n + 1, "the decoder workers to be busy")
    return plugs


@pytest.mark.parametrize("stage", ["decoder", "model"])
def test_a_client_that_goes_away_frees_its_slot_in_the_stage_it_waits_for(
    stage: str, blobs: list[bytes]
) -> None:
    """Its request leaves the decode queue, or the model's, at once: not decoded, not in a model batch."""
    gated, gate = GatedDecoder(), threading.Event()
    settings = serve_fastapi.Settings(device="cpu", max_delay_ms=0, model="none")  # or the TinyNet given
    parts = {"decoder": gated} if stage == "decoder" else {"model": TinyNet(gate)}
    app = serve_fastapi.create_app(settings, **parts)
    service = app.state.service
    if stage == "model":
        gated.gate.set()
    queue = service.decoder if stage == "decoder" else service.batcher

    async def main() -> list[list[dict[str, Any]]]:
        plugs = (
            await plugged(app, gated)
            if stage == "decoder"
            else [asyncio.ensure_future(asgi_call(app, blobs[0]))]
        )
        if stage == "model":
            await until(lambda: parts["model"].entered.is_set(), "the model to be busy")
        depth = queue.stats().queue_depth
        leave = asyncio.Event()
        leaving = asyncio.ensure_future(asgi_call(app, blobs[-1], leave))
        await until(lambda: queue.stats().queue_depth == depth + 1, "the request to be queued")
        leave.set()
        await until(lambda: queue.stats().cancelled == 1, "the request to be cancelled")
        assert queue.stats().queue_depth == depth  # its slot is free, with the stage still blocked
        gated.gate.set()
        gate.set()
        return [await plug for plug in plugs] + [await leaving]

    try:
        answers = asyncio.run(main())
    finally:
        gated.gate.set()
        gate.set()
        service.close()
    assert all(sent[0]["status"] == 200 for sent in answers[:-1])
    stats = queue.stats()
    assert (stats.completed, stats.cancelled) == (len(answers) - 1, 1)
    if stage == "decoder":
        assert sum(gated.sizes) == len(answers) - 1  # the one that left was never decoded
    else:
        assert sum(parts["model"].batches) == len(answers) - 1  # nor run through the model


def test_a_burst_of_256_is_bounded_by_the_queue_and_the_rest_get_503_with_retry_after(
    blobs: list[bytes],
) -> None:
    gated = GatedDecoder()
    app = serve_fastapi.create_app(
        serve_fastapi.Settings(device="cpu", model="none", max_delay_ms=0, max_queue=8), decoder=gated
    )
    decoder = app.state.service.decoder

    async def main() -> tuple[int, list[int], list[Any]]:
        plugs = await plugged(app, gated)
        burst = asyncio.ensure_future(send_all(app, [("POST", "/predict", blobs[1])] * 256))
        await until(lambda: decoder.stats().rejected == 256 - 8, "the burst to be refused past the queue")
        depth = decoder.stats().queue_depth
        gated.gate.set()
        return depth, [sent[0]["status"] for sent in await asyncio.gather(*plugs)], await burst

    try:
        depth, plugs, responses = asyncio.run(main())
        model = app.state.service.batcher.stats()
    finally:
        gated.gate.set()
        app.state.service.close()
    assert depth == 8  # the queue held no more than max_queue, whatever arrived
    refused = [r for r in responses if r.status_code == 503]
    assert {r.status_code for r in responses} <= {200, 503} and set(plugs) <= {200, 503}
    # Each refusal is a queue's: the decoder's 248, and the model stage's (also 8 deep) if it overflowed.
    assert len(refused) + plugs.count(503) == 256 - 8 + model.rejected
    for response in refused:
        assert response.headers["retry-after"] == "1"
        assert response.json() == {"error": "the server is overloaded; retry after 1 s"}


def test_sigterm_with_requests_in_flight_answers_them_and_exits_0(tmp_path: Path) -> None:
    """The server in a subprocess on ``--port 0``: SIGTERM while clients send slow-to-decode images."""
    command = [sys.executable, str(EXAMPLES / "serve_fastapi.py"), "--port", "0", "--device", "cpu"]
    server = subprocess.Popen([*command, "--model", "none"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("listening on http://127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        body = encode(photo(1500, 2000, seed=3), quality=90)
        stop = threading.Event()
        outcomes: list[tuple[float, int | str]] = []  # (when answered, status or the error's type)

        def client() -> None:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            while not stop.is_set():
                try:
                    connection.request("POST", "/predict", body)
                    response = connection.getresponse()
                    json.loads(response.read())
                    outcomes.append((time.monotonic(), response.status))
                except (OSError, http.client.HTTPException) as exc:
                    outcomes.append((time.monotonic(), type(exc).__name__))
                    return  # the server has closed: nothing more to send
            connection.close()

        clients = [threading.Thread(target=client) for _ in range(6)]
        for thread in clients:
            thread.start()
        time.sleep(1.0)
        terminated = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait(20) == 0
        stop.set()
        for thread in clients:
            thread.join(30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()  # type: ignore[union-attr]
    statuses = {status for _, status in outcomes if isinstance(status, int)}
    assert statuses <= {200, 503}, outcomes
    assert any(when > terminated and status == 200 for when, status in outcomes)  # in flight, answered


def test_past_max_connections_uvicorn_answers_503_as_json_with_retry_after() -> None:
    command = [sys.executable, str(EXAMPLES / "serve_fastapi.py"), "--port", "0", "--device", "cpu"]
    server = subprocess.Popen(
        [*command, "--model", "none", "--max-connections", "2"], stdout=subprocess.PIPE, text=True
    )
    connections = []
    try:
        port = int(server.stdout.readline().rsplit(":", 1)[1])  # type: ignore[union-attr]
        answers = []
        for _ in range(2):  # the first kept open: uvicorn counts it, and refuses at the limit itself
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            connection.request("GET", "/health")
            response = connection.getresponse()
            answers.append((response.status, response.getheader("Retry-After"), json.loads(response.read())))
            connections.append(connection)
        assert answers[0] == (200, None, {"status": "ok"})
        assert answers[1] == (503, "1", {"error": "too many connections; retry after 1 s"})
    finally:
        for connection in connections:
            connection.close()
        server.terminate()
        server.wait(20)
        server.stdout.close()  # type: ignore[union-attr]
