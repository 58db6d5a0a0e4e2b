import numpy as np

from threadloader.decode._jpeg import normalize_gray_sampling

from .conftest import encode, photo, pil_reference, with_gray_sampling


def test_gray_sampling_rewrite_is_exact() -> None:
    original = encode(photo(75, 100, 1), mode="L", quality=85)
    declared_2x2 = with_gray_sampling(original)
    assert declared_2x2 != original
    fixed = normalize_gray_sampling(declared_2x2)
    assert fixed == original
    np.testing.assert_array_equal(pil_reference(fixed), pil_reference(declared_2x2))


def test_other_files_are_returned_as_they_are() -> None:
    color = encode(photo(30, 40, 2), quality=90)
    gray = encode(photo(30, 40, 3), mode="L", quality=90)
    png = encode(photo(30, 40, 4), fmt="PNG")
    for data in (color, gray, png, b"", b"\xff\xd8", b"\xff\xd8\xff\xc0\x00"):
        assert normalize_gray_sampling(data) is data
