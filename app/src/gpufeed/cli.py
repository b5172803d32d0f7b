"""The `gpufeed` command (also `python -m gpufeed`).

  gpufeed pack SOURCE DEST --format {hdf5,lmdb,tar,mmap} [options]
  gpufeed pack TEXTS DEST --tokenize MODULE:FUNCTION [--vocab-size N] [--eos ID]  (token pack)
  gpufeed verify DEST [--decode]          (DEST a pack, or data read in place: an image
  gpufeed inspect DEST                     folder, WebDataset shards, an HDF5 file --datasets)
  gpufeed merge PART... DEST [--overwrite] (parts packed anywhere -> one pack: gpufeed.write.merge)
  gpufeed doctor [DATA_DIR]              (gpufeed.tools.doctor)
  gpufeed bench PATH [--step-ms MS] [--device cuda]   (gpufeed.tools.bench)
  gpufeed tune PATH [--budget S] [--write FILE]      (gpufeed.tools.tune)
  gpufeed synth PATH [--count N]         (gpufeed.tools.synth)

Every subcommand takes -q/--quiet (no progress bars or messages: the result, warnings and
errors only), -v/--verbose (more detail, and the traceback of an error, as GPUFEED_DEBUG=1)
and --json (the result as JSON on stdout). Option values are checked before anything runs
(gpufeed.cliargs).

Exit codes: 0 ok, 1 data problem (unreadable source, corrupt pack, failed verification),
2 usage error (a bad option or value, a path that does not exist), 130 interrupted, 141 the
reader of the output went away (`gpufeed inspect --json | head`), quietly, as for SIGPIPE.
Errors are one line naming the file and sample.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from gpufeed import __version__, cliargs

EXIT_OK, EXIT_DATA, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141


def parse_bytes(text: str) -> int:
    """'256M', '1.5G', '4096' -> bytes (binary units); see :func:`gpufeed.cliargs.bytes_size`."""
    return cliargs.bytes_size(text)


def _common() -> argparse.ArgumentParser:
    """-q/-v/--json, the same on every subcommand."""
    common = argparse.ArgumentParser(add_help=False)
    loud = common.add_mutually_exclusive_group()
    loud.add_argument(
        "--quiet", "-q", action="store_true", help="no progress bars or messages: results only"
    )
    loud.add_argument(
        "--verbose", "-v", action="store_true", help="more detail, and an error's traceback"
    )
    common.add_argument("--json", action="store_true", help="print the result as JSON")
    return common


def _add_pack(p: argparse.ArgumentParser) -> None:
    from gpufeed.formats import FORMATS
    from gpufeed.formats.mmap import CONTAINERS
    from gpufeed.write.options import ENCODE_MODES, ON_ERROR

    p.description = (
        "Pack SOURCE (image-folder tree with class subfolders, a folder of .npy/.pt "
        "files, of .txt or .wav files (class subfolders or flat), a list file of `path label` "
        "lines, WebDataset tar shards, or an HDF5 file with --datasets) into DEST. Text, "
        "audio, .pt dicts and list files with number labels make multi-field samples. The "
        "pack is written under DEST.partial and renamed to DEST when complete; an interrupted "
        "pack continues with --resume. DEST may be a URL (s3://bucket/prefix): the pack is "
        "made in a local staging folder, then uploaded with its manifest last."
    )
    p.add_argument("source", metavar="SOURCE", type=cliargs.existing_path)
    p.add_argument("dest", metavar="DEST", help="a folder or a URL")
    p.add_argument(
        "--format",
        "-f",
        choices=FORMATS,
        help="required, except with --tokenize (default mmap: windows are slices of one map)",
    )
    p.add_argument(
        "--workers",
        "-j",
        type=cliargs.workers,
        default=None,
        help="processes reading and encoding (default: CPUs, at most 8, started only when the "
        "first items read in-process show they pay off; 0 or 1: in-process; at most "
        f"{cliargs.WORKERS_PER_CPU} per usable CPU)",
    )
    p.add_argument(
        "--shard-size",
        type=cliargs.integer(1, 10**8, "--shard-size"),
        help="tar: max samples per shard (10000)",
    )
    p.add_argument("--shard-bytes", type=cliargs.bytes_size, help="tar: max bytes per shard (256M)")
    p.add_argument(
        "--compression", type=cliargs.compression, help="hdf5: none, lzf or gzip[:1-9] (none)"
    )
    p.add_argument(
        "--encode",
        choices=ENCODE_MODES,
        default="keep",
        help="images: keep the encoded bytes (decode when read) or store decoded uint8 CHW "
        "arrays (default keep)",
    )
    p.add_argument(
        "--resize",
        metavar="HxW",
        type=cliargs.resize,
        help="with --encode raw: resize images to HxW (each side at most 16384)",
    )
    p.add_argument(
        "--container",
        choices=CONTAINERS,
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
        choices=ON_ERROR,
        default="stop",
        help="bad source file: stop naming it (default), or skip it and list it in the manifest",
    )
    p.add_argument(
        "--part-size",
        type=cliargs.integer(1, 10**7, "--part-size"),
        help="source items per committed part (crash-safety granularity, default 1024)",
    )
    _add_pack_sources_and_urls(p)
    _add_pack_tokens(p)


def _add_pack_tokens(p) -> None:
    """--tokenize makes `gpufeed pack` write a token pack (gpufeed.write.token_pack): the
    same command, as pack_tokens is one more way to make a pack (pack_map, pack_samples)."""
    g = p.add_argument_group(
        "token packs (--tokenize)",
        "SOURCE holds texts: .jsonl (.gz, .zst), .txt files (one document each), Parquet, or "
        "a folder or glob of them; each document's token ids become one sample, read as "
        "windows by open_dataset(DEST, block_size=B)",
    )
    g.add_argument(
        "--tokenize",
        metavar="MODULE:FUNCTION",
        type=cliargs.tokenize_spec,
        help="a function of a text returning its token ids (e.g. mytok:encode, a module "
        "of the current folder or installed)",
    )
    g.add_argument(
        "--vocab-size",
        type=cliargs.integer(1, 1 << 32, "--vocab-size"),
        help="ids are below it; uint16 up to 65536, else uint32 (default: the tokenizer's, "
        "else uint32)",
    )
    g.add_argument(
        "--eos",
        type=cliargs.integer(0, (1 << 32) - 1, "--eos"),
        help="a token id appended after each document (recorded in the manifest)",
    )
    g.add_argument(
        "--text-field",
        default="text",
        help="the JSONL key or Parquet column holding the text (default text)",
    )
    g.add_argument(
        "--batched",
        action="store_true",
        help="the function takes a list of texts and returns a list of id lists",
    )


def _add_pack_sources_and_urls(p) -> None:
    p.add_argument(
        "--schema",
        metavar="FIELD=TYPE",
        type=cliargs.schema_field,
        action="append",
        help="multi-field samples (.txt, .wav, .pt dicts, list-file number targets): a field's "
        "type instead of the one taken from the first file, e.g. x=int64[-1] for an array "
        "whose size varies (repeat for more fields)",
    )
    p.add_argument(
        "--datasets",
        type=cliargs.datasets,
        help="SOURCE is an HDF5 file: its datasets, one row per sample, as FIELD=PATH,... or "
        "PATH,... (fields named by the last path component)",
    )
    p.add_argument(
        "--staging-dir",
        type=cliargs.cache_dir,
        help="DEST a URL: the local folder the pack is made in before its upload (default: "
        "the cache folder's staging/SCHEME/BUCKET/PREFIX; --resume continues there)",
    )
    p.add_argument(
        "--keep-staging", action="store_true", help="DEST a URL: keep the staged pack after upload"
    )


def _add_verify(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Re-read DEST, a pack: its files' sizes and sha256, every sample's crc32, the labels. "
        "DEST data read in place (an image folder, WebDataset shards, an HDF5 file with "
        "--datasets) has no checksums: every sample is read and decoded, each failure named."
    )
    p.add_argument("dest", metavar="DEST", type=cliargs.pack_path)
    p.add_argument(
        "--decode",
        action="store_true",
        help="also decode every encoded image (always done for data read in place)",
    )
    cliargs.add_cache_options(p)
    _add_in_place_options(p)


def _add_inspect(p: argparse.ArgumentParser) -> None:
    p.description = (
        "What DEST holds: a pack, or data read in place as open_dataset reads it (an image "
        "folder, WebDataset shards, an HDF5 file with --datasets)."
    )
    p.add_argument("dest", metavar="DEST", type=cliargs.pack_path)
    cliargs.add_cache_options(p)
    _add_in_place_options(p)


def _add_merge(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Make one pack at DEST of the finished packs PART... (same format, sample spec, "
        "classes and gpufeed version), samples in the order given. No sample is copied on "
        "one file system (hard links); merging the same parts again changes nothing."
    )
    p.add_argument("parts", metavar="PART", nargs="+", type=cliargs.pack_path)
    p.add_argument(
        "dest",
        metavar="DEST",
        type=cliargs.location,
        help="the merged pack's folder, or a URL in the parts' bucket (parts in object "
        "storage are merged there by server-side copies, the manifest last)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DEST if it is a gpufeed pack that is not this merge of these parts",
    )
    cliargs.add_cache_options(p)


def _add_in_place_options(p: argparse.ArgumentParser) -> None:
    """verify's and inspect's options for data read in place (open_dataset's)."""
    p.add_argument(
        "--datasets",
        type=cliargs.datasets,
        help="DEST is an HDF5 file without a manifest: its datasets, one row per sample, as "
        "FIELD=PATH,... or PATH,... (fields named by the last path component)",
    )
    p.add_argument(
        "--index-dir",
        type=cliargs.cache_dir,
        help="DEST read in place: where its cached index is (default $GPUFEED_INDEX_DIR, "
        "else ~/.cache/gpufeed/index)",
    )


def _in_place_options(args) -> dict:
    """--datasets and --index-dir, as verify's and inspect's keywords, when given."""
    return {k: getattr(args, k) for k in ("datasets", "index_dir") if getattr(args, k, None)}


# The tools' modules own their arguments and their run (add_arguments, main).
_TOOLS = {
    "doctor": "gpufeed.tools.doctor",
    "synth": "gpufeed.tools.synth",
    "bench": "gpufeed.tools.bench",
    "tune": "gpufeed.tools.tune",
}

# name -> (one-line help, what adds its arguments). A subcommand's arguments (and the modules
# they need: the tools pull in torch) are built only for the subcommand that runs, so
# --version, --help and the light commands start without them.
COMMANDS = {
    "pack": (
        "pack an image folder, .npy/.pt, .txt or .wav files, a list file, WebDataset shards "
        "or HDF5; texts into token ids with --tokenize",
        _add_pack,
    ),
    "verify": ("re-read every sample and check checksums (or decode, in place)", _add_verify),
    "inspect": ("format, count, classes, shapes, size on disk; packs or in place", _add_inspect),
    "merge": ("one pack of packs written anywhere (parts), no sample copied", _add_merge),
    "doctor": ("check driver, GPUs, torch, CPUs, shm, limits and data", None),
    "synth": ("write a small demo image-folder dataset", None),
    "bench": ("measure how fast a pack delivers batches", None),
    "tune": ("find the fastest loader settings here", None),
}


def _add_arguments(name: str, p: argparse.ArgumentParser) -> None:
    add = COMMANDS[name][1]
    if add is None:
        add = importlib.import_module(_TOOLS[name]).add_arguments
    add(p)


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The parser; ``commands``: the subcommands whose arguments to build (None: all)."""
    parser = argparse.ArgumentParser(
        prog="gpufeed",
        description="Pack small files into HDF5/LMDB/tar/mmap, verify and inspect them.",
    )
    parser.add_argument("--version", action="version", version=f"gpufeed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common()
    for name, (text, _) in COMMANDS.items():
        p = sub.add_parser(name, parents=[common], help=text)
        if commands is None or name in commands:
            _add_arguments(name, p)
    return parser


def command_in(argv: list[str]) -> str | None:
    """The subcommand argv names: its first word not an option (the top level takes no
    option with a value), or None."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def _cmd_pack(args) -> int:
    from gpufeed.errors import UsageError
    from gpufeed.write.pack import pack

    if args.tokenize is not None:
        return _cmd_pack_tokens(args)
    token_options = [o for o, (k, default) in _TOKEN_ONLY.items() if getattr(args, k) != default]
    if token_options:
        raise UsageError(f"{', '.join(token_options)}: for token packs; give --tokenize too")
    if args.format is None:
        raise UsageError("--format (-f) is required: hdf5, lmdb, tar or mmap")
    log = (lambda m: print(m, file=sys.stderr)) if args.verbose else None
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
        quiet=args.quiet or args.json,
        part_size=args.part_size,
        log=log,
        follow_symlinks=args.follow_symlinks,
        datasets=args.datasets,
        staging_dir=args.staging_dir,
        keep_staging=args.keep_staging,
        **({"schema": dict(args.schema)} if args.schema else {}),
    )
    if args.json:
        print(json.dumps(manifest, indent=2, default=str))
    elif not args.quiet:
        skipped = manifest.get("skipped", [])
        line = f"packed {manifest['count']} samples into {args.dest} ({manifest['format']})"
        if skipped:
            line += f"; skipped {len(skipped)}: " + ", ".join(s["path"] for s in skipped[:5])
            line += " ..." if len(skipped) > 5 else ""
        # file names that are not UTF-8 (kept byte for byte) print as \x escapes
        print(line.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))
    return EXIT_OK


# the options only a token pack takes, and those it does not (flag: its attribute, default)
_TOKEN_ONLY = {
    "--vocab-size": ("vocab_size", None),
    "--eos": ("eos", None),
    "--text-field": ("text_field", "text"),
    "--batched": ("batched", False),
}
_NOT_FOR_TOKENS = {
    "--encode": ("encode", "keep"),
    "--resize": ("resize", None),
    "--container": ("container", "npy"),
    "--follow-symlinks": ("follow_symlinks", False),
    "--schema": ("schema", None),
    "--datasets": ("datasets", None),
    "--staging-dir": ("staging_dir", None),
    "--keep-staging": ("keep_staging", False),
}


def _cmd_pack_tokens(args) -> int:
    from gpufeed.errors import UsageError
    from gpufeed.write.token_pack import pack_tokens

    given = [o for o, (k, default) in _NOT_FOR_TOKENS.items() if getattr(args, k) != default]
    if given:
        raise UsageError(f"{', '.join(given)}: not for token packs (--tokenize); leave them out")
    manifest = pack_tokens(
        args.source,
        args.dest,
        args.format or "mmap",
        tokenize=args.tokenize,
        vocab_size=args.vocab_size,
        eos=args.eos,
        text_field=args.text_field,
        batched=args.batched,
        workers=args.workers,
        on_error=args.on_error,
        resume=args.resume,
        overwrite=args.overwrite,
        quiet=args.quiet or args.json,
        compression=args.compression,
        shard_size=args.shard_size,
        shard_bytes=args.shard_bytes,
        part_size=args.part_size,
    )
    if args.json:
        print(json.dumps(manifest, indent=2, default=str))
    elif not args.quiet:
        tokens = manifest["tokens"]
        eos = "" if tokens["eos"] is None else f", eos {tokens['eos']} after each"
        print(
            f"packed {manifest['count']} documents into {args.dest} ({manifest['format']}, "
            f"{tokens['dtype']} ids{eos})"
        )
    return EXIT_OK


def _cmd_verify(args) -> int:
    from gpufeed.tools.verify import verify

    report = verify(
        args.dest,
        decode=args.decode,
        quiet=args.quiet or args.json,
        **cliargs.cache_options(args),
        **_in_place_options(args),
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        for problem in report.problems:
            print(problem)
        if report.problems_total > len(report.problems):
            print(f"... and {report.problems_total - len(report.problems)} more")
        print(report.summary())
    return EXIT_OK if report.ok else EXIT_DATA


def _cmd_merge(args) -> int:
    from gpufeed.write.merge import merge

    manifest = merge(args.parts, args.dest, overwrite=args.overwrite, **cliargs.cache_options(args))
    if args.json:
        print(json.dumps(manifest, indent=2, default=str))
    elif not args.quiet:
        print(
            f"merged {len(args.parts)} parts ({manifest['count']} samples, "
            f"{manifest['format']}) into {args.dest}"
        )
    return EXIT_OK


def _cmd_inspect(args) -> int:
    from gpufeed.tools.verify import inspect

    info = inspect(args.dest, **cliargs.cache_options(args), **_in_place_options(args))
    if args.json:
        print(json.dumps(info, indent=2))
        return EXIT_OK
    if args.quiet:  # the exit status says it is a readable pack (or data read in place)
        return EXIT_OK
    rows = _inspect_rows(info) + (_in_place_rows(info) if info["in_place"] else _pack_rows(info))
    for key, value in rows:
        print(f"{key + ':':<12} {value}")
    if len(info.get("image_sizes", [])) > 1:  # the load-time error's words, said before it
        from gpufeed.batch import mixed_sizes_message

        print(mixed_sizes_message(info["image_sizes"], info["path"]))
    return EXIT_OK


def _inspect_rows(info) -> list[tuple[str, object]]:
    """inspect's rows for a pack and for data read in place alike."""
    from gpufeed.system.sizes import format_size

    s = info["sample"]
    if s["kind"] == "array":
        sample = f"{s['dtype_name']} {'x'.join(map(str, s['shape']))}"
    else:
        sample = s["text"] if s["kind"] == "fields" else "encoded"
    classes = info["classes"]
    if classes is not None:
        shown = ", ".join(classes[:10]) + (", ..." if len(classes) > 10 else "")
        class_text = f"{len(classes)} ({shown})"
    elif info["in_place"]:
        class_text = f"none (labels from {info['labels']})" if info["labels"] else "none (-1)"
    else:
        class_text = "none (labels from the source or -1)"
    if info["in_place"]:
        what = f"{info['kind']}, read in place (no manifest)"
    else:
        what = f"{info['format']} (format_version {info['format_version']})"
    return [
        ("path", info["path"]),
        ("format", what),
        ("samples", info["count"]),
        ("classes", class_text),
        ("sample", sample),
        ("size", f"{format_size(info['size_bytes'])} ({format_size(info['disk_bytes'])} on disk)"),
    ]


def _pack_rows(info) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    if "shards" in info:
        rows.append(("shards", f"{info['shards']}: {info['pattern']}"))
    if info.get("compression"):
        rows.append(("compression", info["compression"]))
    tokens = info.get("tokens")
    if tokens:  # a token pack (pack_tokens): read as windows with open_dataset(block_size=)
        keys = ("field", "dtype", "vocab_size", "eos", "tokenizer")
        rows.append(("tokens", ", ".join(f"{k}={tokens.get(k)}" for k in keys)))
    inferred = (info.get("options") or {}).get("inferred_fields")
    if inferred:  # a Writer's fields taken from its first sample, not declared
        rows.append(("inferred", ", ".join(inferred)))
    rows.append(("skipped", info["skipped"]))
    rows.append(("created by", info["created_by"]))
    return rows


# inspect's words for the state of an in-place index (gpufeed.tools.in_place)
INDEX_STATUS = {
    "cached": "cached",
    "built": "built now, and cached",
    "rebuilt": "built anew: the data changed since it was indexed",
    "not saved": "not saved: its folder cannot be written (built on every open)",
}


def _in_place_rows(info) -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = [("shards" if "shards" in info else "files", info["files"])]
    if info.get("dropped"):
        rows.append(("dropped", "not in every sample: " + ", ".join(info["dropped"])))
    if info.get("datasets"):
        rows.append(("datasets", ", ".join(f"{k}={v}" for k, v in info["datasets"].items())))
    index = info["index"]
    if index is None:
        rows.append(("index", "none (the file's own layout is read)"))
    else:
        rows.append(("index", f"{index['path']} ({INDEX_STATUS[index['status']]})"))
    rows.append(("verify", f"{', '.join(info['checks'])}; no checksums (it has none)"))
    return rows


def _handler(command: str):
    own = {"pack": _cmd_pack, "verify": _cmd_verify, "inspect": _cmd_inspect, "merge": _cmd_merge}
    if command in own:
        return own[command]
    return importlib.import_module(_TOOLS[command]).main


def _run(args) -> int:
    from gpufeed.errors import GpufeedError

    debug = args.verbose or os.environ.get("GPUFEED_DEBUG", "") not in ("", "0")
    try:
        return _handler(args.command)(args)
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
    except BrokenPipeError:
        raise
    except (OSError, ValueError, RuntimeError) as e:
        if debug:
            raise
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        print(f"gpufeed {args.command}: error: {where}{type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_DATA


def main(argv: list[str] | None = None) -> int:
    """Run the ``gpufeed`` command.

    Args:
        argv: the arguments after the program name (None: ``sys.argv[1:]``).

    Returns:
        The exit code (see the module docstring): 0 ok, 1 data problem, 2 usage error, 130
        interrupted, 141 the output's reader went away.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(commands=(command_in(argv),))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_OK
    try:
        code = _run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly, as tools killed by SIGPIPE do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE


if __name__ == "__main__":
    sys.exit(main())
