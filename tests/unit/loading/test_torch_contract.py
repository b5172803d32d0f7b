"""Tutorial code works unchanged: every gpufeed dataset honours PyTorch's Dataset contract.

The tutorial's loading snippets (docs/getting-started.md) and the seed's line
``DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4, pin_memory=True)`` run as they
are written against every dataset type (HDF5, LMDB, mmap, tar through its index, tar streamed),
with 0 and 2 workers under fork and spawn; torch's wrappers (Subset, random_split,
ConcatDataset, DistributedSampler), torchdata's StatefulDataLoader and a Lightning Trainer.fit
read the same samples as make_loader; ranks read disjoint shares, whether the rank comes from
make_loader's arguments or the environment.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import (
    ConcatDataset,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    Subset,
    random_split,
)
from unit_sources import ROOT

import gpufeed
from gpufeed.loading.make import make_loader

N = 40  # samples per pack: even, so two ranks split them without padding
SHAPE = (3, 8, 8)
TYPES = ["hdf5", "lmdb", "mmap", "tar-indexed", "tar-stream"]
MAP_TYPES = TYPES[:-1]
SEED_LINE = "DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4, pin_memory=True)"

# pin_memory=True on a machine without CUDA: torch warns and does not pin
# and the seed's 4 workers on a 2-CPU machine: torch's warning about it
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning"),
    pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


@pytest.fixture(scope="session")
def contract_packs(pack_factory) -> dict[str, Path]:
    """Small packs of the same 40 distinct uint8 arrays (classes a and b), every format;
    the tar pack in 8 shards of 5."""
    packs = {}
    for fmt in ("hdf5", "lmdb", "mmap", "tar"):
        kw = {"shard_size": 5} if fmt == "tar" else {}
        classes = {"a": N // 2, "b": N // 2}
        packs[fmt] = pack_factory(fmt, classes=classes, shape=SHAPE, seed=3, **kw)
    return packs


def open_type(packs, kind: str, **options):
    if kind == "tar-indexed":
        return gpufeed.open_dataset(packs["tar"], **options)
    if kind == "tar-stream":
        return gpufeed.open_dataset(packs["tar"], map_style=False, **options)
    return gpufeed.open_dataset(packs[kind], **options)


@pytest.fixture(scope="session")
def reference(contract_packs) -> dict[bytes, int]:
    """Every sample's bytes -> its label, read one by one from the mmap pack."""
    ds = gpufeed.open_dataset(contract_packs["mmap"])
    return {bytes(ds[i][0].numpy()): ds[i][1] for i in range(len(ds))}


def keys(batch) -> list[bytes]:
    images, labels = batch  # DataLoader's [images, labels] and make_loader's Batch alike
    assert images.dtype == torch.uint8 and tuple(images.shape[1:]) == SHAPE
    assert labels.dtype == torch.int64 and len(labels) == len(images)
    return [bytes(x.numpy()) for x in images]


def epoch(loader, reference=None) -> list[bytes]:
    out = []
    for batch in loader:
        got = keys(batch)
        if reference is not None:
            assert [reference[k] for k in got] == batch[1].tolist()  # labels travel with images
        out += got
    return out


def make_loader_epoch(ds) -> set[bytes]:
    return set(epoch(make_loader(ds, 8, True, num_workers=0)))


# ------------------------------------------------------------------ the tutorial lines


def readme_blocks() -> list[str]:
    """docs/getting-started.md's Python blocks marked as tutorials, in order."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    return re.findall(r"<!-- tutorial[^>]*-->\n```python\n(.*?)```", text, flags=re.S)


def test_readme_has_the_tutorial_blocks():
    blocks = readme_blocks()
    assert len(blocks) == 2
    assert SEED_LINE in blocks[0] and "make_loader(" in blocks[1]


@pytest.mark.parametrize("kind", TYPES)
def test_readme_snippets_run_as_written(contract_packs, reference, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loader.json").write_text('{"num_workers": 0}')  # what `gpufeed tune` writes
    first, second = readme_blocks()
    path = contract_packs["tar" if kind.startswith("tar") else kind]
    how = ", map_style=False" if kind == "tar-stream" else ""  # the tutorial's streamed tar
    first = first.replace('open_dataset("packs/train.lmdb")', f"open_dataset({str(path)!r}{how})")
    ns: dict = {}
    if kind == "tar-stream":
        # PyTorch refuses shuffle=True for every IterableDataset; loading.md says to drop it
        with pytest.raises(ValueError, match="expected unspecified shuffle option"):
            exec(first, ns)
        first = first.replace("shuffle=True, ", "")
    exec(first, ns)
    plain = epoch(ns["loader"], reference)
    assert sorted(plain) == sorted(reference)  # every sample once
    exec(second, ns)
    assert ns["loader"].plan.from_settings == ("num_workers",)
    fast = epoch(ns["loader"], reference)
    assert sorted(fast) == sorted(plain)


@pytest.mark.parametrize("kind", MAP_TYPES)
def test_the_seeds_line_verbatim(contract_packs, reference, kind):
    dataset = open_type(contract_packs, kind)
    loader = eval(SEED_LINE)  # noqa: S307 - the line exactly as the seed writes it
    batches = list(loader)
    assert [len(b[1]) for b in batches] == [32, N - 32]
    assert sorted(k for b in batches for k in keys(b)) == sorted(reference)
    assert set(epoch(loader)) == make_loader_epoch(dataset)


def test_the_seeds_line_on_the_tar_stream_without_shuffle(contract_packs, reference):
    dataset = open_type(contract_packs, "tar-stream")
    loader = DataLoader(dataset, batch_size=32, num_workers=4, pin_memory=True)
    got = epoch(loader, reference)
    assert sorted(got) == sorted(reference)  # 4 workers, 8 shards: no sample twice, none lost
    assert set(got) == make_loader_epoch(dataset)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", TYPES)
def test_plain_dataloader_forked_workers(contract_packs, reference, kind, workers):
    dataset = open_type(contract_packs, kind)
    shuffle = None if kind == "tar-stream" else True
    loader = DataLoader(dataset, batch_size=32, shuffle=shuffle, num_workers=workers)
    assert sorted(epoch(loader, reference)) == sorted(reference)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_plain_dataloader_spawned_workers(contract_packs, reference):
    """Spawn is slow (each worker imports torch), so one loader reads all map-style types
    (through ConcatDataset: a wrapper tested on the way) and one the tar stream."""
    datasets = [open_type(contract_packs, kind) for kind in MAP_TYPES]
    for ds in datasets:
        ds[0]  # a handle open in the parent must not travel to the workers
    every = ConcatDataset(datasets)
    loader = DataLoader(
        every, batch_size=32, shuffle=True, num_workers=2, multiprocessing_context="spawn"
    )
    got = epoch(loader, reference)
    assert sorted(got) == sorted(list(reference) * len(MAP_TYPES))
    stream = open_type(contract_packs, "tar-stream")
    loader = DataLoader(stream, batch_size=32, num_workers=2, multiprocessing_context="spawn")
    assert sorted(epoch(loader, reference)) == sorted(reference)


# --------------------------------------------------------------------- the contract


@pytest.mark.parametrize("kind", MAP_TYPES)
def test_indexing_follows_python(contract_packs, kind):
    ds = open_type(contract_packs, kind)
    image, label = ds[3]
    assert isinstance(image, torch.Tensor) and image.shape == SHAPE and isinstance(label, int)
    for same in (np.int64(3), torch.tensor(3), 3 - N):
        got = ds[same]
        assert torch.equal(got[0], image) and got[1] == label, repr(same)
    assert torch.equal(ds[-1][0], ds[N - 1][0])
    for bad in (N, -N - 1, torch.tensor(N)):
        with pytest.raises(IndexError):
            ds[bad]
    for wrong in (1.0, "3", torch.tensor(3.0)):
        with pytest.raises(TypeError):
            ds[wrong]
    # many indices: the list of samples, as __getitems__ (and as torch's Subset indexes)
    for many in ([3, 0], (3, 0), np.array([3, 0]), torch.tensor([3, 0])):
        samples = ds[many]
        assert isinstance(samples, list) and torch.equal(samples[0][0], image)
    assert [s[1] for s in ds[1:4]] == [ds[i][1] for i in range(1, 4)]


@pytest.mark.parametrize("kind", MAP_TYPES)
def test_getitems_is_the_list_of_samples_a_collate_fn_receives(contract_packs, kind):
    ds = open_type(contract_packs, kind)
    indices = [5, 1, 5, -2]
    samples = ds.__getitems__(indices)
    assert len(samples) == len(indices)
    for i, (image, label) in zip(indices, samples, strict=True):
        assert torch.equal(image, ds[i][0]) and label == ds[i][1]
    seen = []

    def my_collate(batch):
        seen.append(batch)
        return len(batch)

    loader = DataLoader(ds, batch_size=6, collate_fn=my_collate)
    assert list(loader) == [6] * 6 + [4]
    assert all(isinstance(s, tuple) and isinstance(s[1], int) for s in seen[0])
    batch = ds.get_batch(indices)  # the fast path: the same read, stacked
    assert torch.equal(batch.samples, torch.stack([s[0] for s in samples]))
    # make_loader hands a collate_fn of yours the samples too, as DataLoader does
    seen.clear()
    assert list(make_loader(ds, 6, collate_fn=my_collate, num_workers=0)) == [6] * 6 + [4]
    assert isinstance(seen[0], list) and isinstance(seen[0][0], tuple)


def test_skipped_samples_keep_their_place_as_none(tmp_path):
    from unit_sources import pack_with_broken_jpeg

    ds = gpufeed.open_dataset(pack_with_broken_jpeg(tmp_path), on_error="skip")
    with pytest.warns(UserWarning, match="skipping corrupt samples"):
        samples = ds.__getitems__([0, 1, 2])
    assert samples[1] is None and samples[0] is not None and samples[2] is not None
    loader = DataLoader(ds, batch_size=3, collate_fn=gpufeed.collate)  # drops them
    assert [len(b.labels) for b in loader] == [2]


# ------------------------------------------------------------------------- wrappers


@pytest.mark.parametrize("kind", MAP_TYPES)
def test_torch_wrappers_read_what_make_loader_reads(contract_packs, kind):
    ds = open_type(contract_packs, kind)
    everything = make_loader_epoch(ds)
    assert len(everything) == N
    sub = Subset(ds, list(range(0, N, 2)))
    assert set(epoch(DataLoader(sub, batch_size=8, shuffle=True))) == {
        bytes(ds[i][0].numpy()) for i in range(0, N, 2)
    }
    assert set(epoch(make_loader(sub, 8, True, num_workers=0))) == set(
        epoch(DataLoader(sub, batch_size=8))
    )
    parts = random_split(ds, [0.75, 0.25], generator=torch.Generator().manual_seed(0))
    got = [epoch(DataLoader(p, batch_size=8, shuffle=True)) for p in parts]
    assert not set(got[0]) & set(got[1]) and set(got[0]) | set(got[1]) == everything
    both = ConcatDataset([ds, ds])
    assert sorted(epoch(DataLoader(both, batch_size=8))) == sorted(list(everything) * 2)
    ranks = []
    for rank in range(2):
        sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=1)
        sampler.set_epoch(3)
        ranks.append(epoch(DataLoader(ds, batch_size=8, sampler=sampler)))
    assert not set(ranks[0]) & set(ranks[1]) and set(ranks[0]) | set(ranks[1]) == everything


@pytest.mark.parametrize("kind", TYPES)
def test_stateful_dataloader_resumes_with_exactly_the_rest(contract_packs, kind):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    ds = open_type(contract_packs, kind)
    shuffle = None if kind == "tar-stream" else True
    kw = dict(batch_size=4, shuffle=shuffle, num_workers=2)
    full_loader = stateful.StatefulDataLoader(ds, **kw)
    full = epoch(full_loader)
    assert set(full) == make_loader_epoch(ds) and len(full) == N
    loader = stateful.StatefulDataLoader(ds, **kw)
    it = iter(loader)
    before = keys(next(it)) + keys(next(it)) + keys(next(it))
    state = loader.state_dict()
    del it
    resumed = stateful.StatefulDataLoader(open_type(contract_packs, kind), **kw)
    resumed.load_state_dict(state)
    after = epoch(resumed)
    assert sorted(before + after) == sorted(full)  # nothing twice, nothing lost


@pytest.mark.slow
def test_lightning_trains_on_a_gpufeed_dataset(contract_packs, reference, tmp_path):
    pl = pytest.importorskip("pytorch_lightning")

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(int(np.prod(SHAPE)), 2)
            self.seen: list[bytes] = []

        def training_step(self, batch, _):
            images, labels = batch
            self.seen += keys(batch)
            logits = self.layer(images.flatten(1).float() / 255)
            return torch.nn.functional.cross_entropy(logits, labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Data(pl.LightningDataModule):
        def __init__(self, fast: bool):
            super().__init__()
            self.fast = fast

        def setup(self, stage=None):
            self.dataset = gpufeed.open_dataset(contract_packs["hdf5"])

        def train_dataloader(self):
            if self.fast:
                return gpufeed.make_loader(self.dataset, 8, True, num_workers=0)
            return DataLoader(self.dataset, batch_size=8, shuffle=True, num_workers=2)

    runs = {}
    for fast in (False, True):
        model = Model()
        trainer = pl.Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
            trainer.fit(model, datamodule=Data(fast))
        assert trainer.state.finished
        runs[fast] = model.seen
    assert sorted(runs[False]) == sorted(runs[True]) == sorted(reference)


# ------------------------------------------------------------------------------ ranks


def rank_epochs(build) -> list[list[bytes]]:
    return [epoch(build(rank)) for rank in range(2)]


def assert_disjoint_halves(ranks, reference):
    assert not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == sorted(reference)
    assert ranks[0] and ranks[1]


@pytest.mark.parametrize("kind", TYPES)
def test_make_loader_shards_by_explicit_rank(contract_packs, reference, kind):
    ds = open_type(contract_packs, kind)
    ranks = rank_epochs(lambda r: make_loader(ds, 4, True, num_workers=0, rank=r, world_size=2))
    assert_disjoint_halves(ranks, reference)
    assert ds.rank is None if kind == "tar-stream" else True  # the user's object unchanged


@pytest.mark.parametrize("kind", TYPES)
def test_make_loader_shards_by_rank_from_the_environment(
    contract_packs, reference, kind, monkeypatch
):
    ds = open_type(contract_packs, kind)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def build(rank):
        monkeypatch.setenv("RANK", str(rank))
        return make_loader(ds, 4, True, num_workers=2)

    assert_disjoint_halves(rank_epochs(build), reference)


def test_plain_dataloader_on_the_tar_stream_shards_by_environment(
    contract_packs, reference, monkeypatch
):
    monkeypatch.setenv("WORLD_SIZE", "2")
    ranks = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        ds = open_type(contract_packs, "tar-stream")
        assert isinstance(ds, IterableDataset)
        ranks.append(epoch(DataLoader(ds, batch_size=32, num_workers=2)))
    assert_disjoint_halves(ranks, reference)


def test_make_loader_distributed_false_reads_everything(contract_packs, reference):
    ds = open_type(contract_packs, "tar-stream")
    loader = make_loader(ds, 4, num_workers=0, rank=1, world_size=2, distributed=False)
    assert sorted(epoch(loader)) == sorted(reference)


def test_make_loader_shuffle_on_the_tar_stream(contract_packs):
    """shuffle=False reads the stream in storage order (the dataset opened shuffling is left
    as it is); None keeps the dataset's own shuffle buffer."""
    stream = open_type(contract_packs, "tar-stream")
    in_order = [k for b in make_loader(stream, 4, False, num_workers=0) for k in keys(b)]
    storage = gpufeed.open_dataset(contract_packs["mmap"])
    assert in_order == [bytes(storage[i][0].numpy()) for i in range(N)]
    assert stream.shuffle_buffer > 1 and stream.shuffle_shards
    shuffled = [k for b in make_loader(stream, 4, num_workers=0) for k in keys(b)]
    assert shuffled != in_order and sorted(shuffled) == sorted(in_order)
