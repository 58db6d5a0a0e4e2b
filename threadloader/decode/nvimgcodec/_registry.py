"""Process-wide nvImageCodec state: Decoder pools, verdicts on what works, allocation streams.

Why one thread per Decoder: with nvImageCodec 0.9.0, two threads calling one Decoder at once crashed
the process (segmentation fault, nvjpeg "execution failed"), while separate Decoders on one device
decode at the same time safely, and two of them decode more images per second than one
(docs/design.md, "Decoder engines"). So a reader thread leases a Decoder for each call.

Why a lease ends before the call's wait: nvImageCodec's decode call returns a future, and the next call
on the Decoder begins by waiting for the previous one's host work (``image_generic_codec.h``, 0.8-0.9).
A reader that returns the Decoder once its call is submitted (``pending=True``) lets the next reader
queue its call inside nvImageCodec, which starts it the moment the Decoder is free: no Python thread
has to wake up, win the GIL back and hand the Decoder on first. Such a Decoder is not destroyed until
every call submitted to it has been waited for (:meth:`DecoderRegistry.settle`).

Why pools end: a Decoder holds device memory and threads of its own, and a pool's key follows the
options (backend, threads, batch size), so a notebook or a server that builds loaders with different
settings made a new pool for each and kept them all. Each decoder claims the pools it uses while it is
open; when the last claim on a pool ends, its Decoders are destroyed (at once if idle, else when their
call returns), so what stays is what open loaders can use.

Why a dropped decoder's claims may end a moment late: its finalizer runs wherever the collector does,
which may be inside this registry's own locked code, in the same thread (a decoder in a reference
cycle, collected during a reader's lease); ending the claims there would wait for that thread's own
lock forever. So a finalizer ends them at once only where the lock is free, and otherwise leaves them to
whichever thread holds it, once it lets go (:meth:`DecoderRegistry.unclaim_soon`).
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from ..._gil import MERGE_INTERVAL

__all__ = ["DecoderKey", "DecoderRegistry"]

#: ``(engine, device index, configuration, CPU threads, fancy upsampling, batch size)``: what a Decoder is
#: made for and by; the batch size is 0 for a configuration without the JPEG engine (see
#: ``_engines.uses_engine``), whose Decoders any batch size may share.
DecoderKey = tuple[str, int, str, int, bool, int]


class DecoderRegistry:
    """Decoder pools, verdicts and allocation streams, shared by every decoder of the library.

    Decoders are leased: a thread holds one for a call and returns it, so no two calls into one Decoder
    run at once, whichever loader or service makes them, while different Decoders decode in parallel.
    A pool makes Decoders only when every one it has is leased or still working on a call, up to the
    limit its caller gives: a single reader thread never costs the memory of a second Decoder. At the
    limit, a call queues on a Decoder still working rather than wait for a lease. A pool that has been claimed
    (:meth:`claim`) lives while it is claimed; one never claimed (a test's) keeps its Decoders. The
    library uses one registry (``SHARED``); a test makes its own, with Decoders of its own making.

    Args:
        new_decoder: Makes a Decoder, called with the key's fields.
        destroy: Frees a Decoder, called with its key and the Decoder once no thread holds it.
    """

    def __init__(
        self, new_decoder: Callable[..., Any], destroy: Callable[[Hashable, Any], None] | None = None
    ) -> None:
        self._new_decoder = new_decoder
        self._destroy = destroy or (lambda _key, _decoder: None)
        self._lock = threading.Lock()
        # One condition for every pool, so each change wakes every waiter: one woken alone might wait
        # for another pool and leave this one's waiter asleep beside an idle Decoder.
        self._returned = threading.Condition(self._lock)
        self._idle: dict[Hashable, list[Any]] = {}
        self._made: dict[Hashable, int] = {}
        self._claims: dict[Hashable, int] = {}
        # Per Decoder (by identity) returned with calls not yet waited for: how many.
        self._pending: dict[int, int] = {}
        self._doomed: set[int] = set()  # of those, the ones of ended pools: destroyed once settled
        self._verdicts: dict[Hashable, bool] = {}
        self._allocation_streams: dict[int, torch.cuda.Stream] = {}
        # Claims finalizers ended while the lock was held: ended by the holder once it lets go.
        self._dropped: collections.deque[list[Hashable]] = collections.deque()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The registry's lock around the body; then the claims finalizers left meanwhile are ended."""
        try:
            with self._returned:
                yield
        finally:
            if self._dropped:
                self._end_dropped()

    def acquire(self, key: Hashable, limit: int) -> Any:
        """A Decoder for ``key`` that no other thread calls until :meth:`release`.

        An idle one with no call under way if there is one; else a new one while fewer than ``limit``
        exist for ``key``; else an idle one still working (the call queues behind its work in
        nvImageCodec); else waits for one to be released (every holder releases it once its call is
        submitted or returns).
        """
        if limit < 1:
            raise ValueError(f"a Decoder pool needs a limit of at least 1, got {limit}")
        with self._locked():
            # The pool's list is looked up again after each wait: a pool that ended meanwhile dropped
            # its list, whose Decoders were destroyed.
            while not (idle := self._idle.setdefault(key, [])) and self._made.get(key, 0) >= limit:
                self._returned.wait(MERGE_INTERVAL)  # the waiter's own dropped objects, freed (3.13t)
            free = [at for at, decoder in enumerate(idle) if id(decoder) not in self._pending]
            if free:
                return idle.pop(free[-1])  # the most recently used: others stay idle, unmade under light load
            if self._made.get(key, 0) >= limit:
                return idle.pop(min(range(len(idle)), key=lambda at: self._pending[id(idle[at])]))
            self._made[key] = self._made.get(key, 0) + 1
        try:
            return self._new_decoder(*key)  # type: ignore[misc]  # outside the lock: it takes a while
        except BaseException:
            with self._locked():
                self._made[key] -= 1
                self._returned.notify_all()
            raise

    def release(self, key: Hashable, decoder: Any, *, pending: bool = False) -> None:
        """Returns a Decoder from :meth:`acquire` to its pool, or destroys it if the pool has ended.

        ``pending``: a call was submitted to it and not yet waited for; the caller calls :meth:`settle`
        once it has been, and the Decoder is not destroyed before.
        """
        with self._locked():
            if pending:
                self._pending[id(decoder)] = self._pending.get(id(decoder), 0) + 1
            ended = self._claims.get(key) == 0
            if ended:
                ended = self._end(key, decoder)
            else:  # a pool claimed again since the lease began may have no list yet
                self._idle.setdefault(key, []).append(decoder)
            self._returned.notify_all()
        if ended:
            self._destroy(key, decoder)

    def settle(self, key: Hashable, decoder: Any) -> None:
        """Says that a call :meth:`release` was told is pending has been waited for."""
        with self._locked():
            left = self._pending[id(decoder)] - 1
            if left:
                self._pending[id(decoder)] = left
                return
            del self._pending[id(decoder)]
            doomed = id(decoder) in self._doomed
            if doomed:
                self._doomed.discard(id(decoder))
                self._made[key] -= 1
                self._returned.notify_all()
        if doomed:
            self._destroy(key, decoder)

    def _end(self, key: Hashable, decoder: Any) -> bool:
        """Takes a Decoder of an ended pool out of it: whether to destroy it now (else on its settle)."""
        if id(decoder) in self._pending:
            self._doomed.add(id(decoder))
            return False
        self._made[key] -= 1
        return True

    @contextmanager
    def lease(self, key: Hashable, limit: int) -> Iterator[Any]:
        """:meth:`acquire` and :meth:`release` around a block."""
        decoder = self.acquire(key, limit)
        try:
            yield decoder
        finally:
            self.release(key, decoder)

    def claim(self, keys: Iterable[Hashable]) -> None:
        """Says that a decoder uses the pools of ``keys`` until it calls :meth:`unclaim` with them."""
        with self._locked():
            for key in keys:
                self._claims[key] = self._claims.get(key, 0) + 1

    def unclaim(self, keys: Iterable[Hashable]) -> None:
        """Ends claims made by :meth:`claim`: a pool whose last claim ends has its Decoders destroyed."""
        ended: list[tuple[Hashable, Any]] = []
        with self._locked():
            for key in keys:
                left = self._claims[key] = self._claims[key] - 1
                if left == 0:
                    ended.extend((key, d) for d in self._idle.pop(key, []) if self._end(key, d))
        for key, decoder in ended:  # outside the lock: destroying joins the Decoder's threads
            self._destroy(key, decoder)

    def unclaim_soon(self, keys: Iterable[Hashable]) -> None:
        """:meth:`unclaim` for a finalizer: never waits for the registry's lock.

        At once where the lock is free; else the thread that holds it ends the claims once it lets go
        (the holder may be the finalizer's own thread, which would otherwise wait for itself).
        """
        keys = list(keys)
        if not keys:
            return
        self._dropped.append(keys)  # before the try: a holder that lets go after it sees them
        if self._lock.acquire(blocking=False):
            self._lock.release()
            self._end_dropped()

    def _end_dropped(self) -> None:
        """Ends the claims :meth:`unclaim_soon` left; an error is reported as a finalizer's would be."""
        while True:
            try:
                keys = self._dropped.popleft()
            except IndexError:  # none left, or another thread took the last
                return
            try:
                self.unclaim(keys)
            except Exception as exc:  # not the unrelated caller's error: printed, as a finalizer's
                sys.unraisablehook(
                    SimpleNamespace(
                        exc_type=type(exc),
                        exc_value=exc,
                        exc_traceback=exc.__traceback__,
                        err_msg="Exception ignored while ending a dropped decoder's claims on its pools",
                        object=None,
                    )
                )

    @contextmanager
    def claimed(self, keys: Iterable[Hashable]) -> Iterator[None]:
        """:meth:`claim` and :meth:`unclaim` around a block."""
        keys = list(keys)
        self.claim(keys)
        try:
            yield
        finally:
            self.unclaim(keys)

    def made(self, key: Hashable) -> int:
        """How many Decoders exist for ``key`` (those of an ended pool still working included)."""
        with self._locked():
            return self._made.get(key, 0)

    def verdict(self, subject: Hashable, check: Callable[[], bool]) -> bool:
        """Whether ``subject`` works (region decoding on a device, the C API): ``check()``'s first answer.

        ``check`` runs outside the lock (it decodes); two threads may both run it, and the first
        verdict stored stands.
        """
        with self._locked():
            works = self._verdicts.get(subject)
        if works is None:
            checked = check()
            with self._locked():
                works = self._verdicts.setdefault(subject, checked)
        return works

    def revoke(self, subject: Hashable) -> bool:
        """Makes the verdict on ``subject`` "does not work"; whether this call changed it."""
        with self._locked():
            if self._verdicts.get(subject) is False:
                return False
            self._verdicts[subject] = False
        return True

    def allocation_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The device's stream that decode outputs are allocated on (see ``_memory.py``)."""
        with self._locked():
            stream = self._allocation_streams.get(device.index)  # type: ignore[arg-type]
            if stream is None:
                stream = self._allocation_streams[device.index] = torch.cuda.Stream(device)  # type: ignore[index]
        return stream
