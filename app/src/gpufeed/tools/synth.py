"""A small, realistic image dataset to run on before real data is mounted (``gpufeed synth``).

The result is an image-folder tree (``PATH/<class>/<n>.jpg``), the layout ``gpufeed pack`` and
torchvision's ``ImageFolder`` read, of JPEGs a small model can learn from: each class is a
shape and colour drawn over a random gradient with sensor-like noise, at a random position and
size. The bytes are deterministic for a given seed, size and count (each class draws from its
own seeded generator, so the result does not depend on how many processes made it).

The tree is written under ``PATH.partial`` and renamed to ``PATH`` when complete, so a crash
never leaves a folder that looks like a finished dataset. ``--overwrite`` replaces only a
dataset synth made (its synth.json), and a leftover ``PATH.partial`` is cleared only when it
holds nothing but synth's class folders (gpufeed.write.ownership); anything else is refused.
"""

from __future__ import annotations

import io
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gpufeed import cliargs
from gpufeed.errors import UsageError
from gpufeed.formats.manifest import PARTIAL_SUFFIX
from gpufeed.write.ownership import check_removable, register_owner, remove_tree

__all__ = ["CLASS_NAMES", "DEFAULT_COUNT", "DEFAULT_SIZE", "synth_image_folder"]

# Ten classes: five shapes, each in a warm and a cool colour.
_SHAPES = ("disc", "square", "ring", "hbar", "vbar")
_COLOURS = {"warm": (230, 90, 40), "cool": (40, 120, 230)}
CLASS_NAMES = tuple(f"{c}_{s}" for c in _COLOURS for s in _SHAPES)
DEFAULT_COUNT = 2000
DEFAULT_SIZE = 96
INFO_FILE = "synth.json"
MADE_BY = "gpufeed synth"


def is_synth_output(path: Path) -> bool:
    """A folder `gpufeed synth` made: its synth.json, or (the PATH.partial a crash left)
    nothing but synth's class folders of JPEGs."""
    if not path.is_dir() or path.is_symlink():
        return False
    try:
        if json.loads((path / INFO_FILE).read_text(encoding="utf-8")).get("made_by") == MADE_BY:
            return True
    except (OSError, ValueError, AttributeError):
        pass
    if not path.name.endswith(PARTIAL_SUFFIX):
        return False
    try:
        folders = os.listdir(path)
        return set(folders) <= set(CLASS_NAMES) and all(
            name.endswith(".jpg") for f in folders for name in os.listdir(path / f)
        )
    except OSError:
        return False


register_owner(
    "synth", is_synth_output, "a dataset gpufeed synth made (no synth.json from it in it)"
)


def _mask(shape: str, xx, yy, cx, cy, r):
    dx, dy = xx - cx, yy - cy
    if shape == "disc":
        return dx * dx + dy * dy < r * r
    if shape == "square":
        return (np.abs(dx) < r) & (np.abs(dy) < r)
    if shape == "ring":
        d2 = dx * dx + dy * dy
        return (d2 < r * r) & (d2 > (0.55 * r) ** 2)
    if shape == "hbar":
        return (np.abs(dy) < 0.35 * r) & (np.abs(dx) < 1.6 * r)
    return (np.abs(dx) < 0.35 * r) & (np.abs(dy) < 1.6 * r)


def _write_class(root: str, label: int, count: int, size: int, seed: int, quality: int) -> int:
    from PIL import Image

    name = CLASS_NAMES[label % len(CLASS_NAMES)]
    colour = np.array(_COLOURS[name.split("_")[0]], dtype=np.int16)
    shape = name.split("_")[1]
    rng = np.random.default_rng([seed, label])
    h = w = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    noise = rng.integers(-12, 13, (3 * h, 3 * w, 3)).astype(np.int16)
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for i in range(count):
        ox, oy = rng.integers(0, 2 * w, 2)
        angle = rng.uniform(0, 2 * np.pi)
        ramp = ((np.cos(angle) * xx + np.sin(angle) * yy) * (80.0 / w)).astype(np.int16)
        img = rng.integers(30, 190, 3).astype(np.int16) + ramp[..., None]
        img = img + noise[oy : oy + h, ox : ox + w]
        cx, cy = rng.uniform(0.3, 0.7, 2) * size
        r = rng.uniform(0.12, 0.25) * size
        jitter = rng.integers(-30, 31, 3).astype(np.int16)
        img[_mask(shape, xx, yy, cx, cy, r)] = colour + jitter
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=quality)
        (folder / f"{i:05d}.jpg").write_bytes(buf.getvalue())
        written += 1
    return written


def synth_image_folder(
    path: str | os.PathLike,
    *,
    count: int = DEFAULT_COUNT,
    classes: int = len(CLASS_NAMES),
    size: int = DEFAULT_SIZE,
    seed: int = 0,
    quality: int = 90,
    workers: int | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``count`` JPEGs (``size`` x ``size`` RGB) in ``classes`` class folders under
    ``path``: a demo image-folder dataset.

    Args:
        path: the folder to create; it may exist if it is empty (a fresh volume).
        count: JPEG files in all.
        classes: class folders, at most len(CLASS_NAMES).
        size: image height and width in pixels, at least 8.
        seed: the images drawn are a function of it.
        quality: JPEG quality.
        workers: processes (default: usable CPUs, at most one per class).
        overwrite: replace a non-empty ``path`` that synth made.

    Returns:
        What was written (path, count, size, classes, seconds...), also saved as
        ``path/synth.json``.

    Raises:
        UsageError: an option out of range, or ``path`` is not an empty folder (without
            ``overwrite``).
    """
    if count < 1 or classes < 1 or size < 8:
        raise UsageError(
            f"synth needs count >= 1, classes >= 1, size >= 8 (got {count}, {classes}, {size})"
        )
    if classes > len(CLASS_NAMES):
        raise UsageError(f"synth makes at most {len(CLASS_NAMES)} classes, got {classes}")
    dest = Path(path).absolute()
    if dest.exists() and not dest.is_dir():
        raise UsageError(f"{dest} exists and is not a folder")
    replace = dest.is_dir() and any(dest.iterdir())
    if replace and not overwrite:
        raise UsageError(f"{dest} is not empty; choose another path or pass --overwrite")
    if replace:
        check_removable(dest, "replace it (--overwrite)", owner="synth")
    start = time.perf_counter()
    partial = dest.with_name(dest.name + ".partial")
    if partial.exists() or partial.is_symlink():
        remove_tree(partial, "start over (a crash's leftover)", owner="synth")
    partial.mkdir(parents=True)
    per_class = [count // classes + (1 if c < count % classes else 0) for c in range(classes)]
    if workers is None:
        from gpufeed.system.sysinfo import usable_cpus

        workers = usable_cpus().count
    workers = max(1, min(int(workers), classes))
    jobs = [(str(partial), c, n, size, seed, quality) for c, n in enumerate(per_class) if n]
    if workers == 1:
        written = sum(_write_class(*job) for job in jobs)
    else:
        import multiprocessing

        ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            written = sum(pool.map(_write_class, *zip(*jobs, strict=True)))
    info = {
        "made_by": MADE_BY,
        "count": written,
        "classes": list(CLASS_NAMES[:classes]),
        "per_class": per_class,
        "size": [size, size],
        "seed": seed,
        "quality": quality,
    }
    # The info file's suffix is not an image's, so `gpufeed pack` and ImageFolder skip it.
    (partial / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    if dest.is_dir() and any(dest.iterdir()):
        remove_tree(dest, "replace it (--overwrite)", owner="synth")
    try:
        if dest.is_dir():
            dest.rmdir()
        partial.rename(dest)
    except OSError:
        # dest is a mount point (an empty volume): it cannot be replaced, so fill it.
        for child in partial.iterdir():
            child.rename(dest / child.name)
        partial.rmdir()
    info["seconds"] = round(time.perf_counter() - start, 3)
    info["path"] = str(dest)
    return info


def add_arguments(parser) -> None:
    """Add the ``gpufeed synth`` options.

    Args:
        parser: the subcommand's argparse parser.
    """
    parser.add_argument("path", metavar="PATH", help="folder to create (may exist if empty)")
    parser.add_argument(
        "--count",
        "-n",
        type=cliargs.integer(1, 10**7, "--count"),
        default=DEFAULT_COUNT,
        help=f"JPEG files in all (default {DEFAULT_COUNT})",
    )
    parser.add_argument(
        "--classes",
        type=cliargs.integer(1, len(CLASS_NAMES), "--classes"),
        default=len(CLASS_NAMES),
        help=f"class folders, at most {len(CLASS_NAMES)} (default all)",
    )
    parser.add_argument(
        "--size",
        type=cliargs.integer(8, 4096, "--size"),
        default=DEFAULT_SIZE,
        help=f"image height and width in pixels, 8 to 4096 (default {DEFAULT_SIZE})",
    )
    parser.add_argument("--seed", type=cliargs.integer(0, 2**63 - 1, "--seed"), default=0)
    parser.add_argument(
        "--workers", "-j", type=cliargs.workers, default=None, help="processes (default: CPUs)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace PATH if synth made it")


def main(args) -> int:
    """Run ``gpufeed synth`` and say what it wrote.

    Args:
        args: the parsed command line (see add_arguments).

    Returns:
        The exit status (0).
    """
    info = synth_image_folder(
        args.path,
        count=args.count,
        classes=args.classes,
        size=args.size,
        seed=args.seed,
        workers=args.workers,
        overwrite=args.overwrite,
    )
    if args.json:
        print(json.dumps(info, indent=2, default=str))
    elif not args.quiet:
        print(
            f"wrote {info['count']} JPEGs ({info['size'][0]}x{info['size'][1]}) in "
            f"{len(info['classes'])} classes to {info['path']} in {info['seconds']:.1f} s"
        )
    return 0
