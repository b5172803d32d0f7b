"""What held in issue 37's attack and must keep holding: no pickle is ever executed (a .npy,
a .pt or a tar member holding one, read from a pack or packed from a source folder), and
170 random byte flips across every format give no crash, hang or raw error."""

from __future__ import annotations

import numpy as np
import pytest
from fuzzpack import Unpickled, fuzz, plan_cases, summary
from unit_sources import PYTHON_ENV

import gpufeed
from gpufeed.errors import GpufeedError

pytestmark = pytest.mark.slow


def test_170_random_byte_flips_never_crash_hang_or_leak(fuzz_packs, fuzz_expected, fuzz_root):
    cases = plan_cases(sorted(fuzz_packs), 170, seed=170, kinds=("flip",))
    assert len(cases) == 170 and {c["kind"] for c in cases} == {"flip"}
    failures, tally = fuzz(cases, fuzz_packs, fuzz_expected, fuzz_root, dict(PYTHON_ENV))
    line = summary(cases, failures, tally)
    print(line)
    assert not failures, line + "\n" + "\n".join(failures)


def test_every_pickle_in_a_pack_is_refused_never_executed(fuzz_packs, fuzz_expected, fuzz_root):
    """.npy files of mmap packs, LMDB's value table, tar members and the .pt container, each
    replaced by one holding a pickle that creates a file when unpickled."""
    cases = plan_cases(sorted(fuzz_packs), 0, seed=7, kinds=("pickle",))
    assert {c["pack"] for c in cases} >= {"arr.mmap", "arr-pt.mmap", "arr.lmdb", "arr.tar"}
    failures, tally = fuzz(cases, fuzz_packs, fuzz_expected, fuzz_root, dict(PYTHON_ENV))
    assert not failures, summary(cases, failures, tally) + "\n" + "\n".join(failures)


@pytest.mark.parametrize("ext", [".npy", ".pt"])
def test_a_pickle_in_a_source_file_is_never_executed_when_packing(tmp_path, make_arrays, ext):
    src = tmp_path / "src"
    make_arrays(src, {"a": 2}, shape=(4,), ext=ext)
    marker = tmp_path / "unpickled"
    evil = src / "a" / f"evil{ext}"
    if ext == ".npy":
        arr = np.empty(1, dtype=object)
        arr[0] = Unpickled(str(marker))
        np.save(evil, arr, allow_pickle=True)
    else:
        import torch

        torch.save({"x": Unpickled(str(marker))}, evil)
    with pytest.raises(GpufeedError, match="evil"):
        gpufeed.pack(src, tmp_path / "out", format="mmap", workers=1, quiet=True)
    assert not marker.exists()
