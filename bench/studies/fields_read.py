"""Multi-field read speed: the batched read against the per-sample one, side by side.

    python -m bench.studies.fields_read [--n 4096] [--rounds 5] [--formats lmdb,hdf5,tar,mmap]
                                        [--quick] [--out DIR] [--json FILE]

The same samples (a 64x64 JPEG, a 32-token int32 caption, a class) in
each gpufeed format, every sample read once in a shuffled order, batches of 256:

- ``per-sample``: what gpufeed did before the batched path, and what the per-sample view
  still costs: each record through ``decode_fields`` (one dict per sample), then
  ``collate_fields``;
- ``get_batch``: the batched path (``decode_batch``: every record of the batch split with
  numpy, one copy per field, the JPEGs through one batch-decoder call), what make_loader runs.

Three decode settings: the JPEG kept encoded (``decode=False``), decoded
(``decode=True``), and decoded + RandomResizedCrop(56) + flip; the per-sample row has no batch
decoder, so it decodes, then crops per sample with bench.data.Augment (torchvision's
transforms.v2, what a user of the per-sample path writes). Rounds are interleaved
(bench/studies/common.py), the best pass counts; ratios are printed.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from functools import partial
from pathlib import Path

import numpy as np

import gpufeed  # noqa: E402, I001 - after common, which puts gpufeed's sources on the path
from bench.studies import common
from gpufeed.batch import collate_fields  # noqa: E402
from gpufeed.data.fields import decode_fields  # noqa: E402

FORMATS = ("lmdb", "hdf5", "tar", "mmap")
SCHEMA = {"image": "jpeg", "tokens": "int32[32]", "label": "int"}
BATCH = 256


def jpeg(i: int, size: int = 64) -> bytes:
    """A smooth picture, different for each ``i``, as a quality-90 JPEG."""
    from PIL import Image

    rng = np.random.default_rng(i)
    base = rng.integers(0, 255, (size // 8, size // 8, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((size, size), Image.BILINEAR)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def caption_sample(i: int) -> dict:
    return {"image": jpeg(i), "tokens": np.arange(32, dtype=np.int32) + i, "label": i % 10}


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


def run(root: Path, n: int, rounds: int, formats) -> tuple[dict, str]:
    """(results, markdown): per decode setting, each format's best rates both ways."""
    write_packs(root, n, formats)
    results, tables = {}, []
    for name, (decode, plain_decode, augment) in settings().items():
        candidates = {}
        for fmt in formats:
            ds = gpufeed.open_dataset(root / fmt, map_style=True, decode=decode)
            candidates[f"{fmt} per-sample"] = partial(per_sample_pass, ds, n, plain_decode, augment)
            candidates[f"{fmt} get_batch"] = partial(batched_pass, ds, n)
        passes = common.rates(common.interleaved(candidates, rounds), n)
        best = results[name] = {k: common.best(v) for k, v in passes.items()}
        for fmt in formats:
            pair = {k: best[k] for k in (f"{fmt} per-sample", f"{fmt} get_batch")}
            tables.append(common.ratio_table(pair, f"{fmt} per-sample", title=f"{name}, {fmt}"))
    head = (
        f"fields read: {n} samples (64x64 JPEG + int32[32] caption + class), shuffled, "
        f"batches of {BATCH}: get_batch over per-sample, the best of {rounds} rounds"
    )
    return results, "\n\n".join([head, *tables])


def main(argv=None) -> int:
    p = common.parser(__doc__, rounds=5)
    p.add_argument("--n", type=int, default=4096, help="samples (quick: 512)")
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args(argv)
    n = 512 if args.quick else args.n
    root = Path(tempfile.mkdtemp(prefix="gpufeed-fields-read-"))
    try:
        results, md = run(root, n, 1 if args.quick else args.rounds, args.formats.split(","))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    common.write(args, "fields_read", {"samples": n, "rates": results}, md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
