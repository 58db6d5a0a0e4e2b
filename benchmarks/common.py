"""What the benchmark modules share: command lines, the machine, memory and time, rows in processes.

Command-line lists and options, the description of the machine a result was measured on, device
memory and CPU time, rows measured in processes of their own, and the few pieces of a row that
several entry points use.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import PIL
import torch

if TYPE_CHECKING:
    from threadloader import ThreadLoader

T = TypeVar("T")
Batch = tuple[torch.Tensor, torch.Tensor]
Step = Callable[[Batch], None]
"""What the consumer does with each batch; it must return only once the batch is consumed."""

#: Normalization of the normalized and augmented rows (ImageNet's), as a ResNet-50 training pipeline does.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

ENGINES = ("capi", "python")
"""nvImageCodec's C API and its Python API, as ``THREADLOADER_CAPI`` chooses between them."""


class SkipRow(Exception):
    """A loader cannot run here (no GPU, missing package); the row is reported, not failed."""


def import_optional(module: str) -> Any:
    """Import ``module``, turning only its own absence into a skip (a broken install still fails)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise SkipRow(f"{e.name} is not installed") from e
        raise


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


# --- command lines ----------------------------------------------------------------------------------


def names(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of some of ``choices``."""

    def parse(text: str) -> list[str]:
        found = [x for x in text.split(",") if x]
        unknown = set(found) - set(choices)
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {sorted(unknown)}; choose from {', '.join(choices)}")
        return found

    return parse


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


ROW_ARGUMENTS = frozenset(
    {"batch_size", "drop_last", "num_threads", "size", "dtype", "mean", "std", "device", "transform"}
    | {"channels_last", "region_decode"}
)
"""ThreadLoader's arguments that the rows set themselves: what makes rows the same work, or differ."""


def threadloader_options(text: str) -> dict[str, Any]:
    """``key=value,...``, more ThreadLoader arguments: values are Python literals, else plain strings.

    ``gpu_decoders=2,backend=split`` gives ``{"gpu_decoders": 2, "backend": "split"}``; a comma
    inside a value (``size=(1, 2)``) is kept, since pairs split only before ``name=``.
    """
    options: dict[str, Any] = {}
    for item in re.split(r",\s*(?=[A-Za-z_]\w*\s*=)", text.strip()):
        key, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not key.isidentifier():
            raise argparse.ArgumentTypeError(f"expected name=value pairs separated by commas, got {item!r}")
        if key in ROW_ARGUMENTS:
            raise argparse.ArgumentTypeError(
                f"{key} is set by the rows themselves, as are {', '.join(sorted(ROW_ARGUMENTS - {key}))}: "
                "use --batch-size, --threads, --augment or --normalize instead"
            )
        try:
            options[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):  # not a literal: a plain string, as ``backend=split``
            options[key] = value
    return options


def option_label(options: dict[str, Any]) -> str:
    """``" backend='split' ..."``: how a row's extra ThreadLoader arguments are named ("" for none)."""
    return "".join(f" {key}={value!r}" for key, value in options.items())


Sized = dict[str, tuple[Any, Any, str]]
"""Options whose default depends on ``--quick``: name -> (full run, ``--quick``, what it is)."""


def parser(module: str, doc: str, sized: Sized, out: str) -> argparse.ArgumentParser:
    """An entry point's parser: its sized options, then --data-root, --device, --out and --quick."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    for name, (full, quick, what) in sized.items():
        p.add_argument(
            f"--{name.replace('_', '-')}", type=type(full), help=f"{what} (default {full}; --quick {quick})"
        )
    p.add_argument("--data-root", type=Path, help="data set cache dir (default: see benchmarks.datasets)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    p.add_argument("--out", type=Path, help=f"write {out} here")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None, sized: Sized) -> argparse.Namespace:
    """The options; unset ones at their full-run or --quick default, the device cuda where there is one."""
    args = p.parse_args(argv)
    for name, (full, quick, _) in sized.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that made a result, kept in its JSON so that docs can quote it."""
    return shlex.join(["python", "-m", module, *argv])


# --- the machine, memory and time -------------------------------------------------------------------


def hardware(device: str) -> dict[str, object]:
    """What the numbers depend on, recorded with them."""

    def version(*dists: str) -> str | None:
        for dist in dists:
            with contextlib.suppress(metadata.PackageNotFoundError):
                return metadata.version(dist)
        return None

    info: dict[str, object] = {}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_gb": round(props.total_memory / 2**30),
            "cuda": torch.version.cuda,
        }
    return info | {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version() + ("t" if sysconfig.get_config_var("Py_GIL_DISABLED") else ""),
        "gil": sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True,
        "torch": torch.__version__,
        "nvimgcodec": version("nvidia-nvimgcodec-cu12", "nvidia-nvimgcodec-cu13", "nvidia-nvimgcodec-cu11"),
        "torchvision": version("torchvision"),
        "pillow": PIL.__version__,
        "threadloader": getattr(sys.modules.get("threadloader"), "__version__", None),
    }


def sync(device: str) -> None:
    """Wait until the work queued on the current stream (the batch's data) is done."""
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def release(device: str) -> None:
    """Free what came before so that a row starts from the same memory baseline.

    In a training row, before building the step, never after: ``empty_cache()`` also drops cuBLAS's
    workspaces, whose addresses a captured graph has baked in (its next replay would fault).
    """
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def take(
    stream: Iterator[Batch], step: Step, count: int, *, on_device: list[float] | None = None
) -> tuple[int, float]:
    """Consume ``count`` batches; return the images seen and the seconds spent blocked in ``next()``.

    With ``on_device`` (CUDA only), also appends the seconds the GPU waited for the batches: from an
    event recorded before each ``next()`` to one recorded after it, on the consumer's stream. The step
    ends in a sync, so the first completes at once; the second once the batch's own work (a reader's
    kernels, whose event the stream waits for, or a copy ``next()`` queued) is done. A loader whose
    ``next()`` returns before that makes the GPU, not the host, wait: time the host's clock puts in the
    step.

    A function of its own so no batch outlives it: CUDA IPC batches must be released before the
    workers that produced them are shut down.
    """
    images, waited = 0, 0.0
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    for _ in range(count):
        before = _event() if on_device is not None else None
        start = time.perf_counter()
        batch = next(stream)
        waited += time.perf_counter() - start
        if before is not None:
            marks.append((before, _event()))
        step(batch)
        images += batch[0].shape[0]
    if on_device is not None and marks:
        # The last mark's own event, not the device: a device-wide sync also waited for the loader's
        # work on later batches, which the window's clock would then count.
        marks[-1][1].synchronize()
        on_device.append(sum(before.elapsed_time(after) for before, after in marks) / 1000)
    return images, waited


def stage_ms(before: Any, after: Any, *, cpu: bool = False) -> dict[str, float]:
    """Host ms per batch handed out between two ``ThreadLoader.stats()`` snapshots, per stage.

    ``cpu``: the reader threads' CPU ms instead (``stage_cpu_seconds``); empty for a version of the
    library without them (an A/B's base).
    """
    batches = after.batches - before.batches
    name = "stage_cpu_seconds" if cpu else "stage_seconds"
    if batches <= 0 or not hasattr(after, name):
        return {}
    was = getattr(before, name)
    return {stage: 1000 * (seconds - was[stage]) / batches for stage, seconds in getattr(after, name).items()}


def _event() -> torch.cuda.Event:
    """A timing event recorded on the current stream now."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def proc_stat(path: Path) -> tuple[list[str], float] | None:
    """A process's or thread's ``/proc/.../stat`` (Linux): its fields and the CPU seconds they count.

    The fields are those after the command name; the seconds, user and system. ``None`` where the
    process or thread ended before it was read.
    """
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # the command name may contain spaces
    return fields, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


THREAD_STATUS = Path("/proc/thread-self/status")
"""The calling thread's status (Linux); a module constant so that tests can point it elsewhere."""


def context_switches() -> tuple[int, int] | None:
    """The calling thread's voluntary and involuntary context switches so far, from /proc (Linux).

    They tell why a thread runs slower than alone: voluntary ones, that it blocked (the GIL, a lock,
    I/O); involuntary ones, that the kernel preempted it for another thread (cores oversubscribed).
    ``None`` where the file cannot be read or lacks the counts (not Linux).
    """
    try:
        text = THREAD_STATUS.read_text()
    except OSError:
        return None
    counts = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            counts[key] = int(value)
    if len(counts) != 2:
        return None
    return counts["voluntary_ctxt_switches"], counts["nonvoluntary_ctxt_switches"]


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds of each thread of this process, with its name, from /proc (Linux)."""
    seconds = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        read = proc_stat(task / "stat")
        if read is not None:
            seconds[int(task.name)] = (name, read[1])
    return seconds


def thread_names(read: dict[int, tuple[str, float]]) -> dict[int, str]:
    """Each thread's name in a :func:`thread_cpu` reading.

    Python's where it has one, else the OS's (nvImageCodec's pool threads are ``[NVIMGCODEC][TP``).
    """
    python = {thread.native_id: thread.name for thread in threading.enumerate()}
    return {tid: python.get(tid, name) for tid, (name, _) in read.items()}


def cores_by_group(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float
) -> dict[str, float]:
    """Cores each group of threads used between two :func:`thread_cpu` readings ``wall`` seconds apart.

    A group is the threads named alike but for their numbers (a loader's readers, nvImageCodec's pool,
    CUDA's), so that a window says who used the cores: the readers, the step's thread, nvImageCodec.
    A thread that ended between the readings is not counted.
    """
    names = thread_names(after)
    cores: dict[str, float] = {}
    for tid, (_, cpu) in after.items():
        group = re.sub(r"\d+", "#", names[tid])
        used = cpu - before.get(tid, ("", 0.0))[1]
        cores[group] = cores.get(group, 0.0) + used / wall
    return dict(sorted(cores.items(), key=lambda item: -item[1]))


_walked = [0.0]
"""The CPU seconds :func:`cpu_seconds` has spent walking ``/proc`` in this process, so far."""


def cpu_seconds() -> float:
    """CPU time of this process, its reaped children and its live descendants.

    ``RUSAGE_CHILDREN`` only counts children that have exited, so live DataLoader workers are
    read from ``/proc`` (Linux; elsewhere they are missed until they exit). The walk over ``/proc``
    (milliseconds of this process's CPU) is left out: the difference of two readings is the CPU used
    between them, not that plus one of the walks, which a window's wall clock leaves out.
    """
    total = sum(
        r.ru_utime + r.ru_stime
        for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
    )
    total -= _walked[0]  # the earlier calls' walks, which ``total`` includes
    walk = time.thread_time()
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        read = proc_stat(stat)
        if read is None:  # exited while scanning
            continue
        pid = int(stat.parent.name)
        parent[pid] = int(read[0][1])
        cpu[pid] = read[1]
    found: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    _walked[0] += time.thread_time() - walk  # this walk, which the next call's ``total`` includes
    return total + sum(cpu[pid] for pid in found)


def memory_by_stream(segments: Sequence[Mapping[str, Any]]) -> dict[int, list[float]]:
    """MiB ``[reserved, allocated]`` per CUDA stream, from ``torch.cuda.memory_snapshot()``'s segments.

    Torch's caching allocator keeps the blocks a stream freed for later allocations on that stream
    only: with a stream per reader, what each caches is device memory of its own.
    """
    streams: dict[int, list[float]] = {}
    for segment in segments:
        totals = streams.setdefault(int(segment["stream"]), [0.0, 0.0])
        totals[0] += segment["total_size"] / 2**20
        totals[1] += segment["allocated_size"] / 2**20
    return streams


class DeviceMemory:
    """Peak device-wide memory in use, sampled from a thread every ``period_s``.

    Uses ``cudaMemGetInfo`` rather than torch's allocator stats so that memory held by worker
    processes (their CUDA contexts, IPC buffers) and by nvImageCodec's own allocations counts too.
    """

    def __init__(self, device: str, *, period_s: float = 0.05) -> None:
        self._enabled = device == "cuda"
        self._period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="mem-sampler", daemon=True)
        self._base = self._peak = 0

    @staticmethod
    def _used() -> int:
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(self._period_s):
            self._peak = max(self._peak, self._used())

    def start(self) -> None:
        if self._enabled:
            self._base = self._peak = self._used()
            self._thread.start()

    def stop(self) -> float | None:
        """Stop sampling; return the peak above the starting level in MB (None on CPU)."""
        if not self._enabled or not self._thread.is_alive():
            return None
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._used())
        return (self._peak - self._base) / 2**20


# --- rows in processes of their own -----------------------------------------------------------------


class RowProcessError(Exception):
    """A row's process crashed, hung or printed no result; its own stderr holds the details."""


def record_failure(row: Any, error: Exception) -> None:
    """Marks a row skipped (a :class:`SkipRow`) or failed (traceback printed, first line kept).

    One broken loader must not end a run that measures the others.
    """
    if isinstance(error, SkipRow):
        row.status, row.reason = "skipped", str(error)
        return
    if not isinstance(error, RowProcessError):  # its traceback is the child's, already printed
        traceback.print_exc()
    row.status, row.reason = "failed", f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


def run_child(command: Sequence[str], *, timeout: float) -> dict[str, Any]:
    """Runs one row in a fresh process, which prints its result as a JSON object last.

    The child runs in a session of its own, killed whole when it ends, so that no DataLoader worker of
    a crashed or hung row outlives it into the next row; its stderr (progress, tracebacks) is passed on.

    Raises:
        RowProcessError: The process crashed, ran past ``timeout`` seconds or printed no JSON object.
    """
    timed_out = False
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as child:
        try:
            out, err = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(child.pid, signal.SIGKILL)
            out, err = child.communicate()
        finally:
            with contextlib.suppress(ProcessLookupError):  # the usual case: the whole session has ended
                os.killpg(child.pid, signal.SIGKILL)
    sys.stderr.write(err)
    if timed_out:
        raise RowProcessError(f"stopped after {timeout:g} s")
    if child.returncode < 0:
        raise RowProcessError(f"killed by {signal.Signals(-child.returncode).name}")
    if child.returncode > 0:
        raise RowProcessError(f"exited with {child.returncode}: " + (err.strip().splitlines() or ["?"])[-1])
    try:
        result = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError) as e:  # nothing printed, or not JSON
        raise RowProcessError(f"printed no row: {type(e).__name__}: {e}") from None
    if not isinstance(result, dict):
        raise RowProcessError(f"printed no row: {result!r}")
    return result


def warm_page_cache(files: Iterable[tuple[Path, int]]) -> None:
    """Reads every file once, so that the first row does not pay for the disk."""
    for path, _ in files:
        path.read_bytes()


def write_results(out: Path, name: str, text: str, dump: dict[str, Any]) -> None:
    """``name.md`` and ``name.json`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(json.dumps(dump, indent=2) + "\n")
    print(f"wrote {out}/{name}.md, {name}.json", file=sys.stderr)


# --- ThreadLoader rows ------------------------------------------------------------------------------


def shuffled_threadloader(source: Any, **options: Any) -> ThreadLoader:
    """A ThreadLoader as the benchmarks read a training set: shuffled, in one order, to float32.

    ``seed=0``: every run reads the same images in the same order. ``options``: the rest of the row's.
    """
    from threadloader import ThreadLoader

    return ThreadLoader(source, shuffle=True, seed=0, dtype=torch.float32, **options)


def endless(loader: Iterable[T]) -> Generator[T, None, None]:
    """Cycle an epoch-at-a-time iterable forever, refusing to spin on an empty one."""
    while True:
        count = 0
        for batch in loader:
            count += 1
            yield batch
        if not count:
            raise RuntimeError("loader produced an empty epoch")


def can_chart() -> bool:
    """Whether matplotlib imports, saying so when not: a free-threaded Python may have no build of it.

    The numbers are the run's result; a missing chart should not lose them.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        print(f"no chart: matplotlib does not import ({exc})", file=sys.stderr)
        return False
    return True
