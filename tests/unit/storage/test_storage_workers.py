"""DataLoader workers over a remote map-style pack: obstore's tokio runtime does not survive a
fork, so a worker forked from a parent that used the store would wait for ever on its first
request. make_loader spawns workers once the process has used object storage, and a worker
forked anyway says so at once instead of hanging."""

from __future__ import annotations

import pytest
import torch

from gpufeed.data.open import open_dataset
from gpufeed.errors import StorageError
from gpufeed.loading.make import make_loader
from gpufeed.storage import upload_pack
from gpufeed.tools.timing import stop_workers


def remote_loader(s3, tar_pack, tmp_path, context):
    upload_pack(tar_pack, f"{s3}/train")
    ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", map_style=True)
    # shuffled batches touch several shards each, so the parent fetches ahead in threads too
    loader = make_loader(
        ds, 3, shuffle=True, num_workers=2, seed=1, multiprocessing_context=context
    )
    return ds, loader


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", [None, "spawn"])
def test_workers_read_a_remote_map_style_pack(s3, tar_pack, tmp_path, context):
    ds, loader = remote_loader(s3, tar_pack, tmp_path, context)
    assert loader.plan.multiprocessing_context == "spawn"  # the default too, for a URL dataset
    try:
        for _ in range(2):  # the second epoch reads the cache
            labels = torch.cat([b.labels for b in loader])
            assert sorted(labels.tolist()) == sorted(ds.reader.labels.tolist())
    finally:
        stop_workers(loader)  # persistent workers would outlive the test


@pytest.mark.timeout(120)
def test_a_forked_worker_names_the_problem_instead_of_hanging(s3, tar_pack, tmp_path):
    ds, loader = remote_loader(s3, tar_pack, tmp_path, "fork")
    ds.on_error = "skip"  # a store that cannot be used is never a corrupt sample
    try:
        with pytest.raises(StorageError, match="forked from one .* that had used object storage"):
            list(loader)
    finally:
        stop_workers(loader)
