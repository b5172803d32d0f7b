"""The fuzz suite's packs (built once per session) and their original samples, as read by
the same child process that reads the crafted copies."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fuzzpack import build_packs, run_cases
from unit_sources import PYTHON_ENV

# GPUFEED_FUZZ_CASES raises the count (make fuzz-long, before a release)
DEFAULT_CASES = 240


def fuzz_case_count() -> int:
    return int(os.environ.get("GPUFEED_FUZZ_CASES", DEFAULT_CASES))


@pytest.fixture(scope="session")
def fuzz_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="session")
def fuzz_packs(fuzz_root) -> dict[str, Path]:
    return build_packs(fuzz_root)


@pytest.fixture(scope="session")
def fuzz_expected(fuzz_packs, fuzz_root) -> dict[str, str]:
    """Pack name -> the digest of everything read from the untouched pack (in a child, under
    the same limits): what a crafted copy must give back, if it gives samples at all."""
    cases = [
        {"case": -1 - i, "pack": name, "kind": "none", "seed": 0, "path": str(path)}
        for i, (name, path) in enumerate(sorted(fuzz_packs.items()))
    ]
    results = run_cases(cases, fuzz_root, dict(PYTHON_ENV))
    expected = {}
    for case in cases:
        out = results[case["case"]]
        assert "digest" in out and out.get("verify_ok"), (case["pack"], out)
        assert not out.get("outside"), (case["pack"], out)
        expected[case["pack"]] = out["digest"]
    return expected
