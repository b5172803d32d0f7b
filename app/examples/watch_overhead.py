"""What does gpufeed.watch cost? The same training steps with and without it, side by side.

    python watch_overhead.py [--steps 60] [--rounds 9] [--device cpu|cuda]

Rounds alternate (bare, watched, bare, watched, ...) so that a noisy machine slows both
alike; the report is the ratio of the medians, plus the cost per step of an empty loop body.
The step is a small MLP's forward, backward and optimiser step on a batch already in memory
(so the loader costs nothing and only watch's own work differs); ``loss.item()`` ends each
step, as logging does in real loops.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gpufeed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--width", type=int, default=512)
    args = ap.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 10),
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = [
        (torch.randn(256, args.width, device=dev), torch.randint(0, 10, (256,), device=dev))
        for _ in range(8)
    ]
    loader = [batches[i % len(batches)] for i in range(args.steps)]

    def train(iterable) -> float:
        start = time.perf_counter()
        for x, y in iterable:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss.item()
        return (time.perf_counter() - start) / args.steps

    train(loader)  # warm-up: allocator, kernels
    bare, watched = [], []
    for _ in range(args.rounds):
        bare.append(train(loader))
        watched.append(train(gpufeed.watch(loader, progress=True, report=False)))
    b, w = statistics.median(bare), statistics.median(watched)

    items = list(range(100_000))
    empty = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in items:
            pass
        t_bare = time.perf_counter() - t
        t = time.perf_counter()
        for _ in gpufeed.watch(items, progress=False, report=False):
            pass
        empty.append((time.perf_counter() - t - t_bare) / len(items))
    print(f"device {dev}, {args.steps} steps x {args.rounds} rounds, alternating")
    print(f"step without watch: {b * 1e3:.2f} ms (median of rounds)")
    print(f"step with watch:    {w * 1e3:.2f} ms (progress bar on)")
    print(f"ratio with/without: {w / b:.4f}")
    print(f"cost per step, empty loop body: {min(empty) * 1e6:.2f} us (best of 5)")


if __name__ == "__main__":
    main()
