"""Doctor's torch checks: the installed torch, torchvision and torchaudio, its CUDA build,
cuDNN and NCCL, and the GPUs it sees (asked in a bounded probe: CUDA initialisation can
hang on a broken driver)."""

from __future__ import annotations

from typing import Any

from gpufeed.tools.doctor.report import INFO, OK, WARN, Check

__all__ = ["torch_checks", "torch_probe"]


def torch_probe() -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("torchvision", "torchaudio"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        out["cudnn"] = (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        )
    except Exception:  # a broken cuDNN load is reported as missing
        out["cudnn"] = None
    try:
        import torch.distributed as dist

        out["nccl"] = bool(dist.is_available() and dist.is_nccl_available())
    except Exception:
        out["nccl"] = False
    out["nccl_version"] = None
    if out["nccl"]:
        try:
            v = torch.cuda.nccl.version()
            out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:
            pass
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "name": p.name,
                    "memory_bytes": int(p.total_memory),
                    "capability": f"{p.major}.{p.minor}",
                }
            )
    out["gpus"] = gpus
    return out


def torch_checks(probe_ok: bool, probe: Any, gpu_wanted: bool = True) -> list[Check]:
    """``gpu_wanted``: a GPU is there or asked for, so a CPU-only torch is a problem (on a
    CPU-only host it is the right build)."""
    if not probe_ok:
        why = "did not finish in time" if probe == "timeout" else f"{type(probe).__name__}: {probe}"
        return [
            Check(
                "torch",
                "torch",
                WARN,
                f"could not ask torch ({why})",
                "run python -c 'import torch; print(torch.cuda.is_available())' to see why",
            )
        ]
    p = probe
    versions = ", ".join(
        f"{k} {p[k]}" for k in ("torch", "torchvision", "torchaudio") if p.get(k) is not None
    )
    missing = [k for k in ("torchvision", "torchaudio") if p.get(k) is None]
    checks = [
        Check(
            "torch",
            "torch",
            OK if not missing else INFO,
            versions + (f" (not installed: {', '.join(missing)})" if missing else ""),
            None,
            {k: p.get(k) for k in ("torch", "torchvision", "torchaudio")},
        )
    ]
    if p["cuda"] is None:
        checks.append(
            Check(
                "torch",
                "cuda_build",
                WARN if gpu_wanted else INFO,
                "torch is a CPU-only build: no GPU use",
                "install a CUDA build of torch (the images carry one)",
                {},
            )
        )
    else:
        cudnn = p.get("cudnn")
        cudnn_text = (
            f"{cudnn // 10000}.{cudnn // 100 % 100}.{cudnn % 100}"
            if isinstance(cudnn, int) and cudnn >= 10000
            else str(cudnn)
        )
        checks.append(
            Check(
                "torch",
                "cuda_build",
                OK,
                f"CUDA {p['cuda']}, cuDNN {cudnn_text if cudnn else 'not available'}",
                None,
                {"cuda": p["cuda"], "cudnn": cudnn},
            )
        )
    nccl = p.get("nccl")
    checks.append(
        Check(
            "torch",
            "nccl",
            OK if nccl else (INFO if p["cuda"] is None else WARN),
            f"NCCL available{' (' + p['nccl_version'] + ')' if p.get('nccl_version') else ''}"
            if nccl
            else "NCCL not available (multi-GPU DDP needs it; gloo works on the CPU)",
            None if nccl else "use a CUDA build of torch on Linux",
            {"nccl": nccl},
        )
    )
    return checks
