"""The fuzz harness of tests/unit/security: small packs of known samples, seeded mutators of
every structure a pack holds, and a child process that reads the crafted packs under limits.

Parent side: ``build_packs`` writes one pack per (format, kind of sample); ``plan_cases``
lays out N cases round-robin over every (pack, mutation kind) that applies, each with its
own seed; ``materialize`` writes a case's crafted copy; ``run_cases`` runs them in children
(``python fuzzpack.py CASES.json``), a batch per child, and returns one outcome per case.
A child that dies (a signal), hangs past the case timeout or outgrows its memory limit is
replaced, and the case it was on gets that outcome.

Child side (``child_main``): under RLIMIT_AS, opens each case's pack, reads every sample
(item by item, as one batch, and streamed for tar), then runs ``gpufeed.verify``, and
prints one JSON line per case.

``judge`` is the property: a gpufeed error naming the pack, or exactly the original
samples, or (damage only checksums can see) samples made of the pack's own bytes that
``verify`` reports; never a signal, a hang, a raw exception, memory past the bound, bytes
from outside the pack, or an unpickled object.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import select
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

FORMATS = ("mmap", "hdf5", "lmdb", "tar")
KINDS = ("flip", "manifest", "index", "tar_header", "npy_header", "zstd", "hdf5_layout", "pickle")
# bytes no pack holds: a sample containing them came from outside the pack
MARKER = b"GPUFEED-OUTSIDE!"
SECRET_SIZE = 1 << 16
FIELD_SCHEMA = {
    "a": "uint8[2,3]",
    "z": {"type": "bytes", "compression": "zstd"},
    "b": "bytes",
    "t": "str",
    "label": "int",
}
CASE_TIMEOUT_S = 20.0
BATCH = 400  # crafted copies on disk at a time
MEMORY_BOUND = 768 << 20  # RSS growth one case may cause; address space beyond the start: 2x


# ----------------------------------------------------------------------------- the packs
def field_sample(i: int) -> dict:
    return {
        "a": np.full((2, 3), i, np.uint8),
        "z": bytes([65 + i]) * 60,
        "b": f"r{i}".encode() * (i + 1),
        "t": f"s{i}",
        "label": i % 3,
    }


def build_packs(root: Path) -> dict[str, Path]:
    """Pack name -> path: arr.FMT (uint8 [3,4,5] arrays with classes), fld.FMT (multi-field
    records with a zstd field), arr-pt.mmap (the .pt container); plus the outside files."""
    from unit_sources import write_arrays

    import gpufeed

    root.mkdir(parents=True, exist_ok=True)
    write_arrays(root / "src", {"x": 5, "y": 4}, shape=(3, 4, 5))
    write_outside(root)
    packs = {}
    for fmt in FORMATS:
        shards = {"shard_size": 4} if fmt == "tar" else {}
        dest = root / "packs" / f"arr.{fmt}"
        gpufeed.pack(root / "src", dest, format=fmt, workers=1, quiet=True, **shards)
        packs[dest.name] = dest
        dest = root / "packs" / f"fld.{fmt}"
        with gpufeed.Writer(dest, format=fmt, schema=FIELD_SCHEMA, **shards) as w:
            for i in range(9):
                w.write(field_sample(i))
        packs[dest.name] = dest
    dest = root / "packs" / "arr-pt.mmap"
    gpufeed.pack(root / "src", dest, format="mmap", workers=1, quiet=True, container="pt")
    packs[dest.name] = dest
    return packs


def write_outside(root: Path) -> None:
    """secret.bin and secret.h5 beside the packs: what a crafted pack may point at."""
    import h5py

    (root / "secret.bin").write_bytes(MARKER * (SECRET_SIZE // len(MARKER)))
    secret = np.frombuffer(MARKER * (SECRET_SIZE // len(MARKER)), np.uint8)
    with h5py.File(root / "secret.h5", "w") as f:
        f["data"] = secret
        f["labels"] = np.zeros(64, np.int64)
        f["samples"] = secret[: 60 * 9].reshape(9, 3, 4, 5)


def pack_format(name: str) -> str:
    return name.rsplit(".", 1)[1]


# ----------------------------------------------------------------------------- the plan
def applies(kind: str, name: str) -> bool:
    fmt, fields = pack_format(name), name.startswith("fld")
    if name == "arr-pt.mmap":
        return kind in ("flip", "manifest", "index", "pickle")
    return {
        "tar_header": fmt == "tar",
        "npy_header": fmt in ("mmap", "tar", "lmdb"),
        "zstd": fields,
        "hdf5_layout": fmt == "hdf5",
        "pickle": fmt in ("mmap", "tar", "lmdb"),
    }.get(kind, True)


def known_attacks(names: list[str]) -> list[tuple[str, str, dict]]:
    """(pack, kind, forced picks) of the attacks issue 37 found, run first in every run."""
    names = sorted(names)
    found = []
    for n in names:
        fmt = pack_format(n)
        for target in ("/etc/passwd", "../secret.bin"):
            found.append((n, "manifest", {"how": "rename", "value": target}))
        if applies("pickle", n):
            found.append((n, "pickle", {}))
        offsets = {"tar": "index.npz:offset", "mmap": "offsets.npy", "lmdb": "values.npy",
                   "hdf5": "data.h5:offsets"}[fmt]  # fmt: skip
        if n.startswith("fld") or fmt in ("tar", "lmdb"):
            for stride in ("(-1000, 2048)", "(-1000000000, 100000000)"):
                force = {"target": offsets, "how": "negative-stride", "stride": stride}
                found.append((n, "index", force))
            found.append((n, "index", {"target": offsets, "how": "past-end"}))
        if n.startswith("fld"):
            found.append((n, "zstd", {"how": "size-1GiB"}))
        if fmt == "hdf5":
            for how in ("external", "labels-external", "virtual", "external-link", "soft-link",
                        "shape", "dtype"):  # fmt: skip
                found.append((n, "hdf5_layout", {"how": how}))
        if fmt == "tar":
            for how in ("size-b256", "size-octal", "name-dotdot", "symlink"):
                found.append((n, "tar_header", {"how": how}))
    return found


def plan_cases(
    names: list[str], count: int, seed: int = 37, kinds: tuple[str, ...] = KINDS
) -> list[dict]:
    """The known attacks (for the kinds asked), then random cases up to `count`,
    round-robin over every applicable (pack, kind): each pair is reached once before any
    is reached twice. Each case has its own seed."""
    cases = [
        {"case": i, "pack": n, "kind": k, "seed": seed * 1_000_003 + i, "force": force}
        for i, (n, k, force) in enumerate(x for x in known_attacks(names) if x[1] in kinds)
    ]
    pairs = [(n, k) for k in kinds for n in sorted(names) if applies(k, n)]
    for i in range(len(cases), count):
        n, k = pairs[i % len(pairs)]
        cases.append({"case": i, "pack": n, "kind": k, "seed": seed * 1_000_003 + i})
    return cases[:count] if count >= len(cases) else cases


# ----------------------------------------------------------------------------- mutators
class Forcing(random.Random):
    """A seeded Random whose named picks a case may force ({"how": "external"}): the known
    attacks of the issue run every time, the rest at random."""

    def __init__(self, seed: int, force: dict[str, str]):
        super().__init__(seed)
        self.force = force

    def pick(self, label: str, options: list, name=str):
        if label in self.force:
            found = [o for o in options if name(o) == self.force[label]]
            if not found:
                raise ValueError(f"no {label} {self.force[label]!r} among {options!r:.200}")
            return found[0]
        return self.choice(options)


def materialize(case: dict, packs: dict[str, Path], root: Path) -> Path:
    """Copy the case's pack to root/case-N and apply its mutation; records what was done
    in case["mutation"]."""
    src = packs[case["pack"]]
    dest = root / f"case-{case['case']:06d}"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)
    rng = Forcing(case["seed"], case.get("force", {}))
    outside = src.parent.parent
    try:
        case["mutation"] = MUTATORS[case["kind"]](dest, rng, outside)
    except Exception as e:  # noqa: BLE001 - a mutator that cannot apply is a bug of the harness
        raise RuntimeError(f"mutator {case['kind']} on {dest}: {e!r}") from e
    case["path"] = str(dest)
    return dest


def _resign(dest: Path, *names: str) -> None:
    """Write the manifest's size and sha256 of the named files as they are now (what a
    crafted pack's author does, so that only the structure is left to check)."""
    mpath = dest / "manifest.json"
    m = json.loads(mpath.read_text())
    for name in names:
        data = (dest / name).read_bytes()
        m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    mpath.write_text(json.dumps(m, indent=2))


def _data_files(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.iterdir() if p.is_file())


def mutate_flip(dest: Path, rng: Forcing, outside: Path) -> str:
    name = rng.pick("target", _data_files(dest))
    path = dest / name
    data = bytearray(path.read_bytes())
    flips = []
    for _ in range(rng.randint(1, 8)):
        pos = rng.randrange(len(data))
        data[pos] ^= 1 << rng.randrange(8)
        flips.append(pos)
    path.write_bytes(bytes(data))
    resign = name != "manifest.json" and rng.random() < 0.5
    if resign:
        _resign(dest, name)
    return f"flip {name} at {flips}" + (" (manifest re-signed)" if resign else "")


def _bad_values(rng: Forcing, outside: Path) -> list:
    return [
        "abc", -1, 0, 2**63, 2**64 + 5, 10**30, 1e308, float("nan"), None, True, [], {}, 42,
        [1, 2, 3], {"x": 1}, "/etc/passwd", "../secret.bin", str(outside / "secret.bin"),
        "a/../../secret.bin", "", "x" * 5000, [-1], [2**40], [2**62, 2**62],
    ]  # fmt: skip


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj and len(obj) < 50:
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    if path and path[0] not in ("source", "created_by", "options", "skipped"):
        yield path


def mutate_manifest(dest: Path, rng: Forcing, outside: Path) -> str:
    mpath = dest / "manifest.json"
    m = json.loads(mpath.read_text())
    choice = rng.random()
    # rename a listed file, everywhere the manifest names it (the layout too)
    if rng.force.get("how", "rename" if choice < 0.15 else "field") == "rename":
        old = rng.pick("target", sorted(m["files"]))
        names = ["../secret.bin", str(outside / "secret.bin"), "/etc/passwd", "sub/x"]
        new = rng.pick("value", names)
        m["files"][new] = m["files"].pop(old)
        text = json.dumps(m).replace(json.dumps(old), json.dumps(new))
        mpath.write_text(text)
        return f"manifest: file {old!r} renamed {new!r} everywhere"
    leaves = sorted(_leaves(m), key=repr)
    path = rng.pick("target", leaves, name=lambda p: ".".join(map(str, p)))
    value = rng.pick("value", _bad_values(rng, outside), name=repr)
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    mpath.write_text(json.dumps(m))
    return f"manifest: {'.'.join(map(str, path))} = {value!r:.60}"


# index arrays: (file, key) of each format's per-sample numbers
def _index_targets(dest: Path) -> list[tuple[str, str]]:
    m = json.loads((dest / "manifest.json").read_text())
    fmt = m["format"]
    if fmt == "tar":
        return [("index.npz", k) for k in ("shard", "offset", "size", "labels", "crc32")]
    if fmt == "mmap":
        return [(n, "") for n in ("offsets.npy", "labels.npy", "crc32.npy") if (dest / n).exists()]
    if fmt == "lmdb":
        return [("values.npy", "")]
    return [("data.h5", k) for k in ("offsets", "labels", "crc32")]


def _bad_array(a: np.ndarray, rng: Forcing, key: str, size: int) -> tuple[np.ndarray, str]:
    a = np.array(a)
    n = len(a)
    hows = ["negative", "negative-stride", "huge", "past-end", "swap", "dtype", "shorter",
            "longer", "2d", "float", "reverse", "zero"]  # fmt: skip
    if key == "labels":  # other labels in range are another dataset, not a crafted one
        hows = ["negative", "huge", "dtype", "shorter", "longer", "2d", "float"]
    how = rng.pick("how", hows)
    if how == "negative":
        a = a.astype(np.int64)
        a.flat[rng.randrange(a.size)] = rng.choice([-2, -1000, -(2**62)])
    elif how == "negative-stride":  # a constant stride that starts below 0: passes stride checks
        a = a.astype(np.int64)
        start, step = rng.pick("stride", [(-1000, 2048), (-(10**9), 10**8), (-64, 0)])
        a = (start + step * np.arange(a.size)).reshape(a.shape)
    elif how == "huge":
        a = a.astype(np.int64)
        a.flat[rng.randrange(a.size)] = rng.choice([2**62, 2**40, size + 1, 2**31])
    elif how == "past-end":
        a = a.astype(np.int64)
        a.flat[-1] = size + rng.choice([1, 512, 4096])
    elif how == "swap" and n > 1:
        i, j = rng.sample(range(n), 2)
        a[[i, j]] = a[[j, i]]
    elif how == "dtype":
        a = a.astype(rng.choice([np.uint8, np.int16, np.float32, np.uint64, "<U4"]))
    elif how == "shorter":
        a = a[: rng.randrange(n)]
    elif how == "longer":
        a = np.concatenate([a, a[-1:], a[-1:]])
    elif how == "2d":
        a = np.stack([a, a], axis=-1)
    elif how == "float":
        a = a.astype(np.float64) + 0.5
    elif how == "reverse":
        a = a[::-1].copy()
    else:
        a = np.zeros_like(a)
    return a, how


def mutate_index(dest: Path, rng: Forcing, outside: Path) -> str:
    fname, key = rng.pick("target", _index_targets(dest), name=lambda t: ":".join(t).strip(":"))
    path = dest / fname
    size = max(p.stat().st_size for p in dest.iterdir() if p.is_file())
    if fname.endswith(".npz"):
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
        arrays[key], how = _bad_array(arrays[key], rng, key, size)
        np.savez(path, **arrays)
    elif fname.endswith(".npy"):
        a, how = _bad_array(np.load(path, allow_pickle=False), rng, Path(fname).stem, size)
        np.save(path, a)
    else:
        import h5py

        with h5py.File(path, "r+") as f:
            if key not in f:
                key = "labels"
            a, how = _bad_array(f[key][...], rng, key, size)
            if a.dtype.kind == "U":  # HDF5 keeps byte strings
                a = a.astype("S")
            del f[key]
            f[key] = a
    _resign(dest, fname)
    return f"index: {fname}{':' + key if key else ''} {how}"


def _tar_headers(path: Path) -> list[int]:
    with tarfile.open(path) as t:
        return [m.offset for m in t.getmembers()]


def _checksum(block: bytearray) -> None:
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)


def mutate_tar_header(dest: Path, rng: Forcing, outside: Path) -> str:
    shards = sorted(p.name for p in dest.glob("*.tar"))
    name = rng.pick("target", shards)
    path = dest / name
    data = bytearray(path.read_bytes())
    off = rng.choice(_tar_headers(path))
    block = data[off : off + 512]
    how = rng.pick("how", ["size-octal", "size-b256", "size-b256-neg", "size-small", "name-abs",
                      "name-dotdot", "symlink", "hardlink", "type-dir", "bad-checksum",
                      "size-garbage"])  # fmt: skip
    if how == "size-octal":
        block[124:136] = b"77777777777\0"
    elif how == "size-b256":
        block[124:136] = b"\x80" + (2**62).to_bytes(11, "big")
    elif how == "size-b256-neg":
        block[124:136] = b"\xff" * 12
    elif how == "size-small":
        block[124:136] = b"%011o\0" % rng.randrange(0, 16)
    elif how == "name-abs":
        block[0:100] = str(outside / "secret.bin").encode().ljust(100, b"\0")[:100]
    elif how == "name-dotdot":
        block[0:100] = b"../../secret.bin".ljust(100, b"\0")
    elif how in ("symlink", "hardlink"):
        block[156:157] = b"2" if how == "symlink" else b"1"
        block[157:257] = str(outside / "secret.bin").encode().ljust(100, b"\0")[:100]
    elif how == "type-dir":
        block[156:157] = b"5"
    elif how == "size-garbage":
        block[124:136] = b"9z9z9z9z9z9\0"
    if how != "bad-checksum":
        _checksum(block)
    else:
        block[148:156] = b"0000000\0"
    data[off : off + 512] = block
    path.write_bytes(bytes(data))
    _resign(dest, name)
    return f"tar header: {name} member at {off}: {how}"


def _npy_spots(dest: Path) -> list[tuple[str, int]]:
    """(file, offset) of every .npy header in the pack's files (mmap arrays, tar members,
    LMDB's value table)."""
    spots = []
    for p in sorted(dest.iterdir()):
        if p.suffix in (".npy", ".tar"):
            data = p.read_bytes()
            pos = data.find(b"\x93NUMPY")
            while pos >= 0:
                spots.append((p.name, pos))
                pos = data.find(b"\x93NUMPY", pos + 1)
    return spots


def mutate_npy_header(dest: Path, rng: Forcing, outside: Path) -> str:
    name, pos = rng.pick("target", _npy_spots(dest), name=lambda t: t[0])
    path = dest / name
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[pos + 8 : pos + 10], "little")
    header = data[pos + 10 : pos + 10 + hlen].decode("latin1")
    how = rng.pick("how", ["shape-bigger", "shape-huge", "shape-negative", "dtype-wide",
                      "dtype-object", "dtype-str", "fortran", "hlen-huge", "version",
                      "garbage", "truncate"])  # fmt: skip
    d = eval(header)  # noqa: S307 - the harness's own header, written by numpy
    if how == "shape-bigger":
        d["shape"] = tuple(s * 4 + 1 for s in d["shape"]) or (5,)
    elif how == "shape-huge":
        d["shape"] = (2**40,) + tuple(d["shape"][1:])
    elif how == "shape-negative":
        d["shape"] = (-5,) + tuple(d["shape"][1:])
    elif how == "dtype-wide":
        d["descr"] = "<f8"
    elif how == "dtype-object":
        d["descr"] = "|O"
    elif how == "dtype-str":
        d["descr"] = "<U7"
    elif how == "fortran":
        d["fortran_order"] = True
    if how in ("hlen-huge", "version", "garbage", "truncate"):
        if how == "hlen-huge":
            data[pos + 8 : pos + 10] = b"\xff\xff"
        elif how == "version":
            data[pos + 6 : pos + 8] = bytes([rng.choice([3, 9, 0]), 7])
        elif how == "garbage":
            data[pos + 10 : pos + 10 + hlen] = b"{'descr': __import__('os')}".ljust(hlen)
        else:
            del data[pos + 10 + hlen // 2 :]
    else:
        new = repr(d).encode("latin1")
        data[pos + 10 : pos + 10 + hlen] = new.ljust(hlen - 1)[: hlen - 1] + b"\n"
        if len(new) > hlen - 1:
            how += " (header cut to its length)"
    path.write_bytes(bytes(data))
    _resign(dest, name)
    return f"npy header: {name} at {pos}: {how}"


ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _zstd_spots(dest: Path) -> list[tuple[str, int]]:
    spots = []
    for p in sorted(dest.iterdir()):
        if p.suffix in (".npy", ".tar", ".h5", ".mdb"):
            data = p.read_bytes()
            pos = data.find(ZSTD_MAGIC)
            while pos >= 0:
                spots.append((p.name, pos))
                pos = data.find(ZSTD_MAGIC, pos + 1)
    return spots


def mutate_zstd(dest: Path, rng: Forcing, outside: Path) -> str:
    """A frame that declares a huge content size, or whose blocks lie, in place."""
    name, pos = rng.pick("target", _zstd_spots(dest), name=lambda t: t[0])
    path = dest / name
    data = bytearray(path.read_bytes())
    fhd = data[pos + 4]
    fcs_flag, single = fhd >> 6, (fhd >> 5) & 1
    fcs_size = {0: single, 1: 2, 2: 4, 3: 8}[fcs_flag]
    how = rng.pick("how", ["size-1GiB", "size-2**62", "size-0", "block-huge", "magic", "window"])
    fcs_at = pos + 5 + (0 if single else 1) + (0, 1, 2, 4)[fhd & 3]
    if how.startswith("size") and fcs_size:
        want = {"size-1GiB": 1 << 30, "size-2**62": 2**62, "size-0": 0}[how]
        if fcs_size == 2:
            want = min(max(want - 256, 0), 0xFFFF)
        data[fcs_at : fcs_at + fcs_size] = (want % (1 << (8 * fcs_size))).to_bytes(
            fcs_size, "little"
        )
    elif how == "block-huge":  # the first block header says 128 KiB of raw bytes follow
        blk = fcs_at + fcs_size
        data[blk : blk + 3] = ((128 << 10) << 3 | 0).to_bytes(3, "little")
    elif how == "magic":
        data[pos + 3] ^= 0xFF
    else:
        if not single:
            data[pos + 5] = 0xFF  # window descriptor: the largest window
        how += "" if not single else " (single segment: flipped the header)"
        if single:
            data[pos + 4] ^= 0x20
    path.write_bytes(bytes(data))
    _resign(dest, name)
    return f"zstd frame: {name} at {pos}: {how}"


def mutate_hdf5_layout(dest: Path, rng: Forcing, outside: Path) -> str:
    import h5py

    path = dest / "data.h5"
    secret_bin, secret_h5 = str(outside / "secret.bin"), str(outside / "secret.h5")
    with h5py.File(path, "r+") as f:
        data = "samples" if "samples" in f else "encoded"
        shape, dtype = f[data].shape, f[data].dtype
        hows = ["external", "virtual", "external-link", "soft-link", "shape", "dtype",
                "transpose", "chunked-gzip", "labels-external", "group"]  # fmt: skip
        how = rng.pick("how", hows)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if how == "external":
            del f[data]
            f.create_dataset(data, shape, dtype, external=[(secret_bin, 0, nbytes)])
        elif how == "labels-external":
            n = f["labels"].shape[0]
            del f["labels"]
            f.create_dataset("labels", (n,), np.int64, external=[(secret_bin, 0, 8 * n)])
        elif how == "virtual":
            layout = h5py.VirtualLayout(shape=(SECRET_SIZE,), dtype=np.uint8)
            layout[:] = h5py.VirtualSource(secret_h5, "data", shape=(SECRET_SIZE,))
            del f[data]
            if data == "samples":
                layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
                layout[:] = h5py.VirtualSource(secret_h5, "samples", shape=(9, 3, 4, 5))[: shape[0]]
            f.create_virtual_dataset(data, layout)
        elif how == "external-link":
            target = rng.pick("target", ["labels", data])
            del f[target]
            f[target] = h5py.ExternalLink(secret_h5, "/data" if target != "labels" else "/labels")
            how += f" /{target}"
        elif how == "soft-link":
            del f["labels"]
            f["labels"] = h5py.SoftLink("/crc32")
        elif how == "shape":
            a = f[data][...]
            del f[data]
            f[data] = a.reshape(-1)[: a.size - rng.choice([1, 5, a.size // 2])]
        elif how == "dtype":
            a = f[data][...]
            del f[data]
            f[data] = a.view(np.uint8).reshape(-1, 4) if a.size % 4 == 0 else a.astype(np.int32)
        elif how == "transpose":
            a = f[data][...]
            del f[data]
            f[data] = a.reshape(-1)[::-1].copy().reshape(a.shape[::-1] if a.ndim > 1 else -1)
        elif how == "chunked-gzip":
            a = f[data][...]
            del f[data]
            f.create_dataset(data, data=a, chunks=True, compression="gzip")
        else:
            del f["labels"]
            f.create_group("labels")
    _resign(dest, "data.h5")
    return f"hdf5 layout: {how}"


class Unpickled:
    """Unpickling this creates the file named by the case: proof a pickle was executed."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickle_npy(path: Path, marker: str, rows: int) -> None:
    arr = np.empty(rows, dtype=object)
    arr[:] = [Unpickled(marker) for _ in range(rows)]
    np.save(path, arr, allow_pickle=True)


def mutate_pickle(dest: Path, rng: Forcing, outside: Path) -> str:
    """Replace a .npy (or .pt, or a tar member's .npy) with one that holds a pickle whose
    unpickling creates outside/pickled-CASE: the child fails the case if it appears."""
    marker = str(outside / f"pickled-{dest.name}")
    npys = sorted(p.name for p in dest.glob("*.npy"))
    pts = sorted(p.name for p in dest.glob("*.pt"))
    tars = sorted(p.name for p in dest.glob("*.tar"))
    if pts:
        import torch

        name = pts[0]
        torch.save({"samples": Unpickled(marker)}, dest / name)
    elif tars:
        name = rng.pick("target", tars)
        buf = io.BytesIO()
        _pickle_npy(buf, marker, 1)  # type: ignore[arg-type]
        payload = buf.getvalue()
        src = dest / name
        out = io.BytesIO()
        ustar = tarfile.USTAR_FORMAT
        with tarfile.open(src) as t, tarfile.open(fileobj=out, mode="w", format=ustar) as w:
            for m in t.getmembers():
                body = t.extractfile(m).read()
                if m.name.endswith(".npy"):
                    body = payload
                    m.size = len(body)
                w.addfile(m, io.BytesIO(body))
        src.write_bytes(out.getvalue())
    else:
        name = rng.pick("target", npys)
        rows = len(np.load(dest / name, allow_pickle=False))
        _pickle_npy(dest / name, marker, rows)
    _resign(dest, name)
    return f"pickle: {name} holds a pickled object (marker {Path(marker).name})"


MUTATORS = {
    "flip": mutate_flip,
    "manifest": mutate_manifest,
    "index": mutate_index,
    "tar_header": mutate_tar_header,
    "npy_header": mutate_npy_header,
    "zstd": mutate_zstd,
    "hdf5_layout": mutate_hdf5_layout,
    "pickle": mutate_pickle,
}


# ----------------------------------------------------------------------------- the child
def canon(x):
    """A value as plain, comparable bytes/str/numbers (tensors with dtype and shape)."""
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous()
        return ["T", str(x.dtype), list(x.shape), x.numpy().tobytes().hex()]
    if isinstance(x, np.ndarray):
        return ["A", x.dtype.str, list(x.shape), np.ascontiguousarray(x).tobytes().hex()]
    if isinstance(x, (bytes, bytearray, memoryview)):
        return ["B", bytes(x).hex()]
    if isinstance(x, dict):
        return ["D", [[str(k), canon(v)] for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))]]
    if isinstance(x, (list, tuple)):
        return ["L", [canon(v) for v in x]]
    if isinstance(x, float):
        return ["F", repr(x)]
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return ["?", type(x).__name__, repr(x)[:200]]


def _chunks(c, found: list | None = None) -> list[tuple[bytes, bool]]:
    """The byte strings of a canon value, each with whether it is sample bytes as stored
    (uint8 arrays, bytes, str: checked against the pack's files; numbers such as labels
    are converted on the way, so only checked for the outside marker)."""
    found = [] if found is None else found
    if isinstance(c, list) and c and c[0] in ("T", "A"):
        found.append((bytes.fromhex(c[3]), c[1] in ("torch.uint8", "|u1")))
    elif isinstance(c, list) and c and c[0] == "B":
        found.append((bytes.fromhex(c[1]), True))
    elif isinstance(c, str):
        found.append((c.encode("utf-8", "surrogateescape"), True))
    elif isinstance(c, list):
        for v in c:
            _chunks(v, found)
    return found


def _outside_bytes(values, pack: Path) -> str | None:
    """A sample's bytes holding the outside marker, or 8+ stored bytes found in no file of
    the pack (nor a run of one byte, as a zstd field decompresses to): in a few words."""
    files = [p.read_bytes() for p in pack.iterdir() if p.is_file()]
    for chunk, stored in _chunks(values):
        if MARKER[:8] in chunk:
            return f"a sample holds the outside file's bytes ({chunk[:24]!r})"
        if not stored or len(chunk) < 8 or len(set(chunk)) == 1:
            continue
        if not any(chunk in f for f in files):
            return f"{len(chunk)} bytes in no file of the pack ({chunk[:24]!r})"
    return None


def _rows(batch, n: int) -> list:
    """A batch as its rows (a row's bytes lie together in the pack; a stack's do not)."""
    if isinstance(batch, dict):
        return [{k: v[j] for k, v in batch.items()} for j in range(n)]
    samples, labels = batch
    return [(samples[j], labels[j]) for j in range(n)]


def read_everything(path: Path) -> dict:
    import gpufeed

    got = {}
    ds = gpufeed.open_dataset(path)
    n = len(ds)
    got["items"] = [canon(ds[i]) for i in range(n)]
    got["batch"] = canon(_rows(ds.get_batch(list(range(n))), n)) if n else None
    if json.loads((path / "manifest.json").read_text()).get("format") == "tar":
        got["stream"] = [canon(s) for s in gpufeed.open_dataset(path, map_style=False)]
    return got


def _error(e: BaseException, path: Path) -> dict:
    from gpufeed.errors import GpufeedError, UnsafePathError

    msg = str(e)
    return {
        "type": type(e).__name__,
        "gpufeed": isinstance(e, GpufeedError),
        # an UnsafePathError names the path that leads out: the file in question
        "named": str(path) in msg or path.name in msg or isinstance(e, UnsafePathError),
        "message": msg[:400],
    }


def run_one(case: dict) -> dict:
    import resource

    import gpufeed

    path = Path(case["path"])
    marker = path.parent.parent / f"pickled-{path.name}"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    out: dict = {"case": case["case"]}
    try:
        got = read_everything(path)
        out["digest"] = hashlib.sha256(json.dumps(got, sort_keys=True).encode()).hexdigest()
        out["outside"] = _outside_bytes(list(got.values()), path)
    except (Exception, MemoryError) as e:  # noqa: BLE001 - what the case is about
        out["read_error"] = _error(e, path)
    try:
        report = gpufeed.verify(path)
        out["verify_ok"] = bool(report.ok)
    except (Exception, MemoryError) as e:  # noqa: BLE001
        out["verify_error"] = _error(e, path)
    out["rss_growth"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    out["unpickled"] = marker.exists()
    return out


def child_main(cases_file: str, start: int) -> None:
    import resource

    import torch  # noqa: F401 - counted in the baseline address space

    import gpufeed
    from gpufeed.data import open as _open  # noqa: F401 - imports every reader up front
    from gpufeed.tools import verify as _verify  # noqa: F401

    torch.set_num_threads(1)
    cases = json.loads(Path(cases_file).read_text())
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = vm + 2 * MEMORY_BOUND
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    assert gpufeed
    for case in cases[start:]:
        print("start", case["case"], flush=True)
        out = run_one(case)
        print("done", json.dumps(out), flush=True)
        if out["rss_growth"] > MEMORY_BOUND:
            return  # the next case gets a fresh high-water mark


def run_cases(cases: list[dict], workdir: Path, env: dict) -> dict[int, dict]:
    """Run the cases in children; case number -> outcome (a "died"/"hung" entry for the case a
    child was on when it died or hung)."""
    cases_file = workdir / f"cases-{os.getpid()}-{time.monotonic_ns()}.json"
    cases_file.write_text(json.dumps(cases))
    results: dict[int, dict] = {}
    start = 0
    env = {**env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    while start < len(cases):
        errlog = workdir / "child-stderr.txt"
        with open(errlog, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, __file__, str(cases_file), str(start)],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                start_new_session=True,
            )
            current, pending = None, b""
            deadline = time.monotonic() + CASE_TIMEOUT_S + 30  # the first one imports torch
            hung = False
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    hung = True
                    break
                ready, _, _ = select.select([proc.stdout], [], [], left)
                if not ready:
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    word, _, rest = line.decode().partition(" ")
                    if word == "start":
                        current = int(rest)
                        deadline = time.monotonic() + CASE_TIMEOUT_S
                    elif word == "done":
                        out = json.loads(rest)
                        results[out["case"]] = out
                        current = None
                        start = next(i for i, c in enumerate(cases) if c["case"] == out["case"]) + 1
            if hung:
                os.killpg(proc.pid, 9)
            rc = proc.wait()
        if current is not None:
            tail = errlog.read_bytes()[-600:].decode(errors="replace")
            results[current] = {"case": current, "died": "hung" if hung else rc, "stderr": tail}
            start = next(i for i, c in enumerate(cases) if c["case"] == current) + 1
        elif rc != 0 and start < len(cases) and not hung:
            tail = errlog.read_bytes()[-2000:].decode(errors="replace")
            raise RuntimeError(f"fuzz child exited {rc} between cases:\n{tail}")
    cases_file.unlink()
    return results


# ----------------------------------------------------------------------------- the property
def judge(case: dict, out: dict, expected: dict[str, str]) -> str | None:
    """None when the outcome is allowed, else what went wrong, in a few words."""
    if "died" in out:
        what = "hung" if out["died"] == "hung" else f"died (exit {out['died']})"
        return f"{what}: {out.get('stderr', '')[-300:]!r}"
    if out.get("unpickled"):
        return "a pickle was executed (its marker file appeared)"
    if out["rss_growth"] > MEMORY_BOUND:
        return f"memory grew {out['rss_growth'] >> 20} MiB (bound {MEMORY_BOUND >> 20} MiB)"
    for stage in ("read_error", "verify_error"):
        e = out.get(stage)
        if e and not e["gpufeed"]:
            return f"{stage}: raw {e['type']}: {e['message'][:200]}"
        if e and not e["named"]:
            return f"{stage}: {e['type']} not naming the pack: {e['message'][:200]}"
    # a Fortran-order .npy is the pack's own bytes in another order
    reordered = "fortran" in case.get("mutation", "") and "in no file" in (out.get("outside") or "")
    if out.get("outside") and not reordered:
        return f"bytes from outside the pack: {out['outside']}"
    if "read_error" in out or out["digest"] == expected[case["pack"]]:
        return None
    if out.get("verify_ok"):
        return "samples differ from the originals and verify reports the pack ok"
    return None


def describe(case: dict, out: dict, problem: str) -> str:
    got = out.get("read_error") or {}
    return (
        f"case {case['case']} seed {case['seed']} {case['pack']} {case.get('mutation')}: "
        f"{problem}" + (f" [read: {got.get('type')}]" if got else "")
    )


def fuzz(
    cases: list[dict], packs: dict[str, Path], expected: dict[str, str], root: Path, env: dict
) -> tuple[list[str], dict[str, dict[str, int]]]:
    """Materialize and run the cases, a batch at a time: (failures, outcomes per kind). The
    crafted copies of a batch are deleted once it passes; a failing batch's are kept."""
    work = root / "cases"
    failures: list[str] = []
    tally: dict[str, dict[str, int]] = {}
    for at in range(0, len(cases), BATCH):
        batch = cases[at : at + BATCH]
        work.mkdir(exist_ok=True)
        for case in batch:
            materialize(case, packs, work)
        results = run_cases(batch, root, env)
        for case in batch:
            out = results[case["case"]]
            problem = judge(case, out, expected)
            if problem:
                failures.append(describe(case, out, problem))
                outcome = "failed"
            elif "read_error" in out:
                outcome = "error"
            elif out["digest"] == expected[case["pack"]]:
                outcome = "same"
            else:
                outcome = "differs, verify reports it"
            kind = tally.setdefault(case["kind"], {})
            kind[outcome] = kind.get(outcome, 0) + 1
        if not failures:
            shutil.rmtree(work)
    return failures, tally


def summary(cases: list[dict], failures: list[str], tally: dict) -> str:
    kinds = "; ".join(
        f"{k}: " + ", ".join(f"{n} {o}" for o, n in sorted(v.items())) for k, v in tally.items()
    )
    return f"{len(cases)} crafted packs, {len(failures)} failed ({kinds})"


if __name__ == "__main__":
    child_main(sys.argv[1], int(sys.argv[2]))
