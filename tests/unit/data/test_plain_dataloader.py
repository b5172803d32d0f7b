"""The tutorial's plain ``DataLoader(ds, batch_size=..., shuffle=True, num_workers=...,
pin_memory=True)``, torch's default_collate, over multi-field packs with ragged fields in
every format, 0 and 2 workers, fork and spawn: ragged fields come out as gpufeed.collate
gives them (a list of plain tensors), the other fields as default_collate makes them.
RaggedTensor, the per-sample value that makes it so: a tensor to its user, plain after any
op, pickled plain, registered in default_collate_fn_map wherever a dataset is unpickled."""

from __future__ import annotations

import copy
import io
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data._utils.pin_memory import pin_memory

import gpufeed
from gpufeed.batch import RaggedTensor, collate_fields, ragged
from gpufeed.formats import FORMATS

# pin_memory=True on a machine without CUDA: torch warns and does not pin (the recursion that
# pins is run below with Tensor.pin_memory stood in for, and for real where CUDA is)
pytestmark = pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
N, B = 24, 8  # three batches; no batch of 8 can hold one size only (at most 4 per size)
SCHEMA = {"tok": "int64[-1]", "box": "float32[-1,4]", "x": "float32[2,3]", "s": "str",
          "label": "int"}  # fmt: skip


def sample(i: int) -> dict:
    return {
        "tok": np.arange(i % 7 + 1) + 100 * i,
        "box": np.full((i % 3, 4), i, np.float32),
        "x": np.full((2, 3), i / 4, np.float32),
        "s": f"s{i}",
        "label": i,
    }


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plain_loader")
    for fmt in sorted(FORMATS):
        with gpufeed.Writer(root / fmt, format=fmt, schema=SCHEMA, part_size=5) as w:
            for i in range(N):
                w.write(sample(i))
    return root


def check_batch(batch) -> list[int]:
    """Every field of every sample in the batch equal to what was written for it; ragged
    fields a list of plain tensors; the sample indices in batch order."""
    assert type(batch) is dict and list(batch) == list(SCHEMA)
    labels = batch["label"]
    assert type(labels) is torch.Tensor and labels.dtype == torch.int64
    assert type(batch["x"]) is torch.Tensor and batch["x"].shape == (len(labels), 2, 3)
    for name in ("tok", "box"):
        assert type(batch[name]) is list and len(batch[name]) == len(labels)
        assert all(type(t) is torch.Tensor for t in batch[name]), name
    for j, i in enumerate(labels.tolist()):
        want = sample(i)
        assert batch["tok"][j].dtype == torch.int64 and batch["box"][j].dtype == torch.float32
        assert batch["tok"][j].numpy().tolist() == want["tok"].tolist()
        assert batch["box"][j].shape == want["box"].shape and (batch["box"][j] == i).all()
        assert (batch["x"][j].numpy() == want["x"]).all() and batch["s"][j] == f"s{i}"
    return labels.tolist()


def seeded() -> torch.Generator:
    return torch.Generator().manual_seed(14)


# every format in-process and with forked workers; spawned workers (4-5 s each) over two of
# them: what a spawned worker adds (gpufeed imported by unpickling the dataset) is the same
# for every format, and the streamed tar pack below spawns too
CASES = [(f, 0, None) for f in sorted(FORMATS)] + [(f, 2, "fork") for f in sorted(FORMATS)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fmt", "workers", "context"), [*CASES, ("hdf5", 2, "spawn"), ("mmap", 2, "spawn")]
)
def test_the_tutorial_line_takes_ragged_fields(packs, fmt, workers, context):
    ds = gpufeed.open_dataset(packs / fmt)
    loader = DataLoader(
        ds, batch_size=B, shuffle=True, num_workers=workers, pin_memory=True,
        multiprocessing_context=context, generator=seeded(),
    )  # fmt: skip
    got = [check_batch(b) for b in loader]
    # the sampler's order: the same generator seed gives the same permutation to gpufeed.collate
    reference = DataLoader(
        ds, batch_size=B, shuffle=True, generator=seeded(), collate_fn=gpufeed.collate
    )
    assert got == [b["label"].tolist() for b in reference]
    assert sorted(i for b in got for i in b) == list(range(N)) and got[0] != list(range(B))


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_streamed_tar_pack_through_a_plain_dataloader(packs, context):
    ds = gpufeed.open_dataset(packs / "tar", map_style=False)
    loader = DataLoader(ds, batch_size=B, num_workers=2, multiprocessing_context=context)
    assert sorted(i for b in loader for i in check_batch(b)) == list(range(N))


def test_default_collate_gives_what_gpufeed_collate_gives(packs):
    ds = gpufeed.open_dataset(packs / "mmap")
    for indices in ([3, 1, 8, 0], [1, 8, 15], [5]):  # sizes differ; sizes agree; one
        samples = ds.__getitems__(indices)
        mine, theirs = default_collate(samples), gpufeed.collate(samples)
        assert list(mine) == list(theirs)
        for name, value in theirs.items():
            if isinstance(value, list) and isinstance(value[0], torch.Tensor):
                assert [type(t) for t in mine[name]] == [torch.Tensor] * len(value)
                assert [type(t) for t in value] == [torch.Tensor] * len(value)
                assert all(torch.equal(a, b) for a, b in zip(mine[name], value, strict=True))
            elif isinstance(value, torch.Tensor):
                assert type(mine[name]) is type(value) is torch.Tensor
                assert mine[name].dtype == value.dtype and torch.equal(mine[name], value)
            else:
                assert mine[name] == value
    agree = default_collate(ds.__getitems__([1, 8, 15]))["tok"]  # stacked, as collate_fields
    assert type(agree) is torch.Tensor and agree.shape == (3, 2)


def test_a_ragged_value_is_a_tensor_to_its_user(packs):
    value = gpufeed.open_dataset(packs / "lmdb")[9]["tok"]
    assert type(value) is RaggedTensor and isinstance(value, torch.Tensor)
    assert value.dtype == torch.int64 and value.shape == (3,) and value[1].item() == 901
    assert value.tolist() == [900, 901, 902] and repr(value) == "tensor([900, 901, 902])"
    for result in (value + 1, value[1:], value.clone(), value.float(), torch.stack([value])):
        assert type(result) is torch.Tensor  # ops give plain tensors: nothing leaks onward
    buf = io.BytesIO()
    torch.save({"tok": value}, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["tok"]
    assert type(loaded) is torch.Tensor and torch.equal(loaded, value)
    assert type(pickle.loads(pickle.dumps(value))) is torch.Tensor
    twin = copy.deepcopy({"a": value, "b": value})
    assert type(twin["a"]) is RaggedTensor and twin["a"] is twin["b"]
    assert twin["a"].data_ptr() != value.data_ptr() and torch.equal(twin["a"], value)
    remade = ragged(value[:2] * 2)  # what a transform does to keep a new value ragged
    assert type(remade) is RaggedTensor and ragged(remade) is remade


def test_gpufeed_collate_still_gives_plain_tensors():
    samples = [{"r": ragged(torch.arange(n)), "f": torch.ones(2)} for n in (1, 3)]
    out = collate_fields(samples)
    assert [type(t) for t in out["r"]] == [torch.Tensor, torch.Tensor]
    padded = collate_fields(samples, pad={"r": 0})
    assert type(padded["r"]) is torch.Tensor and padded["r"].tolist() == [[0, 0, 0], [0, 1, 2]]
    same = collate_fields([{"r": ragged(torch.arange(2))}] * 2)["r"]
    assert type(same) is torch.Tensor and same.shape == (2, 2)


def test_pin_memory_reaches_every_tensor_of_a_ragged_list(packs, monkeypatch):
    pinned = []

    def fake_pin(self, *args, **kwargs):
        pinned.append(self.data_ptr())
        return self.clone()

    batch = default_collate(gpufeed.open_dataset(packs / "hdf5").__getitems__([0, 1, 2]))
    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    out = pin_memory(batch)
    assert type(out) is dict and type(out["tok"]) is list and out["s"] == ["s0", "s1", "s2"]
    assert len(pinned) == 2 + 2 * 3  # x, label and each of the 3 values of tok and box
    assert all(torch.equal(a, b) for a, b in zip(out["tok"], batch["tok"], strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs a CUDA device")
def test_pin_memory_pins_ragged_lists_on_a_gpu_host(packs):
    loader = DataLoader(gpufeed.open_dataset(packs / "mmap"), batch_size=B, pin_memory=True)
    batch = next(iter(loader))
    assert all(t.is_pinned() for t in batch["tok"] + batch["box"]) and batch["x"].is_pinned()


@pytest.mark.slow
def test_a_spawned_process_registers_ragged_collation_when_it_unpickles_a_dataset(
    packs, python_env, tmp_path
):
    (tmp_path / "ds.pkl").write_bytes(pickle.dumps(gpufeed.open_dataset(packs / "tar")))
    script = (
        "import pickle, sys\n"
        "from torch.utils.data._utils.collate import default_collate_fn_map as m\n"
        "assert 'gpufeed' not in sys.modules\n"
        "ds = pickle.load(open(sys.argv[1], 'rb'))\n"
        "print(sorted(t.__name__ for t in m if getattr(t, '__module__', '') == 'gpufeed.batch'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "ds.pkl")],
        env=python_env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    # MixedSizeTensor: images of a read whose sizes differ (default_collate's clear error)
    assert done.stdout.strip() == "['MixedSizeTensor', 'RaggedTensor']"
