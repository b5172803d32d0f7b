"""The multi-node recipes: Kubernetes manifests validated offline (what `make lint` runs), the
invariants both recipes share, and the Slurm script's srun/torchrun command with a fake srun."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[2]
VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
K8S = ROOT / "deploy" / "k8s"
# By file, not through sys.path: a module named "validate" must not shadow anything else.
_spec = importlib.util.spec_from_file_location("deploy_k8s_validate", K8S / "validate.py")
validate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validate)


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _pod_specs() -> dict[str, dict]:
    job = next(d for d in _docs("job.yaml") if d["kind"] == "Job")
    pytorchjob = _docs("pytorchjob.yaml")[0]
    return {
        "job": job["spec"]["template"]["spec"],
        "pytorchjob": pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"],
    }


def _problems(tmp_path: Path, docs: list[dict]) -> list[str]:
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return validate.validate(path, validate.K8S_VERSION)


def test_every_manifest_is_valid():
    assert validate.main([]) == 0
    for path in sorted(K8S.glob("*.yaml")):
        assert validate.validate(path, validate.K8S_VERSION) == [], path


@pytest.mark.slow
def test_a_typo_in_a_pod_spec_is_caught_in_both_recipes(tmp_path):
    job_docs = _docs("job.yaml")
    job = next(d for d in job_docs if d["kind"] == "Job")
    job["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    assert any("volumeMount" in p for p in _problems(tmp_path, job_docs))

    pytorchjob = _docs("pytorchjob.yaml")[0]
    bad = copy.deepcopy(pytorchjob)
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0][
        "resource"
    ] = {}
    assert any("resource" in p for p in _problems(tmp_path, [bad]))


@pytest.mark.parametrize(
    "change, word",
    [
        (lambda s: s["elasticPolicy"].update(rdzvBackend="zookeeper"), "zookeeper"),
        (lambda s: s.update(nprocPerNode=8), "8"),
        (lambda s: s.update(pytorchReplicaSpecs={"Chief": {}}), "Chief"),
        (lambda s: s["pytorchReplicaSpecs"]["Worker"].update(replicas=5), "outside"),
        (
            lambda s: s["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
                0
            ].update(name="trainer"),
            "pytorch",
        ),
    ],
)
def test_the_pytorchjob_schema_rejects(tmp_path, change, word):
    doc = _docs("pytorchjob.yaml")[0]
    change(doc["spec"])
    problems = _problems(tmp_path, [doc])
    assert problems and any(word in p for p in problems), problems


def test_both_recipes_run_the_image_torchrun_and_the_shared_volumes():
    images = set()
    for name, spec in _pod_specs().items():
        (container,) = spec["containers"]
        images.add(container["image"])
        assert "command" not in container, f"{name}: keep the image's entrypoint (preflight)"
        assert "torchrun" in " ".join(container["args"])
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert mounts["/data"]["readOnly"] is True
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
        assert volumes[mounts["/workspace"]["name"]]["persistentVolumeClaim"]
        assert spec["securityContext"]["runAsUser"] == 1000
        assert container["resources"]["limits"]["nvidia.com/gpu"] > 0
        # torch.compile's caches outlive the pod: on the shared /workspace volume
        env = {e["name"]: e.get("value", "") for e in container["env"]}
        for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            assert env[variable].startswith("/workspace/"), (name, variable)
    assert len(images) == 1 and "pytorch-cuda-v2.9-ssh" in images.pop()


def test_both_recipes_cache_object_storage_on_an_emptydir_with_keys_from_a_secret():
    from gpufeed.system.sizes import parse_size

    for name, spec in _pod_specs().items():
        (container,) = spec["containers"]
        env = {e["name"]: e.get("value", "") for e in container["env"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        cache = volumes[mounts[env["GPUFEED_CACHE_DIR"]]["name"]]["emptyDir"]
        assert "medium" not in cache, name  # node disk, not memory
        # the bound leaves room below the volume's limit (a pod past it is evicted)
        assert parse_size(env["GPUFEED_CACHE_LIMIT"]) < parse_size(
            cache["sizeLimit"].replace("i", "iB")
        )
        (secret,) = container["envFrom"]
        assert secret["secretRef"] == {"name": "gpufeed-s3", "optional": True}
        assert not any(k.startswith("AWS_") for k in env), name  # never in the manifest


def test_every_recipe_keeps_the_trainers_store_out_of_torchrun():
    """torch 2.9.1 still has pytorch/pytorch#135712: with the store shared with torchrun, a
    restarted rank reads the previous attempt's peer address and gloo fails "Connection
    refused" (seen with `torchrun --max-restarts 1`). So every recipe opts out, and
    train_ddp.py's exit handshake keeps rank 0, which then hosts the store, alive to the end."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    values = {"compose": compose["services"]["train"]["environment"].get(VARIABLE)}
    for name, spec in _pod_specs().items():
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        values[name] = env.get(VARIABLE)
    sbatch = (ROOT / "deploy" / "slurm" / "train.sbatch").read_text().splitlines()
    values["slurm"] = "1" if f"export {VARIABLE}=1" in sbatch else None
    assert values == dict.fromkeys(values, "1")


def test_the_job_rendezvous_endpoint_is_pod_zero_of_the_headless_service():
    service, job = _docs("job.yaml")
    env = {
        e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    pod0 = f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert env["PET_RDZV_ENDPOINT"] == f"{pod0}:29400"
    assert env["PET_NNODES"] == str(job["spec"]["completions"]) == str(job["spec"]["parallelism"])


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu-07\\ngpu-08\\ngpu-09\\n'\n")
    (bin_dir / "srun").write_text(
        '#!/bin/sh\nfor a in "$@"; do printf \'%s\\n\' "$a"; done >"$FAKE_OUT"\n'
        "env | grep '^PET_' | sort >>\"$FAKE_OUT\"\n"
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-[07-09]",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "gpufeed-ddp",
        "DATASET_DIR": "/shared/datasets",
        "WORK_DIR": str(tmp_path / "work"),
        "FAKE_OUT": str(tmp_path / "srun.txt"),
    }

    def sbatch(*args: str, **extra: str) -> list[str]:
        script = ROOT / "deploy" / "slurm" / "train.sbatch"
        proc = subprocess.run(
            ["bash", str(script), *args], env={**env, **extra}, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return (tmp_path / "srun.txt").read_text().splitlines()

    return sbatch


def test_sbatch_runs_torchrun_on_every_node_with_c10d_on_the_first(fake_slurm):
    lines = fake_slurm()
    assert (
        "--container-image=ghcr.io#gpufeed/pytorch-cuda-v2.9-ssh:0.1.0-torch2.9.1-cuda12.8" in lines
    )
    assert "--container-mounts=/shared/datasets:/data:ro," in " ".join(lines)
    assert "PET_NNODES=3" in lines and "PET_RDZV_ENDPOINT=gpu-07:29400" in lines
    assert "PET_RDZV_BACKEND=c10d" in lines and "PET_RDZV_ID=4242" in lines
    assert "PET_NPROC_PER_NODE=gpu" in lines
    assert "/opt/gpufeed/examples/train_ddp.py" in lines
    assert "--checkpoint=/workspace/checkpoints/gpufeed-ddp.pt" in lines
    mounts = next(a for a in lines if a.startswith("--container-mounts=")).split(",")
    work = mounts[1].removesuffix(":/workspace")
    assert f"{work}/torch-cache:/var/cache/torch" in mounts  # COMPILE_CACHE_DIR's default
    assert "/tmp/gpufeed-cache-4242:/var/cache/gpufeed" in mounts  # node-local, per job
    assert os.path.isdir(f"{work}/torch-cache")


def test_sbatch_passes_arguments_and_takes_apptainer(fake_slurm):
    lines = fake_slurm("--epochs", "20", RUNTIME="apptainer")
    assert lines[:3] == ["--kill-on-bad-exit=1", "apptainer", "exec"]
    assert "docker://ghcr.io/gpufeed/pytorch-cuda-v2.9-ssh:0.1.0-torch2.9.1-cuda12.8" in lines
    binds = lines[lines.index("--bind") + 1].split(",")
    assert binds[-2].endswith("/torch-cache:/var/cache/torch"), binds
    assert binds[-1] == "/tmp/gpufeed-cache-4242:/var/cache/gpufeed", binds
    assert lines[-8:-6] == ["--epochs", "20"]
