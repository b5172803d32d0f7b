"""Pack an image folder, check it, and train-loop over it.

    python pack_and_load.py IMAGE_FOLDER OUT_DIR [--format hdf5|lmdb|tar|mmap]

IMAGE_FOLDER is laid out like torchvision's ImageFolder (one subfolder per class). Without
arguments, a tiny random image folder is made in a temporary directory first.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import gpufeed


def tiny_image_folder(root: Path) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (root / name).mkdir(parents=True)
        for i in range(64):
            pixels = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i:03d}.jpg")
    return root


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("source", nargs="?")
    ap.add_argument("dest", nargs="?")
    ap.add_argument("--format", default="hdf5", choices=["hdf5", "lmdb", "tar", "mmap"])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    source = Path(args.source) if args.source else tiny_image_folder(tmp / "images")
    dest = Path(args.dest) if args.dest else tmp / f"packed.{args.format}"

    # 1. Pack: parallel, resumable (--resume after a crash), manifest written last.
    #    encode="raw" stores decoded uint8 CHW arrays (fastest to read, needs one image size);
    #    encode="keep" stores the JPEG bytes and decodes them in the loader workers.
    gpufeed.pack(source, dest, format=args.format, encode="raw", resize=(32, 32), overwrite=True)
    print(gpufeed.verify(dest).summary())
    print({k: v for k, v in gpufeed.inspect(dest).items() if k in ("format", "count", "classes")})

    # 2. Open: the format is read from the manifest. Map-style for hdf5/lmdb/mmap,
    #    an iterable shard stream (with a shuffle buffer) for tar.
    dataset = gpufeed.open_dataset(dest)

    # 3. Load: a plain DataLoader works as with any Dataset:
    #    DataLoader(dataset, batch_size=32, shuffle=True, num_workers=4, pin_memory=True)
    #    make_loader takes the same arguments, picks workers and pinning from the machine and
    #    reads whole batches in one go (dataset.get_batch: one read, no collate per sample).
    loader = gpufeed.make_loader(dataset, batch_size=32, shuffle=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for epoch in range(2):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        start, n = time.perf_counter(), 0
        for images, labels in loader:
            images = images.to(device, non_blocking=True).float().div_(255)  # [B, 3, H, W]
            labels = labels.to(device, non_blocking=True)
            n += len(labels)
        print(f"epoch {epoch}: {n} samples, {n / (time.perf_counter() - start):.0f} samples/s")


if __name__ == "__main__":
    main()
