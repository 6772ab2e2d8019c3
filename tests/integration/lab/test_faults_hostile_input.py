"""A param carrying a Jinja payload reaches the node host as text, never as a command on this machine.

Ansible renders extra vars as templates: a runbook whose string param has a permissive pattern and
flows into a playbook variable would let ``{{ lookup('pipe', 'touch ...') }}`` run on the engine's
machine, in ``runbook plan`` (check mode) as well as in ``runbook run``. The connector marks every
value it passes as data (``__ansible_unsafe``); this test proves it with the real Ansible on the lab.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.lab.test_durability_helpers import NODE, Engine

pytestmark = [pytest.mark.integration, pytest.mark.lab]

NOTED_FILE = """\
apiVersion: runbook/v1
name: noted-file
version: "1"
description: Writes a free-text param into a file on the node host (hostile-input test).
params:
  node: {type: node, required: true}
  note: {type: string, pattern: "^.*$", default: x}
steps:
  - id: write-note
    why: the param must arrive on the host as text
    action:
      ansible:
        playbook: example-touch-file.yml
        become: true
        timeout: 120s
        vars: {marker_path: /var/tmp/runbook-note, marker_content: "{{ params.note }}"}
    verify:
      - check: {file: {path: /var/tmp/runbook-note, contains: "marker={{ params.note }}"}}
        timeout: 30s
"""


@pytest.fixture
def engine(incident: Any) -> Iterator[Engine]:
    with Engine.for_lab(incident) as e:
        yield e


def test_a_jinja_payload_in_a_param_never_runs_on_the_engine_machine(engine: Engine) -> None:
    runbooks = engine.root / "runbooks"
    runbooks.mkdir()
    (runbooks / "noted-file.yaml").write_text(NOTED_FILE)
    canary = Path(f"/tmp/rbt-pwned-{engine.tag}")
    payload = f"{{{{ lookup('pipe', 'touch {canary}') }}}}{{{{ 7*7 }}}}"
    env = {"RUNBOOK_RUNBOOKS_DIR": str(runbooks)}
    try:
        planned = engine.run("plan", "noted-file", "--node", NODE, "-p", f"note={payload}", env=env)
        assert planned.returncode == 0, planned.stdout + planned.stderr
        assert not canary.exists(), "check mode rendered the param as a template"
        done = engine.run("run", "noted-file", "--node", NODE, "--yes", "-p", f"note={payload}", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert not canary.exists(), "the playbook rendered the param as a template"
        on_host = subprocess.run(
            ["ansible", "-i", engine.lab.lab.record()["inventory"], NODE, "-b", "-m", "command", "-a",
             "cat /var/tmp/runbook-note"], env=engine.env(), capture_output=True, text=True, timeout=120, check=True)
        assert f"marker={payload}" in on_host.stdout  # the text itself, 7*7 not evaluated
    finally:
        canary.unlink(missing_ok=True)
