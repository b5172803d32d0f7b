"""gpufeed: packed datasets that keep the GPU fed.

    gpufeed.pack(source, dest, format="hdf5")       files -> packed format (+ manifest.json)
    gpufeed.verify(dest) / gpufeed.inspect(dest)    check / describe a pack
    gpufeed.open_dataset(dest)                      the right dataset for a pack
    gpufeed.make_loader(dataset, batch_size)        a DataLoader with measured defaults

Names are imported on first use, so `import gpufeed` (and the CLI's start) stays light.
"""

from __future__ import annotations

import importlib
import importlib.util

from gpufeed._version import __version__

# Eager: these functions share their module's name, and a submodule import would otherwise
# leave `gpufeed.pack` bound to the module instead of the function. None imports torch.
from gpufeed.pack import pack
from gpufeed.verify import inspect, verify
from gpufeed.watch import watch

_EXPORTS = {
    # packing, checking
    "scan_source": "gpufeed.pack",
    "VerifyReport": "gpufeed.verify",
    "read_manifest": "gpufeed.manifest",
    # reading
    "open_dataset": "gpufeed.datasets",
    "Batch": "gpufeed.datasets",
    "collate": "gpufeed.datasets",
    "PackedDataset": "gpufeed.datasets",
    "HDF5Dataset": "gpufeed.datasets",
    "LMDBDataset": "gpufeed.datasets",
    "MmapDataset": "gpufeed.datasets",
    "TarShardDataset": "gpufeed.datasets",
    "TarIndexedDataset": "gpufeed.datasets",
    "decode_image": "gpufeed.decoders",
    "RandomResizedCrop": "gpufeed.decoders",
    # errors
    "GpufeedError": "gpufeed.formats.common",
    "UsageError": "gpufeed.formats.common",
    "DataError": "gpufeed.formats.common",
    "SourceError": "gpufeed.formats.common",
    "CorruptSampleError": "gpufeed.formats.common",
    "NotPackedError": "gpufeed.formats.common",
    # loading (gpufeed.loader, gpufeed.prefetch, gpufeed.samplers)
    "make_loader": "gpufeed.loader",
    "GpufeedLoader": "gpufeed.loader",
    "LoaderPlan": "gpufeed.loader",
    "plan_workers": "gpufeed.loader",
    "ShmBudgetWarning": "gpufeed.loader",
    "DevicePrefetcher": "gpufeed.prefetch",
    "BlockShuffleSampler": "gpufeed.samplers",
    "SortedBatchSampler": "gpufeed.samplers",
    "block_shuffle_order": "gpufeed.samplers",
    # distributed (gpufeed.distributed) and the machine (gpufeed.sysinfo)
    "split_shards": "gpufeed.distributed",
    "DistributedBlockSampler": "gpufeed.distributed",
    "rank_and_world": "gpufeed.distributed",
    "usable_cpus": "gpufeed.sysinfo",
    "cgroup_memory_limit": "gpufeed.sysinfo",
    "shm_size_bytes": "gpufeed.sysinfo",
    # seeing the pipeline (gpufeed.doctor, gpufeed.watch, gpufeed.synth)
    "diagnose": "gpufeed.doctor",
    "DoctorReport": "gpufeed.doctor",
    "Watch": "gpufeed.watch",
    "WatchSummary": "gpufeed.watch",
    "synth_image_folder": "gpufeed.synth",
    # measuring and tuning (gpufeed.bench, gpufeed.tune: the modules keep those names)
    "BenchResult": "gpufeed.bench",
    "time_batches": "gpufeed.bench",
    "run_bench": "gpufeed.bench",
    "gpu_report": "gpufeed.bench",
    "TuneResult": "gpufeed.tune",
}


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpufeed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])


# Only what is installed: a module still being written (or left out) must not break `import *`.
__all__ = [
    "__version__",
    "inspect",
    "pack",
    "verify",
    "watch",
    *(n for n, m in _EXPORTS.items() if _available(m)),
]
