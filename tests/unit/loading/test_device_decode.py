"""JPEG decode on the device (loading/device_decode.py): where it runs, and the CPU fallback
giving the batches the datasets' own decoder gives. No GPU here: the selection is tested with
torch's and torchvision's answers swapped in, the batched path (torchvision's decode_jpeg on a
list, the crop and resize on the tensor's device) runs on the CPU where torchvision imports
(the images), and the GPU itself is not measured here (tests/gpu/smoke.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.errors import UsageError
from gpufeed.loading import device_decode
from gpufeed.loading.device_decode import DeviceDecode, decode_device


@pytest.fixture(scope="module")
def jpeg_pack(pack_factory):
    return pack_factory("mmap", "jpegs")


def test_where_a_batch_is_decoded(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert decode_device(cpu) == cpu and decode_device(cpu, "cpu") == cpu
    with pytest.raises(UsageError, match="decode_on='cuda' needs the GPU JPEG decoder, but"):
        decode_device(cpu, "cuda")
    with pytest.raises(ValueError, match="decode_on must be one of"):
        decode_device(cpu, "gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, as torch sees it
    monkeypatch.setattr(device_decode, "gpu_jpeg_decoder", lambda: (lambda *a, **k: [], None))
    assert decode_device(gpu) == gpu and decode_device(gpu, "cuda") == gpu
    assert decode_device(gpu, "cpu") == cpu  # overridden
    monkeypatch.setattr(device_decode, "gpu_jpeg_decoder", lambda: (None, "no torchvision"))
    assert decode_device(gpu) == cpu  # the CPU fallback
    with pytest.raises(UsageError, match="no torchvision"):
        decode_device(gpu, "cuda")


def _epoch(loader, prefetch=None):
    torch.manual_seed(3)
    batches = prefetch if prefetch is not None else loader
    return [(x.clone(), y.clone()) for x, y in batches]


def test_the_cpu_fallback_gives_the_datasets_own_batches(jpeg_pack):
    crop = gpufeed.RandomResizedCrop(8, scale=(0.3, 1.0))
    decoded = gpufeed.make_loader(gpufeed.open_dataset(jpeg_pack, decode=crop), 4, num_workers=0)
    encoded = gpufeed.make_loader(gpufeed.open_dataset(jpeg_pack, decode=False), 4, num_workers=0)
    prefetch = gpufeed.DevicePrefetcher(encoded, "cpu", decode=crop, dtype=None)
    assert prefetch.decode.device.type == "cpu" and not prefetch.decode.batched
    want, got = _epoch(decoded), _epoch(encoded, prefetch)
    assert len(got) == len(want) == 4
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert gx.dtype == torch.uint8 and gx.shape[1:] == (3, 8, 8)
        assert torch.equal(gx, wx) and torch.equal(gy, wy)


def test_a_refused_batch_is_decoded_the_cpu_way_with_its_labels(jpeg_pack, monkeypatch):
    ds = gpufeed.open_dataset(jpeg_pack, decode=False)
    batch = ds.get_batch([0, 1, 2, 3])
    batch.samples[1] = torch.tensor([1, 2, 3], dtype=torch.uint8)  # not an image
    monkeypatch.setattr(device_decode, "gpu_jpeg_decoder", lambda: (None, "refused"))
    dec = DeviceDecode(gpufeed.RandomResizedCrop(6), torch.device("cpu"), batched=True)
    with pytest.warns(UserWarning, match="refused a batch"):
        x, y = dec(batch)
    assert dec.fallbacks == 1 and x.shape == (3, 3, 6, 6)
    assert y.tolist() == batch.labels[[0, 2, 3]].tolist()  # the corrupt one dropped
    assert dec(gpufeed.Batch(torch.zeros(2, 3), torch.zeros(2))).samples.shape == (2, 3)


def test_the_batched_path_gives_the_cpu_decoders_pixels(jpeg_pack):
    """What runs on the GPU, run on the CPU: same boxes and flips from the same draws, the
    pixels of torch's antialiased resize computed exactly (float64), and within 1 of the CPU
    decoder's (whose uint8 kernels round in fixed point)."""
    pytest.importorskip("torchvision.io", reason="torchvision (the images carry it)")
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    crop = gpufeed.RandomResizedCrop(12, scale=(0.2, 1.0), memory_format=torch.contiguous_format)
    ds = gpufeed.open_dataset(jpeg_pack, decode=False)
    batch = ds.get_batch(list(range(len(ds))))
    dec = DeviceDecode(crop, torch.device("cpu"), batched=True)
    torch.manual_seed(9)
    x, y = dec(batch)
    torch.manual_seed(9)
    want, kept, _ = crop([p.numpy() for p in batch.samples])
    assert dec.fallbacks == 0 and kept == list(range(len(ds)))
    assert x.shape == want.shape and torch.equal(y, batch.labels)
    assert (x.int() - want.int()).abs().max() <= 1
    torch.manual_seed(9)
    images = [decode_jpeg(p, mode=ImageReadMode.RGB) for p in batch.samples]
    sizes = np.array([img.shape[1:] for img in images])
    boxes = crop.crop_boxes(sizes[:, 0], sizes[:, 1]).tolist()
    flips = torch.rand(len(images)) < crop.flip
    assert 0 < int(flips.sum()) < len(images)  # both kinds in the batch
    exact = torch.stack(
        [
            F.resized_crop(img.double(), t, le, h, w, [12, 12], antialias=True)
            for img, (t, le, h, w) in zip(images, boxes, strict=True)
        ]
    )
    exact[flips] = exact[flips].flip(-1)
    diff = (x.int() - exact.round().clamp(0, 255).int()).abs()
    assert diff.max() <= 1 and np.mean(diff.numpy() > 0) < 0.005


def test_batched_resize_weights_are_torchs():
    """aa_weights against torch's own kernel: a one-hot input row per position gives the
    weights column by column, for shrinking, enlarging and equal sizes."""
    from gpufeed.loading.batch_resize import aa_weights

    for extent, out in ((37, 12), (5, 12), (12, 12), (500, 224)):
        eye = torch.eye(extent, dtype=torch.float64)[None]  # [1, extent, extent]
        want = (
            torch.nn.functional.interpolate(
                eye, size=out, mode="linear", align_corners=False, antialias=False
            )
            if extent <= out
            else None
        )
        got = aa_weights(torch.tensor([extent]), out, extent + 3)[0].numpy()
        assert got.shape == (out, extent + 3) and not got[:, extent:].any()
        assert np.allclose(got.sum(axis=1), 1.0, atol=1e-6)
        ref = torch.nn.functional.interpolate(
            eye[:, :, None, :], size=(1, out), mode="bilinear", antialias=True
        )[0, :, 0, :].T.numpy()  # ref[i, j]: output i's weight on input j
        assert np.allclose(got[:, :extent], ref, atol=1e-6), (extent, out)
        if want is not None:  # enlarging: antialias changes nothing
            assert np.allclose(got[:, :extent], want[0].T.numpy(), atol=1e-6)


def test_batched_resize_flips_and_bounds_its_chunks(monkeypatch):
    from gpufeed.loading import batch_resize

    rng = np.random.default_rng(0)
    images = [
        torch.from_numpy(rng.integers(0, 256, (3, h, w), dtype=np.uint8))
        for h, w in ((20, 30), (31, 17), (8, 8))
    ]
    boxes = np.array([[2, 3, 15, 20], [0, 0, 31, 17], [1, 1, 6, 7]])
    plain = torch.empty((3, 3, 10, 10), dtype=torch.uint8)
    batch_resize.resized_crops(images, boxes, np.zeros(3, bool), plain)
    flipped = torch.empty_like(plain)
    batch_resize.resized_crops(images, boxes, np.array([True, False, True]), flipped)
    assert torch.equal(flipped[0], plain[0].flip(-1)) and torch.equal(flipped[1], plain[1])
    assert torch.equal(flipped[2], plain[2].flip(-1)) and not torch.equal(flipped, plain)
    monkeypatch.setattr(batch_resize, "CHUNK_BYTES", 1)  # one image per product
    chunked = torch.empty_like(plain)
    batch_resize.resized_crops(images, boxes, np.zeros(3, bool), chunked)
    # another batch size may sum in another order: float rounding, at most 1 after uint8
    assert (chunked.int() - plain.int()).abs().max() <= 1
    empty = torch.empty((0, 3, 10, 10), dtype=torch.uint8)
    assert batch_resize.resized_crops([], np.zeros((0, 4)), np.zeros(0, bool), empty) is empty


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_pixels_are_torchvisions_gpu_pipelines(jpeg_pack):
    """nvJPEG's pixels differ from libjpeg-turbo's (docs/jpeg.md): on the GPU the reference
    is torchvision's own GPU decode + resized_crop + flip for the same boxes and flips."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    crop = gpufeed.RandomResizedCrop(12, scale=(0.2, 1.0), memory_format=torch.contiguous_format)
    batch = gpufeed.open_dataset(jpeg_pack, decode=False).get_batch(list(range(13)))
    dev = torch.device("cuda")
    dec = DeviceDecode(crop, dev)
    assert dec.batched
    torch.manual_seed(3)
    x, y = dec(batch)
    torch.manual_seed(3)
    images = decode_jpeg(list(batch.samples), mode=ImageReadMode.RGB, device=dev)
    sizes = np.array([img.shape[1:] for img in images])
    boxes = crop.crop_boxes(sizes[:, 0], sizes[:, 1]).tolist()
    flips = torch.rand(len(images)) < crop.flip
    want = torch.stack(
        [
            F.resized_crop(img, t, le, h, w, [12, 12], antialias=True)
            for img, (t, le, h, w) in zip(images, boxes, strict=True)
        ]
    )
    want[flips.to(dev)] = want[flips.to(dev)].flip(-1)
    assert x.device.type == "cuda" and dec.fallbacks == 0 and torch.equal(y.cpu(), batch.labels)
    diff = (x.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.05
