"""#25 item 16: a playbook run whose ``--limit`` host matched nothing in the inventory is a located
error, never "successful". Real ansible-runner and ansible-playbook (local connection: no host is
reached either way; the point is what Ansible does with a limit that matches nothing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.connectors.ansible import AnsibleConnector

pytestmark = pytest.mark.integration


def test_a_limit_host_that_matches_nothing_in_the_inventory_fails_with_its_location(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.ini"
    local = "ansible_connection=local ansible_python_interpreter=auto_silent"
    inventory.write_text(f"omen2 {local}\nomen3 {local}\n")
    playbooks = tmp_path / "playbooks"
    playbooks.mkdir()
    (playbooks / "hello.yml").write_text("""
- name: Hello
  hosts: "{{ target | default('all') }}"
  gather_facts: false
  tasks:
    - name: Say hello
      ansible.builtin.debug:
        msg: hello
""")
    with AnsibleConnector(inventory, playbooks) as automation:
        ran = automation.run_playbook(Path("hello.yml"), ["omen2", "omen3"], become=False)
        assert ran.status == "successful" and not ran.failed_hosts, ran
        # the inventory changes under a running server: one host it read is gone. Ansible warns
        # "Could not match supplied host pattern, ignoring: omen2", runs on omen3 and exits 0.
        inventory.write_text(f"omen3 {local}\n")
        result = automation.run_playbook(Path("hello.yml"), ["omen2", "omen3"], become=False)
    assert result.status == "failed", result  # today's code: "successful", though omen2 was never touched
    assert set(result.failed_hosts) == {"omen2"}, result.failed_hosts
    message = result.failed_hosts["omen2"]
    assert "inventory host omen2 matched nothing" in message and str(inventory) in message, message
