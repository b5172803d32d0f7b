"""``gpufeed.ray``: packing from a Ray cluster (the names of gpufeed.integrations.ray).

    import ray, gpufeed.ray
    ds = ray.data.read_parquet("s3://bucket/captions/")
    ds.write_datasink(gpufeed.ray.PackSink("/shared/caps.pack", format="tar",
                                           schema={"image": "jpeg", "caption": "str"}))

Needs Ray Data (``pip install 'ray[data]'``); without it, importing this module is an
ImportError that says so. ``import gpufeed`` never imports Ray: only this module and
gpufeed.integrations.ray do.
"""

from gpufeed.integrations.ray import PackSink

__all__ = ["PackSink"]
