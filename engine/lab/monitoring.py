"""The lab's monitoring: real Prometheus (Debian's ``prometheus``) and real Alertmanager
(``prometheus-alertmanager``) on 127.0.0.1, scraping the simulator's exporters (``sim_metrics``)
and paging ``runbook serve``.

Everything lives in ``<lab>/monitoring/``: ``prometheus.yml``, ``alertmanager.yml``, the rule files
the lab writes (``rules/``: the upstream kubernetes-mixin rules of ``engine/lab/rules/`` with only
their ``for:`` replaced by the scenario's ``timing.alert_for_seconds``, plus any extra rule files),
``webhook-token`` (0600; Alertmanager reads it as its bearer credentials), both TSDB/state folders
and both logs. Ports are chosen at run time. The two processes are started in their own sessions
(they outlive ``runbook lab up``) and stopped by PID and start time with the lab.

Must not: listen anywhere but 127.0.0.1, stop a process other than by its recorded PID and start
time, start or touch a system service (it never runs systemctl; Debian's packaged units stay off),
or change an upstream rule beyond its ``for:``.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from engine.lab import procs
from engine.lab.errors import LabError
from engine.lab.ports import free_port, require_loopback
from engine.lab.scenario import Timing

HOST = "127.0.0.1"
UPSTREAM_RULES = "kubernetes-mixin-kubelet.yaml"
DEFAULT_WEBHOOK = "http://127.0.0.1:8080/hooks/alertmanager"  # runbook serve's default --listen
_FOR = re.compile(r"^(\s*)for:\s*\S+\s*$", re.MULTILINE)


def upstream_rules_path() -> Path:
    return Path(str(resources.files("engine.lab") / "rules" / UPSTREAM_RULES))


def compress_for(text: str, seconds: float) -> str:
    """The rule file ``text`` with every ``for:`` duration replaced by ``seconds`` (nothing else changes)."""
    return _FOR.sub(lambda m: f"{m.group(1)}for: {_duration(seconds)}", text)


def _duration(seconds: float) -> str:
    """Prometheus duration syntax: ``10s``, ``1500ms``."""
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{int(seconds * 1000)}ms"


def binary(name: str) -> str:
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if found is None:
        raise LabError(f"{name} is not installed: apt-get install --no-install-recommends "
                       "prometheus prometheus-alertmanager (scripts/prepare.sh does)")
    return found


@dataclass(frozen=True)
class Endpoints:
    prometheus: str
    alertmanager: str
    exporters: str


class Monitoring:
    """Prometheus + Alertmanager of one lab; ``record`` is the ``monitoring`` entry of ``lab.json``."""

    def __init__(self, folder: Path | str, record: dict[str, Any] | None = None) -> None:
        self.dir = Path(folder)
        self.record: dict[str, Any] = dict(record or {})

    # -- start / stop -------------------------------------------------------------------------------
    def start(self, timing: Timing, metrics_port: int, *, webhook_url: str = DEFAULT_WEBHOOK,
              token: str, extra_rules: list[Path] | tuple[Path, ...] = (), timeout: float = 60.0,
              hosts: dict[str, str] | None = None) -> dict[str, Any]:
        """Write the configuration, start both processes and wait until they are ready. ``hosts``: names
        Alertmanager resolves (name -> loopback address; its own /etc/hosts in a private mount
        namespace, as cluster DNS resolves a Service's name for an in-cluster Alertmanager)."""
        prometheus, alertmanager = binary("prometheus"), binary("prometheus-alertmanager")
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rules").mkdir(exist_ok=True)
        token_file = self.dir / "webhook-token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        rules = self._write_rules(timing, extra_rules)
        ports = {"prometheus": free_port(HOST), "alertmanager": free_port(HOST)}
        self.record = {"ports": ports, "metrics_port": metrics_port, "webhook_url": webhook_url,
                       "rule_files": [str(r) for r in rules], "timing": _timing(timing),
                       "processes": {}}
        self._write_alertmanager_config(webhook_url, timing)
        self._write_prometheus_config(timing, metrics_port, rules)
        am_argv = [alertmanager, f"--config.file={self.dir / 'alertmanager.yml'}",
                   f"--storage.path={self.dir / 'alertmanager-data'}",
                   f"--web.listen-address={HOST}:{ports['alertmanager']}", "--cluster.listen-address=",
                   "--log.level=info"]
        if hosts:
            hosts_file = self.dir / "alertmanager-hosts"
            hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
                f"{require_loopback(ip)} {name}\n" for name, ip in sorted(hosts.items())))
            am_argv = ["unshare", "--mount", "--propagation", "private", "/bin/sh", "-c",
                       f"mount --bind {shlex.quote(str(hosts_file))} /etc/hosts && exec "
                       + " ".join(shlex.quote(a) for a in am_argv)]
        self.record["processes"]["alertmanager"] = self._spawn("alertmanager", am_argv)
        self.record["processes"]["prometheus"] = self._spawn("prometheus", [
            prometheus, f"--config.file={self.dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={self.dir / 'prometheus-data'}", "--storage.tsdb.retention.time=1d",
            f"--web.listen-address={HOST}:{ports['prometheus']}", "--web.enable-lifecycle",
            f"--rules.alert.resend-delay={_duration(timing.alert_resend_seconds)}", "--log.level=info"])
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self.record

    def stop(self) -> list[str]:
        """Stop both processes by PID and start time (Prometheus first: it sends to Alertmanager)."""
        stopped = []
        for name in ("prometheus", "alertmanager"):
            ref_json = self.record.get("processes", {}).get(name)
            if not ref_json:
                continue
            ref = procs.ProcessRef.from_json(ref_json)
            if ref.alive():
                procs.stop_processes([ref], timeout=10.0, reap=procs.reap_child)
                stopped.append(f"{name} {ref.pid}")
        return stopped

    def running(self) -> bool:
        refs = [procs.ProcessRef.from_json(r) for r in self.record.get("processes", {}).values()]
        return bool(refs) and all(r.alive() for r in refs)

    @property
    def endpoints(self) -> Endpoints:
        ports = self.record["ports"]
        return Endpoints(f"http://{HOST}:{ports['prometheus']}", f"http://{HOST}:{ports['alertmanager']}",
                         f"http://{HOST}:{self.record['metrics_port']}")

    def _spawn(self, name: str, argv: list[str]) -> dict[str, int]:
        with (self.dir / f"{name}.log").open("ab") as log:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.dir, start_new_session=True, close_fds=True)
        return procs.ProcessRef.of(popen.pid).to_json()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name, url in (("alertmanager", self.endpoints.alertmanager), ("prometheus", self.endpoints.prometheus)):
            ref = procs.ProcessRef.from_json(self.record["processes"][name])
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                        if r.status == 200:
                            break
                except (OSError, urllib.error.URLError):
                    pass
                if not ref.alive():
                    raise LabError(f"{name} exited at start: {self._log_tail(name)}")
                if time.monotonic() > deadline:
                    raise LabError(f"{name} was not ready in {timeout:.0f} s: {self._log_tail(name)}")
                time.sleep(0.2)

    def _log_tail(self, name: str) -> str:
        try:
            return " | ".join((self.dir / f"{name}.log").read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    # -- configuration --------------------------------------------------------------------------------
    def _write_rules(self, timing: Timing, extra_rules: list[Path] | tuple[Path, ...]) -> list[Path]:
        lab_copy = self.dir / "rules" / UPSTREAM_RULES
        lab_copy.write_text(compress_for(upstream_rules_path().read_text(), timing.alert_for_seconds))
        out = [lab_copy]
        for i, extra in enumerate(extra_rules):
            try:
                text = Path(extra).read_text()
            except OSError as e:
                raise LabError(f"{extra}: cannot read rule file: {e.strerror}") from None
            target = self.dir / "rules" / f"extra-{i}-{Path(extra).name}"
            target.write_text(text)  # a copy: the lab folder holds everything Prometheus reads
            out.append(target)
        return out

    def _write_prometheus_config(self, timing: Timing, metrics_port: int, rules: list[Path]) -> None:
        exporters = f"{HOST}:{metrics_port}"
        config: dict[str, Any] = {
            "global": {"scrape_interval": _duration(timing.scrape_seconds),
                       "scrape_timeout": _duration(min(timing.scrape_seconds, 10.0)),
                       "evaluation_interval": _duration(timing.rule_evaluation_seconds)},
            "rule_files": [str(r) for r in rules],
            "alerting": {"alertmanagers": [{"static_configs": [
                {"targets": [f"{HOST}:{self.record['ports']['alertmanager']}"]}]}]},
            "scrape_configs": [
                {"job_name": "kube-state-metrics", "metrics_path": "/metrics",
                 "static_configs": [{"targets": [exporters]}]},
                {"job_name": "kubevirt", "metrics_path": "/kubevirt/metrics",
                 "static_configs": [{"targets": [exporters]}]},
                {"job_name": "dcgm-exporter", "metrics_path": "/dcgm/metrics",
                 "static_configs": [{"targets": [exporters]}]},
            ],
        }
        serve = self.record.get("serve_targets") or {}
        if serve:  # added at run time (``add_scrape_target``)
            job: dict[str, Any] = {"job_name": "runbook-serve", "static_configs": [
                {"targets": [address], "labels": {"instance_name": name}} for name, address in sorted(serve.items())]}
            if (self.dir / "serve-scrape-token").exists():
                job["authorization"] = {"credentials_file": str(self.dir / "serve-scrape-token")}
            config["scrape_configs"].append(job)
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))

    def _write_alertmanager_config(self, webhook_url: str, timing: Timing) -> None:
        config = {
            "route": {"receiver": "runbook", "group_by": ["alertname", "node"],
                      "group_wait": _duration(timing.alert_group_wait_seconds),
                      "group_interval": _duration(timing.alert_group_interval_seconds),
                      "repeat_interval": _duration(timing.alert_repeat_interval_seconds)},
            "receivers": [{"name": "runbook", "webhook_configs": [{
                "url": webhook_url, "send_resolved": True, "max_alerts": 0,
                "http_config": {"authorization": {"credentials_file": str(self.dir / "webhook-token")}}}]}],
        }
        (self.dir / "alertmanager.yml").write_text(yaml.safe_dump(config, sort_keys=False))

    def add_scrape_target(self, name: str, address: str, *, token: str | None = None) -> None:
        """Have Prometheus scrape ``address`` (loopback HOST:PORT) as job ``runbook-serve``, with
        ``token`` as bearer credentials (a reader's, when the server protects ``/metrics``); reloads
        Prometheus. Every runbook-serve target shares the last token given."""
        if not re.fullmatch(r"127\.\d+\.\d+\.\d+:\d+", address):
            raise LabError(f"scrape targets are loopback HOST:PORT, not {address!r}")
        if token is not None:
            token_file = self.dir / "serve-scrape-token"
            token_file.write_text(token)
            token_file.chmod(0o600)
        self.record.setdefault("serve_targets", {})[name] = address
        self._write_prometheus_config(Timing(**self.record["timing"]), self.record["metrics_port"],
                                      [Path(r) for r in self.record["rule_files"]])
        self._post(f"{self.endpoints.prometheus}/-/reload")

    # -- what it sees -------------------------------------------------------------------------------------
    def _get(self, url: str) -> Any:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return json.loads(r.read())
        except (OSError, ValueError) as e:
            raise LabError(f"cannot read {url}: {e}") from e

    def _post(self, url: str) -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="POST", data=b""), timeout=10):
                pass
        except OSError as e:
            raise LabError(f"POST {url} failed: {e}") from e

    def alerts(self) -> list[dict[str, Any]]:
        """Prometheus' alerts (pending and firing): name, node, state, since, labels."""
        data = self._get(f"{self.endpoints.prometheus}/api/v1/alerts")
        out = []
        for a in data.get("data", {}).get("alerts", []):
            labels = a.get("labels", {})
            out.append({"alertname": labels.get("alertname", ""), "node": labels.get("node"),
                        "state": a.get("state"), "active_at": a.get("activeAt"), "labels": labels})
        return sorted(out, key=lambda a: (a["alertname"], a["node"] or ""))

    def rule_groups(self) -> list[dict[str, Any]]:
        """Prometheus' ``/api/v1/rules`` groups (each rule with its ``health`` and ``lastError``)."""
        groups: list[dict[str, Any]] = self._get(f"{self.endpoints.prometheus}/api/v1/rules").get(
            "data", {}).get("groups", [])
        return groups

    def query(self, expr: str) -> list[dict[str, Any]]:
        url = f"{self.endpoints.prometheus}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        result: list[dict[str, Any]] = self._get(url).get("data", {}).get("result", [])
        return result

    def alertmanager_alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self._get(f"{self.endpoints.alertmanager}/api/v2/alerts")
        return alerts


def _timing(timing: Timing) -> dict[str, Any]:
    return timing.model_dump()
