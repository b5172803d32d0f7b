"""The suite's data: generated in the run, the same samples for every row.

Cases (full size; QUICK=1 takes a tenth):

- ``raw``:   100,000 uint8 tensors 3x64x64 (12 KiB each), one ``.pt`` file per sample;
- ``jpeg``:  100,000 JPEGs of 64x64 (smooth pictures with detail, ~2-3 KiB), read with
  decode + RandomResizedCrop(56) + horizontal flip per sample, as ImageNet training does;
- ``large``: 1,000 uint8 tensors 3x384x384 (432 KiB each);
- ``fields``: 100,000 multi-field samples, a JPEG as in ``jpeg`` + a 32-token caption (int32
  token ids, ``tokens.npy``) + the class: read with the JPEG decoded + RandomResizedCrop(56)
  + flip and the captions batched as int32 [B, 32];
- ``bigraw``: 400,000 tensors as in ``raw`` (4.9 GB), run only when named (``--cases
  bigraw``): with ``make bench BENCH_MEMORY=...`` below the pack's size, a cold pass cannot
  be served from a page cache filled before its first batch, as with a dataset larger than RAM.

The per-file layout (``class/NNNNNNN.pt`` or ``.jpg``) is what the tutorial baseline reads
and what ``gpufeed pack`` and the peers' writers start from.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CLASSES = 10
CAPTION_TOKENS = 32
VOCABULARY = 50_000
# the fields case as gpufeed stores it (the peers store the same three columns)
FIELDS_SCHEMA = {"image": "jpeg", "caption": f"int32[{CAPTION_TOKENS}]", "label": "int"}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "raw" | "jpeg" | "fields"
    count: int
    shape: tuple[int, int, int]  # stored (raw) or decoded (jpeg) CHW
    root: Path  # the case's folder: source/ + one folder per stored format
    crop: int | None = None  # jpeg: RandomResizedCrop size

    @property
    def source(self) -> Path:
        return self.root / "source"

    def files(self) -> list[str]:
        """Absolute paths, in gpufeed's sample order (files.json keeps them relative to the
        case folder, so the data folder can be mounted anywhere)."""
        listing = self.root / "files.json"
        rel = json.loads(listing.read_text())["files"]
        return [
            str(self.source / p.split("/source/", 1)[1]) if os.path.isabs(p) else str(self.root / p)
            for p in rel
        ]

    def labels(self) -> np.ndarray:
        return np.load(self.root / "labels.npy")

    def tokens(self) -> np.ndarray:
        """fields: int32 [count, CAPTION_TOKENS], in gpufeed's sample order."""
        return np.load(self.root / "tokens.npy", mmap_mode="r")

    def sample_bytes(self) -> float:
        """Stored payload bytes per sample (the MB/s numerator, the same for every row)."""
        return json.loads((self.root / "files.json").read_text())["payload_bytes"] / self.count


def cases(root: Path, quick: bool) -> list[Case]:
    div = 10 if quick else 1
    return [
        Case("raw", "raw", 100_000 // div, (3, 64, 64), root / "raw"),
        Case("jpeg", "jpeg", 100_000 // div, (3, 64, 64), root / "jpeg", crop=56),
        Case("large", "raw", 1_000 // div, (3, 384, 384), root / "large"),
        Case("fields", "fields", 100_000 // div, (3, 64, 64), root / "fields", crop=56),
        Case("bigraw", "raw", 400_000 // div, (3, 64, 64), root / "bigraw"),
    ]


# cases a run takes only when named (--cases): minutes of writing and gigabytes of disk
OPT_IN = {"bigraw"}


def shuffle_buffer(case: Case) -> int:
    """Samples a streaming row (tar shards, WebDataset) shuffles in memory: 1000, but at most a
    tenth of the case, so a buffer never holds the whole dataset (which would turn every pass
    after the first batch into a memory read)."""
    return max(1, min(1000, case.count // 10))


def _picture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A photo-like image: a smooth random field upsampled, plus some texture."""
    from PIL import Image

    small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC), dtype=np.int16)
    img = img + rng.integers(-12, 13, img.shape, dtype=np.int16)
    return np.clip(img, 0, 255).astype(np.uint8)


def generate(case: Case, seed: int = 0) -> None:
    """Write the per-file source once (kept between runs when complete)."""
    done = case.root / "files.json"
    if done.exists():
        return
    from PIL import Image

    rng = np.random.default_rng([seed, case.count, *case.shape])
    labels = rng.integers(0, CLASSES, case.count).astype(np.int64)
    for c in range(CLASSES):
        (case.source / f"c{c}").mkdir(parents=True, exist_ok=True)
    files, payload = [], 0
    c, h, w = case.shape
    for i in range(case.count):
        sub = case.source / f"c{labels[i]}"
        if case.kind == "raw":
            path = sub / f"{i:07d}.pt"
            x = torch.from_numpy(rng.integers(0, 256, case.shape, dtype=np.uint8))
            torch.save(x, path)
            payload += x.numel()
        else:
            path = sub / f"{i:07d}.jpg"
            buf = io.BytesIO()
            Image.fromarray(_picture(rng, h, w)).save(buf, format="JPEG", quality=90)
            path.write_bytes(buf.getvalue())
            payload += buf.tell()
        files.append(str(path))
    # the source's own order (class folders) is how gpufeed pack numbers the samples
    order = sorted(range(case.count), key=lambda k: (int(labels[k]), files[k]))
    files = [files[k] for k in order]
    labels = labels[order]
    np.save(case.root / "labels.npy", labels)
    if case.kind == "fields":
        tokens = rng.integers(0, VOCABULARY, (case.count, CAPTION_TOKENS), dtype=np.int32)
        np.save(case.root / "tokens.npy", tokens)
        payload += tokens.nbytes
    tmp = done.with_suffix(".tmp")
    rel = [str(Path(f).relative_to(case.root)) for f in files]
    tmp.write_text(json.dumps({"files": rel, "payload_bytes": payload}))
    os.replace(tmp, done)


# ----------------------------------------------------------------- per-sample work


def random_resized_crop_flip(x: torch.Tensor, size: int, rng=None) -> torch.Tensor:
    """torchvision's RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3)) + a random
    horizontal flip on a uint8 CHW tensor: torchvision.transforms.v2 where it is installed,
    the same algorithm in torch otherwise. Every row runs this same function."""
    tv = _tv()
    if tv is not None:
        return tv(x)
    import math
    import random

    _, h, w = x.shape
    area = h * w
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw = int(round(math.sqrt(target * ratio)))
        ch = int(round(math.sqrt(target / ratio)))
        if 0 < cw <= w and 0 < ch <= h:
            top = random.randint(0, h - ch)
            left = random.randint(0, w - cw)
            break
    else:
        ch, cw, top, left = h, w, 0, 0
    crop = x[:, top : top + ch, left : left + cw].unsqueeze(0).float()
    out = torch.nn.functional.interpolate(
        crop, size=(size, size), mode="bilinear", antialias=True, align_corners=False
    )
    out = out.squeeze(0).round_().clamp_(0, 255).to(torch.uint8)
    if random.random() < 0.5:
        out = out.flip(-1)
    return out


_TV = None


def _tv():
    global _TV
    if _TV is None:
        try:
            from torchvision.transforms import v2

            _TV = v2.Compose([v2.RandomResizedCrop(56, antialias=True), v2.RandomHorizontalFlip()])
        except Exception:  # noqa: BLE001 - no torchvision on this host: the torch fallback
            _TV = False
    return _TV or None


class Augment:
    """Picklable per-sample transform (spawned workers)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return random_resized_crop_flip(x, self.size)


class FieldsSample:
    """fields: input i -> the sample dict gpufeed.pack_map(fn, ...) and the peers' writers store
    (picklable: pack runs it in worker processes)."""

    def __init__(self, case: Case):
        self.case = case
        self.files = case.files()
        self.labels = case.labels()

    def __call__(self, i: int) -> dict:
        return {
            "image": Path(self.files[i]).read_bytes(),
            "caption": np.ascontiguousarray(self.case.tokens()[i]),
            "label": int(self.labels[i]),
        }


def decode_jpeg_bytes(data) -> torch.Tensor:
    """The decoder every JPEG row uses unless its loader decodes itself: torchvision's
    (libjpeg-turbo) where installed, PIL otherwise."""
    from gpufeed.data.decoders import decode_image

    return decode_image(data)


def load_raw(path: str) -> np.ndarray:
    return torch.load(path, weights_only=True).numpy()


def to_chw_uint8(x) -> torch.Tensor:
    """A decoded image from any loader (PIL image, HWC array, CHW tensor) as uint8 CHW."""
    if isinstance(x, torch.Tensor):
        return x if x.dim() == 3 and x.shape[0] in (1, 3) else x.permute(2, 0, 1).contiguous()
    arr = np.asarray(x.convert("RGB") if hasattr(x, "convert") else x)
    return torch.from_numpy(np.ascontiguousarray(arr.transpose(2, 0, 1)))
