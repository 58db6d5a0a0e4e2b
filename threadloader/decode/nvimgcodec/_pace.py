"""Choosing, call by call, the Decoder configuration expected to decode the next call soonest.

No fixed choice of nvImageCodec backends wins everywhere. Alone, the GPU's JPEG engine decodes the
256x256 photos faster than nvJPEG's CUDA decoder at a third of its CPU; beside a training step that
keeps the SMs busy it fell to a fraction of that, while the CUDA decoder kept most of its speed
(docs/design.md, "Decoder engines", has the measurements). Which one wins depends on what else the GPU
is doing, and that changes while a loader runs. So ``backend="auto"`` keeps a pool of Decoders of each
configuration and sends each decoder call to the one expected to finish it first, from the time per
image its recent calls took, trying the others again once their measurement is old.

Readers decode at once, and two calls on one configuration share its hardware (the JPEG engine's
cores, the GPU): a configuration's time per image is kept per call under way, and a call that would
join others there expects to share with them. So when the faster configuration is busy, a second
reader takes the other one if that finishes sooner, as ``backend="split"`` splits a batch, and when it
is not, both take the faster one.

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


@dataclass(frozen=True)
class Turn:
    """One call's choice of configuration.

    Attributes:
        arm: The configuration.
        sharing: The calls under way there when it began, itself included.
        trying: Whether it is the try of a configuration whose measurement was old.
    """

    arm: str
    sharing: int
    trying: bool = False


class Pace:
    """Seconds per image of each configuration, and which to use for the next call.

    Thread-safe: reader threads call :meth:`choose` and then :meth:`record` (or :meth:`abandon`) at once.

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
        self._seconds: dict[str, float] = {}  # per image and per call under way: the running mean
        self._measured: dict[str, float] = {}  # when each was last measured
        self._under_way = dict.fromkeys(self.arms, 0)
        self._trying: set[str] = set()  # configurations a thread is trying now: one at a time

    def choose(self) -> Turn:
        """The configuration for the next call.

        One never measured or measured long ago, else the one expected to take the least time, given the
        calls under way there.
        """
        with self._lock:
            now = self._clock()
            arm = self._settled_arm
            if self._settled and arm is not None and not self._failed(arm, now):
                self._under_way[arm] += 1
                return Turn(arm, self._under_way[arm])
            for arm in self.arms:
                stale = now - self._measured.get(arm, -float("inf")) > self._retry_after
                if stale and arm not in self._trying:
                    self._trying.add(arm)
                    self._under_way[arm] += 1
                    return Turn(arm, self._under_way[arm], trying=True)
            arm = min(
                self.arms, key=lambda arm: self._seconds.get(arm, float("inf")) * (self._under_way[arm] + 1)
            )
            self._under_way[arm] += 1
            return Turn(arm, self._under_way[arm])

    def record(self, turn: Turn, images: int, seconds: float) -> None:
        """Tells how long ``turn``'s call took for ``images`` images, from its choice to its return.

        The time includes any wait for a free Decoder of the configuration: what the next call there
        would wait too.

        ``images=0`` says the call failed: the configuration counts as endlessly slow until it is tried
        again, so a Decoder that fails does not take every call meanwhile.
        """
        arm = turn.arm
        with self._lock:
            sharing = (turn.sharing + self._under_way[arm]) / 2  # under way at its start and its end
            self._end(turn)
            now = self._clock()
            per_image = seconds / images / sharing if images > 0 else float("inf")
            old = self._seconds.get(arm)
            fresh = now - self._measured.get(arm, -float("inf")) <= self._retry_after
            if old is None or not fresh or float("inf") in (old, per_image):
                self._seconds[arm] = per_image
            else:
                self._seconds[arm] = old + SMOOTHING * (per_image - old)
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
            self._end(turn)

    def _failed(self, arm: str, now: float) -> bool:
        """Whether ``arm``'s last call failed, and not long ago (it is not tried again yet)."""
        fresh = now - self._measured.get(arm, -float("inf")) <= self._retry_after
        return fresh and self._seconds.get(arm) == float("inf")

    def _end(self, turn: Turn) -> None:
        if turn.trying:
            self._trying.discard(turn.arm)
        self._under_way[turn.arm] -= 1

    def seconds_per_image(self) -> dict[str, float]:
        """Each measured configuration's running mean: seconds per image, per call under way."""
        with self._lock:
            return dict(self._seconds)
