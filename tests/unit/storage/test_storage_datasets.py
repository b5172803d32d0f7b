"""Packs read from a real S3 server (rclone on 127.0.0.1) through open_dataset, make_loader,
verify, inspect and the CLI: the same samples as the local pack, shards fetched ahead of the
order they are read in, a second epoch from the cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpufeed.data.open import open_dataset
from gpufeed.errors import CacheFullError, NotPackedError, StorageError, UsageError
from gpufeed.loading.make import make_loader
from gpufeed.storage import upload_pack
from gpufeed.tools.verify import inspect, verify
from gpufeed.write.pack import pack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def samples_of(dataset) -> dict[int, tuple[bytes, int]]:
    """Every sample by its index in the pack: (its bytes, its label)."""
    out = {}
    for i in range(len(dataset)):
        x, y = dataset[i]
        out[i] = (x.numpy().tobytes(), int(y))
    return out


def stream_sorted(dataset) -> list[tuple[bytes, int]]:
    return sorted((x.numpy().tobytes(), int(y)) for x, y in dataset)


@pytest.fixture(scope="module")
def packs(array_folder, tmp_path_factory):
    """A local pack of each format, over the same 17 array samples."""
    root = tmp_path_factory.mktemp("fmt")
    out = {}
    for fmt in ("tar", "hdf5", "lmdb", "mmap"):
        extra = {"shard_size": 4} if fmt == "tar" else {}
        pack(array_folder, root / fmt, fmt, quiet=True, **extra)
        out[fmt] = root / fmt
    return out


def test_a_tar_pack_streams_from_the_store_and_a_second_epoch_reads_the_cache(s3, packs, tmp_path):
    upload_pack(packs["tar"], f"{s3}/train")
    remote = open_dataset(
        f"{s3}/train", cache_dir=tmp_path / "c", cache_limit="10MB", map_style=False
    )
    local = open_dataset(packs["tar"], map_style=False)
    assert stream_sorted(remote) == stream_sorted(local)
    stats = remote.reader.source.stats
    shard_bytes = sum((packs["tar"] / n).stat().st_size for n in remote.shards)
    index_bytes = (packs["tar"] / "index.npz").stat().st_size
    assert stats.bytes_fetched == shard_bytes + index_bytes  # each file once
    assert stats.misses == len(remote.shards) + 1
    remote.set_epoch(1)
    assert stream_sorted(remote) == stream_sorted(local)  # epoch 2: the cache, no fetch
    assert stats.bytes_fetched == shard_bytes + index_bytes


def test_shards_are_fetched_in_the_order_they_are_read(s3, packs, tmp_path, monkeypatch):
    upload_pack(packs["tar"], f"{s3}/train")
    ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", map_style=False, shuffle_buffer=0)
    asked = []
    real = ds.reader.source.fetch_ahead
    monkeypatch.setattr(
        ds.reader.source,
        "fetch_ahead",
        lambda names, **kw: asked.append(names) or real(names, **kw),
    )
    labels = [int(y) for _, y in ds]
    order = [ds.reader.shards[s] for s in ds.my_shards()]
    assert asked == [order]
    ranges = [slice(*ds.reader.shard_range(s)) for s in ds.my_shards()]
    want = np.concatenate([ds.reader.labels[r] for r in ranges])
    assert labels == want.tolist()  # read in the order fetched


@pytest.mark.parametrize("fmt", ["tar", "hdf5", "lmdb", "mmap"])
def test_every_format_reads_the_same_samples_map_style(s3, packs, tmp_path, fmt):
    upload_pack(packs[fmt], f"{s3}/{fmt}")
    remote = open_dataset(f"{s3}/{fmt}", cache_dir=tmp_path / "c", map_style=True)
    local = open_dataset(packs[fmt], map_style=True)
    assert samples_of(remote) == samples_of(local)


def test_a_single_file_pack_larger_than_cache_limit_is_refused_naming_it(s3, packs, tmp_path):
    upload_pack(packs["hdf5"], f"{s3}/h")
    size = max(p.stat().st_size for p in packs["hdf5"].iterdir())
    with pytest.raises(CacheFullError, match="cache_limit"):
        open_dataset(f"{s3}/h", cache_dir=tmp_path / "c", cache_limit=size // 2)
    assert not list((tmp_path / "c" / "objects").rglob("*.part"))


def test_make_loader_with_workers_delivers_each_sample_once(s3, packs, tmp_path):
    upload_pack(packs["tar"], f"{s3}/train")
    for map_style in (False, True):
        ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", map_style=map_style)
        loader = make_loader(ds, 3, shuffle=True, num_workers=2, seed=1)
        labels = torch.cat([b.labels for b in loader])
        assert sorted(labels.tolist()) == sorted(ds.reader.labels.tolist())


def test_verify_and_inspect_read_a_url(s3, packs, tmp_path, rclone_server):
    upload_pack(packs["tar"], f"{s3}/train")
    report = verify(f"{s3}/train", cache_dir=tmp_path / "c")
    assert report.ok and report.samples_checked == 17
    info = inspect(f"{s3}/train", cache_dir=tmp_path / "c")
    assert (info["format"], info["count"], info["shards"]) == ("tar", 17, 5)
    files = json.loads((packs["tar"] / "manifest.json").read_text())["files"]
    assert info["size_bytes"] == sum(f["bytes"] for f in files.values()) > 0
    # a shard changed in the store: verify names it
    rclone_server.put(f"{s3}/train/shard-000002.tar", b"x" * 10240)
    bad = verify(f"{s3}/train", cache_dir=tmp_path / "c2")
    assert not bad.ok
    assert any("shard-000002.tar" in p.file for p in bad.problems)


def test_the_cli_takes_a_url_and_checks_the_cache_options(s3, packs, tmp_path, python_env):
    upload_pack(packs["tar"], f"{s3}/train")
    import os

    env = {**os.environ, **python_env}
    run = [sys.executable, "-m", "gpufeed"]
    out = subprocess.run(
        [*run, "inspect", f"{s3}/train", "--json", "--cache-dir", str(tmp_path / "c")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["count"] == 17
    out = subprocess.run(
        [*run, "verify", f"{s3}/train", "-q", "--cache-limit", "lots"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2 and "--cache-limit='lots'" in out.stderr
    out = subprocess.run(
        [*run, "bench", "s3:/bucket/x", "-q"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 2 and "lost a slash" in out.stderr
    out = subprocess.run(
        [*run, "bench", f"{s3}/train", "-q", "--json", "--seconds", "1", "--workers", "0",
         "--cache-dir", str(tmp_path / "c")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr


def test_pack_into_a_url_stages_locally_then_uploads_manifest_last(
    s3, array_folder, tmp_path, rclone_server, monkeypatch
):
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    manifest = pack(array_folder, f"{s3}/p", "tar", shard_size=4, quiet=True)
    keys = rclone_server.keys(f"{s3}/p")
    assert "manifest.json" in keys and set(manifest["files"]) <= set(keys)
    assert not (tmp_path / "cache" / "staging" / "s3").exists() or not any(
        (tmp_path / "cache" / "staging" / "s3").rglob("manifest.json")
    )  # the staged copy is gone
    ds = open_dataset(f"{s3}/p", cache_dir=tmp_path / "c", map_style=True)
    assert len(ds) == 17
    # a second pack into the same URL is refused before any packing, and allowed with overwrite
    with pytest.raises(UsageError, match="already holds a pack"):
        pack(array_folder, f"{s3}/p", "tar", quiet=True, staging_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()
    pack(array_folder, f"{s3}/p", "hdf5", quiet=True, overwrite=True)
    assert open_dataset(f"{s3}/p", cache_dir=tmp_path / "c").manifest["format"] == "hdf5"


def test_a_reader_never_sees_a_half_uploaded_pack(s3, array_folder, tmp_path, monkeypatch):
    """The upload fails after the data files (the manifest never goes up): the URL is no pack."""
    import gpufeed.storage.upload as upload

    def broken(loc, sizes, listed, after):
        raise StorageError("cut here")

    with monkeypatch.context() as patched:
        patched.setattr(upload, "check_listed_sizes", broken)
        with pytest.raises(StorageError, match="cut here"):
            pack(array_folder, f"{s3}/half", "tar", quiet=True, staging_dir=tmp_path / "stage")
    with pytest.raises(NotPackedError, match="upload is unfinished"):
        open_dataset(f"{s3}/half", cache_dir=tmp_path / "c")
    with pytest.raises(UsageError, match="no manifest.json"):  # a new pack there: not ours
        pack(array_folder, f"{s3}/half", "hdf5", quiet=True, staging_dir=tmp_path / "s2")
    # the staged pack is still there, finished: resume uploads it without packing again
    manifest = pack(
        array_folder, f"{s3}/half", "tar", quiet=True, staging_dir=tmp_path / "stage",
        resume=True, overwrite=False,
    )  # fmt: skip
    assert manifest["count"] == 17
    assert len(open_dataset(f"{s3}/half", cache_dir=tmp_path / "c")) == 17


def test_the_cli_packs_into_a_url(s3, array_folder, tmp_path, python_env, rclone_server):
    import os

    env = {**os.environ, **python_env, "GPUFEED_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "gpufeed", "pack", str(array_folder), f"{s3}/cli", "-f", "lmdb"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"packed 17 samples into {s3}/cli" in out.stdout
    assert "manifest.json" in rclone_server.keys(f"{s3}/cli")
    assert not Path("s3:").exists()


def _warm_threads() -> int:
    import threading

    return sum(t.name.startswith("gpufeed-warm") for t in threading.enumerate())


def test_reads_ahead_start_fetches_only_for_files_missing_from_the_cache(s3, packs, tmp_path):
    upload_pack(packs["tar"], f"{s3}/warm")
    cold = open_dataset(f"{s3}/warm", cache_dir=tmp_path / "c", map_style=True)
    files, names = cold.reader.source, list(cold.reader.shards)
    files.warm(names[:1])  # a miss: a fetch ahead starts
    assert _warm_threads() >= 1
    files.close()
    assert files.pack.cached(names[0]) and not files.pack.cached(names[1])
    samples_of(cold)  # every shard lands in the cache
    cold.reader.source.close()

    before = _warm_threads()
    warm = open_dataset(f"{s3}/warm", cache_dir=tmp_path / "c", map_style=True)
    warm.reader.source.warm(names)  # all cached: no thread, no pin, no fetch
    assert _warm_threads() == before
    assert warm.reader.source.stats.misses == 0
    assert samples_of(warm) == samples_of(open_dataset(packs["tar"], map_style=True))
    assert warm.reader.source.stats.misses == 0


def test_reads_ahead_ask_for_shards_in_the_order_they_will_be_read(s3, packs, tmp_path):
    upload_pack(packs["tar"], f"{s3}/order")
    ds = open_dataset(f"{s3}/order", cache_dir=tmp_path / "c", map_style=True)
    reader, asked = ds.reader, []
    reader.source.warm = asked.append
    last, first = reader.shard_range(len(reader.shards) - 1), reader.shard_range(0)
    reader.read_ahead(np.array([last[0], first[0], last[0], first[0] + 1]))
    assert asked == [[reader.shards[-1], reader.shards[0]]]  # first seen first, each once


@pytest.mark.parametrize("limit", [None, "64KB"])
def test_a_map_style_tar_pack_keeps_its_shards_open_within_the_pin_budget(
    s3, packs, tmp_path, monkeypatch, limit
):
    """A cache epoch that fits reopens no shard (each reopen maps the shard anew); past the
    pin budget (a share of cache_limit) the shards read before are closed and unpinned, so
    the cache can evict them: only the shard read now stays open."""
    from gpufeed.formats.tar import reader as tar
    from gpufeed.storage import packs as storage_packs

    monkeypatch.setattr(storage_packs, "PIN_SHARE", 64)  # 64 KB: a budget of 1 KB
    upload_pack(packs["tar"], f"{s3}/train")
    ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", cache_limit=limit)
    reader, n = ds.reader, len(ds)
    shards = len(reader.shards)
    assert shards > 1
    opened = []
    real = tar.TarReader._shard_path
    monkeypatch.setattr(
        tar.TarReader, "_shard_path", lambda self, s: opened.append(s) or real(self, s)
    )
    for _ in range(2):  # two epochs, in storage order, a few samples a batch
        for start in range(0, n, 3):
            reader.read_batch(np.arange(start, min(n, start + 3)))
    open_now = reader.handle["remote"]
    if limit is None:  # everything fits the budget: each shard opened once, all still open
        assert sorted(opened) == list(range(shards)) and len(open_now) == shards
    else:  # over budget: only the shard read now stays open, the others reopen in epoch 2
        assert reader._shard_bytes(list(range(shards))) > reader.source.pin_budget() == 1000
        assert len(open_now) == 1 and len(opened) > shards
