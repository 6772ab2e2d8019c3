"""The check-kind extension point of the runbook format: the base class, the registry, ``Check``.

A check kind is one pydantic model class deriving from ``CheckKind``: its single key (``KEY``,
``{node_ready: true}``), the facts it reads (``READS``: node, host, objects or logic), and the
methods every caller needs (``describe``, ``evaluate``, ``establish``, ``probes``, ``parts``).
``register_check`` adds a kind; ``Check`` (the type the format uses wherever a check may appear)
validates ``{key: spec}`` against the registered kinds *at validation time* and ``runbook schema``
lists them at generation time, so a kind registered anywhere (a test module too) is part of the
format without editing this module or ``engine.model``.

The built-in kinds live in ``engine.checks`` (one module per group of facts); importing that
package registers them. This module sits at the bottom of the engine's floors (next to the model
and the facts): it must not import ``engine.checks``, templating or any connector, and it holds no
check-specific logic.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticKnownError, core_schema

from engine.facts import Facts

NODE = "node"
HOST = "host"

Reads = Literal["node", "host", "objects", "logic"]


@dataclass(frozen=True)
class ObjectsQuery:
    """One list call: ``list_objects(api_version, plural, namespace=, label_selector=)``."""

    api_version: str
    plural: str
    namespace: str | None = None
    selector: str | None = None

    @property
    def key(self) -> str:
        """The key of its results in ``Facts.objects``."""
        out = f"{self.api_version}/{self.plural}"
        if self.namespace:
            out += f"?namespace={self.namespace}"
        if self.selector:
            out += ("&" if self.namespace else "?") + f"selector={self.selector}"
        return out

    @classmethod
    def from_key(cls, key: str) -> ObjectsQuery | None:
        """The query behind a ``Facts.objects`` key (``kubevirt.io/v1/virtualmachines?namespace=x``)."""
        path, _, query = key.partition("?")
        api_version, _, plural = path.rpartition("/")
        if not api_version or not plural:
            return None
        args: dict[str, str] = {}
        for part in query.split("&") if query else ():
            k, sep, v = part.partition("=")
            if not sep or k not in ("namespace", "selector"):
                return None
            args[k] = v
        q = cls(api_version, plural, args.get("namespace") or None, args.get("selector") or None)
        return q if q.key == key else None


@dataclass(frozen=True)
class HostFile:
    """A file the host probe must report on (passed to the facts playbook as ``runbook_files``)."""

    path: str


Probe = str | ObjectsQuery | HostFile  # NODE, HOST, an objects query, or a host file (implies HOST)


@dataclass(frozen=True)
class CheckResult:
    holds: bool | None
    observed: str
    evidence: Mapping[str, Any] = field(default_factory=dict)
    reads: Mapping[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Fail closed: only a definite True passes."""
        return self.holds is True


@dataclass(frozen=True)
class Env:
    """What an evaluation may read besides the facts: the run's params and the plan's baseline."""

    params: Mapping[str, Any] = field(default_factory=dict)
    baseline: Mapping[str, Any] | None = None


class FormatModel(BaseModel):
    """Base of every runbook-format model: frozen, unknown keys forbidden (a typo is a located error)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)


def probe_error(facts: Facts, probe: str) -> str:
    """Why a probe's facts are missing: its recorded error, or "not gathered"."""
    for e in facts.errors:
        if e.probe == probe or e.probe.startswith(probe + ":"):
            return e.message
    return "not gathered"


def unknown(what: str, facts: Facts, probe: str) -> CheckResult:
    """The result of a check whose facts are missing: unknown, with the probe's error."""
    msg = probe_error(facts, probe)
    return CheckResult(None, f"{what} unknown: {msg}", {"error": msg, "probe": probe})


def result(holds: bool, observed: str, reads: Mapping[str, Any] | None = None, **evidence: Any) -> CheckResult:
    return CheckResult(holds, observed, dict(evidence), dict(reads or {}))


class CheckKind(FormatModel):
    """One check kind. Subclasses declare ``KEY``, ``READS`` and one field named ``KEY`` (the spec).

    Methods receive the check *bound* (templates rendered by ``engine.checks.bind``); ``evaluate``
    may raise on malformed facts (the caller turns that into an unknown result: fail closed).
    """

    KEY: ClassVar[str]
    READS: ClassVar[Reads]
    RENDERED: ClassVar[bool] = True  # its templated strings are rendered before use (``expr``: no)

    def describe(self) -> str:
        """A short human text: ``label nvidia.com/gpu.workload.config = container``."""
        return self.KEY

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        """Whether the check holds in ``facts``: True, False, or None (unknown)."""
        raise NotImplementedError(f"check kind {self.KEY!r} does not evaluate")

    def establish(self, facts: Facts, env: Env) -> Facts:
        """The facts as they will be once the check holds; the facts unchanged where unknowable."""
        return facts

    def probes(self, env: Env) -> set[Probe]:
        """The probes evaluating this check needs (by default those of its ``READS`` group)."""
        if self.READS == "node":
            return {NODE}
        if self.READS == "host":
            return {HOST}
        return set()

    def parts(self) -> tuple[CheckKind, ...]:
        """The checks nested in this one (combinators)."""
        return ()

    def uses_baseline(self) -> bool:
        """Whether the check itself compares with the plan's baseline (not counting templates)."""
        return False


# --------------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------------

GROUPS: tuple[Reads, ...] = ("node", "objects", "host", "logic")


_KINDS: dict[str, type[CheckKind]] = {}

K = TypeVar("K", bound=type[CheckKind])


def register_check(kind: K) -> K:
    """Make ``kind`` part of the runbook format (a class decorator). Its key must be new."""
    key = kind.KEY
    if key in _KINDS and _KINDS[key] is not kind:
        raise ValueError(f"check kind {key!r} is already registered ({_KINDS[key].__qualname__})")
    if getattr(kind, "READS", None) not in GROUPS:
        raise ValueError(f"check kind {kind.__qualname__} needs READS, one of {', '.join(GROUPS)}")
    fields = kind.__pydantic_fields__
    if key not in fields and not any(f.alias == key for f in fields.values()):
        raise ValueError(f"check kind {kind.__qualname__} needs a field named {key!r} (its spec)")
    _KINDS[key] = kind
    return kind


def unregister_check(key: str) -> None:
    """Remove a kind (tests that register their own kinds clean up with this)."""
    _KINDS.pop(key, None)


def check_kinds() -> tuple[type[CheckKind], ...]:
    """The registered kinds by group (node, objects, host, logic), each group in registration order:
    the order of the JSON Schema's ``oneOf`` and of "one of: ..." hints."""
    return tuple(sorted(_KINDS.values(), key=lambda k: GROUPS.index(k.READS)))


def check_keys() -> tuple[str, ...]:
    return tuple(k.KEY for k in check_kinds())


def iter_checks(check: CheckKind) -> Iterator[CheckKind]:
    """The check and every check nested in it."""
    yield check
    for part in check.parts():
        yield from iter_checks(part)


def _validate_check(value: Any) -> CheckKind:
    if isinstance(value, CheckKind):
        return value
    if not isinstance(value, Mapping) or len(value) != 1:  # as a union tagged by its single key
        raise PydanticKnownError("union_tag_not_found", {"discriminator": "_single_key()"})
    key = next(iter(value))
    kind = _KINDS.get(key) if isinstance(key, str) else None
    if kind is None:
        raise PydanticKnownError("union_tag_invalid", {
            "discriminator": "_single_key()", "tag": str(key),
            "expected_tags": ", ".join(repr(k) for k in check_keys())})
    return kind.model_validate(value)  # its ValidationError's locations join the caller's


class _CheckType:
    """The pydantic type of ``Check``: dispatch on the single key to the registered kind."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(_validate_check)

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: core_schema.CoreSchema,
                                     handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """``{"oneOf": [$ref of each kind]}``. A kind whose definition is being generated (``all``
        nests checks) is referred to, not generated again (no endless recursion)."""
        busy = _GENERATING.get()
        kinds = check_kinds()
        choices: list[core_schema.CoreSchema | tuple[core_schema.CoreSchema, str]] = [
            _ref_schema(kind) if kind in busy else kind.__pydantic_core_schema__ for kind in kinds]
        token = _GENERATING.set(busy | set(kinds))
        try:
            # A union's members are generated as definitions (``$defs``) and referred to by ``$ref``.
            js = handler(core_schema.union_schema(choices))
        finally:
            _GENERATING.reset(token)
        return {"oneOf": js["anyOf"]} if "anyOf" in js else {"oneOf": [js]}


_GENERATING: ContextVar[frozenset[type[CheckKind]]] = ContextVar("check_schema_generating", default=frozenset())


def _ref_schema(kind: type[CheckKind]) -> core_schema.CoreSchema:
    """A reference to the kind's definition (its core schema's ``ref``)."""
    schema: Any = kind.__pydantic_core_schema__
    ref = schema.get("ref") or (schema.get("schema") or {}).get("schema_ref")
    if not ref:
        return kind.__pydantic_core_schema__
    return core_schema.definition_reference_schema(ref)


# A check in a runbook: any registered kind, ``{key: spec}``.
Check = Annotated[CheckKind, _CheckType()]
