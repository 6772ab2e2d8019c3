"""Verb ``wait``: wait until a condition (a check) holds, at most ``timeout``; or the old fixed pause.

``wait: {until: {node_ready: true}, timeout: 5m}`` is waited for as a verify check is (a watch for
node checks, polling for host and object checks: the executor's ``wait_until``); not holding by the
timeout fails the step with the last observation. ``wait: {seconds: N}`` keeps its old meaning (a
pause, cut short by cancellation). Nothing is changed either way, so a wait is never "mutating".
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from engine.checkkind import Check, FormatModel
from engine.errors import ActionFailed
from engine.facts import NodeFacts
from engine.kube_verbs.effects import EffectFailed, KubeContext, Wait, applies, decides, previews
from engine.model import Duration, KubeVerbSpec, parse_duration

DEFAULT_TIMEOUT = "300s"


class WaitSpec(FormatModel):
    """``wait: {until: <check>, timeout: 5m}`` waits for a condition (watched or polled as a verify
    check is); the old ``wait: {seconds: N}`` is a fixed pause."""

    seconds: float | None = Field(default=None, gt=0, le=3600)
    until: Check | None = None
    timeout: Duration | None = None  # with until; 300s when omitted

    @model_validator(mode="after")
    def _one_form(self) -> WaitSpec:
        if (self.seconds is None) == (self.until is None):
            raise ValueError("wait takes either 'until' (a check, with an optional 'timeout') or 'seconds'")
        if self.seconds is not None and self.timeout is not None:
            raise ValueError("'timeout' goes with 'until'; 'seconds' is a fixed pause")
        return self


class KubeWait(KubeVerbSpec):
    KEY: ClassVar[str] = "wait"
    ORDER: ClassVar[int] = 110
    MUTATING: ClassVar[bool] = False  # a wait changes nothing
    READS_NODE: ClassVar[bool] = False  # it decides from its spec alone
    wait: WaitSpec


@decides(KubeWait)
def decide(verb: KubeWait, node: NodeFacts) -> Wait:
    w = verb.wait
    if w.seconds is not None:
        return Wait("wait", f"wait {w.seconds:g}s", f"sleep {w.seconds:g}", seconds=w.seconds)
    from engine.checks import describe

    assert w.until is not None  # WaitSpec holds exactly one of seconds / until
    timeout = parse_duration(w.timeout or DEFAULT_TIMEOUT)
    text = describe(w.until)
    return Wait("wait", f"wait up to {timeout:g}s until {text}",
                f"# wait up to {timeout:g}s until {text}", until=w.until, timeout=timeout)


@applies(Wait)
def apply(effect: Wait, ctx: KubeContext) -> dict[str, Any]:
    if effect.seconds is not None:
        deadline = ctx.clock() + effect.seconds
        while not ctx.cancel.is_set() and (left := deadline - ctx.clock()) > 0:
            ctx.sleep(min(left, 1.0))
        return {}
    if ctx.wait_until is None:
        raise ActionFailed("wait: no way to evaluate checks here")
    holds, observed, evidence = ctx.wait_until(effect.until, effect.timeout)
    if not holds:
        raise EffectFailed(f"{effect.summary}: not by the timeout: {observed}", {"observed": observed, **evidence})
    return {"observed": observed}


@previews(Wait)
def preview(effect: Wait, ctx: KubeContext) -> str:
    return ""
