"""Parquet read in place against Hugging Face datasets, LitData, pyarrow's own read and packs.

    python -m bench.studies.parquet [--n 100000] [--group 1000] [--file-rows 10000]
                                    [--sets images,tokens] [--workers 0,2] [--rounds 3]
                                    [--tmp DIR] [--quick] [--out DIR] [--json FILE]

Two sets, each ``--n`` rows in Hub-style files (``train-00000-of-00010.parquet``) of
``--file-rows`` rows in row groups of ``--group``:

- ``images``: a 64x64 JPEG bytes column, a caption, a label; the JPEGs decoded to uint8 CHW
  tensors by every reader;
- ``tokens``: a text column (a caption of 60-300 characters) and a list<int32> token column of
  32-512 ids; the tokens become one int tensor a row.

Every row is read once a pass, in a shuffled order, batches of 256, with each of ``--workers``
(``0,2``: both, side by side in the same rounds):

- ``gpufeed in place, make_loader``: open_dataset on the folder, make_loader's block shuffle
  (its blocks are the row groups: each row group read once an epoch);
- ``gpufeed in place, DataLoader``: the tutorial DataLoader(shuffle=True) over the same
  dataset (a uniform shuffle: nearly every batch touches every row group);
- ``HF datasets, DataLoader``: datasets.Dataset.from_parquet on the files (it converts them
  once to its Arrow cache, outside the timing), the image column cast to Image(),
  with_format("torch") (its Image feature decodes with PIL), DataLoader(shuffle=True): what
  its users write;
- ``LitData ParquetLoader``: litdata.index_parquet_dataset on the folder (once, outside the
  timing), StreamingDataset(folder, item_loader=ParquetLoader(), shuffle=True,
  transform=decode) + StreamingDataLoader (workers spawned: it refuses fork); its rows are
  Python values, so the transform decodes the JPEG (torchvision's decode_jpeg, as gpufeed
  does where torchvision imports; else PIL) and makes the token tensor;
- ``pyarrow iter_batches (no decode)``: the files read front to back, nothing decoded: the
  read bound, not a loader;
- ``gpufeed lmdb pack`` / ``gpufeed tar pack``, make_loader: the same rows after
  ``gpufeed pack`` (outside the timing).

The tutorial rows (DataLoader, StreamingDataLoader) collate to a list of rows (token lists
vary in length: the default collate cannot stack them); make_loader's batches are gpufeed's
own (images stacked, tokens ragged). Every pass checks that it saw ``--n`` rows. A peer not
installed (HF datasets, LitData + polars) reads "not run" with the reason. Rounds are
interleaved (bench/studies/common.py), the best pass counts; ratios against HF datasets.
"""

from __future__ import annotations  # noqa: I001 - common first: it puts gpufeed on the path

import shutil
import tempfile
from pathlib import Path

import numpy as np

from bench.studies import common
import gpufeed
from bench.studies.fields_read import jpeg

BATCH = 256
SETS = ("images", "tokens")
PACKS = ("lmdb", "tar")
HF = "HF datasets, DataLoader"
LITDATA = "LitData ParquetLoader"
IN_PLACE = "gpufeed in place, make_loader"
TUTORIAL = "gpufeed in place, DataLoader"
BOUND = "pyarrow iter_batches (no decode)"
WORDS = "a the cat dog on under red blue small large photo of sitting near green".split()


# ---------------------------------------------------------------------------- the data
def _images_columns(lo: int, hi: int, rng) -> dict:
    import pyarrow as pa

    images = [jpeg(i % 512) for i in range(lo, hi)]  # 512 distinct pictures: a quick write
    return {
        "image": pa.array(images, pa.binary()),
        "caption": [f"a picture numbered {i}" for i in range(lo, hi)],
        "label": pa.array([i % 10 for i in range(lo, hi)], pa.int64()),
    }


def _tokens_columns(lo: int, hi: int, rng) -> dict:
    import pyarrow as pa

    words = np.asarray(WORDS)
    text = [" ".join(rng.choice(words, rng.integers(12, 60))) for _ in range(lo, hi)]
    tokens = [rng.integers(0, 50000, rng.integers(32, 513)).astype(np.int32) for _ in range(lo, hi)]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int32)
    flat = np.concatenate(tokens) if tokens else np.zeros(0, np.int32)
    return {"text": text, "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))}


COLUMNS = {"images": _images_columns, "tokens": _tokens_columns}


def write_set(kind: str, folder: Path, n: int, group: int, file_rows: int) -> list[Path]:
    """`kind`'s n rows as Hub-style Parquet files of `file_rows` rows, row groups of `group`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    count = -(-n // file_rows)
    files = []
    for k in range(count):
        lo, hi = k * file_rows, min(n, (k + 1) * file_rows)
        path = folder / f"train-{k:05d}-of-{count:05d}.parquet"
        pq.write_table(pa.table(COLUMNS[kind](lo, hi, rng)), path, row_group_size=group)
        files.append(path)
    return files


# ---------------------------------------------------------------------------- the peers
def peers() -> dict[str, str | None]:
    """Each peer's reason for not running here (None: it runs)."""
    out: dict[str, str | None] = {}
    try:
        import datasets  # noqa: F401
    except ImportError:
        out[HF] = "datasets is not installed (the bench image has it)"
    else:
        out[HF] = None
    try:
        import litdata  # noqa: F401
        import polars  # noqa: F401
    except ImportError as e:
        out[LITDATA] = f"{e.name} is not installed (the bench image has litdata and polars)"
    else:
        out[LITDATA] = None
    return out


def hf_dataset(files: list[Path], kind: str, cache: Path):
    import datasets

    ds = datasets.Dataset.from_parquet([str(f) for f in files], cache_dir=str(cache))
    if kind == "images":
        ds = ds.cast_column("image", datasets.Image())
    return ds.with_format("torch")


def litdata_index(folder: Path) -> None:
    from litdata import index_parquet_dataset

    index_parquet_dataset(str(folder), num_workers=1)


def litdata_row(row: dict) -> dict:
    """What a LitData user's transform does: the JPEG decoded (torchvision's decode_jpeg where
    it imports, as gpufeed's own decode; else PIL, as HF's Image feature), the token list
    made a tensor."""
    import torch

    if "image" in row:
        row["image"] = _decode_jpeg(row["image"])
    if "tokens" in row:
        row["tokens"] = torch.tensor(row["tokens"], dtype=torch.int32)
    return row


def _decode_jpeg(data: bytes):
    import torch

    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError:
        import io

        from PIL import Image

        pixels = np.array(Image.open(io.BytesIO(data)).convert("RGB"))
        return torch.from_numpy(pixels).permute(2, 0, 1)
    return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB)


# ---------------------------------------------------------------------------- the passes
def listed(batch):
    """The tutorial rows' collate: the rows as a list (token lists vary in length)."""
    return batch


def _rows(batch) -> int:
    if isinstance(batch, list):
        return len(batch)
    return len(next(iter(batch.values())))  # gpufeed's FieldBatch: a dict of columns


def drain(loader, n: int) -> None:
    """Every batch taken; a pass that saw other than n rows is an error (the pass is timed
    by common.interleaved: nothing returned)."""
    seen = sum(_rows(b) for b in loader)
    if seen != n:
        raise RuntimeError(f"a pass read {seen:,} rows, not {n:,}")


def candidates(kind: str, data: dict, n: int, workers: int, missing: dict) -> dict:
    """`kind`'s readers at `workers` workers, name -> one timed pass (None: not run)."""
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    folder, files = data["folder"], data["files"]
    in_place = gpufeed.open_dataset(folder)

    def make(ds):
        return lambda: drain(
            gpufeed.make_loader(
                ds, batch_size=BATCH, shuffle=True, num_workers=workers, check_shm=False
            ),
            n,
        )

    def tutorial(ds):
        return lambda: drain(
            DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=workers, collate_fn=listed),
            n,
        )

    def litdata_pass() -> None:
        from litdata import StreamingDataLoader, StreamingDataset
        from litdata.streaming.item_loader import ParquetLoader

        ds = StreamingDataset(
            str(folder), item_loader=ParquetLoader(), shuffle=True, transform=litdata_row
        )
        # its ParquetLoader refuses fork (polars' threads): spawn, as its error message asks
        context = {"multiprocessing_context": "spawn"} if workers else {}
        loader = StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=workers, collate_fn=listed, **context
        )
        drain(loader, n)

    def arrow_bound() -> None:
        for f in files:
            for _ in pq.ParquetFile(f).iter_batches(batch_size=BATCH):
                pass

    out = {IN_PLACE: make(in_place), TUTORIAL: tutorial(in_place)}
    out[HF] = None if missing[HF] else tutorial(data["hf"])
    out[LITDATA] = None if missing[LITDATA] else litdata_pass
    out[BOUND] = arrow_bound
    for fmt in PACKS:
        out[f"gpufeed {fmt} pack, make_loader"] = make(gpufeed.open_dataset(data[fmt]))
    return out


def prepare(kind: str, root: Path, n: int, group: int, file_rows: int, missing: dict) -> dict:
    """`kind` written, packed, and made ready for each peer that runs (outside the timing)."""
    folder = root / kind / "data"
    data = {"folder": folder, "files": write_set(kind, folder, n, group, file_rows)}
    for fmt in PACKS:
        data[fmt] = root / kind / f"pack.{fmt}"
        gpufeed.pack(folder, data[fmt], format=fmt, quiet=True)
    if not missing[HF]:
        data["hf"] = hf_dataset(data["files"], kind, root / kind / "hf-cache")
    if not missing[LITDATA]:
        litdata_index(folder)
    return data


# ---------------------------------------------------------------------------- the report
def named(name: str, workers: int) -> str:
    return f"{name} [{workers}w]"


def goals(best: dict, worker_counts: list[int]) -> list[str]:
    """The issue's goals, as ratios: in place against each peer, each pack against in place."""
    lines = []
    for w in worker_counts:
        for ours in (IN_PLACE, TUTORIAL):
            for peer in (HF, LITDATA):
                a, b = best.get(named(ours, w)), best.get(named(peer, w))
                if a and b:
                    ok = "met" if a >= b else "NOT met"
                    lines.append(f"- {w} workers: {ours} / {peer} = {a / b:.2f}x ({ok})")
        for fmt in PACKS:
            a, b = (
                best.get(named(f"gpufeed {fmt} pack, make_loader", w)),
                best.get(named(IN_PLACE, w)),
            )
            if a and b:
                lines.append(f"- {w} workers: {fmt} pack / in place (make_loader) = {a / b:.2f}x")
    return lines


def run_set(kind: str, args, root: Path, missing: dict, log) -> tuple[dict, str]:
    n, group = args.n, min(args.group, args.n)
    data = prepare(kind, root, n, group, min(args.file_rows, n), missing)
    log(f"{kind}: {n} rows written, packed to {', '.join(PACKS)}, peers ready")
    table = {}
    for w in args.workers:
        for name, run in candidates(kind, data, n, w, missing).items():
            table[named(name, w)] = run
    timed = common.interleaved({k: v for k, v in table.items() if v is not None}, args.rounds, log)
    rates = common.rates(timed, n)
    best = {k: common.best(rates[k]) if k in rates else None for k in table}
    reasons = [f"- {name}: not run: {why}" for name, why in missing.items() if why]
    title = (
        f"Parquet read, {kind}: {n:,} rows in files of {min(args.file_rows, n):,}, row groups "
        f"of {group:,}; [Nw] = N loader workers"
    )
    md = "\n".join(
        [
            common.ratio_table(best, named(HF, args.workers[0]), title=title),
            "",
            *goals(best, args.workers),
            *reasons,
        ]
    )
    return {"seconds": timed, "best": best}, md


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--n", type=int, default=100000, help="rows a set (default 100000)")
    ap.add_argument("--group", type=int, default=1000, help="rows per row group (default 1000)")
    ap.add_argument("--file-rows", type=int, default=10000, help="rows a file (default 10000)")
    ap.add_argument("--sets", default=",".join(SETS), help="images,tokens (default both)")
    ap.add_argument("--workers", default="0,2", help="loader worker counts (default 0,2)")
    ap.add_argument("--tmp", type=Path, default=None, help="where the data goes (default /tmp)")
    args = ap.parse_args()
    args.workers = [int(w) for w in str(args.workers).split(",")]
    sets = [s for s in args.sets.split(",") if s]
    if unknown := [s for s in sets if s not in SETS]:
        ap.error(f"--sets: no set {unknown}; the sets are {', '.join(SETS)}")
    if args.quick:
        args.n, args.group, args.file_rows, args.rounds = 2000, 250, 1000, 1
    log = common.logger()
    missing = peers()
    if args.tmp is not None:
        args.tmp.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gpufeed-parquet-", dir=args.tmp))
    try:
        results, tables = {"n": args.n, "group": args.group, "workers": args.workers}, []
        for kind in sets:
            results[kind], md = run_set(kind, args, root, missing, log)
            tables.append(md)
        common.write(args, "parquet", results, "\n\n".join(tables))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
