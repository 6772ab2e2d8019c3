"""Run integrity: only runs this server (or CLI) recorded, unchanged since, are ever executed.

The store is writable by more identities than the engine's: anyone who may create a
``RemediationRun`` (or edit its status) could otherwise hand the executor a run it never planned,
a plan for another node, or an approval nobody gave. So every run the engine records is **sealed**:
an HMAC-SHA256, keyed by a secret only the engine holds, over the SHA-256 of the canonical JSON of
each field that decides what a run does (``sealed_fields``): its id, the spec (runbook, node, nodes,
params, source, mode), who requested it, the recorded plan digest, and the approval (digest and
approver). The seal is an event of the run (``run.seal``: key id, the per-field hashes, the MAC over
them), so a failed check names the field that changed. The run service seals right after each write
it makes to those fields (create, plan, approval, an ``approval.required``): it reads them back and
seals only when the fields it wrote are as written and every other field is what the last seal
covered (a change slipped in by someone else meanwhile is never sealed).

Before a run is planned, resumed, taken over or executed, ``RunIntegrity.check`` verifies the last
seal's MAC and compares its hashes with the record as it is now; a run with no seal, a seal by an
unknown key or altered, or a field that changed is refused: ``block`` records phase ``Blocked``
with the reason (and, in the Kubernetes store, a Warning Event on the RemediationRun) and nothing
else happens. ``plan_problems`` then holds the
plan itself to the run (item 2 of issue 25): its digest recomputed from its content equals the
recorded one (and the approved one, for an approve-mode run), and its node, runbook and params are
the run's spec.

Keys (``Keyring``): ids with secrets, one ``current`` that signs; every listed key verifies, so a
rotation adds a key, makes it current, and removes the old one once no run sealed with it is left.
Where they live (``keyring_for``): with the Kubernetes store the Secret ``runbook-run-key`` in the
store namespace (created by the first process that needs it, readable only by the engine's
ServiceAccount: deploy/kubernetes/rbac.yaml); with the SQLite journal the file ``<journal>.key``
beside it (mode 0600, created on first use).

What it must not do: trust any field of the store for its own proof, or let a failed check do
anything but block the run.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import Conflict, ExitCode, KubeError, RunbookError, UsageError

if TYPE_CHECKING:
    from engine.model import Plan
    from engine.store import RunRecord, RunStore

SEAL_EVENT = "run.seal"
ESCALATED_EVENT = "approval.required"  # the server made an automatic run wait for a person (sealed too)
KEY_SECRET = "runbook-run-key"  # the Secret in the store namespace (Kubernetes store)
KEY_FILE_SUFFIX = ".key"  # beside the SQLite journal
SEALED = ("run_id", "runbook", "node", "nodes", "params", "source", "approval_required", "requested_by",
          "plan_digest", "approvals", "approved_digest", "approved_by")
APPROVAL_RECORDED = "approval.recorded"  # engine.approvals: one person's approval under the policy
log = logging.getLogger("runbook.integrity")


class IntegrityError(RunbookError):
    """A run that does not verify, or a key that cannot be read or created: nothing is executed."""

    exit_code = ExitCode.BLOCKED

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def canonical(value: Any) -> bytes:
    """Stable bytes: sorted keys, no whitespace, UTF-8 (what is MAC'ed)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


@dataclass(frozen=True)
class Keyring:
    """Key id -> secret; ``current`` signs, every key verifies."""

    keys: Mapping[str, bytes]
    current: str

    def __post_init__(self) -> None:
        if self.current not in self.keys or any(len(k) < 16 for k in self.keys.values()):
            raise IntegrityError(f"run key: current key {self.current!r} missing or a key shorter than 16 bytes")

    def mac(self, key_id: str, payload: bytes) -> str:
        return hmac.new(self.keys[key_id], payload, hashlib.sha256).hexdigest()

    @staticmethod
    def generate(key_id: str = "k1") -> Keyring:
        return Keyring({key_id: secrets.token_bytes(32)}, key_id)

    def to_json(self) -> str:
        return json.dumps({"current": self.current,
                           "keys": {k: base64.b64encode(v).decode() for k, v in sorted(self.keys.items())}})

    @staticmethod
    def from_json(text: str, where: str) -> Keyring:
        try:
            data = json.loads(text)
            return Keyring({str(k): base64.b64decode(v, validate=True) for k, v in data["keys"].items()},
                           str(data["current"]))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IntegrityError(f"{where}: not a run key ring ({{\"current\": id, \"keys\": {{id: base64}}}}): "
                                 f"{e}") from e


# -- the fields a seal covers ------------------------------------------------------------------------


def sealed_fields(rec: RunRecord, requested_by: str | None, escalated: bool = False,
                  approvals: list[list[Any]] | None = None) -> dict[str, Any]:
    """What decides what a run does, as the store holds it now (``escalated``: an
    ``approval.required`` event made an automatic run wait for a person; ``approvals``: each
    person's approval the policy counts, [by, plan digest, roles])."""
    return {"run_id": rec.id, "runbook": rec.runbook, "node": rec.nodes[0] if rec.nodes else "",
            "nodes": list(rec.nodes), "params": dict(rec.params), "source": rec.source,
            "approval_required": bool(rec.approval_required) or escalated, "requested_by": requested_by,
            "plan_digest": rec.plan_digest, "approvals": list(approvals or []),
            "approved_digest": rec.approved_digest, "approved_by": rec.approved_by}


def _field_hashes(fields: Mapping[str, Any]) -> dict[str, str]:
    return {k: hashlib.sha256(canonical(fields.get(k))).hexdigest()[:32] for k in SEALED}


def plan_problems(plan: Plan, rec: RunRecord, params: Mapping[str, Any] | None = None) -> list[str]:
    """Why ``plan`` may not run as ``rec`` ([] = it may): the plan's digest recomputed from its
    content must equal its own, the recorded and (approve mode) the approved digest; its node,
    runbook and params must be the run's spec (``params``: those the executor will be given)."""
    out = []
    computed = plan.compute_digest()
    if computed != plan.digest:
        out.append(f"the plan's content hashes to {computed[:12]}, not to its digest {plan.digest[:12]}")
    if rec.plan_digest != plan.digest:
        out.append(f"the plan's digest {plan.digest[:12]} is not the recorded plan digest {str(rec.plan_digest)[:12]}")
    if rec.approval_required and rec.approved_digest is not None and rec.approved_digest != plan.digest:
        out.append(f"the approved digest {rec.approved_digest[:12]} is not the plan's {plan.digest[:12]}")
    node = rec.nodes[0] if rec.nodes else ""
    if plan.node != node or len(rec.nodes) != 1:
        out.append(f"the plan is for node {plan.node!r}, the run for {list(rec.nodes)}")
    if plan.runbook != rec.runbook:
        out.append(f"the plan is for runbook {plan.runbook!r}, the run for {rec.runbook!r}")
    if canonical(dict(plan.params)) != canonical(dict(rec.params)):
        out.append("the plan's params are not the run's params")
    if params is not None and canonical(dict(params)) != canonical(dict(plan.params)):
        out.append("the params to execute with are not the approved plan's params")
    return out


# -- key sources -------------------------------------------------------------------------------------


def _key_file_ring(path: Path) -> Keyring:
    """The key ring in ``path`` (0600), created when missing (O_EXCL: two processes never both create)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    except OSError as e:
        raise IntegrityError(f"{path}: cannot create the run key file: {e.strerror}") from e
    else:
        with os.fdopen(fd, "w") as f:
            f.write(Keyring.generate().to_json())
            f.flush()
            os.fsync(f.fileno())
        return _key_file_ring(path)
    text = ""
    for _ in range(100):  # Why: its creator may be between O_EXCL and the write (a few ms at most)
        try:
            mode = path.stat().st_mode & 0o077
            text = path.read_text()
        except OSError as e:
            raise IntegrityError(f"{path}: cannot read the run key file: {e.strerror}") from e
        if text.strip():
            break
        time.sleep(0.01)
    if mode:
        raise IntegrityError(f"{path}: the run key file is readable by others (mode {oct(mode)}); chmod 600 it")
    if not text.strip():  # another process is writing it right now
        raise IntegrityError(f"{path}: the run key file is empty", retryable=True)
    return Keyring.from_json(text, str(path))


def _secret_ring(api: Any, namespace: str) -> Keyring:
    """The key ring in Secret ``runbook-run-key`` (data ``keys.json``), created when missing; two
    creators race through the API server's create (409: the other's is read)."""
    where = f"Secret {namespace}/{KEY_SECRET}"
    try:
        obj = api.read_object("v1", "secrets", namespace, KEY_SECRET)
        if obj is None:
            body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": KEY_SECRET, "namespace": namespace,
                                 "labels": {"app.kubernetes.io/name": "runbook"}},
                    "data": {"keys.json": base64.b64encode(Keyring.generate().to_json().encode()).decode()}}
            try:
                obj = api.create_object("v1", "secrets", namespace, body)
            except Conflict:
                obj = api.read_object("v1", "secrets", namespace, KEY_SECRET)
    except KubeError as e:
        raise IntegrityError(f"{where}: cannot read or create the run key ({e}); only the engine's "
                             "ServiceAccount may (deploy/kubernetes/rbac.yaml): approvers approve through "
                             "the server, not with the store", retryable=e.retryable) from e
    data = (obj or {}).get("data") or {}
    if "keys.json" not in data:
        raise IntegrityError(f"{where}: has no data key keys.json")
    try:
        text = base64.b64decode(data["keys.json"]).decode()
    except ValueError as e:
        raise IntegrityError(f"{where}: keys.json is not base64: {e}") from e
    return Keyring.from_json(text, where)


def keyring_for(store: RunStore) -> Keyring:
    """The key ring of ``store``: the Secret of the Kubernetes store's namespace, or the file beside
    the SQLite journal. ``IntegrityError`` when it can be neither read nor created."""
    from engine.kube_store import KubeRunStore

    if isinstance(store, KubeRunStore):
        return _secret_ring(store.api, store.namespace)
    path = getattr(store, "path", None)
    if path is None:
        raise IntegrityError(f"{type(store).__name__}: no place for a run key")
    return _key_file_ring(Path(str(path) + KEY_FILE_SUFFIX))


# -- sealing and checking ----------------------------------------------------------------------------


class RunIntegrity:
    """Seals and checks the runs of one store. Thread-safe; the key ring is read once (and again
    when a seal names a key it does not hold: a rotation made while it runs)."""

    def __init__(self, store: RunStore, keys: Keyring | None = None) -> None:
        self.store = store
        self._keys = keys
        self._lock = threading.Lock()

    def keys(self, *, reload: bool = False) -> Keyring:
        with self._lock:
            if self._keys is None or reload:
                self._keys = keyring_for(self.store)
            return self._keys

    def _now(self, run_id: str) -> tuple[RunRecord, dict[str, Any], list[dict[str, Any]]]:
        rec = self.store.get_run(run_id)
        events = self.store.events(run_id)
        requested = next((e.data.get("by") for e in events if e.kind == "run.requested"), None)
        seals = [e.data for e in events if e.kind == SEAL_EVENT]
        escalated = any(e.kind == ESCALATED_EVENT for e in events)
        approvals = [[e.data.get("by"), e.data.get("plan_digest"), list(e.data.get("roles") or [])]
                     for e in events if e.kind == APPROVAL_RECORDED]
        return rec, sealed_fields(rec, requested, escalated, approvals), seals

    def fields(self, run_id: str) -> dict[str, Any]:
        """The sealed fields as the store holds them now."""
        return self._now(run_id)[1]

    def _signed(self, fields: Mapping[str, Any]) -> dict[str, Any]:
        """A seal event's data: per-field hashes, and the current key's MAC over them."""
        keys = self.keys()
        hashes = _field_hashes(fields)
        return {"key": keys.current, "mac": keys.mac(keys.current, canonical(hashes)), "fields": hashes}

    def _authentic(self, seal: Mapping[str, Any]) -> tuple[dict[str, str] | None, str]:
        """The field hashes of a seal whose MAC verifies, else (None, why)."""
        key_id, mac = str(seal.get("key", "")), str(seal.get("mac", ""))
        given = seal.get("fields")
        hashes = {str(k): str(v) for k, v in given.items()} if isinstance(given, Mapping) else {}
        keys = self.keys()
        if key_id not in keys.keys:
            keys = self.keys(reload=True)
        if key_id not in keys.keys:
            return None, f"its seal names key {key_id!r}, which the run key ring does not hold"
        if set(hashes) != set(SEALED) or not hmac.compare_digest(keys.mac(key_id, canonical(hashes)), mac):
            return None, "its seal was altered (the MAC does not verify)"
        return hashes, ""

    def seal(self, run_id: str, **expected: Any) -> None:
        """Seal the run as recorded now. Refused (``IntegrityError``, nothing written) unless the
        fields in ``expected`` (those the caller just wrote) read back as written and every other
        field is what the run's last seal covered: a change slipped in meanwhile is never sealed."""
        _, fields, seals = self._now(run_id)
        changed = [k for k, v in expected.items() if canonical(fields.get(k)) != canonical(v)]
        if not seals:
            raise IntegrityError(f"run {run_id}: it carries no seal to continue from; not sealed")
        before, why = self._authentic(seals[-1])
        if before is None:
            raise IntegrityError(f"run {run_id}: {why}; not sealed")
        now = _field_hashes(fields)
        changed += [k for k in SEALED if k not in expected and before[k] != now[k]]
        if changed:
            raise IntegrityError(f"run {run_id}: {', '.join(sorted(set(changed)))} changed in the store by "
                                 "someone else; not sealed")
        self.store.append(run_id, SEAL_EVENT, **self._signed(fields))

    def first_seal(self, run_id: str, *, runbook: str, nodes: list[str], params: Mapping[str, Any], source: str,
                   approval_required: bool, requested_by: str) -> tuple[str, dict[str, Any]]:
        """The seal of a run about to be created (an event for ``create_run``'s first events: one
        commit), over the values as the store will hold them (masked, plain JSON)."""
        fields = {"run_id": run_id, "runbook": runbook, "node": nodes[0] if nodes else "", "nodes": list(nodes),
                  "params": json.loads(json.dumps(self.store.redact(dict(params)), default=str)),
                  "source": source, "approval_required": bool(approval_required),
                  "requested_by": self.store.redact(requested_by), "plan_digest": None, "approvals": [],
                  "approved_digest": None, "approved_by": None}
        return SEAL_EVENT, self._signed(fields)

    def problem(self, run_id: str) -> str | None:
        """Why the run does not verify (None: it does). ``IntegrityError`` when no key can be read."""
        _, fields, seals = self._now(run_id)
        if not seals:
            return ("it carries no seal of this engine: it was not created by runbook (created with kubectl or "
                    "another tool, or by a version before run seals)")
        recorded, why = self._authentic(seals[-1])
        if recorded is None:
            return why
        now = _field_hashes(fields)
        named = sorted(k for k in SEALED if recorded[k] != now[k])
        if not named:
            return None
        return f"its {', '.join(named)} changed after runbook recorded them (the seal does not verify)"

    def check(self, run_id: str) -> None:
        """``IntegrityError`` naming what did not verify; None when the run may go on."""
        why = self.problem(run_id)
        if why is not None:
            raise IntegrityError(f"run {run_id} refused: {why}")

    def block(self, run_id: str, reason: str) -> None:
        """Record the run ``Blocked`` with ``reason`` (and a Warning Event on the RemediationRun);
        nothing else. Best effort past the state: a refused run must never become an error loop."""
        try:
            self.store.append(run_id, "run.blocked", reason=reason, integrity=True)
            self.store.set_state(run_id, "blocked", exit_code=ExitCode.BLOCKED)
        except RunbookError as e:
            log.error("run %s: could not record it blocked (%s): %s", run_id, e, reason)
        _record_kube_event(self.store, run_id, reason)


def approve_sealed(integrity: RunIntegrity, run_id: str, digest: str, approved_by: str,
                   record: Callable[[str], Mapping[str, Any]], *,
                   roles: frozenset[str] = frozenset()) -> Mapping[str, Any]:
    """Record ``approved_by``'s approval of plan ``digest`` (``record``: the approval policy's
    ``engine.approvals.approve``, returning the run's summary with ``approvals``) and seal it. The
    key is read first and the run verified first: an identity that cannot seal writes nothing, and a
    run that does not verify is never approved (sealing it would make a forged run look like the
    engine's). The seal expects exactly this approval added (and, once the policy is satisfied, the
    run's approval): anything else slipped in meanwhile is never sealed."""
    integrity.keys()
    before: list[Any] | None = None
    with contextlib.suppress(UsageError):  # an unknown run: record says so, after the store's lock wait
        integrity.check(run_id)
        before = list(integrity.fields(run_id)["approvals"])
    summary = record(approved_by)
    expected: dict[str, Any] = {"approvals": [*(before or []), [approved_by, digest, sorted(roles)]]}
    if (summary.get("approvals") or {}).get("satisfied"):
        expected.update(approved_digest=digest, approved_by=summary.get("approved_by"))
    integrity.seal(run_id, **expected)
    return summary


def _record_kube_event(store: RunStore, run_id: str, reason: str) -> None:
    from engine.kube_store import API_VERSION, KIND, KubeRunStore
    from engine.kube_store import format_time as fmt

    if not isinstance(store, KubeRunStore):
        return
    now = fmt(store.clock())
    body = {"apiVersion": "v1", "kind": "Event",
            "metadata": {"name": f"{run_id}.{secrets.token_hex(6)}", "namespace": store.namespace},
            "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": run_id,
                               "namespace": store.namespace},
            "reason": "RunIntegrityRefused", "message": reason[:1024], "type": "Warning",
            "source": {"component": "runbook"}, "reportingComponent": "runbook", "reportingInstance": "runbook",
            "firstTimestamp": now.split(".")[0] + "Z", "lastTimestamp": now.split(".")[0] + "Z", "count": 1}
    try:
        store.api.create_object("v1", "events", store.namespace, body)
    except (KubeError, UsageError) as e:  # the record in the run is what counts
        log.warning("run %s: could not record the integrity Event: %s", run_id, e)


__all__ = ["ESCALATED_EVENT", "KEY_SECRET", "SEAL_EVENT", "IntegrityError", "Keyring", "RunIntegrity",
           "approve_sealed", "keyring_for",
           "plan_problems", "sealed_fields"]
