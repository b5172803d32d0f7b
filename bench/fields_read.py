"""Multi-field read speed: the batched read against the per-sample one, side by side.

    python -m bench.fields_read [--n 4096] [--reps 5] [--formats lmdb,hdf5,tar,mmap]

The same samples (a 64x64 JPEG, a 32-token int32 caption, a class: bench.multifield's) in
each gpufeed format, every sample read once in a shuffled order, batches of 256:

- ``per-sample``: what gpufeed did before the batched path, and what the per-sample view
  still costs: each record through ``decode_fields`` (one dict per sample), then
  ``collate_fields``;
- ``get_batch``: the batched path (``decode_batch``: every record of the batch split with
  numpy, one copy per field, the JPEGs through one batch-decoder call), what make_loader runs.

Three decode settings: the JPEG kept encoded (``decode=False``), decoded
(``decode=True``), and decoded + RandomResizedCrop(56) + flip; the per-sample row has no batch
decoder, so it decodes, then crops per sample with bench.data.Augment (torchvision's
transforms.v2, what a user of the per-sample path writes). Passes are interleaved, the best
counts; ratios are printed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "app" / "src"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import gpufeed  # noqa: E402
from bench.multifield import BATCH, best_rates, caption_sample  # noqa: E402
from gpufeed.batch import collate_fields  # noqa: E402
from gpufeed.data.fields import decode_fields  # noqa: E402

FORMATS = ("lmdb", "hdf5", "tar", "mmap")
SCHEMA = {"image": "jpeg", "tokens": "int32[32]", "label": "int"}


def write_packs(root: Path, n: int, formats) -> None:
    samples = [caption_sample(i) for i in range(n)]
    for fmt in formats:
        with gpufeed.Writer(root / fmt, format=fmt, schema=SCHEMA) as w:
            for s in samples:
                w.write(s)


def per_sample_pass(ds, n: int, decode, augment) -> None:
    reader, schema = ds.reader, ds.reader.spec.schema
    order = np.random.default_rng(0).permutation(n)
    for lo in range(0, n, BATCH):
        samples = [
            decode_fields(schema, r, decode) for r in reader.read_batch(order[lo : lo + BATCH])
        ]
        if augment is not None:
            for s in samples:
                s["image"] = augment(s["image"])
        collate_fields(samples)


def batched_pass(ds, n: int) -> None:
    order = np.random.default_rng(0).permutation(n)
    for lo in range(0, n, BATCH):
        ds.get_batch(order[lo : lo + BATCH])


def settings():
    from bench.data import Augment

    return {
        "encoded": (False, False, None),
        "decoded": (True, True, None),
        "decoded+crop56": (gpufeed.RandomResizedCrop(56), True, Augment(56)),
    }


def run(root: Path, n: int, reps: int, formats) -> None:
    write_packs(root, n, formats)
    print(f"fields read: {n} samples (64x64 JPEG + int32[32] caption + class), shuffled, "
          f"batches of {BATCH}; get_batch / per-sample")  # fmt: skip
    for name, (decode, plain_decode, augment) in settings().items():
        candidates = {}
        for fmt in formats:
            ds = gpufeed.open_dataset(root / fmt, map_style=True, decode=decode)
            candidates[f"{fmt} per-sample"] = partial(per_sample_pass, ds, n, plain_decode, augment)
            candidates[f"{fmt} get_batch"] = partial(batched_pass, ds, n)
        rates = best_rates(candidates, reps, n)
        for fmt in formats:
            a, b = rates[f"{fmt} get_batch"], rates[f"{fmt} per-sample"]
            print(f"  {name:15} {fmt:5} get_batch {a:9,.0f}/s  per-sample {b:9,.0f}/s  "
                  f"ratio {a / b:5.2f}x")  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="gpufeed-fields-read-"))
    try:
        run(root, args.n, args.reps, args.formats.split(","))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
