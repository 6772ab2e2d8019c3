"""Maintenance windows applied to runs: the ``window`` run guard, and an automatic run's deferral.

``window_verdict``: the ``window`` guard's verdict for a run of a runbook now (None when the runbook
and its trigger declare no window). A person passes it only with ``--override-guard window --reason``
(journaled like every override); the server's automatic runs never pass it.

``deferral``: what the server does with an automatic run outside its windows: ``defer`` (the run
stays pending, a ``run.deferred`` event names the next opening, and the server starts it then) or
``refuse`` (the run ends blocked, naming the next opening). The windows themselves are
``engine.windows`` (pure, clock injected).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from engine.model import Runbook
from engine.run_guards import GuardVerdict, Override
from engine.windows import Window, WindowState, state

__all__ = ["Deferral", "deferral", "trigger_windows", "window_state", "window_verdict"]


def window_state(runbook: Runbook, now: datetime, extra: Sequence[Window] = ()) -> WindowState:
    """Open only when the runbook's windows and the trigger's (``extra``) both are."""
    own, trig = state(runbook.windows, now), state(tuple(extra), now)
    if own.open and trig.open:
        return WindowState(True, None, own.windows + trig.windows)
    nexts = [s.next_opening for s in (own, trig) if not s.open and s.next_opening is not None]
    closed = [s for s in (own, trig) if not s.open]
    return WindowState(False, max(nexts) if len(nexts) == len(closed) else None,
                       tuple(w for s in closed for w in s.windows))


def window_verdict(runbook: Runbook, now: datetime, *, overrides: Mapping[str, str], actor: str,
                   automatic: bool, extra: Sequence[Window] = ()) -> GuardVerdict | None:
    if not runbook.windows and not extra:
        return None
    st = window_state(runbook, now, extra)
    given = None if automatic or st.open else overrides.get("window")
    return GuardVerdict("window", st.open, st.describe(), transient=True,
                        overridden=Override(actor, given) if given else None)


def trigger_windows(note: Mapping[str, Any] | None) -> tuple[Window, ...]:
    """The windows of the trigger that asked for a run, as its ``run.note`` recorded them."""
    raw = (note or {}).get("windows") or ()
    return tuple(Window.model_validate(w) for w in raw)


@dataclass(frozen=True)
class Deferral:
    action: str  # "defer" | "refuse"
    until: datetime | None
    reason: str

    def as_event(self) -> dict[str, Any]:
        return {"until": self.until.astimezone(UTC).isoformat(timespec="seconds") if self.until else None,
                "reason": self.reason}


def deferral(runbook: Runbook, now: datetime, extra: Sequence[Window] = ()) -> Deferral | None:
    """None inside the windows; else defer (to the next opening) or refuse, as the runbook says.
    No next opening within a year: refused (nothing would ever start it)."""
    st = window_state(runbook, now, extra)
    if st.open:
        return None
    action = "refuse" if runbook.outside_windows == "refuse" or st.next_opening is None else "defer"
    return Deferral(action, st.next_opening, st.describe())


def note_of(events: Sequence[Any]) -> Mapping[str, Any] | None:
    notes = [e.data for e in events if e.kind == "run.note"]
    return notes[0] if notes else None


def run_window_verdict(store: Any, run_id: str, runbook: Runbook, now: datetime, *, overrides: Mapping[str, str],
                       actor: str, automatic: bool) -> GuardVerdict | None:
    """``window_verdict`` for a recorded run: the runbook's windows and its trigger's (``run.note``)."""
    extra = trigger_windows(note_of(store.events(run_id))) if automatic else ()
    return window_verdict(runbook, now, overrides=overrides, actor=actor, automatic=automatic, extra=extra)
