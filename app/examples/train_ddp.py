"""DistributedDataParallel training fed by gpufeed, resumable mid-epoch. Run it under torchrun:

    torchrun --nproc-per-node gpu train_ddp.py --data /data/packed.hdf5      # one node, all GPUs
    docker compose run --rm train /opt/gpufeed/examples/train_ddp.py --data /data/packed.hdf5
    torchrun --nproc-per-node 2 train_ddp.py --synthetic 4096                # CPU, gloo

What it shows, in the order a real training script needs it:

- one process per GPU (``LOCAL_RANK``), NCCL on GPUs, gloo on the CPU;
- ``gpufeed.make_loader`` shards the dataset by rank (``DistributedBlockSampler``: every
  sample once per epoch across ranks, block-shuffled, a new order each epoch) and
  ``DevicePrefetcher`` copies the next batch to the GPU while this one trains;
- a checkpoint every ``--checkpoint-every`` steps and at each epoch's end: model, optimizer
  and every rank's loader state, written atomically by rank 0, so a run killed mid-epoch
  resumes at the next unseen sample (start it again with the same arguments and world size;
  under ``torchrun --max-restarts N`` the restarted workers resume by themselves).

The data is a gpufeed pack (``gpufeed pack SRC DEST``; any map-style format: hdf5, lmdb,
mmap, tar via its index) of equally shaped samples with integer labels, or ``--synthetic N``
samples made in memory. ``--sample-log DIR`` writes what each rank trained on (a digest per
sample, the loss per step), which is how the image tests check coverage and resumption.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gpufeed


class SyntheticImages(torch.utils.data.Dataset):
    """``n`` uint8 [3, 16, 16] images in 4 classes, each class a different brightness pattern
    plus noise: learnable in a few epochs, the same on every rank (seeded by index)."""

    classes = ["a", "b", "c", "d"]

    def __init__(self, n: int, shape=(3, 16, 16)):
        self.n, self.shape = n, shape
        g = torch.Generator().manual_seed(1234)
        self.patterns = torch.rand((len(self.classes), *shape), generator=g) * 40

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        label = i % len(self.classes)
        g = torch.Generator().manual_seed(i)
        noise = torch.rand(self.shape, generator=g) * 215
        return (self.patterns[label] + noise).to(torch.uint8), label


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--data", help="a gpufeed pack (a folder with manifest.json)")
    src.add_argument("--synthetic", type=int, metavar="N", help="N in-memory samples instead")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0, help="model init and sample order")
    ap.add_argument("--workers", default="auto", help="DataLoader workers per rank, or auto")
    ap.add_argument(
        "--checkpoint",
        default="/workspace/checkpoints/train_ddp.pt",
        help="checkpoint file; resumed from when it exists (default: %(default)s)",
    )
    ap.add_argument("--checkpoint-every", type=int, default=100, metavar="STEPS")
    ap.add_argument(
        "--no-resume", action="store_true", help="start over even if a checkpoint exists"
    )
    ap.add_argument("--sample-log", metavar="DIR", help="per-rank JSON lines of what was trained")
    ap.add_argument(
        "--crash-at-step",
        type=int,
        metavar="STEP",
        help="testing: SIGKILL the last rank after this global step (first attempt only)",
    )
    args = ap.parse_args(argv)
    if args.workers != "auto":
        args.workers = int(args.workers)
    return args


def setup() -> tuple[int, int, int, torch.device]:
    """Join the process group torchrun describes in the environment; one GPU per process."""
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit(
            "run me under torchrun: torchrun --nproc-per-node gpu train_ddp.py ... "
            "(or docker compose run train ...)"
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return dist.get_rank(), dist.get_world_size(), local_rank, device


def open_data(args) -> torch.utils.data.Dataset:
    if args.synthetic:
        return SyntheticImages(args.synthetic)
    path = Path(args.data)
    if not (path / "manifest.json").exists():
        raise SystemExit(
            f"{path} is not a gpufeed pack (no manifest.json); pack a folder first: "
            f"gpufeed pack SOURCE {path} --format hdf5, or use --synthetic N"
        )
    return gpufeed.open_dataset(path)  # map-style for every format: exact resumption


def make_model(sample: torch.Tensor, classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(sample.numel(), 128),
        nn.ReLU(),
        nn.Linear(128, classes),
    )


def save_checkpoint(path: Path, rank: int, model, optimizer, loader, step: int) -> None:
    """Rank 0 writes one file holding every rank's loader state (they differ by rank), to a
    temporary name renamed over the old one: a kill while writing leaves the previous one."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, loader.state_dict())
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(
            {
                "model": model.module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "loaders": states,
                "step": step,
            },
            tmp,
        )
        os.replace(tmp, path)
    dist.barrier()  # nobody runs ahead of a checkpoint that might not exist yet


def leave(rank: int, world: int, attempt: int) -> None:
    """The exit handshake, the last thing every rank does. Rank 0's process hosts the store the
    ranks share (the recipes set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; docs/distributed.md says
    why): were it to exit first, a rank still talking to that store (tearing down its process
    group, a late request) would fail or abort. So each rank checks in and rank 0 leaves last."""
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(minutes=5),
    )
    key = f"gpufeed/train_ddp/left/{attempt}"
    if store.add(key, 1) == world:
        store.set(f"{key}/all", "1")
    if rank == 0:
        store.wait([f"{key}/all"])


def digests(samples: torch.Tensor) -> list[str]:
    rows = samples.detach().to("cpu").contiguous().flatten(1).numpy()
    return [hashlib.blake2b(r.tobytes(), digest_size=8).hexdigest() for r in rows]


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world, local_rank, device = setup()
    dataset = open_data(args)
    classes = len(getattr(dataset, "classes", None) or []) or int(dataset.labels.max()) + 1

    # The same seed on every rank gives the same initial weights (DDP broadcasts rank 0's
    # anyway) and, through make_loader(seed=), the same global order split by rank.
    torch.manual_seed(args.seed)
    model = make_model(dataset[0][0], classes).to(device)
    ddp = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loader = gpufeed.make_loader(
        dataset,
        args.batch_size,
        shuffle=True,
        seed=args.seed,
        num_workers=args.workers,
        distributed=True,
    )
    # uint8 -> float in [0, 1] on the device, copied on a side stream one batch ahead.
    batches = gpufeed.DevicePrefetcher(loader, device)

    ckpt, step = Path(args.checkpoint), 0
    if ckpt.exists() and not args.no_resume:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if len(state["loaders"]) != world:
            raise SystemExit(
                f"{ckpt} was written by {len(state['loaders'])} ranks, this run has {world}: "
                f"resume with the same world size, or pass --no-resume to start over"
            )
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["loaders"][rank])
        step = state["step"]
    start_epoch = loader.epoch
    if rank == 0:
        resumed = f", resumed at step {step} (epoch {start_epoch})" if step else ""
        print(
            f"world {world} on {device.type} ({dist.get_backend()}), {len(dataset)} samples, "
            f"{len(loader)} steps/epoch/rank, loader: {loader.plan.reason}{resumed}",
            flush=True,
        )

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    host = socket.gethostname()
    log = None
    if args.sample_log:
        Path(args.sample_log).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.sample_log) / f"rank{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(start_epoch, args.epochs):
        batches.set_epoch(epoch)
        loss_sum, count, t0 = torch.zeros((), device=device), 0, time.perf_counter()
        for samples, labels in batches:
            loss = loss_fn(ddp(samples), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            count += len(labels)
            loss_sum += loss.detach() * len(labels)  # no host sync per step
            if log is not None:
                row = {"attempt": attempt, "epoch": epoch, "step": step, "loss": loss.item()}
                row["host"] = host
                log.write(json.dumps({**row, "samples": digests(samples)}) + "\n")
            if args.crash_at_step == step and rank == world - 1 and attempt == 0:
                os.kill(os.getpid(), signal.SIGKILL)  # as an OOM kill or a lost node would
            if step % args.checkpoint_every == 0:
                save_checkpoint(ckpt, rank, ddp, optimizer, batches, step)
        save_checkpoint(ckpt, rank, ddp, optimizer, batches, step)
        total = torch.stack([loss_sum, torch.tensor(float(count), device=device)])
        dist.all_reduce(total)
        if rank == 0:
            rate = count * world / (time.perf_counter() - t0)
            print(
                f"epoch {epoch}: loss {total[0].item() / total[1].item():.4f}, "
                f"{int(total[1].item())} samples this pass, {rate:.0f} samples/s",
                flush=True,
            )
    if log is not None:
        log.close()
    dist.destroy_process_group()
    leave(rank, world, attempt)


if __name__ == "__main__":
    main()
