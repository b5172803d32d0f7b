"""The tutorial line over a URL: `open_dataset("s3://...", cache_dir=...)` read by a plain torch
DataLoader (shuffle, pin_memory, workers forked as on Linux by default, or spawned) delivers
every sample exactly once, for every format, from a real S3 server (rclone on 127.0.0.1).

A forked worker cannot use obstore (its tokio runtime does not survive a fork): it fetches
through a helper process (storage/helper.py). Before that helper, such a worker raised
StorageError on its first miss; a worker that hangs fails here by the timeout."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader

from gpufeed.data.open import open_dataset
from gpufeed.errors import ObjectNotFoundError
from gpufeed.storage import upload_pack
from gpufeed.write.pack import pack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FORMATS = ("tar", "hdf5", "lmdb", "mmap")
# (num_workers, multiprocessing_context): in-process, forked (Linux's default), spawned
READERS = [(0, None), (2, "fork"), (2, "spawn")]


@pytest.fixture(scope="module")
def packs(array_folder, tmp_path_factory):
    """A local pack of each format over the same 17 array samples (tar: 5 shards)."""
    root = tmp_path_factory.mktemp("tutorial")
    for fmt in FORMATS:
        extra = {"shard_size": 4} if fmt == "tar" else {}
        pack(array_folder, root / fmt, fmt, quiet=True, **extra)
    return root


def samples(batches) -> list[tuple[bytes, int]]:
    """Each sample of default-collated (x, y) batches as (its bytes, its label), sorted."""
    out = []
    for x, y in batches:
        out += [(xi.numpy().tobytes(), int(yi)) for xi, yi in zip(x, y, strict=True)]
    return sorted(out)


def tutorial_loader(ds, workers: int, context: str | None) -> DataLoader:
    return DataLoader(
        ds,
        batch_size=4,
        shuffle=True,
        num_workers=workers,
        pin_memory=True,
        multiprocessing_context=context,
        persistent_workers=context == "spawn",  # each spawned worker imports torch: seconds
    )


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")  # no accelerator here
@pytest.mark.parametrize(("workers", "context"), READERS, ids=["0", "fork", "spawn"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_tutorial_line_over_a_url_reads_every_sample_once(
    s3, packs, tmp_path, fmt, workers, context
):
    url = f"{s3}/{fmt}"
    upload_pack(packs / fmt, url)
    ds = open_dataset(url, cache_dir=tmp_path / "cache", map_style=True)
    want = samples(tutorial_loader(open_dataset(packs / fmt, map_style=True), 0, None))
    assert len(want) == 17 and len(set(want)) == 17  # distinct: a duplicate would show
    loader = tutorial_loader(ds, workers, context)
    for _ in range(2):  # the second epoch reads the cache (forked workers: new ones)
        assert samples(loader) == want


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
def test_forked_workers_fetch_what_the_parent_never_did(s3, packs, tmp_path):
    """Tar shards are fetched only when read: here every one by a forked worker's helper."""
    upload_pack(packs / "tar", f"{s3}/tar")
    ds = open_dataset(f"{s3}/tar", cache_dir=tmp_path / "cache", map_style=True)
    shards = [tmp_path / "cache" / "packs" / "s3" / s3[5:] / "tar" / n for n in ds.reader.shards]
    assert not any(os.path.exists(s) for s in shards)  # the parent fetched the index only
    batches = list(tutorial_loader(ds, 2, "fork"))
    assert len(samples(batches)) == 17
    assert all(os.path.exists(s) for s in shards)  # linked into the view by the workers
    assert torch.is_tensor(batches[0][0])


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
def test_a_forked_workers_fetch_error_names_the_object(s3, packs, tmp_path, rclone_server):
    """The helper's error reaches the worker, and the loader, as the same gpufeed error."""
    upload_pack(packs / "tar", f"{s3}/tar")
    ds = open_dataset(f"{s3}/tar", cache_dir=tmp_path / "cache", map_style=True)
    missing = ds.reader.shards[-1]
    rclone_server.delete(f"{s3}/tar/{missing}")
    with pytest.raises(ObjectNotFoundError, match=f"{missing}: no such object"):
        list(tutorial_loader(ds, 2, "fork"))
