"""Block-shuffled order: random-order epochs that still read storage in long runs.

A uniformly random permutation makes every read a seek. FFCV's quasi-random order instead
shuffles *blocks* of neighbouring indices, then shuffles the indices of a few consecutive
blocks together (the "buffer"), so each stretch of the epoch touches only ``buffer_blocks``
regions of the file while batches still mix samples from far-apart parts of the dataset.

numpy only (no torch: loader settings and tools read the defaults without it). Orders are
numpy arrays computed from ``(seed, epoch)`` alone, so every rank and every resumed
run computes the same order without communicating.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_BUFFER_BLOCKS", "block_shuffle_order"]

DEFAULT_BLOCK_SIZE = 256
DEFAULT_BUFFER_BLOCKS = 16


def _rng(seed: int, epoch: int) -> np.random.Generator:
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return np.random.default_rng([int(seed), int(epoch)])


def block_shuffle_order(
    n: int,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    buffer_blocks: int = DEFAULT_BUFFER_BLOCKS,
    seed: int = 0,
    epoch: int = 0,
) -> np.ndarray:
    """A permutation of ``range(n)`` (int64) in block-shuffled order.

    Blocks of ``block_size`` neighbouring indices are put in random order; then each window of
    ``buffer_blocks`` consecutive blocks is shuffled as a whole. ``block_size=1`` is a plain
    uniform permutation. Deterministic in ``(n, block_size, buffer_blocks, seed, epoch)``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if block_size < 1 or buffer_blocks < 1:
        raise ValueError(
            f"block_size and buffer_blocks must be >= 1, got {block_size}, {buffer_blocks}"
        )
    rng = _rng(seed, epoch)
    if n == 0:
        return np.empty(0, dtype=np.int64)
    n_blocks = -(-n // block_size)
    blocks = rng.permutation(n_blocks)
    order = (blocks[:, None] * block_size + np.arange(block_size)[None, :]).ravel()
    # window = position of the element's block in the shuffled block order // buffer_blocks,
    # so each window holds exactly `buffer_blocks` whole blocks even around the short last one
    windows = np.repeat(np.arange(n_blocks) // buffer_blocks, block_size)
    keep = order < n  # the last block may be short
    order, windows = order[keep], windows[keep]
    if buffer_blocks >= n_blocks:
        return rng.permutation(order)
    keys = rng.random(order.size)
    return order[np.lexsort((keys, windows))].astype(np.int64, copy=False)


def rank_slice(order: np.ndarray, rank: int, world: int, drop_last: bool) -> np.ndarray:
    """Rank ``rank``'s contiguous share of ``order`` over ``world`` ranks, all shares equal:
    padded by repeating the order's first indices (drop_last=False, as DistributedSampler
    does) or with the tail dropped (drop_last=True)."""
    n = len(order)
    per = n // world if drop_last else -(-n // world)
    total = per * world
    if total > n and n > 0:
        reps = -(-(total - n) // n)
        order = np.concatenate([order, np.tile(order, reps)[: total - n]])
    return order[rank * per : (rank + 1) * per]


def remaining_after(global_order: np.ndarray, world: int, per_rank: int, seen: int) -> np.ndarray:
    """The samples of an epoch not yet handed out after each of ``world`` ranks handed out
    the first ``seen`` of its contiguous ``per_rank`` slice of ``global_order``: each sample
    once, in global order (a checkpoint taken with ``world`` ranks, resumed with others)."""
    consumed = np.concatenate(
        [global_order[r * per_rank : r * per_rank + seen] for r in range(world)]
    )
    _, first = np.unique(global_order, return_index=True)
    every = global_order[np.sort(first)]
    return every[~np.isin(every, consumed)]
