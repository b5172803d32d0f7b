"""Real 2-process torchrun (gloo, CPU): sharding, per-epoch order and mid-epoch resumption.

Run as a script by torchrun (see ``_rank_main``); the test launches it and checks what rank 0
gathered from both ranks.
"""

import json
import os
import socket
import subprocess
import sys
from collections import Counter

import pytest

N, BATCH, SHARDS = 103, 8, [f"shard-{i:03d}.tar" for i in range(10)]
STOP_AFTER = {0: 3, 1: 5}  # batches each rank consumes before "crashing" in epoch 2


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


def _rank_main(out_path, tar_path):
    import torch
    import torch.distributed as dist

    from gpufeed.data.distributed import split_shards
    from gpufeed.loading.make import make_loader

    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return torch.tensor([i]), i

    dist.init_process_group("gloo")
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


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("torchrun") / "gathered.json"
    tar = _tar_pack(tmp_path_factory)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
        __file__, str(out), str(tar),
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
    assert len(full) == len(set(full)) == 55  # whole shards per rank: no padding needed
    for r in ranks:
        t = r["tar"]
        assert len(t["before"]) == 4 * STOP_AFTER[r["rank"]]
        assert t["before"] + t["after"] == t["full"]


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
