"""What a shipped playbook would change, computed from the host facts the plan already holds.

A check-mode preview (``ansible-playbook --check --diff``) costs an Ansible process: on the lab
~1-1.5 s of its start, the SSH round trips and the modules it ships, for every changing playbook
step of every plan. For the playbooks whose whole effect is a function of facts the probe reads
anyway, the engine says the same thing from those facts: a step with ``preview: facts`` gets the
preview of this module's model of its playbook, and no check-mode run.

Each model answers as the playbook's check mode would, in the same words: the changes it would
make, or the refusal it would fail with (nothing changed). A model declines (``None``: the plan
falls back to a check-mode run) when the step passes variables the model does not know, or when a
fact it needs could not be read. ``tests/integration/test_playbook_previews.py`` runs each
playbook in check mode on real hosts over SSH and compares its report with the model's, for every
case a model distinguishes; ``tests/unit/test_playbook_previews.py`` checks that the model's fstab
rule is the playbook's regexp, character for character.

Pure functions of ``HostFacts``: no connector, nothing changed.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any

from engine.facts import HostFacts

# swap-off.yml's `replace` task, verbatim: an uncommented fstab line whose third field is `swap`
# and whose options lack `noauto` (the same rule as engine.hostfacts.fstab_active_swap).
SWAP_OFF_FSTAB_REGEXP = r"^([ \t]*[^#\s]\S*[ \t]+\S+[ \t]+swap(?![ \t]+(?:\S*,)?noauto(?:[,\s]|$))(?:[ \t].*)?)$"
SWAP_OFF_FSTAB_REPLACE = r"# \1"
FSTAB = "/etc/fstab"

Model = Callable[[HostFacts, Mapping[str, Any]], "str | None"]


def _would_change(said: list[str], diff: str = "") -> str:
    """The shape of a check-mode preview (``engine.previews``): what tasks say, then the diffs."""
    if not said and not diff:
        return "check mode: no changes"
    return "\n".join([*(["check mode: would change:", *said] if said else []), *([diff] if diff else [])])


def _would_fail(task: str, message: str) -> str:
    return f"check mode: failed (nothing changed)\n{task}: {message}"


def fstab_without_swap(text: str) -> tuple[str, int]:
    """/etc/fstab as swap-off.yml leaves it (its active swap entries commented out), and how many."""
    return re.subn(SWAP_OFF_FSTAB_REGEXP, SWAP_OFF_FSTAB_REPLACE, text, flags=re.MULTILINE)


def fstab_diff(before: str, after: str) -> str:
    """A unified diff of /etc/fstab, as the plan shows Ansible's ``--diff`` of it."""
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 fromfile=FSTAB, tofile=FSTAB)
    return "".join(ln if ln.endswith("\n") else ln + "\n" for ln in lines)


def swap_off(host: HostFacts, variables: Mapping[str, Any]) -> str | None:
    """swap-off.yml: refuse swap it cannot keep off; ``swapoff`` each active device; comment out
    the active swap entries of /etc/fstab. ``backup`` only decides whether a copy is kept."""
    if set(variables) - {"backup"} or host.fstab is None:
        return None
    if host.unhandled_swap_sources:
        return _would_fail("Refuse swap sources this playbook cannot keep off",
                           f"swap on {host.host} comes from sources this playbook cannot switch off for good: "
                           f"{', '.join(host.unhandled_swap_sources)}")
    said = []
    if host.swap_devices:
        devices = " ".join(d.name for d in host.swap_devices)
        said.append(f"Report the swap devices to turn off (check mode): would swapoff {devices} on {host.host}")
    after, count = fstab_without_swap(host.fstab)
    if count:
        said.append(f"Comment out active swap entries in fstab: {count} replacements made")
    return _would_change(said, fstab_diff(host.fstab, after) if count else "")


def _pci_address(slot: str) -> str:
    """lspci's slot with its PCI domain (``lspci -D``): ``01:00.0`` -> ``0000:01:00.0``."""
    return slot if slot.count(":") >= 2 else f"0000:{slot}"


def gpu_bind_driver(host: HostFacts, variables: Mapping[str, Any]) -> str | None:
    """gpu-bind-driver.yml: refuse a host without an NVIDIA GPU; bind every GPU not on ``driver``
    (default nvidia) to it with driverctl, refusing when driverctl is missing."""
    if set(variables) - {"driver"} or host.driverctl is None:
        return None
    driver = str(variables.get("driver", "nvidia"))
    if not host.gpus:
        return _would_fail("Refuse a host without an NVIDIA GPU",
                           f"{host.host} has no NVIDIA display function (lspci -Dnnk -d 10de: lists none)")
    todo = [_pci_address(g.slot) for g in host.gpus_not_on(driver)]
    if not todo:
        return _would_change([])
    if not host.driverctl:
        return _would_fail("Refuse without driverctl",
                           f"driverctl is not installed on {host.host}; nothing was changed")
    return _would_change([f"Report the planned binding (check mode): would bind {', '.join(todo)} to {driver} "
                          f"on {host.host}"])


# Playbook (its path in the playbooks folder) -> its model. `preview: facts` needs one.
MODELS: dict[str, Model] = {
    "swap-off.yml": swap_off,
    "gpu-bind-driver.yml": gpu_bind_driver,
}


def preview(playbook: str, host: HostFacts | None, variables: Mapping[str, Any]) -> str | None:
    """The model's preview of ``playbook`` on ``host``; None when it cannot say (no model, no host
    facts, a variable it does not know, a fact it needs unread): then check mode must."""
    model = MODELS.get(playbook)
    if model is None or host is None:
        return None
    return model(host, variables)
