"""A remote pack's manifest is untrusted (storage/packs.py, storage/remote.py): a name that
leaves the pack (absolute, "..") is refused before anything is fetched or linked, with the
error a local pack gets (UnsafePathError naming the object), and the cache's view of a pack
never gets a link outside itself; the file a crafted name points at is left untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpufeed.data.open import open_dataset
from gpufeed.errors import UnsafePathError
from gpufeed.storage import upload_pack
from gpufeed.tools.verify import verify

pytestmark = pytest.mark.timeout(180)
PRECIOUS = b"the user's own file\n"


def _renamed(rclone_server, url: str, old: str, new: str, *, upload: bool = True) -> None:
    """The pack at `url` with its file `old` renamed `new` in the manifest (files and the tar
    layout's shards), as a crafted upload would name it; its bytes uploaded under that key."""
    manifest = json.loads(rclone_server.get(f"{url}/manifest.json"))
    manifest["files"][new] = manifest["files"].pop(old)
    shards = manifest["layout"].get("shards")
    if shards:
        manifest["layout"]["shards"] = [new if s == old else s for s in shards]
    if upload:
        rclone_server.put(f"{url}/{new.lstrip('/')}", rclone_server.get(f"{url}/{old}"))
    rclone_server.put(f"{url}/manifest.json", json.dumps(manifest).encode())


def _read_all(url: str, cache: Path) -> None:
    ds = open_dataset(url, cache_dir=cache)
    for i in range(len(ds)):
        ds[i]


def _untouched(victim: Path) -> None:
    assert not victim.is_symlink()
    assert victim.read_bytes() == PRECIOUS


def _cli_verify(url: str, cache: Path, python_env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gpufeed", "verify", url, "-q", "--cache-dir", str(cache)],
        capture_output=True, text=True, env={**os.environ, **python_env}, timeout=120,
    )  # fmt: skip


def test_an_absolute_shard_name_is_refused_before_any_fetch_or_link(
    s3, tar_pack, tmp_path, rclone_server, python_env
):
    url = f"{s3}/evil"
    upload_pack(tar_pack, url)
    victim = tmp_path / "home" / ".bashrc"
    victim.parent.mkdir()
    victim.write_bytes(PRECIOUS)
    _renamed(rclone_server, url, "shard-000001.tar", str(victim))
    cache = tmp_path / "cache"
    with pytest.raises(UnsafePathError, match=rf"{url}/+{victim}: leads outside the pack"):
        _read_all(url, cache)
    with pytest.raises(UnsafePathError, match=rf"{url}/+{victim}: leads outside the pack"):
        verify(url, cache_dir=cache)
    out = _cli_verify(url, cache, python_env)
    assert out.returncode == 1 and f"{victim}: leads outside the pack" in out.stderr, out.stderr
    _untouched(victim)
    assert not list((cache / "objects").rglob("*")) or all(
        p.is_dir() for p in (cache / "objects").rglob("*")
    )  # nothing was fetched


def test_a_dotdot_name_whose_bytes_are_already_cached_is_never_linked(
    s3, tar_pack, tmp_path, rclone_server, python_env
):
    """obstore refuses a ".." key on download, but a name whose sha256 is already in the cache
    needs no download: the name itself must be refused."""
    url = f"{s3}/evil"
    upload_pack(tar_pack, url)
    cache = tmp_path / "cache"
    _read_all(url, cache)  # every shard's sha256 now in the cache
    victim = tmp_path / "victim"
    victim.write_bytes(PRECIOUS)
    # the view of the pack is cache/packs/s3/<bucket>/evil: five levels below tmp_path
    name = "../../../../../victim"
    assert (cache / "packs" / "s3" / "b" / "evil" / name).resolve() == victim.resolve()
    _renamed(rclone_server, url, "shard-000001.tar", name, upload=False)
    with pytest.raises(UnsafePathError, match=rf"{url}/{name}: leads outside the pack"):
        _read_all(url, cache)
    with pytest.raises(UnsafePathError, match=rf"{url}/{name}: leads outside the pack"):
        verify(url, cache_dir=cache)
    out = _cli_verify(url, cache, python_env)
    assert out.returncode == 1 and f"{name}: leads outside the pack" in out.stderr, out.stderr
    _untouched(victim)


@pytest.mark.parametrize("name", ["a//b.tar", "./b.tar", "a/./b.tar", "b.tar\0x"])
def test_names_that_are_not_plain_file_names_are_refused(
    s3, tar_pack, tmp_path, rclone_server, name
):
    url = f"{s3}/odd"
    upload_pack(tar_pack, url)
    _renamed(rclone_server, url, "shard-000001.tar", name, upload=False)
    with pytest.raises(UnsafePathError, match="is not a plain file name inside the pack"):
        open_dataset(url, cache_dir=tmp_path / "cache")


def test_a_layout_naming_a_file_the_manifest_does_not_list_is_refused_by_its_name(
    s3, tar_pack, tmp_path, rclone_server
):
    url = f"{s3}/layout"
    upload_pack(tar_pack, url)
    manifest = json.loads(rclone_server.get(f"{url}/manifest.json"))
    manifest["layout"]["shards"][1] = "/etc/passwd"
    rclone_server.put(f"{url}/manifest.json", json.dumps(manifest).encode())
    with pytest.raises(UnsafePathError, match=rf"{url}/+etc/passwd: leads outside the pack"):
        _read_all(url, tmp_path / "cache")


def test_a_link_in_the_cache_view_leading_out_is_never_followed(
    s3, tar_pack, tmp_path, rclone_server
):
    """Defence in depth: a folder of the pack's view replaced by a link out of the cache
    (someone sharing the cache) gets no link written through it."""
    url = f"{s3}/nested"
    upload_pack(tar_pack, url)
    _renamed(rclone_server, url, "shard-000001.tar", "sub/shard-000001.tar")
    cache = tmp_path / "cache"
    ds = open_dataset(url, cache_dir=cache)
    outside = tmp_path / "outside"
    outside.mkdir()
    (ds.reader.root / "sub").symlink_to(outside)
    with pytest.raises(UnsafePathError, match=r"sub/shard-000001.tar: would be linked outside"):
        ds.reader.read_batch(np.arange(len(ds)))  # the reader's own error (datasets wrap it)
    assert list(outside.iterdir()) == []


def test_a_remote_packs_cache_and_staging_are_private(
    s3, tar_pack, array_folder, tmp_path, monkeypatch
):
    """Under the usual umask (022) the cache would be world-readable: everything gpufeed
    makes there is 0700 (folders) or 0600 (files), the pack's view and staging included."""
    from gpufeed.write.pack import pack

    monkeypatch.delenv("GPUFEED_CACHE_SHARED", raising=False)
    monkeypatch.setenv("GPUFEED_CACHE_DIR", str(tmp_path / "cache"))
    old = os.umask(0o022)
    try:
        upload_pack(tar_pack, f"{s3}/train")
        _read_all(f"{s3}/train", tmp_path / "cache")
        pack(array_folder, f"{s3}/p", "tar", shard_size=4, quiet=True, keep_staging=True)
    finally:
        os.umask(old)
    cache = tmp_path / "cache"
    assert (cache / "packs" / "s3").is_dir() and (cache / "staging" / "s3").is_dir()
    for p in [cache, *cache.rglob("*")]:
        parts = p.relative_to(cache).parts
        if p.is_symlink() or (parts[:1] == ("staging",) and len(parts) > 3):
            continue  # links; the staged pack itself (made by pack, inside a 0700 folder)
        want = 0o700 if p.is_dir() else 0o600
        assert p.stat().st_mode & 0o777 == want, f"{p}: {oct(p.stat().st_mode & 0o777)}"


@pytest.fixture()
def eight_shards(tmp_path) -> Path:
    """A tar pack of 40 samples of 3 KiB in 8 shards of about 16 KiB."""
    from unit_sources import write_arrays

    from gpufeed.write.pack import pack

    write_arrays(tmp_path / "src", {"a": 20, "b": 20}, shape=(3, 32, 32))
    pack(tmp_path / "src", tmp_path / "pack", "tar", shard_size=5, quiet=True)
    return tmp_path / "pack"


def _pack_bytes(pack_dir: Path) -> int:
    return sum(p.stat().st_size for p in pack_dir.iterdir())


READ_SHUFFLED = """
import sys
import numpy as np
from gpufeed.data.open import open_dataset
ds = open_dataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit=int(sys.argv[3]))
for i in np.random.default_rng(int(sys.argv[4])).permutation(len(ds)):
    ds[int(i)]
print("read", len(ds))
"""


def test_a_map_style_reader_works_in_a_cache_smaller_than_the_pack(s3, eight_shards, tmp_path):
    """Pins (shards held open, fetched ahead) are sized from cache_limit: a process reading
    in random order needs room for the index and the shard it reads, not for four or more."""
    upload_pack(eight_shards, f"{s3}/train")
    total = _pack_bytes(eight_shards)
    limit = 120_000
    assert limit < total
    ds = open_dataset(f"{s3}/train", cache_dir=tmp_path / "c", cache_limit=limit)
    order = np.random.default_rng(0).permutation(len(ds))
    got = {int(i): ds[int(i)][0].numpy().tobytes() for i in order}
    local = open_dataset(eight_shards)
    assert got == {i: local[i][0].numpy().tobytes() for i in range(len(local))}


@pytest.mark.slow
def test_two_processes_share_a_cache_of_80_percent_of_the_pack(
    s3, eight_shards, tmp_path, python_env
):
    upload_pack(eight_shards, f"{s3}/train")
    limit = int(_pack_bytes(eight_shards) * 0.8)
    env = {**os.environ, **python_env}
    run = [sys.executable, "-c", READ_SHUFFLED, f"{s3}/train", str(tmp_path / "c"), str(limit)]
    procs = [
        subprocess.Popen([*run, str(seed)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for seed in (1, 2)
    ]
    for p in procs:
        out, err = p.communicate(timeout=150)
        assert p.returncode == 0, err.decode()[-2000:]
        assert out.decode().strip() == "read 40"


def test_a_merged_pack_of_parts_uploaded_to_object_storage_reads(s3, tmp_path):
    # a merged mmap pack reads each part through its own reader, fetched through the cache
    import gpufeed
    from gpufeed.write.merge import merge

    parts = []
    for k in range(2):
        parts.append(tmp_path / f"part-{k}")
        with gpufeed.Writer(parts[-1], format="mmap", schema={"label": "int"}) as w:
            w.write({"label": k})
    merge(parts, tmp_path / "merged")
    url = f"{s3}/merged"
    upload_pack(tmp_path / "merged", url)
    cache = tmp_path / "cache"
    assert [int(open_dataset(url, cache_dir=cache)[i]["label"]) for i in range(2)] == [0, 1]
    assert verify(url, cache_dir=cache).ok
