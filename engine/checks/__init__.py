"""Checks: the kinds a runbook may use, and what every caller does with a check.

* ``engine.checkkind`` (the bottom floor): the ``CheckKind`` base, the registry, the ``Check`` type
  the format uses, ``CheckResult`` and the probe keys;
* ``engine.checks.core``: bind, describe, evaluate, establish, required probes (any kind);
* the kinds, one class each, grouped by the facts they read: ``node`` (the node object),
  ``objects`` (listed Kubernetes objects), ``host`` (the node host's facts), ``logic``
  (combinators and ``expr``). Importing this package registers them; ``runbook schema`` lists
  them group by group in that order.

To add a kind: a class in the group's module (or a new module imported below) decorated with
``@register_check`` (docs/design.md, "How to add a check"). Nothing here performs I/O.
"""

from __future__ import annotations

from engine.checkkind import (
    HOST,
    NODE,
    Check,
    CheckKind,
    CheckResult,
    Env,
    HostFile,
    ObjectsQuery,
    Probe,
    check_keys,
    check_kinds,
    iter_checks,
    register_check,
    unregister_check,
)
from engine.checks.core import (
    bind,
    describe,
    describe_bound,
    establish,
    evaluate,
    has_template,
    required_probes,
    template_probes,
    uses_baseline,
)
from engine.checks.host import (
    CudaProcessesCheck,
    CudaProcessesSpec,
    FileCheck,
    FileSpec,
    FstabActiveSwapCheck,
    GpuDriverCheck,
    HostCheck,
    JournalContainsCheck,
    JournalSpec,
    ServiceCheck,
    ServiceSpec,
    SwapActiveCheck,
)
from engine.checks.logic import AllCheck, AnyCheck, ExprCheck, NotCheck
from engine.checks.node import (
    AllocatableCheck,
    AllocatableSpec,
    NodeCheck,
    NodeConditionCheck,
    NodeConditionSpec,
    NodeExistsCheck,
    NodeLabelCheck,
    NodeLabelSpec,
    NodeReadyCheck,
    NodeTaintCheck,
    NodeTaintSpec,
)
from engine.checks.objects import ObjectsCheck, ObjectsSpec, field_value
from engine.resources import asks_for, object_resources, parse_quantity

__all__ = [
    "HOST", "NODE", "AllCheck", "AllocatableCheck", "AllocatableSpec", "AnyCheck", "Check", "CheckKind",
    "CheckResult", "CudaProcessesCheck", "CudaProcessesSpec", "Env", "ExprCheck", "FileCheck", "FileSpec",
    "FstabActiveSwapCheck", "GpuDriverCheck", "HostCheck", "HostFile", "JournalContainsCheck", "JournalSpec",
    "NodeCheck", "NodeConditionCheck", "NodeConditionSpec", "NodeExistsCheck", "NodeLabelCheck", "NodeLabelSpec",
    "NodeReadyCheck", "NodeTaintCheck", "NodeTaintSpec", "NotCheck", "ObjectsCheck", "ObjectsQuery",
    "ObjectsSpec", "Probe", "ServiceCheck", "ServiceSpec", "SwapActiveCheck", "asks_for", "bind",
    "check_keys", "check_kinds", "describe", "describe_bound", "establish", "evaluate", "field_value",
    "has_template", "iter_checks", "object_resources", "parse_quantity", "register_check",
    "required_probes", "template_probes", "unregister_check", "uses_baseline",
]
