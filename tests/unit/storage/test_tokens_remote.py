"""Token windows and mixtures of a token pack read from object storage (s3://)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpufeed
from gpufeed.data.mixture import mix
from gpufeed.storage import upload_pack

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _index_dir(tmp_path, monkeypatch):
    """Document lengths read from the documents are cached here, not in ~/.cache."""
    monkeypatch.setenv("GPUFEED_INDEX_DIR", str(tmp_path / "index"))


def test_token_windows_of_a_pack_in_object_storage(s3, tmp_path):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 60000, rng.integers(1, 90)).astype(np.uint16) for _ in range(50)]
    with gpufeed.Writer(tmp_path / "tok", "tar", schema={"tokens": "uint16[-1]"}) as w:
        for d in docs:
            w.write({"tokens": d})
    upload_pack(tmp_path / "tok", f"{s3}/tok")
    ds = gpufeed.open_dataset(f"{s3}/tok", block_size=16, eos=0, cache_dir=tmp_path / "cache")
    stream = np.concatenate([x for d in docs for x in (d, np.zeros(1, np.uint16))])
    want = stream[: len(stream) // 16 * 16].reshape(-1, 16)
    assert np.array_equal(torch.stack(ds[:]).numpy(), want)
    m = mix([ds, ds], [0.5, 0.5])
    loader = gpufeed.make_loader(m, 8, num_workers=2, shuffle=True, seed=0)
    assert sum(len(b) for b in loader) == 2 * len(want)
