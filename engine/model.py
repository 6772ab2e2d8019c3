"""The runbook format and the run-time values, as frozen pydantic models.

Two families live here:

* the **format** (``Runbook`` and everything under it) that ``engine.loader`` builds from YAML;
  every model forbids unknown keys, so a typo is a located load error rather than a silent no-op;
* the **values** a run produces (``Plan``, ``StepOutcome``, ``RunResult``, the state enums), which
  are serialisable (``model_dump_json``) so plans can be saved, compared and approved by digest.

No I/O and no Jinja here: templates are plain strings until ``engine.templating`` renders them.
Checks, actions and kube verbs are unions discriminated by their single key (``{node_ready: true}``),
which is also how the JSON Schema for editors (``runbook schema``) describes them. The check kinds
(``engine.checkkind``) and the kube verbs (``KubeVerbSpec``, defined in ``engine.kube_verbs``) are
registries read at validation time: this module names none of them.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    Tag,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticKnownError, core_schema

from engine.checkkind import Check, FormatModel
from engine.windows import Window

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


_Model = FormatModel


def _single_key(value: Any) -> str | None:
    """Discriminator of ``{key: spec}`` unions: the one key, or the model's ``KEY``."""
    if isinstance(value, Mapping):
        return next(iter(value)) if len(value) == 1 else None
    return getattr(value, "KEY", None)


# --------------------------------------------------------------------------------------------
# Checks: ``Check`` is any kind registered in ``engine.checkkind`` (the built-in kinds are in
# ``engine.checks``, one class each); the format does not enumerate them.
# --------------------------------------------------------------------------------------------

# --------------------------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------------------------

# -- kube verbs: a runbook's ``kube: {VERB: spec}`` ------------------------------------------------
# A verb is one module in ``engine/kube_verbs/``: its spec class (a ``KubeVerbSpec``, its ``KEY`` the
# runbook key) and its ``decide``, whose ``@decides(Spec)`` registers the spec here (``kube_verb``).
# ``KubeVerb`` validates ``{key: spec}`` against the registered verbs *at validation time* and
# ``runbook schema`` lists them at generation time (as ``Check`` does for the check kinds), so this
# module names no verb and never imports ``engine.kube_verbs``.
class KubeVerbSpec(_Model):
    """The base of a kube verb's spec: ``KEY`` is the runbook key (``kube: {KEY: spec}``) and the name
    of its one field (the spec). The class variables say what callers must know without naming it."""

    KEY: ClassVar[str]
    # Where the verb stands in the format's lists (the schema's ``oneOf``, the loader's "one of:"
    # hint): by ``ORDER``, then ``KEY``. The verbs of the first format keep their places (10, 20, ...);
    # a new verb may leave the default and comes after them.
    ORDER: ClassVar[int] = 1000
    # True: the verb's apply proves its own effect (drain: no evictable pod left; the bootstrap
    # token verbs): a step with it needs no ``verify`` (loader)
    SELF_VERIFYING: ClassVar[bool] = False
    # False: the verb changes nothing (``wait``): its step is not "mutating" (no verify, no approval)
    MUTATING: ClassVar[bool] = True
    # False: the verb decides without the node's facts (``wait``): planning and execution neither read
    # the node nor need a Kubernetes connection to decide it
    READS_NODE: ClassVar[bool] = True
    # True: ``rollback: auto`` restores what the verb changed from the run's recorded changes (node
    # labels, annotations, unschedulable; engine.rollback)
    AUTO_INVERSE: ClassVar[bool] = False


_KUBE_VERBS: dict[str, type[KubeVerbSpec]] = {}
V = TypeVar("V", bound=type[KubeVerbSpec])


def kube_verb(spec: V) -> V:
    """Make ``spec`` a kube verb of the format (``engine.kube_verbs.effects.decides`` calls this for
    the specs it decides; usable as a class decorator). Its ``KEY`` must be new."""
    key = getattr(spec, "KEY", None)
    if not key or (key in _KUBE_VERBS and _KUBE_VERBS[key] is not spec):
        raise ValueError(f"kube verb {spec.__qualname__}: KEY {key!r} missing or already registered")
    if not issubclass(spec, KubeVerbSpec):
        raise ValueError(f"kube verb {spec.__qualname__} must derive from KubeVerbSpec")
    fields = spec.__pydantic_fields__
    if key not in fields and not any(f.alias == key for f in fields.values()):
        raise ValueError(f"kube verb {spec.__qualname__} needs a field named {key!r} (its spec)")
    _KUBE_VERBS[key] = spec
    return spec


def unregister_kube_verb(key: str) -> None:
    """Remove a verb (tests that register their own verbs clean up with this)."""
    _KUBE_VERBS.pop(key, None)


def kube_verbs() -> tuple[type[KubeVerbSpec], ...]:
    """The registered verbs by ``ORDER``, then ``KEY``: the order of the schema and the hints."""
    return tuple(sorted(_KUBE_VERBS.values(), key=lambda v: (v.ORDER, v.KEY)))


def kube_verb_keys() -> tuple[str, ...]:
    """The runbook keys of the registered verbs (``label``, ``unlabel``, ...)."""
    return tuple(v.KEY for v in kube_verbs())


def auto_inverse_verbs() -> tuple[str, ...]:
    """The verbs ``rollback: auto`` can undo (``AUTO_INVERSE``)."""
    return tuple(v.KEY for v in kube_verbs() if v.AUTO_INVERSE)


def _validate_kube_verb(value: Any) -> KubeVerbSpec:
    if isinstance(value, KubeVerbSpec):
        return value
    key = _single_key(value)
    if key is None:  # as a union tagged by its single key
        raise PydanticKnownError("union_tag_not_found", {"discriminator": "_single_key()"})
    spec = _KUBE_VERBS.get(key) if isinstance(key, str) else None
    if spec is None:
        raise PydanticKnownError("union_tag_invalid", {
            "discriminator": "_single_key()", "tag": str(key),
            "expected_tags": ", ".join(repr(k) for k in kube_verb_keys())})
    return spec.model_validate(value)  # its ValidationError's locations join the caller's


class _KubeVerbType:
    """The pydantic type of ``KubeVerb``: dispatch on the single key to the registered verb."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(_validate_kube_verb)

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """``{"oneOf": [$ref of each verb]}``: a union's members are generated as definitions."""
        js = handler(core_schema.union_schema([v.__pydantic_core_schema__ for v in kube_verbs()]))
        return {"oneOf": js["anyOf"]} if "anyOf" in js else {"oneOf": [js]}


# A kube verb in a runbook: any registered verb, ``{key: spec}``.
KubeVerb = Annotated[KubeVerbSpec, _KubeVerbType()]


class AnsibleSpec(_Model):
    playbook: str = Field(min_length=1)  # relative to the playbooks dir
    become: bool = True
    vars: dict[str, Any] = Field(default_factory=dict)
    timeout: Duration = "300s"
    # How a plan previews the step: True, run the playbook with --check --diff; "facts", the
    # engine's model of the playbook says what it would change from the plan's host facts (no
    # Ansible run; engine.playbook_previews, shipped playbooks only); False, no preview.
    preview: bool | Literal["facts"] = True

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
    """Kube verbs other than ``wait`` (``MUTATING``) and every playbook run change something."""
    if isinstance(action, KubeAction):
        return action.kube.MUTATING
    return isinstance(action, AnsibleAction)


def action_kind(action: KubeAction | AnsibleAction | CheckAction) -> Literal["kube", "ansible", "check"]:
    return action.KEY  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Params, preconditions, steps, triggers, runbook
# --------------------------------------------------------------------------------------------

ParamValue = str | int | bool

# Why fullmatch everywhere: ``$`` also matches before a trailing newline, so ``re.match(r"^...$")``
# let ``omen2\n`` through as a node name.
_NODE_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
# Printable text without shell, quoting or template metacharacters; a param that needs more
# declares its own `pattern`.
_SAFE_STRING = re.compile(r"[A-Za-z0-9 _.,:/@+=%#-]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_MAX_STRING = 1024
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def is_node_name(value: str) -> bool:
    """An RFC 1123 subdomain: lowercase, <= 253 characters, dot-separated labels of <= 63."""
    if not value or len(value) > 253:
        return False
    return all(len(part) <= 63 and _NODE_LABEL.fullmatch(part) for part in value.split("."))


def control_character(value: str) -> str | None:
    """Where ``value`` holds a control character (or a lone surrogate): ``"U+000A at position 5"``."""
    m = _CONTROL.search(value)
    return None if m is None else f"U+{ord(m.group()):04X} at position {m.start()}"


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
            self.coerce("default", self.default)
        return self

    def coerce(self, name: str, value: Any) -> ParamValue:
        """One value (a CLI string or a typed value from YAML/JSON) -> this param's type, or ValueError."""
        kind = self.type
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
                return value.strip().lower() in _TRUE
            raise ValueError(f"param {name}: expected true or false, got {value!r}")
        if kind == "int":
            if isinstance(value, bool):
                raise ValueError(f"param {name}: expected an integer, got {value!r}")
            if isinstance(value, int):
                n = value
            elif isinstance(value, str) and re.fullmatch(r"[-+]?\d{1,18}", value.strip()):
                n = int(value.strip())
            else:
                raise ValueError(f"param {name}: expected an integer, got {value!r}")
            if self.min is not None and n < self.min:
                raise ValueError(f"param {name}: {n} is less than the minimum {self.min}")
            if self.max is not None and n > self.max:
                raise ValueError(f"param {name}: {n} is more than the maximum {self.max}")
            return n
        if not isinstance(value, str):
            raise ValueError(f"param {name}: expected a string, got {value!r}")
        bad = control_character(value)
        if bad is not None:  # Why: a newline or escape in a param reaches logs, Ansible limits and API paths
            raise ValueError(f"param {name}: {value[:80]!r} contains a control character ({bad})")
        if kind == "enum":
            assert self.values is not None
            if value not in self.values:
                raise ValueError(f"param {name}: {value!r} is not one of {', '.join(self.values)}")
            return value
        if kind == "node":
            if not is_node_name(value):
                raise ValueError(f"param {name}: {value!r} is not a valid node name "
                                 "(RFC 1123: lowercase letters, digits, '-' and '.', at most 253 characters)")
        elif len(value) > _MAX_STRING:
            raise ValueError(f"param {name}: longer than {_MAX_STRING} characters")
        if self.pattern is not None:
            if not re.fullmatch(self.pattern, value):
                raise ValueError(f"param {name}: {value!r} does not match {self.pattern}")
        elif kind == "string" and not _SAFE_STRING.fullmatch(value):
            raise ValueError(f"param {name}: {value!r} contains characters a string param without a "
                             "'pattern' does not accept (quotes, shell or template metacharacters)")
        return value


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
    """``on_failure: {rollback: [actions]}`` (the step's own rollback), or ``{rollback: all}``: after
    the step's failure, roll back the whole run (every step's declared inverse, newest first)."""

    KEY: ClassVar[str] = "rollback"
    rollback: tuple[Action, ...] | Literal["all"]

    @field_validator("rollback")
    @classmethod
    def _some(cls, v: tuple[Action, ...] | str) -> tuple[Action, ...] | str:
        if not v:
            raise ValueError("give at least one rollback action, or `all`")
        return v


class Inverse(_Model):
    """A step's declared inverse (whole-run rollback, ``runbook rollback RUN_ID``): one action, the
    guards that must hold to take it now (else the rollback is refused with the reason), and its
    verification."""

    action: Action | None = None
    auto: bool = False  # the kube verb's own inverse (as ``rollback: auto``), under these guards
    why: str = ""
    guards: tuple[Check, ...] = ()
    verify: tuple[Verify, ...] = ()

    @model_validator(mode="after")
    def _one(self) -> Inverse:
        if (self.action is None) == (not self.auto):
            raise ValueError("give the inverse's action, or auto: true (not both)")
        return self


class NoInverse(_Model):
    """``rollback: {none: WHY}``: the step cannot or must not be undone, and why."""

    none: str = Field(min_length=1)


# ``auto``: the kube verb's own inverse (``AUTO_INVERSE``: label/unlabel/annotate restore the values the
# run found; cordon <-> uncordon), from the changes its run recorded. ``none``: no inverse (say why in a
# comment, or use ``{none: why}``).
StepRollback = Literal["auto", "none"] | NoInverse | Inverse


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
    rollback: StepRollback | None = None  # the inverse for a whole-run rollback (engine.rollback)

    @model_validator(mode="after")
    def _auto_inverse(self) -> Step:
        auto = self.rollback == "auto" or (isinstance(self.rollback, Inverse) and self.rollback.auto)
        if auto and not (isinstance(self.action, KubeAction) and self.action.kube.AUTO_INVERSE):
            raise ValueError(f"rollback: auto is the inverse of the kube verbs {', '.join(auto_inverse_verbs())}; "
                             "declare the inverse action ({action: ..., verify: [...]}) or {none: why}")
        return self

    @property
    def mutating(self) -> bool:
        return is_mutating(self.action)

    @property
    def rollback_actions(self) -> tuple[KubeAction | AnsibleAction | CheckAction, ...]:
        if isinstance(self.on_failure, Rollback) and not isinstance(self.on_failure.rollback, str):
            return self.on_failure.rollback
        return ()

    @property
    def rollback_all(self) -> bool:
        """``on_failure: {rollback: all}``: a failure of this step rolls the whole run back."""
        return isinstance(self.on_failure, Rollback) and self.on_failure.rollback == "all"

    def describe_rollback(self) -> str:
        """What the plan shows as this step's inverse."""
        if self.rollback is None:
            return "no inverse declared" if self.mutating else ""
        if self.rollback == "auto" or (isinstance(self.rollback, Inverse) and self.rollback.auto):
            guards = len(self.rollback.guards) if isinstance(self.rollback, Inverse) else 0
            return "auto: restore what the step changed" + (f" (under {guards} guard(s))" if guards else "")
        if self.rollback == "none":
            return "none"
        if isinstance(self.rollback, NoInverse):
            return f"none: {self.rollback.none}"
        a = self.rollback.action
        assert a is not None
        what = f"playbook {a.ansible.playbook}" if isinstance(a, AnsibleAction) else \
            f"kube {a.kube.KEY}" if isinstance(a, KubeAction) else "check"
        return f"{what}{': ' + self.rollback.why if self.rollback.why else ''}"


class PagerDutyMatch(_Model):
    service: str | None = None
    title_pattern: str | None = None  # regex; named groups become params
    # with notify.pagerduty_rest: the incident is resolved when the run succeeded (else left open)
    resolve_incident: bool = False


class NodeConditionMatch(_Model):
    """A Node condition that pages by itself (``runbook serve``, no Prometheus needed), as NodeHealthCheck's
    ``unhealthyConditions`` read it: ``type`` with one of ``status`` for at least ``for``."""

    type: str = Field(min_length=1, max_length=316)
    status: tuple[Literal["True", "False", "Unknown"], ...] = Field(min_length=1)
    for_: Duration = Field(alias="for")

    @field_validator("status", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    def seconds(self) -> float:
        return parse_duration(self.for_)


class Trigger(_Model):
    """The alerts that may start this runbook (``runbook serve``, issue 7), or Node conditions."""

    alert: str | tuple[str, ...] = ""  # Alertmanager alertname(s)
    matchers: tuple[str, ...] = ()  # Alertmanager matcher syntax: 'node=~"omen.*"'
    params: dict[str, str] = Field(default_factory=dict)  # templated over the alert's labels
    mode: Literal["auto", "approve"] = "approve"
    pagerduty: PagerDutyMatch | None = None
    # Node conditions watched by the server itself (any of them pages), on the nodes whose labels
    # include every one of ``node_selector`` (empty: every node).
    node_conditions: tuple[NodeConditionMatch, ...] = ()
    node_selector: dict[str, str] = Field(default_factory=dict)
    description: str = ""
    # Fire only when the runbook's declared diagnosis matches the node (read-only facts first); a
    # page for a node sick for another cause ends blocked with the evidence and changes nothing.
    require_diagnosis: bool = False
    # The trigger's own maintenance windows (as the runbook's ``windows``): its automatic runs
    # start only inside them (and inside the runbook's).
    windows: tuple[Window, ...] = ()


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


class DiagnosisNote(_Model):
    """Something an operator must know about a sick node whatever the diagnosis (a risk of the fix,
    a source the runbook will not handle): said by ``runbook diagnose`` whenever ``when`` holds on
    the node's facts. ``says`` is templated over params and facts."""

    id: str = Field(pattern=STEP_ID, max_length=63)
    when: Check
    says: str = Field(min_length=1)


class DiagnosisSpec(_Model):
    """What a runbook declares it fixes: the cause, the evidence that identifies it, what rules it out.

    ``params``: extra params of the suggested command (``-p k=v``), templated over params and facts;
    the node param is always filled with the diagnosed node. ``notes``: what ``runbook diagnose``
    says about a sick node when their condition holds (the domain knowledge of this runbook's
    cause lives here, not in the code)."""

    cause: DiagnosisCause
    evidence: tuple[Evidence, ...] = Field(min_length=1)
    excludes: tuple[Evidence, ...] = ()
    params: dict[str, str] = Field(default_factory=dict)
    notes: tuple[DiagnosisNote, ...] = ()


class Fleet(_Model):
    """What ``runbook diagnose`` knows about the fleet beyond the runbooks' diagnoses, as data
    (``runbooks/catalogue/fleet.yaml``): the labels and resources that say what a GPU node is and
    serves, and what to tell an operator about them. The causes themselves are the runbooks'."""

    workload_label: str = Field(min_length=1)  # the GPU Operator's workload label
    container_workload: str = "container"  # its value for "serves GPUs to containers"
    passthrough_workload: str = "vm-passthrough"  # its value for "serves GPUs to VMs"
    gpu_resource: str = "nvidia.com/gpu"  # what the device plugin advertises under container
    gpu_resource_prefix: str = "nvidia.com/"  # every GPU resource (sandbox plugins: the PCI names)
    gpu_labels: tuple[str, ...] = ()  # labels GPU Feature Discovery keeps while it runs
    gpu_labels_gone: str = ""  # what their absence means (said in the chain)
    gpu_label_prefixes: tuple[str, ...] = ()  # labels shown in the evidence
    # ``diagnose --all`` also examines Ready nodes with one of these labels: a GPU fault (an Xid, a
    # pending remap, the fabric manager) does not make a node NotReady.
    gpu_node_labels: tuple[str, ...] = ()
    # Said about a healthy node whose GPU VMs wait for it while it serves containers; {vms},
    # {resources} and {node} are filled in.
    waiting_vms_note: str = ""


class RunbookOnFailure(_Model):
    """``on_failure: {escalate: [RUNBOOK, ...]}``: when a run of this runbook fails (an action or a
    verification, never a blocked step), the named runbooks (each with the same node param) are
    tried in order, each planned, guarded, approved per its own mode and verified (engine.escalation)."""

    escalate: tuple[str, ...] = Field(min_length=1)

    @field_validator("escalate")
    @classmethod
    def _names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if not re.fullmatch(DNS_LABEL, name):
                raise ValueError(f"escalate: {name!r} is not a runbook name")
        if len(set(v)) != len(v):
            raise ValueError("escalate names a runbook twice")
        return v


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
    # More causes this runbook fixes, each declared like ``diagnosis`` (gpu-reset: Xid 48, Xid 95, a
    # pending row remap): ``runbook diagnose`` names each by its own cause id.
    diagnoses: tuple[DiagnosisSpec, ...] = ()
    # Maintenance windows (engine.windows): outside them an automatic run is deferred until the
    # next opening (or refused, ``outside_windows: refuse``); a person's run needs
    # ``--override-guard window --reason``.
    windows: tuple[Window, ...] = ()
    outside_windows: Literal["defer", "refuse"] = "defer"
    on_failure: RunbookOnFailure | None = None  # escalation when a run fails (engine.escalation)

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

    @property
    def all_diagnoses(self) -> tuple[DiagnosisSpec, ...]:
        """``diagnosis`` then ``diagnoses``: every cause this runbook declares it fixes."""
        return ((self.diagnosis,) if self.diagnosis is not None else ()) + self.diagnoses

    def step(self, step_id: str) -> Step:
        for s in self.steps:
            if s.id == step_id:
                return s
        raise KeyError(step_id)


# --------------------------------------------------------------------------------------------
# Run-time values
# --------------------------------------------------------------------------------------------


class RunState(enum.StrEnum):
    """A run's state, the one vocabulary of every store, front end and report. It knows what it
    means (as httpx's status codes do): ``is_active`` (someone runs it or will: pending, waiting
    for approval, running), ``is_final`` (it ended and stays so: succeeded, failed, blocked,
    cancelled), ``is_resumable`` (it stopped half-way and a person or a server may continue it:
    interrupted). Every state is exactly one of the three. A new state is one member here plus its
    line in ``_MEANING``; the stores, the CRD's phases and the groups follow."""

    PENDING = "pending"
    WAITING_APPROVAL = "waiting-approval"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    BLOCKED = "blocked"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"

    @property
    def is_active(self) -> bool:
        return _MEANING[self][0] == "active"

    @property
    def is_final(self) -> bool:
        return _MEANING[self][0] == "final"

    @property
    def is_resumable(self) -> bool:
        return _MEANING[self][0] == "resumable"

    @property
    def phase(self) -> str:
        """The phase a RemediationRun shows (``kubectl get rr``, ``runbook runs``' PHASE column)."""
        return _MEANING[self][1]


# state -> (what it means, the RemediationRun phase)
_MEANING: dict[RunState, tuple[Literal["active", "final", "resumable"], str]] = {
    RunState.PENDING: ("active", "Pending"),
    RunState.WAITING_APPROVAL: ("active", "WaitingApproval"),
    RunState.RUNNING: ("active", "Running"),
    RunState.SUCCEEDED: ("final", "Succeeded"),
    RunState.FAILED: ("final", "Failed"),
    RunState.BLOCKED: ("final", "Blocked"),
    RunState.CANCELLED: ("final", "Cancelled"),
    RunState.INTERRUPTED: ("resumable", "Interrupted"),
}


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
    rollback: str = ""  # the step's declared inverse, as a whole-run rollback would take it


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
