"""gpufeed.RandomResizedCrop: decode + crop + resize + flip fused over a batch, with the same
sampling as torchvision's RandomResizedCrop and the same antialiased resize, in both backends
(opencv: simplejpeg + cv2.resize for enlarged boxes; torch: torchvision's kernels)."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch
from unit_sources import pack_with_broken_jpeg

import gpufeed
from gpufeed.data import decoders, native_jpeg
from gpufeed.data.decoders import RandomResizedCrop, decode_image
from gpufeed.errors import CorruptSampleError, UsageError


@pytest.fixture(scope="module")
def jpeg_pack(pack_factory):
    return pack_factory("mmap", "jpegs")


# CI builds gpufeed-jpeg (make venv): there a missing native decoder fails these tests
NATIVE = native_jpeg.available() or bool(os.environ.get("CI"))
BACKENDS = ["torch", "opencv"] + (["native"] if NATIVE else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", [(10, 12), (31, 40)])  # shrinks, enlarges the whole picture
def test_whole_image_crop_is_the_antialiased_resize(jpeg_pack, backend, size):
    plain = gpufeed.open_dataset(jpeg_pack)
    fused = gpufeed.open_dataset(
        jpeg_pack,
        decode=RandomResizedCrop(size, scale=(1, 1), ratio=(1.2, 1.2), flip=0, backend=backend),
    )
    idx = [0, 5, 12]
    x, y = fused.get_batch(idx)
    assert x.shape == (3, 3, *size) and x.dtype == torch.uint8
    assert x.is_contiguous(memory_format=torch.channels_last)  # the default, either backend
    assert torch.equal(y, plain.get_batch(idx).labels)
    for j, i in enumerate(idx):
        img = plain[i][0]  # 20x24 images: ratio 1.2, so scale 1 crops the whole picture
        want = torch.nn.functional.interpolate(
            img[None].float(), size=size, mode="bilinear", antialias=True
        )
        diff = (x[j].float() - want[0]).abs()
        assert diff.max() <= 1, diff.max()  # uint8 kernel vs float kernel: rounding only


@pytest.mark.parametrize("backend", BACKENDS)
def test_flip_mirrors_the_same_crop(jpeg_pack, backend):
    def batch(flip):
        random.seed(3)
        torch.manual_seed(3)
        decode = RandomResizedCrop(8, flip=flip, backend=backend)
        return gpufeed.open_dataset(jpeg_pack, decode=decode).get_batch(list(range(13))).samples

    assert torch.equal(batch(1.0), batch(0.0).flip(-1))
    random.seed(3)
    torch.manual_seed(3)
    half = gpufeed.open_dataset(jpeg_pack, decode=RandomResizedCrop(8, backend=backend)).get_batch(
        list(range(13))
    )
    same = [torch.equal(a, b) for a, b in zip(half.samples, batch(0.0), strict=True)]
    assert 0 < sum(same) < 13  # some flipped, some not


def test_crop_boxes_follow_torchvision_sampling():
    rrc = RandomResizedCrop(8, scale=(0.2, 0.6), ratio=(0.5, 2.0))
    torch.manual_seed(0)
    top, left, h, w = rrc.crop_boxes(np.full(2000, 60), np.full(2000, 80)).T
    assert (top >= 0).all() and (top + h <= 60).all() and (left >= 0).all()
    assert (left + w <= 80).all()
    areas, aspects = h * w / (60 * 80), w / h
    # rounding to whole pixels moves the bounds by a little
    assert areas.min() >= 0.18 and areas.max() <= 0.63
    assert aspects.min() >= 0.45 and aspects.max() <= 2.1
    assert abs(np.median(np.log(aspects))) < 0.1  # log-uniform ratio: centred on 1
    assert len(set(top.tolist())) > 20 and len(set(left.tolist())) > 20  # positions vary
    # an image too narrow for any try: the centre crop with the ratio clamped
    assert RandomResizedCrop(8, scale=(1, 1), ratio=(1, 1)).crop_box(100, 10) == (45, 0, 10, 10)
    # each image of a batch by its own size
    boxes = RandomResizedCrop(8, scale=(1, 1), ratio=(1, 1)).crop_boxes([100, 7], [10, 30])
    assert boxes.tolist() == [[45, 0, 10, 10], [0, 11, 7, 7]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupt_image_named_or_skipped(tmp_path, backend):
    dest = pack_with_broken_jpeg(tmp_path)
    decode = RandomResizedCrop(4, backend=backend)
    with pytest.raises(CorruptSampleError, match=r"encoded.npy: sample 1 .*cannot decode"):
        gpufeed.open_dataset(dest, decode=decode).get_batch([0, 1, 2])
    ds = gpufeed.open_dataset(dest, decode=decode, on_error="skip")
    with pytest.warns(UserWarning, match="skipping corrupt"):
        out = ds.get_batch([0, 1, 2])
    assert out.samples.shape == (2, 3, 4, 4) and ds.skipped == 1
    assert out.labels.tolist() == [0, 0]


def test_array_packs_refuse_an_image_decoder(array_folder, tmp_path):
    dest = tmp_path / "a.mmap"
    gpufeed.pack(array_folder, dest, format="mmap", workers=1, quiet=True)
    with pytest.raises(UsageError, match="holds array samples"):
        gpufeed.open_dataset(dest, decode=RandomResizedCrop(4))


@pytest.mark.parametrize(
    "bad", [dict(size=0), dict(size=4, scale=(0.5, 0.1)), dict(size=4, flip=2)]
)
def test_bad_settings_are_named(bad):
    with pytest.raises(ValueError, match="size|scale|flip"):
        RandomResizedCrop(**bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loader_with_workers_is_reproducible_per_seed_and_epoch(jpeg_pack, backend):
    def epoch(seed, e):
        ds = gpufeed.open_dataset(jpeg_pack, decode=RandomResizedCrop(6, backend=backend))
        loader = gpufeed.make_loader(ds, 4, shuffle=True, seed=seed, num_workers=2)
        loader.set_epoch(e)
        return torch.cat([x for x, _ in loader])

    a = epoch(1, 0)
    assert a.shape == (13, 3, 6, 6)
    assert torch.equal(a, epoch(1, 0))
    assert not torch.equal(a, epoch(1, 1))
    assert not torch.equal(a, epoch(2, 0))


def test_decode_image_still_gives_the_full_picture(jpeg_pack):
    ds = gpufeed.open_dataset(jpeg_pack)
    payload = ds.reader.read_batch(np.array([0]))[0]
    assert decode_image(payload).shape == (3, 20, 24)


def test_backends_give_the_same_pixels_for_the_same_boxes(jpeg_pack):
    """Same seeds, same boxes and flips: the opencv backend's bilinear (enlarging) and
    torchvision's kernel (shrinking) against torchvision's kernel everywhere."""

    def batch(backend):
        random.seed(7)
        torch.manual_seed(7)
        decode = RandomResizedCrop(16, scale=(0.2, 1.0), backend=backend)
        ds = gpufeed.open_dataset(jpeg_pack, decode=decode)
        return torch.cat([ds.get_batch(list(range(13))).samples for _ in range(8)])

    exact = batch("torch")
    for backend in set(BACKENDS) - {"torch"}:
        fast = batch(backend)
        assert fast.shape == exact.shape == (104, 3, 16, 16)
        diff = (fast.int() - exact.int()).abs()
        assert diff.max() <= 1, (backend, diff.max())  # uint8 rounding, never another filter
        assert torch.equal(
            fast.contiguous(), fast.contiguous(memory_format=torch.contiguous_format)
        )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", [torch.channels_last, torch.contiguous_format])
def test_memory_format_is_the_same_whatever_backend(jpeg_pack, backend, layout):
    """One layout rule for both backends (it was channels_last with opencv, NCHW without),
    and dataset[i] / __getitems__ are the samples of the batch get_batch returns."""

    def dataset():
        # the whole 20x24 picture, unflipped: the same pixels whatever else is in the batch
        decode = RandomResizedCrop(
            7, scale=(1, 1), ratio=(1.2, 1.2), flip=0, backend=backend, memory_format=layout
        )
        return gpufeed.open_dataset(jpeg_pack, decode=decode)

    batch = dataset().get_batch([2, 0, 9])
    assert batch.samples.is_contiguous(memory_format=layout)
    assert f"memory_format={layout}" in repr(dataset().decode)
    samples = dataset().__getitems__([2, 0, 9])
    assert torch.equal(torch.stack([s for s, _ in samples]), batch.samples)
    assert [label for _, label in samples] == batch.labels.tolist()
    one = dataset()[2]
    assert one[0].shape == (3, 7, 7) and torch.equal(one[0], batch.samples[0])


def test_fast_backends_take_png_and_grayscale(tmp_path, make_images):
    from PIL import Image

    make_images(tmp_path / "s", {"a": 2}, size=(12, 10), ext=".png")
    Image.new("L", (10, 12), 77).save(tmp_path / "s" / "a" / "gray.jpg", quality=95)
    gpufeed.pack(tmp_path / "s", tmp_path / "d", format="lmdb", workers=1, quiet=True)

    def batch(backend):
        random.seed(1)
        torch.manual_seed(1)
        decode = RandomResizedCrop(6, backend=backend, memory_format=torch.contiguous_format)
        return gpufeed.open_dataset(tmp_path / "d", decode=decode).get_batch([0, 1, 2])

    exact = batch("torch")
    for backend in set(BACKENDS) - {"torch"}:
        fast = batch(backend)
        assert fast.samples.shape == (3, 3, 6, 6) and fast.samples.is_contiguous()
        assert (fast.samples.int() - exact.samples.int()).abs().max() <= 1
        assert torch.equal(fast.labels, exact.labels)


def test_backend_choice_and_missing_native_or_opencv(monkeypatch):
    first = "native" if NATIVE else "opencv"  # the test environment has cv2 and simplejpeg
    assert RandomResizedCrop(4).backend == first
    assert f"backend='{first}'" in repr(RandomResizedCrop(4))
    monkeypatch.setattr(decoders, "native_status", lambda: (False, "gpufeed-jpeg is missing"))
    with pytest.raises(ValueError, match="backend='native' needs gpufeed-jpeg: .* missing"):
        RandomResizedCrop(4, backend="native")
    assert RandomResizedCrop(4).backend == "opencv"
    assert repr(RandomResizedCrop(4, backend="torch")) != repr(RandomResizedCrop(4))
    with pytest.raises(ValueError, match="backend must be one of"):
        RandomResizedCrop(4, backend="pil")
    with pytest.raises(ValueError, match="memory_format"):
        RandomResizedCrop(4, memory_format=torch.preserve_format)
    monkeypatch.setattr(decoders, "opencv_backend", lambda: None)
    assert RandomResizedCrop(4).backend == "torch"
    with pytest.raises(ValueError, match=r"pip install 'gpufeed\[opencv\]'"):
        RandomResizedCrop(4, backend="opencv")


@pytest.mark.skipif(not NATIVE, reason="pip install ./app/native")
def test_native_threads_share_the_loader_cpus_among_its_processes(monkeypatch):
    from gpufeed.system import sysinfo

    monkeypatch.setattr(sysinfo, "usable_cpus", lambda *a: sysinfo.CpuBudget(8, None, 8, "test"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    crop = RandomResizedCrop(4, backend="native")
    assert [crop.threads_for(n) for n in (0, 1, 3, 16)] == [8, 8, 2, 1]
    assert crop.decoder_threads() == 8  # this process is no DataLoader worker
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this node: half each
    assert crop.threads_for(0) == 8  # the CPUs are read once per process
    sysinfo._process_loader_cpus.cache_clear()  # as a rank started with it reads them
    assert crop.threads_for(0) == 4
    assert RandomResizedCrop(4, backend="native", threads=3).threads_for(2) == 3
    assert RandomResizedCrop(4, backend="opencv").threads_for(0) == 1  # one image at a time
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    sysinfo._process_loader_cpus.cache_clear()

    class Threads(torch.utils.data.Dataset):  # what the decoder sizes itself to in a worker
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return crop.decoder_threads()

    seen = torch.utils.data.DataLoader(Threads(), batch_size=None, num_workers=2)
    assert list(seen) == [4, 4, 4, 4]  # forked workers: 8 CPUs // 2 workers
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            RandomResizedCrop(4, backend="native", threads=bad)


@pytest.mark.skipif(not NATIVE, reason="pip install ./app/native")
def test_the_plan_counts_decoder_threads_not_processes(jpeg_pack, monkeypatch):
    """A threaded decoder in-process already uses every CPU: workers split those CPUs, so
    the worker model must not divide the in-process time by the worker count again."""
    from gpufeed.loading.plan import decoder_threads, plan_workers
    from gpufeed.system import sysinfo

    monkeypatch.setattr(sysinfo, "usable_cpus", lambda *a: sysinfo.CpuBudget(4, None, 4, "test"))
    ds = gpufeed.open_dataset(jpeg_pack, decode=RandomResizedCrop(6, backend="native"))
    assert (decoder_threads(ds, 0), decoder_threads(ds, 3)) == (4, 1)
    assert decoder_threads(gpufeed.open_dataset(jpeg_pack), 0) == 1  # no batch decoder
    _, _, measured, _ = plan_workers(ds, 4, cpus=4, use_cache=False, budget_s=0.5)
    assert measured["decoder_threads_in_process"] == 4
    assert measured["decoder_threads_per_worker"] == 1
    modelled = measured.get("workers3_batches_per_s_model")
    if modelled is not None:  # the model: the same 4 CPUs decoding, plus the IPC
        assert modelled <= measured["in_process_batches_per_s"] * 1.0001
