"""MosaicML Streaming (MDS), as its docs show: ``MDSWriter(out=..., columns=...)``, then
``StreamingDataset(local=..., shuffle=..., batch_size=B)`` in a torch DataLoader. Raw samples
are an ``ndarray`` column, JPEGs a ``jpeg`` column (the file's own bytes, decoded to PIL); the
fields case adds an ``ndarray:int32:32`` caption column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def unavailable() -> str | None:
    import streaming  # noqa: F401

    return None


def write(case, out: Path) -> None:
    from PIL import Image
    from streaming import MDSWriter

    from bench.data import load_raw

    labels = case.labels()
    kind = f"ndarray:uint8:{','.join(map(str, case.shape))}" if case.kind == "raw" else "jpeg"
    columns = {"x": kind, "y": "int"}
    captions = None
    if case.kind == "fields":
        captions = case.tokens()
        columns["caption"] = f"ndarray:int32:{captions.shape[1]}"
    with MDSWriter(out=str(out), columns=columns, size_limit="64mb") as w:
        for i, path in enumerate(case.files()):
            x = load_raw(path) if case.kind == "raw" else Image.open(path)
            sample = {"x": x, "y": int(labels[i])}
            if captions is not None:
                sample["caption"] = np.ascontiguousarray(captions[i])
            w.write(sample)


def batches(case, out: Path, *, shuffle: bool, workers: int, batch_size: int, seed: int = 0):
    import streaming
    from streaming.base.util import clean_stale_shared_memory

    from bench.data import Augment, to_chw_uint8

    clean_stale_shared_memory()
    aug = Augment(case.crop) if case.kind in ("jpeg", "fields") else None

    class Dataset(streaming.StreamingDataset):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            x = item["x"]
            x = aug(to_chw_uint8(x)) if aug is not None else torch.from_numpy(np.asarray(x))
            if "caption" in item:
                return x, torch.tensor(item["caption"]), item["y"]
            return x, item["y"]

    ds = Dataset(local=str(out), shuffle=shuffle, shuffle_seed=seed + 1, batch_size=batch_size)
    return torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
