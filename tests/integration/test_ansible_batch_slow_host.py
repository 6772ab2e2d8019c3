"""A rolling batch's one ``ansible-playbook`` (engine.batch.SharedPlaybooks over the real
AnsibleConnector, real SSH node hosts): one slow host does not hold back the others of its batch
beyond the run's timeout, and the others keep their own outcome (issue 32).

Under Ansible's default linear strategy every task waits for the slowest host: the fast host never
reached the end of its play, and the timeout that ended the slow host's run ended its run too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.batch import SharedPlaybooks
from engine.connectors.ansible import AnsibleConnector
from engine.connectors.base import PlaybookResult
from engine.facts import HostFacts
from engine.lab.nodehosts import NodeHostSet, NodeHostSpec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "Become-4q8Zt-2wP"  # the ops user's sudo password on these test hosts (nowhere else)
TIMEOUT = 12.0


def slow_playbook(tmp_path: Path) -> Path:
    """A step's playbook: a command that hangs on omen2's host only, then (as every playbook) the facts."""
    folder = tmp_path / "playbooks"
    folder.mkdir()
    (folder / "slow-on-omen2.yml").write_text(f"""
- name: Slow on one host
  hosts: "{{{{ target | default('all') }}}}"
  gather_facts: false
  become: true
  tasks:
    - name: Work (hangs on omen2's host)
      ansible.builtin.command: "sleep {{{{ 4242 if inventory_hostname == 'omen2' else 0 }}}}"
      changed_when: true
    - name: Second task
      ansible.builtin.command: "true"
      changed_when: false
    - name: Facts
      ansible.builtin.import_tasks: {REPO / "playbooks" / "tasks" / "facts.yml"}
""")
    return folder


def test_one_slow_host_does_not_hold_back_or_fail_the_rest_of_its_batch(
        node_hosts: Callable[..., NodeHostSet], tmp_path: Path) -> None:
    hosts = node_hosts([NodeHostSpec("omen2", sudo="password", become_password=PASSWORD),
                        NodeHostSpec("gpu-box-1", k8s_node_name="omen1", sudo="password",
                                     become_password=PASSWORD)])
    results: dict[str, PlaybookResult] = {}
    ended: dict[str, float] = {}
    with AnsibleConnector(hosts.inventory_path, slow_playbook(tmp_path), become_password=PASSWORD) as automation:
        batch = SharedPlaybooks(automation, ["omen2", "omen1"])

        def step(node: str) -> None:
            try:
                results[node] = batch.run_playbook(Path("slow-on-omen2.yml"), [node], timeout=TIMEOUT)
                ended[node] = time.monotonic()
            finally:
                batch.leave(node)

        start = time.monotonic()
        threads = [threading.Thread(target=step, args=(n,)) for n in ("omen2", "omen1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert batch.processes == [["omen2", "omen1"]]  # one ansible-playbook for the batch
    fast, slow = results["omen1"], results["omen2"]
    assert slow.status == "timeout" and not slow.ok
    # the fast host went through its whole play: its node's step succeeded, with its closing facts
    assert fast.ok and fast.status == "successful", fast
    assert fast.changed == {"omen1": True}
    assert isinstance(fast.host_facts.get("omen1"), HostFacts)
    assert [t["task"] for t in fast.tasks if t["status"] != "skipped"][-1].endswith("runbook_facts for the engine")
    # held back at most until the slow host's timeout (not 4242 s, and not failed by it)
    assert ended["omen1"] - start < TIMEOUT + 10
