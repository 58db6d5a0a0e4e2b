"""The training step the training benchmarks feed: ResNet-50, channels_last, bf16 autocast, SGD.

Two kinds of step over the same model: ``eager`` (a Python call per op: about a thousand kernel
launches, each giving up and re-taking the GIL) and ``graphed`` (forward, loss, backward and the
optimizer step captured once as a CUDA graph and replayed: one launch per step), following the
"whole-network capture" example of torch's CUDA semantics notes. Either way the step ends with a
sync of the current stream, as a loop that logs its loss each step would.
"""

from __future__ import annotations

import torch

from benchmarks.common import Batch, SkipRow, Step, import_optional, sync

KINDS = ("eager", "graphed")

CLASSES = 1000


class TinyNet(torch.nn.Sequential):
    """A stand-in for ResNet-50 on the CPU, where rows are smoke runs that exercise the code."""

    def __init__(self) -> None:
        super().__init__(
            torch.nn.Conv2d(3, 8, 3, stride=4, padding=1, bias=False),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(inplace=True),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, CLASSES),
        )


def model_name(device: str) -> str:
    """``"resnet50"`` on a GPU (a row without torchvision is skipped); ``"tinynet"`` on the CPU.

    On the CPU a ResNet-50 step takes seconds on two cores (12 s at batch 8), more than a smoke run's
    budget, wherever torchvision is installed (the free-threaded CI job has it).
    """
    if device != "cuda":
        return "tinynet"
    import_optional("torchvision.models")
    return "resnet50"


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model_name(device) == "tinynet":
        model: torch.nn.Module = TinyNet()
    else:
        model = import_optional("torchvision.models").resnet50(weights=None, num_classes=CLASSES)
    return model.to(device, memory_format=torch.channels_last)  # type: ignore[call-overload]


def random_batch(*, device: str, batch_size: int, size: tuple[int, int]) -> Batch:
    """Random images (channels_last, as the loaders deliver them) and targets: a step's fixed input."""
    images = torch.rand(batch_size, 3, *size, device=device).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, CLASSES, (batch_size,), device=device)


def make_step(*, device: str, batch_size: int, size: tuple[int, int], kind: str = "eager") -> Step:
    """A fresh model and optimizer and the step over them, already run on random data.

    The steps run before returning (warm-up, cuDNN autotuning, the capture) put weights, optimizer
    state, workspaces and the graph's memory pool in the caller's memory baseline, so what a row adds
    on top is its loader's.

    Args:
        device: ``"cuda"`` or ``"cpu"``.
        batch_size: Images per step (fixed: a graph's input has one shape).
        size: (height, width) of the images.
        kind: ``"eager"`` or ``"graphed"`` (CUDA only: raises SkipRow elsewhere).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown step kind {kind!r}; choose from {KINDS}")
    if kind == "graphed" and device != "cuda":
        raise SkipRow("CUDA graphs need a CUDA device")
    model = _model(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.backends.cudnn.benchmark = True
    images, targets = random_batch(device=device, batch_size=batch_size, size=size)

    def train(x: torch.Tensor, y: torch.Tensor) -> None:
        # No autocast weight cache: a graph must not capture casts cached outside it (torch's notes).
        with torch.autocast(device_type=device, dtype=torch.bfloat16, cache_enabled=False):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()

    if kind == "eager":

        def step(batch: Batch) -> None:
            optimizer.zero_grad(set_to_none=True)
            train(batch[0].contiguous(memory_format=torch.channels_last), batch[1])
            sync(device)

        step((images, targets))
        return step

    # Warm up on a side stream (cuDNN autotuning, optimizer state), then capture. The momentum buffers
    # exist after the warm-up, so the captured optimizer step updates them in place.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            train(images, targets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)  # backward in the capture allocates .grad from the graph's pool
    with torch.cuda.graph(graph):
        train(images, targets)

    def replay(batch: Batch) -> None:
        images.copy_(batch[0])  # the graph reads these very tensors; replay refills .grad in place
        targets.copy_(batch[1])
        graph.replay()
        sync(device)

    replay((images, targets))
    return replay
