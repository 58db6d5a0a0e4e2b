"""OrderedPool's start with more threads than cores: the first result comes about as soon as with one
thread, and afterwards every thread works."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from threadloader import ThreadLoader, _workers
from threadloader._workers import OrderedPool

ROOT = Path(__file__).resolve().parent.parent


def test_threads_past_the_cores_wait_for_the_first_result(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_workers, "available_cpus", lambda: 2)
    release, started = threading.Event(), threading.Event()
    taken: list[tuple[int, int]] = []  # (task, thread), as started
    lock = threading.Lock()

    def work(task: int, thread: int) -> int:
        with lock:
            taken.append((task, thread))
        if task == 0:
            started.set()
            release.wait(10)
        else:
            time.sleep(0.002)
        return task

    pool: OrderedPool[int] = OrderedPool(
        tasks=iter(range(60)), work=work, num_threads=6, window=12, name="tl-start"
    )
    try:
        assert started.wait(10)
        time.sleep(0.2)  # the eager threads fill the window meanwhile; the others must not start
        with lock:
            before = list(taken)
        assert {thread for _, thread in before} <= {0, 1}, before
        assert len(before) == 12  # the window, taken by the two eager threads alone
        release.set()
        results = [pool.next() for _ in range(60)]
    finally:
        release.set()
        pool.close()
    assert results == list(range(60))
    assert {thread for _, thread in taken} == set(range(6))  # once task 0 was in, every thread worked


def test_a_pool_that_ends_before_its_first_result_ends_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_workers, "available_cpus", lambda: 1)
    pool: OrderedPool[int] = OrderedPool(
        tasks=iter([]), work=lambda t, i: t, num_threads=4, window=8, name="tl-empty"
    )
    with pytest.raises(StopIteration):
        pool.next()
    pool.close()
    assert [thread for thread in pool.threads if thread.is_alive()] == []


#: In a process held to one core: seconds to the first result of CPU-bound tasks that let go of the GIL
#: (hashing, as decoding does), with ``argv[1]`` threads.
FIRST_RESULT_SCRIPT = """
import hashlib, os, sys, time
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from threadloader._workers import OrderedPool

DATA = bytes(1 << 20)

def work(task, thread):
    for _ in range(150):
        hashlib.sha256(DATA).digest()
    return task

threads = int(sys.argv[1])
started = time.perf_counter()
tasks = iter(range(4 * threads))
pool = OrderedPool(tasks=tasks, work=work, num_threads=threads, window=2 * threads, name="tl-first")
pool.next()
print(time.perf_counter() - started)
pool.close()
"""


def first_result_s(threads: int) -> float:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(
        [sys.executable, "-c", FIRST_RESULT_SCRIPT, str(threads)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return float(result.stdout)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="holds a process to one core (Linux)")
def test_eight_threads_on_one_core_give_the_first_result_as_soon_as_one() -> None:
    one = min(first_result_s(1) for _ in range(2))
    eight = min(first_result_s(8) for _ in range(2))
    # All eight starting at once shared the core: the first result came about eight times later.
    assert eight < 3 * one, f"first result: {one:.3f} s with 1 thread, {eight:.3f} s with 8"


def test_a_thread_the_system_refuses_is_named_with_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """num_threads=100000 failed at the first iter() with a bare "can't start new thread" that named
    neither the count nor the argument."""
    start = threading.Thread.start
    calls = [0]

    def refusing(self: threading.Thread) -> None:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("can't start new thread")
        start(self)

    with ThreadLoader([b""] * 8, batch_size=1, device="cpu", num_threads=5) as loader:
        monkeypatch.setattr(threading.Thread, "start", refusing)
        refused = r"refused thread 3 of 5 .*can't start new thread.*num_threads"
        with pytest.raises(RuntimeError, match=refused):
            iter(loader)
