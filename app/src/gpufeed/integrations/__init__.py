"""Thin adapters for the engines users already run: each writes or reads gpufeed packs
through the public API (gpufeed.Writer, gpufeed.merge), never through format internals.

    gpufeed.integrations.ray.PackSink          a Ray Data Datasink (also gpufeed.ray.PackSink)
    gpufeed.integrations.spark.write_partitions a Spark DataFrame or RDD, a part a partition
    gpufeed.integrations.dask.write_partitions  a Dask bag or DataFrame, a part a partition

Each writes one part a task and merges them on the driver by one protocol
(gpufeed.integrations.parts): an attempt's part has a name of its own, and exactly one
counted part a partition is merged, so a retried task leaves no sample twice or missing.

An engine's own package is imported only by its module here (``import gpufeed`` never
imports Ray, Spark or Dask).
"""
