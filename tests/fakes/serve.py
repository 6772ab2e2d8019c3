"""``runbook serve`` without the run machinery or a cluster, for unit tests (and the benchmarks).

``FakeRunStarter`` keeps runs in memory and behaves as the ``RunStarter`` contract says (states,
digests, ``StalePlan`` / ``UsageError``, the approval policy); ``FakeLeadership`` is set or flipped
by hand; ``StaticClusterView`` serves a fixed list of nodes and kured locks; ``alert``/``webhook``
build Alertmanager v4 payloads; ``served`` runs the app over these fakes (a Starlette TestClient)
and captures its notifications. Nothing here does I/O.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from engine.approval_policy import Approval, ApprovalConfig, judge, refusal, rule_for
from engine.errors import ApprovalRefused, StalePlan, UsageError
from engine.facts import NodeFacts
from engine.model import Plan, Trigger, is_node_name
from engine.serve.cluster import ClusterSnapshot, ClusterUnavailable, snapshot_from
from engine.serve.config import ExclusionConfig
from engine.serve.starter import RunOutcome, RunRequest, RunTicket, TriggerSpec
from tests.fakes.kube import make_node

DIGEST = "a" * 64


FSTAB_DIFF = """--- before: /etc/fstab
+++ after: /etc/fstab
@@ -8,3 +8,3 @@
 UUID=4f1c-root / ext4 defaults 0 1
-/swap.img none swap sw 0 0
+#/swap.img none swap sw 0 0  # disabled by runbook (kubelet needs swap off)
 tmpfs /run/user tmpfs defaults 0 0
"""


def saved_plan(node: str = "omen2", *, expires_in: float = 3600.0) -> Plan:
    """A sealed gpu-node-recovery plan as ``runbook plan --out`` saves it (two steps, the fstab diff)."""
    now = time.time()

    def iso(t: float) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))

    return Plan.model_validate({
        "runbook": "gpu-node-recovery", "version": "3", "runbook_digest": "b" * 64,
        "params": {"node": node}, "node": node, "inventory_host": node,
        "created_at": iso(now), "expires_at": iso(now + expires_in), "state": "ready",
        "preconditions": [{"id": "swap-is-the-cause", "applies": True, "holds": True,
                           "observed": "kubelet: running with swap on is not supported",
                           "evidence": {"swap_total_bytes": 2147483648}}],
        "steps": [
            {"id": "swap-off", "why": "kubelet refuses to start while swap is on", "kind": "change",
             "action": "ansible", "summary": "comment the swap line out of /etc/fstab, swapoff -a",
             "command": f"ansible-playbook -i INVENTORY -l {node} playbooks/disable-swap.yml",
             "guards": [{"check": "host reachable", "holds": True, "observed": "ssh ok"}],
             "verify": [{"check": "host swap_total_bytes == 0", "timeout_seconds": 60}],
             "preview": FSTAB_DIFF, "mutating": True},
            {"id": "restart-kubelet", "why": "pick up the fixed configuration", "kind": "change",
             "action": "ansible", "summary": "systemctl restart kubelet",
             "command": f"ansible-playbook -i INVENTORY -l {node} playbooks/restart-kubelet.yml",
             "verify": [{"check": "node Ready", "timeout_seconds": 300}], "mutating": True},
        ]}).sealed()


def trigger_spec(runbook: str = "gpu-node-recovery", *, mode: str = "approve",
                 alert: str | tuple[str, ...] = ("KubeNodeNotReady", "KubeNodeUnreachable"),
                 matchers: tuple[str, ...] = (), params: Mapping[str, str] | None = None,
                 pagerduty: Mapping[str, Any] | None = None, require_diagnosis: bool = False) -> TriggerSpec:
    trig = Trigger.model_validate({
        "alert": alert, "matchers": matchers, "mode": mode, "require_diagnosis": require_diagnosis,
        "params": dict(params if params is not None else {"node": "{{ labels.node }}"}),
        **({"pagerduty": dict(pagerduty)} if pagerduty else {})})
    return TriggerSpec(runbook=runbook, trigger=trig, node_param="node")


def two_steps_then(state: str, first_step: str = "swap-off") -> Callable[[dict[str, Any]], str]:
    """A ``FakeRunStarter`` outcome: the run records two step outcomes (``first_step`` succeeded,
    then ``restart-kubelet``, failed unless ``state`` is succeeded) and ends ``state``."""

    def outcome(run: dict[str, Any]) -> str:
        now = time.time()
        run.setdefault("events", []).extend([
            {"kind": "step.outcome", "step": first_step, "status": "succeeded", "reason": "",
             "started_at": now - 3, "finished_at": now - 2},
            {"kind": "step.outcome", "step": "restart-kubelet", "status": "succeeded" if state == "succeeded"
             else "failed", "reason": "" if state == "succeeded" else "Ready stayed Unknown for 300s",
             "started_at": now - 2, "finished_at": now}])
        return state

    return outcome


class FakeRunStarter:
    """In-memory runs. ``outcome(run)`` decides how an executed run ends (default: succeeded)."""

    def __init__(self, triggers: Sequence[TriggerSpec] = (), *,
                 outcome: Callable[[Mapping[str, Any]], str] | None = None,
                 execute_delay: float = 0.0, submit_delay: float = 0.0, recover_ids: Iterable[str] = (),
                 preload: Iterable[Mapping[str, Any]] = (),
                 plan: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None,
                 approvals: ApprovalConfig | None = None, execute_gate: threading.Event | None = None) -> None:
        self.triggers = list(triggers)
        self.execute_gate = execute_gate  # set: executions may go on (each waits for it, at most 10 s)
        self.approvals = approvals or ApprovalConfig()  # the approval policy, judged like the real starter
        self._approvals: dict[str, list[Approval]] = {}
        self.plan = plan  # the plan (a Plan's JSON shape) a run waiting for approval shows; digest from it
        self.outcome = outcome or (lambda run: "succeeded")
        self.execute_delay = execute_delay
        self.submit_delay = submit_delay
        self.requests: list[RunRequest] = []
        self.previews: list[tuple[str, dict[str, str], str]] = []  # preview() calls: nothing recorded
        self.executed: list[str] = []
        self.cancels: list[tuple[str, str]] = []  # cancel() calls
        self.handed_back: list[str] = []  # hand_back() calls that gave a queued run up
        self._runs: dict[str, dict[str, Any]] = {dict(r)["id"]: dict(r) for r in preload}
        self._recover = list(recover_ids)
        self._ids = itertools.count(1)
        self._cond = threading.Condition()

    # -- RunStarter ---------------------------------------------------------------------------------

    def trigger_index(self) -> Sequence[TriggerSpec]:
        return list(self.triggers)

    def submit(self, request: RunRequest) -> RunTicket:
        if self.submit_delay:
            time.sleep(self.submit_delay)
        known = {t.runbook for t in self.triggers}
        if known and request.runbook not in known:
            raise UsageError(f"unknown runbook {request.runbook!r}")
        node = request.params.get("node") or request.node
        if not isinstance(node, str) or not is_node_name(node):
            raise UsageError(f"param node: {node!r} is not a valid node name")
        with self._cond:
            run_id = f"r-fake-{next(self._ids):04d}"
            self.requests.append(request)
            self._runs[run_id] = {
                "id": run_id, "runbook": request.runbook, "params": dict(request.params),
                "nodes": [node], "state": "pending", "source": request.source, "plan_digest": None,
                "approval_required": request.mode == "approve", "approved_by": None,
                "warnings": list(request.warnings), "reason": request.reason,
                "dedup_key": request.dedup_key, "requested_by": request.requested_by or request.source,
                "require_diagnosis": request.require_diagnosis,
                "started": time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()), "finished": None,
                "exit_code": None}
            self._cond.notify_all()
        return RunTicket(run_id, "pending")

    def execute(self, run_id: str) -> RunOutcome:
        if self.execute_gate is not None:
            self.execute_gate.wait(10)
        if self.execute_delay:
            time.sleep(self.execute_delay)
        with self._cond:
            run = self._runs[run_id]
            self.executed.append(run_id)
            if run["state"] in ("succeeded", "failed", "blocked", "cancelled"):
                return RunOutcome(run_id, run["state"], run["plan_digest"], run["exit_code"])
            if run["approval_required"] and not run["approved_by"]:
                run["state"], run["plan_digest"] = "waiting-approval", DIGEST
                if self.plan is not None:
                    run["plan"] = dict(self.plan(run))
                    run["plan_digest"] = run["plan"].get("digest") or DIGEST
                self._cond.notify_all()
                return RunOutcome(run_id, "waiting-approval", DIGEST)
        state = self.outcome(run)
        with self._cond:
            run["state"] = state
            run["exit_code"] = {"succeeded": 0, "failed": 1, "blocked": 3}.get(state, 1)
            run["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime())
            self._cond.notify_all()
        return RunOutcome(run_id, state, run["plan_digest"], run["exit_code"],
                          reason=f"fake run {state}")

    def require_approval(self, run_id: str, reason: str) -> None:
        with self._cond:
            run = self._runs[run_id]
            run["approval_required"] = True
            run.setdefault("escalations", []).append(reason)

    def approve(self, run_id: str, plan_digest: str, approved_by: str, *,
                roles: frozenset[str] = frozenset()) -> Mapping[str, Any]:
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                raise UsageError(f"unknown run id {run_id!r}")
            if run["plan_digest"] is None or plan_digest != run["plan_digest"]:
                raise StalePlan(f"run {run_id}: approval names plan {plan_digest!r}, but the run's plan is "
                                f"{run['plan_digest']!r}")
            if run["state"] != "waiting-approval":
                raise StalePlan(f"run {run_id} is {run['state']}, not waiting for approval")
            rule = rule_for(self.approvals, run["runbook"], {})
            earlier = self._approvals.setdefault(run_id, [])
            new = Approval(approved_by, plan_digest, roles)
            why = refusal(rule, new, requester=run.get("requested_by"), earlier=earlier)
            if why is not None:
                raise ApprovalRefused(f"run {run_id}: {why}")
            earlier.append(new)
            status = judge(rule, earlier, plan_digest, requester=run.get("requested_by"))
            run["approvals"] = status.as_dict()
            if status.satisfied:
                run["approved_by"] = ", ".join(status.approvers)
            return dict(run)

    def reject(self, run_id: str, reason: str, rejected_by: str) -> Mapping[str, Any]:
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                raise UsageError(f"unknown run id {run_id!r}")
            if run["state"] != "waiting-approval":
                raise StalePlan(f"run {run_id} is {run['state']}, not waiting for approval")
            run.update(state="cancelled", exit_code=4, rejected_by=rejected_by, rejected_reason=reason,
                       finished=time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
            run.setdefault("events", []).append({"kind": "approval.rejected", "by": rejected_by, "reason": reason})
            self._cond.notify_all()
            return dict(run)

    def runs(self, limit: int = 100, *, sources: tuple[str, ...] | None = None) -> Sequence[Mapping[str, Any]]:
        with self._cond:
            runs = [dict(r) for r in reversed(list(self._runs.values()))]
        return [r for r in runs if sources is None or r.get("source") in sources][:limit]

    def run(self, run_id: str) -> Mapping[str, Any]:
        with self._cond:
            if run_id not in self._runs:
                raise UsageError(f"unknown run id {run_id!r}")
            return dict(self._runs[run_id])

    def events_of(self, run_id: str, kinds: tuple[str, ...]) -> Sequence[Mapping[str, Any]]:
        return [e for e in self.run(run_id).get("events") or () if e.get("kind") in kinds]

    def record_event(self, run_id: str, kind: str, data: Mapping[str, Any]) -> None:
        with self._cond:
            if run_id not in self._runs:
                raise UsageError(f"unknown run id {run_id!r}")
            self._runs[run_id].setdefault("events", []).append({"kind": kind, **dict(data)})
            self._cond.notify_all()

    def stopping(self) -> None:
        """Nothing waits for budget room here."""

    def hand_back(self, run_id: str) -> bool:
        """A pending fake run is handed back (``handed_back`` records it); others are left as they are."""
        with self._cond:
            run = self._runs.get(run_id)
            if run is None or run["state"] != "pending" or run_id in self.executed:
                return False
            self.handed_back.append(run_id)
            return True

    def cancel(self, run_id: str, reason: str) -> str:
        """A pending, waiting or running fake run ends ``cancelled`` at once (``cancels`` records it)."""
        with self._cond:
            run = self._runs.get(run_id)
            if run is None:
                raise UsageError(f"unknown run id {run_id!r}")
            self.cancels.append((run_id, reason))
            if run["state"] in ("succeeded", "failed", "blocked", "cancelled", "interrupted"):
                return str(run["state"])
            run.update(state="cancelled", exit_code=4, finished=time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime()))
            run.setdefault("events", []).append({"kind": "run.cancelled", "reason": reason})
            self._cond.notify_all()
            return "cancelled"

    def prune(self, keep: int, max_age: float | None) -> Sequence[str]:
        """Finished runs beyond the ``keep`` newest (the fake keeps no finish times: ``max_age`` unused)."""
        with self._cond:
            finished = [r for r in reversed(list(self._runs.values()))
                        if r["state"] in ("succeeded", "failed", "blocked", "cancelled")]
            gone = [r["id"] for r in finished[keep:]]
            for run_id in gone:
                del self._runs[run_id]
            return gone

    def recover(self) -> Sequence[str]:
        return list(self._recover)

    def runbook_names(self) -> Sequence[str]:
        return sorted({t.runbook for t in self.triggers})

    def preview(self, runbook: str, params: Mapping[str, str], node: str) -> Mapping[str, Any]:
        if runbook not in self.runbook_names():
            raise UsageError(f"no runbook named {runbook!r}")
        if not is_node_name(node):
            raise UsageError(f"param node: {node!r} is not a valid node name")
        with self._cond:
            self.previews.append((runbook, dict(params), node))
        if self.plan is None:
            return {"format": "runbook-plan/v1", "runbook": runbook, "node": node, "state": "ready",
                    "params": {**params, "node": node}, "digest": DIGEST, "steps": []}
        return dict(self.plan({"id": f"preview-{len(self.previews)}", "runbook": runbook,
                               "params": {**params, "node": node}}))

    # -- test helpers ---------------------------------------------------------------------------------

    def wait_until(self, predicate: Callable[[FakeRunStarter], bool], timeout: float = 5.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self), timeout)

    def replan(self, run_id: str, digest: str) -> None:
        """The run's plan changed (as when facts moved): approvals naming the old digest are stale."""
        with self._cond:
            self._runs[run_id]["plan_digest"] = digest
            if isinstance(self._runs[run_id].get("plan"), dict):
                self._runs[run_id]["plan"]["digest"] = digest
            self._cond.notify_all()

    def set_state(self, run_id: str, state: str) -> None:
        with self._cond:
            self._runs[run_id]["state"] = state
            self._cond.notify_all()


class FakeLeadership:
    """A leadership that tests set or flip by hand (the real one is ``engine.serve.leader.LeaderElector``)."""

    def __init__(self, leading: bool = False) -> None:
        self.leading = leading
        self.on_change: Any = None

    def is_leader(self) -> bool:
        return self.leading

    def describe(self) -> dict[str, Any]:
        return {"role": "leader" if self.leading else "follower"}

    def try_once(self) -> bool:
        return self.leading

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def win(self) -> None:
        self.leading = True
        self.on_change(True)


class StaticClusterView:
    """A ``ClusterView`` over a fixed (mutable) list of nodes; ``fail`` makes it unreadable."""

    def __init__(self, nodes: Iterable[NodeFacts] = (), *, kured: Mapping[str, str] | None = None,
                 exclusions: ExclusionConfig | None = None) -> None:
        self.nodes = list(nodes)
        self.kured = dict(kured or {})
        self.exclusions = exclusions or ExclusionConfig()
        self.fail: str | None = None
        self.reads = 0

    def snapshot(self) -> ClusterSnapshot:
        self.reads += 1
        if self.fail:
            raise ClusterUnavailable(self.fail)
        return snapshot_from(self.nodes, self.exclusions, self.kured, time.time())


def alert(node: str, *, alertname: str = "KubeNodeNotReady", status: str = "firing",
          fingerprint: str | None = None, **labels: str) -> dict[str, Any]:
    """One alert of an Alertmanager v4 webhook, as Alertmanager 0.25 sends it."""
    return {
        "status": status,
        "labels": {"alertname": alertname, "node": node, "condition": "Ready", "status": "true",
                   "severity": "warning", **labels},
        "annotations": {"summary": f"{node} has been unready for more than 15 minutes."},
        "startsAt": "2026-07-10T15:39:51.000Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2026-07-10T16:39:51.000Z",
        "generatorURL": "http://prometheus.example/graph?g0.expr=kube_node_status_condition",
        "fingerprint": fingerprint if fingerprint is not None else f"fp-{alertname}-{node}",
    }


def webhook(*alerts: Mapping[str, Any], status: str | None = None) -> dict[str, Any]:
    """An Alertmanager v4 webhook body around ``alerts``."""
    firing = any(a.get("status") == "firing" for a in alerts)
    return {
        "receiver": "runbook", "status": status or ("firing" if firing else "resolved"),
        "alerts": list(alerts), "groupLabels": {"alertname": "KubeNodeNotReady"},
        "commonLabels": {"alertname": "KubeNodeNotReady"}, "commonAnnotations": {},
        "externalURL": "http://alertmanager.example", "version": "4",
        "groupKey": '{}:{alertname="KubeNodeNotReady"}', "truncatedAlerts": 0,
    }


TOKEN = "t0k3n-for-tests-sender"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
APPROVER_TOKEN = "t0k3n-for-tests-alice"  # approver "alice"
APPROVE = {"Authorization": f"Bearer {APPROVER_TOKEN}"}
READER_TOKEN = "t0k3n-for-tests-reader"  # reader "grafana"
READ = {"Authorization": f"Bearer {READER_TOKEN}"}
INCIDENT_NODES = tuple(make_node(f"omen{i}", gpus=1) for i in range(1, 9))  # eight healthy GPU nodes


class Served:
    """A served app (Starlette TestClient, lifespan run) with its fakes and captured notifications."""

    def __init__(self, client: Any, starter: FakeRunStarter, cluster: StaticClusterView,
                 sent: list[dict[str, Any]]) -> None:
        self.client, self.starter, self.cluster, self.sent = client, starter, cluster, sent

    @property
    def dispatcher(self) -> Any:
        return self.client.app.state.dispatcher

    def post_alerts(self, *alerts: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> Any:
        return self.client.post("/hooks/alertmanager", json=webhook(*alerts),
                                headers=dict(AUTH if headers is None else headers))

    def idle(self, timeout: float = 5.0) -> None:
        """Wait until every queued run was executed and every notification attempted."""
        assert self.dispatcher.worker.wait_idle(timeout), "runs still executing"
        assert self.dispatcher.notifier.flush(timeout), "notifications still queued"

    def events(self) -> list[str]:
        return [m["runbook_event"]["event"] for m in self.sent]


@contextmanager
def served(mode: str = "auto", *, token: str | None = TOKEN, nodes: Iterable[NodeFacts] | None = None,
           starter: FakeRunStarter | None = None, env: Mapping[str, str] | None = None,
           clock: Callable[[], float] = time.time, notify_from_config: bool = False,
           identity: Any = None, elector: Any = None, sweep_interval: float = 0, **cfg: Any) -> Iterator[Served]:
    """The app over fakes: trigger KubeNodeNotReady/Unreachable on ``node=~"omen.*"`` in ``mode``;
    eight healthy nodes omen1..omen8 unless ``nodes``; ``cfg`` overrides the configuration. The
    sender's token is ``token`` (``AUTH``), approver ``alice`` has ``APPROVE``, reader ``grafana``
    has ``READ``; the TestClient's Host ``testserver`` is allowed. ``notify_from_config``: the
    configuration's ``notify:`` section sends the notifications (real HTTP), not the capture.
    ``identity``: a ``KubeIdentity``: ``auth.mode: kubernetes``, no approver or reader credential.
    ``elector``: a ``LeaderElector`` (replicas); ``sweep_interval`` 0: no sweeper thread."""
    import httpx
    from starlette.testclient import TestClient

    from engine.serve.app import create_app
    from engine.serve.config import load_config
    from engine.serve.notify import Notifier

    sent: list[dict[str, Any]] = []

    def receive(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200)

    roles = {} if identity is not None else {"RUNBOOK_APPROVER_TOKEN_ALICE": APPROVER_TOKEN,
                                             "RUNBOOK_READER_TOKEN_GRAFANA": READER_TOKEN}
    environ = {**({"RUNBOOK_WEBHOOK_TOKEN": token} if token else {}), **roles, **dict(env or {})}
    auth = {"allowed_hosts": ["testserver"], **({"mode": "kubernetes"} if identity is not None else {}),
            **dict(cfg.pop("auth", None) or {})}
    config = load_config(None, env=environ, overrides={**cfg, "auth": auth})
    starter = starter or FakeRunStarter([trigger_spec(mode=mode, matchers=('node=~"omen.*"',))])
    cluster = StaticClusterView(INCIDENT_NODES if nodes is None else nodes)
    notifier = None if notify_from_config else Notifier("http://127.0.0.1:9/notify",
                                                        transport=httpx.MockTransport(receive))
    app = create_app(config, starter, cluster=cluster, notifier=notifier, sweep_interval=sweep_interval,
                     clock=clock, identity=identity, elector=elector)
    with TestClient(app) as client:
        yield Served(client, starter, cluster, sent)
