"""Choosing, call by call, the Decoder configuration expected to decode the next call soonest.

No fixed choice of nvImageCodec backends wins everywhere. Alone, the GPU's JPEG engine decodes the
256x256 photos faster than nvJPEG's CUDA decoder at a third of its CPU; beside a training step that
keeps the SMs busy it fell to a fraction of that, while the CUDA decoder kept most of its speed
(docs/design.md, "Decoder engines", has the measurements). Which one wins depends on what else the GPU
is doing, and that changes while a loader runs. So ``backend="auto"`` keeps a pool of Decoders of each
configuration and sends each decoder call to the one expected to finish it first, from the time per
image its recent calls took, trying the others again once their measurement is old.

Readers decode at once, and two calls on one configuration may share its hardware (the JPEG engine's
cores, the GPU) or not (a second Decoder that one call does not fill): a configuration's calls are
timed with the calls under way beside them, and how much a second one slows them (its sharing) is
measured by a join, a call sent beside one under way once a retry's time, which keeps its company
while it runs (a reader whose call there returns goes back), and moves the sharing most of the way to
what it measured. While a configuration is
idle, a call goes where it adds the most images a second to the whole: a slow engine beside a busy GPU
still adds its own images to the CUDA decoder's, which a second call there barely does. While every
configuration has calls, it goes where it is expected to finish first, so that its reader chooses
again soonest; as ``backend="split"`` splits a batch, readers spread where sharing would be slower.

The fastest decoder is what a loader needs while its consumer waits for it. While the consumer is the
slower side (a training step that keeps the GPU busy), what counts is what the loader takes from it:
beside ResNet-50 steps the steps ran faster beside nvJPEG's CUDA decoder than beside the JPEG engine's
configuration, though the engine's calls returned sooner (docs/benchmarks.md). So a front end says when
its consumer is ahead (:meth:`Pace.settle`), and the calls then go to the configuration named for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["Pace", "Turn"]

#: Seconds after which a configuration not chosen is tried again: long enough that the calls spent on
#: the slower one are few (one in hundreds at thousands of images a second), short enough to follow a
#: training step that starts or stops beside the loader.
RETRY_AFTER = 1.0

#: Weight of the newest call in a configuration's running mean while it is in use.
SMOOTHING = 0.3

#: How far one join moves a configuration's sharing towards what it measured: a join's company differs
#: from the usual by a call or less, so one call that jitters can measure a shared engine as unshared.
JOIN_WEIGHT = 0.7


@dataclass(frozen=True)
class Turn:
    """One call's choice of configuration.

    Attributes:
        arm: The configuration.
        sharing: The calls under way there when it began, itself included.
        trying: Whether it is a try: of a configuration whose measurement was old, or a join.
        joining: Whether the try joins calls under way there, to measure how they share it.
        began: When it began, on the pace's clock.
        load: The configuration's calls under way, integrated over time, when it began.
    """

    arm: str
    sharing: int
    trying: bool = False
    joining: bool = False
    began: float = 0.0
    load: float = 0.0


class Pace:
    """Seconds per image of each configuration, and which to use for the next call.

    Thread-safe: reader threads call :meth:`choose` and then :meth:`record` (or :meth:`abandon`) at once.

    Each configuration's calls are modelled as taking ``alone * (1 + sharing * (calls - 1))`` per
    image with ``calls`` under way there: ``sharing`` 1 for calls that share its hardware fully (each of
    two takes twice as long), 0 for Decoders that do not slow each other. The calls' times give the line
    through their mean; a join (a call sent where others are under way, once a retry's time) gives its
    slope.

    Args:
        arms: The configurations, in order of preference before anything is measured.
        settled: The configuration every call goes to while :meth:`settle` says the consumer is the
            slower side (``None``: keep choosing by pace).
        retry_after: Seconds after which a configuration's measurement is old: it is tried again, and
            its next measurement replaces the old one rather than being averaged with it.
        clock: Monotonic seconds (a test passes its own).
    """

    def __init__(
        self,
        arms: Sequence[str],
        *,
        settled: str | None = None,
        retry_after: float = RETRY_AFTER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not arms:
            raise ValueError("Pace needs at least one configuration to choose from")
        self.arms = tuple(arms)
        if settled is not None and settled not in self.arms:
            raise ValueError(f"settled must be one of {self.arms} or None, got {settled!r}")
        self._settled_arm = settled
        self._settled = False
        self._retry_after = retry_after
        self._clock = clock
        self._lock = threading.Lock()
        now = clock()
        self._seconds: dict[str, float] = {}  # per image: the running mean of the calls' times
        self._others: dict[str, float] = {}  # the running mean of the other calls under way beside them
        self._measured: dict[str, float] = {}  # when each was last measured
        # Full sharing until a join measures it; the first join waits a retry's time, past the start's
        # slow calls.
        self._sharing = dict.fromkeys(self.arms, 1.0)
        self._shared_at = dict.fromkeys(self.arms, now)
        self._under_way = dict.fromkeys(self.arms, 0)
        self._load = dict.fromkeys(self.arms, 0.0)  # calls under way integrated over time, up to...
        self._load_at = dict.fromkeys(self.arms, now)  # ...this time
        self._trying: set[str] = set()  # configurations a thread is trying now: one at a time
        self._joining: dict[str, int] = {}  # a join under way: the calls there when it began, itself included

    def choose(self) -> Turn:
        """The configuration for the next call.

        One never measured or measured long ago; else a join of the calls under way on one whose
        sharing was measured long ago; else one whose join has lost company since it began (the join
        measures sharing by its company); else, while some configuration is idle, the one where the call
        adds the most images a second (an idle one its whole speed, a busy one what sharing lets it
        add): an idle configuration's hardware is wasted; else the one expected to finish the call
        first, so that its reader chooses again soonest.
        """
        with self._lock:
            now = self._clock()
            arm = self._settled_arm
            if self._settled and arm is not None and not self._failed(arm, now):
                return self._begin(arm, now)
            for arm in self.arms:
                if not self._fresh(arm, now) and arm not in self._trying:
                    return self._begin(arm, now, trying=True)
            for arm in self.arms:
                old = now - self._shared_at[arm] > self._retry_after
                if old and self._under_way[arm] and arm not in self._trying and not self._failed(arm, now):
                    return self._begin(arm, now, trying=True, joining=True)
            for arm in self.arms:
                if self._under_way[arm] < self._joining.get(arm, 0) and not self._failed(arm, now):
                    return self._begin(arm, now)
            finish = {arm: self._per_image(arm, self._under_way[arm] + 1) for arm in self.arms}
            if all(self._under_way.values()):
                return self._begin(min(self.arms, key=lambda arm: finish[arm]), now)
            return self._begin(max(self.arms, key=lambda arm: (self._gain(arm), -finish[arm])), now)

    def record(self, turn: Turn, images: int, seconds: float) -> None:
        """Tells how long ``turn``'s call took for ``images`` images, from its choice to its return.

        The time includes any wait for a free Decoder of the configuration: what the next call there
        would wait too. A join's time measures how the configuration's calls share it.

        ``images=0`` says the call failed: the configuration counts as endlessly slow until it is tried
        again, so a Decoder that fails does not take every call meanwhile.
        """
        arm = turn.arm
        with self._lock:
            now = self._clock()
            self._advance(arm, now)
            took = now - turn.began
            # The calls under way beside it, on average over its time.
            others = (self._load[arm] - turn.load) / took - 1 if took > 0 else turn.sharing - 1.0
            self._end(turn)
            # A nanosecond an image: no call is faster, and a zero would divide.
            per_image = max(seconds / images, 1e-9) if images > 0 else float("inf")
            mean, beside = self._seconds.get(arm, float("inf")), self._others.get(arm, 0.0)
            if turn.joining:
                self._shared_at[arm] = now  # measured or not (beside no more calls than usual): once
            if turn.joining and others >= beside + 0.25 and float("inf") not in (mean, per_image):
                # Calls run at 1 / (1 + sharing) of their speed alone while beside another: the rate of
                # images falls in a line with the time beside one, through the mean and the join.
                slope = (1 / per_image - 1 / mean) / (others - beside)
                rate = 1 / mean - slope * beside
                part = min(0.5, max(0.0, -slope / rate)) if rate > 0 else 0.5
                before = self._sharing[arm] / (1 + self._sharing[arm])
                if part == 0 < self._sharing[arm]:
                    # No slower beside more calls: unshared, or a call that jittered. Joined again at
                    # once, before the choices made on it pile the calls there, where no join would
                    # have more company than usual to measure it again.
                    self._shared_at[arm] = now - self._retry_after
                part = before + JOIN_WEIGHT * (part - before)
                self._sharing[arm] = part / (1 - part)
                return
            if not self._fresh(arm, now) or float("inf") in (mean, per_image):
                self._seconds[arm], self._others[arm] = per_image, others
            else:
                self._seconds[arm] = mean + SMOOTHING * (per_image - mean)
                self._others[arm] = beside + SMOOTHING * (others - beside)
            self._measured[arm] = now

    def settle(self, consumer_ahead: bool) -> None:
        """Says whether the consumer is the slower side: while it is, calls go to the settled arm.

        Unless its last call failed: then they are chosen by pace until it is tried again.
        """
        with self._lock:
            self._settled = consumer_ahead

    def abandon(self, turn: Turn) -> None:
        """Ends ``turn`` without a measurement (its call was cancelled, or found no Decoder)."""
        with self._lock:
            self._advance(turn.arm, self._clock())
            self._end(turn)

    def seconds_per_image(self) -> dict[str, float]:
        """Each measured configuration's seconds per image of a call alone there, lately."""
        with self._lock:
            return {arm: self._per_image(arm, 1) for arm in self._seconds}

    def _begin(self, arm: str, now: float, *, trying: bool = False, joining: bool = False) -> Turn:
        self._advance(arm, now)
        if trying:
            self._trying.add(arm)
        if joining:
            self._joining[arm] = self._under_way[arm] + 1
        self._under_way[arm] += 1
        return Turn(arm, self._under_way[arm], trying, joining, now, self._load[arm])

    def _advance(self, arm: str, now: float) -> None:
        """Integrates ``arm``'s calls under way up to ``now``."""
        self._load[arm] += self._under_way[arm] * max(0.0, now - self._load_at[arm])
        self._load_at[arm] = max(now, self._load_at[arm])

    def _per_image(self, arm: str, calls: int) -> float:
        """Expected seconds per image of each of ``calls`` calls at once on ``arm``."""
        mean, sharing = self._seconds.get(arm, float("inf")), self._sharing[arm]
        beside = self._others.get(arm, 0.0)
        alone = mean * (1 + sharing * max(0.0, 1 - beside)) / (1 + sharing * max(1.0, beside))
        return alone * (1 + sharing * (calls - 1))

    def _gain(self, arm: str) -> float:
        """Images a second the whole gains by one more call on ``arm``, given the calls under way."""
        calls = self._under_way[arm]
        before = calls / self._per_image(arm, calls) if calls else 0.0
        return (calls + 1) / self._per_image(arm, calls + 1) - before

    def _fresh(self, arm: str, now: float) -> bool:
        """Whether ``arm`` was measured, and not long ago."""
        return now - self._measured.get(arm, -float("inf")) <= self._retry_after

    def _failed(self, arm: str, now: float) -> bool:
        """Whether ``arm``'s last call failed, and not long ago (it is not tried again yet)."""
        return self._fresh(arm, now) and self._seconds.get(arm) == float("inf")

    def _end(self, turn: Turn) -> None:
        if turn.trying:
            self._trying.discard(turn.arm)
        if turn.joining:
            self._joining.pop(turn.arm, None)
        self._under_way[turn.arm] -= 1
