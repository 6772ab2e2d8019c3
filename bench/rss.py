"""``python -m bench.rss OUT -- ARGS...``: run ``runbook ARGS`` in this very process (what the
``runbook`` console script does: ``engine.cli.main()``), and at exit write the process's peak
resident set to OUT as JSON.

``VmHWM`` of ``/proc/self/status`` and ``getrusage(RUSAGE_SELF).ru_maxrss`` count this process only:
the ``ansible-playbook`` children (and their ssh clients) are excluded, as benchmark P6 asks.
"""

from __future__ import annotations

import atexit
import json
import resource
import sys
from pathlib import Path


def peak_rss() -> dict[str, int]:
    fields: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key.lower() + "_kb"] = int(value.split()[0])
    fields["ru_maxrss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return fields


def _report(out: Path) -> None:
    out.write_text(json.dumps(peak_rss()) + "\n")


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: python -m bench.rss OUT -- RUNBOOK-ARGS...")
    atexit.register(_report, Path(argv[0]))
    sys.argv = ["runbook", *argv[2:]]
    from engine.cli import main as runbook

    runbook()


if __name__ == "__main__":
    main(sys.argv[1:])
