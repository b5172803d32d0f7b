"""gpufeed.pack_samples(samples, DEST): samples given as Python objects (a list, a generator, an
array of rows) are packed as they are, in order, in every format."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import gpufeed
from gpufeed.errors import SourceError

FORMATS = ["hdf5", "lmdb", "tar", "mmap"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_list_of_arrays_comes_back_exact_as_field_x(tmp_path, fmt):
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((3, 4)).astype(np.float16) for _ in range(7)]
    manifest = gpufeed.pack_samples(arrays, tmp_path / "p", format=fmt, quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "p")
    assert manifest["count"] == len(ds) == 7
    for i in (0, 6, -1):
        x = ds[i]["x"]
        assert x.dtype == torch.float16 and np.array_equal(x.numpy(), arrays[i])


def test_pairs_from_a_generator_give_x_and_label_with_a_ragged_schema(tmp_path):
    pairs = ((torch.arange(i, dtype=torch.int32), i % 3) for i in range(6))
    gpufeed.pack_samples(
        pairs, tmp_path / "p", format="tar", schema={"x": "int32[-1]", "label": "int"}
    )
    ds = gpufeed.open_dataset(tmp_path / "p")
    assert [ds[i]["x"].tolist() for i in range(6)] == [list(range(i)) for i in range(6)]
    np.testing.assert_array_equal(ds.labels, np.arange(6) % 3)


def test_jpeg_bytes_with_a_label_are_an_image_field_kept_encoded(tmp_path):
    b = io.BytesIO()
    Image.fromarray(np.full((8, 6, 3), 200, np.uint8)).save(b, "JPEG")
    gpufeed.pack_samples([(b.getvalue(), 4)] * 3, tmp_path / "p", format="lmdb", quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "p", decode=False)
    assert bytes(ds[1]["image"]) == b.getvalue() and ds[1]["label"] == 4


def test_an_array_of_rows_and_a_list_of_dicts(tmp_path):
    rows = np.arange(24, dtype=np.uint8).reshape(4, 2, 3)
    gpufeed.pack_samples(rows, tmp_path / "rows", format="mmap", quiet=True)
    assert gpufeed.open_dataset(tmp_path / "rows")[3]["x"].tolist() == rows[3].tolist()
    dicts = [{"caption": f"c{i}", "score": i / 2} for i in range(3)]
    gpufeed.pack_samples(dicts, tmp_path / "dicts", format="hdf5", quiet=True)
    assert gpufeed.open_dataset(tmp_path / "dicts")[2] == {"caption": "c2", "score": 1.0}


def test_the_tutorial_loader_runs_over_packed_arrays(tmp_path):
    arrays = [np.full((2, 2), i, np.int64) for i in range(40)]
    gpufeed.pack_samples(arrays, tmp_path / "p", format="lmdb", quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "p")
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
    seen = sorted(int(v) for batch in loader for v in batch["x"][:, 0, 0])
    assert seen == list(range(40))


def test_a_sample_that_is_none_of_these_says_how_to_name_fields(tmp_path):
    with pytest.raises(SourceError, match=r"a sample is a dict of named fields.*got int"):
        gpufeed.pack_samples([1, 2], tmp_path / "p", quiet=True)
    assert not (tmp_path / "p").exists()


# ------------------------------------------------------------------ a generator is streamed
# issue 37 item 9: pack(generator, DEST) held every sample before writing one (MemoryError
# under a limit the Writer loop over the same data stays within). The child's address space
# is limited to what it uses after its imports plus LIMIT_MIB, less than the samples hold.
STREAM_CHILD = r"""
import resource, sys
import numpy as np
import torch  # noqa: F401 - what pack(samples) imports, counted in the baseline
import gpufeed, gpufeed.write.convert  # noqa: F401

def vm_size():
    for line in open("/proc/self/status"):
        if line.startswith("VmSize:"):
            return int(line.split()[1]) << 10

limit = vm_size() + (int(sys.argv[2]) << 20)
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

def samples():
    for i in range(int(sys.argv[3])):
        yield {"x": np.full(2 << 20, i % 251, dtype=np.uint8)}

try:
    m = gpufeed.pack_samples(samples(), sys.argv[1], format="tar", quiet=True, part_size=4)
except MemoryError:
    sys.exit("MemoryError")
print("packed", m["count"])
"""
LIMIT_MIB, SAMPLES = 128, 100  # 100 x 2 MiB = 200 MiB of samples; streamed, < 96 MiB used


def test_a_generator_of_large_samples_is_packed_in_bounded_memory(tmp_path, python_env):
    import subprocess
    import sys

    dest = tmp_path / "p"
    env = {**python_env, "MALLOC_ARENA_MAX": "2"}  # glibc's per-thread arenas reserve 64 MiB
    r = subprocess.run(
        [sys.executable, "-c", STREAM_CHILD, str(dest), str(LIMIT_MIB), str(SAMPLES)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "packed 100" in r.stdout, (r.returncode, r.stderr[-2000:])
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert len(ds) == SAMPLES
    for i in (0, 57, SAMPLES - 1):
        x = ds[i]["x"]
        assert x.shape == (2 << 20,) and int(x[0]) == int(x[-1]) == i % 251


def test_a_generator_is_consumed_as_written_and_a_resume_goes_on_after_the_committed(tmp_path):
    taken = []

    def samples(stop_at=None):
        for i in range(10):
            if i == stop_at:
                raise RuntimeError("stopped")
            taken.append(i)
            yield {"x": np.full(3, i, dtype=np.int16)}

    dest = tmp_path / "p"
    with pytest.raises(RuntimeError, match="stopped"):
        gpufeed.pack_samples(samples(stop_at=7), dest, format="mmap", quiet=True, part_size=3)
    taken.clear()
    m = gpufeed.pack_samples(samples(), dest, format="mmap", quiet=True, part_size=3, resume=True)
    assert taken == list(range(10))  # the committed 6 read and passed over, not converted
    ds = gpufeed.open_dataset(dest, map_style=True)
    assert m["count"] == len(ds) == 10
    assert [int(ds[i]["x"][0]) for i in range(10)] == list(range(10))


def test_a_generator_of_paths_through_workers_names_its_inputs(tmp_path):
    paths = []
    for i in range(40):
        path = tmp_path / f"in{i:02d}.txt"
        path.write_text(f"text {i}")
        paths.append(path)

    def read(path):
        text = path.read_text()
        if text == "text 33":
            raise ValueError("bad input")
        return {"text": text}

    m = gpufeed.pack_map(
        read, (p for p in paths), tmp_path / "p", format="lmdb", workers=2, quiet=True,
        on_error="skip",
    )  # fmt: skip
    assert m["count"] == 39
    assert [s["item"] for s in m["skipped"]] == [33]
    assert m["skipped"][0]["path"].endswith("in33.txt")
    ds = gpufeed.open_dataset(tmp_path / "p", map_style=True)
    assert [ds[i]["text"] for i in (0, 32, 33)] == ["text 0", "text 32", "text 34"]


def test_pack_samples_widens_a_size_that_varies_and_takes_a_partial_schema(tmp_path):
    """In-process (pack_samples' default), samples go through Writer.add_item: tokens of
    varying length become ragged; a schema naming one field declares it, the rest inferred."""
    samples = [{"t": np.arange(n, dtype=np.int32), "c": f"s{n}"} for n in (3, 5, 2)]
    gpufeed.pack_samples(samples, tmp_path / "a.lmdb", format="lmdb", quiet=True)
    ds = gpufeed.open_dataset(tmp_path / "a.lmdb")
    assert ds.reader.spec.schema.describe() == "t: int32[*], c: str"
    assert [len(ds[i]["t"]) for i in range(3)] == [3, 5, 2]
    gpufeed.pack_samples(
        samples, tmp_path / "b.lmdb", format="lmdb", quiet=True, schema={"t": "int64[-1]"}
    )
    ds = gpufeed.open_dataset(tmp_path / "b.lmdb")
    assert ds.reader.spec.schema.describe() == "t: int64[*], c: str"
    assert ds.reader.manifest["options"]["inferred_fields"] == ["c"]
