"""gpufeed.integrations.spark and .dask on a real local Spark (local[2,2]: two task threads,
a task tried twice) and real Dask schedulers (synchronous, threads, a distributed
LocalCluster of two worker processes): a part per partition, merged in partition order;
a task that fails half-way through its part and is retried, and a partition written twice
(a speculative or recomputed copy that finished too), leave every sample exactly once, in
order, and nothing in DEST.parts/."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

import gpufeed
from gpufeed.errors import UsageError
from gpufeed.integrations.parts import PartWriter, merge_parts, parts_folder, remove_parts

SCHEMA = {"x": "bytes", "label": "int"}


def row(i: int) -> dict:
    return {"x": bytes([i % 256]) * (1 + i % 5), "label": i}


def contents(dest: Path) -> list[tuple[bytes, int]]:
    ds = gpufeed.open_dataset(dest)
    return [(bytes(ds[i]["x"]), int(ds[i]["label"])) for i in range(len(ds))]


def expected(n: int) -> list[tuple[bytes, int]]:
    return [(row(i)["x"], i) for i in range(n)]


class FailOnce:
    """to_sample that fails the first attempt of the task holding label ``at`` (its part half
    written: ``part_size`` samples committed before it); the marker file says it failed."""

    def __init__(self, at: int, marker: Path):
        self.at, self.marker = at, str(marker)

    def __call__(self, sample: dict) -> dict:
        sample = dict(sample)
        if sample["label"] == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            raise RuntimeError("this attempt dies half-way through its part")
        return sample


def assert_one_clean_pack(dest: Path, n: int) -> None:
    assert contents(dest) == expected(n)
    assert not parts_folder(dest).exists()
    assert gpufeed.verify(dest).ok


# -- the protocol both share ---------------------------------------------------------------
def test_a_partition_written_twice_is_merged_once(tmp_path):
    dest = tmp_path / "pack"
    write = PartWriter(str(parts_folder(dest)), "tar", SCHEMA, options={"shard_size": 4})
    results = [write(k, [row(i) for i in range(10 * k, 10 * k + 10)]) for k in range(3)]
    write(1, [row(i) for i in range(10, 20)])  # a speculative copy of partition 1, finished
    assert len(list(parts_folder(dest).iterdir())) == 4
    merge_parts(results, 3, dest)
    assert_one_clean_pack(dest, 30)


def test_a_missing_or_doubled_partition_is_refused_naming_it(tmp_path):
    dest = tmp_path / "pack"
    write = PartWriter(str(parts_folder(dest)), "tar", SCHEMA)
    first, second = write(0, [row(0)]), write(1, [row(1)])
    with pytest.raises(UsageError, match=r"partitions \[1\]: no part written"):
        merge_parts([first], 2, dest)
    with pytest.raises(UsageError, match="partition 0: two results"):
        merge_parts([first, write(0, [row(0)]), second], 2, dest)
    assert not dest.exists()


def test_a_url_destination_is_refused_before_any_task_runs():
    with pytest.raises(UsageError, match="s3://bucket/pack: needs a local path here"):
        parts_folder("s3://bucket/pack")


# -- Spark ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spark():
    pytest.importorskip("pyspark")
    if not (shutil.which("java") or os.environ.get("JAVA_HOME")):
        pytest.fail("pyspark needs a Java 17+ runtime: apt-get install openjdk-17-jre-headless")
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # executors cannot import tests
    # the executors' Python: SparkContext reads this variable (spark.pyspark.python is for
    # spark-submit); python3 on PATH may be another interpreter, without gpufeed
    before = os.environ.get("PYSPARK_PYTHON")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        # 2 task threads, a task tried at most twice (local mode ignores spark.task.maxFailures)
        SparkSession.builder.master("local[2,2]")
        .appName("gpufeed-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "512m")
        # a short-lived JVM: the quick compiler only (start and first job ~25% faster here)
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
    stop_jvm()
    if before is None:
        del os.environ["PYSPARK_PYTHON"]
    else:
        os.environ["PYSPARK_PYTHON"] = before


def stop_jvm() -> None:
    """End the driver's JVM (session.stop() leaves it, ~300 MB, for the rest of the run):
    Spark's gateway exits when its stdin closes."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway
    if gateway is None:
        return
    gateway.shutdown()
    gateway.proc.stdin.close()
    gateway.proc.wait(timeout=60)
    SparkContext._gateway = SparkContext._jvm = None


@pytest.mark.slow
def test_spark_dataframe_partitions_make_one_pack_in_order(spark, tmp_path):
    from gpufeed.integrations.spark import write_partitions

    data = [(row(i)["x"], i) for i in range(40)]
    df = spark.createDataFrame(spark.sparkContext.parallelize(data, 4), "x binary, label int")
    assert df.rdd.getNumPartitions() == 4
    manifest = write_partitions(df, tmp_path / "pack", format="tar", schema=SCHEMA, shard_size=3)
    assert manifest["count"] == 40
    assert_one_clean_pack(tmp_path / "pack", 40)


@pytest.mark.slow
def test_spark_rdd_with_to_sample_and_a_retried_task(spark, tmp_path):
    from gpufeed.integrations.spark import write_partitions

    marker = tmp_path / "failed-once"
    rdd = spark.sparkContext.parallelize([row(i) for i in range(60)], 4)  # 15 a partition
    fail = FailOnce(at=37, marker=marker)  # partition 2's 8th row
    dest = tmp_path / "pack"
    write_partitions(
        rdd, dest, format="hdf5", schema=SCHEMA, to_sample=fail, part_size=5, keep_parts=True
    )
    assert marker.exists()
    # the failed attempt's unfinished part (samples 30-34 committed) is there, not merged
    left = sorted(p.name for p in parts_folder(dest).iterdir())
    assert [name[:11] for name in left] == [f"part-00000{k}" for k in (0, 1, 2, 2, 3)]
    assert sum(name.endswith(".partial") for name in left) == 1
    assert contents(dest) == expected(60)
    remove_parts(parts_folder(dest))
    assert_one_clean_pack(dest, 60)


@pytest.mark.slow
def test_spark_an_empty_rdd_makes_an_empty_pack(spark, tmp_path):
    from gpufeed.integrations.spark import write_partitions

    rdd = spark.sparkContext.emptyRDD()
    assert rdd.getNumPartitions() == 0
    assert write_partitions(rdd, tmp_path / "pack", schema=SCHEMA)["count"] == 0
    assert_one_clean_pack(tmp_path / "pack", 0)


# -- Dask ----------------------------------------------------------------------------------
def test_dask_bag_on_the_synchronous_scheduler(tmp_path):
    pytest.importorskip("dask")
    import dask.bag as db

    from gpufeed.integrations.dask import write_partitions

    bag = db.from_sequence([row(i) for i in range(23)], npartitions=5)
    write_partitions(
        bag, tmp_path / "pack", format="lmdb", schema=SCHEMA, compute={"scheduler": "sync"}
    )
    assert_one_clean_pack(tmp_path / "pack", 23)


def test_dask_dataframe_rows_are_samples(tmp_path):
    pytest.importorskip("dask.dataframe")
    import dask
    import dask.dataframe as dd
    import pandas as pd

    from gpufeed.integrations.dask import write_partitions

    frame = pd.DataFrame({"x": [row(i)["x"] for i in range(17)], "label": range(17)})
    frame["caption"] = [f"a {i}" for i in range(17)]
    # bytes columns stay bytes (Dask makes object columns pyarrow strings by default)
    with dask.config.set({"dataframe.convert-string": False}):
        df = dd.from_pandas(frame, npartitions=3)
        schema = {"x": "bytes", "label": "int", "caption": "str"}
        write_partitions(df, tmp_path / "pack", format="mmap", schema=schema)
    ds = gpufeed.open_dataset(tmp_path / "pack")
    assert [ds[i]["caption"] for i in range(len(ds))] == [f"a {i}" for i in range(17)]
    assert_one_clean_pack(tmp_path / "pack", 17)


@pytest.mark.slow
def test_dask_distributed_retried_task(tmp_path):
    pytest.importorskip("distributed")
    import cloudpickle
    import dask.bag as db
    from distributed import Client, LocalCluster

    from gpufeed.integrations.dask import write_partitions

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests
    marker = tmp_path / "failed-once"
    bag = db.from_sequence([row(i) for i in range(40)], npartitions=4)
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=":0")
    with cluster, Client(cluster):
        fail = FailOnce(at=25, marker=marker)  # partition 2's 6th row, 4 samples committed
        write_partitions(
            bag,
            tmp_path / "pack",
            schema=SCHEMA,
            part_size=4,
            to_sample=fail,
            compute={"retries": 1},
        )
    assert marker.exists()
    assert_one_clean_pack(tmp_path / "pack", 40)
