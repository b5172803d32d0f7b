"""Parquet files and Hugging Face datasets folders read in place (formats/inplace/parquet.py):
files written by pyarrow and by datasets (Image feature, list columns, strings, nulls,
several files and row groups), read through DataLoader with 0 and 2 workers under fork and
spawn, split across ranks; crafted files are DataErrors naming them, never a crash."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from gpufeed.data.map_style import PackedDataset  # noqa: E402
from gpufeed.errors import CorruptSampleError, DataError, UsageError  # noqa: E402
from gpufeed.formats.inplace.parquet import ParquetReader, parquet_files  # noqa: E402

ROWS, GROUP = 40, 8


def _jpeg(k: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((12, 10, 3), k, np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


def _table(lo: int, hi: int):
    ids = list(range(lo, hi))
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "label": pa.array([i % 3 for i in ids], pa.int32()),
            "score": pa.array([i / 2 for i in ids], pa.float32()),
            "text": pa.array([f"row {i}" for i in ids]),
            "tokens": pa.array([list(range(i % 5)) for i in ids], pa.list_(pa.int32())),
            "boxes": pa.array(
                [[[i, 0, 1, 2]] * (i % 3) for i in ids], pa.list_(pa.list_(pa.float32(), 4))
            ),
            "vec": pa.array([[i, i + 1, i + 2] for i in ids], pa.list_(pa.int16(), 3)),
            "image": pa.array([_jpeg(i) for i in ids], pa.binary()),
        }
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Hub layout: data/train-0000k-of-00002.parquet, row groups of GROUP rows."""
    root = tmp_path_factory.mktemp("hub")
    (root / "data").mkdir()
    half = ROWS // 2
    for k, (lo, hi) in enumerate([(0, half), (half, ROWS)]):
        pq.write_table(
            _table(lo, hi), root / "data" / f"train-{k:05d}-of-00002.parquet", row_group_size=GROUP
        )
    return root


def _as_listed(batch):
    return batch


def _ids(samples) -> list[int]:
    return [int(s["id"]) for s in samples]


def test_columns_become_fields(shards):
    r = ParquetReader(shards)
    s = r.spec.schema
    assert [f.type for f in s.fields] == [
        "int",
        "int",
        "float",
        "str",
        "ragged",
        "ragged",
        "array",
        "image",
    ]
    assert s["boxes"].shape == (-1, 4) and s["vec"].shape == (3,) and s["image"].format == "jpeg"
    assert r.count == ROWS and r.preferred_block_size == GROUP
    assert r.labels.tolist() == [i % 3 for i in range(ROWS)]


def test_values_read_back(shards):
    ds = PackedDataset(shards, reader=ParquetReader)
    got = ds[[37, 3, 21]]
    assert _ids(got) == [37, 3, 21]
    one = got[0]
    assert one["text"] == "row 37" and one["score"] == pytest.approx(18.5)
    assert one["tokens"].tolist() == list(range(37 % 5))
    assert one["boxes"].shape == (37 % 3, 4) and one["vec"].tolist() == [37, 38, 39]
    assert one["image"].shape == (3, 12, 10) and one["image"].dtype == torch.uint8


def test_a_batch_across_row_groups_and_files_keeps_its_order(shards):
    """One batch touching several row groups of both files, in no order: its rows in the
    order asked (read_batch joins the row groups' rows and converts them once)."""
    ds = PackedDataset(shards, reader=ParquetReader)
    ask = [ROWS - 1, 0, GROUP + 1, ROWS // 2, 1, ROWS - 1, GROUP - 1]
    got = ds.reader.read_batch(np.asarray(ask))
    assert len(got) == len(ask)
    assert _ids(ds[ask]) == ask
    assert [s["text"] for s in ds[ask]] == [f"row {i}" for i in ask]
    assert [s["tokens"].tolist() for s in ds[ask]] == [list(range(i % 5)) for i in ask]
    assert ds.reader.read_batch(np.zeros(0, np.int64)) == []


def test_a_null_in_a_batch_of_several_row_groups_names_its_row(tmp_path):
    path = tmp_path / "n.parquet"
    table = pa.table({"id": list(range(9)), "n": [0, 1, 2, 3, 4, None, 6, 7, 8]})
    pq.write_table(table, path, row_group_size=3)
    ds = PackedDataset(path, reader=ParquetReader)
    with pytest.raises(CorruptSampleError, match=r"row 2 of row group 1") as e:
        ds.reader.read_batch(np.asarray([7, 0, 5, 3]))
    assert e.value.index == 5


def test_columns_select(shards):
    ds = PackedDataset(shards, reader=ParquetReader, columns=["id", "text"])
    assert ds.reader.spec.schema.names == ["id", "text"]
    assert ds[5] == {"id": 5, "text": "row 5"}
    with pytest.raises(UsageError, match="no column"):
        ParquetReader(shards, columns=["nope"])


def test_several_splits_refused(shards, tmp_path):
    import shutil

    shutil.copytree(shards, tmp_path / "hub")
    pq.write_table(_table(0, 4), tmp_path / "hub" / "data" / "test-00000-of-00001.parquet")
    with pytest.raises(UsageError, match="splits test, train"):
        ParquetReader(tmp_path / "hub")
    assert len(parquet_files(str(tmp_path / "hub" / "data" / "train-*.parquet"))) == 2


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_dataloader_every_row_once(shards, workers, context):
    ds = PackedDataset(shards, reader=ParquetReader, columns=["id", "tokens", "image"])
    dl = DataLoader(
        ds, batch_size=6, shuffle=True, num_workers=workers, multiprocessing_context=context,
        collate_fn=_as_listed,
    )  # fmt: skip
    seen = [int(s["id"]) for batch in dl for s in batch]
    assert sorted(seen) == list(range(ROWS))


def test_make_loader_ranks_and_resume(shards):
    from gpufeed import make_loader

    ds = PackedDataset(shards, reader=ParquetReader, columns=["id", "label"])
    seen = []
    for rank in range(2):
        dl = make_loader(
            ds, batch_size=4, shuffle=True, seed=3, rank=rank, world_size=2, num_workers=0
        )
        seen += [int(i) for b in dl for i in b["id"]]
    assert sorted(seen) == list(range(ROWS))
    dl = make_loader(ds, batch_size=4, shuffle=True, seed=3, num_workers=0)
    it = iter(dl)
    first = [int(i) for _ in range(3) for i in next(it)["id"]]
    state = dl.state_dict()
    rest = [int(i) for b in it for i in b["id"]]
    again = make_loader(ds, batch_size=4, shuffle=True, seed=3, num_workers=0)
    again.load_state_dict(state)
    assert [int(i) for b in again for i in b["id"]] == rest
    assert sorted(first + rest) == list(range(ROWS))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("hf")
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=["cat", "dog"]),
            "tokens": datasets.Sequence(datasets.Value("int32")),
            "caption": datasets.Value("string"),
        }
    )
    rows = {
        "image": [{"bytes": _jpeg(i), "path": None} for i in range(10)],
        "label": [i % 2 for i in range(10)],
        "tokens": [list(range(i)) for i in range(10)],
        "caption": [None if i == 4 else f"c{i}" for i in range(10)],
    }
    ds = datasets.Dataset.from_dict(rows, features=features)
    ds.save_to_disk(str(root / "saved"), max_shard_size="2KB")
    ds.to_parquet(str(root / "hub.parquet"), batch_size=3)
    return root


@pytest.mark.parametrize("name", ["saved", "hub.parquet"])
def test_hugging_face_written(hf_folder, name):
    ds = PackedDataset(hf_folder / name, reader=ParquetReader)
    r = ds.reader
    assert r.manifest["classes"] == ["cat", "dog"]
    assert r.spec.schema["image"].type == "image"
    assert r.labels.tolist() == [i % 2 for i in range(10)]
    s = ds[7]
    assert s["caption"] == "c7" and s["tokens"].tolist() == list(range(7))
    assert s["image"].shape == (3, 12, 10)
    with pytest.raises(CorruptSampleError, match="column 'caption' is null") as e:
        ds[4]
    assert str(hf_folder / name) in str(e.value)


def test_null_skipped_when_asked(hf_folder):
    ds = PackedDataset(hf_folder / "saved", reader=ParquetReader, on_error="skip")
    got = ds[[3, 4, 5]]
    assert got[1] is None and got[0]["caption"] == "c3" and ds.skipped == 1


def test_saved_folder_lists_arrow_streams(hf_folder):
    files = parquet_files(hf_folder / "saved")
    assert files and all(f.suffix == ".arrow" for f in files)
    assert ParquetReader(hf_folder / "saved").count == 10


def test_random_crop_decodes_the_image_column(shards):
    from gpufeed import RandomResizedCrop

    ds = PackedDataset(
        shards, reader=ParquetReader, columns=["image", "label"], decode=RandomResizedCrop(8)
    )
    b = ds.get_batch([0, 9, 17])
    assert b["image"].shape == (3, 3, 8, 8)


# -- crafted files ------------------------------------------------------------------------
def _crafted(tmp_path, how: str):
    path = tmp_path / "bad.parquet"
    pq.write_table(_table(0, 16), path, row_group_size=GROUP)
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    elif how == "footer length":
        data[-8:-4] = (2**31 - 1).to_bytes(4, "little")
    elif how == "pages":
        mid = len(data) // 3
        data[mid : mid + 200] = b"\xff" * 200
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("how", ["truncated", "footer length", "pages"])
def test_crafted_file_is_an_error_naming_it(tmp_path, python_env, how):
    path = _crafted(tmp_path, how)
    code = (
        "import sys, numpy as np\n"
        "from gpufeed.errors import DataError\n"
        "from gpufeed.formats.inplace.parquet import ParquetReader\n"
        "try:\n"
        f"    r = ParquetReader({str(path)!r})\n"
        "    r.read_batch(np.arange(r.count))\n"
        "except DataError as e:\n"
        "    print('DataError', e)\n"
        "    sys.exit(0)\n"
        "print('read')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=python_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    if how != "pages" or "DataError" in out.stdout:  # damaged pages may still decode
        assert out.stdout.startswith("DataError") and str(path) in out.stdout, out.stdout


def test_footer_claiming_huge_row_count(tmp_path, monkeypatch):
    """The count comes from the footer: one past any real file is refused before any array
    of that size is made."""
    path = tmp_path / "big.parquet"
    pq.write_table(_table(0, 4), path)
    import gpufeed.formats.inplace.parquet as mod

    monkeypatch.setattr(mod, "MAX_ROWS", 3)
    with pytest.raises(DataError, match="claims 4 rows") as e:
        ParquetReader(path)
    assert str(path) in str(e.value)


def test_not_parquet_is_none(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    assert parquet_files(tmp_path) is None
    assert parquet_files(tmp_path / "a.txt") is None


# -- through open_dataset, make_loader, inspect and verify ---------------------------------
def test_open_dataset_reads_a_file_a_glob_a_folder(shards, hf_folder):
    import gpufeed

    data = shards / "data"
    for path in (shards, str(data / "train-*.parquet"), data / "train-00001-of-00002.parquet"):
        ds = gpufeed.open_dataset(path, columns=["id", "text"])
        assert ds.reader.format_name == "parquet" and ds[3]["text"] == f"row {int(ds[3]['id'])}"
    saved = gpufeed.open_dataset(hf_folder / "saved")
    assert saved.reader.manifest["classes"] == ["cat", "dog"] and len(saved) == 10
    with pytest.raises(UsageError, match="cache_row_groups"):
        gpufeed.open_dataset(shards, cache_row_group=2)


def test_make_loader_blocks_are_row_groups(shards):
    import gpufeed

    ds = gpufeed.open_dataset(shards, columns=["id"])
    assert ds.preferred_block_size == GROUP
    dl = gpufeed.make_loader(
        ds, batch_size=2 * GROUP, shuffle=True, seed=1, num_workers=0, buffer_blocks=2
    )
    for batch in dl:  # a block is a row group: a window of 2 blocks, 2 row groups a batch
        groups = {int(i) // GROUP for i in batch["id"]}
        assert len(groups) <= 2, sorted(int(i) for i in batch["id"])


def test_inspect_and_verify_in_place(hf_folder):
    from gpufeed.tools.in_place import describe, open_in_place_reader

    reader, index = open_in_place_reader(hf_folder / "hub.parquet")
    info = describe(reader, index)
    assert info["kind"] == "Parquet or Arrow files" and info["labels"] == "the label column"
    assert info["count"] == 10 and info["classes"] == ["cat", "dog"]
    from gpufeed.tools.verify import verify

    report = verify(hf_folder / "saved", decode=True)
    assert report.in_place and report.samples_checked == 9  # the 10th named as a problem
    assert report.bad_samples == [4]  # the null caption, named


def test_pack_converts_parquet(hf_folder, tmp_path):
    import gpufeed

    gpufeed.pack(
        hf_folder / "saved", tmp_path / "out.lmdb", format="lmdb", on_error="skip", quiet=True
    )
    packed = gpufeed.open_dataset(tmp_path / "out.lmdb")
    assert len(packed) == 9  # the row whose caption is null is left out, and listed
    assert packed[4]["caption"] == "c5" and packed[4]["tokens"].tolist() == list(range(5))
    assert packed.reader.manifest["skipped"]


def test_gpufeed_pack_parquet_cli_and_resume(shards, tmp_path, capsys):
    """`gpufeed pack PARQUET DEST`: columns become fields; a pack stopped after a committed
    part goes on from there (--resume)."""
    import gpufeed
    from gpufeed.cli import main

    src = str(shards / "data" / "train-*.parquet")
    dest = tmp_path / "out.tar"
    assert main(["pack", src, str(dest), "-f", "tar", "-q"]) == 0
    packed = gpufeed.open_dataset(dest)
    assert len(packed) == ROWS and packed.reader.spec.schema.names[:2] == ["id", "label"]
    assert packed[33]["boxes"].shape == (0, 4) and packed[33]["text"] == "row 33"
    # resume: a Writer committed 16 rows and stopped; pack --resume writes the rest
    from gpufeed.write.writer import Writer

    reader = ParquetReader(shards)
    w = Writer(tmp_path / "r.lmdb", "lmdb", reader.spec.schema)
    w.item_names = [f"{reader.location(i)}#{i}" for i in range(ROWS)]
    for i in range(16):
        w.add_records(i, [(reader.read(i), int(reader.labels[i]), 0)])
    w.flush()
    w.abandon()
    assert (
        main(["pack", str(shards), str(tmp_path / "r.lmdb"), "-f", "lmdb", "--resume", "-q"]) == 0
    )
    resumed = gpufeed.open_dataset(tmp_path / "r.lmdb")
    assert [int(resumed[i]["id"]) for i in range(ROWS)] == list(range(ROWS))


def test_arrow_offsets_past_their_buffer_are_an_error(tmp_path, python_env):
    """An IPC file's arrays are used as stored: string offsets pointing past the data must be
    refused (full validation), never read (memory outside the file, or a crash)."""
    folder = tmp_path / "saved"
    folder.mkdir()
    path = folder / "data-00000-of-00001.arrow"
    table = pa.table({"text": ["aaaa", "bbbb", "cccc"]})
    with pa.ipc.new_stream(str(path), table.schema) as w:
        w.write_table(table)
    data = path.read_bytes()
    offsets = np.array([0, 4, 8, 12], "<i4").tobytes()
    at = data.index(offsets)
    bad = np.array([0, 4, 8, 1 << 30], "<i4").tobytes()
    path.write_bytes(data[:at] + bad + data[at + len(bad) :])
    state = {"_data_files": [{"filename": path.name}]}
    (folder / "state.json").write_text(__import__("json").dumps(state))
    code = (
        "import sys\n"
        "import gpufeed\n"
        "from gpufeed.errors import DataError\n"
        "try:\n"
        f"    ds = gpufeed.open_dataset({str(folder)!r})\n"
        "    ds[2]\n"
        "except DataError as e:\n"
        "    print('DataError', e)\n"
        "    sys.exit(0)\n"
        "print('read')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=python_env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("DataError") and str(path) in out.stdout, out.stdout


def test_the_row_group_cache_is_bounded(shards):
    """At least cache_row_groups row groups are kept, more while under cache_bytes."""
    everything = ParquetReader(shards, columns=["id"])
    everything.read_batch(np.arange(ROWS))
    n = len(everything.group_file)  # 8, 8, 4 rows in each file
    assert len(everything.handle["groups"]) == n == 6  # a small set stays whole
    bounded = ParquetReader(shards, columns=["id"], cache_row_groups=2, cache_bytes=0)
    for lo in bounded.group_start[:-1]:
        bounded.read_batch(np.array([lo]))
    assert list(bounded.handle["groups"]) == [n - 2, n - 1]


def test_pack_reads_blocks_not_rows(shards, tmp_path, monkeypatch):
    """pack_in_place reads a block of rows (a row group at least) per read_batch, not one
    row a call (40 calls for these 40 rows before)."""
    import gpufeed

    calls = []
    read_batch = ParquetReader.read_batch

    def counted(self, indices):
        calls.append(len(indices))
        return read_batch(self, indices)

    monkeypatch.setattr(ParquetReader, "read_batch", counted)
    gpufeed.pack(shards, tmp_path / "out.lmdb", format="lmdb", quiet=True)
    assert calls == [ROWS]
    packed = gpufeed.open_dataset(tmp_path / "out.lmdb")
    assert [int(packed[i]["id"]) for i in range(ROWS)] == list(range(ROWS))


# -- nulls="mask" -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def with_nulls(tmp_path_factory):
    """Row 1 null in every nullable column; row 2's tokens hold a null element."""
    path = tmp_path_factory.mktemp("nulls") / "nulls.parquet"
    schema = pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            ("n", pa.int32()),
            ("x", pa.float64()),
            ("text", pa.string()),
            ("image", pa.binary()),
            ("tokens", pa.list_(pa.int32())),
            ("vec", pa.list_(pa.float32(), 2)),
            ("tags", pa.list_(pa.string())),
        ]
    )
    table = pa.table(
        {
            "id": [0, 1, 2],
            "n": [5, None, 7],
            "x": [0.5, None, 2.5],
            "text": ["a", None, "c"],
            "image": [_jpeg(10), None, _jpeg(30)],
            "tokens": [[1, 2], None, [3, None]],
            "vec": [[1, 2], None, [5, 6]],
            "tags": [["p"], None, []],
        },
        schema=schema,
    )
    pq.write_table(table, path)
    return path


def test_nulls_mask_gives_empty_values_and_valid_fields(with_nulls):
    ds = PackedDataset(with_nulls, reader=ParquetReader, nulls="mask")
    names = ds.reader.spec.schema.names
    assert names == [
        "id", "n", "n_valid", "x", "x_valid", "text", "text_valid", "image", "image_valid",
        "tokens", "tokens_valid", "vec", "vec_valid", "tags", "tags_valid",
    ]  # fmt: skip
    ok, null, inner = ds[[0, 1, 2]]
    assert (ok["n"], ok["x"], ok["text"], ok["tags"]) == (5, 0.5, "a", ["p"])
    assert ok["image"].shape == (3, 12, 10) and ok["tokens"].tolist() == [1, 2]
    assert all(bool(ok[f"{c}_valid"]) for c in ("n", "x", "text", "image", "tokens", "vec"))
    assert (null["id"], null["n"], null["x"], null["text"], null["tags"]) == (1, 0, 0.0, "", None)
    assert null["tokens"].tolist() == [] and null["vec"].tolist() == [0.0, 0.0]
    assert null["image"].shape == (3, 1, 1) and int(null["image"].sum()) == 0
    valid = {c: bool(null[f"{c}_valid"]) for c in ("n", "x", "text", "image", "tokens", "vec")}
    assert not any(valid.values()), valid
    # a null element makes the row's list invalid (its value empty); the rest of it stays
    assert inner["tokens"].tolist() == [] and not bool(inner["tokens_valid"])
    assert inner["text"] == "c" and bool(inner["text_valid"]) and bool(inner["tags_valid"])
    batch = ds.get_batch([0, 1, 2])
    assert batch["n_valid"].dtype == torch.bool and batch["n_valid"].tolist() == [True, False, True]
    assert batch["n"].tolist() == [5, 0, 7]


def test_nulls_error_names_the_mask_option(with_nulls):
    ds = PackedDataset(with_nulls, reader=ParquetReader)
    assert ds.reader.spec.schema.names[:3] == ["id", "n", "x"]  # no _valid fields
    with pytest.raises(CorruptSampleError, match="column 'n' is null.*nulls='mask'"):
        ds[1]
    with pytest.raises(UsageError, match="nulls='drop'"):
        ParquetReader(with_nulls, nulls="drop")
    import gpufeed

    masked = gpufeed.open_dataset(with_nulls, nulls="mask")  # open_dataset passes it on
    assert masked[1]["n"] == 0 and not bool(masked[1]["n_valid"])


def test_nulls_mask_name_clash(tmp_path):
    path = tmp_path / "clash.parquet"
    pq.write_table(pa.table({"a": [1, None], "a_valid": [True, False]}), path)
    with pytest.raises(UsageError, match="a field 'a_valid' is added"):
        ParquetReader(path, nulls="mask")
    assert ParquetReader(path, nulls="mask", columns=["a"]).spec.schema.names == ["a", "a_valid"]


# -- the Hub's Audio feature --------------------------------------------------------------
def _wav(samples: np.ndarray, rate: int, width: int = 2) -> bytes:
    """A PCM WAV file of int samples [frames, channels] of `width` bytes each."""
    import wave

    frames, channels = samples.shape
    if width == 3:
        raw = samples.astype("<i4").view(np.uint8).reshape(frames, channels, 4)[..., :3].tobytes()
    else:
        raw = samples.astype({1: "u1", 2: "<i2", 4: "<i4"}[width]).tobytes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)
    return buf.getvalue()


AUDIO_ROWS = [  # (int samples [frames, channels], rate, width, full scale)
    (np.array([[0], [16384], [-32768], [32767]]), 16000, 2, 32768),
    (np.array([[1, -1], [4194304, -8388608], [8388607, 0]]), 48000, 3, 8388608),
    (np.array([[0], [64], [128], [255]]), 8000, 1, None),
    (np.array([[1 << 30, -(1 << 31)]]), 22050, 4, 1 << 31),
]


def _expected(samples, width, scale) -> np.ndarray:
    if width == 1:
        return ((samples.astype(np.float32) - 128) / 128).T
    return (samples.astype(np.float64) / scale).astype(np.float32).T


@pytest.fixture(scope="module")
def audio_set(tmp_path_factory):
    datasets = pytest.importorskip("datasets")
    root = tmp_path_factory.mktemp("audio")
    files = [_wav(s, rate, width) for s, rate, width, _ in AUDIO_ROWS]
    rows = {"audio": [{"bytes": b, "path": f"{k}.wav"} for k, b in enumerate(files)]}
    rows["id"] = list(range(len(files)))
    ds = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio())
    ds.to_parquet(str(root / "audio.parquet"))
    ds.save_to_disk(str(root / "saved"))
    return root


@pytest.mark.parametrize("name", ["audio.parquet", "saved"])
def test_hub_audio_decodes_to_waveform_and_rate(audio_set, name):
    ds = PackedDataset(audio_set / name, reader=ParquetReader)
    schema = ds.reader.spec.schema
    assert schema.names == ["audio", "audio_rate", "id"]
    assert (schema["audio"].type, schema["audio"].dtype) == ("ragged", "<f4")
    for k, (samples, rate, width, scale) in enumerate(AUDIO_ROWS):
        s = ds[k]
        assert s["audio"].dtype == torch.float32 and s["audio_rate"] == rate
        assert s["audio"].shape == (samples.shape[1], samples.shape[0])
        assert torch.equal(s["audio"], torch.from_numpy(_expected(samples, width, scale)))
    batch = ds.get_batch([0, 2])  # one channel each, 4 samples each
    assert batch["audio_rate"].tolist() == [16000, 8000]


def test_audio_as_bytes_when_asked(audio_set):
    ds = PackedDataset(audio_set / "audio.parquet", reader=ParquetReader, audio="bytes")
    assert ds.reader.spec.schema.names == ["audio", "id"]
    assert ds[1]["audio"][:4] == b"RIFF"


def test_audio_that_does_not_decode_names_sample_and_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    good = _wav(np.zeros((4, 1)), 16000)
    flac = b"fLaC" + bytes(60)  # not WAV: soundfile's, or an error naming it
    huge = bytearray(_wav(np.zeros((4, 1)), 16000))
    huge[40:44] = (0xFFFFFFF0).to_bytes(4, "little")  # the data chunk claims 4 GiB
    rows = {"audio": [{"bytes": b, "path": None} for b in (good, flac, bytes(huge))]}
    ds = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio())
    ds.to_parquet(str(tmp_path / "a.parquet"))
    read = PackedDataset(tmp_path / "a.parquet", reader=ParquetReader)
    assert read[0]["audio"].shape == (1, 4)
    with pytest.raises(CorruptSampleError, match="not an audio file soundfile reads") as e:
        read[1]
    assert e.value.index == 1 and "column 'audio'" in str(e.value)
    assert str(tmp_path / "a.parquet") in str(e.value)
    with pytest.raises(CorruptSampleError, match="over the 1024 MiB a decoded file may take"):
        read[2]


def test_audio_null_masked(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"audio": [{"bytes": _wav(np.ones((3, 2)), 8000), "path": None}, None]}
    ds = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio())
    ds.to_parquet(str(tmp_path / "a.parquet"))
    read = PackedDataset(tmp_path / "a.parquet", reader=ParquetReader, nulls="mask")
    assert read.reader.spec.schema.names == ["audio", "audio_rate", "audio_valid"]
    ok, null = read[[0, 1]]
    assert ok["audio"].shape == (2, 3) and ok["audio_rate"] == 8000 and bool(ok["audio_valid"])
    assert null["audio"].shape == (0, 0) and null["audio_rate"] == 0
    assert not bool(null["audio_valid"])


def test_audio_flac_through_soundfile(tmp_path):
    """FLAC (and OGG, MP3) decode through soundfile where it is installed."""
    import soundfile as sf  # gpufeed[audio]; requirements-dev.txt has it

    datasets = pytest.importorskip("datasets")
    samples = np.array([[0, 100], [-16384, 16384], [32767, -32768]], np.int16)
    buf = io.BytesIO()
    sf.write(buf, samples, 44100, format="FLAC", subtype="PCM_16")
    rows = {"audio": [{"bytes": buf.getvalue(), "path": "a.flac"}]}
    ds = datasets.Dataset.from_dict(rows).cast_column("audio", datasets.Audio())
    ds.to_parquet(str(tmp_path / "a.parquet"))
    s = PackedDataset(tmp_path / "a.parquet", reader=ParquetReader)[0]
    assert s["audio_rate"] == 44100
    assert torch.equal(s["audio"], torch.from_numpy(samples.T.astype(np.float32) / 32768))


def test_audio_without_soundfile_names_the_extra(tmp_path, monkeypatch):
    """A file only soundfile reads, where soundfile is not installed: the sample, the column
    and the extra to install are named."""
    import sys

    monkeypatch.setitem(sys.modules, "soundfile", None)  # import soundfile -> ImportError
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"audio": [{"bytes": b"fLaC" + bytes(60), "path": None}]})
    ds = ds.cast_column("audio", datasets.Audio())
    ds.to_parquet(str(tmp_path / "a.parquet"))
    read = PackedDataset(tmp_path / "a.parquet", reader=ParquetReader)
    with pytest.raises(CorruptSampleError, match=r"gpufeed\[audio\]") as e:
        read[0]
    assert e.value.index == 0 and "column 'audio'" in str(e.value)
