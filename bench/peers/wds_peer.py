"""WebDataset, as its README shows: ShardWriter to tar shards, then
``WebDataset(urls, shardshuffle=...).shuffle(N).decode(...).to_tuple(...).batched(B)``
in a ``WebLoader(batch_size=None)`` (batching in the workers, its recommended setup). The
fields case's samples are ``{"jpg": bytes, "caption.npy": int32 [32], "cls": int}``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def unavailable() -> str | None:
    import webdataset  # noqa: F401

    return None


def write(case, out: Path) -> None:
    import webdataset as wds

    from bench.data import load_raw

    out.mkdir(parents=True, exist_ok=True)
    labels = case.labels()
    captions = case.tokens() if case.kind == "fields" else None
    per_shard = max(1, case.count // 10)
    with wds.ShardWriter(str(out / "shard-%06d.tar"), maxcount=per_shard, verbose=0) as w:
        for i, path in enumerate(case.files()):
            sample = {"__key__": f"{i:09d}", "cls": int(labels[i])}
            if case.kind == "raw":
                sample["npy"] = load_raw(path)
            else:
                sample["jpg"] = Path(path).read_bytes()
            if captions is not None:
                sample["caption.npy"] = np.ascontiguousarray(captions[i])
            w.write(sample)


def _to_tensor(x):
    return torch.from_numpy(np.ascontiguousarray(x))


def batches(case, out: Path, *, shuffle: bool, workers: int, batch_size: int, seed: int = 0):
    import webdataset as wds

    from bench.data import Augment, shuffle_buffer

    urls = sorted(str(p) for p in out.glob("shard-*.tar"))
    ds = wds.WebDataset(
        urls,
        shardshuffle=len(urls) if shuffle else False,
        empty_check=False,
        seed=seed,
        nodesplitter=wds.split_by_node,
        workersplitter=wds.split_by_worker,
    )
    if shuffle:
        ds = ds.shuffle(shuffle_buffer(case))
    if case.kind == "raw":
        ds = ds.decode().to_tuple("npy", "cls").map_tuple(_to_tensor, int)
    elif case.kind == "fields":
        ds = ds.decode("torchrgb8").to_tuple("jpg", "caption.npy", "cls")
        ds = ds.map_tuple(Augment(case.crop), _to_tensor, int)
    else:
        ds = ds.decode("torchrgb8").to_tuple("jpg", "cls").map_tuple(Augment(case.crop), int)
    ds = ds.batched(batch_size, partial=True)
    return wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=False)
