"""The readers' pacing of loops that hold the GIL (threadloader/_gil.py)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from threadloader import _gil


def test_a_loop_sleeps_once_it_has_held_the_gil_long_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    pauses: list[float] = []
    monkeypatch.setattr(_gil, "_gil_enabled", lambda: True)
    monkeypatch.setattr(_gil.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(_gil.time, "sleep", pauses.append)
    pacer = _gil.Pacer()
    for _ in range(9):  # 9 items of 30 us: pauses after the 4th (120 us) and the 8th
        clock[0] += 30e-6
        pacer.tick()
    assert pauses == [_gil._PAUSE, _gil._PAUSE]


def test_without_a_gil_there_is_nothing_to_let_in(monkeypatch: pytest.MonkeyPatch) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(_gil, "_gil_enabled", lambda: False)
    monkeypatch.setattr(_gil.time, "sleep", pauses.append)
    pacer = _gil.Pacer()
    deadline = time.perf_counter() + 0.01
    while time.perf_counter() < deadline:
        pacer.tick()
    assert pauses == []


def test_a_waiting_thread_gets_the_gil_during_a_paced_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop that never lets go of the GIL but for its pacing: a thread waiting for the GIL runs within
    the loop, where without the pacing it would wait for the interpreter's switch interval (1 s here)."""
    monkeypatch.setattr(_gil, "_gil_enabled", lambda: True)
    previous = sys.getswitchinterval()
    go, ran = threading.Event(), []

    def other() -> None:
        go.wait()  # then it needs the GIL, which the loop below holds
        ran.append(time.perf_counter())

    thread = threading.Thread(target=other)
    thread.start()
    sys.setswitchinterval(1.0)
    try:
        pacer = _gil.Pacer()
        go.set()
        begin = time.perf_counter()
        while not ran and time.perf_counter() - begin < 0.5:
            for _ in range(200):  # Python that keeps the GIL
                pass
            pacer.tick()
    finally:
        sys.setswitchinterval(previous)
        thread.join(5)
    assert ran and ran[0] - begin < 0.1, "the waiting thread did not get the GIL during the paced loop"


@pytest.mark.parametrize(
    ("value", "every"), [(None, 100e-6), ("", 100e-6), (" ", 100e-6), ("25", 25e-6), ("400.5", 400.5e-6)]
)
def test_the_slice_comes_from_the_environment_at_import(value: str | None, every: float) -> None:
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != _gil.SLICE_ENV}
    if value is not None:
        env[_gil.SLICE_ENV] = value
    code = "from threadloader import _gil; print(repr(_gil.EVERY))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert float(out.stdout) == pytest.approx(every)


@pytest.mark.parametrize("value", ["0", "-5", "fast", "1e9", "nan"])
def test_a_slice_that_is_no_duration_is_refused_naming_the_variable(value: str) -> None:
    import os
    import subprocess

    env = {**os.environ, _gil.SLICE_ENV: value}
    result = subprocess.run(
        [sys.executable, "-c", "import threadloader"], env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert f"{_gil.SLICE_ENV} must be microseconds" in result.stderr and repr(value) in result.stderr


def test_a_gil_turned_back_on_after_import_is_paced() -> None:
    """A free-threaded build turns the GIL back on when a module that needs it is imported after this
    one (torchvision with triton): a pacer that asked only at import never let a waiting thread in."""
    import subprocess

    code = """if True:
        import sys, time
        gil = [False]  # off while threadloader is imported, as on 3.13t
        sys._is_gil_enabled = lambda: gil[0]
        from threadloader import _gil
        gil[0] = True  # then an import turns it back on
        clock, pauses = [0.0], []
        time.perf_counter = lambda: clock[0]
        time.sleep = pauses.append
        pacer = _gil.Pacer()
        for _ in range(9):  # 9 items of 30 us: a pause after the 4th (120 us) and after the 8th
            clock[0] += 30e-6
            pacer.tick()
        print(len(pauses))
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["2"], out.stdout + out.stderr
