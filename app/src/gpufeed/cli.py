"""The `gpufeed` command.

  gpufeed pack SOURCE DEST --format {hdf5,lmdb,tar,mmap} [options]
  gpufeed verify DEST [--decode] [--json]
  gpufeed inspect DEST [--json]
  gpufeed doctor [DATA_DIR] [--json]     (gpufeed.doctor)
  gpufeed bench PATH [--step-ms MS] [--device cuda] [--json]   (gpufeed.bench)
  gpufeed tune PATH [--budget S] [--write FILE] [--json]      (gpufeed.tune)
  gpufeed synth PATH [--count N]         (gpufeed.synth)

Exit codes: 0 ok, 1 data problem (unreadable source, corrupt pack, failed verification),
2 usage error. Errors are one line naming the file and sample; GPUFEED_DEBUG=1 shows the
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from gpufeed import __version__

FORMATS = ("hdf5", "lmdb", "tar", "mmap")
EXIT_OK, EXIT_DATA, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'256M', '1.5G', '4096' -> bytes (binary units; an optional trailing B or iB)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)] if unit else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512M or 2G") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: size must be positive")
    return int(value * _UNITS[unit])


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gpufeed",
        description="Pack small files into HDF5/LMDB/tar/mmap, verify and inspect them.",
    )
    parser.add_argument("--version", action="version", version=f"gpufeed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "pack",
        help="pack an image folder, a folder of .npy/.pt files or a list file",
        description="Pack SOURCE (image-folder tree with class subfolders, a folder of .npy/.pt "
        "files, or a list file of `path label` lines) into DEST. The pack is written under "
        "DEST.partial and renamed to DEST when complete; an interrupted pack continues with "
        "--resume.",
    )
    p.add_argument("source", metavar="SOURCE")
    p.add_argument("dest", metavar="DEST")
    p.add_argument("--format", "-f", choices=FORMATS, required=True)
    p.add_argument(
        "--workers",
        "-j",
        type=int,
        default=None,
        help="processes reading and encoding (default: CPUs, at most 8, started only when the "
        "first items read in-process show they pay off; 0 or 1: in-process)",
    )
    p.add_argument("--shard-size", type=positive_int, help="tar: max samples per shard (10000)")
    p.add_argument("--shard-bytes", type=parse_bytes, help="tar: max bytes per shard (256M)")
    p.add_argument("--compression", help="hdf5: none, lzf or gzip[:1-9] (default none)")
    p.add_argument(
        "--encode",
        choices=("keep", "raw"),
        default="keep",
        help="images: keep the encoded bytes (decode when read) or store decoded uint8 CHW "
        "arrays (default keep)",
    )
    p.add_argument("--resize", metavar="HxW", help="with --encode raw: resize images to HxW")
    p.add_argument(
        "--container",
        choices=("npy", "pt"),
        default="npy",
        help="mmap: samples.npy (numpy memmap) or samples.pt (torch.load mmap=True)",
    )
    p.add_argument("--resume", action="store_true", help="continue an interrupted pack")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DEST if it is a gpufeed pack (anything else is refused) / discard a partial",
    )
    p.add_argument(
        "--follow-symlinks",
        action="store_true",
        help="follow symbolic links to folders in SOURCE (loops and second links to a folder "
        "are reported, never packed twice); by default such links are reported, not followed",
    )
    p.add_argument(
        "--on-error",
        choices=("stop", "skip"),
        default="stop",
        help="bad source file: stop naming it (default), or skip it and list it in the manifest",
    )
    p.add_argument(
        "--part-size",
        type=positive_int,
        help="source items per committed part (crash-safety granularity, default 1024)",
    )
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar or messages")

    v = sub.add_parser("verify", help="re-read every sample and check checksums")
    v.add_argument("dest", metavar="DEST")
    v.add_argument("--decode", action="store_true", help="also decode every encoded image")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    i = sub.add_parser("inspect", help="format, count, classes, shapes, size on disk")
    i.add_argument("dest", metavar="DEST")
    i.add_argument("--json", action="store_true", help="print JSON")

    from gpufeed import doctor, synth  # each module owns its arguments

    doctor.add_arguments(
        sub.add_parser("doctor", help="check driver, GPUs, torch, CPUs, shm, limits and data")
    )
    synth.add_arguments(sub.add_parser("synth", help="write a small demo image-folder dataset"))
    from gpufeed import bench, tune

    bench.add_arguments(sub.add_parser("bench", help="measure how fast a pack delivers batches"))
    tune.add_arguments(sub.add_parser("tune", help="find the fastest loader settings here"))
    return parser


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _cmd_pack(args) -> int:
    from gpufeed.pack import pack

    manifest = pack(
        args.source,
        args.dest,
        format=args.format,
        workers=args.workers,
        shard_size=args.shard_size,
        shard_bytes=args.shard_bytes,
        compression=args.compression,
        encode=args.encode,
        resize=args.resize,
        container=args.container,
        resume=args.resume,
        overwrite=args.overwrite,
        on_error=args.on_error,
        quiet=args.quiet,
        part_size=args.part_size,
        follow_symlinks=args.follow_symlinks,
    )
    if not args.quiet:
        skipped = manifest.get("skipped", [])
        line = f"packed {manifest['count']} samples into {args.dest} ({manifest['format']})"
        if skipped:
            line += f"; skipped {len(skipped)}: " + ", ".join(s["path"] for s in skipped[:5])
            line += " ..." if len(skipped) > 5 else ""
        # file names that are not UTF-8 (kept byte for byte) print as \x escapes
        print(line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))
    return EXIT_OK


def _cmd_verify(args) -> int:
    from gpufeed.verify import verify

    report = verify(args.dest, decode=args.decode, quiet=args.quiet or args.json)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for problem in report.problems:
            print(problem)
        if report.problems_total > len(report.problems):
            print(f"... and {report.problems_total - len(report.problems)} more")
        print(report.summary())
    return EXIT_OK if report.ok else EXIT_DATA


def _cmd_inspect(args) -> int:
    from gpufeed.verify import inspect

    info = inspect(args.dest)
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    s = info["sample"]
    sample = (
        f"{s['dtype_name']} {'x'.join(map(str, s['shape']))}" if s["kind"] == "array" else "encoded"
    )
    classes = info["classes"]
    if classes is None:
        class_text = "none (labels from the source or -1)"
    else:
        shown = ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else "")
        class_text = f"{len(classes)} ({shown})"
    rows = [
        ("path", info["path"]),
        ("format", f"{info['format']} (format_version {info['format_version']})"),
        ("samples", info["count"]),
        ("classes", class_text),
        ("sample", sample),
        ("size", f"{_human(info['size_bytes'])} ({_human(info['disk_bytes'])} on disk)"),
    ]
    if "shards" in info:
        rows.append(("shards", f"{info['shards']}: {info['pattern']}"))
    if info.get("compression"):
        rows.append(("compression", info["compression"]))
    rows.append(("skipped", info["skipped"]))
    rows.append(("created by", info["created_by"]))
    for key, value in rows:
        print(f"{key + ':':<12} {value}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    from gpufeed import doctor, synth
    from gpufeed.formats.common import GpufeedError

    handlers = {"pack": _cmd_pack, "verify": _cmd_verify, "inspect": _cmd_inspect}
    handlers.update(doctor=doctor.main, synth=synth.main)
    from gpufeed import bench, tune

    handlers.update(bench=bench.main, tune=tune.main)
    debug = os.environ.get("GPUFEED_DEBUG", "") not in ("", "0")
    try:
        return handlers[args.command](args)
    except GpufeedError as e:
        if debug:
            raise
        print(f"gpufeed {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        hint = "; continue with --resume" if args.command == "pack" else ""
        print(f"gpufeed {args.command}: interrupted{hint}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (OSError, ValueError, RuntimeError) as e:
        if debug:
            raise
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"gpufeed {args.command}: error: {where}{type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_DATA


if __name__ == "__main__":
    sys.exit(main())
