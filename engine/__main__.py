"""``python -m engine``: the same as the ``runbook`` command (and completes as ``runbook``)."""

from engine.cli import main

main(prog_name="runbook")
