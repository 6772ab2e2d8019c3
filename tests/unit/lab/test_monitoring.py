"""The lab's exporters (``sim_metrics``) and rule handling (``monitoring``), without processes.

The series are parsed back with prometheus_client's own text parser, so names, label names and
values are checked as Prometheus will read them.
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from engine.lab import sim_metrics
from engine.lab.errors import LabError
from engine.lab.monitoring import Monitoring, compress_for, upstream_rules_path
from engine.lab.scenario import Timing


def _node(name: str, ready: str, *, taints: list[dict[str, str]] | None = None,
          labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints or [], **({"unschedulable": True} if name == "cordoned" else {})},
            "status": {"conditions": [{"type": "Ready", "status": ready}],
                       "allocatable": {"cpu": "24", "memory": "64Gi", "pods": "110", "nvidia.com/gpu": "1",
                                       "nvidia.com/GB202_GEFORCE_RTX_5090": "0"}}}


def _samples(path: str, state: sim_metrics.LabState) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Render one exporter the way the WSGI app does and parse the text back."""
    app = sim_metrics.wsgi_app(lambda: state)
    status: list[str] = []
    body = b"".join(app({"PATH_INFO": path, "REQUEST_METHOD": "GET", "QUERY_STRING": "",
                         "wsgi.input": io.BytesIO()}, lambda s, h: status.append(s)))
    assert status[0].startswith("200"), status
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def _value(samples: list[tuple[dict[str, str], float]], **labels: str) -> float | None:
    found = [v for have, v in samples if all(have.get(k) == x for k, x in labels.items())]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_kube_state_metrics_series_are_named_and_labelled_like_kube_state_metrics_v2() -> None:
    unreachable = [{"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
                   {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}]
    state = sim_metrics.LabState(
        nodes=[_node("omen2", "Unknown", taints=unreachable,
                     labels={"nvidia.com/gpu.workload.config": "vm-passthrough"}),
               _node("worker-1", "True"), _node("cordoned", "True")],
        pods=[{"metadata": {"namespace": "gpu-operator", "name": "dp-1", "uid": "u1"},
               "status": {"phase": "Running"}}])
    s = _samples("/metrics", state)
    cond = s["kube_node_status_condition"]
    assert _value(cond, node="omen2", condition="Ready", status="true") == 0
    assert _value(cond, node="omen2", condition="Ready", status="unknown") == 1
    assert _value(cond, node="worker-1", condition="Ready", status="true") == 1
    assert _value(s["kube_node_spec_unschedulable"], node="cordoned") == 1
    assert _value(s["kube_node_spec_unschedulable"], node="omen2") == 0
    alloc = s["kube_node_status_allocatable"]
    assert _value(alloc, node="omen2", resource="cpu", unit="core") == 24
    assert _value(alloc, node="omen2", resource="memory", unit="byte") == 64 * 2**30
    assert _value(alloc, node="omen2", resource="nvidia_com_gpu", unit="integer") == 1
    assert _value(alloc, node="omen2", resource="nvidia_com_GB202_GEFORCE_RTX_5090", unit="integer") == 0
    assert _value(s["kube_node_labels"], node="omen2",
                  label_nvidia_com_gpu_workload_config="vm-passthrough") == 1
    taint = s["kube_node_spec_taint"]
    assert _value(taint, node="omen2", key="node.kubernetes.io/unreachable", value="", effect="NoSchedule") == 1
    assert _value(taint, node="worker-1") is None
    phase = s["kube_pod_status_phase"]
    assert _value(phase, namespace="gpu-operator", pod="dp-1", uid="u1", phase="Running") == 1
    assert _value(phase, namespace="gpu-operator", pod="dp-1", uid="u1", phase="Pending") == 0


def test_kubevirt_phase_count_counts_vmis_per_node_and_lower_cased_phase() -> None:
    vmis = [{"metadata": {"name": n, "annotations": {}}, "status": {"phase": p, "nodeName": node}}
            for n, p, node in (("a", "Running", "worker-1"), ("b", "Running", "worker-1"), ("c", "Pending", ""))]
    s = _samples("/kubevirt/metrics", sim_metrics.LabState(vmis=vmis))
    counts = s["kubevirt_vmi_phase_count"]
    assert _value(counts, node="worker-1", phase="running", os="<none>", instance_type="<none>") == 2
    assert _value(counts, node="", phase="pending") == 1


def test_dcgm_exports_only_gpus_on_the_nvidia_driver_and_the_lab_series_names_every_bound_driver() -> None:
    gpu = {"slot": "01:00.0", "vendor_device": "10de:2b85", "name": "GB202 [GeForce RTX 5090]",
           "display": True, "driver": "nvidia"}
    hosts = {"omen2": {"pci_devices": [gpu], "cuda_jobs": [{"used_memory_mib": 21504}]},
             "gpu-3090-1": {"pci_devices": [{**gpu, "vendor_device": "10de:2204", "driver": "vfio-pci",
                                              "name": "GA102 [GeForce RTX 3090]"}]}}
    s = _samples("/dcgm/metrics", sim_metrics.LabState(hosts=hosts))
    (labels, used), = s["DCGM_FI_DEV_FB_USED"]
    assert used == 21504
    assert labels == {"gpu": "0", "UUID": sim_metrics.gpu_uuid(gpu), "pci_bus_id": "00000000:01:00.0",
                      "device": "nvidia0", "modelName": "NVIDIA GeForce RTX 5090", "Hostname": "omen2",
                      "DCGM_FI_DRIVER_VERSION": sim_metrics.DRIVER_VERSION}
    drivers = s["runbook_lab_gpu_driver"]
    assert _value(drivers, Hostname="gpu-3090-1", driver="vfio-pci") == 1
    assert _value(drivers, Hostname="omen2", driver="nvidia") == 1


def test_an_unknown_path_is_a_404_not_an_exporter() -> None:
    app = sim_metrics.wsgi_app(lambda: sim_metrics.LabState())
    status: list[str] = []
    app({"PATH_INFO": "/other", "REQUEST_METHOD": "GET", "wsgi.input": io.BytesIO()},
        lambda s, h: status.append(s))
    assert status == ["404 Not Found"]


def test_the_lab_copy_of_the_upstream_rules_differs_only_in_its_for_durations() -> None:
    upstream = upstream_rules_path().read_text()
    lab = compress_for(upstream, 10)
    durations = re.compile(r"^\s*for: (\S+)$", re.MULTILINE)
    assert durations.findall(upstream) == ["15m", "15m"]
    assert durations.findall(lab) == ["10s", "10s"]
    assert compress_for(upstream, 1.5).count("for: 1500ms") == 2
    up_rules = yaml.safe_load(upstream)["groups"][0]["rules"]
    lab_rules = yaml.safe_load(lab)["groups"][0]["rules"]
    assert [r["alert"] for r in lab_rules] == ["KubeNodeNotReady", "KubeNodeUnreachable"]
    for a, b in zip(up_rules, lab_rules, strict=True):
        assert {k: v for k, v in a.items() if k != "for"} == {k: v for k, v in b.items() if k != "for"}


def test_a_scrape_computes_from_the_current_state_each_time() -> None:
    current = {"state": sim_metrics.LabState(nodes=[_node("omen2", "Unknown")])}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(sim_metrics._Exporter(lambda: current["state"], sim_metrics.kube_state_metrics))
    assert registry.get_sample_value("kube_node_status_condition",
                                     {"node": "omen2", "condition": "Ready", "status": "true"}) == 0
    current["state"] = sim_metrics.LabState(nodes=[_node("omen2", "True")])
    assert registry.get_sample_value("kube_node_status_condition",
                                     {"node": "omen2", "condition": "Ready", "status": "true"}) == 1


def _configured(tmp_path: Path, **targets: str) -> Monitoring:
    mon = Monitoring(tmp_path / "monitoring")
    (mon.dir / "rules").mkdir(parents=True)
    timing = Timing()
    rules = mon._write_rules(timing, [Path(__file__).resolve().parents[3] / "deploy/monitoring/runbook-alerts.yaml"])
    mon.record = {"ports": {"prometheus": 20001, "alertmanager": 20002}, "metrics_port": 20003,
                  "timing": timing.model_dump(), "rule_files": [str(r) for r in rules], "serve_targets": targets}
    (mon.dir / "webhook-token").write_text("t0ken-for-alertmanager")
    mon._write_alertmanager_config("http://127.0.0.1:8080/hooks/alertmanager", timing)
    mon._write_prometheus_config(timing, 20003, rules)
    return mon


def test_the_generated_prometheus_and_alertmanager_configurations_pass_their_own_checkers(tmp_path: Path) -> None:
    for tool in ("promtool", "amtool"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (apt-get install prometheus prometheus-alertmanager)")
    mon = _configured(tmp_path, lab="127.0.0.1:20004")
    prom = subprocess.run(["promtool", "check", "config", str(mon.dir / "prometheus.yml")],
                          capture_output=True, text=True, check=False)
    assert prom.returncode == 0, prom.stdout + prom.stderr
    assert "SUCCESS: 2 rule files found" in prom.stdout + prom.stderr, prom.stdout + prom.stderr
    am = subprocess.run(["amtool", "check-config", str(mon.dir / "alertmanager.yml")],
                        capture_output=True, text=True, check=False)
    assert am.returncode == 0, am.stdout + am.stderr


def test_everything_the_lab_monitoring_talks_to_is_on_loopback_and_the_token_stays_out_of_the_configs(
        tmp_path: Path) -> None:
    mon = _configured(tmp_path, lab="127.0.0.1:20004")
    prom = yaml.safe_load((mon.dir / "prometheus.yml").read_text())
    am = yaml.safe_load((mon.dir / "alertmanager.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    targets += [t for a in prom["alerting"]["alertmanagers"] for sc in a["static_configs"] for t in sc["targets"]]
    assert targets and all(t.startswith("127.0.0.1:") for t in targets), targets
    assert {j["job_name"] for j in prom["scrape_configs"]} == {
        "kube-state-metrics", "kubevirt", "dcgm-exporter", "runbook-serve"}
    (receiver,) = am["receivers"][0]["webhook_configs"]
    assert receiver["send_resolved"] is True and receiver["url"].startswith("http://127.0.0.1:")
    assert receiver["http_config"]["authorization"] == {"credentials_file": str(mon.dir / "webhook-token")}
    assert "t0ken" not in (mon.dir / "alertmanager.yml").read_text()
    assert am["route"]["group_by"] == ["alertname", "node"]
    with pytest.raises(LabError, match="loopback"):
        mon.add_scrape_target("elsewhere", "10.0.0.5:8080")
