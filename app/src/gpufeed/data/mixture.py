"""Weighted mixtures of map-style datasets: ``gpufeed.mix``.

An epoch of ``mix(datasets, weights, samples_per_epoch=N, seed=s)`` holds ``N`` draws;
source ``i`` (``L_i`` samples) gets ``n_i`` of them: ``w_i * N`` rounded by largest
remainder (floors first, the remaining draws to the largest fractional parts, ties to the
earlier source), so the counts add up to exactly ``N`` (default ``N = sum(L_i)``).

Which samples, for ``n_i = q * L_i + r`` (``0 <= r < L_i``):

- every sample of the source ``q`` times (q whole passes), and
- ``r`` more from the source's *walk*: permutations of the source, one after another
  (pass p seeded by (seed, i, p)); epoch ``e`` takes walk positions ``[e*r, (e+1)*r)``.
  Where an epoch's slice runs from one pass into the next, the next pass puts the samples
  the slice already took last, so no sample repeats within an epoch.

So within an epoch each sample of a source is drawn ``q`` or ``q + 1`` times (equally often
within one); an upsampled source (``n_i >= L_i``) is whole in every epoch; a downsampled
one (``n_i < L_i``) walks through its source across epochs, every sample once a pass
before any repeats (MosaicML Streaming's ``choose``; its ``repeat`` is ``q``). LitData's
``CombinedStreamingDataset`` draws each sample's source at random by the weights (counts
vary from epoch to epoch), torchdata's ``MultiNodeWeightedSampler`` likewise; here the
counts are exact and the walk is deterministic for (seed, epoch).

Index ``j`` of an epoch is draw ``k`` of one source: the sources' draws are interleaved
evenly over ``0..N-1`` (draw k of source i at about ``(k + 0.5) * N / n_i``), so a
contiguous block of indices (make_loader's block shuffle) holds each source in its
proportion, and a source's q whole passes read its samples in storage order.

The order of an epoch is the sampler's (``make_loader(shuffle=True)``, DataLoader's
``shuffle=True``, DistributedSampler): ranks, resume and elastic resume come from it. The
epoch's draws come from ``set_epoch(epoch)``, which make_loader calls in every worker (and
persistent ones) as it does for gpufeed's datasets; with a plain DataLoader call
``mixture.set_epoch(e)`` before iterating (non-persistent workers see it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from gpufeed.data.reading import PythonIndexing, as_index_array
from gpufeed.data.tokens import TokenWindows
from gpufeed.errors import UsageError

__all__ = ["Mixture", "mix", "split_counts"]


def mix(
    datasets: Sequence | Mapping[str, Any],
    weights: Sequence[float] | Mapping[str, float],
    *,
    samples_per_epoch: int | None = None,
    seed: int = 0,
    source_field: str | None = None,
) -> Mixture:
    """A map-style dataset drawing each of ``datasets`` in its weight's proportion (module
    docstring: the exact rule).

    Args:
        datasets: map-style datasets, a list or a dict name -> dataset.
        weights: one weight per dataset (a list, or a dict with the same names), >= 0, not
            all 0; normalised to sum to 1.
        samples_per_epoch: draws per epoch (default: the datasets' total length).
        seed: picks the walk of downsampled sources' samples (with the epoch).
        source_field: the dict form: each sample (a dict) gets this key, holding its
            source's name.

    Returns:
        A Mixture (``set_epoch``, ``counts()``, ``sources()``).

    Raises:
        UsageError: weights that do not match the datasets, negative or all zero; a source
            drawn from but empty; source_field without names.
    """
    names, sources, w = _named(datasets, weights)
    return Mixture(names, sources, w, samples_per_epoch, seed, source_field)


def _named(datasets, weights) -> tuple[list[str], list, np.ndarray]:
    if isinstance(datasets, Mapping):
        names = [str(n) for n in datasets]
        sources = list(datasets.values())
        if not isinstance(weights, Mapping) or set(map(str, weights)) != set(names):
            raise UsageError(
                f"mix: weights must be a dict with the datasets' names {names}, got {weights!r}"
            )
        weights = [weights[n] for n in datasets]
    else:
        sources = list(datasets)
        names = [str(i) for i in range(len(sources))]
        if isinstance(weights, Mapping) or len(weights) != len(sources):
            raise UsageError(f"mix: give one weight per dataset ({len(sources)}), got {weights!r}")
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError):
        raise UsageError(f"mix: weights must be numbers, got {weights!r}") from None
    if not sources or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise UsageError(f"mix: weights must be >= 0 and not all 0, got {list(weights)}")
    return names, sources, w / w.sum()


def split_counts(weights: np.ndarray, total: int) -> np.ndarray:
    """``weights * total`` rounded so that the counts add up to ``total`` (largest
    remainder; ties to the earlier source)."""
    exact = weights * total
    counts = np.floor(exact).astype(np.int64)
    left = int(total - counts.sum())
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:left]] += 1
    return counts


class Mixture(PythonIndexing, Dataset):
    """The map-style dataset ``gpufeed.mix`` returns (module docstring)."""

    def __init__(self, names, sources, weights, samples_per_epoch, seed, source_field):
        self.names, self.sources, self.weights = names, sources, weights
        self.lengths = np.array([len(s) for s in sources], dtype=np.int64)
        total = int(self.lengths.sum()) if samples_per_epoch is None else samples_per_epoch
        if isinstance(total, bool) or not isinstance(total, (int, np.integer)) or total < 0:
            raise UsageError(f"mix: samples_per_epoch must be an integer >= 0, got {total!r}")
        self.draws = split_counts(weights, int(total))
        drawn = zip(names, self.draws, self.lengths, strict=True)
        empty = [n for n, d, ln in drawn if d and not ln]
        if empty:
            raise UsageError(f"mix: source {empty[0]!r} is empty but has weight > 0")
        self.seed, self.source_field = int(seed), source_field
        self.source_of, self.draw_of = _interleave(self.draws)
        self.epoch = 0
        self._walks: dict[int, _Walk] = {}
        self.windows = _same_windows(sources)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose draws the indices name (make_loader calls it in every worker)."""
        self.epoch = int(epoch)

    def counts(self, indices=None) -> dict[str, int]:
        """Draws from each source: name -> count, in an epoch (the same every epoch), or
        among ``indices`` (one rank's share, the batches seen so far: which source an index
        draws from does not change with the epoch)."""
        if indices is None:
            drawn = self.draws
        else:
            idx = as_index_array(indices, len(self), "mixture")
            drawn = np.bincount(self.source_of[idx], minlength=len(self.names))
        return dict(zip(self.names, drawn.tolist(), strict=True))

    def __len__(self) -> int:
        return len(self.source_of)

    def locate(self, indices) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample in it) of each index, in this epoch."""
        idx = as_index_array(indices, len(self), "mixture")
        src = self.source_of[idx].astype(np.int64)
        local = np.empty(len(idx), dtype=np.int64)
        for _, at, samples in self._groups(idx):
            local[at] = samples
        return src, local

    def _groups(self, idx: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per source drawn by the (checked) indices ``idx``: (source, positions in idx,
        its samples there, in this epoch)."""
        src = self.source_of[idx]
        drawn = np.flatnonzero(np.bincount(src, minlength=len(self.sources)))
        groups = []
        for i in drawn.tolist():
            at = np.flatnonzero(src == i)
            groups.append((i, at, self._sample(i, self.draw_of[idx[at]])))
        return groups

    def _sample(self, i: int, k: np.ndarray) -> np.ndarray:
        L, n = int(self.lengths[i]), int(self.draws[i])
        whole = (n // L) * L
        out = k % L
        extra = k >= whole
        if extra.any():
            out[extra] = self._walk(i).slice(self.epoch, n - whole)[k[extra] - whole]
        return out

    def _walk(self, i: int) -> _Walk:
        if i not in self._walks:
            self._walks[i] = _Walk(self.seed, i, int(self.lengths[i]))
        return self._walks[i]

    def __getitems__(self, indices) -> list:
        """The samples at ``indices``: one batched read per source, every source's reads
        started before any is waited on; token windows of one shape copied into one array
        (_gather_windows)."""
        groups = self._groups(as_index_array(indices, len(self), "mixture"))
        count = sum(len(at) for _, at, _ in groups)
        if self.windows:
            return self._gather_windows(groups, count)
        for i, _, samples in groups:  # every source's reads started before any waits
            read_ahead = getattr(self.sources[i], "read_ahead", None)
            if callable(read_ahead):
                read_ahead(samples.tolist())
        out: list = [None] * count
        for i, at, samples in groups:
            got = _fetch(self.sources[i], samples.tolist())
            for j, sample in zip(at.tolist(), got, strict=True):
                out[j] = self._tagged(sample, i)
        return out

    def _gather_windows(self, groups, count: int) -> list:
        """Sources that are all TokenWindows of one shape: each source's windows planned and
        their reads started, then copied into one [W, B] array (one gather per source, no
        per-sample reassembly), whose rows are the items."""
        plans = []
        for i, at, samples in groups:
            plan = self.sources[i].plan(samples, checked=True)
            self.sources[i].start(plan)
            plans.append((self.sources[i], at, plan))
        out = self.sources[0].new_rows(count)
        spans = np.empty(count, dtype=np.int64)  # tokens in each window
        for source, at, plan in plans:
            source.fill(plan, out, at)
            spans[at] = plan.hi - plan.lo
        items = self.sources[0].as_items(out, spans)
        if self.source_field is None:
            return items
        src = np.empty(count, dtype=np.int64)
        for i, at, _ in groups:
            src[at] = i
        return [self._tagged(x, i) for x, i in zip(items, src.tolist(), strict=True)]

    def _tagged(self, sample, i: int):
        if self.source_field is None:
            return sample
        if not isinstance(sample, dict):
            raise UsageError(
                f"mix: source_field={self.source_field!r} tags dict samples; source "
                f"{self.names[i]!r} gives {type(sample).__name__}: leave source_field out "
                "(counts() gives the draws per source)"
            )
        return {**sample, self.source_field: self.names[i]}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_walks"] = {}  # a pass is a permutation of its source: made again where read
        return state

    def close(self) -> None:
        """Close every source that can be closed (their readers, maps)."""
        for source in self.sources:
            close = getattr(source, "close", None)
            if callable(close):
                close()

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}: {d}" for n, d in zip(self.names, self.draws.tolist(), strict=True))
        return f"Mixture({len(self)} samples an epoch: {parts}; seed {self.seed})"


def _same_windows(sources) -> bool:
    """Whether every source is token windows of one shape, dtype, kind and padding (their
    windows can share one array: Mixture._gather_windows)."""
    if not sources or not all(isinstance(s, TokenWindows) for s in sources):
        return False
    shape = {(s.block_size, s.dtype, s.boundaries, s.pad_id) for s in sources}
    return len(shape) == 1


def _fetch(dataset, indices: list[int]) -> list:
    getitems = getattr(dataset, "__getitems__", None)
    return list(getitems(indices)) if getitems else [dataset[i] for i in indices]


def _interleave(draws: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, draw number) of each index: each source's draws spread evenly."""
    src = np.repeat(np.arange(len(draws)), draws)
    k = np.concatenate([np.arange(n, dtype=np.int64) for n in draws.tolist()] or [[]])
    k = k.astype(np.int64)
    key = (k + 0.5) / np.maximum(draws[src], 1)
    order = np.lexsort((src, key))
    kind = np.uint8 if len(draws) <= 255 else np.int64
    return src[order].astype(kind), k[order]


class _Walk:
    """One source's walk (module docstring): passes are permutations seeded by
    (seed, source, pass); a pass moves the samples the slice crossing into it already took
    to its end. Computed pass by pass, the last ones kept (epochs go forward)."""

    def __init__(self, seed: int, source: int, length: int):
        self.seed, self.source, self.length = seed, source, length
        self.passes: dict[int, np.ndarray] = {}
        self._last: tuple | None = None

    def slice(self, epoch: int, r: int) -> np.ndarray:
        """Walk positions [epoch * r, (epoch + 1) * r) (the last epoch's kept)."""
        if self._last is not None and self._last[0] == (epoch, r):
            return self._last[1]
        lo, hi, L = epoch * r, (epoch + 1) * r, self.length
        pieces = []
        while lo < hi:
            p = lo // L
            end = min(hi, (p + 1) * L)
            pieces.append(self._pass(p, r)[lo - p * L : end - p * L])
            lo = end
        out = np.concatenate(pieces)
        self._last = ((epoch, r), out)
        return out

    def _pass(self, p: int, r: int) -> np.ndarray:
        if p in self.passes:
            return self.passes[p]
        q = max([q for q in self.passes if q < p], default=-1)
        prev = self.passes.get(q)
        while q < p:
            q += 1
            prev = self._next(q, prev, r)
            self.passes[q] = prev
        self.passes = {k: v for k, v in self.passes.items() if k >= p - 1}
        return prev

    def _next(self, p: int, prev: np.ndarray | None, r: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.source, p])
        perm = rng.permutation(self.length)
        if prev is None:
            return perm
        L = self.length
        s = (p * L - 1) // r  # the epoch slice holding pass p - 1's last position
        taken = prev[s * r - (p - 1) * L :] if s * r + r > p * L else prev[:0]
        if not len(taken):
            return perm
        moved = np.isin(perm, taken)
        return np.concatenate((perm[~moved], perm[moved]))
