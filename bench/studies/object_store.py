"""Object-storage clients side by side: obstore, fsspec (s3fs) and boto3 on the same objects.

    python -m bench.studies.object_store [--quick] [--concurrency 8] [--rounds 3] [--out DIR]
                                         [--json FILE]

One run starts a real S3-compatible server on 127.0.0.1 (bench/s3server.py: rclone, and moto
for ranged reads, whose 206 answers obstore needs), uploads the same objects once, reads them
once untimed, then runs each (client, task) in its own process, rounds interleaved with each
client leading one in turn, and prints each client's median as a ratio to the best. Tasks:
  get      many objects of 1-64 MiB, whole-object GETs streamed in 1 MiB chunks to nowhere,
           --concurrency requests at a time (MiB/s; peak RSS added by the task)
  range    small ranged reads (4 KiB at random offsets), one at a time (p50 and p95 latency)
  list     listing a prefix of many small objects
  upload   multipart upload of a few large files (MiB/s; peak RSS added)
and, for phase 2's goal (a second epoch within 10% of local disk), the chosen client's fetch
of the same objects against reading them from local disk, cold (evicted from the page cache
with posix_fadvise, server side too) and warm.

Ratios only: the machine is shared and noisy, so no absolute number stands alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.s3server import S3Server
from bench.studies import common

CLIENTS = ("obstore", "s3fs", "boto3")
BUCKET = "bench"
CHUNK = 64 << 10  # obstore costs more CPU as min_chunk_size grows (8 MiB: 2x)
RANGE_BYTES = 4096
MIB = 1 << 20


# --------------------------------------------------------------------------- the clients
def make_client(name: str, concurrency: int):
    """(get_stream(key) -> iterable of chunks, get_range(key, start, n), list(prefix), put)."""
    if name == "obstore":
        import obstore as obs
        from obstore.store import S3Store

        store = S3Store(
            BUCKET,
            client_options={"allow_http": True, "pool_max_idle_per_host": str(concurrency)},
        )
        return (
            lambda k: obs.get(store, k).stream(min_chunk_size=CHUNK),
            lambda k, s, n: obs.get_range(store, k, start=s, length=n),
            lambda p: [m for batch in obs.list(store, p) for m in batch],
            lambda src, k: obs.put(store, k, Path(src), chunk_size=8 * MIB, max_concurrency=4),
        )
    if name == "s3fs":
        import s3fs

        fs = s3fs.S3FileSystem(default_block_size=CHUNK, max_concurrency=4)

        def stream(k):
            with fs.open(f"{BUCKET}/{k}", "rb", block_size=8 * MIB, cache_type="readahead") as f:
                while chunk := f.read(CHUNK):
                    yield chunk

        return (
            stream,
            lambda k, s, n: fs.cat_file(f"{BUCKET}/{k}", start=s, end=s + n),
            lambda p: fs.find(f"{BUCKET}/{p}"),
            lambda src, k: fs.put_file(src, f"{BUCKET}/{k}", chunksize=8 * MIB),
        )
    if name == "boto3":
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        client = boto3.client("s3", config=Config(max_pool_connections=max(10, concurrency)))
        cfg = TransferConfig(
            multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB, max_concurrency=4
        )

        def list_keys(p):
            pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=p)
            return [o["Key"] for page in pages for o in page.get("Contents", [])]

        return (
            lambda k: client.get_object(Bucket=BUCKET, Key=k)["Body"].iter_chunks(CHUNK),
            lambda k, s, n: client.get_object(Bucket=BUCKET, Key=k, Range=f"bytes={s}-{s + n - 1}")[
                "Body"
            ].read(),
            list_keys,
            lambda src, k: client.upload_file(src, BUCKET, k, Config=cfg),
        )
    raise ValueError(name)


# --------------------------------------------------------------------------- one task
def run_task(client: str, task: str, cfg: dict) -> dict:
    """Runs in its own process: the task's figure and the peak RSS it added."""
    get, get_range, list_prefix, put = make_client(client, cfg["concurrency"])
    rss = RssSampler()
    cpu0 = _cpu_seconds()
    t0 = time.perf_counter()
    out: dict = {}
    if task == "get":
        out["bytes"] = _get_all(get, cfg["keys"], cfg["concurrency"])
    elif task == "range":
        out["latencies"] = _ranged(get_range, cfg["keys"], cfg["sizes"], cfg["ranges"])
    elif task == "list":
        out["count"] = len(list_prefix(cfg["list_prefix"]))
    elif task == "upload":
        for i, src in enumerate(cfg["upload_files"]):
            put(src, f"up-{client}/{i}.bin")
        out["bytes"] = sum(os.path.getsize(p) for p in cfg["upload_files"])
    out["seconds"] = time.perf_counter() - t0
    out["cpu_seconds"] = _cpu_seconds() - cpu0
    out["rss_added_mib"] = rss.stop() / MIB
    return out


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class RssSampler:
    """Peak resident memory above the level at start, sampled every 5 ms in a thread."""

    def __init__(self):
        self.base = self._rss()
        self.peak = self.base
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self):
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.base


def _get_all(get, keys, concurrency) -> int:
    def drain(k):
        return sum(len(c) for c in get(k))

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(drain, keys))


def _ranged(get_range, keys, sizes, count) -> list[float]:
    rng = random.Random(0)
    lat = []
    for _ in range(count):
        i = rng.randrange(len(keys))
        start = rng.randrange(sizes[i] - RANGE_BYTES)
        t = time.perf_counter()
        data = get_range(keys[i], start, RANGE_BYTES)
        lat.append(time.perf_counter() - t)
        assert len(data) == RANGE_BYTES, (len(data), keys[i])
    return lat


def disk_read(paths: list[str], concurrency: int, cold: bool) -> float:
    if cold:
        evict(paths)
    t0 = time.perf_counter()

    def read(p):
        with open(p, "rb", buffering=0) as f:
            buf = bytearray(CHUNK)
            while f.readinto(buf):
                pass

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(read, paths))
    return time.perf_counter() - t0


def evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------- the run
def object_sizes(quick: bool) -> list[int]:
    """Log-uniform 1-64 MiB, fixed seed: a mix of small chunks and large shards."""
    rng = random.Random(42)
    n = 12 if quick else 32
    return [int(MIB * 2 ** rng.uniform(0, 6)) for _ in range(n)]


def prepare(servers: list[S3Server], work: Path, quick: bool, list_count: int) -> dict:
    """The same objects on every server, put through its S3 API."""
    import obstore
    from obstore.store import S3Store

    sizes = object_sizes(quick)
    keys = [f"objs/{i:03d}.bin" for i in range(len(sizes))]
    blobs = [os.urandom(size) for size in sizes]
    for server in servers:
        server.make_bucket(BUCKET)
        store = S3Store(
            BUCKET,
            endpoint=server.endpoint,
            access_key_id=server.env()["AWS_ACCESS_KEY_ID"],
            secret_access_key=server.env()["AWS_SECRET_ACCESS_KEY"],
            region=server.env()["AWS_REGION"],
            client_options={"allow_http": True},
        )
        for key, data in zip(keys, blobs, strict=True):
            obstore.put(store, key, data)
        for i in range(list_count if server.kind == "rclone" else 0):
            obstore.put(store, f"many/{i:05d}", b"x")
    root = servers[0].data_dir / BUCKET  # rclone's folder: the files local-disk reads use
    upload = []
    for i in range(2 if quick else 4):
        p = work / f"upload-{i}.bin"
        p.write_bytes(os.urandom(48 * MIB))
        upload.append(str(p))
    return {"keys": keys, "sizes": sizes, "paths": [str(root / k) for k in keys], "upload": upload}


def spawn(client: str, task: str, cfg: dict, env: dict) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.studies.object_store",
        "--worker",
        client,
        task,
        json.dumps(cfg),
    ]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        lines = [ln for ln in res.stderr.splitlines() if "Error" in ln] or ["?"]
        return {"error": lines[-1][:200]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--ranges", type=int, default=200)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        client, task, cfg = args.worker
        print(json.dumps(run_task(client, task, json.loads(cfg))))
        return 0
    with tempfile.TemporaryDirectory(prefix="gpufeed-objbench-") as tmp:
        results = run_all(Path(tmp), args)
    common.write(args, "object_store", results, report(results))
    return 0


def run_all(tmp: Path, args) -> dict:
    list_count = 300 if args.quick else 2000
    rounds = {}
    with S3Server("rclone", tmp / "rclone") as rclone, S3Server("moto", tmp / "moto") as moto:
        data = prepare([rclone, moto], tmp, args.quick, list_count)
        cfg = {
            "keys": data["keys"],
            "sizes": data["sizes"],
            "concurrency": args.concurrency,
            "ranges": args.ranges,
            "list_prefix": "many/",
            "upload_files": data["upload"],
        }
        plan = [
            ("get", rclone),
            ("range", rclone),
            ("range-moto", moto),
            ("list", rclone),
            ("upload", rclone),
        ]
        for server in (rclone, moto):  # untimed: the servers' first reads warm them up
            spawn("boto3", "get", cfg, {**os.environ, **server.env()})
        for r in range(args.rounds):
            order = CLIENTS[r % 3 :] + CLIENTS[: r % 3]  # each client leads a round in turn
            for name, server in plan:
                for client in order:
                    env = {**os.environ, **server.env()}
                    res = spawn(client, name.removesuffix("-moto"), cfg, env)
                    rounds.setdefault(name, {}).setdefault(client, []).append(res)
            rounds.setdefault("disk", []).append(_disk_vs_fetch(rclone, data, args.concurrency))
    return {"rounds": rounds, "sizes": data["sizes"], "concurrency": args.concurrency}


def _disk_vs_fetch(server: S3Server, data: dict, concurrency: int) -> dict:
    """Local-disk reads against the same files fetched through the server (obstore)."""
    env = {**os.environ, **server.env()}
    cfg = {"keys": data["keys"], "sizes": data["sizes"], "concurrency": concurrency}
    out = {"disk_cold": disk_read(data["paths"], concurrency, cold=True)}
    evict(data["paths"])
    out["fetch_cold"] = spawn("obstore", "get", cfg, env).get("seconds")
    out["disk_warm"] = disk_read(data["paths"], concurrency, cold=False)
    out["fetch_warm"] = spawn("obstore", "get", cfg, env).get("seconds")
    return out


# --------------------------------------------------------------------------- the report
def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else None


def report(results: dict) -> str:
    """Each task's clients as ratios to the best, the fetch against local disk."""
    out = []
    rounds = results["rounds"]
    total = sum(results["sizes"]) / MIB
    n, c = len(results["sizes"]), results["concurrency"]
    out.append(f"\n{n} objects, {total:.0f} MiB, {c} concurrent requests")
    for task in ("get", "upload"):
        secs = {c: _median(rounds[task][c], "seconds") for c in CLIENTS}
        best = min(s for s in secs.values() if s)
        cpu = {c: _median(rounds[task][c], "cpu_seconds") for c in CLIENTS}
        least = min(s for s in cpu.values() if s)
        out.append(
            f"\n{task}: throughput and client CPU time as ratios to the best; peak RSS added"
        )
        for c in CLIENTS:
            errs = [r["error"] for r in rounds[task][c] if "error" in r]
            if secs[c] is None:
                out.append(f"  {c:8s} failed: {errs[0]}")
                continue
            rss = _median(rounds[task][c], "rss_added_mib")
            out.append(
                f"  {c:8s} {best / secs[c]:5.2f}x   cpu {cpu[c] / least:5.2f}x   +{rss:5.0f} MiB"
            )
    for task in ("range", "range-moto"):
        out.append(f"\n{task}: {RANGE_BYTES} B ranged reads, latency as a ratio to the fastest p50")
        p = {}
        for c in CLIENTS:
            lats = [x for r in rounds[task][c] for x in r.get("latencies", [])]
            p[c] = (statistics.median(lats), statistics.quantiles(lats, n=20)[18]) if lats else None
        best = min(v[0] for v in p.values() if v)
        for c in CLIENTS:
            if p[c] is None:
                err = next(r["error"] for r in rounds[task][c] if "error" in r)
                out.append(f"  {c:8s} failed: {err}")
            else:
                out.append(f"  {c:8s} p50 {p[c][0] / best:5.2f}x   p95 {p[c][1] / best:5.2f}x")
    secs = {c: _median(rounds["list"][c], "seconds") for c in CLIENTS}
    best = min(s for s in secs.values() if s)
    out.append("\nlist: time as a ratio to the fastest (lower is better)")
    for c in CLIENTS:
        out.append(f"  {c:8s} {secs[c] / best:5.2f}x")
    disk = rounds["disk"]
    out.append(
        "\nfetch through the server (obstore) vs the same files from local disk (time ratio)"
    )
    for mode in ("cold", "warm"):
        f = statistics.median(d[f"fetch_{mode}"] for d in disk)
        d = statistics.median(d[f"disk_{mode}"] for d in disk)
        out.append(f"  {mode}: fetch time / disk time = {f / d:5.2f}x")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
