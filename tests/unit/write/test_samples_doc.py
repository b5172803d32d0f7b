"""docs/samples.md: every use-case block runs as it is, in an empty folder."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[3] / "docs" / "samples.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_its_five_use_cases():
    assert len(BLOCKS) == 5


@pytest.mark.parametrize("block", BLOCKS, ids=["plain", "caption", "boxes", "tokens", "audio"])
def test_a_use_case_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block, str(DOC), "exec"), {"__name__": "samples_doc"})
    assert any(tmp_path.iterdir())  # it wrote its pack here
