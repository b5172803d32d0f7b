"""Writing token packs: tokens written per second by gpufeed.pack_tokens against LitData's
``optimize(item_loader=TokensLoader())`` and MosaicML Streaming's ``MDSWriter``.

    python -m bench.studies.tokens_write [--docs 40000] [--files 8] [--workers 1,2]
                                         [--rounds 3] [--tmp DIR] [--quick] [--out DIR]
                                         [--json FILE]

The same input for every candidate: ``--docs`` JSONL documents (``{"text": ...}``, 50-400
words of a made-up vocabulary, seeded) in ``--files`` files. The same tokenizer,
:func:`fake_tokenize`: one id per word, its CRC32 mod 50,257 (GPT-2's vocabulary size;
the same in every process, no download), and an eos (50,256) after each document; every
candidate stores the ids as uint16. Rows, each with every worker count of ``--workers``:

- ``gpufeed pack_tokens``: ``pack_tokens(files, dest, tokenize=fake_tokenize,
  vocab_size=50257, eos=50256, workers=W)``, the mmap format (W=1 runs in-process, as
  pack_map does);
- ``LitData optimize``: ``optimize(fn=litdata_documents, inputs=the files, output_dir,
  chunk_bytes="64MB", item_loader=TokensLoader(), num_workers=W)``, fn yielding one uint16
  array a document (litgpt's prepare scripts' pattern);
- ``MDS MDSWriter``: ``MDSWriter(columns={"tokens": "ndarray:uint16"})`` in the main process,
  documents tokenized in it (W=1) or by ``multiprocessing.Pool(W).imap`` over the lines
  (MDS has no parallel writer of its own: this is what its users write);
- ``tokenize only``: the files read, parsed and tokenized in one process, nothing written:
  the bound of the one-process rows.

Each pass writes into an empty folder; its time includes starting the workers. Tokens/s is
the input's token count (eos included) over a pass's seconds, the best pass counting. Every
output is checked after the rounds (its documents and tokens). A peer that is not installed
reads "not run" (the bench image has both: ``make bench-image``). Rounds are interleaved
(bench/studies/common.py); the table's ratios are against ``tokenize only``, and the lines
under it give gpufeed's ratio to each peer at the same worker count.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

import gpufeed  # noqa: E402, I001 - after common, which puts gpufeed's sources on the path
from bench.studies import common

VOCAB, EOS = 50257, 50256
GPUFEED, LITDATA, MDS = "gpufeed pack_tokens", "LitData optimize", "MDS MDSWriter"
BOUND = "tokenize only (1 process)"
WORDS = 5000


def fake_tokenize(text: str) -> list[int]:
    """A fixed stand-in tokenizer: one id per whitespace-separated word, its CRC32 mod the
    vocabulary (Python's hash() is salted per process; CRC32 is not)."""
    return [zlib.crc32(w) % VOCAB for w in text.encode("utf-8").split()]


def document_ids(line: bytes) -> np.ndarray:
    """One JSONL line -> its ids and the eos, uint16 (what the peers store per document)."""
    ids = fake_tokenize(json.loads(line)["text"])
    ids.append(EOS)
    return np.array(ids, dtype=np.uint16)


def litdata_documents(path: str):
    """LitData's fn: one input file -> one uint16 array a document."""
    with open(path, "rb") as f:
        for line in f:
            yield document_ids(line)


def write_input(folder: Path, docs: int, files: int) -> tuple[list[Path], int]:
    """``docs`` JSONL documents in ``files`` files; and their token count (eos included)."""
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(2, 10)))) for _ in range(WORDS)]
    folder.mkdir(parents=True, exist_ok=True)
    paths, tokens = [], 0
    per_file = -(-docs // files)
    for k in range(files):
        path = folder / f"part-{k:03d}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for _ in range(min(per_file, docs - k * per_file)):
                n = int(rng.integers(50, 400))
                text = " ".join(words[i] for i in rng.integers(0, WORDS, n))
                f.write(json.dumps({"text": text}) + "\n")
                tokens += n + 1
        paths.append(path)
    return paths, tokens


def peers() -> dict[str, str | None]:
    """Each peer's reason for not running here (None: it runs)."""
    out: dict[str, str | None] = {LITDATA: None, MDS: None}
    try:
        import litdata  # noqa: F401
    except ImportError:
        out[LITDATA] = "litdata is not installed (the bench image has it)"
    try:
        import streaming  # noqa: F401
    except ImportError:
        out[MDS] = "mosaicml-streaming is not installed (the bench image has it)"
    return out


def fresh(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    return path


def run_gpufeed(files: list[Path], out: Path, workers: int) -> None:
    gpufeed.pack_tokens(
        str(files[0].parent / "part-*.jsonl"), fresh(out), tokenize=fake_tokenize,
        vocab_size=VOCAB, eos=EOS, workers=workers, quiet=True,
    )  # fmt: skip


def run_litdata(files: list[Path], out: Path, workers: int) -> None:
    from litdata import TokensLoader, optimize

    optimize(
        fn=litdata_documents, inputs=[str(f) for f in files], output_dir=str(fresh(out)),
        chunk_bytes="64MB", item_loader=TokensLoader(), num_workers=workers,
    )  # fmt: skip


def run_mds(files: list[Path], out: Path, workers: int) -> None:
    import multiprocessing as mp

    from streaming import MDSWriter

    def lines():
        for path in files:
            with open(path, "rb") as f:
                yield from f

    with MDSWriter(out=str(fresh(out)), columns={"tokens": "ndarray:uint16"}) as w:
        if workers <= 1:
            for line in lines():
                w.write({"tokens": document_ids(line)})
            return
        with mp.get_context("fork").Pool(workers) as pool:
            for ids in pool.imap(document_ids, lines(), chunksize=256):
                w.write({"tokens": ids})


def run_bound(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as f:
            for line in f:
                document_ids(line)


def written(name: str, out: Path) -> tuple[int, int | None]:
    """(documents, tokens) a candidate's output holds (tokens None where its index does
    not say: MDS)."""
    if name == GPUFEED:
        ds = gpufeed.open_dataset(out, block_size=1)
        return int(read_count(out)), ds.total_tokens
    index = json.loads((out / "index.json").read_text())
    chunks = index.get("chunks") or index.get("shards") or []
    if name == LITDATA:
        return None, sum(int(c["dim"]) for c in chunks)
    return sum(int(s["samples"]) for s in chunks), None


def read_count(out: Path) -> int:
    return json.loads((out / "manifest.json").read_text())["count"]


def candidates(files, work: Path, workers: list[int], missing: dict) -> dict:
    """label -> (one timed pass or None where the peer is not installed, the candidate,
    the folder it writes)."""
    runs = {GPUFEED: run_gpufeed, LITDATA: run_litdata, MDS: run_mds}
    out: dict = {}
    for w in workers:
        for name, run in runs.items():
            label = f"{name}, {w} worker{'s' if w > 1 else ''}"
            dest = work / label.replace(", ", "-").replace(" ", "_")
            timed = None if missing.get(name) else (lambda r=run, d=dest, w=w: r(files, d, w))
            out[label] = (timed, name, dest)
    out[BOUND] = ((lambda: run_bound(files)), BOUND, None)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--docs", type=int, default=40000, help="documents (default 40000)")
    ap.add_argument("--files", type=int, default=8, help="JSONL files (default 8)")
    ap.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    ap.add_argument("--tmp", type=Path, default=None, help="scratch folder (default: a temp one)")
    args = ap.parse_args(argv)
    if args.quick:
        args.docs, args.files, args.rounds = min(args.docs, 600), min(args.files, 2), 1
    workers = [int(w) for w in args.workers.split(",")]
    log = common.logger()
    work = Path(tempfile.mkdtemp(dir=args.tmp, prefix="tokens-write-"))
    try:
        files, tokens = write_input(work / "input", args.docs, args.files)
        log(f"{args.docs:,} documents, {tokens:,} tokens in {len(files)} files")
        missing = peers()
        table = candidates(files, work, workers, missing)
        timed = {label: c[0] for label, c in table.items() if c[0] is not None}
        seconds = common.interleaved(timed, args.rounds, log)
        rates = {label: common.best(r) for label, r in common.rates(seconds, tokens).items()}
        checks = {
            label: written(name, dest)
            for label, (fn, name, dest) in table.items()
            if fn is not None and dest is not None
        }
        results = {
            "docs": args.docs, "files": len(files), "tokens": tokens, "rounds": args.rounds,
            "seconds": seconds, "tokens_per_s": rates, "written": checks,
            "not_run": {k: v for k, v in missing.items() if v},
        }  # fmt: skip
        _check(checks, args.docs, tokens)
        values = {label: rates.get(label) for label in table}
        md = common.ratio_table(values, BOUND, "tokens/s", "Token packs written (tokens/s)")
        md += "\n\n" + "\n".join(_peer_ratios(values, workers, missing))
        common.write(args, "tokens_write", results, md)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _check(checks: dict, docs: int, tokens: int) -> None:
    """Every output holds every document and token (a candidate that wrote less is no
    faster: it is wrong)."""
    for label, (count, total) in checks.items():
        if (count is not None and count != docs) or (total is not None and total != tokens):
            raise SystemExit(
                f"{label}: wrote {count} documents, {total} tokens; expected {docs}, {tokens}"
            )


def _peer_ratios(values: dict, workers: list[int], missing: dict) -> list[str]:
    lines = []
    for w in workers:
        s = "s" if w > 1 else ""
        ours = values.get(f"{GPUFEED}, {w} worker{s}")
        for peer in (LITDATA, MDS):
            theirs = values.get(f"{peer}, {w} worker{s}")
            if ours and theirs:
                lines.append(f"- {w} worker{s}: gpufeed / {peer} = {ours / theirs:.2f}x")
            else:
                lines.append(f"- {w} worker{s}: {peer} not run ({missing.get(peer) or 'failed'})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
