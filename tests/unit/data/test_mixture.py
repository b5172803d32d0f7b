"""gpufeed.mix (gpufeed.data.mixture): weighted mixtures of map-style datasets."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import gpufeed
from gpufeed import make_loader, mix
from gpufeed.data.mixture import split_counts
from gpufeed.errors import UsageError


@pytest.fixture(autouse=True)
def _index_dir(tmp_path, monkeypatch):
    """Document lengths read from the documents are cached here, not in ~/.cache."""
    monkeypatch.setenv("GPUFEED_INDEX_DIR", str(tmp_path / "index"))


class Ids(Dataset):
    """Sample i is {"id": i, "tag": tag}."""

    def __init__(self, n: int, tag: str):
        self.n, self.tag = n, tag

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"id": torch.tensor(i), "tag": self.tag}


def _draws(m, epoch) -> dict[str, Counter]:
    m.set_epoch(epoch)
    src, local = m.locate(np.arange(len(m)))
    return {n: Counter(local[src == i].tolist()) for i, n in enumerate(m.names)}


def test_counts_are_the_weights_rounded_to_the_exact_total():
    assert split_counts(np.array([0.5, 0.3, 0.2]), 7).tolist() == [4, 2, 1]
    assert split_counts(np.array([1 / 3] * 3), 10).tolist() == [4, 3, 3]
    m = mix({"web": Ids(1000, "w"), "code": Ids(300, "c")}, {"web": 0.7, "code": 0.3})
    assert len(m) == 1300 and m.counts() == {"web": 910, "code": 390}


@pytest.mark.parametrize("seed", [0, 1])
def test_proportions_and_equal_coverage_within_an_epoch(seed):
    sizes, weights, total = (100, 37, 1000, 7), (0.5, 0.25, 0.2, 0.05), 997
    m = mix([Ids(n, str(k)) for k, n in enumerate(sizes)], weights, samples_per_epoch=total,
            seed=seed)  # fmt: skip
    for epoch in range(5):
        for (name, seen), n, w in zip(_draws(m, epoch).items(), sizes, weights, strict=True):
            assert abs(sum(seen.values()) - w * total) <= 1  # within 1% of the epoch
            q = int(m.counts()[name]) // n
            assert set(seen.values()) <= {q, q + 1}  # equally often, within one
            if q >= 1:
                assert len(seen) == n  # upsampled: whole in every epoch


@pytest.mark.parametrize(("n", "r"), [(1000, 140), (10, 4), (7, 6), (50, 25)])
def test_a_downsampled_source_walks_through_it_across_epochs(n, r):
    m = mix([Ids(n, "a"), Ids(10 * r, "b")], [r, 10 * r], samples_per_epoch=11 * r, seed=4)
    assert m.counts()["0"] == r
    epochs = np.lcm(n, r) // r  # the walk then ends with a whole pass
    walk: Counter = Counter()
    for epoch in range(epochs):
        seen = _draws(m, epoch)["0"]
        assert max(seen.values()) == 1 and sum(seen.values()) == r  # no repeat in an epoch
        walk.update(seen)
        if epoch + 1 == n // r:  # the first pass: nothing repeats before it is whole
            assert max(walk.values()) == 1
    assert set(walk.values()) == {epochs * r // n} and len(walk) == n  # once a pass


def test_draws_are_deterministic_by_seed_and_epoch_and_change_with_them():
    a = mix([Ids(100, "a"), Ids(1000, "b")], [0.5, 0.5], samples_per_epoch=300, seed=1)
    b = mix([Ids(100, "a"), Ids(1000, "b")], [0.5, 0.5], samples_per_epoch=300, seed=1)
    assert _draws(a, 3) == _draws(b, 3)
    assert _draws(a, 0) == _draws(b, 0)  # going back an epoch: the same again
    assert _draws(a, 0)["1"] != _draws(a, 1)["1"]
    c = mix([Ids(100, "a"), Ids(1000, "b")], [0.5, 0.5], samples_per_epoch=300, seed=2)
    assert _draws(a, 0)["1"] != _draws(c, 0)["1"]


def test_source_field_tags_dict_samples_and_refuses_others():
    m = mix({"web": Ids(5, "w"), "code": Ids(5, "c")}, {"web": 1, "code": 1},
            source_field="source")  # fmt: skip
    for s in m[:]:
        assert {"web": "w", "code": "c"}[s["source"]] == s["tag"]
    pairs = torch.utils.data.TensorDataset(torch.arange(4), torch.arange(4))
    bad = mix({"a": pairs}, {"a": 1}, source_field="source")
    with pytest.raises(UsageError, match="source_field='source'.*'a' gives tuple"):
        bad[0]


def test_weights_that_do_not_fit_are_usage_errors():
    a, b = Ids(3, "a"), Ids(0, "b")
    with pytest.raises(UsageError, match="one weight per dataset"):
        mix([a, a], [1.0])
    with pytest.raises(UsageError, match="names"):
        mix({"a": a}, {"b": 1.0})
    with pytest.raises(UsageError, match=">= 0 and not all 0"):
        mix([a, a], [1.0, -1.0])
    with pytest.raises(UsageError, match="'1' is empty"):
        mix([a, b], [0.5, 0.5])


def _token_pack(path, fmt, first, count):
    with gpufeed.Writer(path, fmt, schema={"tokens": "uint16[-1]"}) as w:
        for j in range(count):
            w.write({"tokens": np.full(8, first + j, np.uint16)})
    return gpufeed.open_dataset(path, block_size=8)


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_a_mixture_of_token_windows_through_make_loader(tmp_path, workers, context):
    web = _token_pack(tmp_path / "web", "mmap", 0, 60)  # window i: all tokens i
    code = _token_pack(tmp_path / "code", "tar", 1000, 20)
    m = mix({"web": web, "code": code}, {"web": 0.7, "code": 0.3}, samples_per_epoch=100)
    assert m.counts() == {"web": 70, "code": 30}
    loader = make_loader(
        m, 10, num_workers=workers, shuffle=True, seed=2, multiprocessing_context=context,
        persistent_workers=workers > 0,
    )  # fmt: skip
    for epoch in range(3):  # persistent workers see each epoch (set_epoch)
        loader.set_epoch(epoch)
        ids = torch.cat([b[:, 0] for b in loader]).long()
        m.set_epoch(epoch)
        want = sorted(int(w[0]) for w in m[:])
        assert sorted(ids.tolist()) == want
        assert (ids < 1000).sum() == 70


def test_ranks_and_mid_epoch_resume_of_a_mixture(tmp_path):
    web = _token_pack(tmp_path / "web", "lmdb", 0, 60)
    code = _token_pack(tmp_path / "code", "hdf5", 1000, 20)
    m = mix([web, code], [0.5, 0.5], samples_per_epoch=80, seed=9)
    shares = []
    for rank in range(2):
        loader = make_loader(m, 8, num_workers=0, shuffle=True, seed=1, rank=rank, world_size=2)
        shares.append([int(x) for b in loader for x in b[:, 0]])
    assert len(shares[0]) == len(shares[1]) == 40
    per_rank = [
        make_loader(m, 8, num_workers=0, shuffle=True, seed=1, rank=r, world_size=2).source_counts()
        for r in range(2)
    ]
    for share, counted in zip(shares, per_rank, strict=True):  # what each rank was handed
        assert counted == {"0": sum(x < 1000 for x in share), "1": sum(x >= 1000 for x in share)}
    assert per_rank[0]["0"] + per_rank[1]["0"] == m.counts()["0"] == 40
    m.set_epoch(0)
    assert sorted(shares[0] + shares[1]) == sorted(int(w[0]) for w in m[:])
    whole = [b.clone() for b in make_loader(m, 8, num_workers=0, shuffle=True, seed=1)]
    first = make_loader(m, 8, num_workers=0, shuffle=True, seed=1)
    it = iter(first)
    head = [next(it).clone() for _ in range(4)]
    resumed = make_loader(m, 8, num_workers=2, shuffle=True, seed=1)
    resumed.load_state_dict(first.state_dict())
    for a, b in zip(head + list(resumed), whole, strict=True):
        assert torch.equal(a, b)


def test_the_plain_dataloader_sees_set_epoch(tmp_path):
    m = mix([Ids(4, "a"), Ids(100, "b")], [0.5, 0.5], samples_per_epoch=20)
    got = {}
    for epoch in (0, 1):
        m.set_epoch(epoch)
        dl = DataLoader(m, batch_size=5, num_workers=2, multiprocessing_context="spawn")
        pairs = [(int(i), t) for b in dl for i, t in zip(b["id"], b["tag"], strict=True)]
        got[epoch] = sorted(i for i, t in pairs if t == "b")
        m.set_epoch(epoch)
        assert got[epoch] == sorted(int(s["id"]) for s in m[:] if s["tag"] == "b")
    assert got[0] != got[1]


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_a_mixture_checkpoint_resumes_with_another_world_size(tmp_path, before, after):
    """Elastic: N ranks checkpoint mid-epoch, M ranks finish it; every draw exactly once."""
    web = _token_pack(tmp_path / "web", "mmap", 0, 40)
    code = _token_pack(tmp_path / "code", "lmdb", 1000, 10)
    m = mix([web, code], [0.6, 0.4], samples_per_epoch=76, seed=3)  # the rest splits evenly

    def loader(rank, world):
        return make_loader(
            m, 4, shuffle=True, num_workers=0, seed=5, rank=rank, world_size=world,
            distributed=True, block_size=4,
        )  # fmt: skip

    seen, states = [], []
    for rank in range(before):
        first = loader(rank, before)
        it = iter(first)
        seen += [int(x) for _ in range(2) for x in next(it)[:, 0]]
        states.append(first.state_dict())
    shares = []
    for rank in range(after):
        resumed = loader(rank, after)
        resumed.load_state_dict(states[0])
        shares.append([int(x) for b in resumed for x in b[:, 0]])
    assert len({len(s) for s in shares}) == 1  # equal shares
    m.set_epoch(0)
    assert sorted(seen + [x for s in shares for x in s]) == sorted(int(w[0]) for w in m[:])


def test_a_mixture_of_image_packs_and_a_folder_read_in_place(tmp_path):
    from unit_sources import write_images

    write_images(tmp_path / "a", {"cat": 6, "dog": 6}, size=(8, 8))
    write_images(tmp_path / "b", {"cat": 3, "dog": 3}, size=(8, 8), seed=1)
    gpufeed.pack(tmp_path / "a", tmp_path / "a.lmdb", format="lmdb", quiet=True)
    packed = gpufeed.open_dataset(tmp_path / "a.lmdb")
    in_place = gpufeed.open_dataset(tmp_path / "b", index_dir=tmp_path / "index")
    m = mix({"packed": packed, "folder": in_place}, {"packed": 0.5, "folder": 0.5})
    assert m.counts() == {"packed": 9, "folder": 9}
    batches = list(make_loader(m, 6, num_workers=2, shuffle=True, seed=0))
    assert sum(len(b.labels) for b in batches) == 18
    assert all(b.samples.shape[1:] == (3, 8, 8) for b in batches)


def _docs_pack(path, fmt, docs):
    with gpufeed.Writer(path, fmt, schema={"tokens": "uint16[-1]"}) as w:
        for d in docs:
            w.write({"tokens": d})
    return path


@pytest.mark.parametrize("boundaries", [False, True])
def test_token_windows_are_gathered_once_per_source_into_one_batch(tmp_path, boundaries):
    rng = np.random.default_rng(4)
    docs = [[rng.integers(0, 60000, n).astype(np.uint16) for n in rng.integers(1, 90, k)]
            for k in (40, 25)]  # fmt: skip
    packs = [
        _docs_pack(tmp_path / "a", "mmap", docs[0]),
        _docs_pack(tmp_path / "b", "lmdb", docs[1]),
    ]
    opts = {"block_size": 16, "eos": 3, "boundaries": boundaries, "pad_id": 9}
    sources = {
        "a": gpufeed.open_dataset(packs[0], **opts),
        "b": gpufeed.open_dataset(packs[1], **opts),
    }
    field = "source" if boundaries else None  # tensor rows cannot be tagged
    m = mix(sources, {"a": 0.6, "b": 0.4}, samples_per_epoch=50, seed=1, source_field=field)
    assert m.windows
    calls = Counter()
    for name, s in sources.items():
        for method in ("plan", "fill"):
            real = getattr(s, method)
            setattr(
                s,
                method,
                lambda *a, _r=real, _k=(name, method), **k: calls.update([_k]) or _r(*a, **k),
            )
    order = [7, 3, 49, 0, 3, 21, 22]
    got = m[order]
    assert calls == {("a", "plan"): 1, ("a", "fill"): 1, ("b", "plan"): 1, ("b", "fill"): 1}
    src, local = m.locate(order)
    for g, i, j in zip(got, src.tolist(), local.tolist(), strict=True):
        want = sources[m.names[i]][j]
        if boundaries:
            assert g["source"] == m.names[i]
            assert torch.equal(g["tokens"], want["tokens"]) and torch.equal(g["mask"], want["mask"])
        else:
            assert g.dtype == torch.uint16 and torch.equal(g, want)


def test_windows_of_different_shapes_mix_sample_by_sample(tmp_path):
    a = gpufeed.open_dataset(_docs_pack(tmp_path / "a", "mmap", [np.arange(64, dtype=np.uint16)]),
                             block_size=8)  # fmt: skip
    b = gpufeed.open_dataset(_docs_pack(tmp_path / "b", "mmap", [np.arange(64, dtype=np.uint16)]),
                             block_size=4)  # fmt: skip
    m = mix([a, b], [0.5, 0.5])
    assert not m.windows
    got = m[list(range(len(m)))]
    assert sorted(len(x) for x in got) == [4] * 12 + [8] * 12  # 24 draws, half each
    src, local = m.locate(list(range(len(m))))
    for g, i, j in zip(got, src.tolist(), local.tolist(), strict=True):
        assert torch.equal(g, [a, b][i][j])
