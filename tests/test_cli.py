"""``python -m threadloader`` as a user runs it: one line for each user error, exit codes, --on-error."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from threadloader.__main__ import main

from .conftest import encode, photo
from .test_tar import sample, write_shard

ROOT = Path(__file__).resolve().parents[1]
PROG = "python -m threadloader"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "threadloader", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no traceback, no usage block
    assert lines[0].startswith(f"{PROG}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two classes of two small JPEGs each, and a bad file in the second: sample 4 in sorted order."""
    root = tmp_path / "photos"
    for c, name in enumerate(("cat", "dog")):
        (root / name).mkdir(parents=True)
        for i in range(2):
            (root / name / f"{i}.jpg").write_bytes(encode(photo(40, 48, seed=10 * c + i), quality=90))
    (root / "dog" / "2.jpg").write_bytes(b"this is not a JPEG")
    return root


def test_help_is_plain_text() -> None:
    result = cli("--help")
    assert result.returncode == 0 and result.stderr == ""
    assert "--on-error {raise,skip}" in result.stdout
    for markup in ("``", ":class:", ":func:", ":meth:", "**"):
        assert markup not in result.stdout, markup


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--batch-size", "0"], ["--batch-size", "positive integer", "got 0"]),
        (["--size", "big"], ["--size", "'big'"]),
        (["--bogus"], ["unrecognized arguments: --bogus"]),
        (["--on-error", "ignore"], ["--on-error", "'ignore'"]),
    ],
)
def test_bad_options_are_one_line(args: list[str], fragments: list[str]) -> None:
    assert_one_line_error(cli(*args), 2, *fragments, "--help")


def test_missing_folder(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    assert_one_line_error(cli(str(missing)), 2, "no such file or folder", str(missing))


def test_a_missing_file_among_images_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """It was 'got 2 paths that are not all images or all shards', which hid which one was missing."""
    (tmp_path / "a.jpg").write_bytes(encode(photo(20, 24, seed=1)))
    missing = str(tmp_path / "nosuch.jpg")
    code, out, err = in_process(capsys, str(tmp_path / "a.jpg"), missing)
    assert (code, out) == (2, "")
    assert err == f"{PROG}: error: no such file or folder: {missing!r}\n"


def test_a_file_that_is_no_image_nor_shard(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("no image")
    assert_one_line_error(cli(str(path)), 2, str(path), "is not an image", "folder")


def test_a_folder_of_images_alone_and_image_files_load(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The library's message for a folder without class sub-folders says to pass its files: the
    command refused both."""
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(encode(photo(20, 24, seed=i)))
    for args in ([str(tmp_path)], [str(tmp_path / f"{i}.jpg") for i in range(3)]):
        code, out, err = in_process(capsys, *args, "--device", "cpu", "--epochs", "1", "--size", "16")
        assert (code, err) == (0, "") and "1 epoch(s) of 3 images at 16x16" in out


def test_a_folder_of_images_with_sub_folders_without_images_loads_its_images(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Any sub-folder (an empty '.ipynb_checkpoints') made the command read class folders and exit 2
    with "no image files", though the folder's JPEGs were there; a hidden one's images make no class."""
    for i in range(3):
        (tmp_path / f"{i}.jpg").write_bytes(encode(photo(20, 24, seed=i)))
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("no image")
    (tmp_path / ".thumbs").mkdir()
    (tmp_path / ".thumbs" / "0.jpg").write_bytes(encode(photo(20, 24, seed=9)))
    code, out, err = in_process(capsys, str(tmp_path), "--device", "cpu", "--epochs", "1", "--size", "16")
    assert (code, err) == (0, "") and "1 epoch(s) of 3 images at 16x16" in out


def test_a_folder_without_images_says_what_it_holds(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """It said to remove '.ipynb_checkpoints' or pass --allow-empty, as if '.thumbs' were a class."""
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".thumbs").mkdir()
    (tmp_path / ".thumbs" / "0.jpg").write_bytes(encode(photo(20, 24, seed=9)))
    (tmp_path / "notes.txt").write_text("no image")
    code, out, err = in_process(capsys, str(tmp_path), "--device", "cpu")
    assert (code, out) == (2, "")
    assert err == (
        f"{PROG}: error: no images (.jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, .webp), class folders "
        f"or .tar shards in {str(tmp_path)!r}: it holds only sub-folders without images "
        "('.ipynb_checkpoints'); hidden sub-folders with images ('.thumbs'), not classes: give one as the "
        "folder; other files ('notes.txt')\n"
    )


def test_a_folder_named_like_a_shard_is_a_folder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """A class-folder tree named 'imagenet.tar' was opened as a shard ("not a regular file"); the
    library's as_source takes a directory as a folder before looking at its name."""
    root = tmp_path / "imagenet.tar"
    for name, count in (("cat", 1), ("dog", 2)):
        (root / name).mkdir(parents=True)
        for i in range(count):
            (root / name / f"{i}.jpg").write_bytes(encode(photo(20, 24, seed=i)))
    code, out, err = in_process(capsys, str(root), "--device", "cpu", "--epochs", "1", "--size", "16")
    assert (code, err) == (0, "") and "1 epoch(s) of 3 images at 16x16" in out


def test_the_first_batchs_time_leaves_out_making_the_sample_photos(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threadloader.__main__ as command

    made = command.sample_photos

    def slow(count: int) -> list[tuple[bytes, int]]:
        time.sleep(1.0)
        return made(count)

    monkeypatch.setattr(command, "sample_photos", slow)
    code, out, _ = in_process(capsys, "--device", "cpu", "--count", "64", "--epochs", "1", "--size", "32")
    assert code == 0
    assert float(out.rsplit("first batch after ", 1)[1].split(" s")[0]) < 1.0


def test_running_out_of_memory_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threadloader.__main__ as command

    def run(args: object) -> str:
        raise RuntimeError(
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate 43200000000 bytes"
        )

    monkeypatch.setattr(command, "run", run)
    code, out, err = in_process(capsys, "--device", "cpu")
    assert (code, out) == (1, "")
    assert (
        err.startswith(f"{PROG}: error: out of memory (") and "--size" in err and len(err.splitlines()) == 1
    )


def test_empty_folder(tmp_path: Path) -> None:
    """It was the library's 'no class sub-folders ... pass a list of file paths', which the command takes."""
    assert_one_line_error(cli(str(tmp_path)), 2, str(tmp_path), "no images", "class folders or .tar shards")


def test_a_folder_of_shards_loads_its_shards(capsys: pytest.CaptureFixture[str], shard_dir: Path) -> None:
    code, out, err = in_process(
        capsys, str(shard_dir), "--count", "5", "--batch-size", "2", "--size", "32", "--epochs", "1"
    )
    assert code == 0, err
    assert "1 epoch(s) of 5 images at 32x32" in out


def test_a_folder_without_images(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "notes.txt").write_text("no image here")
    assert_one_line_error(cli(str(tmp_path)), 2, str(tmp_path))


def test_a_bad_image_stops_the_run_with_one_line(folder: Path) -> None:
    bad = folder / "dog" / "2.jpg"
    assert_one_line_error(
        cli(str(folder), "--batch-size", "2", "--epochs", "1"), 1, "sample 4", str(bad), "--on-error skip"
    )


def test_on_error_skip_goes_on_and_counts(folder: Path) -> None:
    result = cli(str(folder), "--batch-size", "2", "--size", "32", "--epochs", "2", "--on-error", "skip")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("threadloader: ") and line.endswith("; 1 bad images skipped")
    assert "Traceback" not in result.stderr


def test_every_image_bad_with_skip_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "0.jpg").write_bytes(b"garbage")
    result = cli(str(tmp_path), "--on-error", "skip", "--epochs", "1")
    assert result.returncode == 1
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"{PROG}: error: no image could be loaded: every one of the 1 was bad and skipped"
    )


def assert_no_python_spelling(line: str) -> None:
    """The command's messages name its flags, not the library's keyword arguments."""
    for python in ("device=", "allow_empty", "ImageFolder(", "None"):
        assert python not in line, line


def test_cuda_on_a_machine_without_one() -> None:
    """It was the library's "device='cuda' but ...; pass device='cpu' (or None)"."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message on a machine without a GPU")
    for device in ("cuda", "cuda:1"):
        line = assert_one_line_error(
            cli("--device", device, "--count", "4"), 2, f"--device {device},", "no CUDA GPU", "--device cpu"
        )
        assert_no_python_spelling(line)


@pytest.mark.parametrize("device", ["bogus", "mps", "cuda:x"])
def test_a_device_that_is_not_cpu_or_cuda(capsys: pytest.CaptureFixture[str], device: str) -> None:
    """It was the library's "device must be 'cpu', 'cuda', 'cuda:N' or None, got ...": a usage error now."""
    code, out, err = in_process(capsys, "--device", device)
    assert (code, out) == (2, "")
    expected = f"argument --device: expected cpu, cuda or cuda:N, got {device!r} (see {PROG} --help)"
    assert err == f"{PROG}: error: {expected}\n"


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """As if this machine had one CUDA GPU (the library's checks are made by the command first)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_a_cuda_device_past_the_last(capsys: pytest.CaptureFixture[str], one_gpu: None) -> None:
    """It was the library's "device='cuda:3' but only 1 CUDA device(s) exist"."""
    code, out, err = in_process(capsys, "--device", "cuda:3", "--count", "4")
    assert (code, out) == (2, "")
    assert err == f"{PROG}: error: --device cuda:3, but this machine has 1 CUDA device(s): cuda:0\n"


def test_cuda_without_nvimgcodec(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, one_gpu: None
) -> None:
    """It was the library's ImportError, which ends "or pass device='cpu'"."""
    import threadloader.__main__ as command

    monkeypatch.setattr(command.devices, "_nvimgcodec_installed", lambda: False)
    code, out, err = in_process(capsys, "--device", "cuda", "--count", "4")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert err.startswith(f"{PROG}: error: --device cuda decodes on the GPU, which needs nvImageCodec")
    assert "pip install 'nvidia-nvimgcodec-cu" in err and err.endswith("; or use --device cpu\n")
    assert_no_python_spelling(err)


def test_nvimgcodec_that_does_not_import(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, one_gpu: None
) -> None:
    """Installed but not importable: the library's own ImportError, its advice in the command's words."""
    import threadloader.__main__ as command
    from threadloader.decode.nvimgcodec._engines import import_nvimgcodec

    monkeypatch.setitem(sys.modules, "nvidia.nvimgcodec", None)  # "import nvidia.nvimgcodec" fails
    if "nvidia" in sys.modules:
        monkeypatch.delattr(sys.modules["nvidia"], "nvimgcodec", raising=False)
    with pytest.raises(ImportError) as library:
        import_nvimgcodec()
    assert "device='cpu'" in str(library.value)  # what the command rewords

    def loader(*args: object, **kwargs: object) -> None:
        raise library.value

    monkeypatch.setattr(command.devices, "_nvimgcodec_installed", lambda: True)
    monkeypatch.setattr(command, "ThreadLoader", loader)
    code, out, err = in_process(capsys, "--device", "cuda", "--count", "4")
    assert (code, out) == (2, "") and len(err.splitlines()) == 1
    assert err.startswith(f"{PROG}: error: --device cuda: GPU decoding needs nvImageCodec")
    assert err.endswith("; or use --device cpu\n") and "device='cpu'" not in err


def test_a_gpu_without_nvimgcodec_is_one_note(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, one_gpu: None
) -> None:
    """Without --device the library warns (CPUFallbackWarning, "pass device='cpu'", and a source line)."""
    import warnings

    import threadloader.__main__ as command

    monkeypatch.setattr(command.devices, "_nvimgcodec_installed", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the library's warning would fail the run
        code, out, err = in_process(
            capsys, "--count", "8", "--batch-size", "4", "--size", "16", "--epochs", "1"
        )
    assert code == 0 and "on the CPU (Pillow)" in out
    (line,) = err.splitlines()
    assert line.startswith(f"{PROG}: note: a CUDA GPU is here, but nvImageCodec is not installed")
    assert "--device cpu" in line and "pip install 'nvidia-nvimgcodec-cu" in line
    assert_no_python_spelling(line)


@pytest.fixture
def empty_class(tmp_path: Path) -> Path:
    """Classes cat, dog (no images: a note in it) and eel, two JPEGs each in cat and eel."""
    for name, count in (("cat", 2), ("dog", 0), ("eel", 2)):
        (tmp_path / name).mkdir()
        for i in range(count):
            (tmp_path / name / f"{i}.jpg").write_bytes(encode(photo(20, 24, seed=i), quality=90))
    (tmp_path / "dog" / "notes.txt").write_text("no image here")
    return tmp_path


def test_an_empty_class_folder_names_allow_empty(empty_class: Path) -> None:
    """It was the library's "...or pass ImageFolder(root, allow_empty=True)": the command had no flag."""
    line = assert_one_line_error(
        cli(str(empty_class), "--device", "cpu"), 2, str(empty_class), "'dog'", "--allow-empty"
    )
    assert_no_python_spelling(line)


def test_allow_empty_keeps_an_empty_class(capsys: pytest.CaptureFixture[str], empty_class: Path) -> None:
    """Targets as torchvision's ImageFolder(allow_empty=True): the empty class keeps its index."""
    from threadloader import ImageFolder
    from threadloader.__main__ import _folder

    code, out, err = in_process(
        capsys, str(empty_class), "--allow-empty", "--device", "cpu", "--batch-size", "2", "--size", "16"
    )
    assert (code, err) == (0, "") and "of 4 images at 16x16" in out
    folder = _folder(str(empty_class), allow_empty=True)
    assert isinstance(folder, ImageFolder)
    assert folder.class_to_idx == {"cat": 0, "dog": 1, "eel": 2}
    assert [(Path(path).relative_to(empty_class).as_posix(), target) for path, target in folder.samples] == [
        ("cat/0.jpg", 0),
        ("cat/1.jpg", 0),
        ("eel/0.jpg", 2),
        ("eel/1.jpg", 2),
    ]
    try:
        from torchvision.datasets import ImageFolder as TorchvisionFolder
    except ImportError:
        return
    theirs = TorchvisionFolder(str(empty_class), allow_empty=True)
    assert folder.class_to_idx == theirs.class_to_idx
    assert folder.samples == theirs.samples


def test_help_names_allow_empty() -> None:
    result = cli("--help")
    assert result.returncode == 0 and "--allow-empty" in result.stdout


def test_the_bundled_samples_run() -> None:
    result = cli("--count", "16", "--batch-size", "4", "--size", "32", "--epochs", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("threadloader: ") and "on the CPU (Pillow)" in line and "batches of 4" in line


def in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``main(args)`` in this process (no interpreter to start): its exit status, stdout and stderr."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_count_takes_the_first_images_of_a_folder(capsys: pytest.CaptureFixture[str], folder: Path) -> None:
    """The bad image is the last of five in ImageFolder order: the first four load without it."""
    code, out, err = in_process(
        capsys, str(folder), "--count", "4", "--batch-size", "2", "--size", "32", "--epochs", "1"
    )
    assert code == 0, err
    assert "1 epoch(s) of 4 images at 32x32" in out
    code, _, err = in_process(capsys, str(folder), "--count", "99", "--epochs", "1")
    assert code == 1 and "sample 4" in err and str(folder / "dog" / "2.jpg") in err


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    """Three shards of two samples each (targets 0..5), and a file that is not a shard beside them."""
    blobs = [encode(photo(40, 48, seed=i), quality=90) for i in range(6)]
    for s in range(3):
        write_shard(tmp_path / f"{s:06d}.tar", [sample(blobs, 2 * s + k) for k in range(2)])
    (tmp_path / "README.txt").write_text("not a shard")
    return tmp_path


@pytest.mark.parametrize("form", ["glob", "shell-expanded", "braces"])
def test_shards_load_from_a_glob_a_file_list_or_braces(
    capsys: pytest.CaptureFixture[str], shard_dir: Path, form: str
) -> None:
    sources = {
        "glob": [str(shard_dir / "*.tar")],
        "shell-expanded": sorted(str(path) for path in shard_dir.glob("*.tar")),
        "braces": [str(shard_dir / "{000000..000002}.tar")],
    }[form]
    code, out, err = in_process(
        capsys, *sources, "--count", "5", "--batch-size", "2", "--size", "32", "--epochs", "1"
    )
    assert code == 0, err
    assert "1 epoch(s) of 5 images at 32x32" in out


def test_a_glob_matching_no_shard_names_the_brace_syntax(tmp_path: Path) -> None:
    """As a user runs it: one line, no traceback, exit status 2."""
    pattern = str(tmp_path / "*.tar")
    assert_one_line_error(cli(pattern), 2, pattern, "no file matches", "{000000..000127}")


def test_several_folders_are_refused(capsys: pytest.CaptureFixture[str], folder: Path) -> None:
    code, out, err = in_process(capsys, str(folder), str(folder))
    assert (code, out) == (2, "")
    assert (
        err
        == f"{PROG}: error: give one folder, image files, or tar shards (.tar), got 2 paths that are not all "
        + "images or all shards: "
        + f"{str(folder)!r}, {str(folder)!r}\n"
    )
