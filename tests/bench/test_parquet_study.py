"""bench/studies/parquet.py: the two sets as written (Hub-style files, row groups, exact
columns), LitData's row transform, the pass check, and a quick run of the whole study (HF
datasets is in the host venv; LitData, where it is missing, reads "not run" with why)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pq = pytest.importorskip("pyarrow.parquet")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def study(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench.studies import parquet

    return parquet


def test_images_set_is_hub_style_files_of_row_groups_with_the_jpeg_bytes(study, tmp_path):
    from bench.studies.fields_read import jpeg

    files = study.write_set("images", tmp_path, n=25, group=4, file_rows=10)
    assert [f.name for f in files] == [f"train-0000{k}-of-00003.parquet" for k in range(3)]
    groups = [
        [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)]
        for f in map(pq.ParquetFile, files)
    ]
    assert groups == [[4, 4, 2], [4, 4, 2], [4, 1]]
    table = pq.read_table(files[2])
    assert table.column_names == ["image", "caption", "label"]
    assert table.column("image").to_pylist() == [jpeg(i) for i in range(20, 25)]
    assert table.column("caption").to_pylist()[0] == "a picture numbered 20"
    assert table.column("label").to_pylist() == [0, 1, 2, 3, 4]


def test_tokens_set_has_text_and_int32_token_lists_of_32_to_512(study, tmp_path):
    import pyarrow as pa

    files = study.write_set("tokens", tmp_path, n=300, group=100, file_rows=300)
    table = pq.read_table(files[0])
    assert table.schema.field("tokens").type == pa.list_(pa.int32())
    lengths = [len(t) for t in table.column("tokens").to_pylist()]
    assert len(lengths) == 300 and min(lengths) >= 32 and max(lengths) <= 512
    assert len(set(lengths)) > 50  # ragged, as real token sequences
    words = set(study.WORDS)
    texts = table.column("text").to_pylist()
    assert all(12 <= len(t.split()) < 60 and set(t.split()) <= words for t in texts)


def test_litdata_transform_decodes_the_jpeg_and_makes_int32_tokens(study):
    from PIL import Image

    from bench.studies.fields_read import jpeg

    row = study.litdata_row({"image": jpeg(3), "tokens": [5, 6, 7], "caption": "c"})
    want = np.array(Image.open(io.BytesIO(jpeg(3))).convert("RGB")).transpose(2, 0, 1)
    assert row["image"].dtype == torch.uint8 and row["image"].shape == (3, 64, 64)
    # torchvision's decode_jpeg where it imports, else PIL: both libjpeg(-turbo), within 2
    diff = np.abs(row["image"].numpy().astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= 2 and diff.mean() < 0.5
    assert row["tokens"].dtype == torch.int32 and row["tokens"].tolist() == [5, 6, 7]
    assert row["caption"] == "c"


def test_a_pass_that_misses_rows_is_an_error(study):
    study.drain([[1, 2], {"a": [3]}], 3)
    with pytest.raises(RuntimeError, match="read 2 rows, not 3"):
        study.drain([[1], [2]], 3)


@pytest.mark.slow
def test_quick_run_measures_every_reader_and_says_why_a_peer_did_not_run(
    study, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "r.json"
    argv = ["parquet", "--quick", "--workers", "0", "--tmp", str(tmp_path), "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    study.main()
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    missing = study.peers()
    for kind in study.SETS:
        best = results[kind]["best"]
        runs = [study.IN_PLACE, study.TUTORIAL, study.HF, study.LITDATA, study.BOUND]
        runs += [f"gpufeed {fmt} pack, make_loader" for fmt in study.PACKS]
        assert list(best) == [study.named(name, 0) for name in runs]
        for name in runs:
            rate = best[study.named(name, 0)]
            assert (rate is None) == bool(missing.get(name)), name
            assert rate is None or rate > 0
    assert printed.count(f"| {study.named(study.IN_PLACE, 0)} |") == 2
    for name, why in missing.items():
        if why:
            assert f"- {name}: not run: {why}" in printed
    assert list(tmp_path.glob("gpufeed-parquet-*")) == []  # the data is removed
