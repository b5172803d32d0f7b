"""Parquet read in place against Hugging Face datasets, pyarrow's own read and a packed copy.

    python -m bench.studies.parquet [--n 20000] [--group 1000] [--rounds 3] [--workers 0]
                                    [--quick] [--out DIR] [--json FILE]

An image+caption set (a 64x64 JPEG bytes column, a caption, 16-64 int32 tokens, a label),
``--n`` rows in row groups of ``--group``, each row read once in a shuffled order, batches of
256, the JPEGs decoded to uint8 CHW tensors:

- ``gpufeed in place, make_loader``: open_dataset on the .parquet file, make_loader's block
  shuffle (its blocks are the row groups: each row group read once an epoch);
- ``gpufeed in place, DataLoader``: the tutorial DataLoader(shuffle=True) over the same
  dataset (a uniform shuffle: nearly every batch touches every row group);
- ``HF datasets, DataLoader``: datasets.Dataset.from_parquet, the image column cast to
  Image(), with_format("torch"), DataLoader(shuffle=True) (what its users write);
- ``pyarrow iter_batches (no decode)``: the file read front to back, nothing decoded: the
  read bound, not a loader;
- ``gpufeed lmdb pack, make_loader``: the same rows after ``gpufeed pack`` to lmdb.

LitData's Parquet loader is not installed here: not run. Rounds are interleaved
(bench/studies/common.py), the best pass counts; ratios against HF datasets are printed.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np

import gpufeed  # noqa: E402, I001 - after common, which puts gpufeed's sources on the path
from bench.studies import common
from bench.studies.fields_read import jpeg

BATCH = 256


def write_parquet(path: Path, n: int, group: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    images = [jpeg(i % 512) for i in range(n)]  # 512 distinct pictures: the write stays quick
    table = pa.table(
        {
            "image": pa.array(images, pa.binary()),
            "caption": [f"a picture numbered {i}" for i in range(n)],
            "tokens": pa.array(
                [rng.integers(0, 50000, rng.integers(16, 65)).tolist() for _ in range(n)],
                pa.list_(pa.int32()),
            ),
            "label": pa.array([i % 10 for i in range(n)], pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=group)


def _drain(loader) -> None:
    """Every batch taken (the pass is timed by common.interleaved: nothing returned)."""
    for _ in loader:
        pass


def candidates(path: Path, pack: Path, workers: int) -> dict:
    import datasets
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    in_place = gpufeed.open_dataset(path, columns=["image", "label", "tokens", "caption"])
    packed = gpufeed.open_dataset(pack)
    hf = datasets.Dataset.from_parquet(str(path)).cast_column("image", datasets.Image())
    hf = hf.with_format("torch")

    def listed(batch):
        return {"label": [s["label"] for s in batch], "rows": batch}

    def make(ds):
        return lambda: _drain(
            gpufeed.make_loader(ds, batch_size=BATCH, shuffle=True, num_workers=workers)
        )

    def tutorial(ds, collate):
        return lambda: _drain(
            DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=collate)
        )

    def arrow_bound() -> None:
        for _ in pq.ParquetFile(path).iter_batches(batch_size=BATCH):
            pass

    return {
        "gpufeed in place, make_loader": make(in_place),
        "gpufeed in place, DataLoader": tutorial(in_place, listed),
        "HF datasets, DataLoader": tutorial(hf, listed),
        "pyarrow iter_batches (no decode)": arrow_bound,
        "gpufeed lmdb pack, make_loader": make(packed),
    }


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--n", type=int, default=20000, help="rows (default 20000)")
    ap.add_argument("--group", type=int, default=1000, help="rows per row group (default 1000)")
    ap.add_argument("--workers", type=int, default=0, help="loader workers (default 0)")
    args = ap.parse_args()
    n, rounds = (2000, 1) if args.quick else (args.n, args.rounds)
    log = common.logger()
    tmp = Path(tempfile.mkdtemp(prefix="gpufeed-parquet-"))
    try:
        path = tmp / "captions.parquet"
        write_parquet(path, n, min(args.group, n))
        gpufeed.pack(path, tmp / "captions.lmdb", format="lmdb", quiet=True)
        log(f"{n} rows written, packed")
        timed = common.interleaved(
            candidates(path, tmp / "captions.lmdb", args.workers), rounds, log
        )
        best = {name: common.best(v) for name, v in common.rates(timed, n).items()}
        results = {"n": n, "group": args.group, "workers": args.workers, "seconds": timed}
        title = f"Parquet read, {n} rows, row groups of {args.group}, {args.workers} workers"
        common.write(
            args,
            "parquet",
            results,
            common.ratio_table(best, "HF datasets, DataLoader", title=title),
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
