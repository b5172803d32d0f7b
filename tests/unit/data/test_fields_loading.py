"""Multi-field batches: collate_fields (stack, pad + mask, lists), through make_loader with 0
and 2 workers under fork and spawn, a plain DataLoader, resumption and ranks."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import gpufeed
from gpufeed.batch import FieldBatch, collate_fields
from gpufeed.errors import UsageError
from gpufeed.loading.make import make_loader

N = 61
SCHEMA = {"x": "float32[2,3]", "tok": "int64[-1]", "box": "float32[-1,4]", "s": "str",
          "b": "bytes", "label": "int", "score": "float", "meta": "json"}  # fmt: skip


def sample(i: int) -> dict:
    return {
        "x": np.full((2, 3), i, np.float32),
        "tok": np.arange(i % 5 + 1) + 100 * i,
        "box": np.full((i % 3, 4), i, np.float32),
        "s": f"s{i}",
        "b": bytes([i]),
        "label": i,
        "score": i / 2,
        "meta": {"i": i},
    }


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("field_packs")
    out = {}
    for fmt, kw in [("lmdb", {}), ("tar", {"shard_size": 8})]:
        with gpufeed.Writer(root / fmt, format=fmt, schema=SCHEMA, **kw) as w:
            for i in range(N):
                w.write(sample(i))
        out[fmt] = root / fmt
    return out


def labels(batch) -> list[int]:
    assert isinstance(batch, FieldBatch)
    assert batch["x"].shape[1:] == (2, 3) and batch["label"].dtype == torch.int64
    assert batch["tok"].shape == batch["tok_mask"].shape
    for j, i in enumerate(batch["label"].tolist()):  # every field belongs to the same sample
        n = i % 5 + 1
        assert batch["tok"][j, :n].tolist() == list(range(100 * i, 100 * i + n))
        assert batch["tok_mask"][j].sum() == n and (batch["tok"][j, n:] == -1).all()
        assert batch["s"][j] == f"s{i}" and batch["meta"][j] == {"i": i}
        assert batch["box"][j].shape == (i % 3, 4) and batch["score"][j] == i / 2
    return batch["label"].tolist()


def test_collate_fields_stacks_pads_and_lists():
    samples = [
        {"a": torch.ones(2, 3), "r": torch.arange(n), "s": "x", "i": n, "f": 0.5} for n in (1, 3, 2)
    ]
    out = collate_fields(samples, pad={"r": 7})
    assert out["a"].shape == (3, 2, 3)
    assert out["r"].tolist() == [[0, 7, 7], [0, 1, 2], [0, 1, 7]]
    assert out["r_mask"].tolist() == [[1, 0, 0], [1, 1, 1], [1, 1, 0]]
    assert out["s"] == ["x"] * 3 and out["i"].tolist() == [1, 3, 2]
    assert out["f"].dtype == torch.float64
    assert isinstance(collate_fields(samples)["r"], list)  # no pad: a list of tensors
    same = collate_fields(samples[:1], pad={"r": 0})  # padded batches always carry the mask
    assert same["r_mask"].tolist() == [[True]]
    grid = collate_fields([{"g": torch.ones(1, 2)}, {"g": torch.ones(2, 1)}], pad={"g": 0})
    assert grid["g"].shape == (2, 2, 2) and grid["g_mask"].sum() == 4
    assert gpufeed.collate(out) is out  # a FieldBatch passes through


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "workers", "context"),
    [("lmdb", 0, None), ("lmdb", 2, "fork"), ("lmdb", 2, "spawn"), ("tar", 0, None),
     ("tar", 2, "fork"), ("tar", 2, "spawn")],
)  # fmt: skip
def test_make_loader_gives_every_sample_once_with_workers(packs, fmt, workers, context):
    ds = gpufeed.open_dataset(packs[fmt], pad={"tok": -1})
    dl = make_loader(
        ds, 8, shuffle=True, num_workers=workers, multiprocessing_context=context, seed=3
    )
    seen = [i for b in dl for i in labels(b)]
    assert sorted(seen) == list(range(N)) and seen != list(range(N))


@pytest.mark.parametrize("fmt", ["lmdb", "tar"])
def test_resumption_gives_exactly_the_unseen_samples(packs, fmt):
    ds = gpufeed.open_dataset(packs[fmt], pad={"tok": -1})
    dl = make_loader(ds, 8, num_workers=2, seed=1)
    full = [i for b in dl for i in labels(b)]
    dl.set_epoch(0)
    it = iter(dl)
    before = labels(next(it)) + labels(next(it))
    state = dl.state_dict()
    del it
    resumed = make_loader(
        gpufeed.open_dataset(packs[fmt], pad={"tok": -1}), 8, num_workers=2, seed=1
    )
    resumed.load_state_dict(state)
    assert before + [i for b in resumed for i in labels(b)] == full


@pytest.mark.parametrize("fmt", ["lmdb", "tar"])
def test_ranks_share_the_samples_disjointly(packs, fmt):
    shares = []
    for rank in range(2):
        ds = gpufeed.open_dataset(packs[fmt], pad={"tok": -1})
        dl = make_loader(ds, 8, shuffle=True, num_workers=0, rank=rank, world_size=2)
        shares.append([i for b in dl for i in labels(b)])
    # map-style ranks (tar too) get equal shares, as DistributedSampler pads them:
    # 61 = 31 + 30 + 1 again
    assert len(set(shares[0]) & set(shares[1])) == 1
    assert set(shares[0]) | set(shares[1]) == set(range(N))
    assert set(shares[0]) | set(shares[1]) == set(range(N))


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_plain_dataloader_with_gpufeed_collate(packs, context):
    ds = gpufeed.open_dataset(packs["lmdb"])
    loader = DataLoader(
        ds, batch_size=32, shuffle=True, num_workers=2, pin_memory=True,
        collate_fn=functools.partial(gpufeed.collate, pad={"tok": -1}),
        multiprocessing_context=context,
    )  # fmt: skip
    seen = [i for b in loader for i in labels(b)]
    assert sorted(seen) == list(range(N))
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    plain = DataLoader(ds, batch_size=32, sampler=sampler, collate_fn=gpufeed.collate)
    # rank 1 of 2: every second index from 1, padded to 31 with index 0 (DistributedSampler)
    assert [b["label"].tolist() for b in plain] == [list(range(1, N, 2)) + [0]]


def test_torch_default_collate_takes_packs_without_ragged_fields(tmp_path):
    with gpufeed.Writer(tmp_path / "p", format="hdf5", schema={"x": "uint8[4]", "s": "str"}) as w:
        for i in range(10):
            w.write({"x": np.full(4, i, np.uint8), "s": str(i)})
    ds = gpufeed.open_dataset(tmp_path / "p")
    batch = next(iter(DataLoader(ds, batch_size=4, num_workers=0)))
    assert batch["x"].shape == (4, 4) and batch["s"] == ["0", "1", "2", "3"]


def test_pad_names_ragged_fields_only(packs):
    with pytest.raises(UsageError, match=r"\['x'\] are not ragged fields.*\['tok', 'box'\]"):
        gpufeed.open_dataset(packs["lmdb"], pad={"x": 0})
    with pytest.raises(UsageError, match="batch_transform takes one stacked tensor"):
        gpufeed.open_dataset(packs["lmdb"], batch_transform=lambda b: b)
