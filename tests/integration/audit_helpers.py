"""Reading the lab API server's audit log (RequestResponse level for runbook.io objects)."""

from __future__ import annotations

from typing import Any

from engine.kube_store import PHASE_LABEL


def is_phase_label_write(event: dict[str, Any]) -> bool:
    """True for the store's one write of a RemediationRun itself (not its status): the
    ``runbook.io/phase`` label brought in step with the phase (engine/kube_store.py,
    ``_label_phase``). Its spec is as created: the API server bumps ``metadata.generation`` on a
    change of anything but metadata and status, and the response still says generation 1."""
    ref = event.get("objectRef") or {}
    if event.get("verb") != "update" or ref.get("resource") != "remediationruns" or ref.get("subresource"):
        return False
    sent = ((event.get("requestObject") or {}).get("metadata") or {}).get("labels") or {}
    kept = (event.get("responseObject") or {}).get("metadata") or {}
    return PHASE_LABEL in sent and kept.get("generation") == 1
