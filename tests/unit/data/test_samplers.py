import numpy as np
import pytest

from gpufeed.data.order import block_shuffle_order
from gpufeed.data.samplers import BlockShuffleSampler, SortedBatchSampler


@pytest.mark.parametrize("n", [0, 1, 7, 1000, 1001, 4099])
@pytest.mark.parametrize("block_size,buffer_blocks", [(1, 1), (16, 4), (64, 2), (5000, 3)])
def test_permutation_every_index_once(n, block_size, buffer_blocks):
    order = block_shuffle_order(n, block_size=block_size, buffer_blocks=buffer_blocks, seed=3)
    assert order.dtype == np.int64
    assert np.array_equal(np.sort(order), np.arange(n))


def test_deterministic_per_seed_and_epoch():
    kw = dict(block_size=32, buffer_blocks=4)
    a = block_shuffle_order(5000, seed=1, epoch=2, **kw)
    assert np.array_equal(a, block_shuffle_order(5000, seed=1, epoch=2, **kw))
    assert not np.array_equal(a, block_shuffle_order(5000, seed=1, epoch=3, **kw))
    assert not np.array_equal(a, block_shuffle_order(5000, seed=2, epoch=2, **kw))
    assert not np.array_equal(a, block_shuffle_order(5000, seed=2, epoch=1, **kw))


def test_windows_touch_only_buffer_blocks_and_mix_them():
    bs, buf, n = 100, 4, 10_000
    order = block_shuffle_order(n, block_size=bs, buffer_blocks=buf, seed=0, epoch=0)
    window = bs * buf
    for w in range(n // window):
        chunk = order[w * window : (w + 1) * window]
        assert len(np.unique(chunk // bs)) == buf  # each window reads exactly `buf` blocks
    # inside a window the blocks are interleaved, not read one after another
    first = order[:window] // bs
    assert np.count_nonzero(np.diff(first)) > window // 2
    # and the block order is not the identity
    assert not np.array_equal(order, np.arange(n))


def test_locality_beats_uniform_shuffle():
    n, bs = 20_000, 256
    order = block_shuffle_order(n, block_size=bs, buffer_blocks=8, seed=0)
    uniform = np.random.default_rng(0).permutation(n)

    # distinct 256-sample regions touched by each batch of 64
    def regions(o):
        return [len(np.unique(o[i : i + 64] // bs)) for i in range(0, n, 64)]

    # a batch straddling two windows touches at most both windows' blocks
    assert max(regions(order)) <= 16 and np.mean(regions(order)) < 9
    assert np.mean(regions(uniform)) > 40


def test_sampler_epochs_and_iter_from():
    s = BlockShuffleSampler(1000, block_size=10, buffer_blocks=3, seed=5)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    assert sorted(e0) == sorted(e1) == list(range(1000)) and e0 != e1
    assert list(s.iter_from(250)) == e1[250:]
    assert len(s) == 1000
    assert list(BlockShuffleSampler(10, shuffle=False)) == list(range(10))
    with pytest.raises(ValueError, match="block_size"):
        BlockShuffleSampler(10, block_size=0)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sorted_batch_sampler(drop_last):
    s = BlockShuffleSampler(103, block_size=8, seed=1)
    bsamp = SortedBatchSampler(s, 10, drop_last=drop_last)
    batches = list(bsamp)
    assert len(batches) == len(bsamp) == (10 if drop_last else 11)
    assert all(b == sorted(b) for b in batches)
    flat = [i for b in batches for i in b]
    order = list(s)
    # same batch membership as the sampler's order, only sorted inside each batch
    assert [sorted(order[i : i + 10]) for i in range(0, len(flat), 10)] == batches
    bsamp.start = 30
    assert list(bsamp) == batches[3:]
    unsorted = SortedBatchSampler(s, 10, sort=False)
    assert [i for b in unsorted for i in b] == order[: len(order)]


def test_sorted_batch_sampler_start_with_plain_sampler():
    b = SortedBatchSampler(range(25), 10)
    b.start = 10
    assert list(b) == [list(range(10, 20)), list(range(20, 25))]
    assert len(b) == 2


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("start", [0, 7, 96])
@pytest.mark.parametrize("sort", [False, True])
def test_sorted_batch_sampler_array_path_equals_the_index_loop(drop_last, start, sort):
    sampler = BlockShuffleSampler(101, block_size=8, buffer_blocks=3, seed=4, epoch=2)
    fast = SortedBatchSampler(sampler, 10, drop_last=drop_last, sort=sort)
    slow = SortedBatchSampler(list(sampler), 10, drop_last=drop_last, sort=sort)  # no order()
    fast.start = slow.start = start
    got, want = list(fast), list(slow)
    assert got == want and len(got) == len(fast)
    assert all(type(i) is int for b in got for i in b)
