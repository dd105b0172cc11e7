"""deploy/: the Kubernetes manifests pass the API schema (offline) and keep the pair's contract."""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

import tether
from tether.cluster import smg_path
from tether.settings import Settings, env_name

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.33.0"  # native sidecars are stable from here on
PRESTOP_MARGIN_S = 5


def docs() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def one(kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}"
    return found[0]


def test_every_manifest_passes_the_schema_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the schema check tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    kinds = set()
    for doc in docs():
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.add(doc["kind"])
    assert {"Deployment", "Service", "Secret", "Ingress"} <= kinds


def test_the_schema_check_can_fail() -> None:
    pod = one("Deployment", "tether")["spec"]["template"]["spec"]
    bad = {**one("Deployment", "tether")}
    bad["spec"] = {**bad["spec"], "template": {**bad["spec"]["template"],
                                               "spec": {**pod, "restartPolicyy": "Always"}}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_pod_is_one_pair_with_the_daemon_as_native_sidecar() -> None:
    pod = one("Deployment", "tether")["spec"]["template"]["spec"]
    [daemon] = pod["initContainers"]
    [proxy] = pod["containers"]
    assert daemon["args"][0] == "daemon" and proxy["args"][0] == "proxy"
    assert daemon["restartPolicy"] == "Always" and "startupProbe" in daemon
    fifos = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
    assert len(fifos) == 1
    runtime_dir = one("ConfigMap", "tether")["data"]["TETHER_RUNTIME_DIR"]
    for c in (daemon, proxy):
        assert {"name": fifos[0]["name"], "mountPath": runtime_dir} in c["volumeMounts"]
    assert daemon["startupProbe"]["exec"]["command"][-1] == f"{runtime_dir}/tokens"
    for probe in ("readinessProbe", "livenessProbe"):
        assert proxy[probe]["httpGet"]["path"] == "/health"
    assert _env(daemon)["TETHER_STATE_URL"] == {"secretKeyRef": {"name": "tether-store",
                                                                 "key": "url"}}
    assert "url" in one("Secret", "tether-store")["stringData"]


def test_shutdown_fits_the_drain_timeout() -> None:
    pod = one("Deployment", "tether")["spec"]["template"]["spec"]
    drain = float(one("ConfigMap", "tether")["data"]["TETHER_DRAIN_TIMEOUT_S"])
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + PRESTOP_MARGIN_S


def test_settings_named_in_the_manifests_exist() -> None:
    known = {env_name(f.name) for f in dataclasses.fields(Settings)}
    assert set(one("ConfigMap", "tether")["data"]) <= known
    pod = one("Deployment", "tether")["spec"]["template"]["spec"]
    named = {n for c in pod["initContainers"] + pod["containers"] for n in _env(c)}
    assert {n for n in named if n.startswith("TETHER_")} <= known


def test_services_reach_the_pods() -> None:
    for name, deployment in (("tether", "tether"), ("tether-router", "tether-router")):
        service = one("Service", name)["spec"]
        template = one("Deployment", deployment)["spec"]["template"]
        assert service["selector"].items() <= template["metadata"]["labels"].items()
        ports = {p["name"] for c in template["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["ports"]} <= ports


def test_the_router_runs_smg_with_flags_it_has_and_finds_the_pairs() -> None:
    smg = smg_path()
    assert smg is not None, "smg is a dev dependency"
    known = set(re.findall(r"--[a-z0-9-]+", subprocess.run(
        [smg, "launch", "--help"], capture_output=True, text=True, timeout=60).stdout))
    [router] = one("Deployment", "tether-router")["spec"]["template"]["spec"]["containers"]
    args = router["args"]
    assert router["command"] == ["smg"] and args[0] == "launch"
    assert {a for a in args if a.startswith("--")} <= known
    selector = args[args.index("--selector") + 1]
    labels = one("Deployment", "tether")["spec"]["template"]["metadata"]["labels"]
    assert dict([selector.split("=")]).items() <= labels.items()
    assert args[args.index("--health-check-endpoint") + 1] == "/health"


def test_ingress_sends_stored_response_reads_to_the_pairs() -> None:
    paths = {(p["path"], p["pathType"]): p["backend"]["service"]["name"]
             for p in one("Ingress", "tether")["spec"]["rules"][0]["http"]["paths"]}
    assert paths[("/v1/responses", "Exact")] == "tether-router"
    assert paths[("/v1/responses/", "Prefix")] == "tether"
    assert paths[("/v1/conversations", "Prefix")] == "tether"
    assert paths[("/", "Prefix")] == "tether-router"


def test_images_are_the_one_the_containerfile_builds() -> None:
    tag = f"tether:{tether.__version__}"  # the one place the version is written
    assert f"-t {tag} " in (DEPLOY / "Containerfile").read_text()
    images = {c["image"] for d in docs() if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"].get("initContainers", [])
              + d["spec"]["template"]["spec"]["containers"]}
    assert images == {tag}
