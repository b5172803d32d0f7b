"""A pack's class names read from a real S3 server (rclone on 127.0.0.1): dataset.classes
and class_to_idx as the local pack has them, map-style and streamed."""

from __future__ import annotations

import numpy as np
import pytest

import gpufeed
from gpufeed.storage import upload_pack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_a_remote_pack_names_the_classes_its_writer_was_given(s3, tmp_path, fmt):
    local = tmp_path / fmt
    with gpufeed.Writer(local, fmt, {"x": "int64[1]", "label": "int"}, classes=["a", "b"]) as w:
        for i in range(5):
            w.write({"x": np.full(1, i, np.int64), "label": i % 2})
    upload_pack(local, f"{s3}/{fmt}")
    for map_style in [True, False] if fmt == "tar" else [True]:
        ds = gpufeed.open_dataset(f"{s3}/{fmt}", cache_dir=tmp_path / "c", map_style=map_style)
        assert ds.classes == ["a", "b"] and ds.class_to_idx == {"a": 0, "b": 1}
