"""``gpufeed bench --compare-plain``: the tutorial's plain DataLoader against make_loader on the
same pack, side by side in one run, and the DataLoader's own ceiling over samples held in
memory."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from gpufeed.tools.timing import epoch_after_epoch, stop_workers, time_batches

__all__ = ["IN_MEMORY_BYTES", "compare_plain", "format_compare"]


def compare_plain(
    path,
    *,
    batch_size: int = 32,
    workers: tuple[int, ...] = (0, 2),
    seconds: float = 3.0,
    rounds: int = 3,
    pin_memory: bool | None = None,
    dataset_options: Mapping[str, Any] | None = None,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    """samples/s of the tutorial's plain ``DataLoader(dataset, batch_size, shuffle=True,
    num_workers=N, pin_memory=...)`` (``__getitems__`` then torch's default_collate) and of
    ``make_loader`` with the same arguments (``get_batch``: one stacked read per batch), on
    the same pack, for each worker count: every loader built and warmed first, then
    ``rounds`` interleaved rounds of ``seconds`` each, the median per loader, so the ratios
    come from the same minutes of a shared machine. Workers are persistent in both, so the
    rates are steady state. A tar stream is read unshuffled by the DataLoader (PyTorch
    refuses shuffle=True for an IterableDataset) and by its own shuffle buffer.

    The same DataLoader also reads the first samples of the pack held in memory (up to
    IN_MEMORY_BYTES, as ``dataset[i]`` gives them: decoded): that line's own ceiling, its
    workers' per-batch traffic and the collate, with nothing left to read or decode. Where
    the plain DataLoader reads the pack near that rate, the DataLoader is the limit, not the
    storage. Map-style packs only.

    Args:
        path: the pack (anything ``open_dataset`` opens).
        batch_size: samples per batch, for both loaders.
        workers: the worker counts to compare at.
        seconds: each round's reading time per loader.
        rounds: interleaved rounds; the median per loader is reported.
        pin_memory: for both loaders (None: when CUDA is available).
        dataset_options: open_dataset's keyword arguments.
        log: called with each progress line.

    Returns:
        The comparison: path, dataset, batch_size, pin_memory, rounds, seconds_per_round,
        and per worker count the plain DataLoader's and make_loader's samples/s, their
        ratio and the in-memory line's samples/s (:func:`format_compare` prints it).
    """
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    from gpufeed.data.open import open_dataset
    from gpufeed.loading.make import make_loader

    dataset = open_dataset(path, **dict(dataset_options or {}))
    shuffle = None if isinstance(dataset, IterableDataset) else True
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    held = None if shuffle is None else _held_samples(dataset, IN_MEMORY_BYTES)
    loaders: dict[tuple[str, int], Iterable] = {}
    for w in workers:
        kw = dict(num_workers=w, pin_memory=pin, persistent_workers=w > 0)
        loaders["plain", w] = DataLoader(dataset, batch_size, shuffle, **kw)
        loaders["make_loader", w] = make_loader(dataset, batch_size, shuffle, **kw)
        if held is not None:
            loaders["in_memory", w] = DataLoader(held, batch_size, shuffle, **kw)

    rates: dict[tuple[str, int], list[float]] = {k: [] for k in loaders}
    try:
        for loader in loaders.values():  # start workers, open files, warm the page cache
            time_batches(epoch_after_epoch(loader), max_seconds=min(1.0, seconds))
        for r in range(rounds):
            for key, loader in loaders.items():
                rates[key].append(
                    time_batches(epoch_after_epoch(loader), max_seconds=seconds).samples_per_s
                )
            log(
                f"round {r + 1}/{rounds}: "
                + ", ".join(f"{k[0]}/{k[1]} {v[-1]:,.0f}" for k, v in rates.items())
            )
    finally:
        for loader in loaders.values():
            stop_workers(loader)
    out: dict[str, Any] = {
        "path": str(path),
        "dataset": repr(dataset),
        "batch_size": batch_size,
        "pin_memory": pin,
        "rounds": rounds,
        "seconds_per_round": seconds,
        "workers": {},
    }
    out["in_memory_samples"] = len(held) if held is not None else None
    for w in workers:
        plain = statistics.median(rates["plain", w])
        fast = statistics.median(rates["make_loader", w])
        out["workers"][w] = {
            "plain_samples_per_s": plain,
            "make_loader_samples_per_s": fast,
            "make_loader_vs_plain": fast / plain if plain > 0 else None,
            "in_memory_samples_per_s": (
                statistics.median(rates["in_memory", w]) if held is not None else None
            ),
        }
    return out


# What compare_plain holds in memory for the DataLoader's own ceiling: enough batches for
# steady rates, little against the memory a training run has
IN_MEMORY_BYTES = 256 << 20


class _Held:
    """Samples held in a list: a map-style dataset with no storage and no decode."""

    def __init__(self, samples: list):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def _held_samples(dataset, max_bytes: int) -> _Held:
    """The first samples of ``dataset`` (``dataset[i]``, as the DataLoader gets them) up to
    ``max_bytes`` of their tensors and arrays, at least one."""
    import numpy as np
    import torch

    def nbytes(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, np.ndarray):
            return x.nbytes
        if isinstance(x, (tuple, list)):
            return sum(map(nbytes, x))
        if isinstance(x, dict):
            return sum(map(nbytes, x.values()))
        return len(x) if isinstance(x, (bytes, str)) else 8

    samples, total = [], 0
    for i in range(len(dataset)):
        samples.append(dataset[i])
        total += nbytes(samples[-1])
        if total >= max_bytes:
            break
    return _Held(samples)


def format_compare(result: Mapping[str, Any]) -> str:
    """The comparison as a table.

    Args:
        result: what :func:`compare_plain` returned.

    Returns:
        The text: a heading, then one row per worker count.
    """
    lines = [
        f"{result['dataset']}, batch_size={result['batch_size']}, pin_memory="
        f"{result['pin_memory']}: median of {result['rounds']} interleaved rounds of "
        f"{result['seconds_per_round']:g} s",
        f"{'workers':>7}  {'DataLoader':>12}  {'make_loader':>12}  {'ratio':>6}"
        + (f"  {'DataLoader, in memory':>21}" if result.get("in_memory_samples") else ""),
    ]
    for w, row in result["workers"].items():
        ratio, held = row["make_loader_vs_plain"], row.get("in_memory_samples_per_s")
        lines.append(
            f"{w:>7}  {row['plain_samples_per_s']:>12,.0f}  "
            f"{row['make_loader_samples_per_s']:>12,.0f}  "
            + (f"{ratio:>5.2f}x" if ratio is not None else f"{'-':>6}")
            + (f"  {held:>21,.0f}" if held is not None else "")
        )
    lines.append("(samples/s; ratio: make_loader over the plain DataLoader, same pack, same run)")
    if result.get("in_memory_samples"):
        lines.append(
            f"(in memory: the same DataLoader over the pack's first {result['in_memory_samples']:,}"
            " samples held in a list, decoded: its own ceiling with nothing to read)"
        )
    return "\n".join(lines)
