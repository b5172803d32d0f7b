"""GPU smoke benchmark: `make smoke-gpu` (or python bench/studies/smoke_gpu.py [--json FILE]).

One short script (well under 10 minutes on any GPU) that measures what only a GPU can show:

1. host-to-device bandwidth from pinned vs pageable memory;
2. the data-starvation percentage of a compute-bound model step fed by DevicePrefetcher from
   a real gpufeed loader (pinned batches of a small pack made here), against the same step
   with the batches already on the GPU (and against plain blocking copies);
3. uint8 transfer + normalisation on the GPU vs normalising on the host and moving float32;
4. JPEG decode + RandomResizedCrop + flip on the GPU (DevicePrefetcher(decode=crop): encoded
   bytes pinned, torchvision's batched nvJPEG decode on the side stream) against the CPU
   decoder in the loader: samples/s, GPU time per batch, starvation of a compute-bound step.

Without CUDA it says "no CUDA device: GPU measurements skipped", still runs the CPU part
(pack, loader, prefetcher passthrough) and exits 0, unless GPUFEED_EXPECT_GPU=1 (a GPU runner,
where a missing device is the failure to report): then it exits 1.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a file (tests/gpu/smoke.py, device_checks.sh)

from bench.studies import common  # noqa: E402 - it puts gpufeed's sources on the path too


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


def make_jpeg_pack(root: Path, count: int, hw=(375, 500)) -> Path:
    """ImageNet-sized JPEGs (quality 90), packed as mmap."""
    import io

    import numpy as np
    from PIL import Image

    import gpufeed

    src = root / "jpeg-src" / "c0"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        small = rng.integers(0, 256, (hw[0] // 8, hw[1] // 8, 3), dtype=np.uint8)
        img = Image.fromarray(small).resize(hw[::-1], Image.BICUBIC)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        (src / f"{i:05d}.jpg").write_bytes(buf.getvalue())
    dest = root / "jpeg-pack"
    gpufeed.pack(root / "jpeg-src", dest, format="mmap", workers=1, quiet=True)
    return dest


def _feed_rate(batches, step, seconds: float):
    """(samples/s, seconds per batch) of ``step`` over ``batches`` for about ``seconds``."""
    import torch

    n = done = 0
    t0 = time.perf_counter()
    for x, _ in batches:
        step(x)
        n, done = n + len(x), done + 1
        if time.perf_counter() - t0 > seconds:
            break
    torch.cuda.synchronize()
    took = time.perf_counter() - t0
    return n / took, took / max(done, 1)


def jpeg_rows(pack: Path, batch_size: int, step_ms: float, log) -> dict:
    """GPU decode against CPU decode, each feeding the same compute-bound step."""
    import statistics

    import torch

    import gpufeed
    from gpufeed.tools.gpu_report import calibrated_step

    out: dict = {}
    crop = gpufeed.RandomResizedCrop(224)
    dev = torch.device("cuda")
    enc = gpufeed.make_loader(gpufeed.open_dataset(pack, decode=False), batch_size, True)
    gpu = gpufeed.DevicePrefetcher(enc, dev, decode=crop, decode_on="cuda")
    cpu_loader = gpufeed.make_loader(gpufeed.open_dataset(pack, decode=crop), batch_size, True)
    cpu = gpufeed.DevicePrefetcher(cpu_loader, dev)
    host = next(iter(enc))
    times = []
    for _ in range(5):  # the decode alone, on the GPU, per batch
        torch.cuda.synchronize()
        t = time.perf_counter()
        gpu.decode(host)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    out["gpu_decode_ms_per_batch"] = statistics.median(times[1:]) * 1e3
    for name, feed in (("gpu_decode", gpu), ("cpu_decode", cpu)):
        _feed_rate(feed, lambda x: None, 1.0)  # warm-up
        out[f"{name}_samples_per_s"], _ = _feed_rate(feed, lambda x: None, 3.0)
    step, _ = calibrated_step(dev, step_ms)
    resident = torch.zeros(batch_size, 3, 224, 224, dtype=torch.uint8, device=dev)
    _, t_step = _feed_rate([(resident, None)] * 20, step, 1.0)  # the step alone
    for name, feed in (("gpu_decode", gpu), ("cpu_decode", cpu)):
        _, t_fed = _feed_rate(feed, step, 3.0)
        out[f"{name}_starvation_pct"] = max(0.0, (t_fed - t_step) / t_fed * 100)
    out["gpu_fallback_batches"] = gpu.decode.fallbacks
    log(
        f"JPEG 500x375 -> RandomResizedCrop(224) + flip, batches of {batch_size}: GPU decode "
        f"{out['gpu_decode_samples_per_s']:,.0f} samples/s ({out['gpu_decode_ms_per_batch']:.1f} "
        f"ms GPU time per batch, starves a {t_step * 1e3:.0f} ms step "
        f"{out['gpu_decode_starvation_pct']:.1f}%), CPU decode "
        f"{out['cpu_decode_samples_per_s']:,.0f} samples/s (starves "
        f"{out['cpu_decode_starvation_pct']:.1f}%)"
    )
    return out


def summary(report: dict) -> str:
    """The markdown: one line per check (the GPU's measurements as their JSON)."""
    lines = [f"- torch {report['torch']} (CUDA build {report['cuda_build']})"]
    lines += [f"- {report[k]}" for k in ("cpu_path", "cpu_decode_path") if k in report]
    lines.append(f"- gpu: {json.dumps(report.get('gpu'), default=str)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = common.parser(__doc__, rounds=1)
    ap.add_argument("--samples", type=int, default=1024, help="samples in the test pack")
    ap.add_argument("--size", type=int, default=224, help="image side (3 x size x size)")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=25.0, help="compute step per batch")
    ap.add_argument("--jpegs", type=int, default=512, help="500x375 JPEGs for the decode rows")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.jpegs = min(args.samples, 64), min(args.jpegs, 32)

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
        jpegs = make_jpeg_pack(Path(tmp), args.jpegs)
        # the GPU decode's CPU fallback, run everywhere: the same pipeline, decoded on the CPU
        enc = gpufeed.make_loader(gpufeed.open_dataset(jpegs, decode=False), 8, num_workers=0)
        crop = gpufeed.RandomResizedCrop(224)
        x, _ = next(iter(gpufeed.DevicePrefetcher(enc, "cpu", decode=crop)))
        assert x.shape == (8, 3, 224, 224) and x.dtype == torch.float32
        report["cpu_decode_path"] = "encoded JPEGs + DevicePrefetcher(cpu, decode=crop): ok"
        print(report["cpu_decode_path"], flush=True)
        if cuda:
            report["gpu"] = gpu_report(
                [(s, y) for s, y in batches], step_ms=args.step_ms, log=print
            )
            report["gpu"]["jpeg"] = jpeg_rows(jpegs, args.batch_size, args.step_ms, print)
        else:
            report["gpu"] = {"skipped": NO_CUDA}
            print(NO_CUDA, flush=True)
        del loader
    report["seconds"] = time.perf_counter() - t0
    common.write(args, "smoke_gpu", report, summary(report))
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
