"""backend="auto"'s choice between Decoder configurations, on a clock of the test's own.

The choice is plain Python (``decode/_pace.py``): it is checked here with simulated calls, whose times
the test decides, against what a user expects of it: the faster configuration takes the calls, the
slower one is tried again once its measurement is old, a change of speed is followed, and two readers
that slow the faster one down spread their calls.
"""

from __future__ import annotations

import pytest

from threadloader.decode.nvimgcodec._pace import Pace


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(pace: Pace, clock: Clock, seconds: dict[str, float], calls: int, *, images: int = 64) -> list[str]:
    """``calls`` calls in a row, each of ``images`` images at ``seconds[arm]`` per image; the arms used."""
    used = []
    for _ in range(calls):
        turn = pace.choose()
        took = seconds[turn.arm] * images
        clock.now += took
        pace.record(turn, images, took)
        used.append(turn.arm)
    return used


def test_every_configuration_is_measured_first_then_the_faster_takes_the_calls() -> None:
    clock = Clock()
    pace = Pace(["engine", "cuda"], retry_after=1.0, clock=clock)
    used = _run(pace, clock, {"engine": 0.00005, "cuda": 0.0001}, 200)
    assert used[:2] == ["engine", "cuda"]  # each tried once, in order of preference
    assert used[2:].count("cuda") <= 3  # 200 calls of 3-6 ms: about a second, one retry at most each
    assert pace.seconds_per_image() == pytest.approx({"engine": 0.00005, "cuda": 0.0001})


def test_the_slower_one_is_tried_again_once_its_measurement_is_old_and_a_change_is_followed() -> None:
    clock = Clock()
    pace = Pace(["engine", "cuda"], retry_after=1.0, clock=clock)
    speeds = {"engine": 0.00005, "cuda": 0.0001}
    _run(pace, clock, speeds, 100)
    # The GPU gets busy: the engine slows down fourfold. Within a few seconds the calls move over.
    speeds["engine"] = 0.0004
    _run(pace, clock, speeds, 200)
    later = _run(pace, clock, speeds, 200)
    assert later.count("cuda") >= 195
    # And back, once the engine's retry shows it fast again.
    speeds["engine"] = 0.00005
    _run(pace, clock, speeds, 400)
    assert _run(pace, clock, speeds, 200).count("engine") >= 195


def test_a_measurement_after_a_pause_replaces_the_old_one() -> None:
    """An old figure (say, the first call's, slow while the decoder initialized) is not averaged in."""
    clock = Clock()
    pace = Pace(["a"], retry_after=1.0, clock=clock)
    pace.record(pace.choose(), 10, 10.0)  # one second per image
    clock.now += 5
    pace.record(pace.choose(), 10, 0.01)
    assert pace.seconds_per_image() == {"a": pytest.approx(0.001)}
    clock.now += 0.01
    pace.record(pace.choose(), 10, 0.03)  # fresh: averaged in
    assert pace.seconds_per_image()["a"] == pytest.approx(0.001 + 0.3 * (0.003 - 0.001))


def test_a_failed_call_keeps_its_configuration_out_until_it_is_tried_again() -> None:
    clock = Clock()
    pace = Pace(["engine", "cuda"], retry_after=1.0, clock=clock)
    turn = pace.choose()
    assert turn.arm == "engine"
    pace.record(turn, 0, 0.001)  # the call failed
    turn = pace.choose()
    assert turn.arm == "cuda"
    pace.record(turn, 64, 0.01)
    for _ in range(5):
        turn = pace.choose()
        assert turn.arm == "cuda"
        pace.record(turn, 64, 0.01)
    clock.now += 1.5
    assert pace.choose().arm == "engine"  # tried again


def test_one_thread_at_a_time_tries_a_configuration() -> None:
    """While one reader tries the slower configuration, the other does not try it too."""
    clock = Clock()
    pace = Pace(["engine", "cuda"], retry_after=1.0, clock=clock)
    pace.record(pace.choose(), 64, 0.003)
    pace.record(pace.choose(), 64, 0.006)
    clock.now += 0.5
    pace.record(pace.choose(), 64, 0.003)  # engine again: the faster
    clock.now += 0.6  # cuda's measurement is now old, engine's is not
    trying = pace.choose()
    assert (trying.arm, trying.trying) == ("cuda", True)  # the first thread tries it
    other = pace.choose()
    assert (other.arm, other.trying) == ("engine", False)  # the second takes the faster one meanwhile
    pace.abandon(trying)  # the try was cancelled: no measurement, and it may be tried again
    assert pace.choose().arm == "cuda"


def test_a_second_call_takes_the_other_configuration_when_sharing_would_be_slower() -> None:
    """Calls on one configuration share its hardware: the engine at 40 us an image alone is 80 us an
    image for each of two calls, so with one call under way there the other's 60 us wins; with none,
    the engine does."""
    clock = Clock()
    pace = Pace(["engine", "cuda"], retry_after=10.0, clock=clock)
    pace.record(pace.choose(), 64, 64 * 0.00004)
    pace.record(pace.choose(), 64, 64 * 0.00006)
    first = pace.choose()
    assert first.arm == "engine"
    second = pace.choose()
    assert second.arm == "cuda"
    pace.record(first, 64, 64 * 0.00004)
    pace.record(second, 64, 64 * 0.00006)
    assert pace.choose().arm == "engine"


def test_two_readers_that_slow_the_faster_configuration_spread_their_calls() -> None:
    """Two readers whose calls would each take twice as long on the shared engine: both configurations
    take a good share of the calls, as ``backend="split"`` splits a batch."""
    now = [0.0]
    pace = Pace(["engine", "cuda"], retry_after=1.0, clock=lambda: now[0])
    alone = {"engine": 0.00004, "cuda": 0.00006}
    counts = {"engine": 0, "cuda": 0}
    # In lockstep: each round both readers choose, then both record, each call's time depending on
    # how many of the two chose its configuration.
    for _ in range(400):
        turns = [pace.choose(), pace.choose()]
        sharing = {arm: sum(turn.arm == arm for turn in turns) for arm in alone}
        took = {arm: alone[arm] * sharing[arm] * 64 for arm in alone}
        for turn in turns:
            pace.record(turn, 64, took[turn.arm])
            counts[turn.arm] += 1
        now[0] += max(took[turn.arm] for turn in turns)
    assert counts["cuda"] > 200 and counts["engine"] > 200, counts


def test_it_needs_something_to_choose_from() -> None:
    with pytest.raises(ValueError, match="at least one configuration"):
        Pace([])


def test_while_the_consumer_is_ahead_every_call_goes_to_the_settled_configuration() -> None:
    """Beside a training step that is slower than the loader, the fastest decoder is not what counts:
    the calls go to the one named for it, without tries of the others, until told otherwise."""
    clock = Clock()
    pace = Pace(["engine", "cuda"], settled="cuda", retry_after=1.0, clock=clock)
    speeds = {"engine": 0.00005, "cuda": 0.0001}
    _run(pace, clock, speeds, 50)
    pace.settle(True)
    clock.now += 10  # every measurement old: still no try while settled
    assert set(_run(pace, clock, speeds, 100)) == {"cuda"}
    pace.settle(False)
    assert _run(pace, clock, speeds, 100).count("engine") >= 95


def test_a_settled_configuration_that_fails_keeps_the_calls_only_once_tried_again() -> None:
    """The settled configuration's Decoder fails every call (its images go to Pillow): while it is the
    one named for a busy GPU, calls went there still, every one of them, until the consumer fell
    behind. A failure keeps it out until it is tried again, as it does for a choice by pace."""
    clock = Clock()
    pace = Pace(["engine", "cuda"], settled="cuda", retry_after=1.0, clock=clock)
    _run(pace, clock, {"engine": 0.00005, "cuda": 0.0001}, 4)
    pace.settle(True)
    used = []
    for _ in range(50):  # 0.15 s of calls: within the retry time
        turn = pace.choose()
        used.append(turn.arm)
        pace.record(turn, 0 if turn.arm == "cuda" else 64, 0.003)
        clock.now += 0.003
    assert used[0] == "cuda" and used[1:] == ["engine"] * 49
    clock.now += 1.5
    turn = pace.choose()
    assert turn.arm == "cuda"  # tried again once its failure is old
    pace.record(turn, 64, 0.006)
    assert [pace.choose().arm for _ in range(3)] == ["cuda"] * 3  # and settled on, now it works


def test_a_settled_configuration_must_be_one_of_them() -> None:
    with pytest.raises(
        ValueError, match=r"settled must be one of \('engine', 'cuda'\) or None, got 'hybrid'"
    ):
        Pace(["engine", "cuda"], settled="hybrid")


def test_a_loader_tells_its_decoder_which_side_is_slower() -> None:
    """A consumer slower than the readers (groups ready when it asks) makes the loader tell the decoder
    so, after a few groups in a row; one that waits for every group makes it say the opposite."""
    import time

    from threadloader import ThreadLoader
    from threadloader.decode import PillowDecoder

    from .conftest import encode, photo

    class Telling(PillowDecoder):
        def __init__(self, delay: float) -> None:
            super().__init__()
            self.told: list[bool] = []
            self.delay = delay

        def decode(self, encoded, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(self.delay)
            return super().decode(encoded, **kwargs)

        def consumer_ahead(self, ahead: bool) -> None:
            self.told.append(ahead)

    samples = [(encode(photo(16, 16, seed=i)), i) for i in range(24)]
    slow_consumer = Telling(delay=0.0)
    with ThreadLoader(samples, batch_size=1, decoder=slow_consumer, num_threads=2) as loader:
        for _ in loader:
            time.sleep(0.02)  # a training step slower than decoding one image
    assert slow_consumer.told[:1] == [True]
    slow_decoder = Telling(delay=0.02)
    with ThreadLoader(samples, batch_size=1, decoder=slow_decoder, num_threads=1) as loader:
        for _ in loader:
            pass
    assert slow_decoder.told == []  # the consumer waited for every group: the default, said nothing
