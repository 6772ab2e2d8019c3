"""#25 item 16: the inventory read (``ansible-inventory``, a child process) gets the allow-listed
environment playbook runs get: an inventory script never sees the server's tokens or secrets, while
the variables the operator names in ``RUNBOOK_ANSIBLE_ENV`` (a CMDB token, ``ANSIBLE_*`` settings)
reach the inventory read and the playbook runs alike. Real ``ansible-inventory``, no fake."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from engine.connectors.ansible import child_environment
from engine.connectors.inventory import PASS_ENV, allowed_environment, load_inventory
from engine.errors import LoadError

CANARIES = {
    "RUNBOOK_WEBHOOK_TOKEN": "canary-webhook-0123456789",
    "RUNBOOK_APPROVER_TOKEN_ALICE": "canary-approver-0123456789",
    "RUNBOOK_PAGERDUTY_SECRET": "canary-pd-0123456789",
    "RUNBOOK_BECOME_PASSWORD": "canary-become-0123456789",
    "AWS_SECRET_ACCESS_KEY": "canary-aws-0123456789",  # not named by the operator: stays out
    "GITHUB_TOKEN": "canary-gh-0123456789",
}
NAMED = {"NETBOX_TOKEN": "cmdb-token-0123456789", "ANSIBLE_COLLECTIONS_PATH": "/opt/collections",
         "ANSIBLE_INVENTORY_CACHE": "False"}


def _dumping_script(folder: Path, dump: Path) -> Path:
    script = folder / "inventory.py"
    script.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env python3
        import json, os, sys
        with open({str(dump)!r}, "w") as f:
            json.dump(dict(os.environ), f)
        print(json.dumps({{"gpu": {{"hosts": ["omen2"]}}, "_meta": {{"hostvars": {{}}}}}}
                         if sys.argv[1:] == ["--list"] else {{}}))
        """))
    script.chmod(0o755)
    return script


def test_an_inventory_script_sees_no_secret_of_the_engine_and_the_named_variables_reach_it_and_playbooks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**CANARIES, **NAMED}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(PASS_ENV, "NETBOX_TOKEN, ANSIBLE_COLLECTIONS_PATH ANSIBLE_INVENTORY_*")
    dump = tmp_path / "env.json"
    inv = load_inventory(_dumping_script(tmp_path, dump))
    assert inv.host_for_node("omen2") == "omen2"
    seen = json.loads(dump.read_text())
    leaked = sorted(n for n, v in CANARIES.items() if v in seen.values())
    assert leaked == [], f"the inventory script saw {leaked}"  # today's code: all but the become password
    assert {n: seen.get(n) for n in NAMED} == NAMED
    # the playbook runs get the same variables of the engine's environment, the same way
    import os

    playbook_env = child_environment({}, {}, os.environ)
    assert {n: playbook_env.get(n) for n in NAMED} == NAMED
    assert not set(CANARIES) & set(playbook_env)
    shared = allowed_environment(os.environ)
    assert {k: v for k, v in seen.items() if k in shared and not k.startswith(("ANSIBLE_", "PATH"))} == \
        {k: v for k, v in shared.items() if not k.startswith(("ANSIBLE_", "PATH"))}


@pytest.mark.parametrize(("value", "needle"), [
    ("RUNBOOK_WEBHOOK_TOKEN", "runbook's own variables"),
    ("RUN*", "runbook's own variables"),
    ("*", "not a variable name"),
    ("AWS-KEY", "not a variable name"),
])
def test_a_bad_pass_through_list_is_a_located_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    value: str, needle: str) -> None:
    monkeypatch.setenv(PASS_ENV, f"NETBOX_TOKEN,{value}")
    with pytest.raises(LoadError, match=needle) as e:
        load_inventory(_dumping_script(tmp_path, tmp_path / "env.json"))
    assert str(e.value).startswith(f"environment variable {PASS_ENV}:1: ")
