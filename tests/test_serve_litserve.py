"""examples/serve_litserve.py in a subprocess on the CPU: LitServe's batching, threadloader's decode.

Skipped, with the reason, where LitServe (the ``serve`` extra) is not installed; CI installs it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from .conftest import encode, photo, pil_reference

pytest.importorskip("litserve", reason="the LitServe example's test needs pip install -e '.[serve]'")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve_litserve.py"
MEAN = torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)
STD = torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)


def post(port: int, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", "/predict", json.dumps(payload), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def test_litserve_batches_decodes_answers_and_stops_on_sigterm() -> None:
    """Good images answered with Pillow's pixels; bad images and malformed requests sent in the same
    batch get their own 400 each, and the good ones beside them still their answers (an exception from
    a LitAPI hook answered the whole batch)."""
    command = [sys.executable, str(EXAMPLE), "--port", "0", "--device", "cpu", "--model", "none"]
    server = subprocess.Popen(
        [*command, "--max-batch", "16", "--batch-timeout-ms", "200"], stdout=subprocess.PIPE, text=True
    )
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("listening on http://127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        blobs = [encode(photo(100 + 9 * i, 140 + 13 * i, seed=i), quality=90) for i in range(8)]
        bad = [b"not an image", blobs[0][:500]]
        payloads = [{"image": base64.b64encode(data).decode()} for data in blobs + bad]
        payloads += [{"picture": "?"}, {"image": "!!"}]
        with concurrent.futures.ThreadPoolExecutor(len(payloads)) as pool:
            answers = list(pool.map(lambda payload: post(port, payload), payloads))
        for (status, answer), data in zip(answers, blobs, strict=False):
            image = torch.from_numpy(pil_reference(data)).permute(2, 0, 1).unsqueeze(0).float()
            resized = torch.nn.functional.interpolate(image, size=(224, 224), mode="bilinear", antialias=True)
            assert status == 200 and answer["shape"] == [3, 224, 224]
            assert answer["mean"] == pytest.approx(float(((resized / 255 - MEAN) / STD).mean()), abs=2e-3)
        (junk, junk_answer), (cut, cut_answer), *malformed = answers[len(blobs) :]
        assert (
            junk == 400
            and "is not an image this server decodes: UnidentifiedImageError" in junk_answer["detail"]
        )
        assert cut == 400 and "is not an image this server decodes: OSError" in cut_answer["detail"]
        for status, answer in malformed:
            assert status == 400 and '{"image": ' in answer["detail"]
        server.send_signal(signal.SIGTERM)
        server.wait(30)  # LitServe's own exit status: its workers are stopped, and nothing hangs
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()  # type: ignore[union-attr]
