"""Sources as given: a single path (a missing one is FileNotFoundError naming it, as the CLI's "no such
folder"), ImageFolder's listing, and a list's in-memory items."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from threadloader import SampleError, ThreadLoader

from .conftest import encode, photo


@pytest.mark.parametrize("kind", [str, Path])
def test_a_missing_directory_is_file_not_found(tmp_path: Path, kind: type) -> None:
    missing = tmp_path / "no" / "such" / "dir"
    with pytest.raises(FileNotFoundError) as raised:
        ThreadLoader(kind(missing))
    assert repr(str(missing)) in str(raised.value)
    assert "does not exist" in str(raised.value)


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks here")
def test_a_broken_link_says_so(tmp_path: Path) -> None:
    link = tmp_path / "data"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(FileNotFoundError, match=r"does not exist \(a link to a missing target\)"):
        ThreadLoader(link)


def test_an_existing_file_keeps_its_message(tmp_path: Path) -> None:
    """A file that exists is not "missing": the message says to pass a list."""
    path = tmp_path / "one.jpg"
    path.write_bytes(encode(photo(8, 8)))
    with pytest.raises(TypeError, match=r"must be a directory.*ThreadLoader\(\[path\]\)"):
        ThreadLoader(str(path))


def test_a_url_is_not_checked_for_existence() -> None:
    """A URL names no local path: it gets the message about what a single path may be."""
    with pytest.raises(TypeError, match="must be a directory"):
        ThreadLoader("s3://bucket/images")


def test_a_local_file_with_double_colons_in_its_name_is_read_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Foo::Bar.png`` was taken for an fsspec chain (``simplecache::s3://...``) and looked up as
    ``Foo`` on no file system: not found (or fsspec missing), though the file was right there."""
    from threadloader._remote import is_url

    monkeypatch.chdir(tmp_path)
    pixels = photo(8, 6)
    (tmp_path / "Foo::Bar.png").write_bytes(encode(pixels, "PNG"))
    with ThreadLoader([("Foo::Bar.png", 3)], batch_size=1, device="cpu") as loader:
        ((images, targets),) = list(loader)
    assert targets.tolist() == [3] and images[0].permute(1, 2, 0).numpy().tolist() == pixels.tolist()
    assert is_url("simplecache::s3://bucket/key.jpg") and is_url("s3://bucket/key.jpg")
    assert not is_url("Foo::Bar.png") and not is_url("C::D/e.jpg")


def test_a_path_object_that_gives_bytes_is_read_as_its_path(tmp_path: Path) -> None:
    """``os.fspath`` of a path object may be bytes (a POSIX path need not be text): a list of them
    failed at construction with "a bytes-like object is required, not 'str'"."""

    class BytesPath:
        def __init__(self, path: Path) -> None:
            self.path = path

        def __fspath__(self) -> bytes:
            return os.fsencode(self.path)

    pixels = [photo(8, 6, seed=i) for i in range(2)]
    for i, each in enumerate(pixels):
        (tmp_path / f"{i}.png").write_bytes(encode(each, "PNG"))
    with ThreadLoader(
        [BytesPath(tmp_path / f"{i}.png") for i in range(2)], batch_size=2, device="cpu"
    ) as loader:
        ((images, _),) = list(loader)
    assert [image.permute(1, 2, 0).numpy().tolist() for image in images] == [each.tolist() for each in pixels]
    missing = ThreadLoader([BytesPath(tmp_path / "missing.png")], batch_size=1, device="cpu")
    with missing, pytest.raises(SampleError) as info:
        list(missing)
    assert info.value.origin == str(tmp_path / "missing.png")  # the path as text, not b'...'


def test_image_folder_lists_nested_files_in_torchvisions_order(tmp_path: Path) -> None:
    """Sorting whole paths put ``cat/a-x/y.jpg`` before ``cat/a.jpg``: sample i was another file than
    torchvision's, which breaks saved index lists and splits. The reference is torchvision's
    ``make_dataset``: ``sorted(os.walk(...))``, each folder's names sorted."""
    from threadloader import ImageFolder

    for name in ("cat/z.jpg", "cat/a.jpg", "cat/b/x.jpg", "cat/a-x/y.jpg", "cat/a-x/deep/w.png", "dog/c.jpg"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    reference = [
        (os.path.join(root, name), target)
        for target, cls in enumerate(["cat", "dog"])
        for root, _, names in sorted(os.walk(tmp_path / cls, followlinks=True))
        for name in sorted(names)
    ]
    assert ImageFolder(tmp_path).samples == reference
    assert reference[:2] == [(str(tmp_path / "cat" / "a.jpg"), 0), (str(tmp_path / "cat" / "z.jpg"), 0)]


def test_a_class_folder_without_images_is_refused_unless_allowed(tmp_path: Path) -> None:
    """A stray '.ipynb_checkpoints' folder became class 0 with no samples: every real class's target
    shifted by one, where torchvision's ImageFolder raises."""
    from threadloader import ImageFolder

    for name in ("cat/1.jpg", "dog/2.jpg", "bird/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / ".ipynb_checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match=r"'\.ipynb_checkpoints', 'bird'; .* allow_empty=True"):
        ImageFolder(tmp_path)
    with pytest.raises(FileNotFoundError, match="'bird'"):
        ThreadLoader(str(tmp_path), batch_size=1, device="cpu")
    kept = ImageFolder(tmp_path, allow_empty=True)
    assert kept.classes == [".ipynb_checkpoints", "bird", "cat", "dog"]  # torchvision's with allow_empty
    assert kept.samples == [(str(tmp_path / "cat" / "1.jpg"), 2), (str(tmp_path / "dog" / "2.jpg"), 3)]


def test_a_home_relative_root_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """'~/data' was 'does not exist'; torchvision's datasets expand it."""
    from threadloader import ImageFolder

    (tmp_path / "data" / "cat").mkdir(parents=True)
    (tmp_path / "data" / "cat" / "1.jpg").write_bytes(encode(photo(8, 8)))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ImageFolder("~/data").samples == [(str(tmp_path / "data" / "cat" / "1.jpg"), 0)]
    with ThreadLoader("~/data", batch_size=1, device="cpu") as loader:
        assert len(loader) == 1
    with pytest.raises(NotADirectoryError, match="'/no/such/place' does not exist"):
        ImageFolder("/no/such/place")


def test_a_folder_of_tar_shards_is_told_the_glob(tmp_path: Path) -> None:
    """A folder of shards was told to pass a list of file paths."""
    (tmp_path / "000000.tar").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"for a folder of tar shards pass '.*/\*\.tar'"):
        ThreadLoader(str(tmp_path), batch_size=1, device="cpu")


def test_a_released_memoryview_in_a_list_is_its_samples_error() -> None:
    """Naming its sample's decode failure read the released view's size, which raised: the pass ended
    with a bare ValueError, on_error="skip" or not."""
    good = [encode(photo(8, 6, seed), "PNG") for seed in (1, 2)]
    released = memoryview(bytearray(good[0]))
    released.release()
    source = [(good[0], 0), (released, 1), (good[1], 2)]
    with pytest.raises(SampleError) as caught:
        list(ThreadLoader(source, batch_size=3, device="cpu"))
    assert (caught.value.index, caught.value.stage) == (1, "decode")
    assert "released memoryview" in caught.value.origin
    with ThreadLoader(source, batch_size=3, device="cpu", on_error="skip") as loader:
        ((images, targets),) = list(loader)
    assert targets.tolist() == [0, 2]
    for image, data in zip(images, good, strict=True):  # Pillow, plainly: the reference
        assert image.permute(1, 2, 0).numpy().tolist() == np.array(Image.open(io.BytesIO(data))).tolist()
