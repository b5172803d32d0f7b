"""make_loader's workers over a remote map-style pack: obstore's tokio runtime does not survive a
fork, so a worker forked from a parent that used the store fetches through a helper process
(storage/helper.py) instead of waiting for ever on its first request."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from gpufeed.data.open import open_dataset
from gpufeed.errors import StorageError
from gpufeed.loading.make import make_loader
from gpufeed.storage import upload_pack
from gpufeed.tools.timing import stop_workers

pytestmark = pytest.mark.slow


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
    assert loader.plan.multiprocessing_context == (context or "fork")  # fork: measured faster
    try:
        for _ in range(2):  # the second epoch reads the cache
            labels = torch.cat([b.labels for b in loader])
            assert sorted(labels.tolist()) == sorted(ds.reader.labels.tolist())
    finally:
        stop_workers(loader)  # persistent workers would outlive the test


@pytest.mark.timeout(120)
def test_a_forked_make_loader_worker_fetches_through_its_helper(s3, tar_pack, tmp_path):
    ds, loader = remote_loader(s3, tar_pack, tmp_path, "fork")
    ds.on_error = "skip"  # a store that cannot be used would not be a skipped sample either
    try:
        labels = torch.cat([b.labels for b in loader])
        assert sorted(labels.tolist()) == sorted(ds.reader.labels.tolist())
    finally:
        stop_workers(loader)


def test_a_forked_process_that_asks_the_store_directly_is_told_why(s3, tar_pack, tmp_path):
    """Only pack files go through the helper: a forked child's own request raises at once
    (obstore would wait for ever) and names the cause."""
    upload_pack(tar_pack, f"{s3}/train")
    ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", map_style=True)
    store = ds.reader.source.pack.store
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        with pytest.raises(StorageError, match="forked from one .* that had used object storage"):
            pool.apply(store.list)
