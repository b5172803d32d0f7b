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
def jpeg_pack(tmp_path_factory, jpeg_folder):
    dest = tmp_path_factory.mktemp("devdec") / "ds.mmap"
    gpufeed.pack(jpeg_folder, dest, format="mmap", workers=1, quiet=True)
    return dest


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
    """What runs on the GPU, run on the CPU: same boxes and flips from the same draws."""
    pytest.importorskip("torchvision.io", reason="torchvision (the images carry it)")
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
    diff = (x.int() - want.int()).abs()
    assert diff.max() <= 1, diff.max()
    assert np.mean(diff.numpy() > 0) < 0.05
