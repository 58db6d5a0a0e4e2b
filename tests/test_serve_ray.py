"""examples/serve_ray.py in a subprocess on the CPU: Ray Serve's @serve.batch, threadloader's decode.

Skipped, with the reason, where Ray Serve is not installed (``pip install "ray[serve]"``; CI does not:
its wheel is large and Ray's start takes seconds).
"""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .conftest import encode, photo, pil_reference, post_predict

pytest.importorskip("ray.serve", reason='the Ray Serve example\'s test needs pip install "ray[serve]"')

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "serve_ray.py"
MEAN = torch.tensor((0.485, 0.456, 0.406)).view(3, 1, 1)
STD = torch.tensor((0.229, 0.224, 0.225)).view(3, 1, 1)


def test_ray_serve_batches_decodes_answers_and_stops_on_sigterm() -> None:
    command = [
        sys.executable,
        str(EXAMPLE),
        "--port",
        "0",
        "--device",
        "cpu",
        "--model",
        "none",
        "--num-cpus",
        "2",
    ]
    server = subprocess.Popen([*command, "--batch-wait-ms", "50"], stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("listening on http://127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1])
        blobs = [encode(photo(100 + 9 * i, 140 + 13 * i, seed=i), quality=90) for i in range(8)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda data: post_predict(port, data, timeout=60), blobs))
        for (status, answer), data in zip(answers, blobs, strict=True):
            image = torch.from_numpy(pil_reference(data)).permute(2, 0, 1).unsqueeze(0).float()
            resized = torch.nn.functional.interpolate(image, size=(224, 224), mode="bilinear", antialias=True)
            assert status == 200 and answer["shape"] == [3, 224, 224]
            assert answer["mean"] == pytest.approx(float(((resized / 255 - MEAN) / STD).mean()), abs=2e-3)
        status, answer = post_predict(port, b"not an image")
        assert status == 400 and "is not an image this server decodes" in answer["error"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()  # type: ignore[union-attr]
