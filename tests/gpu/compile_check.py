"""torch.compile on one device: a small model's training step (forward + backward), eager
against ``torch.compile(mode="default")``, the compiled gradients checked against eager ones.

    python tests/gpu/compile_check.py --device cpu     # one JSON line on stdout

On the CPU, Inductor writes C++/OpenMP kernels and builds them with the image's g++; on the GPU
it writes Triton kernels, and Triton builds its launcher with the C compiler against Python.h.
tests/gpu/smoke.py runs this on the GPU (``make smoke-gpu``) and tests/images/test_compile.py
on the CPU in both images, so both compile the same model the same way. The result names
Inductor's and AOTAutograd's cache hits and misses (torch's own counters), which tell whether
this process compiled or reused what another one left in ``TORCHINDUCTOR_CACHE_DIR``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

# Sizes per device: seconds of work on 2 CPU cores, a launch-bound step on a big GPU.
SIZES = {
    "cpu": {"batch": 32, "width": 128, "depth": 2},
    "cuda": {"batch": 256, "width": 1024, "depth": 4},
}
# fp32 on both paths; Inductor reorders reductions, so the last bits may differ.
TOLERANCE = 1e-3
CACHE_COUNTERS = {
    "fxgraph_hit": ("inductor", "fxgraph_cache_hit"),
    "fxgraph_miss": ("inductor", "fxgraph_cache_miss"),
    "aotautograd_hit": ("aot_autograd", "autograd_cache_hit"),
    "aotautograd_miss": ("aot_autograd", "autograd_cache_miss"),
}


def make_model(width: int, depth: int, classes: int = 10):
    """Residual MLP blocks (LayerNorm, GELU, residual add): elementwise work Inductor fuses."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    return nn.Sequential(
        *[Block() for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, classes)
    )


def train_step(model, x, y):
    """Forward and backward; returns the loss (a Python float, so the device is synchronised)."""
    import torch

    for p in model.parameters():
        p.grad = None
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.item()


def relative_difference(compiled, eager) -> float:
    """Largest gradient difference, relative to the largest eager gradient."""
    pairs = list(zip(compiled.parameters(), eager.parameters(), strict=True))
    worst = max((a.grad - b.grad).abs().max().item() for a, b in pairs)
    scale = max(b.grad.abs().max().item() for _, b in pairs)
    return worst / scale


def step_seconds(models: dict, x, y, rounds: int, steps: int) -> dict[str, float]:
    """Median seconds per step of each model, the models taking turns in each round (so that a
    noisy neighbour slows them alike)."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                train_step(model, x, y)
            times[name].append((time.perf_counter() - start) / steps)
    return {name: statistics.median(values) for name, values in times.items()}


def cache_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {key: int(counters[group][name]) for key, (group, name) in CACHE_COUNTERS.items()}


def run(
    device: str = "cpu",
    *,
    rounds: int = 3,
    steps: int = 5,
    compile_fn: Callable | None = None,
    sizes: dict | None = None,
) -> dict:
    """Compile, check against eager, time both. ``compile_fn`` defaults to
    ``torch.compile(mode="default")``."""
    import torch

    size = sizes or SIZES["cuda" if device.startswith("cuda") else "cpu"]
    compile_fn = compile_fn or (lambda module: torch.compile(module, mode="default"))
    eager = make_model(size["width"], size["depth"]).to(device)
    compiled = compile_fn(copy.deepcopy(eager))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(size["batch"], size["width"], generator=generator).to(device)
    y = torch.randint(0, 10, (size["batch"],), generator=generator).to(device)

    before = cache_counts()
    start = time.perf_counter()
    compiled_loss = train_step(compiled, x, y)  # compiles forward and backward graphs
    first_step = time.perf_counter() - start
    after = cache_counts()
    eager_loss = train_step(eager, x, y)
    grad_difference = relative_difference(compiled, eager)
    loss_difference = abs(compiled_loss - eager_loss) / max(abs(eager_loss), 1e-12)

    seconds = step_seconds({"eager": eager, "compiled": compiled}, x, y, rounds, steps)
    return {
        "device": device,
        "torch": torch.__version__,
        "sizes": size,
        "first_compiled_step_s": first_step,
        "eager_step_ms": seconds["eager"] * 1e3,
        "compiled_step_ms": seconds["compiled"] * 1e3,
        "speedup": seconds["eager"] / seconds["compiled"],
        "loss_difference": loss_difference,
        "grad_difference": grad_difference,
        "tolerance": TOLERANCE,
        "cache": {key: after[key] - before[key] for key in after},
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""),
    }


def problems(result: dict) -> list[str]:
    """What makes a result a failure: compiled numbers that differ from eager ones."""
    found = []
    for key in ("loss_difference", "grad_difference"):
        if not result[key] < result["tolerance"]:
            found.append(f"compiled {key} {result[key]:.3g} exceeds {result['tolerance']}")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    result = run(args.device, rounds=args.rounds, steps=args.steps)
    print(json.dumps(result), flush=True)
    for problem in problems(result):
        print(f"FAIL {problem}", file=sys.stderr)
    return 1 if problems(result) else 0


if __name__ == "__main__":
    sys.exit(main())
