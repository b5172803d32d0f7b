"""pack_tokens (gpufeed.write.token_pack) and its text sources (gpufeed.write.text_sources):
texts -> a token pack, read back as windows by open_dataset(path, block_size=B)."""

from __future__ import annotations

import gzip
import json
import re
import sys

import numpy as np
import pytest

import gpufeed
from gpufeed import cli
from gpufeed.errors import DataError, SourceError, UsageError
from gpufeed.formats.manifest import read_manifest
from gpufeed.write import text_sources
from gpufeed.write.token_pack import TokenizeDocs, pack_tokens

VOCAB, EOS = 50257, 50256
B = 16


@pytest.fixture(autouse=True)
def _index_dir(tmp_path, monkeypatch):
    """Document lengths read from the documents are cached here, not in ~/.cache."""
    monkeypatch.setenv("GPUFEED_INDEX_DIR", str(tmp_path / "index"))


def chars(text: str) -> list[int]:
    """The test tokenizer: one id per character, its code point (picklable: module level)."""
    return [ord(c) for c in text]


def chars_batch(texts: list[str]) -> list[list[int]]:
    return [chars(t) for t in texts]


def boom(text: str) -> list[int]:
    if "BOOM" in text:
        raise ValueError("no tokens for this one")
    return chars(text)


class Tokenizer:
    """A tokenizer object as Hugging Face's looks to pack_tokens: vocab_size without the
    added tokens, len() with them."""

    vocab_size = 300

    def __len__(self) -> int:
        return 70000

    def encode(self, text: str) -> list[int]:
        return chars(text)


def texts(n: int = 700, seed: int = 0) -> list[str]:
    """Documents of varied lengths (an empty one; non-ASCII: é, 中)."""
    rng = np.random.default_rng(seed)
    words = ["the", "web", "é", "中文", "code", "x" * 9]
    docs = [" ".join(rng.choice(words, int(rng.integers(0, 12)))) for _ in range(n)]
    docs[5] = ""
    return docs


DOCS = texts()


def windows(docs, eos=EOS, dtype=np.uint16, block=B) -> np.ndarray:
    """What open_dataset(block_size=block) must read: the documents' ids, eos after each."""
    ids = [x for d in docs for x in [*chars(d), *([] if eos is None else [eos])]]
    stream = np.array(ids, dtype=dtype)
    return stream[: len(stream) // block * block].reshape(-1, block)


def read_windows(dest, block=B) -> np.ndarray:
    ds = gpufeed.open_dataset(dest, block_size=block)
    return np.stack([ds[i].numpy() for i in range(len(ds))])


def write_jsonl(path, docs, opener=open, field="text"):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, field: d}) + "\n")
            if i == 10:
                f.write("\n")  # a blank line is no document
    return path


def write_parquet(path, docs, row_group_size=128, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"id": list(range(len(docs))), column: docs})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


@pytest.mark.parametrize("workers", [0, 2])
def test_jsonl_exact_windows_with_eos_written(tmp_path, workers):
    src = write_jsonl(tmp_path / "web.jsonl", DOCS)
    manifest = pack_tokens(
        src, tmp_path / "p", tokenize=chars, vocab_size=VOCAB, eos=EOS, workers=workers, quiet=True
    )
    assert manifest["count"] == len(DOCS)
    assert manifest["tokens"] == {
        "field": "tokens",
        "eos": EOS,
        "vocab_size": VOCAB,
        "dtype": "uint16",
        "tokenizer": f"{__name__}:chars",
        "text_field": "text",
        "source": str(src),
    }
    assert read_manifest(tmp_path / "p")["tokens"] == manifest["tokens"]  # on disk too
    got = read_windows(tmp_path / "p")
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(got, windows(DOCS))
    # open_dataset knows the eos from the manifest: given again, it is not appended twice
    again = gpufeed.open_dataset(tmp_path / "p", block_size=B, eos=EOS)
    np.testing.assert_array_equal(again[len(again) - 1].numpy(), windows(DOCS)[-1])
    with pytest.raises(UsageError, match="already end with eos 50256"):
        gpufeed.open_dataset(tmp_path / "p", block_size=B, eos=1)
    # each document is named by its run of lines
    names = (tmp_path / "p" / "sources.txt").read_text().splitlines()
    assert names[0] == f"{src}:lines 1-64" and names[-1] == f"{src}:lines 641-701"


@pytest.mark.parametrize(
    "suffix,opener",
    [(".jsonl.gz", gzip.open), (".jsonl.zst", None)],
    ids=["gz", "zst"],
)
def test_compressed_jsonl(tmp_path, suffix, opener):
    if opener is None:
        zstandard = pytest.importorskip("zstandard")

        def opener(path, mode, encoding):
            raw = open(path, "wb")  # noqa: SIM115 - closed by the writer
            return zstandard.ZstdCompressor().stream_writer(raw, closefd=True)

        path = tmp_path / f"web{suffix}"
        with opener(path, "wb", None) as f:
            f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode())
    else:
        path = write_jsonl(tmp_path / f"web{suffix}", DOCS, gzip.open)
    pack_tokens(
        path, tmp_path / "p", tokenize=chars, vocab_size=VOCAB, eos=EOS, workers=0, quiet=True
    )
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(DOCS))


def test_text_files_folder_and_glob_one_document_each(tmp_path):
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    names = ["a.txt", "b.txt", "sub/c.txt"]
    for name, doc in zip(names, DOCS[:3], strict=True):
        (folder / name).write_text(doc, encoding="utf-8")
    (folder / ".hidden.txt").write_text("never read")
    pack_tokens(folder, tmp_path / "p", tokenize=chars, vocab_size=VOCAB, eos=EOS, quiet=True)
    np.testing.assert_array_equal(read_windows(tmp_path / "p", 4), windows(DOCS[:3], block=4))
    assert (tmp_path / "p" / "sources.txt").read_text().splitlines() == [f"{folder}:files 0-2"] * 3
    pack_tokens(f"{folder}/*.txt", tmp_path / "g", tokenize=chars, vocab_size=VOCAB, quiet=True)
    np.testing.assert_array_equal(
        read_windows(tmp_path / "g", 2), windows(DOCS[:2], eos=None, block=2)
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_parquet_file_folder_and_glob_by_row_group(tmp_path, workers):
    pytest.importorskip("pyarrow")
    folder = tmp_path / "data"
    folder.mkdir()
    write_parquet(folder / "train-00000-of-00002.parquet", DOCS[:400])
    write_parquet(folder / "train-00001-of-00002.parquet", DOCS[400:])
    want = windows(DOCS)
    for k, src in enumerate([folder, str(folder / "*.parquet")]):
        dest = tmp_path / f"p{k}"
        pack_tokens(
            src, dest, tokenize=chars, vocab_size=VOCAB, eos=EOS, workers=workers, quiet=True
        )
        np.testing.assert_array_equal(read_windows(dest), want)
    names = (tmp_path / "p0" / "sources.txt").read_text().splitlines()
    # runs never cross a row group (128 rows): the first file's rows 0-63, 64-127, ...
    assert names[0].endswith("train-00000-of-00002.parquet:rows 0-63")
    assert names[64].endswith("train-00000-of-00002.parquet:rows 64-127")
    assert names[-1].endswith("train-00001-of-00002.parquet:rows 256-299")


def test_parquet_text_column_named_and_checked(tmp_path):
    pytest.importorskip("pyarrow")
    path = write_parquet(tmp_path / "t.parquet", DOCS[:50], column="content")
    pack_tokens(
        path, tmp_path / "p", tokenize=chars, vocab_size=VOCAB, text_field="content", quiet=True
    )
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(DOCS[:50], eos=None))
    with pytest.raises(UsageError, match=r"t\.parquet: no column 'text' \(columns: id, content\)"):
        pack_tokens(path, tmp_path / "q", tokenize=chars, vocab_size=VOCAB, quiet=True)
    with pytest.raises(UsageError, match=r"column 'id' is int64, expected strings"):
        pack_tokens(
            path, tmp_path / "q", tokenize=chars, vocab_size=VOCAB, text_field="id", quiet=True
        )
    assert not (tmp_path / "q").exists() and not (tmp_path / "q.partial").exists()


def test_parquet_null_text_names_the_row(tmp_path):
    pytest.importorskip("pyarrow")
    docs = list(DOCS[:200])
    docs[150] = None
    path = write_parquet(tmp_path / "n.parquet", docs, row_group_size=100)
    with pytest.raises(
        SourceError, match=r"n\.parquet row 150 \(column 'text'\): the text is null"
    ):
        pack_tokens(path, tmp_path / "p", tokenize=chars, vocab_size=VOCAB, workers=0, quiet=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_of_strings_streamed(tmp_path, workers):
    gen = (d for d in DOCS)  # consumed as it is written
    pack_tokens(
        gen, tmp_path / "p", tokenize=chars, vocab_size=VOCAB, eos=EOS, workers=workers, quiet=True
    )
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(DOCS))
    assert read_manifest(tmp_path / "p")["tokens"]["source"] is None


def test_batched_tokenizer(tmp_path):
    pack_tokens(
        DOCS, tmp_path / "p", tokenize=chars_batch, batched=True, vocab_size=VOCAB, eos=EOS,
        workers=2, quiet=True,
    )  # fmt: skip
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(DOCS))


def test_without_eos_the_stream_has_none_and_open_time_eos_still_applies(tmp_path):
    pack_tokens(DOCS, tmp_path / "p", tokenize=chars, vocab_size=VOCAB, workers=0, quiet=True)
    assert read_manifest(tmp_path / "p")["tokens"]["eos"] is None
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(DOCS, eos=None))
    ds = gpufeed.open_dataset(tmp_path / "p", block_size=B, eos=9)
    np.testing.assert_array_equal(ds[3].numpy(), windows(DOCS, eos=9)[3])


@pytest.mark.parametrize(
    "vocab,dtype", [(256, np.uint16), (65536, np.uint16), (65537, np.uint32), (200000, np.uint32)]
)
def test_dtype_is_the_narrowest_for_the_vocabulary(tmp_path, vocab, dtype):
    docs = ["ab", "\U0001d11e" if vocab > 119070 else chr(vocab - 1)]  # the largest id fits
    manifest = pack_tokens(docs, tmp_path / "p", tokenize=chars, vocab_size=vocab, quiet=True)
    assert manifest["tokens"]["dtype"] == np.dtype(dtype).name
    assert np.dtype(manifest["sample"]["fields"][0]["dtype"]) == dtype  # stored as such
    np.testing.assert_array_equal(
        read_windows(tmp_path / "p", 3), windows(docs, eos=None, dtype=dtype, block=3)
    )


def test_vocab_size_from_the_tokenizer_else_uint32_with_a_note(tmp_path, capsys):
    tok = Tokenizer()
    manifest = pack_tokens(DOCS[:20], tmp_path / "p", tokenize=tok.encode, workers=0)
    # len() (added tokens included) is the larger: 70,000 ids need uint32
    assert manifest["tokens"]["vocab_size"] == 70000 and manifest["tokens"]["dtype"] == "uint32"
    assert "vocab_size 70,000 from the tokenizer" in capsys.readouterr().err
    manifest = pack_tokens(DOCS[:20], tmp_path / "q", tokenize=chars, workers=0)
    assert manifest["tokens"]["vocab_size"] is None and manifest["tokens"]["dtype"] == "uint32"
    assert "no vocab_size given or found on the tokenizer: ids stored as uint32" in (
        capsys.readouterr().err
    )
    np.testing.assert_array_equal(
        read_windows(tmp_path / "q"), windows(DOCS[:20], eos=None, dtype=np.uint32)
    )


@pytest.mark.parametrize("workers", [0, 2])
def test_an_id_outside_the_vocabulary_names_the_file_and_line(tmp_path, workers):
    docs = ["plain ascii"] * 300
    docs[290] = "caf\u00e9"  # é is 233, outside a vocabulary of 128
    src = write_jsonl(tmp_path / "web.jsonl", docs)
    with pytest.raises(SourceError) as e:
        pack_tokens(
            src, tmp_path / "p", tokenize=chars, vocab_size=128, workers=workers, part_size=64,
            quiet=True,
        )  # fmt: skip
    # line 292: the blank line after line 11 counts
    assert f"{src} line 292: token id 233 (position 3) is outside the vocabulary 0..127" in str(
        e.value
    )
    assert not (tmp_path / "p").exists()  # the partial pack stays, resumable


@pytest.mark.parametrize("dtype,limit", [("uint16", VOCAB), ("uint32", 1 << 32)])
def test_ids_of_every_kind_checked_exactly(dtype, limit):
    fn = TokenizeDocs(chars, "tokens", dtype, limit, 7, False)
    docs = text_sources.Docs("web.jsonl", "jsonl", 1, (b"",) * 3)
    for out in (
        [5, 0, limit - 1],
        np.array([5, 0, limit - 1]),
        (5, 0, limit - 1),
        [np.int64(5), 0, limit - 1],
    ):
        got = fn._ids(out, docs, 1)
        assert got.dtype == np.dtype(dtype) and got.tolist() == [5, 0, limit - 1, 7]
    assert fn._ids([], docs, 0).tolist() == [7]
    refused = {
        "float64 values of shape [2]": [1, 2.5],
        "<U1 values of shape [1]": ["3"],
        "int64 values of shape [1, 2]": [[1, 2]],
        "token id -1 (position 1)": [4, -1],
        f"token id {limit} (position 2)": [4, 5, limit],
    }
    for message, out in refused.items():
        with pytest.raises(DataError, match=rf"web\.jsonl line 2: .*{re.escape(message)}"):
            fn._ids(out, docs, 1)


def test_settings_checked_before_anything_is_written(tmp_path):
    with pytest.raises(UsageError, match=r"eos=300 is outside the vocabulary 0\.\.255"):
        pack_tokens(DOCS, tmp_path / "p", tokenize=chars, vocab_size=256, eos=300)
    with pytest.raises(UsageError, match="vocab_size must be an integer from 1 to 2"):
        pack_tokens(DOCS, tmp_path / "p", tokenize=chars, vocab_size=0)
    with pytest.raises(UsageError, match="tokenize: a function, or 'module:function'"):
        pack_tokens(DOCS, tmp_path / "p", tokenize="chars")
    with pytest.raises(UsageError, match=r"s3://bucket/web: needs a local path here; pack into"):
        pack_tokens(DOCS, "s3://bucket/web", tokenize=chars)
    with pytest.raises(UsageError, match=r"nothing\.jsonl: no such file or folder"):
        pack_tokens(tmp_path / "nothing.jsonl", tmp_path / "p", tokenize=chars)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(UsageError, match=r"x\.csv: not a text source gpufeed reads"):
        pack_tokens(tmp_path / "x.csv", tmp_path / "p", tokenize=chars)
    assert not (tmp_path / "p.partial").exists()


def test_bad_lines_name_the_file_and_line(tmp_path):
    src = tmp_path / "bad.jsonl"
    cases = [
        ('{"text": "ok"}\n{"text": \n', r"bad\.jsonl line 2: not a JSON object"),
        ('{"text": "ok"}\n[1, 2]\n', r"bad\.jsonl line 2: a list, expected a JSON object"),
        ('{"body": "ok"}\n', r"bad\.jsonl line 1: no field 'text' \(it has: body\)"),
        ('{"text": 3}\n', r"bad\.jsonl line 1: the text is a int, expected a string"),
        (b'{"text": "\xff"}\n', r"bad\.jsonl line 1: not a JSON object"),
    ]
    for content, message in cases:
        if isinstance(content, bytes):
            src.write_bytes(content)
        else:
            src.write_text(content)
        with pytest.raises(SourceError, match=message):
            pack_tokens(src, tmp_path / "p", tokenize=chars, workers=0, overwrite=True, quiet=True)


def test_a_tokenizer_failure_names_the_document_and_resume_goes_on(tmp_path):
    docs = [f"doc {i}" for i in range(600)]
    docs[520] = "BOOM"
    src = write_jsonl(tmp_path / "web.jsonl", docs)
    opts = dict(tokenize=boom, vocab_size=VOCAB, eos=EOS, workers=0, part_size=100, quiet=True)
    with pytest.raises(SourceError, match=rf"{src} line 522: tokenize failed \(ValueError"):
        pack_tokens(src, tmp_path / "p", **opts)
    assert (tmp_path / "p.partial" / "tokens.json").exists()
    with pytest.raises(UsageError, match=r"other token settings \(eos: 50256 -> 1\)"):
        pack_tokens(src, tmp_path / "p", **{**opts, "eos": 1}, resume=True)
    docs[520] = "fixed"
    write_jsonl(src, docs)
    manifest = pack_tokens(src, tmp_path / "p", **opts, resume=True)
    assert manifest["count"] == 600
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(docs))
    again = pack_tokens(src, tmp_path / "p", **opts, resume=True)  # finished: nothing to do
    assert again == read_manifest(tmp_path / "p")


def test_skip_leaves_out_the_run_and_lists_it(tmp_path):
    docs = [f"doc {i}" for i in range(600)]
    docs[300] = "BOOM"
    src = write_jsonl(tmp_path / "web.jsonl", docs)
    manifest = pack_tokens(
        src, tmp_path / "p", tokenize=boom, vocab_size=VOCAB, on_error="skip", workers=0, quiet=True
    )
    assert manifest["count"] == 600 - 64
    [skipped] = manifest["skipped"]
    assert skipped["path"] == f"{src}:lines 257-320"
    assert f"{src} line 302: tokenize failed" in skipped["error"]
    np.testing.assert_array_equal(
        read_windows(tmp_path / "p"), windows(docs[:255] + docs[319:], eos=None)
    )


@pytest.mark.parametrize("fmt", ["hdf5", "lmdb", "tar"])
def test_other_formats(tmp_path, fmt):
    pack_tokens(
        DOCS[:100], tmp_path / "p", fmt, tokenize=chars, vocab_size=VOCAB, eos=EOS, quiet=True
    )
    assert read_manifest(tmp_path / "p")["format"] == fmt
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(DOCS[:100]))


def test_runs_are_bounded_by_documents_and_bytes(monkeypatch):
    runs = list(text_sources.documents(["a" * 10] * 600))
    assert [len(r.items) for r in runs] == [64] * 9 + [24]
    monkeypatch.setattr(text_sources, "INPUT_BYTES", 25)
    assert [len(r.items) for r in text_sources.documents(["a" * 10] * 7)] == [3, 3, 1]
    with pytest.raises(UsageError, match="an iterable of str, got int"):
        text_sources.documents(3)
    with pytest.raises(DataError, match="<texts> document 1: the text is a bytes"):
        next(text_sources.documents(["a", b"b"])).texts()


def test_gpufeed_pack_tokens_is_the_api_name():
    assert gpufeed.pack_tokens is pack_tokens
    assert "pack_tokens" not in gpufeed.__all__  # the capped list stays as it is


@pytest.fixture()
def tokenizer_module(tmp_path, monkeypatch):
    """A module of the folder the command runs in, as a user's would be."""
    (tmp_path / "mytok.py").write_text(
        "def encode(text):\n    return [ord(c) for c in text]\n"
        "def encode_all(texts):\n    return [encode(t) for t in texts]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mytok"
    sys.modules.pop("mytok", None)


def test_cli_pack_tokenize(tmp_path, tokenizer_module, capsys):
    src = write_jsonl(tmp_path / "web.jsonl", DOCS)
    args = ["pack", str(src), "p", "--tokenize", "mytok:encode", "--vocab-size", str(VOCAB)]
    assert cli.main([*args, "--eos", str(EOS), "-j", "2"]) == 0
    assert "packed 700 documents into p (mmap, uint16 ids, eos 50256 after each)" in (
        capsys.readouterr().out
    )
    np.testing.assert_array_equal(read_windows(tmp_path / "p"), windows(DOCS))
    assert read_manifest(tmp_path / "p")["tokens"]["tokenizer"] == "mytok:encode"
    assert cli.main(["inspect", "p"]) == 0  # the token settings are shown
    want = f"field=tokens, dtype=uint16, vocab_size={VOCAB}, eos={EOS}, tokenizer=mytok:encode"
    assert want in capsys.readouterr().out
    batched = ["pack", str(src), "b", "-f", "hdf5", "--tokenize", "mytok:encode_all", "--batched"]
    assert cli.main([*batched, "--text-field", "text", "-q"]) == 0
    np.testing.assert_array_equal(
        read_windows(tmp_path / "b"), windows(DOCS, eos=None, dtype=np.uint32)
    )


def test_cli_pack_tokenize_errors(tmp_path, tokenizer_module, capsys):
    src = write_jsonl(tmp_path / "web.jsonl", ["ok", "caf\u00e9"])
    base = ["pack", str(src), "p", "--tokenize", "mytok:encode"]
    assert cli.main([*base, "--vocab-size", "128", "-j", "0", "-q"]) == 1  # a data problem
    assert f"{src} line 2: token id 233 (position 3) is outside" in capsys.readouterr().err
    assert cli.main([*base, "--encode", "raw", "--overwrite"]) == 2
    assert "--encode: not for token packs (--tokenize)" in capsys.readouterr().err
    assert cli.main(["pack", str(src), "q", "--eos", "0", "-f", "mmap"]) == 2
    assert "--eos: for token packs; give --tokenize too" in capsys.readouterr().err
    assert cli.main(["pack", str(src), "q"]) == 2
    assert "--format (-f) is required" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main([*base[:-1], "not a spec"])
    assert e.value.code == 2
    assert "expected MODULE:FUNCTION" in capsys.readouterr().err
    assert cli.main([*base[:-1], "mytok:nothing", "--overwrite"]) == 2
    assert "mytok has no 'nothing'" in capsys.readouterr().err


def test_cli_glob_of_texts_is_a_source(tmp_path, tokenizer_module):
    for k in range(3):
        write_jsonl(tmp_path / f"part{k}.jsonl", DOCS[k * 100 : (k + 1) * 100])
    assert cli.main(["pack", "part*.jsonl", "p", "--tokenize", "mytok:encode", "-q"]) == 0
    np.testing.assert_array_equal(
        read_windows(tmp_path / "p"), windows(DOCS[:300], eos=None, dtype=np.uint32)
    )
