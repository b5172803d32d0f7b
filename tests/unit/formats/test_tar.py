"""formats/tar/reader.py: index.npz is untrusted. Every offset and size is checked against the
shard it names when a pack is opened (0 <= offset, offset + size <= the shard's bytes, the
samples of a shard in order), so a crafted index is a DataError naming index.npz and the
first bad sample: never a strided view past a shard's map (a SIGSEGV, or bytes of this
process's memory served as samples)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from faults import run_gpufeed
from unit_sources import write_arrays

import gpufeed
from gpufeed.errors import DataError
from gpufeed.formats.npy import npy_bytes
from gpufeed.formats.record import npy_header_for

N = 10  # samples int16 [3, 8, 10] in shards of 4, 4, 2


@pytest.fixture(scope="module")
def tar_pack(tmp_path_factory):
    root = tmp_path_factory.mktemp("tarpack")
    write_arrays(root / "src", {"x": 5, "y": 5}, shape=(3, 8, 10), seed=9, dtype=np.int16)
    gpufeed.pack(root / "src", root / "ds.tar", format="tar", workers=1, quiet=True, shard_size=4)
    return root / "ds.tar"


def index_arrays(pack) -> dict[str, np.ndarray]:
    with np.load(pack / "index.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def crafted(pack, dest, **arrays):
    """A copy of ``pack`` whose index.npz holds ``arrays`` in place of its own, the manifest
    updated to match (as whoever crafted it would)."""
    shutil.copytree(pack, dest)
    np.savez(dest / "index.npz", **{**index_arrays(pack), **arrays})
    relist(dest, "index.npz")
    return dest


def relist(dest, name) -> None:
    """The manifest's size and sha256 of ``name`` made those of the file as it is now."""
    data = (dest / name).read_bytes()
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (dest / "manifest.json").write_text(json.dumps(manifest))


def at_one_stride(first: int, stride: int) -> np.ndarray:
    """Offsets first, first + stride, ... in each shard: what shard_strides accepts."""
    return np.concatenate([first + stride * np.arange(n) for n in (4, 4, 2)]).astype(np.int64)


def test_an_intact_pack_opens_and_reads(tar_pack):
    ds = gpufeed.open_dataset(tar_pack, map_style=True)
    assert len(ds) == N and tuple(ds[3][0].shape) == (3, 8, 10)


# the child's ways to read a pack: each prints the error it got and exits 3
_READ = {
    "dataloader": (
        "import torch\n"
        "ds = gpufeed.open_dataset(path, map_style=True)\n"
        "for batch in torch.utils.data.DataLoader(ds, batch_size=4, num_workers=0): pass\n"
    ),
    "make_loader": (
        "ds = gpufeed.open_dataset(path, map_style=True)\n"
        "for batch in gpufeed.make_loader(ds, batch_size=4, num_workers=0): pass\n"
    ),
}


def _read_in_child(path, how: str, env) -> subprocess.CompletedProcess:
    code = (
        "import sys, gpufeed\n"
        "from gpufeed.errors import GpufeedError\n"
        "path = sys.argv[1]\n"
        "try:\n" + "".join("    " + line + "\n" for line in _READ[how].splitlines()) + ""
        "except GpufeedError as e:\n"
        "    print(type(e).__name__, e, flush=True)\n"
        "    sys.exit(3)\n"
        "print('READ', flush=True)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("how", ["verify", "dataloader", "make_loader"])
def test_negative_offsets_at_one_stride_are_an_error_not_a_segfault(
    tar_pack, tmp_path, python_env, how
):
    # offsets -1e9 at a stride of 1e8 passed every check: the strided view read far
    # outside the shard's map (SIGSEGV)
    dest = crafted(tar_pack, tmp_path / "bad", offset=at_one_stride(-(10**9), 10**8))
    if how == "verify":
        r = run_gpufeed("verify", dest, env=python_env)
        assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
        out = r.stdout + r.stderr
    else:
        r = _read_in_child(dest, how, python_env)
        assert r.returncode == 3, (r.returncode, r.stdout, r.stderr)  # -11 was SIGSEGV
        out = r.stdout
        assert out.startswith("DataError")
    assert f"{dest / 'index.npz'}: sample 0 " in out and "negative offset" in out


def test_offsets_before_the_shard_are_an_error_not_other_memory(tar_pack, tmp_path):
    # offsets 1000 bytes before each shard at the pack's own stride: samples were bytes
    # of the process's memory (libpython's), silently
    stride = int(np.diff(index_arrays(tar_pack)["offset"][:2])[0])
    dest = crafted(tar_pack, tmp_path / "bad", offset=at_one_stride(-1000, stride))
    with pytest.raises(DataError, match="sample 0 .*negative offset") as e:
        gpufeed.open_dataset(dest, map_style=True)
    assert str(dest / "index.npz") in str(e.value)


def _reversed_in_shards(offset: np.ndarray) -> np.ndarray:
    out = offset.copy()
    for a, b in ((0, 4), (4, 8), (8, 10)):
        out[a:b] = offset[a:b][::-1]
    return out


@pytest.mark.parametrize(
    "what, edit, message",
    [
        ("past the end", lambda a: {"offset": a["offset"] + 10**6}, "sample 0 .*ends past"),
        ("size past the end", lambda a: {"size": a["size"] * 1000}, "sample 0 .*ends past"),
        ("negative size", lambda a: {"size": -a["size"]}, "sample 0 .*negative offset or size"),
        (
            "a negative stride",  # the strided view ran backwards from the run's start
            lambda a: {"offset": _reversed_in_shards(a["offset"])},
            "sample 1 .*starts before the sample before it",
        ),
        (
            "overlapping samples",
            lambda a: {"offset": np.where(np.arange(N) == 1, a["offset"][0] + 8, a["offset"])},
            "sample 1 .*starts before",
        ),
        ("a shard out of range", lambda a: {"shard": a["shard"] + 7}, "sample 0 .*is in shard 0"),
        ("shards out of order", lambda a: {"shard": a["shard"][::-1].copy()}, "sample 0 .*shard"),
        (
            "uint64 past int64",
            lambda a: {"offset": a["offset"].astype(np.uint64) + np.uint64(2**63)},
            "sample 0 .*negative offset",
        ),
        ("float offsets", lambda a: {"offset": a["offset"] + 0.5}, "offset.npy holds float64"),
        ("too few entries", lambda a: {"size": a["size"][:-1]}, "size.npy holds int64 \\[9\\]"),
        ("a missing array", lambda a: {"crc32": None}, "has no crc32.npy"),
        (
            "a pickled object array",
            lambda a: {"labels": np.array([object()] * N)},
            "labels.npy .*(pickle|not a readable|object)",
        ),
    ],
)
def test_a_crafted_index_is_an_error_naming_it_and_the_sample(
    tar_pack, tmp_path, what, edit, message
):
    arrays = {**index_arrays(tar_pack), **edit(index_arrays(tar_pack))}
    dest = tmp_path / "bad"
    shutil.copytree(tar_pack, dest)
    np.savez(dest / "index.npz", **{k: v for k, v in arrays.items() if v is not None})
    relist(dest, "index.npz")
    with pytest.raises(DataError, match=message) as e:
        gpufeed.open_dataset(dest, map_style=True)
    assert str(dest / "index.npz") in str(e.value)


@pytest.mark.parametrize("counts", [[4, 4, 3], [5, -1, 6], "abc", [[4, 4, 2]]])
def test_manifest_shard_counts_that_do_not_fit_are_an_error(tar_pack, tmp_path, counts):
    dest = tmp_path / "bad"
    shutil.copytree(tar_pack, dest)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["layout"]["shard_counts"] = counts
    (dest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="shard_counts") as e:
        gpufeed.open_dataset(dest, map_style=True)
    assert str(dest) in str(e.value)


def test_a_truncated_shard_is_still_a_per_sample_error(tar_pack, tmp_path):
    # the index is checked against the manifest's shard sizes: a shard cut short since is
    # found by the reads (each checks its end against the map), naming the sample
    dest = tmp_path / "cut"
    shutil.copytree(tar_pack, dest)
    with open(dest / "shard-000001.tar", "r+b") as f:
        f.truncate(4000)
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert tuple(ds[0][0].shape) == (3, 8, 10)
    with pytest.raises(DataError, match="shard is truncated"):
        ds[6]


@pytest.mark.slow
def test_index_members_larger_than_the_count_allows_are_refused_before_reading(tar_pack, tmp_path):
    # a deflated member of 512 MiB of zeros, a few hundred KiB on disk: np.load read all of
    # it before the count was compared
    dest = tmp_path / "bomb"
    shutil.copytree(tar_pack, dest)
    arrays = index_arrays(tar_pack)
    with zipfile.ZipFile(dest / "index.npz", "w", zipfile.ZIP_DEFLATED) as z:
        for name, arr in arrays.items():
            if name != "offset":
                z.writestr(f"{name}.npy", npy_bytes(arr))
        with z.open("offset.npy", "w", force_zip64=True) as f:
            f.write(npy_header_for("<i8", (64 << 20,)))  # 64 Mi entries
            for _ in range(512):
                f.write(bytes(1 << 20))
    relist(dest, "index.npz")
    assert (dest / "index.npz").stat().st_size < 4 << 20
    with pytest.raises(DataError, match="offset.npy declares 536,871,040 bytes") as e:
        gpufeed.open_dataset(dest, map_style=True)
    assert str(dest / "index.npz") in str(e.value)


# -- the default shard size (formats/tar/writer.py: default_shard_size) ------------------------


@pytest.fixture(scope="module")
def small_samples(tmp_path_factory):
    """2,000 samples of 60 bytes: under the old default (10,000 a shard) one shard, so one
    rank or worker of many got every sample and the rest none."""
    root = tmp_path_factory.mktemp("small")
    write_arrays(root / "src", {"a": 1000, "b": 1000}, shape=(3, 4, 5), seed=3)
    return root / "src"


def test_the_default_shard_size_rule():
    from gpufeed.formats.tar.writer import DEFAULT_SHARD_SIZE, default_shard_size

    assert default_shard_size(None) == DEFAULT_SHARD_SIZE  # not known yet
    assert default_shard_size(2000) == 125  # 16 shards
    assert default_shard_size(100) == 64  # no smaller than 64 samples: 2 shards
    assert default_shard_size(10) == 64
    assert default_shard_size(16 * DEFAULT_SHARD_SIZE + 1) == DEFAULT_SHARD_SIZE
    assert default_shard_size(10**8) == DEFAULT_SHARD_SIZE


@pytest.mark.slow
def test_a_small_pack_is_several_shards_by_default(small_samples, tmp_path):
    m = gpufeed.pack(small_samples, tmp_path / "p", format="tar", workers=1, quiet=True)
    counts = m["layout"]["shard_counts"]
    assert len(counts) >= 8 and counts == [125] * 16
    assert m["layout"]["shard_size"] == 125 and m["options"]["shard_size"] is None
    ds = gpufeed.open_dataset(tmp_path / "p", map_style=True)
    assert len(ds) == 2000 and int(ds[1999][1]) == 1


@pytest.mark.parametrize("shard_size, counts", [(1000, [1000, 1000]), (10_000, [2000])])
def test_an_explicit_shard_size_is_kept(small_samples, tmp_path, shard_size, counts):
    m = gpufeed.pack(
        small_samples, tmp_path / "p", format="tar", workers=1, quiet=True, shard_size=shard_size
    )
    assert m["layout"]["shard_counts"] == counts and m["layout"]["shard_size"] == shard_size


def test_large_samples_are_cut_by_bytes_by_default(tmp_path):
    """40 samples of 3 MiB: the count rule allows 64 a shard; the default 64 MiB a shard
    cuts them into two."""
    from gpufeed.formats.tar.writer import DEFAULT_SHARD_BYTES

    def sample(i):
        return {"x": np.full((1536, 2048), i, np.uint8)}

    m = gpufeed.pack_map(sample, range(40), tmp_path / "p", format="tar", workers=0, quiet=True)
    counts = m["layout"]["shard_counts"]
    assert counts == [21, 19] and m["layout"]["shard_bytes"] == DEFAULT_SHARD_BYTES == 64 << 20
    for name in m["layout"]["shards"]:
        assert (tmp_path / "p" / name).stat().st_size <= DEFAULT_SHARD_BYTES
    ds = gpufeed.open_dataset(tmp_path / "p", map_style=True)
    assert int(ds[39]["x"][0, 0]) == 39


def test_a_pack_with_skipped_files_is_cut_for_the_samples_it_keeps(tmp_path):
    """The shards are streamed as parts are committed, cut for the folder's 1,100 files (69
    a shard); 85 skipped, the 1,015 kept are cut again for their own count (64 a shard),
    read back from the streamed shards."""
    paths = write_arrays(tmp_path / "src", None, count=1100, seed=4)
    for p in paths[::13]:
        p.write_bytes(b"not an array")
    m = gpufeed.pack(
        tmp_path / "src", tmp_path / "p", format="tar", workers=1, quiet=True, on_error="skip"
    )
    assert m["count"] == 1015 and m["layout"]["shard_counts"] == [64] * 15 + [55]
    ds = gpufeed.open_dataset(tmp_path / "p", map_style=True)
    kept = [p for i, p in enumerate(paths) if i % 13]
    for j in (0, 63, 64, 500, 1014):
        np.testing.assert_array_equal(ds[j][0].numpy(), np.load(kept[j]))
    report = gpufeed.verify(tmp_path / "p")  # every shard's sha256, every sample's crc32
    assert report.ok and report.samples_checked == 1015
