"""Packing into a URL when an upload was cut short (storage/upload.py, write/remote.py): a
rerun without --resume says what the prefix holds and what to do; --resume uploads the staged
pack only when none of its source files changed since it was staged (else it packs again),
and says which it did."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from unit_sources import write_arrays

from gpufeed.data.open import open_dataset
from gpufeed.write.pack import pack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.fixture()
def cut_upload(s3, tmp_path, monkeypatch, rclone_server):
    """(source folder, URL, env): a pack of the folder into URL whose upload was cut short
    before its manifest, the staged pack left in the cache folder, as a killed
    `gpufeed pack SRC URL` leaves them."""
    src = tmp_path / "src"
    write_arrays(src, {"x": 3, "y": 3})
    cache = tmp_path / "cache"
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(cache))
    url = f"{s3}/p"
    pack(src, url, "tar", shard_size=2, quiet=True, keep_staging=True)
    rclone_server.delete(f"{url}/manifest.json")
    env = {**os.environ, "GPUFEED_CACHE_DIR": str(cache)}
    return src, url, env


def _cli_pack(src, url, env, python_env, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpufeed", "pack", str(src), url, "-f", "tar", "--shard-size",
         "2", *extra],
        capture_output=True, text=True, env={**env, **python_env}, timeout=150,
    )  # fmt: skip


def _samples(url, cache) -> list[bytes]:
    ds = open_dataset(url, cache_dir=cache)
    return [ds[i][0].numpy().tobytes() for i in range(len(ds))]


def test_a_rerun_without_resume_says_the_upload_is_unfinished(cut_upload, python_env):
    src, url, env = cut_upload
    out = _cli_pack(src, url, env, python_env)
    assert out.returncode == 2, out.stderr
    assert f"{url}: holds" in out.stderr and "an unfinished upload" in out.stderr
    assert "rerun with --resume" in out.stderr
    assert "not a gpufeed pack, so" not in out.stderr


def test_resume_reuses_the_staged_pack_when_no_source_changed(
    cut_upload, python_env, tmp_path, rclone_server
):
    src, url, env = cut_upload
    out = _cli_pack(src, url, env, python_env, "--resume")
    assert out.returncode == 0, out.stderr
    assert "reusing the staged pack: none of its 6 source files changed" in out.stderr
    assert "manifest.json" in rclone_server.keys(url)


def test_resume_packs_again_when_a_source_changed_after_staging(
    cut_upload, python_env, tmp_path, rclone_server
):
    """Same size, mtime put back (what cp -p or rsync -t do): ctime still tells."""
    src, url, env = cut_upload
    victim = sorted((src / "y").iterdir())[1]
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = _cli_pack(src, url, env, python_env, "--resume")
    assert out.returncode == 0, out.stderr
    assert "1 source file(s) changed since this pack was staged" in out.stderr
    assert str(victim) in out.stderr and "packing again" in out.stderr
    got = _samples(url, tmp_path / "read")
    assert np.load(victim).tobytes() in got  # the new bytes went up, not the staged ones


def test_resume_packs_again_when_a_source_folder_is_rewritten(cut_upload, python_env, tmp_path):
    src, url, env = cut_upload
    shutil.rmtree(src / "y")
    (src / "y").mkdir()
    write_arrays(src, {"y": 3}, seed=7)  # same names, new files
    out = _cli_pack(src, url, env, python_env, "--resume")
    assert out.returncode == 0, out.stderr
    assert "changed since this pack was staged" in out.stderr
    got = _samples(url, tmp_path / "read")
    assert all(np.load(p).tobytes() in got for p in (src / "y").iterdir())


def test_an_object_listed_at_another_size_keeps_the_manifest_back(s3, tmp_path, monkeypatch):
    """The store listing an uploaded file at another size than the local one (a short
    write the store took) is a StorageError naming it, and no manifest is written."""
    from gpufeed.errors import NotPackedError, StorageError
    from gpufeed.storage import ObjectStore as Store
    from gpufeed.storage import parse_location, upload_pack

    src = tmp_path / "arrays"
    write_arrays(src, {"x": 3, "y": 3})
    pack(src, tmp_path / "p", format="mmap", quiet=True)
    real_list = Store.list

    def short_by_one(store, prefix=""):
        return {
            name: size - (name != "manifest.json")
            for name, size in real_list(store, prefix).items()
        }

    monkeypatch.setattr(Store, "list", short_by_one)
    url = f"{s3}/short"
    with pytest.raises(StorageError, match=r"bytes after the upload, .* expected; the manifest"):
        upload_pack(tmp_path / "p", url)
    monkeypatch.setattr(Store, "list", real_list)  # (undo() would drop the s3 environment too)
    assert "manifest.json" not in Store(parse_location(url)).list()
    with pytest.raises(NotPackedError):
        open_dataset(url, cache_dir=tmp_path / "cache")
