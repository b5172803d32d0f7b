"""gpufeed.integrations.ray.PackSink on a local Ray cluster (2 CPUs): a part a write task,
merged in task order; a write task whose worker dies mid-part is retried, and the pack holds
every sample exactly once, in order."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import gpufeed

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402 - the one Ray pickles tasks with

from gpufeed.integrations.ray import PackSink  # noqa: E402

SCHEMA = {"x": "uint8[4]", "label": "int"}


class DyingSink(PackSink):
    """Task 1's first attempt dies (os._exit: a lost worker) after its first block, its part
    half written; the flag file says it died already."""

    def __init__(self, dest, flag, **kw):
        super().__init__(dest, **kw)
        self.flag = flag

    def write(self, blocks, ctx):
        if ctx.task_idx != 1 or os.path.exists(self.flag):
            return super().write(blocks, ctx)
        open(self.flag, "w").close()

        def dying():
            for k, block in enumerate(blocks):
                if k == 1:
                    os._exit(1)
                yield block

        return super().write(dying(), ctx)


@pytest.fixture(scope="module")
def cluster():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().execution_options.preserve_order = True
    yield
    ray.shutdown()


def dataset(n: int, blocks: int):
    rows = [{"x": np.full(4, i % 256, np.uint8), "label": i} for i in range(n)]
    return ray.data.from_items(rows, override_num_blocks=blocks)


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_pack_sink_writes_every_row_once_in_order(cluster, tmp_path, fmt):
    dest = tmp_path / "pack"
    dataset(50, 5).write_datasink(PackSink(dest, format=fmt, schema=SCHEMA))
    ds = gpufeed.open_dataset(dest)
    assert [int(ds[i]["label"]) for i in range(len(ds))] == list(range(50))
    assert not (tmp_path / "pack.parts").exists()
    assert gpufeed.verify(dest).ok


def test_a_retried_write_task_leaves_no_duplicate_or_missing_sample(cluster, tmp_path):
    dest, flag = tmp_path / "pack", str(tmp_path / "died")
    # 4 write tasks of 2 blocks each (map_batches keeps blocks apart until the write)
    data = dataset(80, 8).repartition(4)
    data = data.map_batches(lambda b: b, batch_size=10)
    data.write_datasink(DyingSink(dest, flag, format="tar", schema=SCHEMA))
    assert os.path.exists(flag)  # the first attempt did die
    ds = gpufeed.open_dataset(dest)
    assert [int(ds[i]["label"]) for i in range(len(ds))] == list(range(80))


def test_gpufeed_ray_is_the_pack_sink(cluster, tmp_path):
    import gpufeed.ray

    assert gpufeed.ray.PackSink is PackSink and gpufeed.ray.__all__ == ["PackSink"]
    dest = tmp_path / "pack"
    dataset(12, 3).write_datasink(gpufeed.ray.PackSink(dest, format="mmap", schema=SCHEMA))
    ds = gpufeed.open_dataset(dest)
    assert [(int(ds[i]["label"]), ds[i]["x"].tolist()) for i in range(12)] == [
        (i, [i] * 4) for i in range(12)
    ]


CHECK_IMPORTS = """
import sys
import gpufeed
gpufeed.Writer, gpufeed.merge, gpufeed.open_dataset, gpufeed.make_loader
import gpufeed.integrations
assert not [m for m in sys.modules if m == "ray" or m.startswith("ray.")], "ray imported"
sys.modules["ray"] = None  # as where Ray is not installed
try:
    import gpufeed.ray
except ImportError as e:
    print(e)
else:
    raise SystemExit("gpufeed.ray imported without ray")
"""


def test_import_gpufeed_never_imports_ray_and_gpufeed_ray_says_what_to_install(python_env):
    run = subprocess.run(
        [sys.executable, "-c", CHECK_IMPORTS],
        env=python_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr + run.stdout
    assert "gpufeed.ray (PackSink) needs Ray Data, which is not installed" in run.stdout
    assert "pip install 'ray[data]'" in run.stdout
