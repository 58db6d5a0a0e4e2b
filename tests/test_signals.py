"""Ctrl-C twice in quick succession (``timeout -s INT`` signals a whole process group; a key held down
repeats): one KeyboardInterrupt, and no reader thread left once it has propagated."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from threadloader._cancel import check_cancelled
from threadloader._workers import OrderedPool, uninterrupted

from .conftest import script_process

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process is POSIX")

#: Iterates a slow CPU loader; the ``finally`` says which reader threads are still alive. ``argv[1]`` is
#: where the consumer spends its time: waiting in ``next()`` ("wait") or in the loop body ("body").
SCRIPT = """
import signal, sys, threading, time
from threadloader import ThreadLoader
from tests.conftest import SlowSamples, encode, photo

JPEG = encode(photo(64, 64), quality=90)
# Ctrl-C as in a terminal, also where the test run was started in the background (a shell without job
# control starts those with SIGINT ignored, and the script would inherit that).
signal.signal(signal.SIGINT, signal.default_int_handler)

try:
    loader = ThreadLoader(SlowSamples([JPEG] * 100000, delay=0.02), batch_size=4, num_threads=3, device="cpu")
    for i, _ in enumerate(loader):
        if i == 2:
            print("iterating", flush=True)
        if sys.argv[1] == "body":
            time.sleep(0.05)
finally:
    print("alive:", [t.name for t in threading.enumerate() if t.name.startswith("threadloader")], flush=True)
"""


def interrupt_twice(tmp_path: Path, where: str) -> subprocess.CompletedProcess[str]:
    """Runs :data:`SCRIPT` and sends it two SIGINTs 1 ms apart once it iterates."""
    command, options = script_process(tmp_path, SCRIPT, where)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **options) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            if line != "iterating\n":
                process.kill()
                pytest.fail(f"the script did not start iterating: {line!r}\n{process.communicate()[1]}")
            time.sleep(0.2)  # the consumer is in its loop, between batches
            process.send_signal(signal.SIGINT)
            time.sleep(0.001)
            process.send_signal(signal.SIGINT)
            stdout, stderr = process.communicate(timeout=60)
        finally:
            if process.poll() is None:
                process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def assert_one_interrupt_and_no_threads(result: subprocess.CompletedProcess[str]) -> None:
    assert result.stdout == "alive: []\n", result.stderr
    assert result.stderr.count("Traceback") == 1, result.stderr
    assert result.stderr.rstrip().endswith("KeyboardInterrupt"), result.stderr
    assert "During handling" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    assert result.returncode == -signal.SIGINT, result.stderr


def test_two_interrupts_while_waiting_for_a_batch(tmp_path: Path) -> None:
    """The first interrupt lands in ``next()``, whose close the second one reaches: that close finishes."""
    assert_one_interrupt_and_no_threads(interrupt_twice(tmp_path, "wait"))


def test_two_interrupts_in_the_loop_body(tmp_path: Path) -> None:
    """The first interrupt lands in the loop body: the dropped iterator closes its pool in ``__del__``."""
    assert_one_interrupt_and_no_threads(interrupt_twice(tmp_path, "body"))


def test_uninterrupted_finishes_every_step_then_raises_the_interrupt_once() -> None:
    calls: list[str] = []
    first = KeyboardInterrupt("first")

    def interrupted_once() -> None:
        calls.append("b")
        if calls.count("b") == 1:
            raise first
        if calls.count("b") == 2:
            raise KeyboardInterrupt("second")

    with pytest.raises(KeyboardInterrupt) as raised:
        uninterrupted(lambda: calls.append("a"), interrupted_once, lambda: calls.append("c"))
    assert calls == ["a", "b", "b", "b", "c"]
    assert raised.value is first


@pytest.mark.parametrize(("handling", "raises"), [(KeyboardInterrupt, False), (ValueError, True)])
def test_uninterrupted_in_a_handler(handling: type[BaseException], raises: bool) -> None:
    """Closing because of a KeyboardInterrupt: a second one is the same news and is dropped; any other
    error being handled does not stand for the interrupt, which is raised."""

    def interrupted() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyboardInterrupt

    calls = 0
    try:
        raise handling
    except handling:
        if raises:
            with pytest.raises(KeyboardInterrupt):
                uninterrupted(interrupted)
        else:
            uninterrupted(interrupted)
    assert calls == 2


def test_a_close_interrupted_while_joining_joins_then_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """The interrupt lands in the join: close joins anyway, then raises it, and next() says closed."""
    started = threading.Barrier(3)

    def work(task: int, thread: int) -> int:
        if task < 2:
            started.wait()
        for _ in range(20):  # a batch of slow steps, each ending at cancellation
            time.sleep(0.005)
            check_cancelled()
        return task

    pool: OrderedPool[int] = OrderedPool(
        tasks=iter(range(100)), work=work, num_threads=2, window=4, name="tl-test"
    )
    started.wait()  # both threads are inside a task
    join_until = pool._group.join_until
    joins = 0

    def interrupted_join(deadline: float | None) -> None:
        nonlocal joins
        joins += 1
        if joins == 1:
            time.sleep(0.001)
            raise KeyboardInterrupt
        join_until(deadline)

    monkeypatch.setattr(pool._group, "join_until", interrupted_join)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert joins == 2
    assert [thread for thread in pool.threads if thread.is_alive()] == []
    with pytest.raises(StopIteration):
        pool.next()
