"""Parquet files and datasets folders in object storage read in place
(storage/parquet_remote.py, storage/parquet_ranges.py), against real local S3 servers: moto
answers ranged GETs (206) as S3 does, so a row group is fetched by its bytes; rclone answers
them with the whole object, so each object is then read whole. Exact rows are checked; the
bytes fetched come from the cache's counters."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import gpufeed  # noqa: E402
from gpufeed.data.map_style import PackedDataset  # noqa: E402
from gpufeed.errors import DataError, NotPackedError, StalePackError, UsageError  # noqa: E402
from gpufeed.storage.parquet_remote import open_parquet_at  # noqa: E402
from gpufeed.storage.store import ObjectStore  # noqa: E402
from gpufeed.storage.urls import parse_location  # noqa: E402

FILES, ROWS_PER_FILE, GROUP = 2, 600, 100
ROWS = FILES * ROWS_PER_FILE
_buckets = itertools.count()


def _table(lo: int, hi: int):
    ids = list(range(lo, hi))
    rng = np.random.default_rng(lo)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "label": pa.array([i % 3 for i in ids], pa.int32()),
            "text": pa.array([f"row {i}" for i in ids]),
            "tokens": pa.array([list(range(i % 7)) for i in ids], pa.list_(pa.int32())),
            # incompressible bytes: a row group is ~50 KB of the file's ~300 KB
            "blob": pa.array([rng.bytes(500) for _ in ids], pa.binary()),
        }
    )


@pytest.fixture(scope="module")
def local_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("pq")
    paths = []
    for k in range(FILES):
        path = root / f"train-{k:05d}-of-{FILES:05d}.parquet"
        lo = k * ROWS_PER_FILE
        pq.write_table(_table(lo, lo + ROWS_PER_FILE), path, row_group_size=GROUP)
        paths.append(path)
    return paths


@pytest.fixture()
def s3_ranged(moto_server, monkeypatch) -> str:
    """s3://BUCKET on the moto server (ranged GETs answered 206), the AWS_* environment
    pointing at it (as conftest's s3 fixture does for rclone; not imported from there: a
    spawned worker imports this module, where `conftest` names another file)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    bucket = f"pq{next(_buckets)}-{os.getpid()}"
    moto_server.make_bucket(bucket)
    return f"s3://{bucket}"


def _upload(url: str, files: dict[str, Path]) -> None:
    store = ObjectStore(parse_location(url))
    for name, path in files.items():
        store.put_file(name, path)


def _as_listed(batch):
    return batch


def _hub(url: str, local_files) -> None:
    _upload(url, {f"data/{p.name}": p for p in local_files})


def _check_rows(reader, ids) -> None:
    from gpufeed.formats.record import decode_record

    records = reader.read_batch(np.asarray(ids, dtype=np.int64))
    for i, record in zip(ids, records, strict=True):
        got = decode_record(reader.spec.schema, record)
        assert got["id"] == i and got["text"] == f"row {i}"
        if "tokens" in got:
            assert np.asarray(got["tokens"]).tolist() == list(range(i % 7))
        if "blob" in got:
            rng = np.random.default_rng(i - i % ROWS_PER_FILE)
            assert bytes(got["blob"]) == [rng.bytes(500) for _ in range(i % ROWS_PER_FILE + 1)][-1]


def test_glob_reads_exact_rows_a_row_group_at_a_time(s3_ranged, local_files, tmp_path):
    _hub(s3_ranged, local_files)
    url = f"{s3_ranged}/data/train-*.parquet"
    reader = open_parquet_at(url, cache_dir=tmp_path / "cache")
    assert reader.count == ROWS and reader.files == [
        f"{s3_ranged}/data/{p.name}" for p in local_files
    ]
    assert reader.labels.tolist() == [i % 3 for i in range(ROWS)]
    stats = reader.source.objects.stats
    before = stats.bytes_fetched
    _check_rows(reader, [777])  # row group 1 of the second file
    one_group = stats.bytes_fetched - before
    size = local_files[1].stat().st_size
    assert 0 < one_group < size / 4, (one_group, size)
    _check_rows(reader, [700, 799])  # the same row group: decoded and kept
    assert stats.bytes_fetched - before == one_group
    _check_rows(reader, [0, 5, 123, 599, 600, 1199])
    # a second reader on the same cache fetches nothing: footers and ranges are hits
    again = open_parquet_at(url, cache_dir=tmp_path / "cache")
    _check_rows(again, [777, 0, 1199])
    assert again.source.objects.stats.bytes_fetched == 0


def test_column_projection_fetches_only_those_columns(s3_ranged, local_files, tmp_path):
    _hub(s3_ranged, local_files)
    reader = open_parquet_at(
        f"{s3_ranged}/data/*.parquet", cache_dir=tmp_path / "c", columns=["id", "text"]
    )
    stats = reader.source.objects.stats
    before = stats.bytes_fetched
    batch = reader.read_batch(np.arange(200, 300))
    assert len(batch) == 100
    assert stats.bytes_fetched - before < 5000  # the blob column (~50 KB) is not fetched


def test_folders_hub_layout_splits_and_saved(s3_ranged, local_files, tmp_path):
    _hub(s3_ranged, local_files)
    reader = open_parquet_at(s3_ranged, cache_dir=tmp_path / "c")  # the bucket: data/*.parquet
    assert reader.count == ROWS
    _check_rows(reader, [1, 1111])
    _upload(s3_ranged, {"two/data/test-00000-of-00001.parquet": local_files[0]})
    _upload(s3_ranged, {"two/data/train-00000-of-00001.parquet": local_files[1]})
    with pytest.raises(UsageError, match="holds the splits test, train") as e:
        open_parquet_at(f"{s3_ranged}/two", cache_dir=tmp_path / "c")
    assert f"{s3_ranged}/two/data/test-*.parquet" in str(e.value)
    with pytest.raises(NotPackedError, match="no .parquet or .arrow object matches"):
        open_parquet_at(f"{s3_ranged}/data/valid-*.parquet", cache_dir=tmp_path / "c")
    with pytest.raises(NotPackedError, match="no manifest.json"):
        open_parquet_at(f"{s3_ranged}/nothing", cache_dir=tmp_path / "c")


def test_saved_folder_read_whole_through_the_cache(s3_ranged, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"id": list(range(50)), "text": [f"t{i}" for i in range(50)]}
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict(rows).save_to_disk(str(saved), max_shard_size="1KB")
    files = {p.name: p for p in saved.iterdir()}
    _upload(f"{s3_ranged}/saved", files)
    ds = PackedDataset(
        f"{s3_ranged}/saved", reader=open_parquet_at, cache_dir=tmp_path / "c", cache_limit="1GB"
    )
    assert len(ds) == 50 and ds.reader.files[0].endswith(".arrow")
    assert [(int(s["id"]), s["text"]) for s in ds[[0, 17, 49]]] == [
        (0, "t0"),
        (17, "t17"),
        (49, "t49"),
    ]
    arrow = sum(p.stat().st_size for n, p in files.items() if n.endswith(".arrow"))
    assert ds.reader.source.objects.stats.bytes_fetched == arrow


def test_a_server_that_ignores_ranges_reads_objects_whole(s3, local_files, tmp_path):
    """rclone answers a ranged GET with the whole object (200): each object is then
    fetched whole, once, into the cache and read there."""
    _hub(s3, local_files)
    reader = open_parquet_at(f"{s3}/data/train-*.parquet", cache_dir=tmp_path / "c")
    assert reader.source.whole and reader.count == ROWS
    _check_rows(reader, [3, 650, 1199])


@pytest.mark.slow
@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_dataloader_workers_every_row_once(s3_ranged, local_files, tmp_path, workers, context):
    _hub(s3_ranged, local_files)
    ds = gpufeed.open_dataset(  # the tutorial line, on a glob in the bucket
        f"{s3_ranged}/data/train-*.parquet", cache_dir=tmp_path / "c", columns=["id", "text"]
    )
    dl = DataLoader(
        ds, batch_size=50, shuffle=True, num_workers=workers, multiprocessing_context=context,
        collate_fn=_as_listed,
    )  # fmt: skip
    seen = [(int(s["id"]), s["text"]) for batch in dl for s in batch]
    assert sorted(seen) == [(i, f"row {i}") for i in range(ROWS)]


def test_make_loader_ranks_and_resume(s3_ranged, local_files, tmp_path):
    from gpufeed import make_loader

    _hub(s3_ranged, local_files)
    ds = gpufeed.open_dataset(f"{s3_ranged}/data", cache_dir=tmp_path / "c", columns=["id"])
    assert ds.preferred_block_size == GROUP
    seen = []
    for rank in range(2):
        dl = make_loader(ds, batch_size=64, shuffle=True, seed=3, rank=rank, world_size=2)
        seen += [int(i) for b in dl for i in b["id"]]
    assert sorted(seen) == list(range(ROWS))
    dl = make_loader(ds, batch_size=64, shuffle=True, seed=3, num_workers=0)
    it = iter(dl)
    first = [int(i) for _ in range(5) for i in next(it)["id"]]
    state = dl.state_dict()
    rest = [int(i) for b in it for i in b["id"]]
    again = make_loader(ds, batch_size=64, shuffle=True, seed=3, num_workers=0)
    again.load_state_dict(state)
    assert [int(i) for b in again for i in b["id"]] == rest
    assert sorted(first + rest) == list(range(ROWS))


def test_an_object_replaced_after_opening_is_stale(s3_ranged, local_files, tmp_path):
    _hub(s3_ranged, local_files)
    reader = open_parquet_at(f"{s3_ranged}/data/*.parquet", cache_dir=tmp_path / "c")
    _check_rows(reader, [650])
    _upload(s3_ranged, {f"data/{local_files[1].name}": local_files[0]})  # other bytes
    with pytest.raises(StalePackError, match="changed in the store since this dataset"):
        reader.read_batch(np.array([1150]))  # a row group not fetched yet


def test_crafted_objects_are_errors_naming_them(s3_ranged, local_files, tmp_path):
    data = local_files[0].read_bytes()
    footer = int.from_bytes(data[-8:-4], "little")
    huge = data[:-8] + (1 << 31).to_bytes(4, "little") + b"PAR1"
    crafted = tmp_path / "crafted.parquet"
    crafted.write_bytes(huge)
    _upload(s3_ranged, {"bad/x.parquet": crafted})
    with pytest.raises(DataError, match="footer claims 2,147,483,648 bytes") as e:
        open_parquet_at(f"{s3_ranged}/bad/x.parquet", cache_dir=tmp_path / "c")
    assert f"{s3_ranged}/bad/x.parquet" in str(e.value)
    # a column chunk placed past the data: refused before any GET of it
    meta = pq.read_metadata(local_files[0])
    assert footer > 0 and meta.num_row_groups == ROWS_PER_FILE // GROUP
    truncated = tmp_path / "short.parquet"
    truncated.write_bytes(data[:100])
    _upload(s3_ranged, {"bad/short.parquet": truncated})
    with pytest.raises(DataError, match="does not end with PAR1"):
        open_parquet_at(f"{s3_ranged}/bad/short.parquet", cache_dir=tmp_path / "c")


@pytest.mark.parametrize(
    ("key", "problem"),
    [("evil/a//train.parquet", "not a plain path"), ("evil/a\\train.parquet", "not a plain file")],
)
def test_unsafe_names_in_a_listing_are_refused(
    s3_ranged, local_files, tmp_path, moto_server, key, problem
):
    bucket = s3_ranged.removeprefix("s3://")
    moto_server.client().put_object(Bucket=bucket, Key=key, Body=local_files[0].read_bytes())
    with pytest.raises(DataError, match=problem) as e:
        open_parquet_at(f"{s3_ranged}/evil/*.parquet", cache_dir=tmp_path / "c")
    assert f"{s3_ranged}/evil" in str(e.value)


def test_the_cache_bound_holds(s3_ranged, local_files, tmp_path):
    """Ranges are cache files: cache_limit bounds them (least recently used evicted)."""
    _hub(s3_ranged, local_files)
    reader = open_parquet_at(
        f"{s3_ranged}/data/*.parquet", cache_dir=tmp_path / "c", cache_limit=300_000
    )
    reader.read_batch(np.arange(0, ROWS, GROUP))  # every row group once
    cache = reader.source.objects.cache
    assert cache.usage() <= 300_000 and cache.stats.evictions > 0
    _check_rows(reader, list(range(0, ROWS, 97)))
    assert os.path.isdir(tmp_path / "c" / "ranges")


def test_pack_and_inspect_objects_in_storage(s3_ranged, local_files, tmp_path, monkeypatch):
    """pack_in_place and inspect take the URL (the default cache: $GPUFEED_CACHE_DIR)."""
    import gpufeed
    from gpufeed.tools.in_place import describe, open_in_place_reader
    from gpufeed.write.convert import pack_in_place

    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "c"))
    _hub(s3_ranged, local_files)
    url = f"{s3_ranged}/data/train-*.parquet"
    pack_in_place(url, tmp_path / "out.lmdb", "lmdb", quiet=True)
    packed = gpufeed.open_dataset(tmp_path / "out.lmdb")
    assert len(packed) == ROWS
    assert [(int(packed[i]["id"]), packed[i]["text"]) for i in (0, 777, 1199)] == [
        (0, "row 0"),
        (777, "row 777"),
        (1199, "row 1199"),
    ]
    reader, index = open_in_place_reader(url)
    info = describe(reader, index)
    assert info["count"] == ROWS and info["files"] == FILES
    assert info["size_bytes"] == sum(p.stat().st_size for p in local_files)


def test_open_dataset_and_the_pack_command_take_a_url(
    s3_ranged, local_files, tmp_path, monkeypatch
):
    from gpufeed.cli import main

    _hub(s3_ranged, local_files)
    url = f"{s3_ranged}/data/train-*.parquet"
    ds = gpufeed.open_dataset(url, cache_dir=tmp_path / "c")
    assert len(ds) == ROWS and [ds[i]["text"] for i in (0, 1199)] == ["row 0", "row 1199"]
    with pytest.raises(UsageError, match="columns"):
        gpufeed.open_dataset(url, cache_dir=tmp_path / "c", column=["id"])
    with pytest.raises(NotPackedError):
        gpufeed.open_dataset(f"{s3_ranged}/nothing-here", cache_dir=tmp_path / "c")
    dest = tmp_path / "out.tar"
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "c"))
    assert main(["pack", url, str(dest), "-f", "tar", "-q"]) == 0
    packed = gpufeed.open_dataset(dest)
    assert [int(packed[i]["id"]) for i in range(ROWS)] == list(range(ROWS))
