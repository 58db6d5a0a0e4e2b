"""Calling a user's function once per gathered micro-batch (the model stage of a service).

:class:`CallEngine` is :class:`~threadloader._serving.engine.Engine`'s sibling: the same queue, workers
and counters, but a micro-batch is handed to ``fn`` (a model's forward, say) rather than decoded. On a
GPU each worker calls ``fn`` on a stream of its own, after that stream has waited for each caller's
stream (where its input tensors were made); a CUDA tensor in a result is handed back to its caller's
stream by event, as the decoder's results are, so neither side syncs the host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._handoff import Ready
from .engine import answer, run_guarded
from .metrics import Metrics
from .queue import Request

__all__ = ["CallEngine"]


@dataclass(frozen=True)
class CallEngine:
    """What a worker needs to run a micro-batch through ``fn``; no reference to the service.

    Attributes:
        fn: Called with the batch's inputs in submission order; returns one result per input.
        metrics: The service's counters.
        streams: One CUDA stream per worker, or empty (no stream hand-off: CPU work).
    """

    fn: Callable[[list[Any]], Sequence[Any]]
    metrics: Metrics
    streams: tuple[torch.cuda.Stream, ...] = ()

    def run(self, requests: list[Request], worker: int) -> None:
        """Calls ``fn`` once on the requests' inputs and answers each future with its result."""
        run_guarded(self.metrics, requests, lambda: self._call(requests, worker))

    def _call(self, requests: list[Request], worker: int) -> None:
        inputs = [request.data for request in requests]
        if not self.streams:
            self._answer_all(requests, self.fn(inputs), None)
            return
        stream = self.streams[worker]
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            for caller in {request.stream for request in requests if request.stream is not None}:
                stream.wait_stream(caller)  # the inputs were made there
            for item in inputs:
                if isinstance(item, torch.Tensor) and item.is_cuda:
                    item.record_stream(stream)  # its memory is not reused while fn's kernels read it
            results = self.fn(inputs)
            event = torch.cuda.Event()
            event.record(stream)
        self._answer_all(requests, results, event)

    def _answer_all(
        self, requests: list[Request], results: Sequence[Any], event: torch.cuda.Event | None
    ) -> None:
        countable = hasattr(results, "__len__") and hasattr(results, "__getitem__")
        if not countable or isinstance(results, (Mapping, str, bytes)) or getattr(results, "ndim", 1) == 0:
            raise TypeError(
                f"the batch function returned {type(results).__name__}; return a list (or a tensor or array "
                "with a first dimension) with one result per input, in order: a generator, map, dict, string "
                "or 0-d tensor cannot be matched to the inputs"
            )
        if len(results) != len(requests):
            raise ValueError(
                f"the batch function returned {len(results)} results for a micro-batch of {len(requests)} "
                "inputs; return one result per input, in order"
            )
        for request, result in zip(requests, results, strict=True):
            if event is not None and request.stream is not None and isinstance(result, torch.Tensor):
                Ready([result], event).receive(stream=request.stream)
            answer(self.metrics, request, result=result)
