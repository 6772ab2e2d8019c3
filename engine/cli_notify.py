"""Notifications for CLI runs (``--notify-config FILE``): the server's targets, sent when a run ends.

``FILE`` is a serve configuration (``runbook serve --config``): its ``notify:`` section (generic or
Slack-compatible webhook, signing ``secret``, ``pagerduty:``) and ``public_url`` are used, with the
same environment overrides (``RUNBOOK_NOTIFY_URL``, ``RUNBOOK_NOTIFY_SECRET``,
``RUNBOOK_PAGERDUTY_ROUTING_KEY``); the rest of the file is validated and otherwise ignored. After
the command, every run the command itself created or resumed (``OwnRuns``: never another
operator's runs in a shared store) that ended (or parked for approval) while it ran is notified: one
``step`` notification per step outcome (PagerDuty only, unless ``notify.events`` lists ``step``),
then ``finished`` / ``failed`` / ``blocked`` / ``waiting-approval`` with the run's report. A CLI run
answers no alert, so PagerDuty is only told with ``--pagerduty-dedup-key KEY`` (the incident's
alert you are working on); without it only the webhook is used.

Must not: change a run or the command's exit code (failures to send are logged warnings), or send
anything when no ``--notify-config`` was given.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from engine.journal import opened
from engine.model import RunState
from engine.serve.config import ServeConfig, load_config
from engine.serve.notify import Notification, Notifier, run_report, step_outcomes
from engine.store import RunStore

log = logging.getLogger(__name__)
SOURCE = "cli"
_EVENTS = {RunState.SUCCEEDED: "finished", RunState.FAILED: "failed", RunState.BLOCKED: "blocked",
           RunState.CANCELLED: "failed", RunState.INTERRUPTED: "failed", RunState.WAITING_APPROVAL: "waiting-approval"}


def load_notify_config(path: str | Path) -> ServeConfig:
    """The serve configuration at ``path`` (UsageError, located, when unreadable or invalid)."""
    return load_config(Path(path))


class OwnRuns:
    """A run store that notes the ids of the runs created (``create_run``) or claimed
    (``claim``: a resume) through it, so that a command tells about its own runs only. Every other
    call goes to the store unchanged."""

    def __init__(self, store: RunStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._ids: set[str] = set()

    @property
    def ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._ids)

    def create_run(self, runbook: str, params: Mapping[str, Any], nodes: list[str], **kwargs: Any) -> str:
        run_id = self._store.create_run(runbook, params, nodes, **kwargs)
        with self._lock:
            self._ids.add(run_id)
        return run_id

    def claim(self, run_id: str) -> bool:
        claimed = self._store.claim(run_id)
        if claimed:
            with self._lock:
                self._ids.add(run_id)
        return claimed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def notifications_since(store: RunStore | Path | None, since: float, *, pagerduty_key: str = "",
                        public_url: str | None = None, only: Collection[str] | None = None) -> list[Notification]:
    """What to send for the CLI runs that ended or parked at or after ``since`` (epoch seconds),
    read from the run store (or the SQLite journal at that path). ``only``: these runs (the ones a
    command created or resumed, whatever their source), no other."""
    out: list[Notification] = []
    with opened(store) as journal:
        for r in reversed(journal.list_runs(limit=1000)):
            event = _EVENTS.get(r.state)
            changed = max(r.created, r.finished or 0.0)
            mine = r.source == SOURCE if only is None else r.id in only
            if not mine or event is None or changed < since:
                continue
            events = [e.as_dict() for e in journal.events(r.id)]
            node = r.nodes[0] if r.nodes else None
            reasons = [str(e.get("reason") or "") for e in events
                       if e.get("kind") in ("run.blocked", "run.failed", "run.cancelled", "run.interrupted")]
            reason = reasons[-1] if reasons else r.state.value
            link = f"{public_url.rstrip('/')}/ui/runs/{quote(r.id, safe='')}" if public_url else None
            common = {"node": node, "run_id": r.id, "mode": "cli", "pagerduty_key": pagerduty_key, "link": link}
            for s in step_outcomes(events):
                out.append(Notification("step", r.runbook, state="running", reason=s["reason"],
                                        extra={"step": s["step"], "status": s["status"]}, **common))  # type: ignore[arg-type]
            extra: dict[str, object] = {"exit_code": r.exit_code}
            if r.state is RunState.WAITING_APPROVAL and r.plan_digest:
                extra["plan_digest"] = r.plan_digest
            out.append(Notification(event, r.runbook, state=r.state.value, reason=reason,
                                    report=run_report(events, r.state.value, reason), extra=extra,
                                    **common))  # type: ignore[arg-type]
    return out


def send_cli_notifications(config: ServeConfig, store: RunStore | Path | None, since: float, *,
                           pagerduty_key: str = "", timeout: float = 30.0, only: Collection[str] | None = None) -> int:
    """Send (and wait for) the notifications of the CLI runs that ended since ``since`` (``only``:
    of these runs); their count."""
    notifier = Notifier.from_config(config.notify, public_url=config.public_url)
    found = notifications_since(store, since, pagerduty_key=pagerduty_key, public_url=config.public_url, only=only)
    for n in found:
        notifier.notify(n)
    if not notifier.flush(timeout):
        log.warning("notifications still unsent after %.0fs: given up", timeout)
    notifier.close(timeout=1.0)
    return len(found)
