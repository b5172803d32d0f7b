"""The `gpufeed` command: pack/verify/inspect, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from gpufeed import __version__
from gpufeed.cli import main, parse_bytes


def run_cli(args, env, **kw):
    return subprocess.run(
        [sys.executable, "-m", "gpufeed.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        **kw,
    )


def test_version(python_env):
    r = run_cli(["--version"], python_env)
    assert r.returncode == 0 and r.stdout.strip() == f"gpufeed {__version__}"


@pytest.mark.slow
def test_pack_verify_inspect(array_folder, tmp_path, capsys):
    dest = tmp_path / "d"
    assert main(["pack", str(array_folder), str(dest), "-f", "hdf5", "-j", "1", "-q"]) == 0
    assert main(["verify", str(dest), "-q"]) == 0
    assert "OK (hdf5, 17 samples" in capsys.readouterr().out
    assert main(["inspect", str(dest), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["format"] == "hdf5" and info["count"] == 17
    assert info["classes"] == ["x", "y"] and info["sample"]["shape"] == [3, 4, 5]
    assert info["size_bytes"] > 17 * 60
    assert main(["inspect", str(dest)]) == 0
    text = capsys.readouterr().out
    assert "samples:     17" in text and "uint8 3x4x5" in text and "2 (x, y)" in text


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_verify_reports_flipped_byte_with_sample_and_source(tmp_path, make_arrays, capsys, fmt):
    make_arrays(tmp_path / "src", {"c0": 5, "c1": 5}, shape=(48,), seed=2)
    dest = tmp_path / "d"
    assert main(["pack", str(tmp_path / "src"), str(dest), "-f", fmt, "-j", "1", "-q"]) == 0
    target = np.load(tmp_path / "src" / "c1" / "a00002.npy").tobytes()  # sample 7
    flipped = 0
    for f in dest.iterdir():
        data = bytearray(f.read_bytes())
        pos = data.find(target)
        while pos >= 0:
            data[pos + 10] ^= 1
            flipped += 1
            pos = data.find(target, pos + 1)
        f.write_bytes(bytes(data))
    assert flipped
    assert main(["verify", str(dest), "-q"]) == 1
    out = capsys.readouterr().out
    assert "sha256" in out
    assert "sample 7 (source c1/a00002.npy): crc32 mismatch" in out
    assert "FAILED" in out
    assert main(["verify", str(dest), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert [p["index"] for p in report["problems"] if p["index"] is not None] == [7]


@pytest.mark.slow
def test_exit_codes_and_one_line_errors(tmp_path, python_env, make_images):
    r = run_cli(["pack", str(tmp_path), str(tmp_path / "o")], python_env)
    assert r.returncode == 2 and "--format" in r.stderr  # argparse usage error
    r = run_cli(["verify", str(tmp_path / "missing")], python_env)
    assert r.returncode == 2  # a path that is not there is a usage error, named
    assert r.stderr.strip().splitlines()[-1] == (
        f"gpufeed verify: error: argument DEST: {tmp_path / 'missing'}: no such file or directory"
    )
    files = make_images(tmp_path / "src", {"a": 2}, ext=".jpg")
    files[0].write_bytes(b"\xff\xd8\xff garbage")
    r = run_cli(
        ["pack", str(tmp_path / "src"), str(tmp_path / "o"), "-f", "tar", "-q"],
        python_env,
    )
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(files[0]) in lines[0] and "Traceback" not in r.stderr
    r = run_cli(
        [
            "pack",
            str(tmp_path / "src"),
            str(tmp_path / "o"),
            "-f",
            "tar",
            "-q",
            "--on-error",
            "skip",
            "--resume",
        ],
        python_env,
    )
    assert r.returncode == 0, r.stderr
    r = run_cli(["pack", str(tmp_path / "src"), str(tmp_path / "o"), "-f", "tar"], python_env)
    assert r.returncode == 2 and "already exists; pass --overwrite" in r.stderr
    plain = tmp_path / "plain"
    plain.mkdir()
    r = run_cli(["verify", str(plain)], python_env)  # there, but not a pack: a data problem
    assert r.returncode == 1 and "Traceback" not in r.stderr and str(plain) in r.stderr
    debug = run_cli(["verify", str(plain)], {**python_env, "GPUFEED_DEBUG": "1"})
    assert debug.returncode == 1 and "Traceback" in debug.stderr
    verbose = run_cli(["verify", str(plain), "-v"], python_env)
    assert verbose.returncode == 1 and "Traceback" in verbose.stderr


def test_skip_is_reported(tmp_path, capsys, make_arrays):
    paths = make_arrays(tmp_path / "src", None, count=3)
    paths[1].write_bytes(b"nope")
    args = ["pack", str(tmp_path / "src"), str(tmp_path / "o"), "-f", "mmap", "-j", "1"]
    assert main([*args, "--on-error", "skip"]) == 0
    assert "packed 2 samples" in capsys.readouterr().out
    assert json.loads((tmp_path / "o" / "manifest.json").read_text())["skipped"][0]["item"] == 1


def test_parse_bytes():
    assert parse_bytes("4096") == 4096
    assert parse_bytes("256M") == 256 << 20
    assert parse_bytes("1.5GiB") == 3 << 29
    with pytest.raises(Exception, match="not a size"):
        parse_bytes("lots")


# The modules a command imports, from a child process: its argv, then what sys.modules holds.
_IMPORTED = """
import json, runpy, sys
sys.argv = ["gpufeed", *json.loads(sys.argv[1])]
try:
    runpy.run_module("gpufeed", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def _imported(args, env):
    r = subprocess.run(
        [sys.executable, "-c", _IMPORTED, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["code"], set(out["modules"])


def test_light_commands_do_not_import_torch(python_env, tmp_path, make_arrays):
    """--version, --help, inspect and pack build only their own arguments: no tool module,
    no torch (issue 38 item 9: doctor's import of torch cost every command over a second)."""
    make_arrays(tmp_path / "src", {"a": 3}, shape=(4,))
    assert main(["pack", str(tmp_path / "src"), str(tmp_path / "p"), "-f", "tar", "-q"]) == 0
    runs = {
        "--version": ["--version"],
        "--help": ["--help"],
        "pack --help": ["pack", "--help"],
        "inspect": ["inspect", str(tmp_path / "p")],
        "pack": ["pack", str(tmp_path / "src"), str(tmp_path / "q"), "-f", "mmap", "-q"],
    }
    for what, args in runs.items():
        code, modules = _imported(args, python_env)
        assert code == 0, what
        assert "torch" not in modules, what
        assert not {m for m in modules if m.startswith("gpufeed.tools.doctor")}, what
    _, modules = _imported(["--version"], python_env)
    assert "numpy" not in modules and "gpufeed.formats" not in modules


def test_help_lists_every_command_and_each_builds_its_own(capsys):
    from gpufeed import cli

    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name, (text, _) in cli.COMMANDS.items():
        assert name in out and text.split(",")[0] in out
    assert cli.command_in(["-q", "doctor", "x"]) == "doctor"
    assert cli.command_in(["--version"]) is None and cli.command_in(["nope"]) is None
    with pytest.raises(SystemExit) as exit_:
        main(["doctor", "--help"])
    assert exit_.value.code == 0 and "--probe-seconds" in capsys.readouterr().out


def test_inspect_shows_the_class_names_a_writer_was_given(tmp_path, capsys):
    import gpufeed

    dest = tmp_path / "p"
    names = [f"c{i}" for i in range(12)]
    with gpufeed.Writer(dest, "tar", {"x": "int64[1]", "label": "int"}, classes=names) as w:
        w.write({"x": np.zeros(1, np.int64), "label": 11})
    assert main(["inspect", str(dest)]) == 0
    shown = "classes:     12 (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, ...)"
    assert shown in capsys.readouterr().out
    assert main(["inspect", str(dest), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["classes"] == names and info["num_classes"] == 12


def test_inspect_and_verify_an_image_folder_in_place(tmp_path, capsys, make_images, python_env):
    """Issue 38 item 12: what open_dataset reads in place, inspect describes and verify
    checks (read and decode every sample: there are no checksums), never refused."""
    files = make_images(tmp_path / "src", {"a": 3, "b": 2}, ext=".jpg")
    files[4].write_bytes(b"\xff\xd8\xff garbage")
    src, idx = str(tmp_path / "src"), str(tmp_path / "idx")
    assert main(["inspect", src, "--index-dir", idx]) == 0
    text = capsys.readouterr().out
    assert "format:      image folder, read in place (no manifest)" in text
    assert "samples:     5" in text and "classes:     2 (a, b)" in text
    assert "files:       5" in text and f"index:       {idx}/imagefolder-" in text
    assert "no checksums" in text
    assert main(["inspect", src, "--index-dir", idx, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["in_place"] is True and info["index"]["status"] == "cached"
    assert main(["verify", src, "--index-dir", idx]) == 1
    out = capsys.readouterr().out
    assert f"{files[4]}: sample 4: cannot decode" in out and "no checksums" in out
    assert main(["verify", src, "--index-dir", idx, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["in_place"] is True and report["checksums"] is False and report["checks"]
    assert [p["file"] for p in report["problems"]] == [str(files[4])]
    # inspect in place, like a pack's, needs no torch
    code, modules = _imported(["inspect", src, "--index-dir", idx], python_env)
    assert code == 0 and "torch" not in modules


def test_inspect_and_verify_webdataset_shards_and_an_hdf5_file_in_place(tmp_path, capsys):
    import h5py

    wds = pytest.importorskip("webdataset")
    shards = tmp_path / "shards"
    shards.mkdir()
    with wds.TarWriter(str(shards / "part-0.tar")) as sink:
        for i in range(4):
            sink.write({"__key__": f"k{i}", "cls": i, "txt": f"text {i}"})
    idx = str(tmp_path / "idx")
    pattern = str(shards / "part-{0..0}.tar")  # a brace pattern, as open_dataset takes
    assert main(["inspect", pattern, "--index-dir", idx, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["format"], info["count"], info["shards"]) == ("webdataset", 4, 1)
    assert info["sample"]["text"] == "cls: int, txt: str"
    assert main(["verify", str(shards), "--index-dir", idx]) == 0
    assert "OK (WebDataset shards read in place, 4 samples" in capsys.readouterr().out
    h5 = tmp_path / "theirs.h5"
    with h5py.File(h5, "w") as f:
        f["x"] = np.zeros((3, 2), np.float32)
        f["y"] = np.arange(3)
    assert main(["inspect", str(h5)]) == 1  # which datasets: named by --datasets
    assert "--datasets" in capsys.readouterr().err
    assert main(["inspect", str(h5), "--datasets", "x=/x,label=/y"]) == 0
    text = capsys.readouterr().out
    assert "HDF5 file, read in place" in text and "datasets:    x=/x, label=/y" in text
    assert main(["verify", str(h5), "--datasets", "/x,/y", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["samples_checked"] == 3 and report["kind"] == "HDF5 file"


def test_merge_parts_into_one_pack_and_refuse_a_differing_part(tmp_path, capsys):
    import gpufeed

    parts = []
    for k, fmt in enumerate(("tar", "tar", "mmap")):
        parts.append(tmp_path / f"part-{k}")
        with gpufeed.Writer(parts[-1], format=fmt, schema={"label": "int"}) as w:
            for i in range(3 * k, 3 * k + 3):
                w.write({"label": i})
    dest = tmp_path / "merged"
    assert main(["merge", str(parts[0]), str(parts[1]), str(dest)]) == 0
    assert f"merged 2 parts (6 samples, tar) into {dest}" in capsys.readouterr().out
    ds = gpufeed.open_dataset(dest)
    assert [int(ds[i]["label"]) for i in range(6)] == list(range(6))
    assert main(["merge", "-q", str(parts[0]), str(parts[1]), str(dest)]) == 0  # idempotent
    assert capsys.readouterr().out == ""
    assert main(["merge", str(parts[0]), str(parts[2]), str(tmp_path / "m2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"gpufeed merge: error: {parts[2]}: its format is mmap")
    assert len(err.splitlines()) == 1 and not (tmp_path / "m2").exists()


# ------------------------------------ images of different sizes (issue 38 item 3, issue 39)
@pytest.fixture(scope="module")
def mixed_jpegs(tmp_path_factory):
    """An ordinary image folder of JPEGs of two sizes."""
    from unit_sources import write_images

    root = tmp_path_factory.mktemp("mixed") / "src"
    write_images(root, {"a": 5}, size=(82, 71), ext=".jpg")
    write_images(root, {"b": 5}, size=(40, 60), ext=".jpg", seed=1)
    return root


def _says_sizes_vary(text: str, where) -> None:
    assert f"{where}: the images differ in size ([82, 71], [40, 60])" in text, text
    assert "RandomResizedCrop(224)" in text and "--encode raw --resize" in text


def test_pack_and_inspect_say_when_image_sizes_vary(mixed_jpegs, tmp_path, capsys):
    dest = tmp_path / "p"
    assert main(["pack", str(mixed_jpegs), str(dest), "-f", "tar", "-j", "1"]) == 0
    _says_sizes_vary(capsys.readouterr().err, dest)
    assert main(["inspect", str(dest)]) == 0
    _says_sizes_vary(capsys.readouterr().out, dest)
    assert main(["inspect", str(dest), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["image_sizes"] == [[82, 71], [40, 60]]
    assert main(["inspect", str(mixed_jpegs)]) == 0  # the folder read in place
    _says_sizes_vary(capsys.readouterr().out, mixed_jpegs)


def test_pack_and_inspect_say_nothing_of_sizes_that_agree(tmp_path, capsys):
    from unit_sources import write_images

    write_images(tmp_path / "src", {"a": 3, "b": 3}, size=(20, 30), ext=".jpg")
    dest = tmp_path / "p"
    assert main(["pack", str(tmp_path / "src"), str(dest), "-f", "lmdb", "-j", "1"]) == 0
    assert main(["inspect", str(dest)]) == 0
    assert "differ in size" not in str(capsys.readouterr())
    assert main(["inspect", str(dest), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["image_sizes"] == [[20, 30]]
