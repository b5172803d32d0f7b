"""formats.base's checks of index arrays read from a pack (every format's reader calls them
before it builds a view from the numbers)."""

from __future__ import annotations

import numpy as np
import pytest

from gpufeed.errors import DataError
from gpufeed.formats.base import check_offsets, check_spans, index_array


def test_spans_inside_the_file_pass():
    check_spans("f", np.array([0, 10]), np.array([10, 30]), 30, ordered=True)
    check_offsets("f", np.array([0, 0, 5, 30]), 30)


@pytest.mark.parametrize(
    "starts, ends, ordered, says",
    [
        ([0, -1000], [10, -990], False, r"f: sample 8 lies at bytes \[-1,000, -990\), outside"),
        ([0, 10], [10, 31], False, r"f: sample 8 lies at bytes \[10, 31\), outside the 30 bytes"),
        ([5, 4], [10, 3], False, r"f: sample 8 lies at bytes \[4, 3\)"),
        ([0, 5], [10, 12], True, r"f: sample 8 .* overlapping sample 7, which ends at 10"),
        ([0, 2**63 + 5], [10, 2**63 + 6], False, r"f: sample 8 lies at bytes \[-"),
    ],
)
def test_a_span_outside_the_file_names_it_and_its_sample(starts, ends, ordered, says):
    dtype = np.uint64 if max(ends) > 2**62 else np.int64
    with pytest.raises(DataError, match=says):
        check_spans(
            "f", np.array(starts, dtype), np.array(ends, dtype), 30, first=7, ordered=ordered
        )


def test_offsets_that_go_back_name_the_sample():
    with pytest.raises(DataError, match=r"f: sample 1 lies at bytes \[9, 5\)"):
        check_offsets("f", np.array([0, 9, 5, 30]), 30)


@pytest.mark.parametrize(
    "arr, says",
    [
        (np.zeros(3, np.float64), r"holds float64\[3\], expected one dimension of integers"),
        (np.zeros((2, 2), np.int64), r"holds int64\[2, 2\]"),
        (np.array([b"x"]), r"holds \|S1\[1\]"),
        (np.array([2**40], np.int64), "holds values beyond uint32"),
    ],
)
def test_index_arrays_must_be_integers_that_fit(arr, says):
    with pytest.raises(DataError, match=rf"f: key: {says}"):
        index_array("f: key", arr, np.uint32)
