"""gpufeed synth: an image-folder tree of real JPEGs that pack reads, deterministic, atomic,
and learnable (classes differ in what the pixels show, not only in folder names)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import gpufeed
from gpufeed.errors import UsageError
from gpufeed.tools.synth import CLASS_NAMES, INFO_FILE, synth_image_folder


def digest(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.jpg"))
    }


def test_layout_counts_and_images(tmp_path):
    info = synth_image_folder(tmp_path / "d", count=53, classes=4, size=40, workers=1)
    root = tmp_path / "d"
    jpgs = sorted(root.rglob("*.jpg"))
    assert info["count"] == len(jpgs) == 53
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert folders == sorted(CLASS_NAMES[:4]) == sorted(info["classes"])
    per_class = [len(list((root / c).glob("*.jpg"))) for c in CLASS_NAMES[:4]]
    assert per_class == info["per_class"] and max(per_class) - min(per_class) <= 1
    with Image.open(jpgs[0]) as im:
        assert (im.format, im.mode, im.size) == ("JPEG", "RGB", (40, 40))
    assert (root / INFO_FILE).is_file()
    assert not (tmp_path / "d.partial").exists()


def test_deterministic_whatever_the_worker_count(tmp_path):
    one = synth_image_folder(tmp_path / "a", count=40, classes=5, size=32, workers=1)
    two = synth_image_folder(tmp_path / "b", count=40, classes=5, size=32, workers=2)
    assert one["count"] == two["count"]
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    synth_image_folder(tmp_path / "c", count=40, classes=5, size=32, seed=1, workers=1)
    assert digest(tmp_path / "c") != digest(tmp_path / "a")


def test_refuses_non_empty_destination_but_fills_an_empty_one(tmp_path):
    dest = tmp_path / "d"
    dest.mkdir()
    synth_image_folder(dest, count=10, classes=2, size=16, workers=1)  # empty: fine
    before = digest(dest)
    with pytest.raises(UsageError, match="not empty"):
        synth_image_folder(dest, count=10, classes=2, size=16, workers=1)
    assert digest(dest) == before
    synth_image_folder(dest, count=6, classes=3, size=16, workers=1, overwrite=True)
    assert len(digest(dest)) == 6
    with pytest.raises(UsageError):
        synth_image_folder(tmp_path / "e", count=5, classes=len(CLASS_NAMES) + 1)


def test_pack_reads_it(tmp_path):
    synth_image_folder(tmp_path / "d", count=30, classes=3, size=24, workers=1)
    manifest = gpufeed.pack(
        tmp_path / "d", tmp_path / "p", format="hdf5", encode="raw", quiet=True, workers=0
    )
    assert manifest["count"] == 30
    ds = gpufeed.open_dataset(tmp_path / "p")
    assert sorted(ds.classes) == sorted(CLASS_NAMES[:3])
    assert tuple(ds[0][0].shape) == (3, 24, 24)


@pytest.mark.slow
def test_classes_are_learnable(tmp_path):
    """A tiny CNN trained for a few steps beats chance (0.1) on held-out images: the classes
    differ in what the pixels show, so the notebook's model has something to learn."""
    import torch

    synth_image_folder(tmp_path / "d", count=400, classes=10, size=24, workers=2)
    xs, ys = [], []
    for label, name in enumerate(CLASS_NAMES):
        for p in sorted((tmp_path / "d" / name).glob("*.jpg")):
            with Image.open(p) as im:
                xs.append(np.asarray(im, dtype=np.uint8))
            ys.append(label)
    x = torch.from_numpy(np.stack(xs)).permute(0, 3, 1, 2).float() / 255
    y = torch.tensor(ys)
    held_out = torch.arange(len(y)) % 4 == 0
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny convolutions: threads only contend on a shared machine
    nn = torch.nn
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(1), nn.Flatten(),
        nn.Linear(16, 10),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), 3e-3)
    xt, yt = x[~held_out], y[~held_out]
    for _ in range(120):
        i = torch.randint(0, len(yt), (64,))
        loss = torch.nn.functional.cross_entropy(model(xt[i]), yt[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = (model(x[held_out]).argmax(1) == y[held_out]).float().mean().item()
    torch.set_num_threads(threads)
    assert accuracy > 0.25, accuracy


def test_cli(tmp_path, python_env):
    argv = [sys.executable, "-m", "gpufeed.cli", "synth", str(tmp_path / "d"), "-n", "12"]
    done = subprocess.run(argv + ["--size", "16"], env=python_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "wrote 12 JPEGs (16x16) in 10 classes" in done.stdout
    again = subprocess.run(argv, env=python_env, capture_output=True, text=True)
    assert again.returncode == 2 and "not empty" in again.stderr
