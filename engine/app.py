"""What each ``runbook`` command does, as one function per command.

The CLI (``engine.cli``) parses options and calls exactly one of these; each returns the exit
code. They compose ``engine.api`` (load, plan, run), ``engine.runs.RunService`` (journal, Lease,
approvals) and ``engine.output`` (rendering). Nothing here parses YAML or talks to a cluster
directly.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import api, output
from engine.errors import Cancelled, ExitCode, LoadError, StalePlan, UsageError
from engine.model import Plan, PlanState, RunResult, RunState, parse_duration

if TYPE_CHECKING:
    from engine.runs import RunService
    from engine.settings import Settings


# -- catalogue ----------------------------------------------------------------------------------


def list_runbooks(settings: Settings, fmt: str) -> int:
    loaded, problems = api.list_runbooks(settings.runbooks_dir)
    if fmt == "json":
        print(output.dump_json([{"name": lr.name, "version": lr.runbook.version, "path": str(lr.path),
                                 "description": lr.runbook.description.strip().splitlines()[0]
                                 if lr.runbook.description.strip() else "",
                                 "params": sorted(lr.runbook.params)} for lr in loaded]))
    else:
        for lr in loaded:
            first = lr.runbook.description.strip().splitlines()
            print(f"{lr.name:<28} {lr.runbook.version:<8} {first[0] if first else ''}")
    if problems:
        raise LoadError(problems)
    return ExitCode.OK


def show_runbook(settings: Settings, name: str) -> int:
    from engine.checks import describe

    lr = api.load(name, settings.runbooks_dir)
    rb = lr.runbook
    print(f"{rb.name} {rb.version}  ({lr.path})")
    if rb.description:
        print("  " + rb.description.strip().replace("\n", "\n  "))
    print("params:")
    for k, p in rb.params.items():
        extra = " required" if p.required else f" default={p.default!r}"
        values = f" values={list(p.values)}" if p.values else ""
        print(f"  {k}: {p.type}{extra}{values}  {p.description.strip()}")
    if rb.preconditions:
        print("preconditions:")
        for pre in rb.preconditions:
            when = f" when {describe(pre.when)}" if pre.when is not None else ""
            print(f"  {pre.id}:{when} {describe(pre.check)}")
    print("steps:")
    for i, s in enumerate(rb.steps, 1):
        kind = next(iter(s.action.model_dump(by_alias=True, exclude_none=True)))
        print(f"  {i}. {s.id} ({kind}{', requires ' + ', '.join(s.requires) if s.requires else ''})")
        if s.why:
            print(f"     why: {' '.join(s.why.split())}")
        for g in s.guards:
            print(f"     guard: {describe(g)}")
        for c in s.skip_if:
            print(f"     skip if: {describe(c)}")
        for v in s.verify:
            print(f"     verify: {describe(v.check)} within {v.timeout}")
    for t in rb.triggers:
        print(f"trigger: alert {t.alert} {list(t.matchers)} mode={t.mode}")
    return ExitCode.OK


def validate(settings: Settings, paths: Sequence[Path]) -> int:
    from engine.loader import default_runbooks_dir, validate_paths

    targets = list(paths) or [settings.runbooks_dir or default_runbooks_dir()]
    ok, problems = validate_paths(targets)
    if problems:
        raise LoadError(problems)
    print(f"{len(ok)} runbook{'s' if len(ok) != 1 else ''} valid")
    return ExitCode.OK


# -- planning -----------------------------------------------------------------------------------


def _service(settings: Settings, *, live: bool = True, lock_wait: float = 0.0) -> RunService:
    from engine.runs import RunService

    return RunService(settings, live=output.LiveView() if live else None, lock_wait=lock_wait)


def _prepare(service: RunService, name: str, node: str | None, selector: str | None,
             raw_params: Sequence[str]) -> list[api.PreparedRun]:
    from engine.runs import select_fleet

    loaded = service.load(name)
    if node and selector:
        raise UsageError("give either --node or --selector, not both")
    if selector:
        return select_fleet(service, loaded, selector, raw_params)
    return [api.prepare_run(loaded, list(raw_params), node=node)]


def _plans(service: RunService, prepared: list[api.PreparedRun], *, preview: bool,
           ttl: float | None = None) -> list[Plan]:
    if len(prepared) == 1:
        return [service.plan(prepared[0], preview=preview, ttl=ttl)]
    kube, nodes = service.connectors(prepared[0].loaded, prepared[0].params)
    kwargs: dict[str, Any] = {"preview": preview}
    if ttl is not None:
        kwargs["ttl"] = ttl
    return api.plan_fleet(prepared, kube, nodes, **kwargs)


def plan(settings: Settings, name: str, *, node: str | None, selector: str | None, raw_params: Sequence[str],
         output: str, out_file: Path | None, expires: str) -> int:
    try:
        ttl = parse_duration(expires)
    except ValueError as e:
        raise UsageError(f"--expires: {e}") from None
    service = _service(settings, live=False)
    try:
        prepared = _prepare(service, name, node, selector, raw_params)
        plans = _plans(service, prepared, preview=True, ttl=ttl)
    finally:
        settings.close()
    _print_plans(plans, output)
    if out_file is not None:
        if len(plans) != 1:
            raise UsageError("--out saves the plan of one node; use --node")
        api.save_plan(plans[0], out_file)
        print(f"plan saved to {out_file} (digest {plans[0].digest})", file=sys.stderr)
    return max(p.exit_code for p in plans)


def _print_plans(plans: Sequence[Plan], fmt: str) -> None:
    print(output.render_plans(plans, fmt))


# -- running ------------------------------------------------------------------------------------


@contextmanager
def cancellation(on_abort: Callable[[], None] | None = None) -> Iterator[threading.Event]:
    """SIGINT/SIGTERM stop a run safely, and it is recorded either way.

    The first signal sets the event: the current action finishes, its outcome is recorded and
    the engine stops before the next one (exit 4). The second (SIGINT or SIGTERM) calls
    ``on_abort``: the Ansible connector ends the running playbook's whole process tree, and the
    step is recorded as cancelled. A third SIGINT raises KeyboardInterrupt (the run is left
    ``interrupted``, resumable). The Lease is released and child processes are ended on every path.
    """
    cancel = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield cancel
        return
    received = 0

    def handler(signum: int, _frame: Any) -> None:
        nonlocal received
        received += 1
        name = signal.Signals(signum).name
        if received == 1:
            cancel.set()
            print(f"\n{name}: stopping after the current action (again to stop the action now)", file=sys.stderr)
        elif received == 2:
            print(f"\n{name}: stopping the current action now", file=sys.stderr)
            if on_abort is not None:
                on_abort()
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt

    old_int = signal.signal(signal.SIGINT, handler)
    old_term = signal.signal(signal.SIGTERM, handler)
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, old_term)


def confirm(question: str, yes: bool) -> None:
    """``--yes`` skips; a terminal asks; no terminal refuses (exit 2) rather than guessing."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise UsageError("refusing to change anything without confirmation: no terminal to ask on; pass --yes")
    import click

    if not click.confirm(question, default=False, err=True):
        raise Cancelled("not confirmed; nothing was changed")


def _print_result(result: RunResult, run_id: str | None, fmt: str) -> None:
    if fmt == "json":
        print(output.dump_json(output.result_json(result, run_id)))
    else:
        output.print_result_table(result, run_id)
    if result.state is RunState.INTERRUPTED and run_id:
        print(f"run {run_id} is interrupted and resumable: `runbook resume {run_id}`", file=sys.stderr)


def _execute_plans(service: RunService, prepared: list[api.PreparedRun], plans: list[Plan], *, yes: bool,
                   fmt: str, max_parallel: int, settle: float) -> int:
    from concurrent.futures import ThreadPoolExecutor

    from engine.planning import fleet_batches

    blocked = [p for p in plans if p.state is PlanState.BLOCKED]
    for p, prep in zip(plans, prepared, strict=True):
        if p.state is PlanState.BLOCKED:
            run_id = service.create(prep, p, state="pending")
            service.journal.append(run_id, "run.blocked", reason="; ".join(p.blocked_reasons))
            service.journal.set_state(run_id, RunState.BLOCKED.value, exit_code=ExitCode.BLOCKED)
    if blocked:
        _print_plans(blocked, "text" if fmt != "json" else "json")
        return ExitCode.BLOCKED
    if fmt != "json":
        _print_plans(plans, "text")
    changing = [p for p in plans if p.state is PlanState.READY]
    if changing:
        confirm(f"Apply {len(changing)} plan{'s' if len(changing) > 1 else ''} "
                f"({', '.join(p.node for p in changing)})?", yes)
    by_node = {p.node: (prep, p) for prep, p in zip(prepared, plans, strict=True)}
    results: list[tuple[str, RunResult]] = []
    with cancellation(on_abort=service.settings.abort_actions) as cancel:
        batches = fleet_batches([p.node for p in plans], max_parallel)
        for i, batch in enumerate(batches):
            if cancel.is_set():
                break

            def one(node: str) -> tuple[str, RunResult]:
                prep, p = by_node[node]
                run_id = service.create(prep, p, approval_required=p.approval)
                return run_id, service.execute(run_id, prep, p, cancel=cancel)

            if len(batch) == 1:
                results.append(one(batch[0]))
            else:
                with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                    results.extend(pool.map(one, batch))
            if any(r.state is not RunState.SUCCEEDED for _, r in results):
                break  # a rolling run stops at the first node that did not recover
            if settle and i + 1 < len(batches):
                cancel.wait(settle)
    if fmt == "json" and len(results) == 1:
        _print_result(results[0][1], results[0][0], fmt)
    elif fmt == "json":
        print(output.dump_json({"runs": [output.result_json(r, rid) for rid, r in results]}))
    else:
        for rid, r in results:
            _print_result(r, rid, fmt)
    if not results:
        return ExitCode.CANCELLED
    return max(r.exit_code for _, r in results)


def run(settings: Settings, name: str, *, node: str | None, selector: str | None, raw_params: Sequence[str],
        dry_run: bool, yes: bool, output: str, max_parallel: int, settle: float, lock_wait: float) -> int:
    service = _service(settings, lock_wait=lock_wait)
    try:
        prepared = _prepare(service, name, node, selector, raw_params)
        plans = _plans(service, prepared, preview=dry_run)
        if dry_run:
            _print_plans(plans, output)
            return max(p.exit_code for p in plans)
        return _execute_plans(service, prepared, plans, yes=yes, fmt=output, max_parallel=max_parallel,
                              settle=settle)
    finally:
        settings.close()


def apply(settings: Settings, plan_file: Path, *, yes: bool, output: str) -> int:
    saved = api.load_plan(plan_file)
    service = _service(settings)
    try:
        loaded = service.load(saved.runbook)
        kube, nodes = service.connectors(loaded, saved.params)
        problems, prepared = api.check_saved_plan(saved, loaded, kube, nodes)
        if problems:
            raise StalePlan("the saved plan no longer holds; make a new one with `runbook plan`:\n"
                            + "\n".join(f"  {p}" for p in problems))
        return _execute_plans(service, [prepared], [saved], yes=yes, fmt=output, max_parallel=1, settle=0)
    finally:
        settings.close()


def approve(settings: Settings, run_id: str, digest: str, approved_by: str | None) -> int:
    from engine.runs import current_user

    journal = settings.open_journal()
    rec = journal.record_approval(run_id, digest, approved_by or current_user())
    print(f"run {run_id} approved by {rec.approved_by} for plan {digest}")
    return ExitCode.OK


def resume(settings: Settings, run_id: str, *, yes: bool, output: str) -> int:
    """Continue an ``interrupted`` run (or an approved one waiting for approval) where it stopped."""
    from engine.journal import FINAL_STATES

    service = _service(settings)
    try:
        journal = service.journal
        rec = journal.get_run(run_id)
        if rec.state in FINAL_STATES:
            print(f"run {run_id} already finished: {rec.state} (exit {rec.exit_code}); nothing to resume")
            return ExitCode.OK
        if rec.state in ("running", "pending"):
            raise UsageError(f"run {run_id} is still {rec.state} (pid {rec.owner_pid} on {rec.owner_host})")
        if rec.plan is None:
            # Interrupted before it was planned (a server that died with a queued run): plan now.
            prepared = api.prepare_run(service.load(rec.runbook), dict(rec.params))
            the_plan = service.plan(prepared)
            service.record_plan(run_id, the_plan)
            _print_plans([the_plan], "text" if output != "json" else "json")
        else:
            prepared, the_plan = service.prepare_from_record(run_id)
        approved = rec.approved_digest == the_plan.digest
        if rec.state == "waiting-approval" and not approved:
            print(f"run {run_id} is waiting for approval of plan {the_plan.digest}")
            return ExitCode.BLOCKED
        progress = journal.progress(run_id)
        left = [s.id for s in the_plan.steps if s.id not in progress.completed]
        note = f"; step {progress.interrupted_step} was left half-way" if progress.interrupted_step else ""
        print(f"resuming run {run_id} ({rec.runbook} on {prepared.node}): steps left: "
              f"{', '.join(left) or 'none'}{note}", file=sys.stderr)
        confirm(f"Resume run {run_id}?", yes)

        def ask_rerun(step: str, why: str) -> bool:
            # --yes confirms the plan, not doing a non-idempotent action twice: always ask a person.
            import click

            return bool(click.confirm(f"step {step}: {why}. Run it again?", default=False, err=True))

        with cancellation(on_abort=settings.abort_actions) as cancel:
            result = service.execute(run_id, prepared, the_plan, cancel=cancel, approved=approved, resume=True,
                                     confirm_rerun=ask_rerun if sys.stdin.isatty() else None)
        _print_result(result, run_id, output)
        if result.outcomes and result.outcomes[-1].evidence.get("needs_confirmation"):
            print(f"step {result.outcomes[-1].step} is not idempotent: confirm re-running it with "
                  f"`runbook resume {run_id}` on a terminal, or finish it by hand", file=sys.stderr)
        return result.exit_code
    finally:
        settings.close()


# -- history ------------------------------------------------------------------------------------


def list_runs(settings: Settings, fmt: str, limit: int) -> int:
    runs = settings.open_journal().list_runs(limit=limit)
    if fmt == "json":
        print(output.dump_json([r.summary() for r in runs]))
    else:
        print(output.runs_text(runs))
    return ExitCode.OK


def show_run(settings: Settings, run_id: str, fmt: str) -> int:
    journal = settings.open_journal()
    rec = journal.get_run(run_id)
    events = journal.events(run_id)
    if fmt == "json":
        print(output.dump_json({**rec.summary(), "plan": rec.plan,
                                "events": [e.as_dict() for e in events]}))
    else:
        print(output.events_text(rec, events))
    return ExitCode.OK




def create_run_starter(settings: Settings, config: Any = None) -> Any:
    """The ``RunStarter`` ``runbook serve`` uses (``engine.serve.starter``)."""
    from engine.serve_starter import JournalRunStarter

    return JournalRunStarter(settings)
