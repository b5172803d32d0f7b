"""Token windows (gpufeed.data.tokens): open_dataset(path, block_size=B) on a token pack."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import gpufeed
from gpufeed import make_loader, open_dataset
from gpufeed.data.tokens import TokenWindows
from gpufeed.errors import CorruptSampleError, DataError, UsageError


@pytest.fixture(autouse=True)
def _index_dir(tmp_path, monkeypatch):
    """Document lengths read from the documents are cached here, not in ~/.cache."""
    monkeypatch.setenv("GPUFEED_INDEX_DIR", str(tmp_path / "index"))


FORMATS = ["mmap", "hdf5", "lmdb", "tar"]
EOS = 7


def _docs(count=120, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 150, count)
    lengths[[3, 4]] = 0  # empty documents in the stream
    return [rng.integers(0, 60000, n).astype(np.uint16) for n in lengths]


DOCS = _docs()


def _write(dest, fmt, docs=DOCS, schema=None, extra=None):
    schema = schema or {"tokens": "uint16[-1]"}
    with gpufeed.Writer(dest, fmt, schema=schema) as w:
        for j, d in enumerate(docs):
            w.write({"tokens": d, **(extra(j) if extra else {})})
    return dest


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokens")
    return {fmt: _write(root / fmt, fmt) for fmt in FORMATS}


def _stream(eos=None) -> np.ndarray:
    sep = [] if eos is None else [np.array([eos], np.uint16)]
    return np.concatenate([x for d in DOCS for x in (d, *sep)])


def _windows(B, eos=None) -> np.ndarray:
    s = _stream(eos)
    return s[: len(s) // B * B].reshape(-1, B)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("eos", [None, EOS])
def test_windows_are_the_concatenated_documents(packs, fmt, eos):
    ds = open_dataset(packs[fmt], block_size=32, eos=eos)
    want = _windows(32, eos)
    assert isinstance(ds, TokenWindows) and len(ds) == len(want)
    got = ds[list(range(len(ds)))]  # one read of every document
    assert all(w.dtype == torch.uint16 and w.shape == (32,) for w in got)
    assert np.array_equal(torch.stack(got).numpy(), want)
    for i in (0, 5, len(ds) - 1, -1):  # one at a time: the same
        assert np.array_equal(ds[i].numpy(), want[i])
    with pytest.raises(IndexError, match=str(packs[fmt])):
        ds[len(ds)]


def test_a_window_longer_than_documents_and_a_shuffled_batch(packs):
    ds = open_dataset(packs["lmdb"], block_size=500)
    want = _windows(500)
    order = [3, 0, 7, 3]
    assert np.array_equal(torch.stack(ds.__getitems__(order)).numpy(), want[order])
    from gpufeed.data.samplers import LookaheadBatch
    from gpufeed.pagecache.plan import BatchReadAhead

    mapped = open_dataset(packs["mmap"], block_size=500)  # make_loader's batch naming the next
    got = mapped.__getitems__(LookaheadBatch(order, BatchReadAhead(ahead=[1, 2])))
    assert np.array_equal(torch.stack(got).numpy(), want[order])


@pytest.mark.parametrize("fmt", ["mmap", "tar"])
def test_boundaries_start_windows_at_documents_padded_and_masked(packs, fmt):
    B = 40
    ds = open_dataset(packs[fmt], block_size=B, eos=EOS, boundaries=True, pad_id=1)
    want_tokens, want_mask = [], []
    for d in DOCS:  # each document with its eos, cut into B, the last piece padded
        doc = np.append(d, np.uint16(EOS))
        for lo in range(0, len(doc), B):
            piece = doc[lo : lo + B]
            want_tokens.append(np.pad(piece, (0, B - len(piece)), constant_values=1))
            want_mask.append(np.arange(B) < len(piece))
    assert len(ds) == len(want_tokens) == sum(-(-(len(d) + 1) // B) for d in DOCS)
    got = ds[list(range(len(ds)))]
    assert np.array_equal(torch.stack([g["tokens"] for g in got]).numpy(), want_tokens)
    assert np.array_equal(torch.stack([g["mask"] for g in got]).numpy(), want_mask)
    batch = next(iter(DataLoader(ds, batch_size=4)))  # default_collate: a dict of [4, B]
    assert batch["tokens"].dtype == torch.uint16 and batch["mask"].shape == (4, B)


@pytest.mark.parametrize(("workers", "context"), [(0, None), (2, "fork"), (2, "spawn")])
def test_the_tutorial_dataloader(packs, workers, context):
    ds = open_dataset(packs["lmdb"], block_size=32, eos=EOS)
    dl = DataLoader(ds, batch_size=8, num_workers=workers, multiprocessing_context=context)
    got = torch.cat(list(dl))
    assert got.dtype == torch.uint16  # default_collate stacks uint16 (torch >= 2.3)
    assert np.array_equal(got.numpy(), _windows(32, EOS))


@pytest.mark.parametrize("workers", [0, 2])
def test_make_loader_ranks_are_disjoint_equal_and_cover_the_windows(packs, workers):
    ds = open_dataset(packs["mmap"], block_size=16)
    shares = []
    for rank in range(2):
        loader = make_loader(
            ds, 8, num_workers=workers, shuffle=True, seed=3, rank=rank, world_size=2
        )
        shares.append([w.numpy().tobytes() for b in loader for w in b])
    assert len(shares[0]) == len(shares[1])
    everything = {w.tobytes() for w in _windows(16)}
    assert set(shares[0]).isdisjoint(shares[1]) or len(everything) < len(ds)
    assert set(shares[0]) | set(shares[1]) <= everything
    assert len(shares[0]) + len(shares[1]) >= len(ds) - 1


def test_make_loader_resumes_mid_epoch_exactly(packs):
    ds = open_dataset(packs["hdf5"], block_size=16)
    whole = [b.clone() for b in make_loader(ds, 8, num_workers=0, shuffle=True, seed=5)]
    first = make_loader(ds, 8, num_workers=0, shuffle=True, seed=5)
    it = iter(first)
    head = [next(it).clone() for _ in range(3)]
    state = first.state_dict()
    resumed = make_loader(ds, 8, num_workers=2, shuffle=True, seed=5)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(head) + len(rest) == len(whole)
    for a, b in zip(head + rest, whole, strict=True):
        assert torch.equal(a, b)


def test_field_names_the_token_field_among_several(tmp_path):
    schema = {"tokens": "uint16[-1]", "ids": "int32[-1]", "url": "str"}
    extra = lambda j: {"ids": np.arange(j % 5, dtype=np.int32), "url": f"u{j}"}  # noqa: E731
    pack = _write(tmp_path / "p", "mmap", schema=schema, extra=extra)
    with pytest.raises(UsageError, match="several.*field="):
        open_dataset(pack, block_size=8)
    ds = open_dataset(pack, block_size=8, field="tokens")
    assert np.array_equal(torch.stack(ds[:]).numpy(), _windows(8))
    with pytest.raises(UsageError, match="'url' is str"):
        open_dataset(pack, block_size=8, field="url")
    with pytest.raises(UsageError, match="not a field"):
        open_dataset(pack, block_size=8, field="text")


def test_a_compressed_token_field(tmp_path):
    schema = {"tokens": {"type": "ragged", "dtype": "uint16", "shape": [-1], "compression": "zstd"}}
    pack = _write(tmp_path / "z", "lmdb", schema=schema)
    ds = open_dataset(pack, block_size=32, eos=EOS)
    assert np.array_equal(torch.stack(ds[:]).numpy(), _windows(32, EOS))


def test_options_that_do_not_fit_are_usage_errors(packs, tmp_path):
    with pytest.raises(UsageError, match="eos=70000 does not fit.*uint16"):
        open_dataset(packs["mmap"], block_size=8, eos=70000)
    with pytest.raises(UsageError, match="block_size must be a positive integer"):
        open_dataset(packs["mmap"], block_size=0)
    images = tmp_path / "img"
    with gpufeed.Writer(images, "mmap", schema={"x": "float32[3]"}) as w:
        w.write({"x": np.zeros(3, np.float32)})
    with pytest.raises(UsageError, match=f"{images}.*ragged 1-D integer field"):
        open_dataset(images, block_size=8)


def test_token_dtype_and_the_writer_refusing_ids_that_do_not_fit(tmp_path):
    from gpufeed.write.tokens import token_dtype, token_schema

    assert token_dtype(50257) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_schema(128256) == {"tokens": "uint32[-1]"}
    assert token_dtype(65537) == np.uint32 and token_dtype(128256) == np.uint32
    with pytest.raises(UsageError):
        token_dtype(0)
    with pytest.raises(UsageError, match=r"'tokens'.*70000.*uint16.*uint32"):
        _write(tmp_path / "big", "mmap", docs=[np.array([1, 70000])])


def test_a_damaged_document_length_is_an_error_naming_file_and_sample(tmp_path):
    pack = _write(tmp_path / "bad", "mmap", docs=[np.arange(10, dtype=np.uint16)] * 3)
    data = pack / "encoded.npy"
    raw = bytearray(data.read_bytes())
    offsets = np.load(pack / "offsets.npy")
    head = len(raw) - int(offsets[-1])  # the .npy header before the records
    at = head + int(offsets[1]) + 8  # sample 1: after its field size, its length
    raw[at : at + 8] = np.int64(11).tobytes()
    data.write_bytes(bytes(raw))
    ds = open_dataset(pack, block_size=4, verify_crc=False)
    with pytest.raises(CorruptSampleError, match=rf"{pack}.*sample 1: field 'tokens'.*11"):
        ds[:]


def test_lengths_read_from_the_documents_are_cached_for_those_files(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFEED_INDEX_DIR", str(tmp_path / "index"))
    pack = _write(tmp_path / "p", "lmdb")
    assert np.array_equal(torch.stack(open_dataset(pack, block_size=32)[:]).numpy(), _windows(32))
    (cache,) = (tmp_path / "index").glob("tokens-*.npz")
    with np.load(cache) as z:
        saved = {k: z[k] for k in z.files}
    assert saved["lengths"].tolist() == [len(d) for d in DOCS]
    saved["lengths"][0] += 1  # a cache that lies, for these very files
    np.savez(cache, **saved)
    ds = open_dataset(pack, block_size=32)  # taken from the cache: no document read
    with pytest.raises(CorruptSampleError, match=rf"{pack}.*sample 0: holds \d+ tokens"):
        ds[0]  # caught when read, never a shifted window
    other = _docs(50, seed=5)
    _write(tmp_path / "p2", "lmdb", docs=other)
    shutil.rmtree(pack)
    shutil.copytree(tmp_path / "p2", pack)  # another pack at the same path: rebuilt
    got = open_dataset(pack, block_size=8)
    stream = np.concatenate(other)
    assert np.array_equal(
        torch.stack(got[:]).numpy(), stream[: len(stream) // 8 * 8].reshape(-1, 8)
    )


@pytest.fixture(scope="module")
def h5_packs(tmp_path_factory):
    """HDF5 token packs read through h5py: chunked (lzf) and contiguous (use_mmap=False)."""
    root = tmp_path_factory.mktemp("h5")
    lzf = root / "lzf"
    with gpufeed.Writer(lzf, "hdf5", schema={"tokens": "uint16[-1]"}, compression="lzf") as w:
        for d in DOCS:
            w.write({"tokens": d})
    return {"lzf": (lzf, {}), "plain": (_write(root / "plain", "hdf5"), {"use_mmap": False})}


@pytest.mark.parametrize("which", ["lzf", "plain"])
@pytest.mark.parametrize("eos", [None, EOS])
def test_hdf5_through_h5py_reads_a_batch_in_one_read(h5_packs, which, eos, monkeypatch):
    from gpufeed.data import tokens

    path, options = h5_packs[which]
    ds = open_dataset(path, block_size=32, eos=eos, **options)
    assert ds.mode == tokens.H5_SPANS
    calls = []

    def counted(*args):
        calls.append(args[1])
        return read_spans(*args)

    read_spans = tokens.read_h5_spans
    monkeypatch.setattr(tokens, "read_h5_spans", counted)
    want = _windows(32, eos)
    order = [9, 0, len(ds) - 1, 9, 4, 5]  # a repeat, neighbours, the last window
    assert np.array_equal(torch.stack(ds[order]).numpy(), want[order])
    assert len(calls) == 1  # the whole batch: one read of its byte spans
    assert np.array_equal(torch.stack(ds[:]).numpy(), want)
    windowed = open_dataset(path, block_size=40, eos=eos, boundaries=True, **options)
    mapped = open_dataset(h5_packs["plain"][0], block_size=40, eos=eos, boundaries=True)
    assert mapped.mode == tokens.MAPPED and len(windowed) == len(mapped)
    for a, b in zip(windowed[:], mapped[:], strict=True):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["mask"], b["mask"])


def test_read_h5_spans_merges_overlaps_and_gives_each_position(tmp_path):
    import h5py

    from gpufeed.data.token_reads import SPAN_GAP, read_h5_spans

    data = np.arange(20000, dtype=np.int64).astype(np.uint8)
    with h5py.File(tmp_path / "x.h5", "w") as f:
        f.create_dataset("d", data=data, chunks=(64,), compression="lzf")
    assert SPAN_GAP == 4096
    with h5py.File(tmp_path / "x.h5", "r") as f:
        starts = np.array([500, 10, 20, 30, 19999, 0, 9000])
        sizes = np.array([40, 15, 5, 0, 1, 3, 10])
        buf, spans = read_h5_spans(f["d"], starts, sizes, tmp_path / "x.h5")
        # merged: [0, 540) (gaps under SPAN_GAP read through), [9000, 9010), [19999, 20000)
        assert len(buf) == 540 + 10 + 1
        assert spans.starts.tolist() == [0, 9000, 19999] and spans.at.tolist() == [0, 540, 550]
        for a, n in zip(starts.tolist(), sizes.tolist(), strict=True):
            at = int(spans.locate(np.array([a]))[0])
            assert np.array_equal(buf[at : at + n], data[a : a + n])


def test_a_damaged_record_head_through_h5py_is_an_error_naming_file_and_sample(tmp_path):
    import h5py

    pack = tmp_path / "bad"
    with gpufeed.Writer(pack, "hdf5", schema={"tokens": "uint16[-1]"}, compression="lzf") as w:
        for _ in range(3):
            w.write({"tokens": np.arange(10, dtype=np.uint16)})
    with h5py.File(pack / "data.h5", "r+") as f:
        at = int(f["offsets"][1]) + 8  # sample 1's length, after its field size
        f["encoded"][at : at + 8] = np.frombuffer(np.int64(11).tobytes(), np.uint8)
    ds = open_dataset(pack, block_size=4, verify_crc=False)
    with pytest.raises(CorruptSampleError, match=rf"{pack}.*sample 1: field 'tokens'.*11"):
        ds[:]


def _chars(text: str) -> list[int]:
    return [ord(c) - 96 for c in text]


def test_eos_the_pack_was_written_with_is_not_appended_twice(tmp_path):
    texts = ["abc", "", "defgh", "ij"]
    pack = tmp_path / "p"
    gpufeed.pack_tokens(texts, pack, tokenize=_chars, vocab_size=100, eos=99, workers=0,
                        quiet=True)  # fmt: skip
    stream = [1, 2, 3, 99, 99, 4, 5, 6, 7, 8, 99, 9, 10, 99]
    want = np.array(stream[:12], np.uint16).reshape(-1, 4)
    for eos in (None, 99):  # the same id asked again: already in the stream
        ds = open_dataset(pack, block_size=4, eos=eos)
        assert ds.stream_eos == 99 and ds.eos is None and len(ds) == 3
        assert np.array_equal(torch.stack(ds[:]).numpy(), want)
    bounded = open_dataset(pack, block_size=4, eos=99, boundaries=True)
    assert [w["mask"].sum().item() for w in bounded[:]] == [4, 1, 4, 2, 3]  # no second eos
    with pytest.raises(UsageError, match=r"already end with eos 99 \(manifest tokens.eos\)"):
        open_dataset(pack, block_size=4, eos=0)
    manifest = json.loads((pack / "manifest.json").read_text())
    manifest["tokens"]["eos"] = 70000  # no uint16
    (pack / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"{pack}: manifest tokens.eos=70000 does not fit"):
        open_dataset(pack, block_size=4)


def test_make_loaders_blocks_to_come_are_asked_for_as_their_documents_bytes(packs, monkeypatch):
    from gpufeed.data import tokens
    from gpufeed.data.samplers import LookaheadBatch
    from gpufeed.pagecache.plan import BatchReadAhead

    ds = open_dataset(packs["mmap"], block_size=32)
    asked = []
    monkeypatch.setattr(tokens, "looks_cached", lambda addr, n: False)  # as if cold
    monkeypatch.setattr(ds.reader, "cached", None)
    monkeypatch.setattr(tokens, "advise_willneed", lambda regions: asked.extend(regions))
    batch = LookaheadBatch([5, 1], BatchReadAhead(ranges=[(0, 4), (10, 12)]))
    want = _windows(32)
    assert np.array_equal(torch.stack(ds.__getitems__(batch)).numpy(), want[[5, 1]])
    base, offsets = ds._mapped().ctypes.data, ds.reader.offsets
    starts = np.concatenate(([0], np.cumsum([len(d) for d in DOCS])))
    spans = []
    for a, b in [(0, 4), (10, 12)]:  # the documents holding tokens [32a, 32b)
        first = np.searchsorted(starts, 32 * a, side="right") - 1
        last = np.searchsorted(starts, 32 * b - 1, side="right") - 1
        spans.append((base + int(offsets[first]), int(offsets[last + 1] - offsets[first])))
    assert asked[: len(spans)] == spans  # the blocks first, then the batch's own pieces
