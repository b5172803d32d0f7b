"""Token windows in the peers, written and read as their users do (bench/tokens.py's rows).

- LitData, as litgpt pretrains: ``litdata.optimize(fn, inputs, output_dir, chunk_bytes,
  item_loader=TokensLoader())`` with ``fn`` yielding each document's token array, then
  ``StreamingDataset(output_dir, item_loader=TokensLoader(block_size=B), shuffle=True,
  drop_last=True)`` in a ``StreamingDataLoader``. Its windows are the chunk's concatenated
  documents cut into B (a window never spans chunks); its shuffle is the chunks' order and a
  permutation within each chunk.
- MosaicML Streaming, as llm-foundry does (``convert_dataset_hf --concat_tokens B``): MDS
  has no window reader, so the stream is cut into windows when written, one sample each
  (``{"tokens": ndarray:uint16:B}``), and ``StreamingDataset(local=..., shuffle=True,
  batch_size=...)`` reads sample i as window i (``torch.from_numpy(sample["tokens"])`` in a
  ``__getitem__`` of a subclass, as StreamingTextDataset does), in a torch DataLoader.

Both read from the documents of the token stream bench/tokens.py wrote (``train.bin`` and
the lengths of its documents): the same tokens as gpufeed's pack.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import numpy as np

DOCS_PER_INPUT = 2048  # documents an optimize input yields


def unavailable(peer: str) -> str | None:
    """Why ``peer`` ("litdata", "mds") cannot run here, or None."""
    try:
        if peer == "litdata":
            import litdata  # noqa: F401
        else:
            import streaming  # noqa: F401
    except ImportError as e:
        return f"{e} (the peers are in the bench image: make bench-image)"
    return None


class _Documents:
    """optimize's fn: input (first, last document) -> each document's tokens (uint16)."""

    def __init__(self, flat: Path, starts: np.ndarray):
        self.flat, self.starts = str(flat), starts

    def __call__(self, span):
        data = np.memmap(self.flat, dtype=np.uint16, mode="r")
        for d in range(*span):
            yield np.array(data[self.starts[d] : self.starts[d + 1]])


def write_litdata(out: Path, flat: Path, starts: np.ndarray, workers: int = 2) -> None:
    import litdata
    from litdata import TokensLoader

    docs = len(starts) - 1
    inputs = [(lo, min(lo + DOCS_PER_INPUT, docs)) for lo in range(0, docs, DOCS_PER_INPUT)]
    litdata.optimize(
        fn=_Documents(flat, starts),
        inputs=inputs,
        output_dir=str(out),
        chunk_bytes="64MB",
        item_loader=TokensLoader(),
        num_workers=workers,
        verbose=False,
    )
    # optimize sets the start method for everyone (spawn); the rows' DataLoaders fork, as
    # Linux's default
    multiprocessing.set_start_method("fork", force=True)


def litdata_loader(out: Path, block: int, batch: int, workers: int, seed: int):
    import litdata
    from litdata import TokensLoader

    ds = litdata.StreamingDataset(
        str(out),
        item_loader=TokensLoader(block_size=block),
        shuffle=True,
        drop_last=True,
        seed=seed,
    )
    return litdata.StreamingDataLoader(ds, batch_size=batch, num_workers=workers)


def write_mds(out: Path, flat: Path, block: int) -> None:
    from streaming import MDSWriter

    data = np.memmap(flat, dtype=np.uint16, mode="r")
    windows = len(data) // block
    with MDSWriter(out=str(out), columns={"tokens": f"ndarray:uint16:{block}"}) as w:
        for i in range(windows):
            w.write({"tokens": np.array(data[i * block : (i + 1) * block])})


def mds_loader(out: Path, batch: int, workers: int, seed: int):
    import torch
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = _mds_windows()(local=str(out), shuffle=True, shuffle_seed=seed + 1, batch_size=batch)
    return torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers)


_WINDOWS = None


def _mds_windows():
    """The MDS dataset class whose item is a window tensor, made once (module level, so
    workers can unpickle it; streaming imported only where it is installed)."""
    global _WINDOWS
    if _WINDOWS is None:
        import streaming
        import torch

        class Windows(streaming.StreamingDataset):
            def __getitem__(self, index):
                return torch.from_numpy(super().__getitem__(index)["tokens"].copy())

        Windows.__qualname__ = Windows.__name__ = "MDSWindows"
        _WINDOWS = Windows
    return _WINDOWS


def __getattr__(name: str):
    if name == "MDSWindows":  # what a spawned worker unpickles
        return _mds_windows()
    raise AttributeError(name)
