"""The runbook format and the run-time values, as frozen pydantic models.

Two families live here:

* the **format** (``Runbook`` and everything under it) that ``engine.loader`` builds from YAML;
  every model forbids unknown keys, so a typo is a located load error rather than a silent no-op;
* the **values** a run produces (``Plan``, ``StepOutcome``, ``RunResult``, the state enums), which
  are serialisable (``model_dump_json``) so plans can be saved, compared and approved by digest.

No I/O and no Jinja here: templates are plain strings until ``engine.templating`` renders them.
Checks and actions are unions discriminated by their single key (``{node_ready: true}``), which is
also how the JSON Schema for editors (``runbook schema``) describes them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

API_VERSION = "runbook/v1"
PLAN_FORMAT = "runbook-plan/v1"

# RFC 1123 label (runbook names, step ids) and subdomain (Kubernetes node names).
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
STEP_ID = r"^[a-z0-9]([-_a-z0-9]*[a-z0-9])?$"
PARAM_NAME = r"^[a-z_][a-z0-9_]*$"

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_DURATION = re.compile(r"^(?:\d+(?:\.\d+)?(?:ms|s|m|h))+$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def is_template(text: str) -> bool:
    """True when a string contains Jinja2 markup and must be rendered before use."""
    return "{{" in text or "{%" in text


def parse_duration(text: str | int | float) -> float:
    """``"30s"``, ``"2m"``, ``"1m30s"``, ``"500ms"``, ``"1h"`` or a number of seconds -> seconds."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, int | float):
        if text < 0:
            raise ValueError(f"a duration cannot be negative: {text}")
        return float(text)
    s = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", s):
        return float(s)
    if not _DURATION.fullmatch(s):
        raise ValueError(f"not a duration: {text!r} (use e.g. 30s, 2m, 1m30s, 500ms, 1h)")
    return sum(float(n) * _UNITS[u] for n, u in _DURATION_PART.findall(s))


def _coerce_duration(value: Any) -> Any:
    """Durations are kept as strings (possibly templated) and parsed when used."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration like 30s, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a duration cannot be negative: {value}")
        return f"{value}s"
    if isinstance(value, str) and not is_template(value):
        parse_duration(value)
    return value


Duration = Annotated[str, BeforeValidator(_coerce_duration)]


def _bool_to_status(value: Any) -> Any:
    # YAML reads `status: True` as a boolean; Kubernetes condition statuses are strings.
    if isinstance(value, bool):
        return "True" if value else "False"
    return value


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


def _single_key(value: Any) -> str | None:
    """Discriminator of ``{key: spec}`` unions: the one key, or the model's ``KEY``."""
    if isinstance(value, Mapping):
        return next(iter(value)) if len(value) == 1 else None
    return getattr(value, "KEY", None)


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


class NodeLabelSpec(_Model):
    key: str = Field(min_length=1)
    equals: str | None = None
    absent: bool | None = None

    @model_validator(mode="after")
    def _one_condition(self) -> NodeLabelSpec:
        if (self.equals is None) == (self.absent is None):
            raise ValueError("node_label needs exactly one of 'equals' or 'absent'")
        return self


class NodeTaintSpec(_Model):
    key: str = Field(min_length=1)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    present: bool = True


class NodeConditionSpec(_Model):
    type: str = Field(min_length=1)
    status: Annotated[Literal["True", "False", "Unknown"], BeforeValidator(_bool_to_status)]


class AllocatableSpec(_Model):
    resource: str = Field(min_length=1)
    min: int | str = 1  # a Kubernetes quantity: 1, "500m", "4Gi"


class ObjectsSpec(_Model):
    """Objects of any listable kind, e.g. KubeVirt VirtualMachines by ``status.printableStatus``."""

    api_version: str = Field(min_length=1)  # "kubevirt.io/v1", "v1"
    kind: str = Field(min_length=1)  # "VirtualMachine"
    plural: str | None = None  # defaults to lower(kind) + "s"
    namespace: str | None = None  # all namespaces when omitted
    selector: str | None = None  # label selector
    resource: str | None = None  # only objects asking for this extended resource (pods, VMs, VMIs)
    field: str | None = None  # dotted path into each object; all listed objects match when omitted
    equals: str | int | bool | None = None
    count: int | None = Field(default=None, ge=0)
    min: int | None = Field(default=None, ge=0)
    max: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> ObjectsSpec:
        if self.field is not None and self.equals is None:
            raise ValueError("objects: 'field' needs 'equals'")
        if self.count is not None and (self.min is not None or self.max is not None):
            raise ValueError("objects: use either 'count' or 'min'/'max'")
        return self

    @property
    def plural_name(self) -> str:
        return self.plural or self.kind.lower() + "s"


class ServiceSpec(_Model):
    name: str = Field(min_length=1)
    state: str | tuple[str, ...]  # systemctl is-active output; a list means any of them

    @property
    def states(self) -> tuple[str, ...]:
        return (self.state,) if isinstance(self.state, str) else self.state


class JournalSpec(_Model):
    unit: str = Field(min_length=1)
    text: str = Field(min_length=1)


class CudaProcessesSpec(_Model):
    min: int | None = Field(default=None, ge=0)
    max: int | None = Field(default=None, ge=0)
    # Every host CUDA process of the plan's baseline (the facts the plan was made from) still runs,
    # by pid: "no host CUDA job killed". Unknown without a baseline (fail closed).
    none_killed: Literal[True] | None = None

    @model_validator(mode="after")
    def _some_bound(self) -> CudaProcessesSpec:
        if self.min is None and self.max is None and self.none_killed is None:
            raise ValueError("cuda_processes needs 'min', 'max' or 'none_killed: true'")
        return self


class FileSpec(_Model):
    path: str = Field(min_length=2)  # absolute path on the node host
    exists: bool | None = None  # defaults to true when 'contains' is not given
    contains: str | None = None  # substring of the file's text (first 64 KiB)

    @field_validator("path")
    @classmethod
    def _absolute(cls, v: str) -> str:
        if not v.startswith("/") and not v.startswith("{{"):
            raise ValueError(f"file path must be absolute, got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> FileSpec:
        if self.contains is not None and self.exists is False:
            raise ValueError("file: 'contains' with 'exists: false' can never hold")
        return self


class NodeExistsCheck(_Model):
    KEY: ClassVar[str] = "node_exists"
    node_exists: bool


class NodeReadyCheck(_Model):
    KEY: ClassVar[str] = "node_ready"
    node_ready: bool


class NodeLabelCheck(_Model):
    KEY: ClassVar[str] = "node_label"
    node_label: NodeLabelSpec


class NodeTaintCheck(_Model):
    KEY: ClassVar[str] = "node_taint"
    node_taint: NodeTaintSpec


class NodeConditionCheck(_Model):
    KEY: ClassVar[str] = "node_condition"
    node_condition: NodeConditionSpec


class AllocatableCheck(_Model):
    KEY: ClassVar[str] = "allocatable"
    allocatable: AllocatableSpec


class ObjectsCheck(_Model):
    KEY: ClassVar[str] = "objects"
    objects: ObjectsSpec


class SwapActiveCheck(_Model):
    KEY: ClassVar[str] = "swap_active"
    swap_active: bool


class FstabActiveSwapCheck(_Model):
    KEY: ClassVar[str] = "fstab_active_swap"
    fstab_active_swap: bool


class ServiceCheck(_Model):
    KEY: ClassVar[str] = "service"
    service: ServiceSpec


class JournalContainsCheck(_Model):
    KEY: ClassVar[str] = "journal_contains"
    journal_contains: JournalSpec


class GpuDriverCheck(_Model):
    KEY: ClassVar[str] = "gpu_driver"
    gpu_driver: Literal["nvidia", "vfio-pci", "none"]


class CudaProcessesCheck(_Model):
    KEY: ClassVar[str] = "cuda_processes"
    cuda_processes: CudaProcessesSpec


class FileCheck(_Model):
    KEY: ClassVar[str] = "file"
    file: FileSpec


class ExprCheck(_Model):
    KEY: ClassVar[str] = "expr"
    expr: str = Field(min_length=1)  # a Jinja2 expression (no braces), truthy = holds


class AllCheck(_Model):
    KEY: ClassVar[str] = "all"
    all_: tuple[Check, ...] = Field(alias="all", min_length=1)


class AnyCheck(_Model):
    KEY: ClassVar[str] = "any"
    any_: tuple[Check, ...] = Field(alias="any", min_length=1)


class NotCheck(_Model):
    KEY: ClassVar[str] = "not"
    not_: Check = Field(alias="not")


CHECK_TYPES: tuple[type[_Model], ...] = (
    NodeExistsCheck, NodeReadyCheck, NodeLabelCheck, NodeTaintCheck, NodeConditionCheck,
    AllocatableCheck, ObjectsCheck, SwapActiveCheck, FstabActiveSwapCheck, ServiceCheck,
    JournalContainsCheck, GpuDriverCheck, CudaProcessesCheck, FileCheck, ExprCheck, AllCheck, AnyCheck,
    NotCheck,
)
CHECK_KEYS: tuple[str, ...] = tuple(t.KEY for t in CHECK_TYPES)  # type: ignore[attr-defined]

Check = Annotated[
    Annotated[NodeExistsCheck, Tag("node_exists")]
    | Annotated[NodeReadyCheck, Tag("node_ready")]
    | Annotated[NodeLabelCheck, Tag("node_label")]
    | Annotated[NodeTaintCheck, Tag("node_taint")]
    | Annotated[NodeConditionCheck, Tag("node_condition")]
    | Annotated[AllocatableCheck, Tag("allocatable")]
    | Annotated[ObjectsCheck, Tag("objects")]
    | Annotated[SwapActiveCheck, Tag("swap_active")]
    | Annotated[FstabActiveSwapCheck, Tag("fstab_active_swap")]
    | Annotated[ServiceCheck, Tag("service")]
    | Annotated[JournalContainsCheck, Tag("journal_contains")]
    | Annotated[GpuDriverCheck, Tag("gpu_driver")]
    | Annotated[CudaProcessesCheck, Tag("cuda_processes")]
    | Annotated[FileCheck, Tag("file")]
    | Annotated[ExprCheck, Tag("expr")]
    | Annotated[AllCheck, Tag("all")]
    | Annotated[AnyCheck, Tag("any")]
    | Annotated[NotCheck, Tag("not")],
    Discriminator(_single_key),
]

AllCheck.model_rebuild()
AnyCheck.model_rebuild()
NotCheck.model_rebuild()

# --------------------------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------------------------

TaintEffect = Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]


class TaintSpec(_Model):
    key: str = Field(min_length=1)
    value: str = ""
    effect: TaintEffect


class UntaintSpec(_Model):
    key: str = Field(min_length=1)
    effect: TaintEffect | None = None  # every effect of the key when omitted


class PatchSpec(_Model):
    type: Literal["merge", "strategic", "json"] = "merge"
    body: dict[str, Any] | list[dict[str, Any]]

    @model_validator(mode="after")
    def _body_matches_type(self) -> PatchSpec:
        if (self.type == "json") != isinstance(self.body, list):
            raise ValueError("a json patch body is a list of operations; merge/strategic bodies are mappings")
        return self


class PodSelectorSpec(_Model):
    selector: str | None = None  # label selector; every pod on the node when omitted
    namespace: str | None = None  # every namespace when omitted
    resource: str | None = None  # only pods whose containers request or limit this resource (nvidia.com/gpu)
    grace_seconds: int | None = Field(default=None, ge=0)  # delete_pods only


class WaitSpec(_Model):
    seconds: float = Field(gt=0, le=3600)


class KubeLabel(_Model):
    KEY: ClassVar[str] = "label"
    label: dict[str, str] = Field(min_length=1)


class KubeUnlabel(_Model):
    KEY: ClassVar[str] = "unlabel"
    unlabel: tuple[str, ...] = Field(min_length=1)


class KubeAnnotate(_Model):
    KEY: ClassVar[str] = "annotate"
    annotate: dict[str, str] = Field(min_length=1)


class KubeCordon(_Model):
    KEY: ClassVar[str] = "cordon"
    cordon: Literal[True]


class KubeUncordon(_Model):
    KEY: ClassVar[str] = "uncordon"
    uncordon: Literal[True]


class KubeTaint(_Model):
    KEY: ClassVar[str] = "taint"
    taint: TaintSpec


class KubeUntaint(_Model):
    KEY: ClassVar[str] = "untaint"
    untaint: UntaintSpec


class KubePatch(_Model):
    KEY: ClassVar[str] = "patch"
    patch: PatchSpec


class KubeEvict(_Model):
    KEY: ClassVar[str] = "evict"
    evict: PodSelectorSpec


class KubeDeletePods(_Model):
    KEY: ClassVar[str] = "delete_pods"
    delete_pods: PodSelectorSpec


class KubeWait(_Model):
    KEY: ClassVar[str] = "wait"
    wait: WaitSpec


KubeVerb = Annotated[
    Annotated[KubeLabel, Tag("label")]
    | Annotated[KubeUnlabel, Tag("unlabel")]
    | Annotated[KubeAnnotate, Tag("annotate")]
    | Annotated[KubeCordon, Tag("cordon")]
    | Annotated[KubeUncordon, Tag("uncordon")]
    | Annotated[KubeTaint, Tag("taint")]
    | Annotated[KubeUntaint, Tag("untaint")]
    | Annotated[KubePatch, Tag("patch")]
    | Annotated[KubeEvict, Tag("evict")]
    | Annotated[KubeDeletePods, Tag("delete_pods")]
    | Annotated[KubeWait, Tag("wait")],
    Discriminator(_single_key),
]
KUBE_VERBS = ("label", "unlabel", "annotate", "cordon", "uncordon", "taint", "untaint", "patch",
              "evict", "delete_pods", "wait")


class AnsibleSpec(_Model):
    playbook: str = Field(min_length=1)  # relative to the playbooks dir
    become: bool = True
    vars: dict[str, Any] = Field(default_factory=dict)
    timeout: Duration = "300s"
    preview: bool = True  # run with --check --diff when planning

    @field_validator("playbook")
    @classmethod
    def _relative_playbook(cls, v: str) -> str:
        parts = v.replace("\\", "/").split("/")
        if v.startswith("/") or ".." in parts:
            raise ValueError(f"playbook must be a path inside the playbooks dir, got {v!r}")
        if not v.endswith((".yml", ".yaml")):
            raise ValueError(f"playbook must be a .yml or .yaml file, got {v!r}")
        return v

    @field_validator("vars")
    @classmethod
    def _var_names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for k in v:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise ValueError(f"ansible variable name {k!r} is not a valid identifier")
        return v


class CheckSpec(_Model):
    """``check: {}``: a pure wait step, its verify list is what it waits for."""


class KubeAction(_Model):
    KEY: ClassVar[str] = "kube"
    kube: KubeVerb


class AnsibleAction(_Model):
    KEY: ClassVar[str] = "ansible"
    ansible: AnsibleSpec


class CheckAction(_Model):
    KEY: ClassVar[str] = "check"
    check: CheckSpec = Field(default_factory=CheckSpec)

    @field_validator("check", mode="before")
    @classmethod
    def _null_is_empty(cls, v: Any) -> Any:
        return {} if v is None else v


Action = Annotated[
    Annotated[KubeAction, Tag("kube")] | Annotated[AnsibleAction, Tag("ansible")]
    | Annotated[CheckAction, Tag("check")],
    Discriminator(_single_key),
]
ACTION_KEYS = ("kube", "ansible", "check")


def is_mutating(action: KubeAction | AnsibleAction | CheckAction) -> bool:
    """Kube verbs other than ``wait`` and every playbook run change something."""
    if isinstance(action, KubeAction):
        return not isinstance(action.kube, KubeWait)
    return isinstance(action, AnsibleAction)


def action_kind(action: KubeAction | AnsibleAction | CheckAction) -> Literal["kube", "ansible", "check"]:
    return action.KEY  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Params, preconditions, steps, triggers, runbook
# --------------------------------------------------------------------------------------------

ParamValue = str | int | bool


class Param(_Model):
    type: Literal["string", "int", "bool", "enum", "node"] = "string"
    description: str = ""
    required: bool = False
    default: ParamValue | None = None
    pattern: str | None = None
    values: tuple[str, ...] | None = None  # enum
    min: int | None = None
    max: int | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Param:
        if self.type == "enum" and not self.values:
            raise ValueError("an enum param needs 'values'")
        if self.type != "enum" and self.values is not None:
            raise ValueError("'values' is only for enum params")
        if self.type != "int" and (self.min is not None or self.max is not None):
            raise ValueError("'min'/'max' are only for int params")
        if self.pattern is not None:
            if self.type not in ("string", "node"):
                raise ValueError("'pattern' is only for string and node params")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern is not a valid regular expression: {e}") from e
        if self.required and self.default is not None:
            raise ValueError("a required param has no default")
        if self.default is not None:
            from engine.params import coerce_value  # lazy: params imports this module

            coerce_value("default", self, self.default)
        return self


class Precondition(_Model):
    id: str = Field(pattern=STEP_ID)
    when: Check | None = None  # the precondition applies only when this holds
    check: Check
    message: str = ""  # templated over params and facts; shown when the check fails
    on_fail: Literal["refuse", "nothing_to_do"] = "refuse"


class Verify(_Model):
    check: Check
    timeout: Duration = "60s"


class Rollback(_Model):
    KEY: ClassVar[str] = "rollback"
    rollback: tuple[Action, ...] = Field(min_length=1)


def _on_failure_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "stop"
    return _single_key(value)


OnFailure = Annotated[
    Annotated[Literal["stop"], Tag("stop")] | Annotated[Rollback, Tag("rollback")],
    Discriminator(_on_failure_tag),
]


class Step(_Model):
    id: str = Field(pattern=STEP_ID, max_length=63)
    why: str = ""
    action: Action
    requires: tuple[str, ...] = ()
    guards: tuple[Check, ...] = ()
    skip_if: tuple[Check, ...] = ()
    verify: tuple[Verify, ...] = ()
    on_failure: OnFailure = "stop"
    idempotent: bool = True
    approval: bool = False

    @property
    def mutating(self) -> bool:
        return is_mutating(self.action)

    @property
    def rollback_actions(self) -> tuple[KubeAction | AnsibleAction | CheckAction, ...]:
        return self.on_failure.rollback if isinstance(self.on_failure, Rollback) else ()


class PagerDutyMatch(_Model):
    service: str | None = None
    title_pattern: str | None = None  # regex; named groups become params


class Trigger(_Model):
    """The alerts that may start this runbook (``runbook serve``, issue 7)."""

    alert: str | tuple[str, ...] = ""  # Alertmanager alertname(s)
    matchers: tuple[str, ...] = ()  # Alertmanager matcher syntax: 'node=~"omen.*"'
    params: dict[str, str] = Field(default_factory=dict)  # templated over the alert's labels
    mode: Literal["auto", "approve"] = "approve"
    pagerduty: PagerDutyMatch | None = None
    description: str = ""
    # Fire only when the runbook's declared diagnosis matches the node (read-only facts first); a
    # page for a node sick for another cause ends blocked with the evidence and changes nothing.
    require_diagnosis: bool = False


class DiagnosisCause(_Model):
    """The cause a runbook addresses: a stable id (``swap``) and a one-line title."""

    id: str = Field(pattern=STEP_ID, max_length=63)
    title: str = Field(min_length=1)


class Evidence(_Model):
    """One piece of evidence for (or, under ``excludes``, against) a cause: a check over the facts.

    ``required`` evidence must hold for the cause to match; ``supporting`` evidence only raises the
    confidence. ``says`` is what the evidence shows when it holds (rendered in the diagnosis)."""

    id: str = Field(pattern=STEP_ID, max_length=63)
    check: Check
    weight: Literal["required", "supporting"] = "required"
    says: str = ""


class DiagnosisSpec(_Model):
    """What a runbook declares it fixes: the cause, the evidence that identifies it, what rules it out.

    ``params``: extra params of the suggested command (``-p k=v``), templated over params and facts;
    the node param is always filled with the diagnosed node."""

    cause: DiagnosisCause
    evidence: tuple[Evidence, ...] = Field(min_length=1)
    excludes: tuple[Evidence, ...] = ()
    params: dict[str, str] = Field(default_factory=dict)


class Runbook(_Model):
    api_version: Literal["runbook/v1"] = Field(alias="apiVersion")
    name: str = Field(pattern=DNS_LABEL, max_length=63)
    version: str = Field(min_length=1)
    description: str = ""
    params: dict[str, Param] = Field(default_factory=dict)
    approval: bool = False  # pause for approval before the first mutating step
    preconditions: tuple[Precondition, ...] = ()
    steps: tuple[Step, ...] = Field(min_length=1)
    report: str | None = None
    triggers: tuple[Trigger, ...] = ()
    diagnosis: DiagnosisSpec | None = None

    @field_validator("params")
    @classmethod
    def _param_names(cls, v: dict[str, Param]) -> dict[str, Param]:
        for k in v:
            if not re.fullmatch(PARAM_NAME, k):
                raise ValueError(f"param name {k!r} must match {PARAM_NAME}")
        return v

    @property
    def node_param(self) -> str | None:
        """The param naming the run's target node: ``node`` if declared, else the first node param."""
        if "node" in self.params and self.params["node"].type == "node":
            return "node"
        return next((k for k, p in self.params.items() if p.type == "node"), None)

    def step(self, step_id: str) -> Step:
        for s in self.steps:
            if s.id == step_id:
                return s
        raise KeyError(step_id)


# --------------------------------------------------------------------------------------------
# Run-time values
# --------------------------------------------------------------------------------------------


class RunState(enum.StrEnum):
    PENDING = "pending"
    WAITING_APPROVAL = "waiting-approval"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    BLOCKED = "blocked"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"


class StepStatus(enum.StrEnum):
    SUCCEEDED = "succeeded"
    SKIPPED = "skipped"
    FAILED = "failed"
    TIMED_OUT = "timed-out"
    BLOCKED = "blocked"
    ROLLED_BACK = "rolled-back"
    CANCELLED = "cancelled"


class PlanState(enum.StrEnum):
    READY = "ready"  # at least one step will change something
    NOTHING_TO_DO = "nothing-to-do"  # every step is a no-op
    BLOCKED = "blocked"  # a precondition fails or a step would be blocked


class CheckEvaluation(_Model):
    """A check as planning saw it: its text, whether it held, what was observed."""

    check: str
    holds: bool | None
    observed: str = ""


class PreconditionResult(_Model):
    id: str
    applies: bool
    holds: bool | None
    observed: str = ""
    message: str = ""  # rendered; set when the precondition does not hold
    on_fail: Literal["refuse", "nothing_to_do"] = "refuse"
    evidence: dict[str, Any] = Field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.applies or self.holds is True


class Change(_Model):
    """One before -> after difference an action will make (``node.labels[k]: a -> b``)."""

    path: str
    before: Any = None
    after: Any = None


class PlannedVerify(_Model):
    check: str
    timeout_seconds: float


class PlannedStep(_Model):
    id: str
    why: str = ""
    kind: Literal["change", "no-op", "blocked"]
    action: Literal["kube", "ansible", "check"]
    summary: str  # "label ... vm-passthrough -> container" / "no-op: ..." / "blocked: ..."
    reason: str = ""  # why no-op or blocked
    command: str = ""  # the equivalent kubectl / ansible-playbook command line
    changes: tuple[Change, ...] = ()
    requires: tuple[str, ...] = ()
    guards: tuple[CheckEvaluation, ...] = ()
    skip_if: tuple[CheckEvaluation, ...] = ()
    verify: tuple[PlannedVerify, ...] = ()
    preview: str = ""  # diff text: Ansible --check --diff, or server-side dry-run result
    idempotent: bool = True
    approval: bool = False
    mutating: bool = False


def canonical_json(data: Any) -> bytes:
    """Stable bytes for digests: sorted keys, no whitespace, UTF-8."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str).encode("utf-8")


class Plan(_Model):
    """What a run will do to one node now: a reviewable, serialisable value with a digest."""

    format: Literal["runbook-plan/v1"] = "runbook-plan/v1"
    runbook: str
    version: str
    runbook_digest: str  # sha256 of the runbook file's bytes
    params: dict[str, ParamValue]
    node: str
    inventory_host: str = ""
    created_at: str  # ISO 8601, UTC
    expires_at: str
    state: PlanState
    approval: bool = False
    preconditions: tuple[PreconditionResult, ...] = ()
    steps: tuple[PlannedStep, ...] = ()
    depends_on: dict[str, Any] = Field(default_factory=dict)  # fact path -> value a decision read
    # The gathered facts (node, host) in the shape of ``facts``, kept when the runbook reads ``baseline``:
    # verifications compare with them at run time ("no host CUDA job killed"). {} otherwise.
    baseline: dict[str, Any] = Field(default_factory=dict)
    probe_errors: tuple[str, ...] = ()
    digest: str = ""  # sha256 of the canonical JSON of everything above

    def compute_digest(self) -> str:
        return hashlib.sha256(canonical_json(self.model_dump(mode="json", exclude={"digest"}))).hexdigest()

    def sealed(self) -> Plan:
        """This plan with its digest set."""
        return self.model_copy(update={"digest": self.compute_digest()})

    @property
    def exit_code(self) -> int:
        return 3 if self.state is PlanState.BLOCKED else 0

    @property
    def blocked_reasons(self) -> list[str]:
        out = [f"precondition {p.id}: {p.message or p.observed}" for p in self.preconditions
               if not p.passed and p.on_fail == "refuse"]
        out += [f"precondition {p.id}: could not be evaluated: {p.observed}" for p in self.preconditions
                if p.applies and p.holds is None and p.on_fail == "nothing_to_do"]
        out += [f"step {s.id}: {s.reason}" for s in self.steps if s.kind == "blocked"]
        return out

    def step(self, step_id: str) -> PlannedStep:
        for s in self.steps:
            if s.id == step_id:
                return s
        raise KeyError(step_id)


class StepOutcome(_Model):
    step: str
    status: StepStatus
    reason: str = ""
    attempts: int = 0
    started_at: float = 0.0  # epoch seconds
    finished_at: float = 0.0
    evidence: dict[str, Any] = Field(default_factory=dict)


class RunResult(_Model):
    state: RunState
    exit_code: int
    runbook: str = ""
    node: str = ""
    plan_digest: str = ""
    outcomes: tuple[StepOutcome, ...] = ()
    report: str = ""
    reason: str = ""  # one line: why the run ended as it did
