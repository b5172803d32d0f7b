"""gpufeed-jpeg (app/native) and gpufeed.native_jpeg: crop-aware batch JPEG decode + resize +
flip without the GIL, against torchvision's RandomResizedCrop pixels for the same boxes.

The reference is torchvision (decode_jpeg, then transforms.v2.functional.resized_crop with
antialias and horizontal_flip) where it imports, as in the images; elsewhere (this host's
torch has no matching torchvision) the same two steps it takes: libjpeg-turbo's decode through
Pillow and torch's antialiased bilinear interpolate on the uint8 image, the kernel that
resized_crop calls for uint8 tensors."""

from __future__ import annotations

import io
import os
import resource
import subprocess
import sys
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.data import native_jpeg
from gpufeed.data.decoders import RandomResizedCrop

if os.environ.get("CI"):  # CI builds it (make venv): a missing module is a failure there
    import gpufeed_jpeg as gj
else:
    gj = pytest.importorskip("gpufeed_jpeg", reason="pip install ./app/native")


def _picture(rng, h, w, channels=3):
    small = rng.integers(0, 256, (max(h // 8, 1), max(w // 8, 1), 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.int16)
    img = np.clip(img + rng.integers(-12, 13, img.shape, dtype=np.int16), 0, 255)
    return img.astype(np.uint8)[:, :, :channels].squeeze(-1 if channels == 1 else ())


def _jpeg(arr, mode=None, **options) -> bytes:
    buf = io.BytesIO()
    img = Image.fromarray(arr)
    (img.convert(mode) if mode else img).save(buf, format="JPEG", **options)
    return buf.getvalue()


def _corpus() -> dict[str, bytes]:
    rng = np.random.default_rng(16)
    return {
        "64x64 4:2:0 q90 (the suite's)": _jpeg(_picture(rng, 64, 64), quality=90),
        "375x500 4:2:0": _jpeg(_picture(rng, 375, 500), quality=90),
        "4:4:4": _jpeg(_picture(rng, 61, 83), quality=95, subsampling=0),
        "4:2:2": _jpeg(_picture(rng, 70, 99), quality=90, subsampling=1),
        "progressive": _jpeg(_picture(rng, 120, 90), quality=85, progressive=True),
        "grey": _jpeg(_picture(rng, 77, 91, channels=1)),
        "CMYK (Adobe)": _jpeg(_picture(rng, 50, 70), mode="CMYK", quality=90),
        "restart markers": _jpeg(_picture(rng, 90, 120), quality=90, restart_marker_blocks=3),
        "1x1": _jpeg(_picture(rng, 1, 1)),
        "17x23": _jpeg(_picture(rng, 17, 23), quality=95),
    }


CORPUS = _corpus()


def _reference(data: bytes, box, size, flip: bool) -> np.ndarray:
    """torchvision's pixels for this box: HWC uint8."""
    top, left, h, w = (int(v) for v in box)
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
        from torchvision.transforms.v2 import functional as F

        img = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB)
        out = F.resized_crop(img, top, left, h, w, list(size), antialias=True)
        out = F.horizontal_flip(out) if flip else out
    except ImportError:
        with Image.open(io.BytesIO(data)) as im:
            img = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        out = img[None, :, top : top + h, left : left + w]
        if (h, w) != tuple(size):
            out = torch.nn.functional.interpolate(out, size=size, mode="bilinear", antialias=True)
        out = out[0].flip(-1) if flip else out[0]
    return out.permute(1, 2, 0).numpy()


def _random_boxes(rng, height, width, n):
    """Boxes anywhere, edges and corners included, of any size from 1x1 to the whole image."""
    h = rng.integers(1, height + 1, n)
    w = rng.integers(1, width + 1, n)
    top = (rng.random(n) * (height - h + 1)).astype(np.int64)
    left = (rng.random(n) * (width - w + 1)).astype(np.int64)
    edge = rng.random(n) < 0.3  # pinned to the bottom-right corner
    top[edge], left[edge] = height - h[edge], width - w[edge]
    return np.stack([top, left, h, w], axis=1).astype(np.int64)


def _decode(payloads, boxes, flips, size, **kw):
    out = np.empty((len(payloads), *size, 3), dtype=np.uint8)
    failed = gj.decode_crops(payloads, np.asarray(boxes), np.asarray(flips), out, **kw)
    return out, failed


def _edge_boxes(height, width):
    """The boxes where an off-by-one hides: 1 pixel wide, 1 high and 1x1 on every edge, in
    the middle and at odd offsets, and boxes that reach the right and bottom edges."""
    mid_y, mid_x = height // 2, width // 2
    odd_y, odd_x = min(1, height - 1), min(1, width - 1)
    boxes = [(0, 0, height, width)]  # the whole picture
    for left in (0, odd_x, mid_x, width - 1):
        boxes += [(0, left, height, 1), (mid_y, left, height - mid_y, 1)]  # 1 wide
    for top in (0, odd_y, mid_y, height - 1):
        boxes += [(top, 0, 1, width), (top, mid_x, 1, width - mid_x)]  # 1 high
    for top in (0, odd_y, mid_y, height - 1):
        boxes += [(top, left, 1, 1) for left in (0, odd_x, mid_x, width - 1)]  # 1x1
    boxes += [
        (mid_y, mid_x, height - mid_y, width - mid_x),  # to the bottom-right corner
        (odd_y, odd_x, height - odd_y, width - odd_x),  # odd offsets, to both edges
        (0, mid_x, height, width - mid_x),  # the right half
        (mid_y, 0, height - mid_y, width),  # the bottom half
        (odd_y, odd_x, min(2, height - odd_y), min(2, width - odd_x)),  # 2x2 at an odd offset
    ]
    return np.asarray(boxes, dtype=np.int64)


# Enlarged, shrunk, and enlarged along one axis while shrunk along the other (the
# antialiasing filter's support differs per axis), for every picture in CORPUS.
SIZES = [(56, 56), (24, 40), (1, 1), (5, 64), (64, 5)]


@pytest.mark.parametrize("name", list(CORPUS))
@pytest.mark.parametrize("size", SIZES)
def test_pixels_are_torchvisions_for_the_same_box(name, size):
    data = CORPUS[name]
    height, width = gj.image_sizes([data])[0][0]
    # a seed of the parameters that every process computes alike (str hash() does not)
    rng = np.random.default_rng(zlib.crc32(repr((name, size)).encode()))
    edges = _edge_boxes(height, width)
    boxes = np.concatenate([edges, edges, _random_boxes(rng, height, width, 40)])
    flips = np.concatenate([np.zeros(len(edges), bool), np.ones(len(edges), bool)])
    flips = np.concatenate([flips, rng.random(40) < 0.5])
    out, failed = _decode([data] * len(boxes), boxes, flips, size, threads=2)
    assert failed == []
    diffs = [
        int(np.abs(out[i].astype(int) - _reference(data, boxes[i], size, flips[i])).max())
        for i in range(len(boxes))
    ]
    worst = [(d, boxes[i].tolist(), bool(flips[i])) for i, d in enumerate(diffs) if d > 1]
    assert not worst, (name, size, "(max diff, [top, left, h, w], flip)", worst)


@pytest.mark.parametrize("backend", ["native", "opencv", "torch"])
@pytest.mark.parametrize("name", list(CORPUS))
def test_every_backend_gives_torchvisions_pixels_for_the_edge_boxes(name, backend):
    """RandomResizedCrop's backends (native, the images' default; opencv, its fallback;
    torch) for the boxes of _edge_boxes at every size of SIZES, mirrored and not."""
    data = CORPUS[name]
    height, width = gj.image_sizes([data])[0][0]
    boxes = _edge_boxes(height, width)
    worst = []
    for size in SIZES:
        for flip in (False, True):
            crop = RandomResizedCrop(size, flip=float(flip), backend=backend)
            crop.crop_boxes = lambda heights, widths: boxes  # these boxes, not random draws
            batch, kept, failed = crop([data] * len(boxes))
            assert failed == [] and kept == list(range(len(boxes)))
            for box, got in zip(boxes, batch.permute(0, 2, 3, 1).numpy(), strict=True):
                diff = int(np.abs(got.astype(int) - _reference(data, box, size, flip)).max())
                if diff > 1:
                    worst.append((diff, size, box.tolist(), flip))
    assert not worst, (name, backend, "(max diff, size, [top, left, h, w], flip)", worst)


def test_dct_scaling_is_an_explicit_trade_measured_here():
    """DCT scaling (libjpeg-turbo's 1/2, 1/4, 1/8 IDCT) is another shrinking filter: not
    torchvision's pixels, so never the default. Its difference on ImageNet-like boxes (a
    375x500 picture, boxes of at least 2x the output) stays small on average."""
    data = CORPUS["375x500 4:2:0"]
    rng = np.random.default_rng(5)
    boxes = _random_boxes(rng, 375, 500, 64)
    boxes[:, 2:] = np.maximum(boxes[:, 2:], 120)  # every box >= 2x the 56x56 output
    boxes[:, 0] = np.minimum(boxes[:, 0], 375 - boxes[:, 2])
    boxes[:, 1] = np.minimum(boxes[:, 1], 500 - boxes[:, 3])
    flips = np.zeros(64, dtype=bool)
    exact, _ = _decode([data] * 64, boxes, flips, (56, 56))
    scaled, failed = _decode([data] * 64, boxes, flips, (56, 56), dct_scaling=True)
    assert failed == []
    ref = np.stack([_reference(data, b, (56, 56), False) for b in boxes]).astype(int)
    assert np.abs(exact.astype(int) - ref).max() <= 1
    err = np.abs(scaled.astype(int) - ref)
    assert err.max() > 1  # it is a different filter: the option really changes the decode
    assert err.mean() < 3.0, err.mean()  # docs/jpeg.md gives the measured mean and max


def test_corrupt_jpegs_fail_alone_and_name_the_problem():
    good = CORPUS["64x64 4:2:0 q90 (the suite's)"]
    truncated = good[: len(good) // 2]
    sof = good.index(b"\xff\xc0")
    no_width = good[: sof + 7] + b"\0\0" + good[sof + 9 :]  # SOF0: 64 rows of 0 pixels
    payloads = [good, truncated, b"\xff\xd8 not really", no_width, b"GIF89a", good]
    sizes, problems = gj.image_sizes(payloads)
    problems = dict(problems)
    assert problems.keys() == {2, 3, 4}  # the truncated one has its header: found on decode
    assert "not a JPEG" in problems[4] and "corrupt JPEG" in problems[2]
    assert "Empty JPEG image" in problems[3]
    assert sizes[0].tolist() == [64, 64] and sizes[2].tolist() == [-1, -1]
    boxes = np.tile([0, 0, 64, 64], (6, 1))
    boxes[[2, 4]] = (0, 0, 1, 1)
    out, failed = _decode(payloads, boxes, np.zeros(6, bool), (8, 8), threads=3)
    failed = dict(failed)
    assert set(failed) == {1, 2, 3, 4}, failed
    assert "premature end" in failed[1].lower()
    assert (out[[1, 2, 3, 4]] == 0).all()  # zeroed, never stale or half-written
    assert np.array_equal(out[0], out[5]) and out[0].any()


def test_a_box_outside_the_image_is_that_samples_error():
    data = CORPUS["17x23"]
    out, failed = _decode([data, data], [(0, 0, 17, 23), (10, 0, 8, 23)], [False, False], (4, 4))
    assert [i for i, _ in failed] == [1] and "not inside the 17x23 image" in failed[0][1]


def _header_variants(data: bytes, rng) -> list[bytes]:
    """`data` cut short anywhere in its header, with header bytes garbled, and with the
    markers a plain header does not have (fill bytes, a 12-bit frame, a lossless frame, a
    16-bit table, an EOI before the scan, its scan's components out of order)."""
    sos = data.index(b"\xff\xda")
    sof = next(data.index(m) for m in (b"\xff\xc0", b"\xff\xc2") if m in data)
    out = [data[:k] for k in range(sos + 16)]
    for _ in range(400):
        b = bytearray(data)
        for pos in rng.integers(0, sos + 14, rng.integers(1, 3)):
            b[pos] = rng.integers(0, 256) if rng.random() < 0.7 else b[pos] ^ 1 << rng.integers(8)
        out.append(bytes(b))
    dqt = data.index(b"\xff\xdb")
    out += [
        data[:2] + b"\xff\xff" + data[2:],  # a fill byte
        data[:2] + b"\x00" + data[2:],  # a stray byte
        data[: sof + 4] + b"\x0c" + data[sof + 5 :],  # 12-bit
        data[: sof + 1] + b"\xc3" + data[sof + 2 :],  # lossless
        data[: dqt + 4] + bytes([data[dqt + 4] | 0x10]) + data[dqt + 5 :],  # 16-bit table
        data[:sos] + b"\xff\xd9" + data[sos:],  # EOI before the scan
    ]
    n = data[sos + 4]
    if n > 1:  # the scan names its components last to first
        comps = [data[sos + 5 + 2 * i : sos + 7 + 2 * i] for i in range(n)]
        out.append(data[: sos + 5] + b"".join(reversed(comps)) + data[sos + 5 + 2 * n :])
    return out


@pytest.mark.skipif(
    not hasattr(gj, "scan_sizes") and not os.environ.get("CI"),
    reason="this gpufeed_jpeg predates the header walk: rebuild app/native",
)
def test_the_marker_scan_reads_libjpegs_sizes():
    """image_sizes walks the markers of a plain header itself and asks libjpeg's
    jpeg_read_header only about the rest: each size it reads must be libjpeg's, and every
    answer (size or problem) the same as libjpeg's alone."""
    assert (gj.scan_sizes(list(CORPUS.values())) >= 1).all()  # it reads every plain header
    rng = np.random.default_rng(5)
    payloads = [v for data in CORPUS.values() for v in _header_variants(data, rng)]
    scanned = gj.scan_sizes(payloads)
    libjpeg, problems = gj.image_sizes(payloads, scan=False)
    read = scanned[:, 0] >= 0
    assert 0.3 < read.mean() < 0.9  # the variants take both ways
    assert np.array_equal(scanned[read], libjpeg[read])
    assert not read[[i for i, _ in problems]].any()
    for threads in (1, 3):
        sizes, found = gj.image_sizes(payloads, threads)
        assert np.array_equal(sizes, libjpeg) and found == problems


def test_thread_counts_give_identical_batches():
    rng = np.random.default_rng(3)
    payloads = [CORPUS[k] for k in CORPUS for _ in range(6)]
    sizes, _ = gj.image_sizes(payloads)
    boxes = np.concatenate([_random_boxes(rng, h, w, 1) for h, w in sizes])
    flips = rng.random(len(payloads)) < 0.5
    first, _ = _decode(payloads, boxes, flips, (32, 32), threads=1)
    for threads in (2, 3, 8, 200):
        again, failed = _decode(payloads, boxes, flips, (32, 32), threads=threads)
        assert failed == [] and np.array_equal(first, again), threads


@pytest.mark.slow
def test_the_portable_resize_gives_the_same_pixels(tmp_path):
    """x86-64 takes an SSSE3 horizontal pass; other CPUs (GPUFEED_JPEG_PORTABLE=1 forces it
    here) a portable one: both the same integer arithmetic, so the same bytes."""
    payloads = [CORPUS[k] for k in CORPUS] * 2
    sizes, _ = gj.image_sizes(payloads)
    rng = np.random.default_rng(9)
    boxes = np.concatenate([_random_boxes(rng, h, w, 1) for h, w in sizes])
    flips = rng.random(len(payloads)) < 0.5
    np.save(tmp_path / "boxes.npy", boxes)
    np.save(tmp_path / "flips.npy", flips)
    here, _ = _decode(payloads, boxes, flips, (30, 41))
    script = (
        "import sys, numpy as np, test_native_jpeg as t\n"
        "d = sys.argv[1]\n"
        "payloads = [t.CORPUS[k] for k in t.CORPUS] * 2\n"
        "out, _ = t._decode(payloads, np.load(d + '/boxes.npy'), np.load(d + '/flips.npy'),"
        " (30, 41))\n"
        "np.save(d + '/portable.npy', out)\n"
    )
    env = dict(os.environ, GPUFEED_JPEG_PORTABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-c", script, str(tmp_path)], env=env, check=True)
    assert np.array_equal(here, np.load(tmp_path / "portable.npy"))


def test_the_gil_is_released_while_it_decodes():
    """A pure-Python counter keeps counting while another thread is inside decode_crops: held
    GIL, it would stand still for the whole call."""
    data = CORPUS["375x500 4:2:0"]
    n = 48
    boxes, flips = np.tile([0, 0, 375, 500], (n, 1)), np.zeros(n, bool)
    out = np.empty((n, 224, 224, 3), np.uint8)
    count, stop = [0], threading.Event()

    def counter():
        while not stop.is_set():
            count[0] += 1

    def counted(fn):
        count[0] = 0
        stop.clear()
        t = threading.Thread(target=counter)
        t.start()
        started = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - started
        stop.set()
        t.join()
        return count[0] / elapsed

    gj.decode_crops([data] * n, boxes, flips, out)  # warm
    idle = counted(lambda: time.sleep(0.3))
    busy = counted(lambda: gj.decode_crops([data] * n, boxes, flips, out, threads=1))
    # held, the counter would not move at all during the call; released, it counts at a rate
    # that a loaded 2-core machine may cut several-fold: so a low bar, far above zero
    assert busy > 0.02 * idle, (busy, idle)


@pytest.mark.slow
def test_repeated_calls_do_not_grow_memory():
    payloads = [CORPUS[k] for k in CORPUS] * 8
    sizes, _ = gj.image_sizes(payloads)
    boxes = np.stack([[0, 0, h, w] for h, w in sizes]).astype(np.int64)
    flips = np.ones(len(payloads), bool)
    bad = [payloads[0][:300]] * 8  # the error path (longjmp out of libjpeg) too

    def rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    for _ in range(20):
        _decode(payloads, boxes, flips, (40, 40), threads=2)
        _decode(bad, boxes[:8], flips[:8], (40, 40), threads=2)
    before = rss_mb()
    for _ in range(300):
        _decode(payloads, boxes, flips, (40, 40), threads=2)
        _decode(bad, boxes[:8], flips[:8], (40, 40), threads=2)
    assert rss_mb() - before < 8, (before, rss_mb())


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(out=np.empty((2, 4, 4, 4), np.uint8)), "shape"),
        (dict(out=np.empty((2, 4, 4, 3), np.float32)), "uint8"),
        (dict(out=np.empty((2, 4, 4, 3), np.uint8)[:, ::2]), "C-contiguous"),
        (dict(out=np.empty((1, 4, 4, 3), np.uint8)), "need 2"),
        (dict(boxes=np.zeros((2, 3), np.int64)), "boxes"),
        (dict(mirror=np.zeros(3, bool)), "mirror"),
        (dict(threads=0), "threads"),
    ],
)
def test_bad_arguments_are_named(bad, match):
    args = dict(
        payloads=[CORPUS["1x1"]] * 2,
        boxes=np.tile([0, 0, 1, 1], (2, 1)),
        mirror=np.zeros(2, bool),
        out=np.empty((2, 4, 4, 3), np.uint8),
    )
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        gj.decode_crops(**args)


# ------------------------------------------------------------------ gpufeed.native_jpeg


def _seeded(fn, seed=11):
    torch.manual_seed(seed)
    return fn()


def test_wrapper_matches_the_torch_backend_for_the_same_seed():
    payloads = [CORPUS[k] for k in CORPUS] * 3
    crop = RandomResizedCrop((20, 28), memory_format=torch.contiguous_format)
    torch_crop = RandomResizedCrop((20, 28), backend="torch")
    batch, kept, failed = _seeded(lambda: native_jpeg.decode_resized_crops(payloads, crop))
    want, want_kept, _ = _seeded(lambda: torch_crop(payloads))
    assert failed == [] and kept == want_kept == list(range(len(payloads)))
    assert batch.shape == want.shape and batch.is_contiguous()
    assert (batch.int() - want.int()).abs().max() <= 1


def test_wrapper_takes_pngs_and_reports_corrupt_samples(tmp_path):
    png = io.BytesIO()
    Image.fromarray(_picture(np.random.default_rng(0), 30, 20)).save(png, format="PNG")
    good = CORPUS["4:2:2"]
    payloads = [good, png.getvalue(), good[:400], b"junk", good]
    crop = RandomResizedCrop(12, flip=0)
    batch, kept, failed = _seeded(lambda: native_jpeg.decode_resized_crops(payloads, crop))
    assert kept == [0, 1, 4] and [i for i, _ in failed] == [2, 3]
    assert all(p.startswith("cannot decode: ") for _, p in failed)
    assert batch.shape == (3, 3, 12, 12) and batch.is_contiguous(memory_format=torch.channels_last)
    # The truncated JPEG's header reads, so it fails only while decoding, after the boxes were
    # drawn; the torch backend drops it before. The first two boxes are the same draws.
    ref, ref_kept, _ = _seeded(lambda: RandomResizedCrop(12, flip=0, backend="torch")(payloads))
    assert ref_kept == [0, 1, 4]
    assert (batch[:2].int() - ref[:2].int()).abs().max() <= 1


def test_wrapper_resizes_a_png_to_1x1():
    """A 1x1 output is contiguous in both layouts: torch's uint8 kernel failed an internal
    assert on it (decoders.resize_antialiased gives it a channels_last source)."""
    pixels = _picture(np.random.default_rng(4), 30, 20)
    png = io.BytesIO()
    Image.fromarray(pixels).save(png, format="PNG")
    crop = RandomResizedCrop(1, scale=(1, 1), ratio=(2 / 3, 2 / 3), flip=0)  # the whole image
    batch, kept, failed = native_jpeg.decode_resized_crops([png.getvalue()], crop)
    assert kept == [0] and failed == []
    want = torch.nn.functional.interpolate(
        torch.from_numpy(pixels).permute(2, 0, 1)[None].float(),
        size=(1, 1),
        antialias=True,
        mode="bilinear",
    )
    assert (batch.flatten().int() - want.flatten().round().int()).abs().max() <= 1


def test_status_names_the_backend_or_why_not(monkeypatch):
    assert native_jpeg.available() and "libjpeg-turbo" in native_jpeg.status()
    monkeypatch.setattr(native_jpeg, "jpeg_module", lambda: (None, "gpufeed-jpeg is not installed"))
    assert not native_jpeg.available()
    with pytest.raises(RuntimeError, match="not installed"):
        native_jpeg.decode_resized_crops([b""], RandomResizedCrop(4))
