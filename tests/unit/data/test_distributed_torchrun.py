"""Real 2-process torchrun (gloo, CPU): sharding, per-epoch order and mid-epoch resumption;
a streamed tar pack of 11 uneven shards trained in lockstep (an all_reduce a step).

Run as a script by torchrun (see ``_rank_main``); the test launches it and checks what rank 0
gathered from both ranks.
"""

import datetime
import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest

pytestmark = pytest.mark.slow  # torchrun starts real ranks

N, BATCH, SHARDS = 103, 8, [f"shard-{i:03d}.tar" for i in range(10)]
STOP_AFTER = {0: 3, 1: 5}  # batches each rank consumes before "crashing" in epoch 2
UNEVEN, UNEVEN_SHARD, UNEVEN_BATCH = 1001, 100, 16  # 11 shards: whole ones gave 600 and 401


def _tar_epochs(tar_path, rank):
    """Full epoch 1 of gpufeed tar shards on this rank, and a resumed copy of it."""
    import gpufeed
    from gpufeed.loading.make import make_loader

    def keys(batch):
        return [s.numpy().tobytes().hex() for s in batch.samples]

    dl = make_loader(gpufeed.open_dataset(tar_path, map_style=False), 4, num_workers=0, seed=2)
    dl.set_epoch(1)
    full = [k for b in dl for k in keys(b)]
    dl.set_epoch(1)
    before = []
    for k, b in enumerate(dl):
        before += keys(b)
        if k + 1 == STOP_AFTER[rank]:
            state = dl.state_dict()
            break
    resumed = make_loader(gpufeed.open_dataset(tar_path, map_style=False), 4, num_workers=0, seed=2)
    resumed.load_state_dict(state)
    return {"full": full, "before": before, "after": [k for b in resumed for k in keys(b)]}


def _lockstep(uneven_path):
    """For 0 and 2 workers: the steps of an epoch of the 11-shard stream, each step an
    all_reduce (a rank that ran out would leave the other waiting: gloo's timeout), and the
    samples this rank trained on."""
    import torch
    import torch.distributed as dist

    import gpufeed
    from gpufeed.loading.make import make_loader

    runs = {}
    for workers in (0, 2):
        ds = gpufeed.open_dataset(uneven_path, map_style=False)
        dl = make_loader(ds, UNEVEN_BATCH, num_workers=workers, seed=4)
        steps, seen = 0, []
        for batch in dl:
            total = torch.tensor([1])
            dist.all_reduce(total)  # both ranks take this step
            assert int(total) == 2
            steps += 1
            seen += batch["i"].flatten().tolist()
        dist.barrier()
        runs[workers] = {"steps": steps, "seen": seen}
    return runs


def _rank_main(out_path, tar_path, uneven_path):
    import torch
    import torch.distributed as dist

    from gpufeed.data.distributed import split_shards
    from gpufeed.loading.make import make_loader

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return torch.tensor([i]), i

    # a rank left waiting fails in seconds, not gloo's default 30 minutes
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    ds = DS()

    def labels(batch):
        return [int(i) for i in batch[1]]

    dl = make_loader(ds, BATCH, shuffle=True, num_workers=0, block_size=4, seed=5)
    epochs = [[i for b in dl for i in labels(b)] for _ in range(2)]  # epochs 0 and 1

    dl = make_loader(ds, BATCH, shuffle=True, num_workers=1, block_size=4, seed=5)
    dl.set_epoch(2)
    full2 = [i for b in dl for i in labels(b)]
    dl.set_epoch(2)
    before = []
    for k, b in enumerate(dl):
        before += labels(b)
        if k + 1 == STOP_AFTER[rank]:
            state = json.loads(json.dumps(dl.state_dict()))  # as a checkpoint would
            break
    del dl
    resumed = make_loader(ds, BATCH, shuffle=True, num_workers=1, block_size=4, seed=5)
    resumed.load_state_dict(state)
    after = [i for b in resumed for i in labels(b)]

    mine = {
        "rank": rank,
        "world": dist.get_world_size(),
        "sampler": type(resumed.sampler).__name__,
        "epochs": epochs,
        "full2": full2,
        "before": before,
        "after": after,
        "state": state,
        "shards": split_shards(SHARDS, seed=1, epoch=0),
        "tar": _tar_epochs(tar_path, rank),
        "lockstep": _lockstep(uneven_path),
    }
    gathered = [None, None]
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tar_pack(tmp_path_factory):
    from unit_sources import write_arrays

    import gpufeed

    root = tmp_path_factory.mktemp("torchrun_tar")
    write_arrays(root / "src", {"x": 30, "y": 25}, shape=(3, 4, 4))
    gpufeed.pack(root / "src", root / "tar", "tar", quiet=True, workers=1, shard_size=5)
    return root / "tar"


def _uneven_pack(tmp_path_factory):
    """1001 samples {"i": [i]} in 11 tar shards, written by gpufeed's Writer."""
    import numpy as np

    import gpufeed

    dest = tmp_path_factory.mktemp("torchrun_uneven") / "tar"
    with gpufeed.Writer(dest, format="tar", shard_size=UNEVEN_SHARD) as w:
        for i in range(UNEVEN):
            w.write({"i": np.array([i], dtype=np.int64)})
    return dest


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun") / "gathered.json"
    tar = _tar_pack(tmp_path_factory)
    uneven = _uneven_pack(tmp_path_factory)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        __file__, str(out), str(tar), str(uneven),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def _counts_once_plus_padding(seen):
    counts = Counter(seen)
    assert set(counts) == set(range(N))
    total = -(-N // 2) * 2  # DistributedSampler-style padding to a multiple of the world
    assert sum(counts.values()) == total
    assert sum(c - 1 for c in counts.values()) == total - N


def test_ranks_are_sharded_by_torch_distributed(ranks):
    assert [r["rank"] for r in ranks] == [0, 1] and {r["world"] for r in ranks} == {2}
    assert {r["sampler"] for r in ranks} == {"DistributedBlockSampler"}


@pytest.mark.parametrize("epoch", [0, 1])
def test_each_epoch_covers_every_sample_once_across_ranks(ranks, epoch):
    assert len(ranks[0]["epochs"][epoch]) == len(ranks[1]["epochs"][epoch]) == -(-N // 2)
    _counts_once_plus_padding(ranks[0]["epochs"][epoch] + ranks[1]["epochs"][epoch])


def test_order_changes_across_epochs(ranks):
    for r in ranks:
        assert r["epochs"][0] != r["epochs"][1]


def test_resume_yields_exactly_the_unseen_samples_on_every_rank(ranks):
    for r in ranks:
        assert len(r["before"]) == STOP_AFTER[r["rank"]] * BATCH
        assert r["state"]["samples_seen"] == len(r["before"])
        assert r["before"] + r["after"] == r["full2"]
    _counts_once_plus_padding([i for r in ranks for i in r["before"] + r["after"]])


def test_split_shards_reads_rank_from_torch_distributed(ranks):
    parts = [r["shards"] for r in ranks]
    assert sorted(parts[0] + parts[1]) == SHARDS and not set(parts[0]) & set(parts[1])


def test_tar_shards_under_ddp_cover_once_and_resume_per_rank(ranks):
    full = [k for r in ranks for k in r["tar"]["full"]]
    # equal shares of the 55 samples: 27 a rank, the one left over unread this epoch
    assert len(full) == len(set(full)) == 54
    assert len(ranks[0]["tar"]["full"]) == len(ranks[1]["tar"]["full"])
    for r in ranks:
        t = r["tar"]
        assert len(t["before"]) == 4 * STOP_AFTER[r["rank"]]
        assert t["before"] + t["after"] == t["full"]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_a_streamed_pack_of_uneven_shards_trains_in_lockstep(ranks, workers):
    """Issue 38: whole shards gave the ranks 38 and 26 batches; rank 1 stopped and the job
    died on gloo's timeout. Every rank now takes the same steps, each sample at most once."""
    runs = [r["lockstep"][workers] for r in ranks]
    per_rank = UNEVEN // 2
    # 500 a rank: 32 batches of 16 in one stream, or 2 x 16 from two workers of 250 each
    assert runs[0]["steps"] == runs[1]["steps"] == 32
    seen = runs[0]["seen"] + runs[1]["seen"]
    assert len(seen) == len(set(seen)) == per_rank * 2  # the one left over: unread
    assert set(seen) <= set(range(UNEVEN))


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2], sys.argv[3])
