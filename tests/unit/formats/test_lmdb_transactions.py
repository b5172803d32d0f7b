"""The LMDB writer cuts its transactions by record count and bytes, never by part (LMDB's
file bytes depend on the transaction sequence; a pack's bytes must not depend on its parts):
a part's records are added a transaction at a time (lmdb.writer.LMDBWriter.add), with the
cuts a record at a time would make."""

from __future__ import annotations

import numpy as np
import pytest
from encoded_parts import encoded_part

from gpufeed.formats.lmdb import writer as lmdb_writer
from gpufeed.formats.lmdb.keys import key
from gpufeed.formats.parts import Part
from gpufeed.formats.spec import SampleSpec


def part(sizes: list[int], start: int) -> Part:
    """Records of these sizes, their bytes the pack's byte numbers from `start` (mod 256)."""
    return encoded_part(((np.arange(int(np.sum(sizes))) + start) % 256).astype(np.uint8), sizes)


def one_at_a_time(sizes: list[int], records: int, nbytes: int) -> list[int]:
    """Transaction lengths when each record is added and the transaction committed once it
    holds `records` records or `nbytes` bytes."""
    out, count, held = [], 0, 0
    for s in sizes:
        count, held = count + 1, held + s
        if count >= records or held >= nbytes:
            out.append(count)
            count, held = 0, 0
    return [*out, count] if count else out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_transactions_are_cut_as_a_record_at_a_time_whatever_the_parts(tmp_path, monkeypatch, seed):
    monkeypatch.setattr(lmdb_writer, "TXN_RECORDS", 7)
    monkeypatch.setattr(lmdb_writer, "TXN_BYTES", 300)
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 120, 200).tolist()
    cuts = np.sort(rng.choice(np.arange(1, 200), 12, replace=False)).tolist()
    w = lmdb_writer.LMDBWriter(tmp_path, SampleSpec("encoded"), None, 0, {})
    seen = []
    real = w._put_all
    monkeypatch.setattr(w, "_put_all", lambda items: (seen.append(list(items)), real(items)))
    starts = np.concatenate([[0], np.cumsum(sizes)]).tolist()
    for a, b in zip([0, *cuts], [*cuts, 200], strict=True):
        w.add(part(sizes[a:b], starts[a]))
    w._flush()
    assert [len(t) for t in seen] == one_at_a_time(sizes, 7, 300)
    got = [k for t in seen for k, _ in t]
    assert got == [key(i) for i in range(200)]
    values = b"".join(bytes(v) for t in seen for _, v in t)
    assert [len(v) for t in seen for _, v in t] == sizes
    assert values == ((np.arange(sum(sizes))) % 256).astype(np.uint8).tobytes()
    w.env.close()
