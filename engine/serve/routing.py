"""At start: does Alertmanager's routing put several nodes' alerts in one page?

A run fixes one node. When the route that delivers to runbook groups alerts without the node label
(``group_by: [alertname]``), one Alertmanager group - and so one PagerDuty incident - holds every
node's alert, and resolving it after one node's run would resolve the others' alerts too. runbook
resolves such a group only when every node of it recovered (``engine.serve.page_groups``), but the
page then stays open until the last node is fixed: ``group_by: [alertname, node]`` (or ``[...]``)
gives one page per node. With ``alertmanager.url`` set, the server reads Alertmanager's running
configuration (``GET /api/v2/status``, ``config.original``) once at start and logs a warning per
route that delivers to ``/hooks/alertmanager`` without a trigger's node label in its ``group_by``.
Only warns: it never changes what the server does, and an unreachable Alertmanager is a warning.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import yaml

log = logging.getLogger(__name__)
HOOK_PATH = "/hooks/alertmanager"


def _our_receivers(cfg: Mapping[str, Any]) -> set[str]:
    out = set()
    for r in cfg.get("receivers") or []:
        if not isinstance(r, Mapping):
            continue
        for w in r.get("webhook_configs") or []:
            if isinstance(w, Mapping) and HOOK_PATH in str(w.get("url") or ""):
                out.add(str(r.get("name")))
    return out


def routing_warnings(cfg: Mapping[str, Any], node_labels: Mapping[str, str | None]) -> list[str]:
    """One warning per route delivering to runbook whose ``group_by`` lacks a trigger's node label."""
    ours = _our_receivers(cfg)
    labels = sorted({label for label in node_labels.values() if label})
    warnings: list[str] = []

    def walk(route: Mapping[str, Any], receiver: str, group_by: Sequence[str], path: str) -> None:
        receiver = str(route.get("receiver") or receiver)
        group_by = list(route.get("group_by", group_by) or [])
        if receiver in ours and "..." not in group_by:
            missing = [label for label in labels if label not in group_by]
            runbooks = sorted(rb for rb, label in node_labels.items() if label in missing)
            if missing:
                warnings.append(
                    f"Alertmanager route {path} (receiver {receiver}) groups by {group_by or '[]'}, without "
                    f"{', '.join(missing)}: one page can hold several nodes' alerts for {', '.join(runbooks)}; "
                    "runbook resolves such a page only when every node in it recovered. Use "
                    f"group_by: [alertname, {missing[0]}] for one page per node (docs/serve.md)")
        for i, child in enumerate(route.get("routes") or []):
            if isinstance(child, Mapping):
                walk(child, receiver, group_by, f"{path}.routes[{i}]")

    root = cfg.get("route")
    if isinstance(root, Mapping):
        walk(root, "", [], "route")
    return warnings


def fetch_config(url: str, *, timeout: float = 5.0, transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """Alertmanager's running configuration (``/api/v2/status``, ``config.original`` parsed)."""
    with httpx.Client(timeout=timeout, transport=transport) as client:
        resp = client.get(url.rstrip("/") + "/api/v2/status")
        resp.raise_for_status()
        original = (resp.json().get("config") or {}).get("original") or ""
    data = yaml.safe_load(original)
    return data if isinstance(data, dict) else {}


def warn_about_routing(config: Any, index: Any, *, transport: httpx.BaseTransport | None = None) -> list[str]:
    """Read Alertmanager's routing (``alertmanager.url``) and log what would resolve others' alerts."""
    try:
        cfg = fetch_config(config.alertmanager.url, transport=transport)
    except Exception as e:  # Why: a check at start must never stop the server
        log.warning("cannot read Alertmanager's routing at %s to check its group_by: %s: %s",
                    config.alertmanager.url, type(e).__name__, str(e)[:200])
        return []
    warnings = routing_warnings(cfg, index.node_labels())
    for w in warnings:
        log.warning("%s", w)
    return warnings
