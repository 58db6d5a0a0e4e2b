"""The Decoder pool: one thread per Decoder at a time, no more Decoders than asked, none lost.

Runs on the CPU with stand-in Decoders: the pool is plain Python, and nvImageCodec crashes when two
threads call one Decoder at once, so the rule is checked where a breach is visible without a GPU.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable

import pytest

from threadloader import BatchDecoder, ThreadLoader
from threadloader.decode.nvimgcodec import DecoderRegistry, NvImageCodecDecoder
from threadloader.decode.nvimgcodec._registry import DecoderKey

from .conftest import HashesInsideTheLock

KEY = (0, "auto", 2)


class _Recorder:
    """Makes stand-in Decoders and sees whether two threads ever held one at once."""

    def __init__(self) -> None:
        self.made = 0
        self.overlaps = 0
        self._lock = threading.Lock()
        self._held: set[int] = set()

    def new(self, *_key: object) -> int:
        with self._lock:
            self.made += 1
            return self.made

    def hold(self, decoder: int) -> None:
        with self._lock:
            self.overlaps += decoder in self._held
            self._held.add(decoder)

    def drop(self, decoder: int) -> None:
        with self._lock:
            self._held.discard(decoder)


def _hammer(registry: DecoderRegistry, recorder: _Recorder, *, threads: int, limit: int, calls: int) -> None:
    start = threading.Barrier(threads)

    def work() -> None:
        start.wait()
        for _ in range(calls):
            with registry.lease(KEY, limit) as decoder:
                recorder.hold(decoder)
                threading.Event().wait(0.0005)  # a call's duration, so leases overlap
                recorder.drop(decoder)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join(60)
    assert not any(thread.is_alive() for thread in pool)


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_no_decoder_is_held_by_two_threads_and_no_more_are_made_than_the_limit(limit: int) -> None:
    recorder = _Recorder()
    registry = DecoderRegistry(recorder.new)
    _hammer(registry, recorder, threads=8, limit=limit, calls=40)
    assert recorder.overlaps == 0
    assert 1 <= recorder.made <= limit
    assert registry.made(KEY) == recorder.made


def test_one_thread_makes_one_decoder_whatever_the_limit() -> None:
    recorder = _Recorder()
    registry = DecoderRegistry(recorder.new)
    for _ in range(20):
        with registry.lease(KEY, 4):
            pass
    assert recorder.made == 1


def test_a_thread_waits_for_a_busy_decoder_and_gets_it_when_released() -> None:
    registry = DecoderRegistry(_Recorder().new)
    held = registry.acquire(KEY, 1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(registry.acquire(KEY, 1)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # the limit is reached: it waits, it does not make another
    registry.release(KEY, held)
    waiter.join(10)
    assert got == [held]


def test_a_decoder_that_fails_to_be_made_leaves_its_place_free() -> None:
    attempts = []

    def flaky(*_key: object) -> str:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("no memory for nvjpeg buffers")
        return "decoder"

    registry = DecoderRegistry(flaky)
    with pytest.raises(RuntimeError, match="nvjpeg"):
        registry.acquire(KEY, 1)
    assert registry.made(KEY) == 0
    assert registry.acquire(KEY, 1) == "decoder"  # with limit 1: the failed one took no place


def _until_waiting(registry: DecoderRegistry, threads: int) -> None:
    """Returns once ``threads`` threads wait on the registry's condition (CPython's list of waiters)."""
    deadline = time.monotonic() + 10
    while len(registry._returned._waiters) < threads:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the waiters never waited"
        time.sleep(0.001)


def test_a_decoder_returned_to_its_pool_reaches_its_waiter_whoever_else_waits() -> None:
    """Waiters of two pools share one condition: a return to one pool must not wake only the other's
    waiter (who sleeps again) and leave its own asleep beside an idle Decoder."""
    other = (1, "cuda", 2)
    registry = DecoderRegistry(_Recorder().new)
    mine, theirs = registry.acquire(KEY, 1), registry.acquire(other, 1)
    got: dict[str, int] = {}
    first = threading.Thread(target=lambda: got.setdefault("theirs", registry.acquire(other, 1)), daemon=True)
    first.start()
    _until_waiting(registry, 1)  # the longest waiter is the other pool's
    second = threading.Thread(target=lambda: got.setdefault("mine", registry.acquire(KEY, 1)), daemon=True)
    second.start()
    _until_waiting(registry, 2)
    registry.release(KEY, mine)
    second.join(10)
    assert got.get("mine") == mine
    registry.release(other, theirs)
    first.join(10)
    assert got.get("theirs") == theirs


def test_a_waiter_gets_no_decoder_of_a_pool_that_ended_while_it_waited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Decoder returned while a thread waits, then destroyed by the pool's end before that thread
    runs again, is not handed to it: it gets a new Decoder, destroyed in turn once returned."""
    destroyed: list[int] = []
    registry = DecoderRegistry(_Recorder().new, lambda key, decoder: destroyed.append(decoder))
    registry.claim([KEY])
    held = registry.acquire(KEY, 1)
    waiting, woken = threading.Event(), threading.Event()
    wait = registry._returned.wait

    def slow_wake(timeout: float | None = None) -> bool:  # the waiter runs again only once `woken` is set
        waiting.set()
        notified = wait(timeout)
        registry._lock.release()
        woken.wait(10)
        registry._lock.acquire()
        return notified

    monkeypatch.setattr(registry._returned, "wait", slow_wake)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(registry.acquire(KEY, 1)), daemon=True)
    waiter.start()
    assert waiting.wait(10)
    registry.release(KEY, held)  # the waiter is woken, but does not run yet
    registry.unclaim([KEY])  # the pool ends: its idle Decoder is destroyed
    assert destroyed == [held] and registry.made(KEY) == 0
    woken.set()
    waiter.join(10)
    assert got and got[0] != held and registry.made(KEY) == 1
    registry.release(KEY, got[0])
    assert destroyed == [held, got[0]] and registry.made(KEY) == 0


def test_a_decoder_returned_after_its_pool_was_claimed_again_goes_back_to_it() -> None:
    """A reader's lease outlives its decoder's close (the pool ends) and another decoder's claim of the
    same pool: the Decoder returns to the pool, whose limit it still counts against."""
    registry = DecoderRegistry(_Recorder().new)
    registry.claim([KEY])
    leased = registry.acquire(KEY, 1)
    registry.unclaim([KEY])
    registry.claim([KEY])
    registry.release(KEY, leased)
    assert registry.made(KEY) == 1
    assert registry.acquire(KEY, 1) == leased


def test_pools_of_different_configurations_are_apart() -> None:
    recorder = _Recorder()
    registry = DecoderRegistry(recorder.new)
    first = registry.acquire(KEY, 1)
    other = registry.acquire((0, "hybrid", 2), 1)  # does not wait for KEY's only Decoder
    assert first != other and recorder.made == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_gpu_decoders_are_refused_on_any_device(bad: object) -> None:
    with pytest.raises(
        ValueError, match=rf"gpu_decoders must be (an int|at least 1), got {re.escape(repr(bad))}"
    ):
        ThreadLoader([b"x"], batch_size=1, device="cpu", gpu_decoders=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu_decoders"):
        BatchDecoder(device="cpu", gpu_decoders=bad)  # type: ignore[arg-type]


def test_gpu_decoders_beside_a_decoder_of_ones_own_is_refused() -> None:
    from threadloader.decode.pillow import PillowDecoder

    with pytest.raises(ValueError, match="gpu_decoders configure the built-in decoder"):
        ThreadLoader([b"x"], batch_size=1, decoder=PillowDecoder(), gpu_decoders=3)


def test_gpu_decoders_is_ignored_on_the_cpu() -> None:
    from .conftest import encode, photo

    samples = [(encode(photo(20, 30, seed=i)), i) for i in range(4)]
    with ThreadLoader(samples, batch_size=2, device="cpu", gpu_decoders=3) as loader:
        assert sum(len(targets) for _, targets in loader) == 4


def test_the_gpu_decoder_makes_nothing_until_first_used_and_then_once() -> None:
    """Building the decoder is cheap (a front end warms it up in the background); the first use makes
    the first Decoder, under a lock that later callers wait on; a failed first use is tried again."""
    pytest.importorskip("nvidia.nvimgcodec")
    import torch

    from threadloader.decode.nvimgcodec import NvImageCodecDecoder

    made: list[tuple[object, ...]] = []
    failures = [RuntimeError("no Decoder today")]
    entered, release = threading.Event(), threading.Event()

    def new(*key: object) -> object:
        entered.set()
        assert release.wait(10)
        if failures:
            raise failures.pop()
        made.append(key)
        return object()

    decoder = NvImageCodecDecoder(
        torch.device("cuda", 0), decode_threads=3, engine="python", registry=DecoderRegistry(new)
    )
    assert not entered.is_set()  # the constructor made nothing
    release.set()
    with pytest.raises(RuntimeError, match="no Decoder today"):
        decoder.engine  # noqa: B018  # the first use makes the first Decoder: here it fails
    assert made == []
    release.clear()
    entered.clear()
    answers: list[str] = []
    callers = [threading.Thread(target=lambda: answers.append(decoder.engine)) for _ in range(4)]
    for caller in callers:
        caller.start()
    assert entered.wait(5)
    release.set()
    for caller in callers:
        caller.join(10)
    assert answers == ["python"] * 4
    # Tried again after the failure; made once for four callers, one in each of backend="auto"'s
    # configurations: nvImageCodec's own choice, made for the default batch size (it has the JPEG
    # engine), then the CUDA decoders', so that no reader makes one later while the others wait.
    assert made == [("python", 0, "all", 3, True, 64), ("python", 0, "cuda", 3, True, 0)]


def test_every_type_in_the_decoder_plug_in_signature_is_public() -> None:
    """A decoder of one's own needs no private module: what ImageDecoder.decode names is exported."""
    import typing

    import torch

    from threadloader import decode

    hints = typing.get_type_hints(decode.ImageDecoder.decode)
    exported = [getattr(decode, name) for name in decode.__all__]

    def leaves(hint: object) -> list[object]:
        args = typing.get_args(hint)
        return [leaf for arg in args for leaf in leaves(arg)] if args else [hint]

    for name, hint in hints.items():
        for leaf in leaves(hint):
            module = getattr(leaf, "__module__", "builtins")
            assert (
                leaf in exported
                or module in ("builtins", "torch.cuda.streams", "torch.cuda")
                or (leaf is type(None) or leaf is torch.cuda.Stream)
            ), f"{name}: {leaf!r} from {module} is not exported by threadloader.decode"


@pytest.mark.parametrize(
    ("config", "kinds"),
    [
        # GPU decoders before the CPU's: with every share at 1.0, the first backend that can takes an image
        ("cuda", [(2, 1.0), (3, 1.0), (1, 1.0)]),
        ("all", None),
        ("hardware", [(4, 1.0)]),
        ("hybrid", [(3, 1.0)]),
        ("cpu", [(1, 1.0)]),
        ("split", [(4, 0.65), (3, 1.0)]),  # DALI's hw_decoder_load
    ],
)
def test_each_configuration_asks_nvimgcodec_for_its_kinds(
    monkeypatch: pytest.MonkeyPatch, config: str, kinds: list[tuple[int, float]] | None
) -> None:
    """``cuda`` leaves out the JPEG engine (slow beside a busy GPU), ``all`` lets nvImageCodec choose.

    The kinds are nvimgcodecBackendKind_t's values in nvImageCodec 0.9's header: CPU_ONLY 1, GPU_ONLY 2,
    HYBRID_CPU_GPU 3, HW_GPU_ONLY 4.
    """
    import contextlib

    import torch

    from threadloader.decode.nvimgcodec import _capi, _engines

    made: list[object] = []
    monkeypatch.setattr(_capi, "Decoder", lambda instance, **options: made.append(options["backends"]))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    _engines.CApiEngine(None).new_decoder(0, config, 2, True, 64)  # type: ignore[arg-type]
    (asked,) = made
    assert (None if asked is None else list(asked)) == kinds  # type: ignore[call-overload]


@pytest.mark.parametrize("fancy", [True, False])
@pytest.mark.parametrize("engine", ["capi", "python"])
def test_jpeg_fancy_upsampling_reaches_every_jpeg_decoder(
    monkeypatch: pytest.MonkeyPatch, engine: str, fancy: bool
) -> None:
    """Off, nvJPEG's two decoders and the CPU one get nvImageCodec's ``fancy_upsampling=0`` option (the
    names are nvImageCodec 0.9's documented decoder ids); on, none of them does, its default."""
    import contextlib
    import types

    import torch

    from threadloader.decode.nvimgcodec import _capi, _engines

    made: list[str] = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    if engine == "capi":
        monkeypatch.setattr(_capi, "Decoder", lambda instance, **options: made.append(options["options"]))
        _engines.CApiEngine(None).new_decoder(0, "split", 2, fancy, 64)  # type: ignore[arg-type]
    else:
        fake = types.SimpleNamespace(
            DecodeParams=lambda **_: None,
            SRGB=0,
            I_RGB=0,
            Backend=lambda *args, **kwargs: None,
            LoadHintPolicy=types.SimpleNamespace(FIXED=0),
            HW_GPU_ONLY=4,
            HYBRID_CPU_GPU=3,
            Decoder=lambda **options: made.append(options["options"]),
        )
        _engines.PythonApiEngine(fake).new_decoder(0, "split", 2, fancy, 64)  # type: ignore[arg-type]
    (options,) = made
    always = [  # DALI's: the CUDA decoder's staging buffers padded, the engine's made for the batch
        "nvjpeg_cuda_decoder:host_memory_padding=8388608",
        "nvjpeg_hw_decoder:preallocate_batch_size=64",
    ]
    if fancy:
        assert sorted(options.split()) == always
    else:
        assert sorted(options.split()) == sorted(
            [
                *always,
                "libjpeg_turbo_decoder:fancy_upsampling=0",
                "nvjpeg_cuda_decoder:fancy_upsampling=0",
                "nvjpeg_hw_decoder:fancy_upsampling=0",
            ]
        )


def test_jpeg_fancy_upsampling_is_refused_beside_a_decoder_of_ones_own() -> None:
    from threadloader import ThreadLoader
    from threadloader.decode.pillow import PillowDecoder

    with pytest.raises(ValueError, match="jpeg_fancy_upsampling configure the built-in decoder"):
        ThreadLoader([], decoder=PillowDecoder(), jpeg_fancy_upsampling=False)
    with pytest.raises(TypeError, match="jpeg_fancy_upsampling must be True or False, got 2"):
        ThreadLoader([], decoder=PillowDecoder(), jpeg_fancy_upsampling=2)  # type: ignore[arg-type]


def test_the_gpu_decoder_takes_only_a_bool_for_upsampling() -> None:
    import torch

    from threadloader.decode.nvimgcodec import NvImageCodecDecoder

    with pytest.raises(TypeError, match="jpeg_fancy_upsampling must be True or False, got 'no'"):
        NvImageCodecDecoder(torch.device("cuda", 0), decode_threads=1, jpeg_fancy_upsampling="no")  # type: ignore[arg-type]


def test_the_gpu_decoder_takes_a_devices_name_as_the_front_ends_do() -> None:
    """``NvImageCodecDecoder("cuda:0")`` failed with an AttributeError on ``str.type``; the CPU is refused
    saying what to pass. Nothing of nvImageCodec is loaded by the constructor: this runs without a GPU."""
    import torch

    from threadloader.decode.nvimgcodec import NvImageCodecDecoder

    assert NvImageCodecDecoder("cuda:1", decode_threads=1).device == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"got cpu: pass torch.device\('cuda', 0\) or 'cuda:0'"):
        NvImageCodecDecoder("cpu", decode_threads=1)


def test_a_new_decoder_decodes_a_whole_batch_before_anyone_leases_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """nvImageCodec sizes the JPEG engine's share from a Decoder's first call: that call is the pool's
    batch size, not whatever small batch (the warm-up's four photos) would come first; a configuration
    without the engine decodes a few to initialize. A priming that fails leaves the Decoder usable."""
    from threadloader.decode import nvimgcodec
    from threadloader.decode.nvimgcodec import _startup

    primed: list[tuple[object, int]] = []
    engine = type("Engine", (), {"name": "fake", "new_decoder": lambda self, *options: "decoder"})()
    monkeypatch.setattr(_startup, "engine_named", lambda name: engine)
    monkeypatch.setattr(
        _startup, "_prime", lambda engine, decoder, device, count: primed.append((decoder, count))
    )
    assert nvimgcodec.new_decoder("capi", 0, "all", 2, True, 64) == "decoder"
    assert nvimgcodec.new_decoder("capi", 0, "cuda", 2, True, 0) == "decoder"
    assert primed == [("decoder", 64), ("decoder", 8)]

    def failing(*_args: object) -> None:
        raise RuntimeError("no engine today")

    monkeypatch.setattr(_startup, "_prime", failing)
    assert nvimgcodec.new_decoder("capi", 0, "split", 2, True, 64) == "decoder"


def test_a_decoder_whose_priming_is_interrupted_is_destroyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C in the priming decode (a notebook's first, slow call) dropped the Decoder it had just
    made: neither the pool nor anyone else could destroy it, and its memory stayed for the process."""
    from threadloader.decode.nvimgcodec import _startup
    from threadloader.decode.nvimgcodec._registry import DecoderRegistry

    destroyed: list[object] = []
    engine = type(
        "Engine",
        (),
        {"new_decoder": lambda self, *options: "decoder", "destroy": lambda self, d: destroyed.append(d)},
    )()
    monkeypatch.setattr(_startup, "engine_named", lambda name: engine)

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(_startup, "_prime", interrupted)
    registry = DecoderRegistry(_startup.new_decoder, _startup._destroy)
    key = ("capi", 0, "hardware", 2, False, 64)
    registry.claim([key])
    with pytest.raises(KeyboardInterrupt):
        registry.acquire(key, 2)
    assert destroyed == ["decoder"] and registry.made(key) == 0


@pytest.mark.parametrize(
    ("options", "threads"),
    [
        ({}, (16 - 2) // 2),  # the cores 2 readers leave, shared by the 2 Decoders of the default pool
        ({"num_threads": 1}, 16 - 1),  # one reader calls one Decoder at a time: it gets them all
        ({"num_threads": 2, "gpu_decoders": 4}, (16 - 2) // 2),  # as many at once as readers
        ({"num_threads": 4, "gpu_decoders": 3}, (16 - 4) // 3),
        ({"num_threads": 15, "gpu_decoders": 4}, 1),  # never none
        ({"decode_threads": 5, "gpu_decoders": 3}, 5),  # the user's count, per Decoder
    ],
)
def test_the_free_cores_are_shared_by_the_decoders(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, int], threads: int
) -> None:
    """nvImageCodec's CPU threads per Decoder: pools that each took every free core oversubscribed them."""
    import torch

    from threadloader import _options
    from threadloader._runtime import build_decoder

    monkeypatch.setattr(_options, "available_cpus", lambda: 16)
    chosen = _options.Options(**options)  # type: ignore[arg-type]
    readers = chosen.threads_on(torch.device("cuda", 0))
    built = build_decoder(chosen, torch.device("cuda", 0), threads=readers, batch=64)
    assert built.decode_threads == threads  # type: ignore[attr-defined]


def _keys(monkeypatch: pytest.MonkeyPatch, **options: object) -> object:
    """The pools' keys of a GPU decoder of ``options``, its first Decoder made by a stand-in."""
    import torch

    from threadloader.decode.nvimgcodec import NvImageCodecDecoder, _decoder

    made: list[tuple[object, ...]] = []
    monkeypatch.setattr(_decoder, "engine_named", lambda name: type("Engine", (), {"name": name})())
    decoder = NvImageCodecDecoder(
        torch.device("cuda", 0),
        decode_threads=7,
        engine="python",
        registry=DecoderRegistry(lambda *key: made.append(key) or object()),
        **options,  # type: ignore[arg-type]
    )
    prepared = decoder._start()  # type: ignore[attr-defined]
    return prepared.keys, prepared.region_key, made


def test_jpeg_fancy_upsampling_makes_pools_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag is part of a pool's key: a loader without fancy upsampling never leases a Decoder made
    with it (nor its region pool), though both share device, backend and threads. The JPEG engine's
    pool is made for the batch size; the others are shared by any."""
    keys, region_key, made = _keys(monkeypatch, jpeg_fancy_upsampling=False)
    assert keys == {"all": ("python", 0, "all", 7, False, 64), "cuda": ("python", 0, "cuda", 7, False, 0)}
    assert region_key == ("python", 0, "hybrid", 7, False, 0)
    assert made == [("python", 0, "all", 7, False, 64), ("python", 0, "cuda", 7, False, 0)]  # one of each


@pytest.mark.parametrize(
    ("batch_size", "decode_batch_size", "batch"), [(32, None, 64), (32, 128, 128), (96, None, 96)]
)
def test_the_engine_pools_are_made_for_the_front_ends_decode_batch(
    monkeypatch: pytest.MonkeyPatch, batch_size: int, decode_batch_size: int | None, batch: int
) -> None:
    """A Decoder with the JPEG engine is made for the images per call its loader gives (64 by default on
    a GPU, or the batch if larger): loaders of other sizes get pools of their own; the others share."""
    import torch

    from threadloader._options import decode_batch_size_on

    per_call = decode_batch_size_on(torch.device("cuda", 0), batch_size, decode_batch_size)
    assert per_call == batch
    keys, _, _ = _keys(monkeypatch, batch_size=per_call)
    assert (keys["all"][-1], keys["cuda"][-1]) == (batch, 0)  # type: ignore[index]


def test_a_pool_whose_last_claim_ends_destroys_its_decoders_idle_at_once_busy_on_return() -> None:
    destroyed: list[object] = []
    registry = DecoderRegistry(_Recorder().new, lambda key, decoder: destroyed.append(decoder))
    registry.claim([KEY])
    registry.claim([KEY])  # two decoders use the pool
    idle, busy = registry.acquire(KEY, 2), registry.acquire(KEY, 2)
    registry.release(KEY, idle)
    registry.unclaim([KEY])
    assert destroyed == [] and registry.made(KEY) == 2  # one claim is left
    registry.unclaim([KEY])
    assert destroyed == [idle] and registry.made(KEY) == 1  # the idle one at once
    registry.release(KEY, busy)
    assert destroyed == [idle, busy] and registry.made(KEY) == 0  # the busy one when its call returns
    registry.claim([KEY])  # a later decoder of the same configuration makes anew
    assert registry.acquire(KEY, 1) == 3


def test_a_decoder_still_working_takes_a_call_only_once_the_pool_is_at_its_limit() -> None:
    """A Decoder returned with its call submitted but not yet waited for is not free: a second Decoder
    is made for the next call while under the limit (two decode at once), and at the limit the call
    queues on the one with the fewest calls under way rather than waiting for a lease."""
    registry = DecoderRegistry(_Recorder().new)
    first = registry.acquire(KEY, 2)
    registry.release(KEY, first, pending=True)
    second = registry.acquire(KEY, 2)
    assert second != first and registry.made(KEY) == 2
    registry.release(KEY, second, pending=True)
    queued = registry.acquire(KEY, 2)  # both working: it queues on one of them
    registry.release(KEY, queued, pending=True)
    assert registry.acquire(KEY, 2) == ({first, second} - {queued}).pop()  # the one with fewer calls
    registry.settle(KEY, first)
    registry.settle(KEY, second)
    registry.settle(KEY, queued)
    assert registry.made(KEY) == 2


def test_a_pool_that_ends_destroys_a_decoder_only_once_its_calls_are_waited_for() -> None:
    """nvImageCodec's threads still read a submitted call's code streams and write its memory: its
    Decoder outlives the pool's end until the caller has waited (``settle``)."""
    destroyed: list[object] = []
    registry = DecoderRegistry(_Recorder().new, lambda key, decoder: destroyed.append(decoder))
    registry.claim([KEY])
    working, leased = registry.acquire(KEY, 2), registry.acquire(KEY, 2)
    registry.release(KEY, working, pending=True)
    assert registry.acquire(KEY, 2) == working  # at the limit: a second call queues on it
    registry.release(KEY, working, pending=True)
    registry.unclaim([KEY])
    assert destroyed == [] and registry.made(KEY) == 2
    registry.release(KEY, leased, pending=True)  # its call submitted after the end
    assert destroyed == []
    registry.settle(KEY, working)
    assert destroyed == []  # one call of two waited for
    registry.settle(KEY, working)
    assert destroyed == [working] and registry.made(KEY) == 1
    registry.settle(KEY, leased)
    assert destroyed == [working, leased] and registry.made(KEY) == 0


def _leasing(
    backend: str, destroy: Callable[[object, object], None]
) -> tuple[NvImageCodecDecoder, DecoderRegistry, DecoderKey]:
    """A GPU decoder of one stand-in Decoder a pool, and its pool's key, claimed: for calling
    ``_decode_leased`` with stand-in batches on the CPU."""
    import torch

    from threadloader.decode.nvimgcodec import NvImageCodecDecoder

    registry = DecoderRegistry(lambda *key: object(), destroy)
    decoder = NvImageCodecDecoder(
        torch.device("cuda", 0), decode_threads=1, gpu_decoders=1, backend=backend, registry=registry
    )
    key: DecoderKey = ("fake", 0, backend, 1, True, 0)
    registry.claim([key])
    return decoder, registry, key


@pytest.mark.parametrize("queued", [True, False])
def test_a_reader_returns_its_decoder_once_its_call_is_submitted(
    monkeypatch: pytest.MonkeyPatch, queued: bool
) -> None:
    """With THREADLOADER_QUEUED_DECODE=1 and one Decoder, a second reader's call is submitted while the
    first reader still waits for its own, instead of waiting for the lease (without it, it waits); a
    call whose wait fails sends its samples to Pillow. Both calls are waited for before the Decoder can
    be destroyed."""

    from threadloader._stats import StatsRecorder
    from threadloader.decode.nvimgcodec import QUEUE_ENV

    monkeypatch.setenv(QUEUE_ENV, "1" if queued else "0")

    destroyed: list[object] = []
    decoder, registry, key = _leasing("cuda", lambda key, decoder: destroyed.append(decoder))
    gate, submitted = threading.Event(), threading.Event()
    seen: list[object] = []

    class Call:
        queued = True

        def __init__(self, memory: dict[int, object], fails: bool) -> None:
            self.memory, self.fails = memory, fails

        def result(self) -> dict[int, tuple[int, int] | None]:
            if self.fails:
                raise RuntimeError("no results today")
            assert gate.wait(10)
            return dict.fromkeys(self.memory, (2, 3))

    class Batch:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def submit(self, leased: object, memory: dict[int, object], stream: int) -> Call:
            seen.append(leased)
            submitted.set()
            return Call(memory, self.fails)

    results: dict[str, object] = {}

    def read(name: str, positions: list[int], fails: bool) -> None:
        calls = [(key, None, dict.fromkeys(positions))]
        results[name] = decoder._decode_leased(calls, Batch(fails), 0, StatsRecorder())  # type: ignore[arg-type]

    first = threading.Thread(target=read, args=("first", [0, 1], False))
    first.start()
    assert submitted.wait(10)
    second = threading.Thread(target=read, args=("second", [2], True))
    second.start()
    second.join(10 if queued else 0.3)
    if not queued:
        assert second.is_alive() and len(seen) == 1  # it waits for the lease
        gate.set()
        second.join(10)
    assert not second.is_alive(), "the second call waited for the first reader's lease"
    assert len(seen) == 2 and seen[0] is seen[1]  # one Decoder
    assert results["second"].reasons == {2: "nvImageCodec failed (no results today)"}  # type: ignore[attr-defined]
    if queued:
        assert first.is_alive()  # two calls were in flight on it
        registry.unclaim([key])
        assert destroyed == []  # the first call is not yet waited for
        gate.set()
    else:
        first.join(10)
        registry.unclaim([key])
    first.join(10)
    assert results["first"].extents == {0: (2, 3), 1: (2, 3)}  # type: ignore[attr-defined]
    assert destroyed == [seen[0]]


def test_a_call_interrupted_before_its_wait_is_waited_for_before_its_decoder_goes() -> None:
    """Ctrl-C between a call's submit and its wait (a decoder called on the main thread): nvImageCodec's
    threads still use the Decoder and the call's memory, so the call is waited for before the Decoder
    is returned, here to a pool that ended, which destroys it."""

    from threadloader._stats import StatsRecorder

    events: list[str] = []
    decoder, registry, key = _leasing("cuda", lambda key, decoder: events.append("destroyed"))

    class Call:
        queued = False

        def result(self) -> dict[int, tuple[int, int] | None]:
            if not events:
                events.append("interrupted")
                registry.unclaim([key])  # the loader is closed meanwhile
                raise KeyboardInterrupt
            events.append("waited")
            return {0: (2, 3)}

    class Batch:
        def submit(self, leased: object, memory: dict[int, object], stream: int) -> Call:
            return Call()

    with pytest.raises(KeyboardInterrupt):
        decoder._decode_leased([(key, None, {0: None})], Batch(), 0, StatsRecorder())  # type: ignore[arg-type]
    assert events == ["interrupted", "waited", "destroyed"]


def test_a_pool_never_claimed_keeps_its_decoders() -> None:
    """A test's registry, or a pool leased directly: nothing ends it."""
    destroyed: list[object] = []
    registry = DecoderRegistry(_Recorder().new, lambda key, decoder: destroyed.append(decoder))
    with registry.lease(KEY, 1) as first:
        pass
    with registry.lease(KEY, 1) as again:
        assert again == first
    assert destroyed == [] and registry.made(KEY) == 1


def _started_gpu_decoder(monkeypatch: pytest.MonkeyPatch, registry: DecoderRegistry) -> NvImageCodecDecoder:
    """A GPU decoder on ``registry`` whose pools are claimed and hold a stand-in Decoder each."""
    import torch

    from threadloader.decode.nvimgcodec import _decoder

    monkeypatch.setattr(_decoder, "engine_named", lambda name: type("Engine", (), {"name": name})())
    made = NvImageCodecDecoder(torch.device("cuda", 0), decode_threads=2, engine="python", registry=registry)
    made._start()  # type: ignore[attr-defined]
    return made


#: The pools a started ``backend="auto"`` decoder of :func:`_started_gpu_decoder` claims.
_AUTO_POOLS = [("python", 0, "all", 2, True, 64), ("python", 0, "cuda", 2, True, 0)]


def test_the_gpu_decoder_claims_its_pools_until_it_is_closed_or_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its pools (both of ``auto``'s configurations, and the regions') live while it does; closing it,
    or dropping it unclosed, destroys the Decoders no other decoder uses."""
    import gc

    destroyed: list[tuple[object, ...]] = []
    registry = DecoderRegistry(lambda *key: key, lambda key, decoder: destroyed.append(key))
    first, second = _started_gpu_decoder(monkeypatch, registry), _started_gpu_decoder(monkeypatch, registry)
    first.close()
    first.close()  # idempotent
    assert destroyed == []  # the second still uses the pool
    del second
    gc.collect()
    assert destroyed == _AUTO_POOLS


def test_auto_counts_a_calls_wait_for_a_free_decoder_in_its_configurations_pace() -> None:
    """A call of ``backend="auto"`` that waits for the configuration's only Decoder, held by another
    reader for 0.2 s, is timed from before that wait: the next reader would wait too. Timed from its
    lease, the configuration looked fastest while its readers queued (the graphed step's start on the
    JPEG engine, docs/benchmarks.md)."""

    from threadloader._stats import StatsRecorder

    decoder, registry, key = _leasing("auto", lambda key, decoder: None)

    class Call:
        queued = False

        def result(self) -> dict[int, tuple[int, int] | None]:
            return {0: (2, 3)}  # the decode itself takes no time

    class Batch:
        def submit(self, leased: object, memory: dict[int, object], stream: int) -> Call:
            return Call()

    held = registry.acquire(key, 1)  # another reader's call
    threading.Timer(0.2, registry.release, args=(key, held)).start()
    turn = decoder._pace.choose()  # type: ignore[union-attr]
    decoder._decode_leased([(key, turn, {0: None})], Batch(), 0, StatsRecorder())  # type: ignore[arg-type]
    registry.unclaim([key])
    assert decoder.pace()[turn.arm] >= 0.2 * 0.9


def test_a_decoder_dropped_inside_the_registrys_lock_in_its_own_thread_ends_its_pools_on_leaving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The finalizer of a decoder collected while its thread is in the registry's locked code (a reader's
    lease) does not wait for that thread's own lock: the thread ends the pools as it leaves."""
    destroyed: list[object] = []
    registry = DecoderRegistry(lambda *key: key, lambda key, decoder: destroyed.append(key))
    seen: dict[str, object] = {}

    def lease_while_the_decoder_is_dropped() -> None:
        held = [_started_gpu_decoder(monkeypatch, registry)]  # made and dropped by this thread (3.13t)
        registry.release(KEY, registry.acquire(HashesInsideTheLock(held.clear), 1))  # type: ignore[arg-type]
        seen["on_leaving"] = list(destroyed)

    thread = threading.Thread(target=lease_while_the_decoder_is_dropped, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the thread waits for the registry's lock that it holds itself"
    assert seen["on_leaving"] == _AUTO_POOLS


def test_a_decoder_dropped_while_another_thread_is_in_the_registry_does_not_wait_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The finalizer leaves the pools to the thread in the registry, which ends them as it leaves."""
    import gc

    destroyed: list[object] = []
    registry = DecoderRegistry(lambda *key: key, lambda key, decoder: destroyed.append(key))
    decoder = _started_gpu_decoder(monkeypatch, registry)
    inside, leave = threading.Event(), threading.Event()
    holder = threading.Thread(
        target=registry.acquire,
        args=(HashesInsideTheLock(lambda: (inside.set(), leave.wait(10))), 1),
        daemon=True,
    )
    holder.start()
    assert inside.wait(10)
    started = time.monotonic()
    del decoder
    gc.collect()
    assert time.monotonic() - started < 5, "the finalizer waited for the thread in the registry"
    assert destroyed == []  # that thread has yet to leave
    leave.set()
    holder.join(10)
    assert not holder.is_alive() and destroyed == _AUTO_POOLS
