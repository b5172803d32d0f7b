"""gpufeed: packed datasets that keep the GPU fed.

    gpufeed.pack(source, dest, format="hdf5")       files -> packed format (+ manifest.json)
    gpufeed.pack_samples(samples, dest)             samples held in Python -> packed format
    gpufeed.pack_map(fn, inputs, dest, workers=8)   fn(input) in worker processes -> packed
    gpufeed.pack_tokens(texts, dest, tokenize=enc)  texts -> token ids in worker processes
    gpufeed.Writer(dest, format, schema)            sample dicts -> packed format
    gpufeed.merge(parts, dest)                      packs written anywhere -> one pack
    gpufeed.verify(dest) / gpufeed.inspect(dest)    check / describe a pack
    gpufeed.open_dataset(dest)                      the right dataset for a pack
    gpufeed.mix(datasets, weights)                  a weighted mixture of datasets
    gpufeed.make_loader(dataset, batch_size)        a DataLoader with measured defaults
    gpufeed.DevicePrefetcher(loader)                batches on the GPU, copies overlapped
    gpufeed.watch(loader)                           data wait vs compute, per step
    gpufeed.diagnose()                              is this machine set up to feed a GPU?

These are the names a training script writes (``gpufeed.__all__``, merge and pack_tokens
aside: packing pipeline steps, importable as gpufeed.merge and gpufeed.pack_tokens but kept
out of the small ``__all__`` that tests/unit/test_layout.py caps); everything else is
reachable by its module path, one package per stage (docs/architecture.md): gpufeed.formats,
gpufeed.storage, gpufeed.write, gpufeed.data, gpufeed.loading, gpufeed.system,
gpufeed.tools; gpufeed.errors holds every error class.

Names are imported on first use, so `import gpufeed` (and the CLI's start) stays light.
"""

from __future__ import annotations

import importlib

from gpufeed._version import __version__

# name -> the module that defines it
_EXPORTS = {
    "pack": "gpufeed.write.pack",
    "pack_samples": "gpufeed.write.pack",
    "pack_map": "gpufeed.write.pack",
    "Writer": "gpufeed.write.writer",
    "verify": "gpufeed.tools.verify",
    "inspect": "gpufeed.tools.verify",
    "open_dataset": "gpufeed.data.open",
    "mix": "gpufeed.data.mixture",
    "make_loader": "gpufeed.loading.make",
    "DevicePrefetcher": "gpufeed.loading.prefetch",
    "Batch": "gpufeed.batch",
    "collate": "gpufeed.batch",
    "RandomResizedCrop": "gpufeed.data.decoders",
    "watch": "gpufeed.tools.watch",
    "diagnose": "gpufeed.tools.doctor",
    "GpufeedError": "gpufeed.errors",
    "DataError": "gpufeed.errors",
    "NotPackedError": "gpufeed.errors",
    "CorruptSampleError": "gpufeed.errors",
}
# resolved as the names above, not in __all__ (see the module docstring)
_PIPELINE = {"merge": "gpufeed.write.merge", "pack_tokens": "gpufeed.write.token_pack"}

# Names gpufeed exported at the top level before 0.2, removed in 0.2 (CHANGELOG.md): asking
# for one is an AttributeError that says where it lives.
_REMOVED = {
    "scan_source": "gpufeed.formats.inplace.tree",
    "VerifyReport": "gpufeed.tools.verify",
    "read_manifest": "gpufeed.formats.manifest",
    "PackedDataset": "gpufeed.data.map_style",
    "HDF5Dataset": "gpufeed.data.map_style",
    "LMDBDataset": "gpufeed.data.map_style",
    "MmapDataset": "gpufeed.data.map_style",
    "TarIndexedDataset": "gpufeed.data.map_style",
    "TarShardDataset": "gpufeed.data.streaming",
    "decode_image": "gpufeed.data.decoders",
    "UsageError": "gpufeed.errors",
    "SourceError": "gpufeed.errors",
    "GpufeedLoader": "gpufeed.loading.loader",
    "LoaderPlan": "gpufeed.loading.plan",
    "plan_workers": "gpufeed.loading.plan",
    "ShmBudgetWarning": "gpufeed.errors",
    "BlockShuffleSampler": "gpufeed.data.samplers",
    "SortedBatchSampler": "gpufeed.data.samplers",
    "block_shuffle_order": "gpufeed.data.order",
    "split_shards": "gpufeed.data.distributed",
    "DistributedBlockSampler": "gpufeed.data.distributed",
    "rank_and_world": "gpufeed.data.distributed",
    "usable_cpus": "gpufeed.system.sysinfo",
    "cgroup_memory_limit": "gpufeed.system.sysinfo",
    "shm_size_bytes": "gpufeed.system.sysinfo",
    "DoctorReport": "gpufeed.tools.doctor",
    "Watch": "gpufeed.tools.watch",
    "WatchSummary": "gpufeed.tools.watch",
    "synth_image_folder": "gpufeed.tools.synth",
    "BenchResult": "gpufeed.tools.timing",
    "time_batches": "gpufeed.tools.timing",
    "run_bench": "gpufeed.tools.bench",
    "gpu_report": "gpufeed.tools.gpu_report",
    "TuneResult": "gpufeed.tools.tune_result",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name) or _PIPELINE.get(name)
    if module is None and name in _REMOVED:
        raise AttributeError(
            f"gpufeed.{name} was removed in 0.2: use {_REMOVED[name]}.{name} (CHANGELOG.md)"
        )
    if module is None:
        raise AttributeError(f"module 'gpufeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS, *_PIPELINE])


__all__ = ["__version__", *_EXPORTS]
