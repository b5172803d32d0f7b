"""The folder path's JPEG check: a scaled native decode (gpufeed.write.items.jpeg_decodes)
where gpufeed-jpeg is installed, PIL's full decode for whatever it complains of; a JPEG
truncated anywhere, or corrupt, still fails the pack naming the file (or is skipped)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import gpufeed
import gpufeed.write.items as items
from gpufeed.errors import SourceError


def _jpeg(h: int = 240, w: int = 320) -> bytes:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _broken(data: bytes) -> dict[str, bytes]:
    """JPEGs PIL's full decode rejects (one missing only its end marker it may pass: the old
    check did not catch that, nor does this one)."""
    mid = len(data) // 2
    return {
        "header only": data[:300],
        "half": data[:mid],
        "last bytes cut": data[:-40],
        "garbage inside": data[:mid] + b"\xff" * 64 + data[mid + 64 :],
    }


needs_native = pytest.mark.skipif(
    items.jpeg_module()[0] is None, reason="gpufeed-jpeg (app/native) is not installed"
)


@needs_native
def test_the_scaled_native_decode_passes_good_and_fails_broken_jpegs():
    good = _jpeg()
    assert items.jpeg_decodes(good)
    assert items.jpeg_decodes(_jpeg(7, 5))  # smaller than an 8x8 block
    for what, data in _broken(good).items():
        assert not items.jpeg_decodes(data), what
    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    assert not items.jpeg_decodes(png.getvalue())  # a PNG named .jpg: PIL's to judge


@needs_native
def test_a_jpeg_the_native_check_passes_is_not_decoded_by_pil(tmp_path, monkeypatch):
    path = tmp_path / "a.jpg"
    path.write_bytes(_jpeg())

    def no_pil(*a, **k):
        raise AssertionError("PIL decoded a JPEG the native check passed")

    monkeypatch.setattr(Image, "open", no_pil)
    res = items.load_item(str(path), items.LoadOptions())
    assert res[0] == "ok" and res[2] == path.read_bytes()


@pytest.mark.parametrize("native", [True, False])
def test_a_broken_jpeg_fails_the_pack_naming_it_or_is_skipped(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr(items, "jpeg_module", lambda: (None, "not installed"))  # as without it
    good = _jpeg(64, 64)
    for what, data in _broken(good).items():
        root = tmp_path / what.replace(" ", "_") / "src"
        (root / "c").mkdir(parents=True)
        for i in range(3):
            (root / "c" / f"{i}.jpg").write_bytes(good)
        bad = root / "c" / "1.jpg"
        bad.write_bytes(data)
        with pytest.raises(SourceError, match=str(bad)):
            gpufeed.pack(root, root.parent / "o", format="tar", workers=1, quiet=True)
        m = gpufeed.pack(
            root, root.parent / "s", format="tar", workers=1, quiet=True, on_error="skip"
        )
        assert m["count"] == 2 and [s["path"] for s in m["skipped"]] == ["c/1.jpg"], what
