"""What each ``runbook`` command does, as one function per command.

The CLI (``engine.cli``) parses options and calls exactly one of these; each returns the exit
code. Every command that plans or runs goes through ``engine.runs.RunService`` (targets, plans,
guards, journal, Lease, executor, fleets); this module adds what a terminal needs: confirmation,
signals, and rendering through ``engine.output``. Nothing here parses YAML, talks to a cluster or
decides how a run proceeds.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from engine import output  # engine.loader: imported by the functions that load runbooks (`runbook runs` never does)
from engine.errors import Cancelled, ExitCode, LoadError, StalePlan, UsageError
from engine.model import Plan, PlanState, RunResult, RunState, parse_duration

if TYPE_CHECKING:
    from engine.params import PreparedRun
    from engine.runs import FleetResult, RunService
    from engine.settings import Settings
    from engine.store import RunStore


# -- catalogue ----------------------------------------------------------------------------------


def list_runbooks(settings: Settings, fmt: str) -> int:
    from engine import loader

    loaded, problems = loader.list_runbooks(settings.runbooks_dir)
    if fmt == "json":
        print(output.dump_json([{"name": lr.name, "version": lr.runbook.version, "path": str(lr.path),
                                 "description": lr.runbook.description.strip().splitlines()[0]
                                 if lr.runbook.description.strip() else "",
                                 "params": sorted(lr.runbook.params)} for lr in loaded]))
    else:
        print(output.runbooks_text(loaded, wide=fmt == "wide"))
    if problems:
        raise LoadError(problems)
    return ExitCode.OK


def show_runbook(settings: Settings, name: str) -> int:
    from engine import loader
    from engine.checks import describe

    lr = loader.load(name, settings.runbooks_dir)
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
    from engine.live import progress_sink
    from engine.runs import RunService

    return RunService(settings, live=progress_sink(no_tty=settings.no_tty) if live else None, lock_wait=lock_wait)


def _stop_live(service: RunService) -> None:
    """End the live display (its last frame stays) before the closing table is printed."""
    if service.live is not None:
        service.live.stop()


def plan(settings: Settings, name: str, *, node: str | None, selector: str | None, raw_params: Sequence[str],
         output: str, out_file: Path | None, expires: str) -> int:
    from engine import loader

    try:
        ttl = parse_duration(expires)
    except ValueError as e:
        raise UsageError(f"--expires: {e}") from None
    service = _service(settings, live=False)
    try:
        targets = service.targets(name, raw_params, node=node, selector=selector)
        plans = service.plan_targets(targets, preview=True, ttl=ttl)
    finally:
        settings.close()
    _print_plans(plans, output)
    if targets:
        from engine.run_windows import window_state

        shown = window_state(targets[0].loaded.runbook, service.clock())
        if shown.windows:  # `runbook plan` shows the next window (stderr for machine formats)
            print(f"maintenance window: {shown.describe()}", file=sys.stdout if output == "text" else sys.stderr)
    if out_file is not None:
        if len(plans) != 1:
            raise UsageError("--out saves the plan of one node; use --node")
        loader.save_plan(plans[0], out_file)
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


def _run_planned(service: RunService, targets: list[PreparedRun], plans: list[Plan], *, fleet: bool, yes: bool,
                 fmt: str, max_parallel: int = 1, settle: float = 0.0, max_failures: int = 1,
                 fail_fast: bool = False, overrides: dict[str, str] | None = None) -> int:
    """Show the plans, confirm, and run them through ``RunService.run_targets``; print each node's
    result (one node: the result table or its JSON, as always) or the fleet's summary."""
    if fmt != "json":
        _print_plans(plans, "text")
    elif not fleet and plans[0].state is PlanState.BLOCKED:
        _print_plans(plans, "json")

    def ask(changing: Sequence[Plan]) -> None:
        confirm(f"Apply {len(changing)} plan{'s' if len(changing) > 1 else ''} "
                f"({', '.join(p.node for p in changing)})?", yes)

    if service.live is not None:
        service.live.expect(plans, max_parallel)
    try:
        with cancellation(on_abort=service.settings.abort_actions) as cancel:
            done = service.run_targets(targets, plans, max_parallel=max_parallel, settle=settle,
                                       max_failures=max_failures, fail_fast=fail_fast, cancel=cancel,
                                       overrides=overrides, confirm=ask, execute_nothing_to_do=not fleet)
    finally:
        _stop_live(service)
    if fleet:
        return _print_fleet(done, fmt)
    row = done.runs[0]
    if row.result is not None:
        _print_result(row.result, row.run_id, fmt)
        return row.result.exit_code
    if row.plan is not None and row.plan.state is PlanState.BLOCKED:
        return ExitCode.BLOCKED  # the blocked plan is printed above, with its reasons
    state = {"blocked": RunState.BLOCKED, "cancelled": RunState.CANCELLED}.get(row.outcome, RunState.CANCELLED)
    result = RunResult(state=state, exit_code=done.exit_code, runbook=plans[0].runbook, node=row.node,
                       plan_digest=plans[0].digest, reason=row.reason)
    if fmt == "json":
        print(output.dump_json(output.result_json(result, row.run_id)))
    else:
        print(f"{row.node}: {row.outcome}: {row.reason}")
        if row.run_id:
            print(f"run {row.run_id}: nothing was changed")
    return done.exit_code


def _print_fleet(done: FleetResult, fmt: str) -> int:
    doc = done.as_json()
    if fmt == "json":
        print(output.dump_json(doc))
    else:
        for row in done.runs:
            if row.result is not None:
                _print_result(row.result, row.run_id, fmt)
        print(output.fleet_text(doc))
    return done.exit_code


def run(settings: Settings, name: str, *, node: str | None, selector: str | None, raw_params: Sequence[str],
        dry_run: bool, yes: bool, output: str, max_parallel: int, settle: float, lock_wait: float,
        max_failures: int = 1, fail_fast: bool = False, overrides: dict[str, str] | None = None) -> int:
    service = _service(settings, lock_wait=lock_wait)
    try:
        service.check_overrides(overrides or {})
        targets = service.targets(name, raw_params, node=node, selector=selector)
        plans = service.plan_targets(targets, preview=dry_run)
        if dry_run:
            _print_plans(plans, output)
            return max(p.exit_code for p in plans)
        return _run_planned(service, targets, plans, fleet=selector is not None, yes=yes, fmt=output,
                            max_parallel=max_parallel, settle=settle, max_failures=max_failures,
                            fail_fast=fail_fast, overrides=overrides)
    finally:
        settings.close()


def apply(settings: Settings, plan_file: Path, *, yes: bool, output: str,
          overrides: dict[str, str] | None = None) -> int:
    from engine import loader

    saved = loader.load_plan(plan_file)
    service = _service(settings)
    try:
        service.check_overrides(overrides or {})
        problems, prepared = service.check_saved_plan(saved)
        if problems:
            raise StalePlan("the saved plan no longer holds; make a new one with `runbook plan`:\n"
                            + "\n".join(f"  {p}" for p in problems))
        return _run_planned(service, [prepared], [saved], fleet=False, yes=yes, fmt=output, overrides=overrides)
    finally:
        settings.close()


def approve(settings: Settings, run_id: str, digest: str, approved_by: str | None) -> int:
    from engine.runs import current_user

    if settings.cluster_mode:
        # Cluster mode: RBAC decides (verb approve on the run) and the approver is the identity the
        # API server authenticates the kubeconfig as, never a typed name (engine.cluster_auth).
        from engine.cluster_auth import authorize_approval
        from engine.connectors.base import IdentityAPI

        if approved_by is not None:
            raise UsageError("--by is refused with --store kubernetes: the approver recorded is the identity "
                             "your kubeconfig authenticates as")
        who = authorize_approval(cast(IdentityAPI, settings.kube()), settings.store_namespace, run_id)
        roles: frozenset[str] = frozenset()
    else:
        # The SQLite store cannot tell who typed the command: the approver is the operating-system
        # user; --by may name only the identity the approvals configuration gives this CLI.
        who, roles = current_user(), os_groups()
        if approved_by is not None and approved_by not in (who, settings.approval_config().cli_identity):
            raise UsageError(f"--by {approved_by}: the approver recorded is you ({who}); --by may only name "
                             "approvals.cli_identity of the guards configuration")
        who = approved_by or who
    if settings.cluster_mode:
        from engine.integrity import IntegrityError, RunIntegrity

        journal = settings.open_journal()
        try:
            RunIntegrity(journal).keys()
        except IntegrityError:  # an approver holds no run key: a request the server verifies instead
            return _request_store_approval(settings, journal, run_id, digest, who)
    from engine import lifecycle

    summary = lifecycle.approve(_service(settings, live=False), run_id, digest, who, roles=roles)
    approvals = summary["approvals"]
    if approvals["satisfied"]:
        print(f"run {run_id} approved by {summary['approved_by']} for plan {digest} ({approvals['text']})")
    else:
        print(f"run {run_id}: approval by {who} recorded for plan {digest} ({approvals['text']}; "
              f"waiting for {approvals['required'] - approvals['count']} more: {approvals['who_may']})")
    return ExitCode.OK


def os_groups() -> frozenset[str]:
    """The names of the current operating-system user's groups (the roles a CLI approver has)."""
    import grp

    names = set()
    for gid in os.getgroups():
        try:
            names.add(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return frozenset(names)


def _request_store_approval(settings: Settings, journal: RunStore, run_id: str, digest: str, who: str) -> int:
    """``runbook approve --store kubernetes`` by an approver: a CertificateSigningRequest whose author
    the API server records (engine.store_approvals); the server's leader verifies it with a
    SubjectAccessReview and records the approval."""
    from engine import store_approvals
    from engine.cluster_auth import ApprovalForbidden
    from engine.errors import Forbidden

    rec = journal.get_run(run_id)
    if rec.plan_digest != digest:
        raise StalePlan(f"run {run_id}: approval names plan {digest!r}, but the run's plan is {rec.plan_digest!r}; "
                        "re-read the plan and approve that digest")
    if rec.state != "waiting-approval":
        raise StalePlan(f"run {run_id} is {rec.state}, not waiting for approval")
    body = store_approvals.request_body(settings.store_namespace, run_id, digest)
    try:
        settings.objects().create_object(store_approvals.API_VERSION, store_approvals.PLURAL, "", body)
    except Forbidden as e:
        raise ApprovalForbidden(f"forbidden: you may not request an approval of run {run_id}: it needs verb "
                                '"create" on "certificatesigningrequests" (apiGroup certificates.k8s.io); bind '
                                "the ClusterRole runbook-approver-requests (deploy/kubernetes/approver-rbac.yaml)"
                                ) from e
    print(f"run {run_id}: approval of plan {digest} by {who} requested (CertificateSigningRequest "
          f"{body['metadata']['name']}); the server records it at its next sweep")
    return ExitCode.OK


def resume(settings: Settings, run_id: str, *, yes: bool, output: str,
           overrides: dict[str, str] | None = None) -> int:
    """Continue an ``interrupted`` run (or an approved one waiting for approval) where it stopped
    (``engine.lifecycle.continue_run``, as a person: confirm, guard overrides, re-run questions)."""
    from engine import lifecycle

    service = _service(settings)
    try:
        service.check_overrides(overrides or {})

        def show_plan(plan: Plan) -> None:
            _print_plans([plan], "text" if output != "json" else "json")

        def confirm_resume(c: lifecycle.Continuation) -> None:
            note = f"; step {c.progress.interrupted_step} was left half-way" if c.progress.interrupted_step else ""
            print(f"resuming run {run_id} ({c.record.runbook} on {c.prepared.node}): steps left: "
                  f"{', '.join(c.steps_left) or 'none'}{note}", file=sys.stderr)
            confirm(f"Resume run {run_id}?", yes)
            if service.live is not None:
                service.live.expect([c.plan])

        def ask_rerun(step: str, why: str) -> bool:
            # --yes confirms the plan, not doing a non-idempotent action twice: always ask a person.
            import click

            return bool(click.confirm(f"step {step}: {why}. Run it again?", default=False, err=True))

        try:
            done = lifecycle.continue_run(
                service, run_id, automatic=False, overrides=overrides,
                cancel_scope=lambda: cancellation(on_abort=settings.abort_actions),
                confirm_rerun=ask_rerun if sys.stdin.isatty() else None,
                on_planned=show_plan, before_execute=confirm_resume)
        finally:
            _stop_live(service)
        if done.result is None:
            if done.state.is_final and done.reason == "already finished":
                print(f"run {run_id} already finished: {done.state} (exit {done.exit_code}); nothing to resume")
                return ExitCode.OK
            print(done.reason if done.state is RunState.WAITING_APPROVAL else f"run {run_id}: {done.state}: "
                  f"{done.reason}")
            return done.exit_code if done.exit_code is not None else ExitCode.BLOCKED
        result = done.result
        _print_result(result, run_id, output)
        if result.outcomes and result.outcomes[-1].evidence.get("needs_confirmation"):
            print(f"step {result.outcomes[-1].step} is not idempotent: confirm re-running it with "
                  f"`runbook resume {run_id}` on a terminal, or finish it by hand", file=sys.stderr)
        return result.exit_code
    finally:
        settings.close()


# -- diagnosis ----------------------------------------------------------------------------------


def diagnose(settings: Settings, node: str | None, output: str, *, all_nodes: bool = False,
             selector: str | None = None) -> int:
    """``runbook diagnose``: ``--node N`` one node; ``--all`` / ``-l SELECTOR`` every sick node."""
    from engine.diagnose import gather, load_catalogue, render_table, render_text, to_examine
    from engine.loader import default_runbooks_dir, fleet_path, load_fleet, playbooks_dir_for
    from engine.params import validate_node_name

    if sum(bool(x) for x in (node, all_nodes or selector)) != 1:
        raise UsageError("diagnose needs either --node NODE or --all / -l SELECTOR")
    if node:
        validate_node_name(node)
    runbooks_dir = settings.runbooks_dir or default_runbooks_dir()
    catalogue, problems = load_catalogue(Path(runbooks_dir))
    fleet = load_fleet(fleet_path(Path(runbooks_dir)))
    nodes = settings.nodes(playbooks_dir_for(runbooks_dir)) if settings.inventory else None
    try:
        kube = settings.kube()
        names = [node] if node else [n.name for n in kube.list_nodes(selector) if to_examine(n, fleet)]
        ds = gather(names, kube, nodes, catalogue, fleet)
    finally:
        settings.close()
    if node:
        d = ds[0]
        if output == "json":
            doc = d.as_json()
            doc["catalogue_problems"] = problems
            print(json.dumps(doc, indent=2, default=str))
        else:
            print(render_text(d))
            for p in problems:
                print(f"warning: runbook not in the catalogue: {p}")
        return d.exit_code
    ds = [d for d in ds if d.cause != "healthy"]  # GPU nodes are examined; only the sick ones are listed
    code = ExitCode.OK if all(d.known for d in ds) else ExitCode.FAILED
    if output == "json":
        print(json.dumps({"nodes": [d.as_json() for d in ds], "catalogue_problems": problems},
                         indent=2, default=str))
    elif not ds:
        print("nothing is wrong: no node is NotReady, unschedulable or GPU-less, and no GPU node has a fault"
              + (f" among {selector}" if selector else ""))
    else:
        print(render_table(ds))
        for p in problems:
            print(f"warning: runbook not in the catalogue: {p}")
    return code
# -- rollback -----------------------------------------------------------------------------------


def plan_rollback(settings: Settings, run_id: str, *, output: str) -> int:
    """``runbook plan --rollback RUN_ID``: the rollback's plan, skipped steps and refusals. Changes nothing."""
    from engine.rollback import rollback_target

    service = _service(settings, live=False)
    try:
        target = rollback_target(service, run_id)
        the_plan = service.plan(target.prepared, preview=True)
    finally:
        settings.close()
    _print_plans([the_plan], output)
    _print_rollback_notes(run_id, target.skipped, target.refused)
    return ExitCode.BLOCKED if target.refused else the_plan.exit_code


def _print_rollback_notes(run_id: str, skipped: Sequence[str], refused: Sequence[str]) -> None:
    for s in skipped:
        print(f"rollback of {run_id}: skipped {s}", file=sys.stderr)
    for r in refused:
        print(f"rollback of {run_id}: REFUSED: {r}", file=sys.stderr)


def rollback(settings: Settings, run_id: str, *, yes: bool, output: str,
             overrides: dict[str, str] | None = None) -> int:
    """``runbook rollback RUN_ID``: plan the inverses, confirm, run them as a run linked to RUN_ID."""
    from engine.rollback import rollback_target

    service = _service(settings)
    try:
        service.check_overrides(overrides or {})
        target = rollback_target(service, run_id)
        the_plan = service.plan(target.prepared)
        if output != "json":
            _print_plans([the_plan], "text")
        _print_rollback_notes(run_id, target.skipped, target.refused)
        if target.refused or the_plan.state is PlanState.BLOCKED:
            if output == "json":
                _print_plans([the_plan], "json")
            print(f"rollback of run {run_id} refused; nothing was changed", file=sys.stderr)
            return ExitCode.BLOCKED
        confirm(f"Roll back run {run_id} on {target.prepared.node}?", yes)
        return _execute_rollback(service, run_id, target.prepared, the_plan, output=output,
                                 overrides=overrides, reason="runbook rollback")
    finally:
        settings.close()


def _execute_rollback(service: RunService, run_id: str, prepared: PreparedRun, the_plan: Plan, *, output: str,
                      overrides: dict[str, str] | None, reason: str) -> int:
    from engine.rollback import link

    new_id = service.create(prepared, the_plan, source="rollback")
    link(service.journal, run_id, new_id, reason=reason)
    print(f"run {new_id} rolls back run {run_id}", file=sys.stderr)
    if service.live is not None:
        service.live.expect([the_plan])
    try:
        with cancellation(on_abort=service.settings.abort_actions) as cancel:
            result = service.execute(new_id, prepared, the_plan, cancel=cancel, overrides=overrides)
    finally:
        _stop_live(service)
    _print_result(result, new_id, output)
    return result.exit_code


# -- history ------------------------------------------------------------------------------------


def list_runs(settings: Settings, fmt: str, limit: int) -> int:
    runs = settings.open_journal().list_runs(limit=limit)
    if fmt == "json":
        print(output.dump_json([r.summary() for r in runs]))
    else:
        print(output.runs_text(runs, wide=fmt == "wide"))
    return ExitCode.OK


def prune_runs(settings: Settings, keep: int, max_age: str, fmt: str) -> int:
    """``runbook runs prune``: the store's retention, once."""
    try:
        age = parse_duration(max_age)
    except ValueError as e:
        raise UsageError(f"--max-age: {e}") from None
    deleted = settings.open_journal().prune(keep=keep, max_age=age or None)
    if fmt == "json":
        print(output.dump_json({"deleted": deleted, "keep": keep, "max_age_seconds": age or None}))
    else:
        print(f"deleted {len(deleted)} finished run(s)" + (": " + ", ".join(deleted) if deleted else ""))
    return ExitCode.OK


def show_run(settings: Settings, run_id: str, fmt: str) -> int:
    journal = settings.open_journal()
    rec = journal.get_run(run_id)
    events = journal.events(run_id)
    from engine.escalation import lineage

    links = lineage(events)
    if fmt == "json":
        print(output.dump_json({**rec.summary(), "plan": rec.plan, **links,
                                "events": [e.as_dict() for e in events]}))
    else:
        print(output.events_text(rec, events))
        if links["parent"]:
            print(f"{links['parent']['why']} run {links['parent']['run']}")
        for c in links["children"]:
            print(f"{c['why']} run {c['run']}" + (f" ({c['runbook']})" if c.get("runbook") else ""))
    return ExitCode.OK
