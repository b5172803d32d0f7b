"""gpufeed.merge: parts written anywhere, one pack of them (write/merge.py, multipart.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpufeed
from gpufeed.errors import DataError, NotPackedError, UnsafePathError, UsageError
from gpufeed.formats.manifest import MANIFEST_NAME
from gpufeed.write.merge import merge

FORMATS = ["tar", "mmap", "hdf5", "lmdb"]
SCHEMA = {"x": "uint8[4]", "label": "int"}


def write_part(path: Path, fmt: str, first: int, count: int, schema=SCHEMA, **kw) -> Path:
    """A part of samples first..first+count-1: x = [i, i, i, i] (mod 256), label = i."""
    with gpufeed.Writer(path, format=fmt, schema=schema, **kw) as w:
        for i in range(first, first + count):
            w.write({"x": np.full(4, i % 256, np.uint8), "label": i})
    return path


def labels_of(dest: Path) -> list[int]:
    ds = gpufeed.open_dataset(dest)
    return [int(ds[i]["label"]) for i in range(len(ds))]


def make_parts(tmp_path: Path, fmt: str, sizes=(5, 0, 7, 3), **kw) -> list[Path]:
    parts, first = [], 0
    for k, n in enumerate(sizes):
        parts.append(write_part(tmp_path / f"part-{k}", fmt, first, n, **kw))
        first += n
    return parts


@pytest.mark.parametrize("fmt", FORMATS)
def test_merge_every_format_in_order_without_copies(tmp_path, fmt):
    parts = make_parts(tmp_path, fmt)
    dest = tmp_path / "merged"
    manifest = merge(parts, dest)
    assert manifest["count"] == 15 and manifest["format"] == fmt
    assert labels_of(dest) == list(range(15))  # order of the parts, every sample once
    ds = gpufeed.open_dataset(dest)
    assert [int(v) for v in ds[9]["x"]] == [9] * 4
    report = gpufeed.verify(dest)
    assert report.ok, report.problems
    # no sample byte copied: the merged pack's data files are the parts' files (hard links)
    big = max(manifest["files"], key=lambda n: manifest["files"][n]["bytes"])
    assert os.stat(dest / big).st_nlink == 2
    assert gpufeed.inspect(dest)["count"] == 15
    assert not (tmp_path / "merged.partial").exists()
    assert gpufeed.merge is merge  # the top-level name


def test_a_part_and_the_merged_lmdb_pack_read_in_one_process(tmp_path):
    # the merged pack's data.mdb is a hard link of the part's: one LMDB environment for both
    parts = make_parts(tmp_path, "lmdb", sizes=(3, 2))
    part = gpufeed.open_dataset(parts[0])
    assert [int(part[i]["label"]) for i in range(3)] == [0, 1, 2]
    merge(parts, tmp_path / "m")
    assert labels_of(tmp_path / "m") == list(range(5))
    assert labels_of(parts[1]) == [3, 4] and gpufeed.verify(tmp_path / "m").ok


def test_a_merged_pack_takes_its_formats_reader_options(tmp_path):
    from gpufeed.formats.multipart import MultiPartReader
    from gpufeed.formats.open import open_reader

    merge(make_parts(tmp_path, "hdf5", sizes=(2, 3)), tmp_path / "m")
    reader = open_reader(tmp_path / "m", use_mmap=False)
    assert isinstance(reader, MultiPartReader) and len(reader.read_batch(np.arange(5))) == 5
    typo = f"{tmp_path / 'm'}: the hdf5 reader takes no option use_map="
    with pytest.raises(UsageError, match=typo):
        open_reader(tmp_path / "m", use_map=False)


def test_merged_tar_is_an_ordinary_tar_pack(tmp_path):
    parts = make_parts(tmp_path, "tar", sizes=(3, 4))
    manifest = merge(parts, tmp_path / "m")
    assert "parts" not in manifest["layout"]
    assert manifest["layout"]["shards"] == ["shard-000000.tar", "shard-000001.tar"]
    assert manifest["layout"]["shard_counts"] == [3, 4]
    assert not (tmp_path / "m" / "sources.txt").exists()  # no part's samples have names


def test_a_merged_tar_pack_lists_its_parts_sample_names_in_order(tmp_path):
    names = [[f"a/{i}.jpg" for i in range(3)], [f"b/{i}.jpg" for i in range(2)]]
    parts = []
    for k, part_names in enumerate(names):
        samples = [{"x": np.full(4, i, np.uint8), "label": i} for i in range(len(part_names))]
        gpufeed.pack_samples(samples, tmp_path / f"p{k}", format="tar", names=part_names)
        parts.append(tmp_path / f"p{k}")
    merge(parts, tmp_path / "m")
    assert (tmp_path / "m" / "sources.txt").read_text().splitlines() == names[0] + names[1]


def test_merge_array_samples_mmap(tmp_path, make_arrays):
    parts = []
    for k in range(3):
        make_arrays(tmp_path / f"src{k}", {"a": 2 + k}, shape=(3, 4), seed=k)
        parts.append(tmp_path / f"p{k}")
        gpufeed.pack(tmp_path / f"src{k}", parts[-1], format="mmap", quiet=True)
    merge(parts, tmp_path / "m")
    ds = gpufeed.open_dataset(tmp_path / "m")
    opened = [gpufeed.open_dataset(p) for p in parts]
    want = [part[i][0] for part in opened for i in range(len(part))]
    got = [ds[i][0] for i in range(len(ds))]
    assert len(got) == 9 and all((a == b).all() for a, b in zip(got, want, strict=True))
    batch = ds.reader.read_batch(np.array([8, 0, 3, 2], dtype=np.int64))  # across parts
    assert isinstance(batch, np.ndarray) and batch.shape[0] == 4


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_make_loader_rank_split_and_block_shuffle_across_parts(tmp_path, fmt):
    merge(make_parts(tmp_path, fmt, sizes=(10, 6, 8)), tmp_path / "m")
    seen = []
    for rank in range(2):
        loader = gpufeed.make_loader(
            gpufeed.open_dataset(tmp_path / "m"),
            batch_size=4,
            shuffle=True,
            num_workers=0,
            rank=rank,
            world_size=2,
        )
        seen.append([int(v) for b in loader for v in b["label"]])
    assert len(seen[0]) == len(seen[1]) == 12
    assert sorted(seen[0] + seen[1]) == list(range(24))


def test_merge_again_is_idempotent_and_a_changed_part_is_a_new_merge(tmp_path):
    parts = make_parts(tmp_path, "mmap", sizes=(2, 3))
    first = merge(parts, tmp_path / "m")
    mtime = (tmp_path / "m" / MANIFEST_NAME).stat().st_mtime_ns
    assert merge(parts, tmp_path / "m") == first
    assert (tmp_path / "m" / MANIFEST_NAME).stat().st_mtime_ns == mtime
    write_part(parts[1], "mmap", 100, 1, overwrite=True)
    with pytest.raises(UsageError, match="not a merge of these parts"):
        merge(parts, tmp_path / "m")
    merge(parts, tmp_path / "m", overwrite=True)
    assert labels_of(tmp_path / "m") == [0, 1, 100]


def test_refusals_name_the_part(tmp_path):
    a = write_part(tmp_path / "a", "tar", 0, 2)
    b = write_part(tmp_path / "b", "mmap", 2, 2)
    with pytest.raises(UsageError, match=f"{b}: its format is mmap"):
        merge([a, b], tmp_path / "m")
    c = write_part(tmp_path / "c", "tar", 2, 2, schema={"x": "uint8[-1]", "label": "int"})
    with pytest.raises(UsageError, match=f"{c}: its sample is"):
        merge([a, c], tmp_path / "m")
    d = write_part(tmp_path / "d", "tar", 2, 2)
    m = json.loads((d / MANIFEST_NAME).read_text())
    m["created_by"] = "gpufeed 0.0.1"
    (d / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(UsageError, match=f"{d}: its created_by is gpufeed 0.0.1"):
        merge([a, d], tmp_path / "m")
    with pytest.raises(NotPackedError, match=f"part {tmp_path / 'nothing'}"):
        merge([a, tmp_path / "nothing"], tmp_path / "m")
    with pytest.raises(UsageError, match="cannot be, hold or lie inside DEST"):
        merge([a], a / "inside")
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


def test_a_crafted_parts_layout_is_refused(tmp_path):
    merge(make_parts(tmp_path, "mmap", sizes=(2, 2)), tmp_path / "m")
    path = tmp_path / "m" / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    manifest["layout"]["parts"][1]["path"] = "../part-0"
    path.write_text(json.dumps(manifest))
    with pytest.raises(UnsafePathError, match="leads outside the pack"):
        gpufeed.open_dataset(tmp_path / "m")
    manifest["layout"]["parts"][1] = {"path": "parts/000001", "count": 5}
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=str(tmp_path / "m" / "parts" / "000001")):
        gpufeed.open_dataset(tmp_path / "m")


# the merge is killed (SIGKILL) at one of these points, in a child process
KILL_POINTS = {
    "first-link": "merge_mod._link",
    "manifest": "merge_mod.write_manifest",
    "rename": "merge_mod.swap_into_place",
    "cleanup": "merge_mod.remove_partial",
}
CHILD = """
import os, signal, sys
import gpufeed.write.merge as merge_mod
where, parts, dest = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
setattr(merge_mod, where.split(".")[1], killed)
merge_mod.merge(parts, dest)
"""


@pytest.mark.parametrize("point", KILL_POINTS)
@pytest.mark.parametrize("fmt", ["tar", "lmdb"])
def test_a_merge_killed_leaves_the_parts_or_a_complete_pack(tmp_path, python_env, point, fmt):
    parts = make_parts(tmp_path, fmt, sizes=(3, 4))
    dest = tmp_path / "m"
    args = [KILL_POINTS[point], *map(str, parts), str(dest)]
    run = subprocess.run([sys.executable, "-c", CHILD, *args], env=python_env, timeout=120)
    assert run.returncode == -9
    assert labels_of(parts[0]) == [0, 1, 2] and labels_of(parts[1]) == [3, 4, 5, 6]
    if point == "cleanup":
        assert labels_of(dest) == list(range(7))  # renamed into place: complete
    else:
        with pytest.raises(NotPackedError):
            gpufeed.open_dataset(dest)
    merge(parts, dest)  # again: finishes, or finds it finished
    assert labels_of(dest) == list(range(7))
    assert not (tmp_path / "m.partial").exists()


def test_pack_resume_on_a_merged_pack_returns_it_as_it_is(tmp_path, make_images, capsys):
    """`gpufeed pack SRC DEST --resume` where DEST is a finished merge of parts packed from
    SRC's slices: the merged pack is returned as it is, with a message; never re-packed or
    replaced without --overwrite."""
    for k in range(2):
        make_images(tmp_path / f"src-{k}", {"a": 2 + k, "b": 3})
        gpufeed.pack(tmp_path / f"src-{k}", tmp_path / f"part-{k}", "tar", quiet=True)
    make_images(tmp_path / "src", {"a": 5, "b": 6})
    dest = tmp_path / "m"
    merged = merge([tmp_path / "part-0", tmp_path / "part-1"], dest)
    before = {p.name: os.stat(p).st_ino for p in dest.iterdir()}
    mtime = (dest / MANIFEST_NAME).stat().st_mtime_ns
    capsys.readouterr()
    assert gpufeed.pack(tmp_path / "src", dest, "tar", resume=True) == merged
    err = capsys.readouterr().err
    assert f"{dest}: already complete, a merge of 2 parts (gpufeed merge)" in err
    assert "pass --overwrite to re-pack it from SRC" in err
    assert {p.name: os.stat(p).st_ino for p in dest.iterdir()} == before
    assert (dest / MANIFEST_NAME).stat().st_mtime_ns == mtime
    assert not (tmp_path / "m.partial").exists()
    with pytest.raises(UsageError, match="already exists, packed from other sources"):
        gpufeed.pack(tmp_path / "src", dest, "hdf5", resume=True, quiet=True)  # another format
    with pytest.raises(UsageError, match="already exists; pass --overwrite"):
        gpufeed.pack(tmp_path / "src", dest, "tar", quiet=True)  # no --resume
    assert {p.name: os.stat(p).st_ino for p in dest.iterdir()} == before
    # --overwrite re-packs it from SRC: an ordinary pack of SRC now
    manifest = gpufeed.pack(tmp_path / "src", dest, "tar", overwrite=True, quiet=True)
    assert manifest["count"] == 11 and "merged_from" not in manifest


def _ids(text: str) -> list[int]:
    """A tokenizer for the token-pack parts: a word's length, a word an id."""
    return [len(word) for word in text.split()]


@pytest.mark.parametrize("fmt", ["mmap", "lmdb"])
def test_token_parts_merge_into_one_stream_with_their_eos(tmp_path, fmt):
    """pack_tokens' record (eos already ends each document) is carried by the merge, so the
    merged pack's windows get no second eos; parts with another eos are refused."""
    texts = [["a bb ccc", "dddd"], ["ee f"]]
    parts = []
    for k, docs in enumerate(texts):
        parts.append(tmp_path / f"p{k}")
        gpufeed.pack_tokens(docs, parts[-1], fmt, tokenize=_ids, vocab_size=100, eos=99, quiet=True)
    merge(parts, tmp_path / "merged")
    windows = gpufeed.open_dataset(tmp_path / "merged", block_size=3, eos=99)
    stream = [1, 2, 3, 99, 4, 99, 2, 1, 99]
    assert [w.tolist() for w in windows] == [stream[i : i + 3] for i in range(0, 9, 3)]
    other = tmp_path / "other"
    gpufeed.pack_tokens(["g"], other, fmt, tokenize=_ids, vocab_size=100, eos=98, quiet=True)
    with pytest.raises(UsageError, match=f"{other}: its token settings"):
        merge([parts[0], other], tmp_path / "refused")
