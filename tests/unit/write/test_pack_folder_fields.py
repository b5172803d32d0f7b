"""gpufeed.pack of folders and list files whose samples are not one image or one array:
.txt, .wav, .pt dicts and list files with number targets become multi-field packs."""

from __future__ import annotations

import json
import os
import struct
import wave

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.cli import main
from gpufeed.errors import NotPackedError, SourceError, UsageError


def _text_tree(root, classes=("neg", "pos"), n=3) -> dict[str, tuple[str, int]]:
    """Class folders of .txt files; rel path -> (text, label)."""
    want = {}
    for label, cls in enumerate(classes):
        (root / cls).mkdir(parents=True)
        for i in range(n):
            text = f"{cls} review {i}: naïve café ☕\nsecond line"
            (root / cls / f"{i}.txt").write_text(text, encoding="utf-8")
            want[f"{cls}/{i}.txt"] = (text, label)
    return want


def _write_wav(path, samples: np.ndarray, rate: int = 16000, width: int | None = None) -> None:
    """samples [frames, channels]; width: bytes a sample (default: the dtype's)."""
    width = width or samples.dtype.itemsize
    raw = samples.astype(samples.dtype.newbyteorder("<")).tobytes()
    if width == 3:  # the low three bytes of each int32
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in samples.ravel())
    with wave.open(str(path), "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(raw)


def _samples(dest) -> list[dict]:
    ds = gpufeed.open_dataset(dest)
    return [ds[i] for i in range(len(ds))]


def _sources(dest) -> list[str]:
    return (dest / "sources.txt").read_text().splitlines()


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar", "mmap"])
def test_text_class_folders_round_trip(tmp_path, fmt):
    want = _text_tree(tmp_path / "src")
    dest = tmp_path / "out"
    m = gpufeed.pack(tmp_path / "src", dest, format=fmt, workers=1, quiet=True)
    assert m["count"] == 6 and m["classes"] == ["neg", "pos"] and m["skipped"] == []
    text, label = {"name": "text", "type": "str"}, {"name": "label", "type": "int"}
    assert m["sample"]["fields"] == [text, label]
    assert m["source"]["kind"] == "text" and m["source"]["path"] == str(tmp_path / "src")
    assert _sources(dest) == list(want)
    got = _samples(dest)
    assert got == [{"text": t, "label": lab} for t, lab in want.values()]


def test_text_flat_folder_has_no_label_field(tmp_path):
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"{i}.txt").write_text(f"t{i}")
    m = gpufeed.pack(tmp_path / "src", tmp_path / "out", format="lmdb", workers=1, quiet=True)
    assert [f["name"] for f in m["sample"]["fields"]] == ["text"] and m["classes"] is None
    assert _samples(tmp_path / "out") == [{"text": f"t{i}"} for i in range(3)]


@pytest.mark.parametrize(
    ("dtype", "width"), [("<i2", None), ("|u1", None), ("<i4", None), ("<i4", 3)]
)
def test_wav_files_of_other_lengths_and_channels_round_trip(tmp_path, dtype, width):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    top = (1 << 23) if width == 3 else info.max
    bottom = -(1 << 23) if width == 3 else info.min
    want = []
    for cls, (frames, channels) in zip("ab", [(100, 1), (37, 2)], strict=True):
        (tmp_path / "src" / cls).mkdir(parents=True)
        for i in range(2):
            audio = rng.integers(bottom, top, (frames + i, channels)).astype(dtype)
            _write_wav(tmp_path / "src" / cls / f"{i}.wav", audio, 8000 + i, width)
            want.append((audio, 8000 + i, "ab".index(cls)))
    m = gpufeed.pack(tmp_path / "src", tmp_path / "out", format="hdf5", workers=1, quiet=True)
    audio_field = m["sample"]["fields"][0]
    assert audio_field == {"name": "audio", "type": "ragged", "dtype": dtype, "shape": [-1, -1]}
    got = _samples(tmp_path / "out")
    for (audio, rate, label), sample in zip(want, got, strict=True):
        arr = np.asarray(sample["audio"])
        assert arr.dtype == np.dtype(dtype) and arr.shape == audio.shape
        np.testing.assert_array_equal(arr, audio)
        assert sample["sample_rate"] == rate and sample["label"] == label


def _float_wav(path) -> None:
    """An IEEE float WAV (format 3), which the wave module does not read."""
    data = np.zeros(10, "<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, 8000, 32000, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def test_wav_it_cannot_read_is_that_files_error(tmp_path):
    (tmp_path / "src").mkdir()
    _write_wav(tmp_path / "src" / "a.wav", np.zeros((5, 1), "<i2"))
    _float_wav(tmp_path / "src" / "b.wav")
    _write_wav(tmp_path / "src" / "c.wav", np.ones((7, 1), "|u1"))
    with pytest.raises(SourceError, match=r"b\.wav.*not a WAV file gpufeed reads.*PCM"):
        gpufeed.pack(tmp_path / "src", tmp_path / "out", format="tar", workers=1, quiet=True)
    m = gpufeed.pack(
        tmp_path / "src", tmp_path / "out", format="tar", workers=1, quiet=True,
        on_error="skip", overwrite=True,
    )  # fmt: skip
    assert m["count"] == 1
    assert [(s["item"], s["path"]) for s in m["skipped"]] == [(1, "b.wav"), (2, "c.wav")]
    assert "uint8 samples; this pack's audio is int16" in m["skipped"][1]["error"]


def test_pt_dicts_become_fields(tmp_path):
    want = []
    for cls in ("x", "y"):
        (tmp_path / "src" / cls).mkdir(parents=True)
        for i in range(3):
            d = {
                "feat": torch.arange(6, dtype=torch.float32).reshape(2, 3) + i,
                "mask": np.array([i, 1, 0], dtype=np.uint8),
                "n": i,
                "score": i / 3,
                "name": f"{cls}{i}",
                "raw": bytes([i, 255]),
            }
            torch.save(d, tmp_path / "src" / cls / f"{i}.pt")
            want.append((d, "xy".index(cls)))
    m = gpufeed.pack(tmp_path / "src", tmp_path / "out", format="lmdb", workers=2, quiet=True)
    kinds = {f["name"]: f["type"] for f in m["sample"]["fields"]}
    assert kinds == {
        "feat": "array", "mask": "array", "n": "int", "score": "float", "name": "str",
        "raw": "bytes", "label": "int",
    }  # fmt: skip
    for (d, label), s in zip(want, _samples(tmp_path / "out"), strict=True):
        assert torch.equal(torch.as_tensor(s["feat"]), d["feat"])
        np.testing.assert_array_equal(np.asarray(s["mask"]), d["mask"])
        for key in ("n", "score", "name", "raw"):
            assert s[key] == d[key]
        assert s["label"] == label


def test_pt_dict_array_whose_shape_varies_says_how_to_declare_it(tmp_path):
    (tmp_path / "src").mkdir()
    for i in range(3):
        torch.save({"tokens": torch.arange(4 + i), "y": i}, tmp_path / "src" / f"{i}.pt")
    with pytest.raises(SourceError, match=r"1\.pt.*field 'tokens': shape \[5\].*int64\[-1\]"):
        gpufeed.pack(tmp_path / "src", tmp_path / "out", format="tar", workers=1, quiet=True)
    m = gpufeed.pack(
        tmp_path / "src", tmp_path / "out", format="tar", workers=1, quiet=True,
        overwrite=True, schema={"tokens": "int64[-1]"},
    )  # fmt: skip
    assert m["sample"]["fields"][0]["type"] == "ragged"
    got = _samples(tmp_path / "out")
    assert [torch.as_tensor(s["tokens"]).tolist() for s in got] == [
        list(range(4 + i)) for i in range(3)
    ]
    with pytest.raises(UsageError, match="'nope' is not a field of these samples"):
        gpufeed.pack(tmp_path / "src", tmp_path / "o2", format="tar", schema={"nope": "int"})


def test_pt_of_the_other_kind_is_that_files_error(tmp_path):
    (tmp_path / "src").mkdir()
    torch.save({"x": torch.zeros(2)}, tmp_path / "src" / "0.pt")
    torch.save(torch.zeros(2), tmp_path / "src" / "1.pt")
    with pytest.raises(SourceError, match=r"1\.pt.*holds a Tensor, expected a dict of fields"):
        gpufeed.pack(tmp_path / "src", tmp_path / "out", format="tar", workers=1, quiet=True)
    (tmp_path / "tensors").mkdir()
    torch.save(torch.zeros(2), tmp_path / "tensors" / "0.pt")
    torch.save({"x": torch.zeros(2)}, tmp_path / "tensors" / "1.pt")
    with pytest.raises(SourceError, match=r"1\.pt.*holds a dict, expected one tensor"):
        gpufeed.pack(tmp_path / "tensors", tmp_path / "o2", format="tar", workers=1, quiet=True)


def test_one_tensor_pt_folder_stays_the_classic_array_pack(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    torch.save(torch.ones(2, 3), tmp_path / "src" / "a" / "0.pt")
    m = gpufeed.pack(tmp_path / "src", tmp_path / "out", format="hdf5", workers=1, quiet=True)
    assert m["sample"]["kind"] == "array" and m["source"]["kind"] == "arrays"


def test_list_file_with_number_targets(tmp_path, make_arrays, make_images):
    make_arrays(tmp_path / "npy", None, count=3, shape=(2, 2), dtype=np.float32, ext=".npy")
    targets = ["0.5", "3", "-1e-3"]
    names = sorted(p.name for p in (tmp_path / "npy").iterdir())
    lines = [f"npy/{n} {t}" for n, t in zip(names, targets, strict=True)]
    (tmp_path / "list.txt").write_text("\n".join(lines) + "\n")
    dest = tmp_path / "out"
    m = gpufeed.pack(tmp_path / "list.txt", dest, format="hdf5", workers=1, quiet=True)
    assert [f["name"] for f in m["sample"]["fields"]] == ["x", "target"]
    got = _samples(dest)
    assert [s["target"] for s in got] == [0.5, 3.0, -1e-3]
    for name, s in zip(names, got, strict=True):
        np.testing.assert_array_equal(np.asarray(s["x"]), np.load(tmp_path / "npy" / name))
    assert _sources(dest) == [f"npy/{n}" for n in names]

    paths = make_images(tmp_path / "img", {"a": 2}, ext=".jpg")
    (tmp_path / "img.txt").write_text("".join(f"{p} {i / 7}\n" for i, p in enumerate(paths)))
    m = gpufeed.pack(tmp_path / "img.txt", tmp_path / "o2", format="tar", workers=1, quiet=True)
    assert m["sample"]["fields"][0] == {"name": "image", "type": "image", "format": "jpeg"}
    ds = gpufeed.open_dataset(tmp_path / "o2")
    assert [ds[i]["target"] for i in range(2)] == [0 / 7, 1 / 7]


def test_list_file_number_target_missing_on_a_line_is_refused(tmp_path):
    (tmp_path / "l.txt").write_text("a.npy 0.5\nb.npy\n")
    with pytest.raises(UsageError, match=r"l\.txt:2: has no label"):
        gpufeed.pack(tmp_path / "l.txt", tmp_path / "out", format="tar")
    (tmp_path / "l.txt").write_text("a.npy zero\n")
    with pytest.raises(UsageError, match=r"l\.txt:1: expected `path label` \(an integer"):
        gpufeed.pack(tmp_path / "l.txt", tmp_path / "out", format="tar")


def test_folder_mixing_kinds_is_refused_naming_a_file_of_each(tmp_path, make_images):
    make_images(tmp_path / "src", {"a": 1}, ext=".jpg")
    (tmp_path / "src" / "b").mkdir()
    _write_wav(tmp_path / "src" / "b" / "clip.wav", np.zeros((4, 1), np.int16))
    with pytest.raises(UsageError, match=r"mixes kinds of files: images \(.*\.jpg\) and audio "
                       r"\(b/clip\.wav\); pack each kind separately"):  # fmt: skip
        gpufeed.pack(tmp_path / "src", tmp_path / "out", format="tar")
    paths = make_images(tmp_path / "img", {"a": 1}, ext=".jpg")
    (tmp_path / "note.txt").write_text("hi")
    (tmp_path / "list.txt").write_text(f"{paths[0]} 0\n{tmp_path / 'note.txt'} 1\n")
    with pytest.raises(UsageError, match=r"mixes kinds of files: images .* and text"):
        gpufeed.pack(tmp_path / "list.txt", tmp_path / "out", format="tar")


def test_txt_notes_in_an_image_folder_stay_notes_as_before(tmp_path, make_images):
    make_images(tmp_path / "src", {"a": 2, "b": 3}, ext=".jpg")
    (tmp_path / "src" / "a" / "labels.txt").write_text("a note, not a sample")
    (tmp_path / "src" / "meta").mkdir()
    (tmp_path / "src" / "meta" / "README.txt").write_text("a folder of notes is no class")
    (tmp_path / "src" / "README.txt").write_text("top-level note")
    manifest = gpufeed.pack(tmp_path / "src", tmp_path / "out", format="lmdb")
    assert manifest["count"] == 5 and manifest["classes"] == ["a", "b"]
    assert gpufeed.open_dataset(tmp_path / "src", index_dir=tmp_path / "idx").labels.tolist() == [
        0,
        0,
        1,
        1,
        1,
    ]


def test_non_utf8_text_stops_naming_it_or_is_skipped(tmp_path):
    want = _text_tree(tmp_path / "src")
    (tmp_path / "src" / "neg" / "1.txt").write_bytes(b"caf\xe9 latin-1")
    dest = tmp_path / "out"
    with pytest.raises(SourceError, match=r"neg/1\.txt.*not UTF-8 text"):
        gpufeed.pack(tmp_path / "src", dest, format="lmdb", workers=1, quiet=True)
    assert not dest.exists()
    m = gpufeed.pack(
        tmp_path / "src", dest, format="lmdb", workers=2, quiet=True, on_error="skip",
        overwrite=True,
    )  # fmt: skip
    assert m["count"] == 5
    [skip] = m["skipped"]
    assert (skip["item"], skip["path"]) == (1, "neg/1.txt") and "not UTF-8" in skip["error"]
    del want["neg/1.txt"]
    assert _sources(dest) == list(want)
    assert _samples(dest) == [{"text": t, "label": lab} for t, lab in want.values()]


def test_scan_problems_stop_the_pack_or_are_listed(tmp_path):
    _text_tree(tmp_path / "src")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "z.txt").write_text("z")
    os.symlink(tmp_path / "elsewhere", tmp_path / "src" / "zlink")
    with pytest.raises(SourceError, match=r"zlink: symbolic link to a folder: not followed"):
        gpufeed.pack(tmp_path / "src", tmp_path / "out", format="tar", workers=1, quiet=True)
    m = gpufeed.pack(
        tmp_path / "src", tmp_path / "out", format="tar", workers=1, quiet=True, on_error="skip"
    )
    assert m["classes"] == ["neg", "pos", "zlink"] and m["count"] == 6
    assert [(s["item"], s["path"]) for s in m["skipped"]] == [(None, "zlink")]


def test_resume_after_an_interrupted_pack_gives_the_same_samples(tmp_path, monkeypatch):
    _text_tree(tmp_path / "src", n=4)
    clean = gpufeed.pack(tmp_path / "src", tmp_path / "clean", format="tar", quiet=True)
    good = (tmp_path / "src" / "pos" / "2.txt").read_bytes()
    (tmp_path / "src" / "pos" / "2.txt").write_bytes(b"\xff")
    dest = tmp_path / "out"
    with pytest.raises(SourceError, match=r"pos/2\.txt.*resume=True"):
        gpufeed.pack(tmp_path / "src", dest, format="tar", workers=1, quiet=True, part_size=2)
    assert (tmp_path / "out.partial" / "parts" / "part-000002.npz").exists()
    with pytest.raises(NotPackedError, match=rf"gpufeed pack {tmp_path / 'src'} {dest} --resume"):
        gpufeed.open_dataset(dest)
    (tmp_path / "src" / "pos" / "2.txt").write_bytes(good)  # fixed: same size, another mtime
    from gpufeed.write import fields

    read = []
    real = fields.FileSamples.__call__
    monkeypatch.setattr(fields.FileSamples, "__call__", lambda s, i: read.append(i) or real(s, i))
    m = gpufeed.pack(
        tmp_path / "src", dest, format="tar", workers=1, quiet=True, part_size=2, resume=True
    )
    assert read == [0, 6, 7]  # the first file (read for the schema), then after the kept parts
    assert m["count"] == 8 and _samples(dest) == _samples(tmp_path / "clean")
    assert _sources(dest) == _sources(tmp_path / "clean")
    assert m["sample"] == clean["sample"] and m["source"] == clean["source"]
    again = gpufeed.pack(tmp_path / "src", dest, format="tar", quiet=True, resume=True)
    assert again == m  # finished by the earlier run


def test_a_file_changed_before_the_resume_is_read_again_never_kept_stale(tmp_path, monkeypatch):
    _text_tree(tmp_path / "src", n=4)
    (tmp_path / "src" / "pos" / "2.txt").write_bytes(b"\xff")  # stops the pack at item 6
    dest = tmp_path / "out"
    with pytest.raises(SourceError):
        gpufeed.pack(tmp_path / "src", dest, format="lmdb", workers=1, quiet=True, part_size=2)
    (tmp_path / "src" / "pos" / "2.txt").write_text("fixed")
    (tmp_path / "src" / "neg" / "3.txt").write_text("edited after it was packed")  # part 1
    from gpufeed.write import fields

    read = []
    real = fields.FileSamples.__call__
    monkeypatch.setattr(fields.FileSamples, "__call__", lambda s, i: read.append(i) or real(s, i))
    gpufeed.pack(
        tmp_path / "src", dest, format="lmdb", workers=1, quiet=True, part_size=2, resume=True
    )
    assert read == [0, 2, 3, 4, 5, 6, 7]  # part 0 kept; part 1 (item 3 changed) and on read again
    texts = [s["text"] for s in _samples(dest)]
    assert texts[3] == "edited after it was packed" and texts[6] == "fixed"


def test_a_text_rewritten_with_its_size_and_mtime_put_back_is_read_again(tmp_path, capsys):
    """Issue 37 item 8: only the file's ctime tells it changed; the resume says what it kept
    and what it reads again."""
    _text_tree(tmp_path / "src", n=4)
    (tmp_path / "src" / "pos" / "2.txt").write_bytes(b"\xff")  # stops the pack at item 6
    dest = tmp_path / "out"
    with pytest.raises(SourceError):
        gpufeed.pack(tmp_path / "src", dest, format="tar", workers=1, quiet=True, part_size=2)
    (tmp_path / "src" / "pos" / "2.txt").write_text("fixed")
    edited = tmp_path / "src" / "neg" / "3.txt"  # in part 1, committed already
    st = os.stat(edited)
    edited.write_bytes(edited.read_bytes().upper())  # the same size
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    capsys.readouterr()
    gpufeed.pack(tmp_path / "src", dest, format="tar", workers=1, part_size=2, resume=True)
    err = capsys.readouterr().err
    texts = [s["text"] for s in _samples(dest)]
    assert texts[3] == "NEG REVIEW 3: NAïVE CAFé ☕\nSECOND LINE" and texts[6] == "fixed"
    assert "3.txt: changed since it was read; reading part-000001.npz again" in err, err
    assert "resuming: 1 part(s) kept (2 samples of 2 inputs" in err, err


def test_resume_with_another_listing_is_refused(tmp_path):
    _text_tree(tmp_path / "src")
    (tmp_path / "src" / "pos" / "1.txt").write_bytes(b"\xff")
    dest = tmp_path / "out"
    with pytest.raises(SourceError):
        gpufeed.pack(tmp_path / "src", dest, format="hdf5", workers=1, quiet=True, part_size=1)
    (tmp_path / "src" / "pos" / "9.txt").write_text("new")
    with pytest.raises(UsageError, match="was started with different settings"):
        gpufeed.pack(tmp_path / "src", dest, format="hdf5", quiet=True, resume=True)


def test_dataloader_over_a_text_pack(tmp_path):
    _text_tree(tmp_path / "src", n=5)
    gpufeed.pack(tmp_path / "src", tmp_path / "out", format="lmdb", workers=1, quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "out")
    loader = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    texts, labels = [], []
    for batch in loader:
        assert isinstance(batch["text"], list) and isinstance(batch["label"], torch.Tensor)
        texts += batch["text"]
        labels += batch["label"].tolist()
    assert len(texts) == 10
    assert sorted(zip(texts, labels, strict=True)) == sorted(
        (ds[i]["text"], ds[i]["label"]) for i in range(10)
    )


def test_encode_raw_is_refused_for_fields(tmp_path):
    _text_tree(tmp_path / "src")
    with pytest.raises(UsageError, match="--encode raw and --resize apply to"):
        gpufeed.pack(tmp_path / "src", tmp_path / "out", format="tar", encode="raw")


def test_schema_on_a_classic_pack_is_refused(array_folder, tmp_path):
    with pytest.raises(UsageError, match="applies to sources packed as multi-field"):
        gpufeed.pack(array_folder, tmp_path / "out", format="tar", schema={"x": "int"})


def test_cli_packs_a_wav_folder_and_inspect_shows_its_fields(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    for i in range(3):
        _write_wav(tmp_path / "src" / f"{i}.wav", np.full((10 + i, 2), i, "<i2"), 22050)
    dest = tmp_path / "out"
    assert main(["pack", str(tmp_path / "src"), str(dest), "-f", "tar", "-j", "1"]) == 0
    assert "packed 3 samples" in capsys.readouterr().out
    assert main(["inspect", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "audio" in out and "sample_rate" in out
    assert main(["inspect", str(dest), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert "audio" in json.dumps(info)
    s = gpufeed.open_dataset(dest)[2]
    assert np.asarray(s["audio"]).shape == (12, 2) and s["sample_rate"] == 22050


def test_cli_schema_option(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    for i in range(2):
        torch.save({"tokens": torch.arange(3 + i)}, tmp_path / "src" / f"{i}.pt")
    dest = tmp_path / "out"
    args = ["pack", str(tmp_path / "src"), str(dest), "-f", "lmdb", "-j", "1", "-q"]
    assert main([*args, "--schema", "tokens=int64[-1]"]) == 0
    assert torch.as_tensor(gpufeed.open_dataset(dest)[1]["tokens"]).tolist() == [0, 1, 2, 3]
    with pytest.raises(SystemExit):
        main([*args, "--schema", "tokens"])
    assert "expected FIELD=TYPE" in capsys.readouterr().err
