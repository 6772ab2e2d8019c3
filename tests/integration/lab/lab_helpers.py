"""Small helpers shared by the lab's integration tests (``from tests.integration.lab.lab_helpers import ...``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from tests.fakes.clock import wait_for as poll

T = TypeVar("T")


def wait_for(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.3) -> T:
    """``tests.fakes.wait_for``, polling the lab every 0.3 s (kubectl and ssh are not free)."""
    return poll(probe, timeout, what, interval)


def kubectl_json(sh: Callable[..., Any], args: str) -> Any:
    return json.loads(sh(f"kubectl {args} -o json", check=True).stdout)


def ansible(sh: Callable[..., Any], host: str, command: str, become: bool = True) -> Any:
    """``ansible -i "$RUNBOOK_INVENTORY" HOST [-b] -m command -a COMMAND``, exactly as an operator types it."""
    flag = "-b " if become else ""
    quoted = command.replace("'", "'\\''")
    return sh(f"ansible -i \"$RUNBOOK_INVENTORY\" {host} {flag}-m command -a '{quoted}'")


def node(sh: Callable[..., Any], name: str) -> Any:
    return kubectl_json(sh, f"get node {name}")


def condition(obj: Any, type_: str) -> dict[str, Any]:
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def taints(obj: Any) -> set[tuple[str, str]]:
    return {(t["key"], t["effect"]) for t in obj.get("spec", {}).get("taints", []) or []}


def output_lines(result: Any) -> list[str]:
    """The command's output lines in an ad-hoc ``ansible`` result (after the ``HOST | ... >>`` line)."""
    return [line for line in result.stdout.splitlines()[1:] if line.strip()]
