"""Validate the Kubernetes manifests offline: `make lint` runs it.

    python deploy/k8s/validate.py [-k 1.31.0] [FILE.yaml ...]      (default: deploy/k8s/*.yaml)

Core resources (Service, Job, PersistentVolumeClaim...) are checked by kubernetes-validate
against the Kubernetes schemas it ships, strictly (unknown fields are errors). A PyTorchJob is
checked against the CRD schema kept in schemas/ and each of its replica pod templates against
Kubernetes' PodTemplateSpec, so a typo inside the pod spec is caught there too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
K8S_VERSION = "1.31.0"
CRD_SCHEMAS = {
    ("kubeflow.org/v1", "PyTorchJob"): HERE / "schemas" / "pytorchjob-kubeflow.org-v1.json"
}


def _k8s(resource: dict, version: str) -> None:
    kubernetes_validate.validate(resource, version, strict=True)


def _pytorchjob(doc: dict, version: str) -> list[str]:
    problems = []
    name = doc["metadata"]["name"]
    specs = doc["spec"]["pytorchReplicaSpecs"]
    for replica, spec in specs.items():
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{name}-{replica.lower()}"},
            "template": spec["template"],
        }
        try:
            _k8s(template, version)
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{replica} pod template: {error.message} at {list(error.path)}")
    elastic = doc["spec"].get("elasticPolicy")
    if elastic is not None:
        if "Master" in specs:
            problems.append("elasticPolicy takes Worker replicas only (no Master)")
        workers = specs.get("Worker", {}).get("replicas", 1)
        low, high = elastic.get("minReplicas", workers), elastic.get("maxReplicas", workers)
        if not low <= workers <= high:
            problems.append(f"Worker replicas {workers} outside [minReplicas {low}, {high}]")
    return problems


def validate(path: Path, version: str) -> list[str]:
    problems = []
    for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
        if doc is None:
            continue
        name = doc.get("metadata", {}).get("name")
        where = f"{path}: document {index + 1} ({doc.get('kind')} {name})"
        schema_path = CRD_SCHEMAS.get((doc.get("apiVersion"), doc.get("kind")))
        if schema_path is not None:
            schema = json.loads(schema_path.read_text())
            errors = sorted(
                jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.path)
            )
            problems += [f"{where}: {e.message} at {list(e.path)}" for e in errors]
            if not errors:
                problems += [f"{where}: {p}" for p in _pytorchjob(doc, version)]
            continue
        try:
            _k8s(doc, version)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"{where}: no schema for {doc.get('apiVersion')} {doc.get('kind')}")
        except kubernetes_validate.ValidationError as error:
            problems.append(f"{where}: {error.message} at {list(error.path)}")
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", "--kubernetes-version", default=K8S_VERSION)
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args(argv)
    files = args.files or sorted(HERE.glob("*.yaml"))
    problems = [p for f in files for p in validate(f, args.kubernetes_version)]
    for problem in problems:
        print(f"INVALID {problem}", file=sys.stderr)
    if not problems:
        names = ", ".join(
            str(f.relative_to(Path.cwd())) if f.is_relative_to(Path.cwd()) else str(f)
            for f in files
        )
        print(f"valid against Kubernetes {args.kubernetes_version} (+ PyTorchJob CRD): {names}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
