"""bench/studies/tokens_write.py: token packs written per second, gpufeed.pack_tokens against
LitData's optimize and MDS. Its quick mode runs here; the peers run where they are installed
(the bench image), and read "not run" with the reason elsewhere."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def study(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench.studies import tokens_write

    return tokens_write


def test_the_fake_tokenizer_is_fixed_and_ends_each_document_with_eos(study):
    assert study.fake_tokenize("héllo  world") == [
        zlib.crc32("héllo".encode()) % 50257,
        zlib.crc32(b"world") % 50257,
    ]
    ids = study.document_ids(json.dumps({"text": "a b"}).encode())
    assert ids.dtype.name == "uint16"
    assert ids.tolist() == [zlib.crc32(b"a") % 50257, zlib.crc32(b"b") % 50257, 50256]


@pytest.mark.slow
def test_quick_mode_writes_and_checks_every_row_that_runs(study, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert study.main(["--quick", "--tmp", str(tmp_path), "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert (results["docs"], results["files"], results["rounds"]) == (600, 2, 1)
    rows = [f"gpufeed pack_tokens, {w}" for w in ("1 worker", "2 workers")]
    for row in rows:
        # every document and token written (checked by reading the pack back)
        assert results["written"][row] == [600, results["tokens"]]
        assert results["tokens_per_s"][row] > 0
    missing = study.peers()
    for peer in (study.LITDATA, study.MDS):
        ran = f"{peer}, 1 worker" in results["tokens_per_s"]
        assert ran == (missing[peer] is None)
    md = capsys.readouterr().out
    assert "| gpufeed pack_tokens, 2 workers |" in md and "| tokenize only (1 process) |" in md
    assert not list(tmp_path.glob("tokens-write-*"))  # its scratch folder removed


def test_a_row_that_wrote_less_is_an_error_not_a_rate(study):
    study._check({"x": (600, 1000)}, 600, 1000)
    with pytest.raises(SystemExit, match="x: wrote 599 documents"):
        study._check({"x": (599, 1000)}, 600, 1000)
    with pytest.raises(SystemExit, match="y: wrote None documents, 999 tokens"):
        study._check({"y": (None, 999)}, 600, 1000)
