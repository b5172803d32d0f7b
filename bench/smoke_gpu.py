"""GPU smoke benchmark: `make smoke-gpu` (or python bench/smoke_gpu.py [--json FILE]).

One short script (well under 10 minutes on any GPU) that measures what only a GPU can show:

1. host-to-device bandwidth from pinned vs pageable memory;
2. the data-starvation percentage of a compute-bound model step fed by DevicePrefetcher from
   a real gpufeed loader (pinned batches of a small pack made here), against the same step
   with the batches already on the GPU (and against plain blocking copies);
3. uint8 transfer + normalisation on the GPU vs normalising on the host and moving float32.

Without CUDA it says "no CUDA device: GPU measurements skipped", still runs the CPU part
(pack, loader, prefetcher passthrough) and exits 0, unless GPUFEED_EXPECT_GPU=1 (a GPU runner,
where a missing device is the failure to report): then it exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "app" / "src"))


def make_pack(root: Path, count: int, shape) -> Path:
    import numpy as np

    import gpufeed

    src = root / "src" / "c0"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        np.save(src / f"{i:05d}.npy", rng.integers(0, 256, shape, dtype=np.uint8))
    dest = root / "pack"
    gpufeed.pack(root / "src", dest, format="mmap", workers=1, quiet=True)
    return dest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    ap.add_argument("--samples", type=int, default=1024, help="samples in the test pack")
    ap.add_argument("--size", type=int, default=224, help="image side (3 x size x size)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=25.0, help="compute step per batch")
    args = ap.parse_args(argv)

    import torch

    import gpufeed
    from gpufeed.tools.bench import EXPECT_GPU_ENV
    from gpufeed.tools.gpu_report import NO_CUDA, gpu_report

    t0 = time.perf_counter()
    expect = os.environ.get(EXPECT_GPU_ENV, "") not in ("", "0")
    cuda = torch.cuda.is_available()
    report: dict = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda": cuda}
    print(
        f"torch {torch.__version__} (CUDA build {torch.version.cuda}); CUDA visible: {cuda}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        shape = (3, args.size, args.size)
        pack = make_pack(Path(tmp), args.samples, shape)
        ds = gpufeed.open_dataset(pack)
        loader = gpufeed.make_loader(ds, args.batch_size, num_workers=2, pin_memory=cuda)
        batches = []
        for b in loader:
            batches.append(b)
            if len(batches) == 4:
                break
        # the CPU path: the prefetcher passes batches through with the same conversions
        x, _ = next(iter(gpufeed.DevicePrefetcher(batches[:1], "cpu")))
        assert x.dtype == torch.float32 and float(x.max()) <= 1.0
        report["cpu_path"] = f"pack + loader + DevicePrefetcher(cpu): {tuple(x.shape)} float32"
        print(report["cpu_path"], flush=True)
        if cuda:
            report["gpu"] = gpu_report(
                [(s, y) for s, y in batches], step_ms=args.step_ms, log=print
            )
        else:
            report["gpu"] = {"skipped": NO_CUDA}
            print(NO_CUDA, flush=True)
        del loader
    report["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not cuda and expect:
        print(
            f"error: {EXPECT_GPU_ENV}=1 but torch sees no CUDA device; check the driver, "
            f"`nvidia-smi`, and that the container was given the GPU (--gpus all)",
            file=sys.stderr,
        )
        return 1
    print(f"smoke-gpu done in {report['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
