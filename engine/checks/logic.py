"""Check kinds that combine checks or compute over every fact: ``all``, ``any``, ``not``, ``expr``.

Combinators use Kleene logic: ``all`` is False if any part is False, else None if any part is
unknown; ``any`` is True if any part is True, else None if any is unknown; ``not None`` is None.
``expr`` is a Jinja2 expression over params, facts and the baseline, truthy = holds; it is
evaluated, never rendered, and never predicted. Pure: no I/O.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from engine.checkkind import HOST, NODE, Check, CheckKind, CheckResult, Env, Probe, Reads, register_check, result
from engine.checks.core import establish, evaluate
from engine.facts import Facts
from engine.templating import TemplateError, context, evaluate_expression


def _combine(parts: list[CheckResult], holds: bool | None) -> CheckResult:
    reads: dict[str, object] = {}
    for p in parts:
        reads.update(p.reads)
    observed = "; ".join(p.observed for p in parts)
    return CheckResult(holds, observed, {"parts": [{"holds": p.holds, "observed": p.observed} for p in parts]},
                       reads)


@register_check
class ExprCheck(CheckKind):
    KEY: ClassVar[str] = "expr"
    READS: ClassVar[Reads] = "logic"
    RENDERED: ClassVar[bool] = False  # an expression is evaluated, not rendered
    expr: str = Field(min_length=1)  # a Jinja2 expression (no braces), truthy = holds

    def describe(self) -> str:
        return f"expr {self.expr}"

    def probes(self, env: Env) -> set[Probe]:
        """The node and/or host facts, as the expression names them (both when it says neither)."""
        src = self.expr
        out: set[Probe] = set()
        if "facts" in src:
            wants_node = "node" in src
            wants_host = "host" in src
            if wants_node or not wants_host:
                out.add(NODE)
            if wants_host or not wants_node:
                out.add(HOST)
        return out

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        try:
            value = evaluate_expression(self.expr, context(env.params, facts, env.baseline))
        except TemplateError as e:
            return CheckResult(None, str(e), {"error": str(e)})
        holds = bool(value)
        return result(holds, f"{self.expr} -> {value!r}"[:300], {f"expr[{self.expr}]": holds})


@register_check
class AllCheck(CheckKind):
    KEY: ClassVar[str] = "all"
    READS: ClassVar[Reads] = "logic"
    all_: tuple[Check, ...] = Field(alias="all", min_length=1)

    def describe(self) -> str:
        return "all(" + "; ".join(x.describe() for x in self.all_) + ")"

    def parts(self) -> tuple[CheckKind, ...]:
        return self.all_

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        parts = [evaluate(x, facts, env.params, baseline=env.baseline) for x in self.all_]
        values = [p.holds for p in parts]
        return _combine(parts, False if False in values else (None if None in values else True))

    def establish(self, facts: Facts, env: Env) -> Facts:
        for part in self.all_:
            facts = establish(part, facts, env.params, baseline=env.baseline)
        return facts


@register_check
class AnyCheck(CheckKind):
    KEY: ClassVar[str] = "any"
    READS: ClassVar[Reads] = "logic"
    any_: tuple[Check, ...] = Field(alias="any", min_length=1)

    def describe(self) -> str:
        return "any(" + "; ".join(x.describe() for x in self.any_) + ")"

    def parts(self) -> tuple[CheckKind, ...]:
        return self.any_

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        parts = [evaluate(x, facts, env.params, baseline=env.baseline) for x in self.any_]
        values = [p.holds for p in parts]
        return _combine(parts, True if True in values else (None if None in values else False))


@register_check
class NotCheck(CheckKind):
    KEY: ClassVar[str] = "not"
    READS: ClassVar[Reads] = "logic"
    not_: Check = Field(alias="not")

    def describe(self) -> str:
        return f"not({self.not_.describe()})"

    def parts(self) -> tuple[CheckKind, ...]:
        return (self.not_,)

    def evaluate(self, facts: Facts, env: Env) -> CheckResult:
        r = evaluate(self.not_, facts, env.params, baseline=env.baseline)
        holds = None if r.holds is None else not r.holds
        return CheckResult(holds, f"not ({r.observed})", r.evidence, r.reads)
