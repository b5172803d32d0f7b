"""Two ranks on one node share one cache while streaming a pack from a real S3 server (rclone
on 127.0.0.1): each rank fetches only the shards it reads, no file is downloaded twice, and
block-shuffled map-style reads fetch each shard once per epoch even when the cache holds only
a few of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gpufeed.data.open import open_dataset
from gpufeed.loading.make import make_loader
from gpufeed.storage import upload_pack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

RANK = textwrap.dedent(
    """
    import json, sys
    from gpufeed.data.open import open_dataset
    url, cache, rank = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ds = open_dataset(
        url, cache_dir=cache, map_style=False, rank=rank, world_size=2, shuffle_buffer=0
    )
    mine = [ds.reader.shards[s] for s in ds.my_shards()]
    labels = [int(y) for _, y in ds]
    print(json.dumps({"shards": mine, "n": len(labels), "stats": ds.reader.source.stats.as_dict()}))
    """
)


@pytest.fixture(scope="module")
def nine_shards(pack_factory):
    return pack_factory("tar", shard_size=2)  # 17 samples: 9 shards


def test_two_ranks_share_a_node_cache_and_fetch_only_their_shards(
    s3, nine_shards, tmp_path, python_env
):
    upload_pack(nine_shards, f"{s3}/train")
    cache = tmp_path / "node-cache"
    env = {**os.environ, **python_env}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, f"{s3}/train", str(cache), str(rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err
        results.append(json.loads(out))
    size = {p.name: p.stat().st_size for p in nine_shards.iterdir()}
    r0, r1 = results
    assert not set(r0["shards"]) & set(r1["shards"])
    assert sorted(r0["shards"] + r1["shards"]) == sorted(n for n in size if n.endswith(".tar"))
    assert r0["n"] == r1["n"] == 8  # equal shares (issue 38): the 17th is unread this epoch
    for r in results:  # a rank fetched its shards and, maybe, the index: nothing else
        fetched = r["stats"]["bytes_fetched"] - sum(size[n] for n in r["shards"])
        assert fetched in (0, size["index.npz"]), r
    # the index was needed by both and downloaded once: the other rank found it landed
    total = sum(r["stats"]["bytes_fetched"] for r in results)
    assert total == sum(size[n] for n in size if n.endswith(".tar")) + size["index.npz"]
    assert sum(r["stats"]["misses"] for r in results) == 10
    assert sum(r["stats"]["hits"] for r in results) >= 1


def test_block_shuffle_fetches_each_shard_once_per_epoch(s3, nine_shards, tmp_path):
    upload_pack(nine_shards, f"{s3}/train")
    shard = max((nine_shards / n).stat().st_size for n in os.listdir(nine_shards))
    # room for the index and 5 shards: 4 open in the reader, one arriving
    ds = open_dataset(
        f"{s3}/train", cache_dir=tmp_path / "c", cache_limit=7 * shard, map_style=True
    )
    stats = ds.reader.source.stats
    loader = make_loader(ds, 2, shuffle=True, num_workers=0, block_size=2, buffer_blocks=1, seed=3)
    seen = torch.cat([b.labels for b in loader])
    assert len(seen) == 17
    # every file downloaded once (a block is one shard's run), though the cache cannot hold
    # the pack: shards read are let go and evicted, the ones to come were fetched ahead
    read = [*nine_shards.glob("*.tar"), nine_shards / "index.npz"]
    assert stats.bytes_fetched == sum(p.stat().st_size for p in read)
    assert stats.evictions > 0  # the cache did not hold the pack: reads stayed in few shards
