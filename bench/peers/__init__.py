"""The loaders the suite compares, one module each, all with the same two functions:

    write(case, out_dir)                      -> the stored dataset (timed by the suite)
    batches(case, out_dir, *, shuffle, workers, batch_size, seed) -> iterable of batches

``case`` is a :class:`bench.data.Case`: where its per-file source lies, the sample kind
("raw" uint8 tensors, "jpeg" files, or "fields": a JPEG + a caption) and the per-sample
transform. Every loader yields ``(samples, labels)`` batches of ``batch_size`` (fields:
``(images, captions, labels)``); the suite only counts and times them. FIELDS_PEERS: those
that store the fields case (FFCV's row is about JPEGs alone)."""

from __future__ import annotations

import importlib

# row name -> module; the order is the table's
PEERS = {
    "webdataset": "bench.peers.wds_peer",
    "litdata": "bench.peers.litdata_peer",
    "mds": "bench.peers.mds_peer",
    "ffcv": "bench.peers.ffcv_peer",
}

FIELDS_PEERS = ("webdataset", "litdata", "mds")


def load(name: str):
    return importlib.import_module(PEERS[name])


def missing(name: str) -> str | None:
    """Why a peer cannot run here (not installed), or None."""
    try:
        mod = load(name)
        reason = mod.unavailable()
    except ImportError as exc:  # noqa: PERF203
        return f"not importable: {exc}"
    return reason
