"""gpufeed.batch: the one rule for the samples in a batch (what the loader counts for
resumption, bench and watch for their rates), the tensor walker and its bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from unit_sources import write_images

import gpufeed
from gpufeed.batch import Batch, MixedSizeTensor, batch_len, batch_nbytes, collate, iter_tensors
from gpufeed.errors import UsageError


# watch's and bench's cases: a batch that does not say counts as one sample there
@pytest.mark.parametrize(
    "batch,n",
    [
        (Batch(torch.zeros(3, 1), torch.zeros(7)), 7),
        ((torch.zeros(5, 2), torch.zeros(5)), 5),
        ({"x": torch.zeros(6, 1)}, 6),
        ([[torch.zeros(2)]], 2),
        ([0.5] * 32, 32),
        ((["a", "b", "c"], torch.zeros(3)), 3),
        ("not a batch", 1),
    ],
)
def test_samples_per_batch(batch, n):
    assert (batch_len(batch) or 1) == n


def test_batch_size_of_shapes():
    assert batch_len(Batch(torch.zeros(5, 2), torch.zeros(5))) == 5
    assert batch_len({"x": torch.zeros(3, 1)}) == 3
    assert batch_len(([torch.zeros(2), torch.zeros(3)], torch.zeros(2))) == 2
    assert batch_nbytes((torch.zeros(2, 3, dtype=torch.uint8), torch.zeros(2))) == 6 + 8


def test_the_loaders_cases():
    # a list of samples (a collate_fn of yours that returns them as they are): its length
    samples = [(torch.zeros(3, 4, 4), i) for i in range(5)]
    assert batch_len(samples) == 5
    assert batch_len([torch.zeros(6, 2), torch.zeros(6)]) == 6  # default_collate's list
    assert batch_len(np.zeros((4, 2))) == 4  # arrays as tensors, no torch needed
    assert batch_len(torch.tensor(3)) is None  # a 0-d tensor says nothing (loader: batch_size)
    assert batch_len({}) is None and batch_len([]) is None


def test_iter_tensors_walks_nested_batches():
    x, y, a = torch.zeros(2, 3), torch.zeros(2), np.zeros((2, 5), dtype=np.uint8)
    found = list(iter_tensors({"x": [x, (y, "text")], "a": a}))
    assert [tuple(t.shape) for t in found] == [(2, 3), (2,), (2, 5)]
    assert found[2].data_ptr() == a.ctypes.data  # the array's memory, not a copy
    assert len(list(iter_tensors({"x": x, "a": a}, arrays=False))) == 1
    assert batch_nbytes({"x": x, "a": a}) == 2 * 3 * 4 + 10


# ------------------------------------------------- images of different sizes (issue 38 item 3)


@pytest.fixture(scope="module")
def mixed_size_pack(tmp_path_factory):
    """An ordinary image folder of JPEGs of two sizes, packed as it is (encoded)."""
    root = tmp_path_factory.mktemp("mixed")
    write_images(root / "src", {"a": 6}, size=(82, 71), ext=".jpg")
    write_images(root / "src", {"b": 6}, size=(40, 60), ext=".jpg", seed=1)
    gpufeed.pack(root / "src", root / "pack", format="lmdb", workers=1, quiet=True)
    return root / "pack"


def _says_what_to_do(text: str, pack) -> None:
    assert str(pack) in text and "differ in size" in text
    assert "[3, 82, 71]" in text and "[3, 40, 60]" in text
    assert "decode=gpufeed.RandomResizedCrop(224)" in text and "--encode raw --resize" in text


@pytest.mark.parametrize("workers", [0, 2])
def test_readme_dataloader_line_on_mixed_sizes_says_what_to_do(mixed_size_pack, workers):
    # the README's line: torch's default_collate failed with "Trying to resize storage that
    # is not resizable" (workers) or "stack expects each tensor to be equal size"
    ds = gpufeed.open_dataset(mixed_size_pack)
    loader = DataLoader(ds, batch_size=32, shuffle=True, num_workers=workers, pin_memory=True)
    with pytest.raises(UsageError) as err:
        next(iter(loader))
    _says_what_to_do(str(err.value), mixed_size_pack)


@pytest.mark.slow
def test_make_loader_on_mixed_sizes_raises_instead_of_lists(mixed_size_pack):
    ds = gpufeed.open_dataset(mixed_size_pack)
    with pytest.raises(UsageError) as err:
        ds.get_batch([0, 11])
    _says_what_to_do(str(err.value), mixed_size_pack)
    for workers in (0, "auto"):  # auto: its probe (at make_loader) must not hide it either
        with pytest.raises(UsageError) as err:
            next(iter(gpufeed.make_loader(ds, batch_size=12, num_workers=workers)))
        _says_what_to_do(str(err.value), mixed_size_pack)


def test_mixed_sizes_still_read_as_samples_and_crop_to_one_size(mixed_size_pack):
    ds = gpufeed.open_dataset(mixed_size_pack)
    a, b = ds[[0, 11]]
    assert a[0].shape == (3, 82, 71) and b[0].shape == (3, 40, 60)
    assert isinstance(a[0], MixedSizeTensor) and type(a[0] + 0) is torch.Tensor
    assert type(ds[0][0]) is torch.Tensor  # one sample (or sizes that agree): plain tensors
    images, labels = list(zip(*ds[[0, 11]], strict=True))  # a collate_fn that keeps lists
    assert labels == (0, 1) and images[1].shape == (3, 40, 60)
    with pytest.raises(UsageError, match="differ in size"):
        collate(ds[[0, 11]])
    same = ds.get_batch([0, 1])  # sizes that agree still stack
    assert same.samples.shape == (2, 3, 82, 71)
    crop = gpufeed.open_dataset(mixed_size_pack, decode=gpufeed.RandomResizedCrop(32))
    assert crop.get_batch([0, 11]).samples.shape == (2, 3, 32, 32)
