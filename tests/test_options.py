"""The options both front ends take: declared once, checked once, the same in both, reaching the decoder.

An option is a field of ``Options`` (its default, its check); each front end names it in its
signature with that default, and the runtime hands each decoding option to the GPU decoder under the
same name. These tests fail when one of those places is left out for a new option.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from threadloader import BatchDecoder, ThreadLoader
from threadloader._options import DEFAULTS, Options
from threadloader._runtime import build_decoder
from threadloader.decode import NvImageCodecDecoder, PillowDecoder

OPTIONS = [field.name for field in dataclasses.fields(Options)]

#: A value other than the default for each option that configures the GPU decoder, as it reaches it.
DECODING = {
    "backend": "hybrid",
    "decode_threads": 3,
    "gpu_decoders": 4,
    "jpeg_fancy_upsampling": False,
    "max_pixels": 1234,
    "region_decode": False,
}


@pytest.mark.parametrize("front_end", [ThreadLoader, BatchDecoder])
def test_every_option_is_a_keyword_of_both_front_ends_with_the_one_default(front_end: type) -> None:
    parameters = inspect.signature(front_end.__init__).parameters
    for name in OPTIONS:
        assert name in parameters, f"{front_end.__name__} does not take the option {name}"
        parameter = parameters[name]
        assert parameter.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert parameter.default is getattr(DEFAULTS, name), (
            f"{front_end.__name__}'s default for {name} is {parameter.default!r}, the options' "
            f"{getattr(DEFAULTS, name)!r}: name DEFAULTS.{name} in its signature"
        )


def test_every_option_that_configures_the_gpu_decoder_reaches_it_under_its_name() -> None:
    """The GPU decoder's constructor touches no GPU: it is built here for a CUDA device."""
    decoder_parameters = set(inspect.signature(NvImageCodecDecoder.__init__).parameters)
    assert set(DECODING) == (decoder_parameters & set(OPTIONS)) - {"device"}  # a new one is listed above
    for name, value in DECODING.items():
        built = build_decoder(Options(**{name: value}), torch.device("cuda", 0), threads=2, batch=96)
        assert isinstance(built, NvImageCodecDecoder)
        assert getattr(built, name) == value, name
        assert built.batch_size == 96


def test_the_defaults_derive_what_the_user_left_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    from threadloader import _options

    monkeypatch.setattr(_options, "available_cpus", lambda: 16)
    built = build_decoder(DEFAULTS, torch.device("cuda", 0), threads=2, batch=64)
    assert isinstance(built, NvImageCodecDecoder)
    assert (built.decode_threads, built.gpu_decoders, built.region_decode) == ((16 - 2) // 2, 2, True)
    assert isinstance(build_decoder(DEFAULTS, torch.device("cpu"), threads=2, batch=64), PillowDecoder)


@pytest.mark.parametrize("on", [1, np.True_])
def test_switches_given_as_ints_or_numpy_bools_are_kept_as_plain_bools(on: object) -> None:
    """1 and numpy's True are on, as for DataLoader's shuffle; what is kept is a bool, not the object."""
    off = 0 if on == 1 and not isinstance(on, np.bool_) else np.False_
    options = Options(size=(8, 8), channels_last=on, jpeg_fancy_upsampling=off, region_decode=on)  # type: ignore[arg-type]
    kept = (options.channels_last, options.jpeg_fancy_upsampling, options.region_decode)
    assert kept == (True, False, True)
    assert [type(value) for value in kept] == [bool, bool, bool]
    assert type(options.output_format().channels_last) is bool


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"backend": "nvjpeg"}, ValueError, r"backend must be one of \['all', 'auto', .*got 'nvjpeg'"),
        ({"gpu_decoders": 0}, ValueError, "gpu_decoders must be at least 1, got 0"),
        ({"gpu_decoders": "2"}, ValueError, r"gpu_decoders must be an int, got '2' \(str\)"),
        ({"gpu_decoders": None}, ValueError, r"gpu_decoders must be an int, got None"),
        ({"decode_threads": 0}, ValueError, "decode_threads must be at least 1, got 0"),
        ({"decode_threads": 2.0}, ValueError, r"decode_threads must be an int or None, got 2\.0 \(float\)"),
        ({"num_threads": 0}, ValueError, "num_threads must be at least 1, got 0"),
        ({"jpeg_fancy_upsampling": 2}, TypeError, "jpeg_fancy_upsampling must be True or False, got 2"),
        ({"region_decode": "no"}, TypeError, "region_decode must be True, False or None, got 'no'"),
        ({"region_decode": 1.0}, TypeError, "region_decode must be True, False or None, got 1.0"),
        ({"region_decode": 2}, TypeError, "region_decode must be True, False or None, got 2"),
        ({"channels_last": "no", "size": (8, 8)}, TypeError, "channels_last must be True or False, got 'no'"),
        ({"transform": "flip"}, TypeError, "str is not a threadloader transform"),
    ],
)
@pytest.mark.parametrize("front_end", ["options", "loader", "service"])
def test_each_option_is_checked_once_with_the_same_words_in_both_front_ends_on_any_device(
    front_end: str, options: dict[str, object], error: type, message: str
) -> None:
    """The check is the options' own, so both front ends (on the CPU here) refuse the same values with
    the same message as the options do, and as a GPU front end would."""
    with pytest.raises(error, match=message):
        if front_end == "options":
            Options(**options)  # type: ignore[arg-type]
        elif front_end == "loader":
            ThreadLoader([b"x"], batch_size=1, device="cpu", **options)  # type: ignore[arg-type]
        else:
            BatchDecoder(device="cpu", **options)  # type: ignore[arg-type]


def test_decoding_options_are_refused_beside_a_decoder_of_ones_own() -> None:
    for name, value in DECODING.items():
        with pytest.raises(ValueError, match=f"{name} configure the built-in decoder"):
            ThreadLoader([b"x"], batch_size=1, decoder=PillowDecoder(), **{name: value})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"decoder must be a threadloader\.decode\.ImageDecoder, got str"):
        Options(decoder="pillow")  # type: ignore[arg-type]


def test_options_are_frozen_and_take_a_front_ends_arguments_by_name() -> None:
    arguments = {
        "self": None,
        "source": [],
        "backend": "all",
        **{name: getattr(DEFAULTS, name) for name in OPTIONS},
    }
    arguments["backend"] = "all"
    options = Options.of(arguments)
    assert options.backend == "all"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.backend = "auto"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("0", False),
        ("false", False),
        ("Off", False),
        ("no", False),
        (" 0\n", False),
        ("1", True),
        ("TRUE", True),
        ("on", True),
        ("", True),
    ],
)
def test_switches_read_what_people_write(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    """THREADLOADER_WARMUP=false (anything but the exact "0") left the warm-up on, and so on."""
    from threadloader._options import REGION_DECODE_ENV, WARMUP_ENV, warm_up_wanted

    monkeypatch.setenv(WARMUP_ENV, value)
    monkeypatch.setenv(REGION_DECODE_ENV, value)
    assert warm_up_wanted() is on
    assert DEFAULTS.regions() is on


def test_a_switch_of_another_value_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from threadloader._options import WARMUP_ENV, warm_up_wanted

    monkeypatch.setenv(WARMUP_ENV, "disable")
    with pytest.raises(ValueError, match=r"THREADLOADER_WARMUP must be 1 or 0 .*got 'disable'"):
        warm_up_wanted()


@pytest.mark.parametrize("variable", ["THREADLOADER_REGION_DECODE", "THREADLOADER_WARMUP"])
@pytest.mark.parametrize("front_end", ["loader", "service"])
def test_a_switch_of_another_value_is_refused_on_the_cpu_too(
    monkeypatch: pytest.MonkeyPatch, variable: str, front_end: str
) -> None:
    """Both were read on the GPU path alone: with "flase" a front end on the CPU was built without
    complaint, and the same script raised on a GPU machine."""
    monkeypatch.setenv(variable, "flase")
    with pytest.raises(ValueError, match=rf"^{variable} must be 1 or 0 .*, got 'flase'$"):
        if front_end == "loader":
            ThreadLoader([b"x"], batch_size=1, device="cpu")
        else:
            BatchDecoder(device="cpu")


def test_a_normalize_before_any_float_conversion_is_refused_when_built() -> None:
    """Decoders give uint8: it raised "normalize needs float images" at the first batch."""
    from threadloader.transforms import Normalize, Resize, ToDtype

    with pytest.raises(ValueError, match=r"Normalize\(.*\) would see uint8 images: put ToDtype"):
        Options(transform=[Resize((8, 8)), Normalize((0.5,) * 3, (0.2,) * 3)], dtype=torch.float32)
    floats = [ToDtype(torch.float32, scale=True), Normalize((0.5,) * 3, (0.2,) * 3)]
    assert Options(transform=floats, dtype=torch.float32).chain is not None


def test_a_device_index_is_a_cuda_devices_and_one_torch_would_wrap_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``device=0`` (an int, numpy's too) said "device must be 'cpu', 'cuda', 'cuda:N' or None" on a
    machine without a GPU; ``'cuda:257'`` was cuda:1 (torch keeps an index's low 8 bits), another GPU."""
    import numpy as np

    from threadloader import _device

    for index in (1, np.int64(1), torch.device("cuda", 1), "cuda:1"):
        assert _device.parse_device(index) == torch.device("cuda", 1)  # type: ignore[arg-type]
    for wrapped in ("cuda:257", "cuda:128", 257, np.int32(300)):
        with pytest.raises(ValueError, match=r"names a CUDA device index that torch cannot hold"):
            _device.parse_device(wrapped)  # type: ignore[arg-type]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"device='cuda:0' but no CUDA GPU is usable here"):
        _device.resolve_device(0)


def test_a_device_index_torch_reads_as_none_is_refused() -> None:
    """``'cuda:255'``, ``255`` and ``'cuda:511'`` were cuda:0 (the current GPU): torch reads an index of
    255 (mod 256) as none, which the check of a wrapped index let through."""
    import numpy as np

    from threadloader import _device

    for wrapped in ("cuda:255", 255, np.int64(255), "cuda:511"):
        with pytest.raises(
            ValueError, match=rf"^device={re.escape(repr(wrapped))} names a CUDA device index that torch"
        ):
            _device.parse_device(wrapped)  # type: ignore[arg-type]
    # What names no index, or one torch holds, is taken as before.
    assert _device.parse_device("cuda") == torch.device("cuda")
    assert _device.parse_device(torch.device("cuda")) == torch.device("cuda")
    assert _device.parse_device("cpu:0") == torch.device("cpu")
    assert _device.parse_device("cuda:0") == torch.device("cuda", 0)
    assert _device.parse_device(127) == torch.device("cuda", 127)


@pytest.mark.parametrize("cuda", ["11.8", None, "12.4", "13.0"])
def test_the_cpu_fallback_warning_names_only_extras_pyproject_defines(
    monkeypatch: pytest.MonkeyPatch, cuda: str | None
) -> None:
    """With a torch for CUDA 11.8 it said ``pip install -e '.[cu11]'``, an extra that does not exist, and
    with one of no CUDA version (ROCm) it suggested nvImageCodec, whose wheels are for CUDA 12 and 13."""
    from threadloader import CPUFallbackWarning, _device

    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as file:
        extras = set(tomllib.load(file)["project"]["optional-dependencies"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(_device, "_nvimgcodec_installed", lambda: False)
    with pytest.warns(CPUFallbackWarning) as warned:
        assert _device.resolve_device(None) == torch.device("cpu")
    (warning,) = warned
    message = str(warning.message)
    named = set(re.findall(r"'\.\[(\w+)\]'", message))
    assert named <= extras, message
    assert "pass device='cpu'" in message
    if cuda in ("12.4", "13.0"):
        major = cuda.split(".")[0]
        assert named == {f"cu{major}"}
        assert f"pip install 'nvidia-nvimgcodec-cu{major}[nvjpeg]'" in message
    else:
        assert not named, message
        assert "install a torch built for CUDA 12 or 13" in message
        assert (f"built for CUDA {cuda}" if cuda else "has no CUDA version") in message


@pytest.mark.parametrize("named", ["cpu", "cpu:0", torch.device("cpu", 0)])
@pytest.mark.parametrize("front_end", ["loader", "service"])
def test_a_decoder_of_ones_own_takes_the_cpu_named_as_device_takes_it(named: object, front_end: str) -> None:
    """``PillowDecoder(device="cpu")`` raised "'str' object has no attribute 'type'" when built into a
    front end, and beside ``device="cpu"`` "device='cpu' but decoder=... decodes on cpu"."""
    import io

    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (6, 9, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    expected = torch.from_numpy(np.array(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")))
    for device in (None, "cpu"):
        decoder = PillowDecoder(device=named)  # type: ignore[arg-type]
        if front_end == "loader":
            with ThreadLoader([buffer.getvalue()], batch_size=1, device=device, decoder=decoder) as loader:
                assert loader.device == torch.device("cpu")
                (image,), _ = next(iter(loader))
        else:
            with BatchDecoder(device=device, decoder=decoder) as service:
                assert service.device == torch.device("cpu")
                image = service.decode(buffer.getvalue())
        assert torch.equal(image, expected.permute(2, 0, 1))


@pytest.mark.parametrize("front_end", ["loader", "service"])
def test_a_float_dtype_not_made_is_refused_naming_the_ones_that_are(front_end: str) -> None:
    """``dtype=torch.float8_e4m3fn`` said "dtype must be torch.uint8 or a float type", which it is."""
    named = r"torch\.uint8, torch\.float32, torch\.float16, torch\.bfloat16 or torch\.float64"
    with pytest.raises(ValueError, match=rf"^dtype must be {named}, got torch\.float8_e4m3fn$"):
        if front_end == "loader":
            ThreadLoader([b"x"], batch_size=1, device="cpu", dtype=torch.float8_e4m3fn)
        else:
            BatchDecoder(device="cpu", dtype=torch.float8_e4m3fn)
