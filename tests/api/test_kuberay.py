"""deploy/kuberay manifests are valid against KubeRay's own CRD schemas (../shared/kuberay).

The RayService's serveConfigV2 is exactly deploy/serve.yaml (which test_deploy_files builds
into our app); the RayJob runs the batch job with flags its parser accepts.
"""

from __future__ import annotations

import shlex
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CRDS = ROOT.parent / "shared" / "kuberay"


@cache
def crd_schema(name: str) -> dict:
    """The CRD's v1 schema; libyaml's loader where present (the CRDs are MBs of YAML)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    crd = yaml.load((CRDS / f"ray.io_{name}.yaml").read_text(), Loader=loader)  # noqa: S506 - a safe loader
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return v1["schema"]["openAPIV3Schema"]


@pytest.mark.parametrize(("manifest", "crd", "kind"), [("rayservice.yaml", "rayservices", "RayService"),
                                                       ("rayjob.yaml", "rayjobs", "RayJob")])
def test_manifest_validates_against_the_crd(manifest: str, crd: str, kind: str) -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "kuberay" / manifest).read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == kind
    jsonschema.Draft7Validator(crd_schema(crd)).validate(doc)


def test_a_broken_manifest_is_caught() -> None:
    doc = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())
    doc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(crd_schema("rayservices")).validate(doc)


def test_rayservice_serves_exactly_deploy_serve_yaml() -> None:
    svc = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayservice.yaml").read_text())
    serve_yaml = yaml.safe_load((ROOT / "deploy" / "serve.yaml").read_text())
    assert yaml.safe_load(svc["spec"]["serveConfigV2"]) == serve_yaml
    workers = svc["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    args = yaml.safe_load(svc["spec"]["serveConfigV2"])["applications"][0]["args"]
    gpus = int(workers["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == args["data_parallel_size"] * args["gpus_per_rank"]  # the worker holds one rank group


def test_rayjob_entrypoint_parses() -> None:
    from service.jobs import batch

    job = yaml.safe_load((ROOT / "deploy" / "kuberay" / "rayjob.yaml").read_text())
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:3] == ["python", "-m", "service.jobs.batch"]
    parsed = batch.parser().parse_args(argv[3:])
    assert parsed.data_parallel_size == 2 and parsed.gpus_per_rank == 1
