"""gpufeed.data.reading: what every dataset checks when it is opened."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import gpufeed
from gpufeed.errors import UsageError


@pytest.fixture(scope="module")
def box_pack(tmp_path_factory):
    """A multi-field pack of JPEGs and their boxes, as a detection dataset writes it."""
    root = tmp_path_factory.mktemp("reading") / "p"
    schema = {"image": "jpeg", "boxes": "float32[-1,4]", "labels": "int64[-1]"}
    with gpufeed.Writer(root, format="tar", schema=schema) as w:
        for i in range(4):
            buf = io.BytesIO()
            Image.fromarray(np.full((24, 32, 3), i * 40, np.uint8)).save(buf, format="JPEG")
            box = np.array([[1, 2, 10, 12]], np.float32)
            w.write({"image": buf.getvalue(), "boxes": box, "labels": np.array([i])})
    return root


def test_box_options_that_cannot_be_right_are_refused_at_open(box_pack):
    crop = gpufeed.RandomResizedCrop(16, boxes="bbox")
    with pytest.raises(UsageError, match="no field 'bbox'") as err:
        gpufeed.open_dataset(box_pack, decode=crop)  # not at the first batch
    assert str(box_pack) in str(err.value)
    with pytest.raises(UsageError, match="no field 'bbox'"):
        gpufeed.open_dataset(box_pack, decode=crop, map_style=False)


def test_unnamed_boxes_warn_at_open_naming_the_pack(box_pack):
    crop = gpufeed.RandomResizedCrop(16, backend="torch")
    with pytest.warns(UserWarning, match="looks like boxes") as caught:
        gpufeed.open_dataset(box_pack, decode=crop)
    assert str(box_pack) in str(caught[0].message)
