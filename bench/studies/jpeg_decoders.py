"""JPEG decode + RandomResizedCrop + horizontal flip: the candidate CPU decoders side by side.

    python -m bench.studies.jpeg_decoders [--out DIR] [--rounds 5] [--only REGEX] [--quick]
    make bench-jpeg                       (in the bench image: FFCV, torchvision 0.24.1, ...)

The same pictures (bench/data.py's generator) encoded once by FFCV's own encoder (OpenCV,
quality 90, what FFCV's writer stores), so every candidate decodes the very same bytes:

- ``small``: 64x64 JPEGs to 56x56 (the suite's ``jpeg`` case);
- ``imagenet``: 500x375 JPEGs to 224x224 (ImageNet's typical picture and crop).

Each candidate decodes every picture, crops a RandomResizedCrop box (scale 0.08-1, ratio
3/4-4/3), resizes it to the output size and flips half, in batches of 256, with 1 thread and
with 2. The passes are interleaved (bench/studies/common.py: round 1 of every candidate,
then round 2, ...), so machine noise falls on all of them alike; the best pass counts.
Candidates that are not installed are reported as such. Pixels: for the candidates whose box
can be given, the largest difference from torchvision's RandomResizedCrop + flip for the same
box on the first 64 pictures (``-`` where a candidate samples its own boxes).

Prints a table (per-image microseconds on 1 thread, images/s on 2 threads, both as ratios to
FFCV) and writes ``jpeg_decoders.json`` / ``jpeg_decoders.md`` to --out.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch

from bench.data import _picture
from bench.studies import common

BATCH = 256
CASES = {"small": (64, 64, 56, 8192), "imagenet": (375, 500, 224, 512)}


def encode(arr: np.ndarray) -> bytes:
    """FFCV's writer's encoder (RGBImageField(write_mode='jpg', jpeg_quality=90))."""
    import cv2

    ok, buf = cv2.imencode(
        ".jpg", cv2.cvtColor(arr, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90]
    )
    assert ok
    return buf.tobytes()


def make_case(name: str, seed: int = 0):
    h, w, size, count = CASES[name]
    rng = np.random.default_rng([seed, h, w])
    arrays = [_picture(rng, h, w) for _ in range(count)]
    return arrays, [encode(a) for a in arrays], size


def batches(items, n=BATCH):
    return [items[i : i + n] for i in range(0, len(items), n)]


# ------------------------------------------------------------------ candidates
# Each builder returns run(threads) -> images decoded, and optionally crop(payload, box, flip,
# size) -> HWC uint8 for the pixel check; or raises ImportError (not installed).


def _torch_resize_flip(chw: torch.Tensor, box, flip: bool, size: int) -> torch.Tensor:
    top, left, h, w = box
    out = torch.nn.functional.interpolate(
        chw[None, :, top : top + h, left : left + w],
        size=(size, size),
        mode="bilinear",
        antialias=True,
    )[0]
    return out.flip(-1) if flip else out


def _per_image_pool(payloads, size, decode_chw):
    """decode_chw(bytes) -> uint8 CHW tensor, then the torch crop (the same boxes as
    RandomResizedCrop), on a thread pool: what an image decoder that releases the GIL gives."""
    from gpufeed.data.decoders import RandomResizedCrop

    rrc = RandomResizedCrop(size)

    def one(data):
        img = decode_chw(data)
        box = rrc.crop_box(img.shape[1], img.shape[2])
        return _torch_resize_flip(img, box, bool(torch.rand(()) < 0.5), size)

    def run(threads):
        with ThreadPoolExecutor(threads) as pool:
            for batch in batches(payloads):
                torch.stack(list(pool.map(one, batch)))
        return len(payloads)

    def crop(data, box, flip):
        return _torch_resize_flip(decode_chw(data), box, flip, size).permute(1, 2, 0).numpy()

    return run, crop


def build_native(payloads, size, dct_scaling=False):
    from gpufeed.data import native_jpeg
    from gpufeed.data.decoders import RandomResizedCrop

    if not native_jpeg.available():
        raise ImportError(native_jpeg.status())
    rrc = RandomResizedCrop(size)

    def run(threads):
        for batch in batches(payloads):
            native_jpeg.decode_resized_crops(batch, rrc, threads=threads, dct_scaling=dct_scaling)
        return len(payloads)

    def crop(data, box, flip):
        import gpufeed_jpeg

        out = np.empty((1, size, size, 3), np.uint8)
        gpufeed_jpeg.decode_crops([data], np.array([box]), np.array([flip]), out, 1, dct_scaling)
        return out[0]

    return run, crop


def build_opencv(payloads, size):
    """gpufeed's RandomResizedCrop today (simplejpeg + cv2 + torch's kernel), a batch per
    call; 2 threads = two batches at once on a thread pool."""
    from gpufeed.data.decoders import RandomResizedCrop, opencv_backend

    if opencv_backend() is None:
        raise ImportError("cv2 or simplejpeg missing")
    rrc = RandomResizedCrop(size, backend="opencv")

    def run(threads):
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(rrc, batches(payloads, BATCH // threads)))
        return len(payloads)

    return run, None


def build_torchvision(payloads, size):
    from torchvision.io import ImageReadMode, decode_jpeg

    def chw(data):
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB)

    return _per_image_pool(payloads, size, chw)


def build_simplejpeg(payloads, size):
    import simplejpeg

    def chw(data):
        return torch.from_numpy(simplejpeg.decode_jpeg(data, "RGB")).permute(2, 0, 1)

    return _per_image_pool(payloads, size, chw)


def build_pyturbojpeg(payloads, size):
    from turbojpeg import TJPF_RGB, TurboJPEG

    jpeg = TurboJPEG()

    def chw(data):
        return torch.from_numpy(jpeg.decode(data, pixel_format=TJPF_RGB)).permute(2, 0, 1)

    return _per_image_pool(payloads, size, chw)


def build_dali(payloads, size):
    from nvidia.dali import fn, pipeline_def, types

    arrays = [np.frombuffer(p, dtype=np.uint8) for p in payloads]
    pipes = {}

    def pipe(threads):
        if threads not in pipes:

            @pipeline_def(batch_size=BATCH, num_threads=threads, device_id=None)
            def rrc_pipe():
                jpegs = fn.external_source(name="jpegs", dtype=types.UINT8)
                img = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB)
                img = fn.resize(img, resize_x=size, resize_y=size, antialias=True)
                return fn.flip(img, horizontal=fn.random.coin_flip())

            p = rrc_pipe(prefetch_queue_depth=1)
            p.build()
            pipes[threads] = p
        return pipes[threads]

    def run(threads):
        p = pipe(threads)
        for batch in batches(arrays):
            p.feed_input("jpegs", batch)
            p.run()
        return len(payloads)

    return run, None


def build_spdl(payloads, size):
    import spdl.io

    from gpufeed.data.decoders import RandomResizedCrop

    rrc = RandomResizedCrop(size)

    def one(data, box=None, flip=None):
        packets = spdl.io.demux_image(data)
        w, h = packets.width, packets.height
        top, left, bh, bw = box if box is not None else rrc.crop_box(h, w)
        flip = bool(torch.rand(()) < 0.5) if flip is None else flip
        chain = f"crop={bw}:{bh}:{left}:{top},scale={size}:{size}" + (",hflip" if flip else "")
        frames = spdl.io.decode_packets(packets, filter_desc=f"{chain},format=rgb24")
        return spdl.io.to_numpy(spdl.io.convert_frames(frames))

    def run(threads):
        with ThreadPoolExecutor(threads) as pool:
            for batch in batches(payloads):
                list(pool.map(one, batch))
        return len(payloads)

    def crop(data, box, flip):
        return one(data, box, flip)

    return run, crop


def build_ffcv(payloads, size, arrays, workdir: Path):
    from ffcv.fields import IntField, RGBImageField
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, ToTensor
    from ffcv.writer import DatasetWriter

    path = workdir / f"ffcv-{len(arrays)}-{arrays[0].shape[0]}.beton"
    if not path.exists():

        class Source:
            def __len__(self):
                return len(arrays)

            def __getitem__(self, i):
                return arrays[i], 0

        writer = DatasetWriter(
            str(path),
            {"x": RGBImageField(write_mode="jpg", jpeg_quality=90), "y": IntField()},
            num_workers=1,
        )
        writer.from_indexed_dataset(Source())
    loaders = {}

    def run(threads):
        if threads not in loaders:
            loaders[threads] = Loader(
                str(path),
                batch_size=BATCH,
                num_workers=threads,
                order=OrderOption.SEQUENTIAL,
                os_cache=True,
                pipelines={
                    "x": [
                        RandomResizedCropRGBImageDecoder((size, size)),
                        RandomHorizontalFlip(),
                        ToTensor(),
                    ],
                    "y": [IntDecoder(), ToTensor()],
                },
            )
        n = 0
        for x, _ in loaders[threads]:
            n += len(x)
        return n

    return run, None


CANDIDATES = {
    "ffcv": "FFCV 1.0.2 (RandomResizedCropRGBImageDecoder + RandomHorizontalFlip, numba threads)",
    "gpufeed-native": "gpufeed-jpeg: crop-aware decode + torch's kernel, a batch per call",
    "gpufeed-native-dct": "gpufeed-jpeg with dct_scaling=True",
    "gpufeed-opencv": "gpufeed RandomResizedCrop today (simplejpeg + cv2), batch per call",
    "torchvision": "torchvision.io.decode_jpeg + torch resize/flip, per image on a thread pool",
    "simplejpeg": "simplejpeg (GIL released) + torch resize/flip, per image on a thread pool",
    "pyturbojpeg": "PyTurboJPEG (ctypes, GIL released) + torch resize/flip, thread pool",
    "dali": "NVIDIA DALI CPU pipeline (decoders.image_random_crop + resize + flip)",
    "spdl": "SPDL (FFmpeg: crop, scale, hflip filters), per image on a thread pool",
}


BUILDERS = {
    "ffcv": lambda p, s, a, w: build_ffcv(p, s, a, w),
    "gpufeed-native": lambda p, s, a, w: build_native(p, s),
    "gpufeed-native-dct": lambda p, s, a, w: build_native(p, s, dct_scaling=True),
    "gpufeed-opencv": lambda p, s, a, w: build_opencv(p, s),
    "torchvision": lambda p, s, a, w: build_torchvision(p, s),
    "simplejpeg": lambda p, s, a, w: build_simplejpeg(p, s),
    "pyturbojpeg": lambda p, s, a, w: build_pyturbojpeg(p, s),
    "dali": lambda p, s, a, w: build_dali(p, s),
    "spdl": lambda p, s, a, w: build_spdl(p, s),
}


def reference(data: bytes, box, flip: bool, size: int) -> np.ndarray:
    """torchvision's pixels: decode_jpeg, v2.functional.resized_crop (antialias), flip."""
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.transforms.v2 import functional as F

    img = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), ImageReadMode.RGB)
    out = F.resized_crop(img, *box, [size, size], antialias=True)
    return (F.horizontal_flip(out) if flip else out).permute(1, 2, 0).numpy()


def pixel_check(crop, payloads, size) -> int | None:
    """The largest difference from torchvision's pixels (None: no box can be given, or no
    torchvision here)."""
    try:
        import torchvision.io  # noqa: F401
    except ImportError:
        return None
    if crop is None:
        return None
    from gpufeed.data.decoders import RandomResizedCrop

    rrc = RandomResizedCrop(size)
    worst = 0
    torch.manual_seed(0)
    for i, data in enumerate(payloads[:64]):
        h, w = _size(data)
        box = rrc.crop_box(h, w)
        got = np.asarray(crop(data, box, i % 2 == 1)).reshape(size, size, 3)
        worst = max(
            worst, int(np.abs(got.astype(int) - reference(data, box, i % 2 == 1, size)).max())
        )
    return worst


def _size(data: bytes):
    from torchvision.io import decode_jpeg

    img = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return img.shape[1], img.shape[2]


def _one_pass(run, threads: int) -> None:
    run(threads)  # its seconds are the result (common.interleaved)


def _log_round(log, case: str, msg: str) -> None:
    log(f"[{case}] {msg}")


def measure(args) -> dict:
    log = common.logger()
    torch.set_num_threads(1)
    workdir = Path(args.work)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for case in args.cases.split(","):
        arrays, payloads, size = make_case(case)
        runs, notes = {}, {}
        for name in CANDIDATES:
            if args.only and not re.search(args.only, name):
                continue
            try:
                run, crop = BUILDERS[name](payloads, size, arrays, workdir)
                run(1)  # warm-up: compiles, starts, fills caches
                run(2)
                runs[name] = run
                notes[name] = {"max_pixel_diff": pixel_check(crop, payloads, size)}
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is reported
                why = f"{type(exc).__name__}: {exc}".splitlines()[0]
                notes[name] = {"unavailable": why[:200]}
                print(f"[{case}] {name}: not measured: {notes[name]['unavailable']}", flush=True)
        timed = {
            (name, threads): partial(_one_pass, run, threads)
            for name, run in runs.items()
            for threads in (1, 2)
        }
        passes = common.interleaved(timed, args.rounds, partial(_log_round, log, case))
        for (name, threads), seconds in passes.items():
            notes[name][f"images_per_s_{threads}"] = len(payloads) / min(seconds)
        results[case] = {"size": size, "count": len(payloads), "candidates": notes}
    return results


def table(results: dict) -> str:
    lines = []
    for case, res in results.items():
        c = res["candidates"]
        ffcv = c.get("ffcv", {})
        lines += [
            f"\n**{case}** ({res['count']} JPEGs, crop to {res['size']}x{res['size']}; ratios: "
            "FFCV's time per image over the candidate's on 1 thread, the candidate's images/s "
            "over FFCV's on 2 threads; >1 is faster than FFCV)\n",
            "| candidate | us/image, 1 thread | vs FFCV | images/s, 2 threads | vs FFCV "
            "| 2 threads / 1 | max pixel diff vs torchvision |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in c.items():
            if "unavailable" in r:
                lines.append(f"| {name} | not measured: {r['unavailable']} | | | | | |")
                continue
            one, two = r["images_per_s_1"], r["images_per_s_2"]
            v1 = f"{one / ffcv['images_per_s_1']:.2f}x" if ffcv.get("images_per_s_1") else "-"
            v2 = f"{two / ffcv['images_per_s_2']:.2f}x" if ffcv.get("images_per_s_2") else "-"
            px = r["max_pixel_diff"]
            lines.append(
                f"| {name} | {1e6 / one:.1f} | {v1} | {two:,.0f} | {v2} | {two / one:.2f} | "
                f"{'-' if px is None else px} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = common.parser(__doc__, rounds=5)
    ap.set_defaults(out=Path("bench/results"))
    ap.add_argument("--work", default=os.environ.get("TMPDIR", "/tmp") + "/gpufeed-jpeg-bench")
    ap.add_argument("--cases", default="small,imagenet", help="(quick: small)")
    ap.add_argument("--only", default=None, help="only candidates matching this regex")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.rounds = "small", 1
    results = measure(args)
    common.write(args, "jpeg_decoders", results, table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
