"""JPEG decode + RandomResizedCrop + flip: the GPU decoders against the CPU ones, side by side
in one run on one machine (runs in the one prepared device script, bench/device_checks.sh).

    python bench/studies/gpu_decode.py [--images 1024] [--batch-size 256] [--json FILE]
                                       [--quick] [--out DIR]

Rows (samples/s of ImageNet-sized JPEGs, 500x375 and 375x500, quality 90, out 224x224):

- cpu native, 1 thread / all threads: gpufeed.RandomResizedCrop (gpufeed-jpeg, crop-aware
  decode without the GIL), one call per batch;
- cpu opencv: the same crop through simplejpeg + cv2 (the fallback backend);
- gpu torchvision decode: ``torchvision.io.decode_jpeg(list, device="cuda")`` alone (nvJPEG);
- gpu DeviceDecode: what ``DevicePrefetcher(decode=crop)`` runs: that decode, then every
  image's box resized (antialiased bilinear) and flipped on the GPU (batched products);
- gpu crop only: a per-image ``resized_crop`` loop against DeviceDecode's batched products
  (gpufeed.loading.batch_resize) on decoded images;
- gpu nvImageCodec decode (when ``nvidia.nvimgcodec`` imports): its default backends and
  the hardware decoder alone, to choose the GPU decoder by measurement.

Pixels: for the same boxes and flips (same torch seed), DeviceDecode on the GPU against the CPU
native crop and against torchvision's CPU reference (decode_jpeg + resized_crop, antialias):
largest and mean absolute difference, share of values more than 1 apart.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a file (device_checks.sh)

from bench.studies import common  # noqa: E402, I001 - first: it puts gpufeed on the path

import gpufeed  # noqa: E402
from gpufeed.batch import Batch  # noqa: E402
from gpufeed.loading.device_decode import DeviceDecode  # noqa: E402


def on_gpu(decode: DeviceDecode, payloads: list[torch.Tensor]) -> torch.Tensor:
    """What DevicePrefetcher(decode=crop) does to one batch of encoded samples."""
    return decode(Batch(payloads, torch.zeros(len(payloads), dtype=torch.int64))).samples


def make_jpegs(count: int, seed: int = 0) -> list[bytes]:
    """ImageNet-sized JPEGs: smooth random pictures with some texture, half of them portrait."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        h, w = (375, 500) if i % 2 == 0 else (500, 375)
        small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
        img = np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC)).astype(np.int16)
        img = np.clip(img + rng.integers(-12, 13, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def batches(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items) - size + 1, size)]


def rate(fn, groups: list, sync=lambda: None, rounds: int = 3) -> tuple[float, float]:
    """(samples/s, ms per batch): median of ``rounds`` passes over ``groups`` after one
    warm-up pass, ``sync`` before each clock read."""
    for g in groups[:2]:
        fn(g)
    sync()
    per_batch = []
    for _ in range(rounds):
        t = time.perf_counter()
        for g in groups:
            fn(g)
        sync()
        per_batch.append((time.perf_counter() - t) / len(groups))
    ms = statistics.median(per_batch)
    return len(groups[0]) / ms, ms * 1e3


def cpu_rows(jpegs: list[bytes], batch_size: int, rounds: int = 3) -> dict:
    """The CPU decoders, their passes interleaved (common.interleaved) after one warm-up."""
    from gpufeed.data.decoders import BACKENDS

    rows: dict = {}
    arrays = batches([np.frombuffer(b, dtype=np.uint8) for b in jpegs], batch_size)
    cpus = os.cpu_count() or 1
    passes = {}
    for backend, threads in (("native", 1), ("native", cpus), ("opencv", 1)):
        if backend not in BACKENDS:
            continue
        try:
            crop = gpufeed.RandomResizedCrop(224, backend=backend, threads=threads)
        except Exception as exc:  # noqa: BLE001 - a backend not installed here: say so
            rows[f"cpu {backend} x{threads}"] = f"not run: {exc}"
            continue
        crop(arrays[0])  # warm-up

        def one_pass(c=crop):
            for g in arrays:
                c(g)

        passes[f"cpu {backend} x{threads}"] = one_pass
    for name, seconds in common.interleaved(passes, rounds).items():
        ms = common.median(seconds) / len(arrays)
        rows[name] = (batch_size / ms, ms * 1e3)
    return rows


def gpu_rows(jpegs: list[bytes], batch_size: int, nvimgcodec: bool = True) -> dict:
    from torchvision.io import ImageReadMode, decode_jpeg

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    pinned = batches(
        [torch.frombuffer(bytearray(b), dtype=torch.uint8).pin_memory() for b in jpegs], batch_size
    )
    rows: dict = {}
    rows["gpu torchvision decode"] = rate(
        lambda g: decode_jpeg(g, mode=ImageReadMode.RGB, device=dev), pinned, sync
    )
    crop = gpufeed.RandomResizedCrop(224)
    dd = DeviceDecode(crop, dev)
    rows["gpu DeviceDecode (decode+crop)"] = rate(lambda g: on_gpu(dd, g), pinned, sync)
    decoded = decode_jpeg(pinned[0], mode=ImageReadMode.RGB, device=dev)
    rows.update(crop_only(decoded, crop, sync))
    if nvimgcodec:
        rows.update(nvimgcodec_rows(jpegs, batch_size, sync))
    return rows


def crop_only(images: list[torch.Tensor], crop, sync) -> dict:
    """The crop alone on decoded images: a per-image resized_crop loop (what DeviceDecode
    ran before) against DeviceDecode's batched products (gpufeed.loading.batch_resize)."""
    from torchvision.transforms.v2 import functional as F

    from gpufeed.loading.batch_resize import resized_crops

    sizes = np.array([img.shape[1:] for img in images])
    boxes = crop.crop_boxes(sizes[:, 0], sizes[:, 1])
    flips = np.zeros(len(images), dtype=bool)
    out = torch.empty((len(images), 3, 224, 224), dtype=torch.uint8, device=images[0].device)

    def loop(_):
        for n, (img, (t, le, h, w)) in enumerate(zip(images, boxes.tolist(), strict=True)):
            out[n] = F.resized_crop(img, t, le, h, w, [224, 224], antialias=True)

    from gpufeed.loading.batch_resize import aa_weights

    hw = torch.as_tensor(boxes[:, 2:], device=out.device)
    hmax, wmax = int(boxes[:, 2].max()), int(boxes[:, 3].max())
    padded = torch.rand(len(images), 3, hmax, wmax, device=out.device)
    wy, wx = aa_weights(hw[:, 0], 224, hmax), aa_weights(hw[:, 1], 224, wmax)
    return {
        "gpu crop batched: weights only": rate(
            lambda _: (aa_weights(hw[:, 0], 224, hmax), aa_weights(hw[:, 1], 224, wmax)),
            [images] * 4,
            sync,
        ),
        "gpu crop batched: products only": rate(
            lambda _: wy[:, None] @ padded @ wx[:, None].transpose(-1, -2), [images] * 4, sync
        ),
        "gpu crop loop (resized_crop x N)": rate(loop, [images] * 4, sync),
        "gpu crop batched (batch_resize)": rate(
            lambda _: resized_crops(images, boxes, flips, out), [images] * 4, sync
        ),
    }


def nvimgcodec_rows(jpegs: list[bytes], batch_size: int, sync) -> dict:
    try:
        from nvidia import nvimgcodec
    except Exception as exc:  # noqa: BLE001 - not installed: the row says so
        return {"gpu nvimgcodec": f"not run: {exc}"}
    groups = batches(jpegs, batch_size)
    rows: dict = {}
    kinds = {
        "default": None,
        "hw": "HW_GPU_ONLY",
        "gpu": "GPU_ONLY",
        "hybrid": "HYBRID_CPU_GPU",
    }
    for name, kind in kinds.items():
        try:
            if kind is None:
                dec = nvimgcodec.Decoder()
            else:
                backend = nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))
                dec = nvimgcodec.Decoder(backends=[backend])

            def run(g, dec=dec):
                out = dec.decode(g)
                if any(o is None for o in out):
                    raise RuntimeError("an image was not decoded")
                return [torch.as_tensor(o, device="cuda") for o in out]

            rows[f"gpu nvimgcodec decode ({name})"] = rate(run, groups, sync)
        except Exception as exc:  # noqa: BLE001 - a backend this GPU lacks: the row says so
            rows[f"gpu nvimgcodec decode ({name})"] = f"not run: {type(exc).__name__}: {exc}"
    return rows


def pixel_rows(jpegs: list[bytes], n: int = 64) -> dict:
    """The GPU path's pixels against the CPU native crop and torchvision's CPU reference for
    the same boxes and flips."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    sample = jpegs[:n]
    crop = gpufeed.RandomResizedCrop(224, memory_format=torch.contiguous_format)
    payloads = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in sample]
    torch.manual_seed(7)
    dd = DeviceDecode(crop, torch.device("cuda"))
    gpu = on_gpu(dd, payloads).cpu()
    torch.manual_seed(7)
    cpu, kept, _ = crop([p.numpy() for p in payloads])
    torch.manual_seed(7)
    ref_imgs = [decode_jpeg(p, mode=ImageReadMode.RGB) for p in payloads]
    sizes = np.array([img.shape[1:] for img in ref_imgs])
    boxes = crop.crop_boxes(sizes[:, 0], sizes[:, 1]).tolist()
    flips = torch.rand(len(ref_imgs)) < crop.flip
    ref = torch.stack(
        [
            (lambda x, f: x.flip(-1) if f else x)(
                F.resized_crop(img, t, le, h, w, [224, 224], antialias=True), flips[k]
            )
            for k, (img, (t, le, h, w)) in enumerate(zip(ref_imgs, boxes, strict=True))
        ]
    )

    def diff(a, b) -> dict:
        d = (a.int() - b.int()).abs()
        return {
            "max": int(d.max()),
            "mean": float(d.float().mean()),
            "over_1_pct": float((d > 1).float().mean() * 100),
        }

    gpu_decoded = decode_jpeg(payloads, mode=ImageReadMode.RGB, device="cuda")
    decode_only = [diff(g.cpu(), c) for g, c in zip(gpu_decoded, ref_imgs, strict=True)]
    return {
        "decode only: nvJPEG vs libjpeg-turbo": {
            "max": max(d["max"] for d in decode_only),
            "mean": statistics.mean(d["mean"] for d in decode_only),
            "over_1_pct": statistics.mean(d["over_1_pct"] for d in decode_only),
        },
        "gpu vs cpu native": diff(gpu, cpu.contiguous()),
        "gpu vs torchvision cpu": diff(gpu, ref),
        "cpu native vs torchvision cpu": diff(cpu.contiguous(), ref),
        "kept": int(len(kept)),
        "gpu fallbacks": dd.fallbacks,
    }


def table(rows: dict) -> str:
    """The rows as markdown: samples/s (as a ratio to the CPU decoder on one thread, where
    measured) and ms a batch; the pixel rows as they are."""
    ref = rows.get("cpu native x1")
    lines = ["| row | samples/s | vs cpu native x1 | ms/batch |", "|---|---|---|---|"]
    for name, value in rows.items():
        if name.startswith("_"):
            continue
        if isinstance(value, tuple):
            ratio = f"{value[0] / ref[0]:.2f}x" if isinstance(ref, tuple) else ""
            lines.append(f"| {name} | {value[0]:,.0f} | {ratio} | {value[1]:.2f} |")
        else:
            text = json.dumps(value) if isinstance(value, dict) else value
            lines.append(f"| {name} | {text} | | |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--images", type=int, default=1024, help="(quick: 64)")
    ap.add_argument("--batch-size", type=int, default=256, help="(quick: 32)")
    ap.add_argument("--gpu-only", action="store_true", help="skip the CPU and nvImageCodec rows")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.batch_size = 64, 32
    t0 = time.perf_counter()
    jpegs = make_jpegs(args.images)
    rows: dict = {"_cpus": os.cpu_count(), "_torch": torch.__version__}
    if not args.gpu_only:
        rows.update(cpu_rows(jpegs, args.batch_size, args.rounds))
    if torch.cuda.is_available():
        rows["_gpu"] = torch.cuda.get_device_name(0)
        rows.update(gpu_rows(jpegs, args.batch_size, nvimgcodec=not args.gpu_only))
        rows.update(pixel_rows(jpegs))
    else:
        rows["gpu"] = "no CUDA device: GPU rows not measured"
    rows["_seconds"] = time.perf_counter() - t0
    head = (
        f"{rows.get('_gpu', 'no GPU')}, {rows['_cpus']} CPUs, torch {rows['_torch']}, "
        f"batch {args.batch_size}, {args.images} JPEGs 500x375 q90 -> 224"
    )
    common.write(args, "gpu_decode", rows, head + "\n\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
