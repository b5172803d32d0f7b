"""GPU smoke test: what `make smoke-gpu` runs in the SSH image (`--gpus all`), on the GPU
runner (.github/workflows/gpu-smoke.yml) and on any GPU box by hand.

    python tests/gpu/smoke.py [--out DIR] [--size 4096]

Checks, in order; the first failure ends the run with a non-zero exit and a FAIL line:

1. preflight: the image's preflight (driver >= the floor, GPU answers), when it is installed;
2. ``torch.cuda.is_available()`` and at least one device (never skipped: no GPU is a failure);
3. a bf16 matrix product on the GPU against a float64 reference of the same bf16 inputs;
4. ``torch.compile`` on the GPU (Inductor's Triton kernels, built in this image): a small model's
   training step compiled with ``mode="default"``, its gradients against eager ones, eager and
   compiled step times (tests/gpu/compile_check.py, which the image tests run on the CPU);
5. gpufeed's loader -> ``DevicePrefetcher`` path on the GPU (batches/s against a plain
   ``.to()``), the GPU JPEG path's pixels against torchvision's (tests/gpu/decode_check.py),
   then the benchmarks' GPU script, bench/studies/smoke_gpu.py (``gpufeed bench --device
   cuda`` on a synthetic pack where the repository is not there; ``GPUFEED_SMOKE_BENCH``
   names another command).

Results go to ``DIR/smoke-gpu.json``, ``DIR/smoke-gpu.md`` (a table), ``DIR/bench.txt`` and
``DIR/bench.json``, uploaded as the workflow's artifact. Exit codes: 0 all passed, 1 a check
failed, 4 no GPU visible.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NO_GPU = 4
REPO = Path(__file__).resolve().parents[2]
PREFLIGHT = "/usr/local/bin/preflight.sh"


class Failed(Exception):
    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def check_preflight() -> dict:
    if not os.path.exists(PREFLIGHT):
        return {"status": "skipped", "detail": f"{PREFLIGHT} not installed (not in the image)"}
    # The preflight must judge the GPU here, whatever the container was started with.
    env = {**os.environ, "GPUFEED_ALLOW_CPU": "0"}
    env.pop("GPUFEED_SKIP_PREFLIGHT", None)
    proc = subprocess.run([PREFLIGHT], capture_output=True, text=True, env=env, timeout=60)
    detail = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise Failed(f"preflight exited {proc.returncode}: {detail}", NO_GPU)
    return {"status": "passed", "detail": detail}


def check_cuda() -> dict:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("NVIDIA_VISIBLE_DEVICES", "<unset>")
        raise Failed(
            f"torch.cuda.is_available() is False (torch {torch.__version__}, CUDA build "
            f"{torch.version.cuda}, NVIDIA_VISIBLE_DEVICES={visible}): the GPU is not visible "
            f"in this container. Start it with --gpus all (compose: the deploy.resources "
            f"GPU reservation) on a host with the NVIDIA Container Toolkit",
            NO_GPU,
        )
    props = torch.cuda.get_device_properties(0)
    return {
        "status": "passed",
        "devices": torch.cuda.device_count(),
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def check_bf16_matmul(size: int) -> dict:
    """bf16 x bf16 on the tensor cores (fp32 accumulation) against float64 on the same
    bf16-rounded inputs: what remains is accumulation and the bf16 output rounding."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(size, size, device="cuda", generator=gen).to(torch.bfloat16)
    b = torch.randn(size, size, device="cuda", generator=gen).to(torch.bfloat16)
    ref = a.double() @ b.double()
    out = a @ b
    torch.cuda.synchronize()
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    reps = 10
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    # bf16 keeps 8 significant bits: one rounding of the output is ~2**-9 relative
    tolerance = 1e-2
    result = {
        "size": size,
        "relative_error": rel,
        "tolerance": tolerance,
        "tflops": 2 * size**3 / seconds / 1e12,
    }
    if not rel < tolerance:
        raise Failed(f"bf16 matmul relative error {rel:.3g} exceeds {tolerance} (float64 ref)")
    return {"status": "passed", **result}


def check_compile() -> dict:
    """torch.compile on the GPU: Triton kernels for the forward and backward graphs, their
    gradients against eager ones, and eager against compiled step time."""
    import compile_check  # beside this script: sys.path[0] when run as tests/gpu/smoke.py

    result = compile_check.run("cuda", rounds=5, steps=20)
    problems = compile_check.problems(result)
    if problems:
        raise Failed("; ".join(problems))
    return {"status": "passed", **result}


def check_decode() -> dict:
    """DevicePrefetcher's GPU JPEG path (nvJPEG + the batched crop products) against
    torchvision's own GPU pipeline for the same boxes (tests/gpu/decode_check.py)."""
    import decode_check  # beside this script, as compile_check

    result = decode_check.run("cuda")
    problems = decode_check.problems(result)
    if problems:
        raise Failed("; ".join(problems))
    return {"status": "passed", **result}


def check_prefetch(batches: int = 64) -> dict:
    """gpufeed's loader and DevicePrefetcher on the GPU: synthetic uint8 image batches
    copied and converted on a side stream, against a plain .to() in the loop."""
    import torch

    import gpufeed

    class Images(torch.utils.data.Dataset):
        def __init__(self, n):
            self.data = torch.randint(0, 256, (n, 3, 224, 224), dtype=torch.uint8)

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return self.data[i], i % 10

    loader = gpufeed.make_loader(Images(batches * 32), 32, num_workers=0, pin_memory=True)
    weight = torch.randn(3 * 224 * 224, 10, device="cuda") * 1e-3

    def run(source) -> float:
        torch.cuda.synchronize()
        start, n = time.perf_counter(), 0
        for samples, _labels in source:
            (samples.flatten(1) @ weight).sum().item()
            n += 1
        torch.cuda.synchronize()
        return n / (time.perf_counter() - start)

    def plain():
        for samples, labels in loader:
            yield samples.to("cuda", non_blocking=True).float().div_(255), labels

    run(gpufeed.DevicePrefetcher(loader, "cuda"))  # warm-up: pinned pool, kernels
    rows = {"plain .to()": run(plain()), "DevicePrefetcher": run(gpufeed.DevicePrefetcher(loader))}
    return {"status": "passed", "batch": [32, 3, 224, 224], "batches_per_s": rows}


def _synthetic_bench(work: Path) -> list[str]:
    import gpufeed
    from gpufeed.tools.synth import synth_image_folder

    synth_image_folder(work / "images", count=2048, size=64, seed=0)
    gpufeed.pack(work / "images", work / "pack", "hdf5", encode="raw", quiet=True)
    return ["gpufeed", "bench", str(work / "pack"), "--device", "cuda", "--seconds", "5", "-q"]


def run_bench(out: Path) -> dict:
    """The benchmarks' GPU script (bench/studies/smoke_gpu.py: H2D bandwidth, data starvation behind
    DevicePrefetcher, uint8 vs float transfer) when the repository is here, else ``gpufeed
    bench --device cuda`` on a small synthetic pack; ``GPUFEED_SMOKE_BENCH`` names another."""
    command = os.environ.get("GPUFEED_SMOKE_BENCH", "")
    script = REPO / "bench" / "studies" / "smoke_gpu.py"
    if command:
        argv = shlex.split(command)
    elif script.exists():
        argv = [sys.executable, str(script), "--json", str(out / "bench.json")]
    else:
        argv = _synthetic_bench(Path(tempfile.mkdtemp(prefix="smoke-gpu-")))
    if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
        raise Failed(f"benchmark command {argv[0]} not found")
    env = {**os.environ, "GPUFEED_EXPECT_GPU": "1"}  # a missing GPU fails there too
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    (out / "bench.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise Failed(f"{shlex.join(argv)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return {"status": "passed", "command": shlex.join(argv), "output": proc.stdout[-8000:]}


def table(results: dict) -> str:
    lines = ["| check | result |", "|---|---|"]
    for name, r in results.items():
        if name == "cuda" and r.get("status") == "passed":
            text = f"{r['devices']} x {r['name']} (sm {r['capability']}, {r['memory_gib']} GiB)"
        elif name == "bf16_matmul" and r.get("status") == "passed":
            text = (
                f"rel. error {r['relative_error']:.2e} < {r['tolerance']}, "
                f"{r['tflops']:.0f} TFLOP/s"
            )
        elif name == "compile" and r.get("status") == "passed":
            text = (
                f"eager {r['eager_step_ms']:.2f} ms, compiled {r['compiled_step_ms']:.2f} ms a "
                f"step ({r['speedup']:.2f}x), "
                f"first compiled step {r['first_compiled_step_s']:.0f} s"
            )
        elif name == "gpu_decode" and r.get("status") == "passed":
            text = (
                f"{r['images']} JPEGs on {r['device']}: within {r['max_difference']} of "
                f"torchvision's pixels ({r['differ_pct']:.3f}% differ)"
            )
        elif name == "prefetch" and r.get("status") == "passed":
            text = ", ".join(f"{k} {v:.0f} batches/s" for k, v in r["batches_per_s"].items())
        else:
            text = r.get("status", "?") + (f": {r['detail']}" if r.get("detail") else "")
        lines.append(f"| {name} | {text.replace('|', '/').splitlines()[0] if text else ''} |")
    if "bench" in results and results["bench"].get("output"):
        lines += ["", "```", results["bench"]["output"].strip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU smoke test (make smoke-gpu)")
    ap.add_argument("--out", default=os.environ.get("SMOKE_OUT", "smoke-gpu-results"))
    ap.add_argument("--size", type=int, default=4096, help="matrix size for the bf16 check")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    checks = [
        ("preflight", check_preflight),
        ("cuda", check_cuda),
        ("bf16_matmul", lambda: check_bf16_matmul(args.size)),
        ("compile", check_compile),
        ("prefetch", check_prefetch),
        ("gpu_decode", check_decode),
        ("bench", lambda: run_bench(out)),
    ]
    results: dict[str, dict] = {}
    code = 0
    for name, check in checks:
        try:
            results[name] = check()
            word = "ok  " if results[name]["status"] == "passed" else "skip"
            print(f"{word} {name}", flush=True)
        except Failed as failure:
            results[name] = {"status": "FAILED", "detail": str(failure)}
            print(f"FAIL {name}: {failure}", file=sys.stderr, flush=True)
            code = failure.code
            break
        except Exception as error:  # any other crash is a failure too, with its reason kept
            results[name] = {"status": "FAILED", "detail": f"{type(error).__name__}: {error}"}
            print(f"FAIL {name}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            code = 1
            break
    (out / "smoke-gpu.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "smoke-gpu.md").write_text(table(results))
    print(table(results), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
