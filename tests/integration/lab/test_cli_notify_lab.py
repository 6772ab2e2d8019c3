"""CLI runs tell the notification targets (`--notify-config`) on the lab: the refused run on gpu-3090-2
reaches a signed webhook and the PagerDuty incident (left open) with the evidence of the real cause."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.serve.notify import verify_webhook
from tests.fakes.notify import ROUTING_KEY, SECRET, running
from tests.integration.lab.flagship_cli import runbook

pytestmark = [pytest.mark.integration, pytest.mark.lab]


def test_a_refused_cli_run_is_told_to_the_webhook_and_pagerduty_with_its_evidence(
        incident: Any, sh: Any, tmp_path: Path) -> None:
    with running() as receiver:
        cfg = tmp_path / "notify.yaml"
        cfg.write_text(yaml.safe_dump({"public_url": "https://runbook.example.org", "notify": {
            "url": receiver.url + "/hook", "secret": SECRET,
            "pagerduty": {"routing_key": ROUTING_KEY, "url": receiver.url + "/v2/enqueue"}}}))
        r = runbook(sh, f"run gpu-node-recovery --node gpu-3090-2 --yes --notify-config {cfg} "
                        "--pagerduty-dedup-key KubeNodeNotReady-gpu-3090-2", journal=tmp_path / "journal.sqlite")
        assert r.returncode == 3, r.stdout + r.stderr  # the exit code stands
    assert len(receiver.hooks) == 1, receiver.hooks
    body, header = receiver.hooks[0]
    assert verify_webhook(body, header, SECRET, now=time.time())
    event = json.loads(body)["runbook_event"]
    assert (event["event"], event["node"], event["state"], event["runbook"]) == (
        "blocked", "gpu-3090-2", "blocked", "gpu-node-recovery")
    assert "down-only-because-of-swap" in event["report"] and "containerd.sock" in event["report"]
    assert event["link"] == f"https://runbook.example.org/ui/runs/{event['run_id']}"  # its console page
    assert receiver.refused == []
    assert [e["event_action"] for e in receiver.events] == ["trigger"]  # left open, with the evidence
    (pd,) = receiver.events
    assert pd["dedup_key"] == "KubeNodeNotReady-gpu-3090-2"
    assert "containerd.sock" in pd["payload"]["custom_details"]["report"]
