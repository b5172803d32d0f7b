"""The `gpufeed` command's conventions: every numeric or structured option is checked before
anything runs (a usage error, exit 2, naming the option); -q/-v/--json on every subcommand;
`python -m gpufeed`; a closed output pipe ends it quietly; progress bars count what they say."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import gpufeed
from gpufeed import cli

SUBCOMMANDS = ("pack", "verify", "inspect", "doctor", "bench", "tune", "synth")


@pytest.fixture(scope="module")
def paths(tmp_path_factory, array_folder, pack_factory):
    root = tmp_path_factory.mktemp("cliargs")
    pack = pack_factory("hdf5")
    picture = root / "x.jpg"
    picture.write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\xff\xfe" + bytes(range(256)))
    return {"SRC": str(array_folder), "PACK": str(pack), "JPG": str(picture), "ROOT": str(root)}


BAD = [
    # (arguments, the option the message must name, a word of the reason)
    (["pack", "SRC", "DEST", "-f", "hdf5", "--workers", "-5"], "--workers", "out of range"),
    (["pack", "SRC", "DEST", "-f", "hdf5", "--workers", "100000"], "--workers", "per usable CPU"),
    (["pack", "SRC", "DEST", "-f", "tar", "--shard-bytes", "inf"], "--shard-bytes", "finite"),
    (["pack", "SRC", "DEST", "-f", "tar", "--shard-bytes", "0"], "--shard-bytes", "1 B"),
    (["pack", "SRC", "DEST", "-f", "hdf5", "--compression", "gzip:abc"], "--compression", "gzip"),
    (["pack", "SRC", "DEST", "-f", "hdf5", "--compression", "gzip:12"], "--compression", "gzip"),
    (["pack", "SRC", "DEST", "-f", "hdf5", "--compression", "zstd"], "--compression", "unknown"),
    (["pack", "SRC", "DEST", "-f", "hdf5", "--resize", "100000x100000"], "--resize", "16384"),
    (["pack", "SRC", "DEST", "-f", "hdf5", "--resize", "big"], "--resize", "HEIGHTxWIDTH"),
    (["pack", "SRC", "DEST", "-f", "hdf5", "--part-size", "0"], "--part-size", "out of range"),
    (["pack", "SRC", "DEST", "-f", "tar", "--shard-size", "x"], "--shard-size", "not an integer"),
    (["pack", "ROOT/none", "DEST", "-f", "hdf5"], "SOURCE", "no such file"),
    (["doctor", "--batch-mb", "1e308"], "--batch-mb", "at most"),
    (["doctor", "--batch-mb", "nan"], "--batch-mb", "finite"),
    (["doctor", "--batch-mb", "0"], "--batch-mb", "above 0"),
    (["doctor", "--workers", "100000"], "--workers", "out of range"),
    (["doctor", "--probe-seconds", "-1"], "--probe-seconds", "more than 0"),
    (["bench", "PACK", "--prefetch-factor", "0", "--workers", "1"], "--prefetch-factor", "range"),
    (["bench", "PACK", "--epochs", "0"], "--epochs", "out of range"),
    (["bench", "PACK", "--seconds", "nan"], "--seconds", "finite"),
    (["bench", "PACK", "--seconds", "-3"], "--seconds", "at least 0"),
    (["bench", "PACK", "--device", "bogus"], "--device", "cpu, cuda or cuda:N"),
    (["bench", "PACK", "--batch-size", "0"], "--batch-size", "out of range"),
    (["bench", "PACK", "--workers", "100000"], "--workers", "out of range"),
    (["bench", "PACK", "--workers", "many"], "--workers", "not an integer"),
    (["bench", "PACK", "--step-ms", "inf"], "--step-ms", "finite"),
    (["bench", "PACK", "--settings", "JPG"], "--settings", "x.jpg is not valid JSON"),
    (["bench", "PACK", "--settings", "ROOT/none.json"], "--settings", "does not exist"),
    (["bench", "PACK", "--crop", "0"], "--crop", "out of range"),
    (["bench", "ROOT/none"], "PATH", "no such file"),
    (["tune", "PACK", "--batch-sizes", "a,b"], "--batch-sizes", "not an integer"),
    (["tune", "PACK", "--batch-sizes", "0"], "--batch-sizes", "out of range"),
    (["tune", "PACK", "--batch-sizes", ","], "--batch-sizes", "expected batch sizes"),
    (["tune", "PACK", "--budget", "inf"], "--budget", "finite"),
    (["tune", "PACK", "--device", "gpu"], "--device", "cpu, cuda or cuda:N"),
    (["synth", "ROOT/s", "--count", "0"], "--count", "out of range"),
    (["synth", "ROOT/s", "--size", "100000"], "--size", "out of range"),
    (["synth", "ROOT/s", "--workers", "100000"], "--workers", "out of range"),
    (["inspect", "ROOT/none"], "DEST", "no such file"),
    (["verify", "ROOT/none"], "DEST", "no such file"),
    (["inspect", "PACK", "-q", "-v"], "--verbose/-v", "not allowed with"),
]


def fill(args, paths):
    out = []
    for a in args:
        for key in ("ROOT", "SRC", "PACK", "JPG"):
            if a == key or a.startswith(key + "/"):
                a = paths[key] + a[len(key) :]
        out.append(a.replace("DEST", paths["ROOT"] + "/out"))
    return out


@pytest.mark.parametrize(("args", "option", "reason"), BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_values_are_usage_errors_naming_the_option(paths, capsys, args, option, reason):
    with pytest.raises(SystemExit) as exit_:
        cli.main(fill(args, paths))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"gpufeed {args[0]}: error: argument {option}"), err
    assert reason in last, err
    assert "Traceback" not in err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_takes_quiet_verbose_and_json(paths, command):
    parser = cli.build_parser()
    base = {
        "pack": ["pack", paths["SRC"], "d", "-f", "hdf5"],
        "synth": ["synth", "d"],
        "doctor": ["doctor"],
    }.get(command, [command, paths["PACK"]])
    for flags, want in ((["-q"], (True, False)), (["--verbose"], (False, True)), ([], (0, 0))):
        args = parser.parse_args([*base, *flags, "--json"])
        assert (args.quiet, args.verbose) == want and args.json is True


def test_pack_and_synth_print_json(paths, tmp_path, capsys):
    dest = tmp_path / "p"
    assert cli.main(["pack", paths["SRC"], str(dest), "-f", "mmap", "-j", "0", "--json"]) == 0
    manifest = json.loads(capsys.readouterr().out)
    assert manifest["format"] == "mmap" and manifest["count"] == 17
    assert cli.main(["synth", str(tmp_path / "s"), "-n", "4", "--size", "16", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["count"] == 4 and info["path"] == str(tmp_path / "s")
    assert cli.main(["inspect", str(dest), "-q"]) == 0 and capsys.readouterr().out == ""


def test_python_dash_m_gpufeed(python_env, paths):
    r = subprocess.run(
        [sys.executable, "-m", "gpufeed", "inspect", paths["PACK"], "--json"],
        capture_output=True,
        text=True,
        env=python_env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "hdf5"


def test_a_closed_output_pipe_ends_quietly(python_env, paths):
    """`gpufeed inspect --json | head`: the reader leaves early; no BrokenPipeError."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufeed", "inspect", paths["PACK"], "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=python_env,
    )
    proc.stdout.close()  # as `head` does when it has read enough
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == cli.EXIT_PIPE
    assert err == ""


def test_progress_bars_count_what_they_say(paths, tmp_path, monkeypatch):
    from gpufeed.write import progress

    bars = []
    real = progress.progress_bar

    def spy(total, initial, quiet, desc, unit="sample"):
        bars.append((desc, unit, total))
        return real(total, initial, True, desc, unit)

    monkeypatch.setattr(progress, "progress_bar", spy)
    gpufeed.pack(paths["SRC"], tmp_path / "l", format="lmdb", workers=1, part_size=5)
    # LMDB is written as its parts are committed (gpufeed.write.assemble.Stream): one bar
    assert bars == [("pack", "sample", 17)]
    gpufeed.pack(paths["SRC"], tmp_path / "h", format="hdf5", workers=1, part_size=5)
    assert bars == [("pack", "sample", 17)] * 2  # uncompressed HDF5 is streamed too
    gpufeed.pack(
        paths["SRC"], tmp_path / "z", format="hdf5", compression="lzf", workers=1, part_size=5
    )
    assert ("write hdf5", "part", 4) in bars  # 17 samples in parts of 5, assembled after them
