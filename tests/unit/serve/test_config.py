"""Serve configuration: documented defaults, YAML file, environment, located errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.errors import UsageError
from engine.serve.config import ServeConfig, load_config, split_listen


def test_defaults_are_the_documented_ones() -> None:
    c = load_config(None, env={})
    assert c.listen == "127.0.0.1:8080"
    assert c.webhook_token is None and c.force_mode is None
    assert (c.breaker.max_auto_runs, c.breaker.window) == (3, 3600.0)
    assert (c.breaker.max_unhealthy_nodes, c.breaker.max_unhealthy_gpus) == (2, 8)
    assert c.breaker.max_pending_approvals == 10
    assert (c.dedup.fingerprint_window, c.dedup.node_cooldown, c.dedup.webhook_id_window) == (3600, 900, 86400)
    assert c.exclusions.labels == {"runbook.io/exclude": "true",
                                   "remediation.medik8s.io/exclude-from-remediation": "true"}
    assert (c.exclusions.kured.namespace, c.exclusions.kured.daemonset, c.exclusions.kured.annotation) == (
        "kube-system", "kured", "weave.works/kured-node-lock")
    assert c.max_body_bytes == 2 * 1024 * 1024
    assert (c.workers, c.queue_size) == (2, 50)
    assert c.pagerduty.event_types == ("incident.triggered",)


def test_file_then_environment(tmp_path: Path) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text("""
listen: 127.0.0.1:9090
webhook_token: from-file-0123456789
breaker: {max_auto_runs: 1, window: 30m, max_unhealthy_nodes: 4}
dedup: {node_cooldown: 2m}
mode_overrides: {gpu-node-recovery: auto}
pagerduty:
  secrets: [old-secret-0123456789]
  mappings:
    - service: PF9KMXH
      title_pattern: 'Node (?P<node>[a-z0-9.-]+) is NotReady'
      runbook: gpu-node-recovery
""")
    c = load_config(f, env={"RUNBOOK_WEBHOOK_TOKEN": "from-env-0123456789",
                            "RUNBOOK_PAGERDUTY_SECRET": "new-secret-0123456789",
                            "RUNBOOK_NOTIFY_URL": "http://127.0.0.1:9/hook"})
    assert c.listen == "127.0.0.1:9090"
    assert c.webhook_token == "from-env-0123456789"
    assert c.auth.senders == {"alertmanager": "from-env-0123456789"}
    assert c.breaker.max_auto_runs == 1 and c.breaker.window == 1800 and c.breaker.max_unhealthy_nodes == 4
    assert c.dedup.node_cooldown == 120
    assert c.pagerduty.secrets == ("new-secret-0123456789", "old-secret-0123456789")
    assert c.notify.url == "http://127.0.0.1:9/hook"
    assert c.mode_for("gpu-node-recovery", "approve") == "auto"
    assert c.pagerduty.mappings[0].runbook == "gpu-node-recovery"


def test_force_mode_approve_wins_over_everything() -> None:
    c = ServeConfig(force_mode="approve", mode_overrides={"x": "auto"})
    assert c.mode_for("x", "auto") == "approve"
    assert load_config(None, env={"RUNBOOK_SERVE_FORCE_MODE": "approve"}).mode_for("y", "auto") == "approve"


def test_the_token_never_shows_in_repr() -> None:
    assert "s3cret" not in repr(ServeConfig(webhook_token="s3cret"))


@pytest.mark.parametrize(("text", "needle"), [
    ("breaker: {max_auto_runs: -1}", "breaker.max_auto_runs"),
    ("breaker: {window: soon}", "breaker.window"),
    ("unknown_key: 1", "unknown_key"),
    ("listen: localhost", "listen"),
    ("force_mode: auto", "force_mode"),
    ("pagerduty: {mappings: [{title_pattern: '(', runbook: x}]}", "title_pattern"),
    ("notify: {url: 'ftp://x'}", "notify.url"),
    ("- a list", "must be a mapping"),
    ("a: [unclosed", "invalid YAML"),
    ("auth: {mode: ldap}", "auth.mode"),
    ("auth: {mode: kubernetes, approvers: {alice: 0123456789abcdef-alice}}", "remove approvers.alice"),
    ("auth: {kubernetes: {namespace: Not_A_Namespace}}", "auth.kubernetes.namespace"),
])
def test_invalid_configuration_is_a_usage_error_naming_the_key(tmp_path: Path, text: str, needle: str) -> None:
    f = tmp_path / "serve.yaml"
    f.write_text(text)
    with pytest.raises(UsageError) as e:
        load_config(f, env={})
    assert str(f) in str(e.value) and needle in str(e.value)


def test_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot read"):
        load_config(tmp_path / "nope.yaml", env={})


def test_split_listen() -> None:
    assert split_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert split_listen("[::1]:9000") == ("::1", 9000)
    for bad in ("8080", ":8080", "host:", "host:0", "host:70000"):
        with pytest.raises(ValueError):
            split_listen(bad)


ROOT = Path(__file__).resolve().parents[3]


def test_the_example_configuration_in_deploy_loads() -> None:
    c = load_config(ROOT / "deploy" / "serve.example.yaml", env={})
    assert c.pagerduty.mappings[0].runbook == "gpu-node-recovery"


def test_the_documented_defaults_are_the_real_defaults() -> None:
    import yaml

    doc = (ROOT / "docs" / "serve.md").read_text()
    section = doc.split("## Configuration file", 1)[1]
    block = section.split("```yaml", 1)[1].split("```", 1)[0]
    documented = load_config(None, env={}, overrides=yaml.safe_load(block))
    assert documented == ServeConfig()


def test_the_deploy_base_turns_the_remediator_on(tmp_path: Path) -> None:
    import yaml

    docs = yaml.safe_load_all((ROOT / "deploy" / "kubernetes" / "configmaps.yaml").read_text())
    serve = next(d for d in docs if d and d["metadata"]["name"] == "runbook-serve")["data"]["serve.yaml"]
    (tmp_path / "serve.yaml").write_text(serve)
    c = load_config(tmp_path / "serve.yaml", env={})
    assert c.remediator.enabled and not ServeConfig().remediator.enabled
