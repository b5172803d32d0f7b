"""gpufeed.batch: the one rule for the samples in a batch (what the loader counts for
resumption, bench and watch for their rates), the tensor walker and its bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpufeed.batch import Batch, batch_len, batch_nbytes, iter_tensors


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
