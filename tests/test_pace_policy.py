"""backend="auto"'s policy against every fixed choice, in a simulation of readers sharing Decoder pools.

Issue #34 asks for a backend policy that never loses: no case where a fixed backend beats the default
by more than 5%. On a GPU that is a benchmark; here it is its CPU model, so that a change to the choice
(``decode/nvimgcodec/_pace.py``) that makes it lose shows up in CI. The real :class:`Pace` chooses, on a
simulated clock, for simulated readers (no threads, no randomness): each reader loops over a host part
(reading and parsing its next group, no Decoder), ``pace.choose()``, a wait in FIFO order for a free
Decoder of the chosen configuration's pool, and the decode, whose time depends on the configuration and
on how many calls decode on its hardware at once; then it tells ``pace.record`` the seconds from its
choice to its return, the wait included, as ``_decoder.py``'s ``_decode_leased`` does. Throughput is
the images decoded per simulated second after a start, against the same readers and pools with every
call on one configuration, and with the readers split between the two (each reader keeping one:
the best fixed share of the work, as ``backend="split"`` fixes one).

The model leaves out what it cannot know: the two configurations' hardware is independent (the JPEG
engine's cores against nvJPEG's CUDA decoder on the SMs and CPU threads), and a call's speed is set
when its decode starts. Its figures are per call alone; docs/design.md ("Decoder engines") and
docs/benchmarks.md have the measurements they come from.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from threadloader.decode.nvimgcodec._pace import RETRY_AFTER, Pace, Turn

#: A batch: the loaders' default group of 64 images.
IMAGES = 64
#: Seconds simulated before throughput counts: every configuration measured, and tried again once.
START = 1.5 * RETRY_AFTER
#: Seconds over which throughput counts: several retries, so that their cost counts.
SPAN = 4 * RETRY_AFTER


def shared(k: int) -> float:
    """How much longer each of ``k`` calls at once takes on one engine whose cores they share."""
    return float(k)


def overlapping(k: int) -> float:
    """nvJPEG's CUDA decoder: a call's CPU Huffman decoding overlaps another's kernels, mostly."""
    return 1.0 + 0.8 * (k - 1)


@dataclass(frozen=True)
class Scenario:
    """Readers, pools and speeds of one case.

    Attributes:
        name: What it mirrors.
        per_image: Seconds per image of a call alone on a configuration, at a simulated time.
        readers: Reader threads.
        pools: Decoders of each configuration (``gpu_decoders``: 2 by default for both).
        engine: How much longer each call takes when ``k`` decode at once on the JPEG engine's
            configuration; nvJPEG's CUDA decoder's calls overlap (:func:`overlapping`).
        host: Seconds a reader spends on a group outside any Decoder (reading, parsing).
    """

    name: str
    per_image: Callable[[str, float], float]
    readers: int = 4
    pools: dict[str, int] = field(default_factory=lambda: {"all": 2, "cuda": 2})
    engine: Callable[[int], float] = shared
    host: float = 0.0005

    def slowdown(self, arm: str, k: int) -> float:
        """How much longer each of ``k`` calls at once on ``arm`` takes than one alone."""
        return self.engine(k) if arm == "all" else overlapping(k)


@dataclass
class _Call:
    reader: int
    arm: str
    turn: Turn | None
    chosen_at: float
    left: float = 0.0  # seconds of work alone still to do, once decoding


@dataclass
class _Arm:
    queue: deque[_Call] = field(default_factory=deque)
    decoding: list[_Call] = field(default_factory=list)


class Simulation:
    """Readers choosing, waiting for a Decoder and decoding, event by event on a simulated clock.

    Args:
        scenario: The case.
        pick: Each reader's configuration: ``None`` for every reader lets ``Pace`` choose (``auto``).
        seed: Seeds the calls' jitter (:func:`jitter`); ``None``: every call takes its time exactly.
    """

    def __init__(self, scenario: Scenario, pick: list[str] | None = None, seed: int | None = None) -> None:
        self.scenario = scenario
        # Each reader's own stream of factors, so that its n-th call draws the same one whatever the
        # policy: the policies then differ in their choices, not in their luck.
        self.noise = None if seed is None else [random.Random(f"{seed}/{i}") for i in range(scenario.readers)]
        self.now = 0.0
        self.pick = pick
        self.pace = Pace(list(scenario.pools), clock=lambda: self.now)
        self.arms = {arm: _Arm() for arm in scenario.pools}
        # Readers start a little apart, as threads do: reader i's first group is parsed after i steps.
        self.host_until = [scenario.host * (1 + i / scenario.readers) for i in range(scenario.readers)]
        self.decoded: list[tuple[float, str, int]] = []  # (when, configuration, images)

    def run(self, until: float) -> None:
        """Simulates to ``until`` seconds."""
        while self.now < until:
            self._step(until)

    def throughput(self, start: float, end: float) -> float:
        """Images per second returned between ``start`` and ``end``."""
        return sum(n for when, _, n in self.decoded if start <= when < end) / (end - start)

    def share(self, arm: str, start: float, end: float) -> float:
        """The part of the images from ``start`` to ``end`` that ``arm`` decoded."""
        images = [(a, n) for when, a, n in self.decoded if start <= when < end]
        return sum(n for a, n in images if a == arm) / max(1, sum(n for _, n in images))

    def _step(self, until: float) -> None:
        slowdown = {a: self.scenario.slowdown(a, len(s.decoding)) for a, s in self.arms.items() if s.decoding}
        ends = [self.now + min(c.left for c in self.arms[a].decoding) * k for a, k in slowdown.items()]
        nxt = min([until, *(t for t in self.host_until if not math.isnan(t)), *ends])
        elapsed = nxt - self.now
        for arm, k in slowdown.items():  # every call decoding there progresses alike
            for call in self.arms[arm].decoding:
                call.left -= elapsed / k
        self.now = nxt
        for arm, state in self.arms.items():
            for call in [c for c in state.decoding if c.left <= 1e-12]:
                state.decoding.remove(call)
                self._returned(call)
            self._lease(arm)
        for reader, t in enumerate(self.host_until):
            if t <= self.now:
                self._choose(reader)

    def _choose(self, reader: int) -> None:
        self.host_until[reader] = math.nan
        turn: Turn | None = None
        if self.pick is None:
            turn = self.pace.choose()
            arm = turn.arm
        else:
            arm = self.pick[reader]
        self.arms[arm].queue.append(_Call(reader, arm, turn, self.now))
        self._lease(arm)

    def _lease(self, arm: str) -> None:
        state = self.arms[arm]
        while state.queue and len(state.decoding) < self.scenario.pools[arm]:
            call = state.queue.popleft()
            call.left = IMAGES * self.scenario.per_image(arm, self.now)
            if self.noise is not None:
                call.left *= jitter(self.noise[call.reader])
            state.decoding.append(call)

    def _returned(self, call: _Call) -> None:
        if call.turn is not None:
            self.pace.record(call.turn, IMAGES, self.now - call.chosen_at)  # from its choice: the wait too
        self.decoded.append((self.now, call.arm, IMAGES))
        self.host_until[call.reader] = self.now + self.scenario.host


def jitter(rng: random.Random) -> float:
    """A call's time against its configuration's usual one, on a GPU: a few tenths either way, and at
    times a stall (the driver's, a training step's burst) that takes it several times as long."""
    spread, stall = rng.uniform(0.8, 1.2), rng.random() < 0.02
    return spread * (2.5 if stall else 1.0)


def throughputs(scenario: Scenario, seed: int | None = None) -> dict[str, float]:
    """Images per second of ``auto``, of each configuration alone, and of each fixed split of readers.

    With ``seed``, every call's time jitters (:func:`jitter`), alike for ``auto`` and the fixed choices.
    """
    end = START + SPAN
    arms = list(scenario.pools)
    picks: dict[str, list[str] | None] = {"auto": None}
    for arm in arms:
        picks[arm] = [arm] * scenario.readers
    first, second = arms
    for n in range(1, scenario.readers):
        picks[f"{n} on {first}"] = [first] * n + [second] * (scenario.readers - n)
    result = {}
    for name, pick in picks.items():
        sim = Simulation(scenario, pick, seed)
        sim.run(end)
        result[name] = sim.throughput(START, end)
    return result


def steady(engine: float, cuda: float) -> Callable[[str, float], float]:
    """Speeds that stay: ``engine`` and ``cuda`` seconds per image of a call alone."""
    speeds = {"all": engine, "cuda": cuda}
    return lambda arm, now: speeds[arm]


def changing(before: tuple[float, float], after: tuple[float, float]) -> Callable[[str, float], float]:
    """Speeds (engine, cuda) that change a quarter into the span that counts, and stay."""
    change = START + SPAN / 4
    return lambda arm, now: (before if now < change else after)[arm == "cuda"]


def partly_shared(k: int) -> float:
    """An engine whose cores one call does not fill: two calls at once take 1.5x as long each."""
    return 1.0 + 0.5 * (k - 1)


ALONE = (30e-6, 55e-6)  # 256x256 photos on an idle GPU: the engine's call about twice as fast
BUSY = (1300e-6, 90e-6)  # beside a graphed step: the engine's Decoders fell to 0.7-0.8k images/s

SCENARIOS = [
    Scenario(
        "alone: the engine much faster",
        per_image=steady(*ALONE),
    ),
    Scenario(
        "beside a busy GPU: the engine slow",
        per_image=steady(*BUSY),
    ),
    Scenario(
        "the queue: 8 readers at the engine's 2 Decoders",
        readers=8,
        per_image=steady(*ALONE),
        engine=partly_shared,
    ),
    Scenario(
        "a training step starts",
        per_image=changing(ALONE, BUSY),
    ),
]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_auto_is_within_5_percent_of_every_fixed_choice(scenario: Scenario) -> None:
    """No fixed choice (every call on one configuration, or the readers split between them) decodes
    more than 5% faster than ``auto``: issue #34's policy that never loses, on the model."""
    _within_5_percent(scenario, throughputs(scenario))


def _within_5_percent(scenario: Scenario, result: dict[str, float]) -> None:
    _within(scenario, result, 0.95)


def _within(scenario: Scenario, result: dict[str, float], ratio: float, label: str = "") -> None:
    """``auto``'s images a second in ``result`` are at least ``ratio`` of every fixed choice's."""
    result = dict(result)
    auto = result.pop("auto")
    best = max(result, key=lambda name: result[name])
    figures = ", ".join(f"{name} {images:,.0f}" for name, images in result.items())
    assert auto >= ratio * result[best], (
        f"{scenario.name}{label}: auto {auto:,.0f} images/s is {auto / result[best]:.2f}x of {best!r}; "
        f"{figures}"
    )


STEP_ENDS = Scenario(
    "a training step ends",
    per_image=changing(BUSY, ALONE),
)


def test_auto_follows_an_engine_that_gets_fast_again_within_5_percent_of_each_configuration() -> None:
    """The training step ends: the engine, slow beside it and so not in use, is fast again. Only its
    retry, ``RETRY_AFTER`` later, can show it: ``auto`` is still within 5% of each configuration alone
    over the span, and a policy that never retries (stuck on the CUDA decoder) is not."""
    result = throughputs(STEP_ENDS)
    _within_5_percent(STEP_ENDS, {name: result[name] for name in ("auto", *STEP_ENDS.pools)})


def test_auto_follows_an_engine_that_gets_fast_again_within_5_percent_of_every_split() -> None:
    """The same, against the readers split between the configurations, which need no retry."""
    _within_5_percent(STEP_ENDS, throughputs(STEP_ENDS))


INDEPENDENT = Scenario(
    "alone: the engine's two Decoders independent",
    readers=2,
    per_image=steady(*ALONE),
    engine=lambda k: 1.0,
)


def test_auto_uses_a_second_decoder_that_does_not_slow_the_first() -> None:
    """Two readers, and an engine whose two Decoders decode at once without slowing each other (one
    call does not fill its cores): both calls belong on the engine. Taking them to share it fully,
    ``auto`` sent the second to the CUDA decoder (55 us an image against twice 30); a join shows it
    that they do not."""
    result = throughputs(INDEPENDENT)
    assert result["auto"] >= 0.95 * result["all"], result


#: Seeds of the calls' jitter: the first few, each run a few seconds of simulated time.
SEEDS = range(6)

NOISY = [pytest.param(scenario, id=scenario.name) for scenario in (*SCENARIOS, STEP_ENDS, INDEPENDENT)]


@pytest.mark.parametrize("scenario", NOISY)
def test_auto_is_within_5_percent_of_every_fixed_choice_when_calls_jitter(scenario: Scenario) -> None:
    """A GPU's calls do not take the same time twice: the means, the company beside a call and a
    join's measurement of sharing all jitter. Over a few seeds, no fixed choice decodes more than 5%
    faster than ``auto`` on the mean: the policy does not hold only on the noise-free model."""
    runs = [throughputs(scenario, seed) for seed in SEEDS]
    _within_5_percent(scenario, {name: statistics.fmean(run[name] for run in runs) for name in runs[0]})


@pytest.mark.parametrize("scenario", NOISY)
def test_no_seed_leaves_auto_more_than_10_percent_behind(scenario: Scenario) -> None:
    """The mean over seeds hides a run where one join that jittered measured a shared engine as
    unshared, or where a join had too little company to measure a second Decoder as independent: such
    a run stays that way until the next join, a second later. No seed of a dozen leaves ``auto`` more than
    10% behind the best fixed choice of that seed."""
    worst = min(
        ((seed, throughputs(scenario, seed)) for seed in range(12)),
        key=lambda item: item[1]["auto"] / max(v for k, v in item[1].items() if k != "auto"),
    )
    seed, run = worst
    _within(scenario, run, 0.90, f" (seed {seed})")
