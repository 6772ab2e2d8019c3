"""P3 cold start: ``runbook --help`` and ``runbook validate runbooks/``, each in a fresh process.

The installed console script is timed (not a version manager's shim), alternating help and
validate. ``python -c pass`` is timed alongside: the interpreter's own floor on this machine at
that moment, which tells how loaded it was (``python -I -c pass`` is ~20 ms on an idle machine).
"""

from __future__ import annotations

import sys

from bench.common import Context, Metric, base_env, loadavg, log, median, rotations, run_timed, runbook_cmd, summary

COMMANDS = {
    "help": runbook_cmd("--help"),
    "validate": runbook_cmd("validate", "runbooks/"),
    "python": [sys.executable, "-c", "pass"],
}


def run(ctx: Context) -> list[Metric]:
    env = base_env()
    runs = max(ctx.runs * 2, 10) if not ctx.quick else 2
    times: dict[str, list[float]] = {k: [] for k in COMMANDS}
    for name in ("help", "validate"):  # warm the page cache and the .pyc files: "cold" is the process
        run_timed(COMMANDS[name], env=env)
    before = loadavg()
    for _, name in rotations(list(COMMANDS), runs):
        t = run_timed(COMMANDS[name], env=env)
        if t.rc != 0:
            raise RuntimeError(f"{' '.join(COMMANDS[name])} failed (rc {t.rc}): {t.output[-500:]}")
        times[name].append(t.seconds)
    log(f"P3 help {median(times['help']):.3f} s, validate {median(times['validate']):.3f} s, "
        f"python -c pass {median(times['python']):.3f} s")
    common = {"python_c_pass_s": summary(times["python"]), "loadavg": [before, loadavg()]}
    return [
        Metric("p3_help_s", median(times["help"]), len(times["help"]),
               {"command": "runbook --help", "samples_s": summary(times["help"]), **common}),
        Metric("p3_validate_s", median(times["validate"]), len(times["validate"]),
               {"command": "runbook validate runbooks/", "samples_s": summary(times["validate"]), **common}),
    ]
