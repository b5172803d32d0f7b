"""gpufeed.merge of parts in object storage (write/merge_remote.py), against a real S3 server
(rclone serve s3 on 127.0.0.1): every format merged in the bucket by server-side copies, read
by open_dataset/verify/make_loader through the cache, every sample's content once and in
order; merging again changes nothing; a merge killed between copies leaves no readable pack
and a rerun finishes it; refusals name the part."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import gpufeed
from gpufeed.errors import DataError, NotPackedError, UnsafePathError, UsageError
from gpufeed.formats.manifest import MANIFEST_NAME
from gpufeed.storage import ObjectStore, parse_location, upload_pack
from gpufeed.write import merge_remote

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

FORMATS = ["tar", "hdf5", "lmdb", "mmap"]
SCHEMA = {"x": "uint8[4]", "label": "int"}


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """The cache open_dataset and merge read through: this test's own."""
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def upload_parts(tmp_path, url, fmt, sizes=(5, 0, 7, 3), schema=SCHEMA, **kw) -> list[str]:
    """Parts of samples 0, 1, ... in order (x = [i] * 4, label = i), each written locally
    and uploaded to URL/p<k>; their URLs. shard_size applies to tar parts only."""
    if fmt != "tar":
        kw.pop("shard_size", None)
    urls, first = [], 0
    for k, n in enumerate(sizes):
        local = tmp_path / "local" / f"p{k}"
        with gpufeed.Writer(local, format=fmt, schema=schema, **kw) as w:
            for i in range(first, first + n):
                w.write({"x": np.full(4, i % 256, np.uint8), "label": i})
        urls.append(f"{url}/p{k}")
        upload_pack(local, urls[-1])
        first += n
    return urls


def samples_of(where) -> list[tuple[int, list[int]]]:
    """(label, x) of every sample, in order."""
    ds = gpufeed.open_dataset(where)
    return [(int(ds[i]["label"]), [int(v) for v in ds[i]["x"]]) for i in range(len(ds))]


def expected(n: int) -> list[tuple[int, list[int]]]:
    return [(i, [i % 256] * 4) for i in range(n)]


def listing(url: str) -> dict[str, int]:
    return ObjectStore(parse_location(url)).list()


class Calls:
    """The store's own copy and put_bytes, counted (the real requests still run)."""

    def __init__(self, monkeypatch):
        self.copies: list[tuple[str, str]] = []
        self.puts: list[str] = []
        copy, put = ObjectStore.copy, ObjectStore.put_bytes

        def counted_copy(store, src, dst):
            self.copies.append((src, dst))
            return copy(store, src, dst)

        def counted_put(store, name, data):
            self.puts.append(name)
            return put(store, name, data)

        monkeypatch.setattr(ObjectStore, "copy", counted_copy)
        monkeypatch.setattr(ObjectStore, "put_bytes", counted_put)


@pytest.mark.parametrize("fmt", FORMATS)
def test_merge_in_the_bucket_every_format(s3, tmp_path, monkeypatch, cache, fmt):
    parts = upload_parts(tmp_path, f"{s3}/run", fmt, shard_size=3)
    dest = f"{s3}/run/merged"
    calls = Calls(monkeypatch)
    manifest = gpufeed.merge(parts, dest)
    assert manifest["count"] == 15 and manifest["format"] == fmt
    assert [r["path"] for r in manifest["merged_from"]] == parts
    assert samples_of(dest) == expected(15)  # in the parts' order, each sample once
    report = gpufeed.verify(dest)
    assert report.ok, report.problems
    assert report.samples_checked == 15
    assert report.files_checked == len(manifest["files"])
    assert gpufeed.inspect(dest)["count"] == 15
    # the data files were copied by the store, the manifest written last
    data = {n for n in manifest["files"] if n.endswith((".tar", ".h5", ".mdb", ".npy"))}
    assert data and data <= {dst.split("/merged/", 1)[1] for _, dst in calls.copies}
    assert calls.puts[-1] == f"run/merged/{MANIFEST_NAME}"
    listed = listing(dest)
    assert {n: e["bytes"] for n, e in manifest["files"].items()} == {
        n: s for n, s in listed.items() if n != MANIFEST_NAME
    }
    # the parts stay as they were
    assert samples_of(parts[2]) == expected(12)[5:]


def test_no_sample_byte_passes_through_the_client(s3, tmp_path):
    """The merge's own cache holds the tar parts' indexes, never a shard."""
    parts = upload_parts(tmp_path, f"{s3}/run", "tar", sizes=(40, 40), shard_size=8)
    merge_cache = tmp_path / "merge-cache"
    manifest = gpufeed.merge(parts, f"{s3}/run/m", cache_dir=merge_cache)
    fetched = sum(p.stat().st_size for p in merge_cache.rglob("*") if p.is_file() and
                  not p.is_symlink() and p.name != MANIFEST_NAME)  # fmt: skip
    shards = sum(e["bytes"] for n, e in manifest["files"].items() if n.endswith(".tar"))
    indexes = sum(listing(p)["index.npz"] for p in parts)
    assert shards > 4 * indexes
    assert fetched <= indexes + 4096  # the indexes (and the cache's own small files)


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_make_loader_rank_split_and_resume_on_a_merged_remote_pack(s3, tmp_path, fmt):
    parts = upload_parts(tmp_path, f"{s3}/run", fmt, sizes=(10, 6, 8), shard_size=4)
    dest = f"{s3}/run/merged"
    gpufeed.merge(parts, dest)
    kw = dict(batch_size=4, shuffle=True, num_workers=0, world_size=2, seed=3)
    seen = []
    for rank in range(2):
        loader = gpufeed.make_loader(gpufeed.open_dataset(dest), rank=rank, **kw)
        batches = [b for b in loader]
        for b in batches:  # every sample's content is its own
            assert all(
                (np.asarray(x) == int(y) % 256).all()
                for x, y in zip(b["x"], b["label"], strict=True)
            )
        seen.append([int(v) for b in batches for v in b["label"]])
    assert len(seen[0]) == len(seen[1]) == 12
    assert sorted(seen[0] + seen[1]) == list(range(24))
    # resume mid-epoch: the rest of rank 0's epoch, exactly
    loader = gpufeed.make_loader(gpufeed.open_dataset(dest), rank=0, **kw)
    it = iter(loader)
    before = [int(v) for _ in range(2) for v in next(it)["label"]]
    state = loader.state_dict()
    resumed = gpufeed.make_loader(gpufeed.open_dataset(dest), rank=0, **kw)
    resumed.load_state_dict(state)
    after = [int(v) for b in resumed for v in b["label"]]
    assert before + after == seen[0]


def test_merge_again_is_idempotent_and_a_changed_part_is_a_new_merge(s3, tmp_path, monkeypatch):
    parts = upload_parts(tmp_path, f"{s3}/run", "tar", sizes=(6, 6), shard_size=2)
    dest = f"{s3}/run/m"
    first = gpufeed.merge(parts, dest)
    calls = Calls(monkeypatch)
    assert gpufeed.merge(parts, dest) == first
    assert calls.copies == [] and calls.puts == []  # nothing written again
    with gpufeed.Writer(tmp_path / "p1new", format="tar", schema=SCHEMA) as w:
        w.write({"x": np.full(4, 100, np.uint8), "label": 100})
    upload_pack(tmp_path / "p1new", parts[1], overwrite=True)
    with pytest.raises(UsageError, match="already holds a pack; pass overwrite=True"):
        gpufeed.merge(parts, dest)
    manifest = gpufeed.merge(parts, dest, overwrite=True)
    assert samples_of(dest) == expected(6) + [(100, [100] * 4)]
    # the replaced pack's shards beyond the new ones are gone
    assert set(listing(dest)) == set(manifest["files"]) | {MANIFEST_NAME}


# the merge is killed (SIGKILL) in a child process at one of these points
KILL_POINTS = {"second-copy": ("copy", 2), "manifest": ("put_bytes", f"/m/{MANIFEST_NAME}")}
CHILD = """
import os, signal, sys
from gpufeed.storage.store import ObjectStore
import gpufeed
method, when, dest, parts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
real, calls = getattr(ObjectStore, method), []
def killing(store, *args):
    calls.append(args)
    if len(calls) == int(when) if when.isdigit() else args[0].endswith(when):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(store, *args)
setattr(ObjectStore, method, killing)
gpufeed.merge(parts, dest)
"""


@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_merge_killed_leaves_no_readable_half_pack(
    s3, tmp_path, python_env, monkeypatch, point, fmt
):
    parts = upload_parts(tmp_path, f"{s3}/run", fmt, sizes=(3, 4, 2), shard_size=2)
    dest = f"{s3}/run/m"
    method, when = KILL_POINTS[point]
    env = {**os.environ, **python_env}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, method, str(when), dest, *parts], env=env, timeout=120
    )
    assert run.returncode == -9
    assert listing(dest) and MANIFEST_NAME not in listing(dest)  # copies made, no manifest
    with pytest.raises(NotPackedError, match="unfinished"):
        gpufeed.open_dataset(dest)
    assert samples_of(parts[1]) == expected(7)[3:]  # the parts are untouched
    calls = Calls(monkeypatch)
    manifest = gpufeed.merge(parts, dest)  # again: finishes it
    assert samples_of(dest) == expected(9)
    assert gpufeed.verify(dest).ok
    assert calls.puts[-1].endswith(MANIFEST_NAME)
    written = {MANIFEST_NAME, "index.npz", "sources.txt"}  # written, not copied (tar's two)
    copies = sum(1 for n in manifest["files"] if n.rsplit("/", 1)[-1] not in written)
    if point == "manifest":  # every copy was made and is found so: none made again
        assert calls.copies == []
    else:
        assert 0 < len(calls.copies) < copies


def test_refusals_name_the_part(s3, tmp_path):
    run = f"{s3}/run"
    (a,) = upload_parts(tmp_path / "a", f"{run}/a", "tar", sizes=(2,))
    (b,) = upload_parts(tmp_path / "b", f"{run}/b", "mmap", sizes=(2,))
    with pytest.raises(UsageError, match=f"{b}: its format is mmap"):
        gpufeed.merge([a, b], f"{run}/m")
    (c,) = upload_parts(tmp_path / "c", f"{run}/c", "tar", (2,), {"x": "uint8[-1]", "label": "int"})
    with pytest.raises(UsageError, match=f"{c}: its sample is"):
        gpufeed.merge([a, c], f"{run}/m")
    with pytest.raises(NotPackedError, match=f"part {run}/nothing: no manifest.json"):
        gpufeed.merge([a, f"{run}/nothing"], f"{run}/m")
    with pytest.raises(UsageError, match="given twice"):
        gpufeed.merge([a, a], f"{run}/m")
    with pytest.raises(UsageError, match="cannot be, hold or lie inside DEST"):
        gpufeed.merge([a], f"{a}/inside")
    with pytest.raises(UsageError, match="cannot be, hold or lie inside DEST"):
        gpufeed.merge([a], run)
    with pytest.raises(UsageError, match="not in DEST's bucket"):
        gpufeed.merge([a], "s3://another-bucket/m")
    with pytest.raises(UsageError, match="is in object storage and .* is local"):
        gpufeed.merge([a, tmp_path / "a" / "local" / "p0"], f"{run}/m")
    with pytest.raises(UsageError, match="is in object storage and .* is local"):
        gpufeed.merge([a], tmp_path / "m")
    assert not listing(f"{run}/m")  # nothing was written by any of them


def test_an_untrusted_part_is_refused_before_anything_is_written(s3, tmp_path):
    run = f"{s3}/run"
    (a,) = upload_parts(tmp_path / "a", f"{run}/a", "tar", sizes=(4,), shard_size=2)
    (b,) = upload_parts(tmp_path / "b", f"{run}/b", "tar", sizes=(4,), shard_size=2)
    store = ObjectStore(parse_location(b))
    raw = store.read_bytes(MANIFEST_NAME)
    store.delete("shard-000001.tar")  # a part missing a file its manifest lists
    with pytest.raises(DataError, match=f"{b}/shard-000001.tar: is missing, the part's"):
        gpufeed.merge([a, b], f"{run}/m")
    crafted = json.loads(raw)
    crafted["files"]["../a/index.npz"] = crafted["files"].pop("index.npz")
    store.put_bytes(MANIFEST_NAME, json.dumps(crafted).encode())
    with pytest.raises(UnsafePathError, match="leads outside the pack"):
        gpufeed.merge([a, b], f"{run}/m")
    store.put_file("shard-000001.tar", tmp_path / "b" / "local" / "p0" / "shard-000001.tar")
    crafted = json.loads(raw)
    crafted["files"]["index.npz"]["bytes"] += 1  # sizes are checked against the listing
    store.put_bytes(MANIFEST_NAME, json.dumps(crafted).encode())
    with pytest.raises(DataError, match="index.npz: has .* bytes, the part's manifest says"):
        gpufeed.merge([a, b], f"{run}/m")
    assert not listing(f"{run}/m")


def test_an_object_past_one_s3_copy_is_refused_up_front(s3, tmp_path, monkeypatch):
    parts = upload_parts(tmp_path, f"{s3}/run", "hdf5", sizes=(3, 3))
    monkeypatch.setattr(merge_remote, "S3_COPY_LIMIT", 100)
    with pytest.raises(UsageError, match="p0/data.h5: .* bytes, more than the 100 one S3 copy"):
        gpufeed.merge(parts, f"{s3}/run/m")
    assert not listing(f"{s3}/run/m")


def test_a_foreign_prefix_is_not_written(s3, tmp_path):
    parts = upload_parts(tmp_path, f"{s3}/run", "tar", sizes=(2, 2))
    ObjectStore(parse_location(f"{s3}/run/m")).put_bytes("notes.txt", b"mine")
    with pytest.raises(UsageError, match="no manifest.json: not a gpufeed pack"):
        gpufeed.merge(parts, f"{s3}/run/m", overwrite=True)
    assert listing(f"{s3}/run/m") == {"notes.txt": 4}


def test_a_merged_remote_pack_read_by_forked_workers(s3, tmp_path):
    parts = upload_parts(tmp_path, f"{s3}/run", "lmdb", sizes=(9, 7))
    gpufeed.merge(parts, f"{s3}/run/m")
    loader = gpufeed.make_loader(
        gpufeed.open_dataset(f"{s3}/run/m"), batch_size=3, shuffle=True, num_workers=2
    )
    got = [
        (int(y), np.asarray(x).tolist())
        for b in loader
        for x, y in zip(b["x"], b["label"], strict=True)
    ]
    assert sorted(got) == expected(16)


def test_a_crafted_merged_remote_pack_is_refused(s3, tmp_path):
    parts = upload_parts(tmp_path, f"{s3}/run", "mmap", sizes=(2, 3))
    dest = f"{s3}/run/m"
    gpufeed.merge(parts, dest)
    store = ObjectStore(parse_location(dest))
    raw = json.loads(store.read_bytes(MANIFEST_NAME))
    crafted = json.loads(json.dumps(raw))
    crafted["layout"]["parts"][1]["path"] = "../p0"
    store.put_bytes(MANIFEST_NAME, json.dumps(crafted).encode())
    with pytest.raises(UnsafePathError, match="leads outside the pack"):
        gpufeed.open_dataset(dest, cache_dir=tmp_path / "c1")
    # a part's manifest changed in the bucket: the merged manifest's sha256 catches it
    store.put_bytes(MANIFEST_NAME, json.dumps(raw).encode())
    part = json.loads(store.read_bytes(f"parts/000001/{MANIFEST_NAME}"))
    part["count"] = 2
    store.put_bytes(f"parts/000001/{MANIFEST_NAME}", json.dumps(part).encode())
    with pytest.raises(DataError, match=f"parts/000001/{MANIFEST_NAME}"):
        gpufeed.open_dataset(dest, cache_dir=tmp_path / "c2")


def test_a_local_merge_uploaded_whole_reads_from_its_url(s3, tmp_path):
    """A merged hdf5 pack made locally (hard links) and uploaded with upload_pack: read and
    verified by URL; so is one merged before its manifest listed the parts' manifests."""
    parts = [tmp_path / "a", tmp_path / "b"]
    for k, part in enumerate(parts):
        with gpufeed.Writer(part, format="hdf5", schema=SCHEMA) as w:
            for i in range(4 * k, 4 * k + 4):
                w.write({"x": np.full(4, i, np.uint8), "label": i})
    manifest = gpufeed.merge(parts, tmp_path / "m")
    assert f"parts/000001/{MANIFEST_NAME}" in manifest["files"]
    upload_pack(tmp_path / "m", f"{s3}/m")
    assert samples_of(f"{s3}/m") == expected(8)
    assert gpufeed.verify(f"{s3}/m").ok
    for k in range(2):
        del manifest["files"][f"parts/{k:06d}/{MANIFEST_NAME}"]
    (tmp_path / "m" / MANIFEST_NAME).write_text(json.dumps(manifest))
    upload_pack(tmp_path / "m", f"{s3}/older")
    assert samples_of(f"{s3}/older") == expected(8)


def test_the_merge_command_merges_parts_in_the_bucket(s3, tmp_path, cache, capsys):
    from gpufeed.cli import main

    parts = upload_parts(tmp_path, f"{s3}/cli", "lmdb", sizes=(3, 4))
    dest = f"{s3}/cli/merged"
    assert main(["merge", *parts, dest, "--cache-dir", str(cache)]) == 0
    assert f"merged 2 parts (7 samples, lmdb) into {dest}" in capsys.readouterr().out
    assert samples_of(dest) == expected(7)
    assert main(["merge", parts[0], str(tmp_path / "local-dest")]) == 2  # mixed: refused
    assert "local" in capsys.readouterr().err
