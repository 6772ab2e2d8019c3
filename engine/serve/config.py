"""``runbook serve`` configuration: a YAML file plus environment variables, as one frozen value.

Precedence: built-in defaults < ``--config FILE`` < command-line options < environment. The environment carries the
secrets (``RUNBOOK_WEBHOOK_TOKEN``, ``RUNBOOK_PAGERDUTY_SECRET``) so they need not sit in a file;
``RUNBOOK_NOTIFY_URL`` and ``RUNBOOK_SERVE_FORCE_MODE`` are accepted too. Every default is
documented in ``docs/serve.md`` (keep both in step). Errors are ``UsageError`` naming the file and
the key. This module reads files and the environment; it never starts anything.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.errors import UsageError
from engine.model import parse_duration
from engine.run_guards import (
    EXCLUDE_LABEL,
    KURED_LOCK_ANNOTATION,
    MEDIK8S_EXCLUDE_LABEL,
    ExclusionConfig,
    GuardConfig,
    KuredConfig,
)
from engine.serve.alertmanager import format_validation_error

__all__ = ["EXCLUDE_LABEL", "KURED_LOCK_ANNOTATION", "MEDIK8S_EXCLUDE_LABEL", "ExclusionConfig",
           "GuardConfig", "KuredConfig", "ServeConfig", "load_config", "split_listen"]


def _seconds(value: Any) -> Any:
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return parse_duration(value)
    return value


Seconds = Annotated[float, BeforeValidator(_seconds), Field(ge=0)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class DedupConfig(_Section):
    fingerprint_window: Seconds = 3600.0  # same alert fingerprint / incident id: nothing new for 1h
    node_cooldown: Seconds = 900.0  # after a run on a node ended: nothing new on that node for 15m
    webhook_id_window: Seconds = 86400.0  # PagerDuty X-Webhook-Id replays remembered for 24h


class BreakerConfig(_Section):
    max_auto_runs: int = Field(default=3, ge=0)  # automatic runs per runbook per window
    window: Seconds = 3600.0
    max_unhealthy_nodes: int = Field(default=2, ge=0)  # more Ready!=True nodes than this: no auto run
    max_unhealthy_gpus: int = Field(default=8, ge=0)  # more GPUs on such nodes than this: no auto run
    max_pending_approvals: int = Field(default=10, ge=0)  # approve-mode runs waiting at once
    state_file: Path | None = None  # where node-breaker resets are kept (default: memory only)


class NotifyConfig(_Section):
    url: str | None = None  # generic webhook; the JSON has Slack's "text" key
    timeout: Seconds = 5.0
    events: tuple[Literal["started", "waiting-approval", "finished", "failed", "blocked"], ...] = (
        "started", "waiting-approval", "finished", "failed", "blocked")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^https?://[^\s/]+", v):
            raise ValueError("notify.url must be an http(s) URL")
        return v


class PagerDutyMapping(_Section):
    """An incident whose service and title match starts ``runbook``; named groups become params."""

    service: str | None = None  # service id (PXXXXXX) or name (its ``summary``); any when omitted
    title_pattern: str  # Python regex, searched in the incident title; e.g. "Node (?P<node>[a-z0-9.-]+) NotReady"
    runbook: str
    params: dict[str, str | int | bool] = Field(default_factory=dict)  # fixed params, merged under the groups
    mode: Literal["auto", "approve"] = "approve"

    @field_validator("title_pattern")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from e
        return v


class PagerDutyConfig(_Section):
    secrets: tuple[str, ...] = ()  # env RUNBOOK_PAGERDUTY_SECRET adds one; several during rotation
    event_types: tuple[str, ...] = ("incident.triggered",)
    mappings: tuple[PagerDutyMapping, ...] = ()


class ServeConfig(_Section):
    listen: str = "127.0.0.1:8080"
    webhook_token: str | None = Field(default=None, repr=False)  # env RUNBOOK_WEBHOOK_TOKEN
    protect_reads: bool = False  # true: GET /runs, /runs/{id}, /breaker, /triggers need the token too
    force_mode: Literal["approve"] | None = None  # "approve": no automatic run at all
    mode_overrides: dict[str, Literal["auto", "approve"]] = Field(default_factory=dict)  # runbook -> mode
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    workers: int = Field(default=2, ge=1, le=64)
    queue_size: int = Field(default=50, ge=0, le=10000)
    cluster_cache_ttl: Seconds = 5.0
    shutdown_grace: Seconds = 30.0
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    exclusions: ExclusionConfig = Field(default_factory=ExclusionConfig)
    guards: GuardConfig | None = None  # the run guards (engine.run_guards); exclusions above when unset
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    pagerduty: PagerDutyConfig = Field(default_factory=PagerDutyConfig)

    @field_validator("listen")
    @classmethod
    def _host_port(cls, v: str) -> str:
        split_listen(v)
        return v

    @model_validator(mode="after")
    def _one_exclusion_source(self) -> ServeConfig:
        if self.guards is not None and "exclusions" in self.model_fields_set:
            raise ValueError("give the exclusion labels and kured's lock in guards: (labels, kured), "
                             "not in exclusions: as well")
        return self

    def run_guards(self) -> GuardConfig:
        """The guards every run of this server obeys: ``guards:``, else the defaults with the
        ``exclusions:`` section's labels and kured settings."""
        if self.guards is not None:
            return self.guards
        return GuardConfig(labels=dict(self.exclusions.labels), kured=self.exclusions.kured)

    def mode_for(self, runbook: str, declared: Literal["auto", "approve"]) -> Literal["auto", "approve"]:
        """The runbook's mode, after the per-runbook override and the forced mode."""
        if self.force_mode == "approve":
            return "approve"
        return self.mode_overrides.get(runbook, declared)


def split_listen(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:8080"`` / ``"[::1]:8080"`` -> (host, port); ValueError when malformed."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"listen must be HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env.get("RUNBOOK_WEBHOOK_TOKEN"):
        out["webhook_token"] = env["RUNBOOK_WEBHOOK_TOKEN"]
    if env.get("RUNBOOK_SERVE_FORCE_MODE"):
        out["force_mode"] = env["RUNBOOK_SERVE_FORCE_MODE"]
    return out


def load_config(path: Path | str | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> ServeConfig:
    """Defaults < YAML file < ``overrides`` (CLI options) < environment -> ``ServeConfig``.

    The environment only carries secrets, the notification URL and the forced mode; a PagerDuty
    secret from the environment is added to those of the file (rotation)."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    where = str(path) if path else "(environment)"
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except OSError as e:
            raise UsageError(f"{path}: cannot read the serve configuration: {e.strerror}") from e
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            raise UsageError(f"{path}{line}: invalid YAML: {getattr(e, 'problem', e)}") from e
        if raw is not None and not isinstance(raw, dict):
            raise UsageError(f"{path}: the serve configuration must be a mapping")
        data = dict(raw or {})
    data.update(overrides or {})
    data.update(_from_env(env))
    notify_url = env.get("RUNBOOK_NOTIFY_URL")
    if notify_url:
        data["notify"] = {**dict(data.get("notify") or {}), "url": notify_url}
    pd_secret = env.get("RUNBOOK_PAGERDUTY_SECRET")
    if pd_secret:
        pd = dict(data.get("pagerduty") or {})
        pd["secrets"] = (pd_secret, *tuple(pd.get("secrets") or ()))
        data["pagerduty"] = pd
    try:
        return ServeConfig.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"{where}: invalid serve configuration: {format_validation_error(e, limit=10)}") from e
