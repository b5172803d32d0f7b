"""LitData, as its README shows: ``litdata.optimize(fn, inputs, output_dir, chunk_bytes)``,
then ``StreamingDataset(output_dir, shuffle=...)`` in a ``StreamingDataLoader``. JPEGs are
handed to optimize as PIL images (stored as their JPEG bytes, decoded on read); the fields
case's caption as an int32 numpy array."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch


def unavailable() -> str | None:
    import litdata  # noqa: F401

    return None


class _Item:
    def __init__(self, case):
        self.case, self.kind, self.files, self.labels = case, case.kind, case.files(), case.labels()

    def __call__(self, i: int):
        from bench.data import load_raw

        if self.kind == "raw":
            x = torch.from_numpy(load_raw(self.files[i]))
        else:
            from PIL import Image

            x = Image.open(io.BytesIO(Path(self.files[i]).read_bytes()))
        item = {"x": x, "y": int(self.labels[i])}
        if self.kind == "fields":
            item["caption"] = np.ascontiguousarray(self.case.tokens()[i])
        return item


def write(case, out: Path, workers: int = 2) -> None:
    import litdata

    litdata.optimize(
        fn=_Item(case),
        inputs=list(range(case.count)),
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=workers,
    )


def batches(case, out: Path, *, shuffle: bool, workers: int, batch_size: int, seed: int = 0):
    import litdata

    from bench.data import Augment, to_chw_uint8

    class Dataset(litdata.StreamingDataset):
        def __init__(self, *a, augment=None, **kw):
            super().__init__(*a, **kw)
            self.augment = augment

        def __getitem__(self, index):
            item = super().__getitem__(index)
            x = item["x"]
            if self.augment is not None:
                x = self.augment(to_chw_uint8(x))
            if "caption" in item:
                return x, torch.tensor(item["caption"]), item["y"]
            return x, item["y"]

    aug = Augment(case.crop) if case.kind in ("jpeg", "fields") else None
    ds = Dataset(str(out), shuffle=shuffle, seed=seed, augment=aug)
    return litdata.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers)
