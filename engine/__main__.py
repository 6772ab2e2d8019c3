"""``python -m engine``: the same as the ``runbook`` command."""

from engine.cli import main

main()
