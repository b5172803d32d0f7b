"""Crafted packs, every format: manifests, index arrays, tar headers, .npy headers, zstd
frames, HDF5 layouts, pickles and random byte flips, each read in a child process with a
memory limit and a timeout (fuzzpack.py). Each gives a gpufeed error naming the pack, or
exactly the original samples (or, for damage only checksums see, the pack's own bytes that
verify reports); never a signal, a hang, a raw exception, memory past the bound, bytes from
outside the pack or an executed pickle. Seeded: the same cases every run;
GPUFEED_FUZZ_CASES=5000 (make fuzz-long) runs more before a release."""

from __future__ import annotations

import pytest
from conftest import fuzz_case_count
from fuzzpack import FORMATS, KINDS, fuzz, pack_format, plan_cases, summary
from unit_sources import PYTHON_ENV

pytestmark = pytest.mark.slow


def test_the_default_run_covers_every_format_and_mutation_kind(fuzz_packs):
    cases = plan_cases(sorted(fuzz_packs), fuzz_case_count())
    assert {pack_format(c["pack"]) for c in cases} == set(FORMATS)
    assert {c["kind"] for c in cases} == set(KINDS)
    for fmt in FORMATS:  # the kinds every format has reach each one
        kinds = {c["kind"] for c in cases if pack_format(c["pack"]) == fmt}
        assert {"flip", "manifest", "index", "zstd"} <= kinds, fmt
    assert {c["kind"] for c in cases if c["pack"].endswith(".tar")} >= {"tar_header", "npy_header"}
    assert {c["kind"] for c in cases if c["pack"].endswith(".hdf5")} >= {"hdf5_layout"}
    assert plan_cases(sorted(fuzz_packs), 50) == plan_cases(sorted(fuzz_packs), 50)  # seeded


def test_crafted_packs_give_a_named_error_or_the_original_samples(
    fuzz_packs, fuzz_expected, fuzz_root, record_property
):
    cases = plan_cases(sorted(fuzz_packs), fuzz_case_count())
    failures, tally = fuzz(cases, fuzz_packs, fuzz_expected, fuzz_root, dict(PYTHON_ENV))
    line = summary(cases, failures, tally)
    print(line)
    record_property("fuzz_cases", len(cases))
    record_property("fuzz_summary", line)
    assert not failures, line + "\n" + "\n".join(failures)
