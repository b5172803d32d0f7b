"""Source trees for gpufeed's unit tests (a module of its own: a test that imported these from
`conftest` would get whichever conftest was imported first, tests/entrypoints' say)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PYTHON_ENV = {**os.environ, "PYTHONPATH": str(ROOT / "app" / "src")}


def write_images(root: Path, classes: dict[str, int], size=(12, 16), ext=".png", seed=0):
    """class name -> count images of random pixels (H x W = size); returns sorted paths."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    paths = []
    for name, count in classes.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            p = d / f"img{i:04d}{ext}"
            options = {"quality": 90} if ext == ".jpg" else {}
            Image.fromarray(pixels).save(p, **options)
            paths.append(p)
    return sorted(paths)


def write_arrays(
    root: Path,
    classes: dict[str, int] | None,
    count=0,
    shape=(3, 4, 5),
    seed=0,
    dtype=np.uint8,
    ext=".npy",
):
    """.npy (or .pt) files of random values, in class subfolders or flat; returns paths."""
    rng = np.random.default_rng(seed)
    paths = []
    groups = classes.items() if classes else [("", count)]
    for name, n in groups:
        d = root / name if name else root
        d.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            arr = (rng.random(shape) * 250).astype(dtype)
            p = d / f"a{i:05d}{ext}"
            if ext == ".pt":
                import torch

                torch.save(torch.from_numpy(arr), p)
            else:
                np.save(p, arr)
            paths.append(p)
    return sorted(paths)


def pack_with_broken_jpeg(tmp_path: Path, count: int = 3, broken: int = 1) -> Path:
    """An mmap pack of ``count`` JPEGs whose sample ``broken`` has its header zeroed."""
    import gpufeed

    write_images(tmp_path / "s", {"a": count}, ext=".jpg")
    dest = tmp_path / "d"
    gpufeed.pack(tmp_path / "s", dest, format="mmap", workers=1, quiet=True)
    arr = np.load(dest / "encoded.npy", mmap_mode="r+")
    offsets = np.load(dest / "offsets.npy")
    arr[offsets[broken] : offsets[broken] + 40] = 0  # wreck the JPEG header
    arr.flush()
    return dest


def evict(path) -> bool:
    """Drop a file's pages from the page cache, or every file's under a folder (synced first:
    dirty pages are not dropped; gpufeed's kept maps of it forgotten first: mapped pages are
    not dropped). False where the kernel kept pages (tmpfs): the caller skips."""
    import gc

    from gpufeed.pagecache import maps

    path = Path(path)
    maps.forget_maps(path)
    gc.collect()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return not any(_any_page_cached(f) for f in files)


def _any_page_cached(path: Path) -> bool:
    size = os.path.getsize(path)
    return bool(size) and resident_share(path, 0, size) > 0


def resident_pages(arr: np.ndarray) -> np.ndarray:
    """mincore(2) over a mapped array: True per page in the page cache."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    page = mmap.PAGESIZE
    start = arr.ctypes.data - arr.ctypes.data % page
    length = arr.ctypes.data + arr.nbytes - start
    vec = (ctypes.c_ubyte * (-(-length // page)))()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, os.strerror(ctypes.get_errno())
    first = (arr.ctypes.data - start) // page
    return (np.frombuffer(vec, dtype=np.uint8) & 1).astype(bool)[first:]


def resident_share(path, start: int, length: int) -> float:
    """The share of a file range's pages cached (mincore over a map of the file: the truth
    for a file this process owns, or as root)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, np.uint8)[start : start + length]
        share = float(resident_pages(view).mean())
        del view  # the map cannot close while a view exports it
    return share
