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

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine import secrecy
from engine.approval_policy import ApprovalConfig
from engine.configfile import read_mapping
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
from engine.secrecy import Secret, secret_values
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


class RetentionConfig(_Section):
    """What the leader prunes at each sweep (``RunStore.prune``): finished runs only."""

    keep: int = Field(default=1000, ge=1)  # the newest finished runs kept
    max_age: Seconds | None = 30 * 86400.0  # finished longer ago than this: pruned (null: by count only)


class RemediatorConfig(_Section):
    """``RunbookRemediation`` objects (NodeHealthCheck / MachineHealthCheck external remediation),
    reconciled by the leader (``engine.serve.remediator``, docs/remediator.md)."""

    enabled: bool = False  # the deploy base turns it on
    interval: Seconds = Field(default=5.0, gt=0)  # seconds between two passes over the objects
    namespaces: tuple[str, ...] = ()  # where to look (empty: every namespace)


class ReplicasConfig(_Section):
    """Leader election among replicas sharing a store (``--store kubernetes``)."""

    lease_duration: int = Field(default=15, ge=2, le=600)  # seconds; renewed at 1/3, lost at 2/3


def _check_http_url(v: str | None, key: str) -> str | None:
    if v is not None and not re.match(r"^https?://[^\s/]+", v):
        raise ValueError(f"{key} must be an http(s) URL")
    return v


class PagerDutyEventsConfig(_Section):
    """``notify.pagerduty``: PagerDuty Events API v2 (``engine.serve.pagerduty_events``)."""

    routing_key: Secret = Field(min_length=1, max_length=64, repr=False)  # env RUNBOOK_PAGERDUTY_ROUTING_KEY
    url: str = "https://events.pagerduty.com/v2/enqueue"
    source: str = Field(default="runbook", min_length=1, max_length=255)  # when the run has no node
    severity: Literal["critical", "error", "warning", "info"] = "critical"
    acknowledge_on_start: bool = False  # acknowledge the page's incident when the run starts
    dedup_key: Literal["alertmanager-group", "alert"] = "alertmanager-group"

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return _check_http_url(v, "notify.pagerduty.url") or v


# Secret-bearing settings of the on-call targets, declared once (never logged, never in a repr;
# refused blank or short at start): the project's ``Secret`` type (masked in the JSON logs by it).
OncallSecret = Annotated[Secret, Field(min_length=1, max_length=4096, repr=False)]
ONCALL_SECRETS: dict[str, str] = {  # config key -> environment variable
    "notify.pagerduty_rest.token": "RUNBOOK_PAGERDUTY_API_TOKEN",
    "notify.pagerduty_rest.from_email": "RUNBOOK_PAGERDUTY_FROM",
    "notify.slack.bot_token": "RUNBOOK_SLACK_BOT_TOKEN",
    "notify.slack.signing_secret": "RUNBOOK_SLACK_SIGNING_SECRET",
}
_NOT_TOKENS = frozenset({"notify.pagerduty_rest.from_email"})  # secret, but an address: no length rule


class RetryConfig(_Section):
    """``notify.retry``: how a notification request is retried (``engine.serve.delivery``)."""

    attempts: int = Field(default=5, ge=1, le=20)  # tries per request, the first included
    backoff: Seconds = 1.0  # before the first retry; doubled each time
    max_backoff: Seconds = 60.0
    max_retry_after: Seconds = 300.0  # a longer Retry-After (429) is cut to this


class PagerDutyRestConfig(_Section):
    """``notify.pagerduty_rest``: notes on, acknowledge and resolve of the incident that paged
    (PagerDuty REST API v2; ``engine.serve.pagerduty_rest``)."""

    token: OncallSecret  # a REST API key; env RUNBOOK_PAGERDUTY_API_TOKEN
    from_email: OncallSecret  # the From header: a PagerDuty user's e-mail; env RUNBOOK_PAGERDUTY_FROM
    url: str = "https://api.pagerduty.com"
    acknowledge: bool = True  # acknowledge the incident when its run starts executing

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return _check_http_url(v, "notify.pagerduty_rest.url") or v

    @field_validator("from_email")
    @classmethod
    def _email(cls, v: str) -> str:
        if not re.match(r"^[^@\s]+@[^@\s]+$", v):
            raise ValueError("must be the e-mail address of a PagerDuty user")
        return v


class SlackConfig(_Section):
    """``notify.slack``: the Slack app that posts interactive approval messages
    (``engine.serve.slack``) and whose clicks ``POST /hooks/slack`` receives."""

    bot_token: OncallSecret  # xoxb-...; env RUNBOOK_SLACK_BOT_TOKEN
    signing_secret: OncallSecret  # the app's signing secret; env RUNBOOK_SLACK_SIGNING_SECRET
    channel: str = Field(min_length=1, max_length=80)  # channel id (C0123ABCD) the messages go to
    api_url: str = "https://slack.com/api"
    users: dict[str, str] = Field(default_factory=dict)  # Slack user id -> approver name
    events: tuple[Literal["started", "waiting-approval", "finished", "failed", "blocked"], ...] = (
        "started", "waiting-approval", "finished", "failed", "blocked")
    max_age: Seconds = 300.0  # a click signed longer ago than this is refused (Slack: 5 minutes)

    @field_validator("api_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        return _check_http_url(v, "notify.slack.api_url") or v

    @field_validator("users")
    @classmethod
    def _users(cls, v: dict[str, str]) -> dict[str, str]:
        for user, name in v.items():
            if not re.match(r"^[UW][A-Z0-9]{2,30}$", user):
                raise ValueError(f"{user!r} is not a Slack user id (U0123ABCD)")
            if not _IDENTITY.match(name):
                raise ValueError(f"approver name {name!r} must be a short name (letters, digits, . _ @ + -)")
        return v


class AlertmanagerConfig(_Section):
    """``alertmanager``: the Alertmanager whose routing the server checks at start."""

    url: str | None = None  # e.g. http://127.0.0.1:9093 (GET /api/v2/status); null: not checked

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return _check_http_url(v, "alertmanager.url")


class NotifyConfig(_Section):
    url: Secret | None = Field(default=None, repr=False)  # generic webhook (a Slack URL is a credential)
    timeout: Seconds = 5.0
    events: tuple[Literal["started", "waiting-approval", "step", "finished", "failed", "blocked"], ...] = (
        "started", "waiting-approval", "finished", "failed", "blocked")
    secret: Secret | None = Field(default=None, repr=False)  # signs webhook POSTs; env RUNBOOK_NOTIFY_SECRET
    pagerduty: PagerDutyEventsConfig | None = None
    pagerduty_rest: PagerDutyRestConfig | None = None
    slack: SlackConfig | None = None
    retry: RetryConfig = Field(default_factory=RetryConfig)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return _check_http_url(v, "notify.url")


class PagerDutyMapping(_Section):
    """An incident whose service and title match starts ``runbook``; named groups become params."""

    service: str | None = None  # service id (PXXXXXX) or name (its ``summary``); any when omitted
    title_pattern: str  # Python regex, searched in the incident title; e.g. "Node (?P<node>[a-z0-9.-]+) NotReady"
    runbook: str
    params: dict[str, str | int | bool] = Field(default_factory=dict)  # fixed params, merged under the groups
    mode: Literal["auto", "approve"] = "approve"
    resolve_incident: bool = False  # with notify.pagerduty_rest: resolve the incident when the run succeeded

    @field_validator("title_pattern")
    @classmethod
    def _regex(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from e
        return v


class PagerDutyConfig(_Section):
    secrets: tuple[Secret, ...] = Field(default=(), repr=False)  # env RUNBOOK_PAGERDUTY_SECRET adds one
    event_types: tuple[str, ...] = ("incident.triggered",)
    mappings: tuple[PagerDutyMapping, ...] = ()
    max_age: Seconds = 300.0  # a signed occurred_at older than this (plus clock_skew) is refused
    clock_skew: Seconds = 60.0  # tolerated difference between PagerDuty's clock and ours (both ways)


_IDENTITY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,99}$")
MIN_SECRET_BYTES = 16


class KubeAuthConfig(_Section):
    """``auth.mode: kubernetes``: bearer tokens checked by TokenReview, roles from RBAC on
    ``remediationruns.runbook.io`` in ``namespace`` (``engine.serve.kube_identity``)."""

    namespace: str | None = None  # must be the store namespace when given (--store-namespace); default: it
    cache_seconds: Seconds = 10.0  # answers are reused this long per token (a revoked binding: within this)
    # TokenReview audiences: a token must have been made for one of them (kubectl create token --audience runbook)
    audiences: tuple[Annotated[str, Field(min_length=1, max_length=253)], ...] = Field(
        default=("runbook",), min_length=1, max_length=10)
    # true: tokens made for the API server itself are accepted too (the review names no audience)
    api_server_audience: bool = False
    max_concurrent_reviews: int = Field(default=4, ge=1, le=64)  # TokenReviews in flight at once (own threads)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", v):
            raise ValueError(f"namespace {v!r} is not a Kubernetes namespace name")
        return v


class AuthConfig(_Section):
    """Who may do what. Each credential is a bearer token bound to one identity and one role.

    * ``senders``: may POST ``/hooks/alertmanager`` (nothing else);
    * ``approvers``: may approve runs (recorded under their name), reset breakers, and read;
    * ``readers``: may read ``/runs``, ``/runs/{id}``, ``/breaker``, ``/triggers``, ``/metrics``.

    PagerDuty's credential is its signing secret (``pagerduty.secrets``).

    ``mode: kubernetes``: approvers and readers are not listed here; any other bearer token is
    checked with the Kubernetes API (TokenReview) and its role comes from RBAC (``kubernetes``)."""

    mode: Literal["tokens", "kubernetes"] = "tokens"
    kubernetes: KubeAuthConfig = Field(default_factory=KubeAuthConfig)

    senders: dict[str, Secret] = Field(default_factory=dict, repr=False)
    approvers: dict[str, Secret] = Field(default_factory=dict, repr=False)
    readers: dict[str, Secret] = Field(default_factory=dict, repr=False)
    reads: Literal["auto", "open", "token"] = "auto"  # auto: open when bound to loopback, else token
    allowed_hosts: tuple[str, ...] = ()  # Host names besides the bound address (and loopback names)
    requester_cannot_approve: bool = True  # the identity that requested a run cannot approve it
    # unknown credentials per client address (console logins, bearer tokens on /runs, approvals...)
    # before its next ones are refused (429) unchecked; refills at this rate
    failures_per_minute: int = Field(default=10, ge=1, le=10000)
    insecure_no_auth: bool = False  # only from --insecure-no-auth: no credential at all (loopback only)

    @field_validator("senders", "approvers", "readers")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not _IDENTITY.match(name):
                raise ValueError(f"identity {name!r} must be a short name (letters, digits, . _ @ + -)")
        return v

    @model_validator(mode="after")
    def _one_source_of_roles(self) -> AuthConfig:
        if self.mode == "kubernetes" and (self.approvers or self.readers):
            names = ", ".join([f"approvers.{n}" for n in self.approvers] + [f"readers.{n}" for n in self.readers])
            raise ValueError(f"mode kubernetes takes approvers and readers from Kubernetes RBAC (verb approve, or "
                             f"get and list, on remediationruns.runbook.io); remove {names} (or their "
                             "RUNBOOK_APPROVER_TOKEN_* / RUNBOOK_READER_TOKEN_* variables)")
        return self


class LimitsConfig(_Section):
    """Bounds on what one request (or one sender) can make the server hold or write."""

    body_timeout: Seconds = 10.0  # a body must arrive within this; else 408 and the connection closes
    header_timeout: Seconds = 10.0  # a connection must send its request headers within this
    keep_alive: Seconds = 5.0  # idle keep-alive connections are closed after this
    max_connections: int = Field(default=1000, ge=8)  # uvicorn limit_concurrency: beyond, 503
    max_body_reads: int = Field(default=64, ge=1)  # bodies being received at once; beyond: 503
    buffered_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024)  # request bytes held at once
    max_alerts: int = Field(default=1000, ge=1)  # alerts considered per delivery; the rest: refused
    max_labels: int = Field(default=64, ge=1)  # labels (and annotations) per alert; more: 400
    max_value_bytes: int = Field(default=1024, ge=64)  # longer label/annotation values are truncated
    max_reason_bytes: int = Field(default=2048, ge=256)  # reasons recorded with runs and notifications
    max_dedup_entries: int = Field(default=20000, ge=100)  # fingerprints/refusals/webhook ids kept


class ConsoleConfig(_Section):
    """The web console's sessions and live streams (``engine.serve.console``)."""

    session_seconds: Seconds = Field(default=8 * 3600.0, gt=0)  # absolute: a session ends this long after login
    idle_seconds: Seconds = Field(default=1800.0, gt=0)  # a session unused this long ends
    max_sessions: int = Field(default=1000, ge=1)  # in total; a login beyond (none expired or idle) is refused 503
    max_sessions_per_identity: int = Field(default=10, ge=1)  # beyond: that identity's oldest session ends
    max_streams: int = Field(default=50, ge=1)  # live run streams in total; beyond: 503
    max_streams_per_session: int = Field(default=8, ge=1)  # beyond: 429
    max_streams_per_client: int = Field(default=16, ge=1)  # per client address; beyond: 429
    # journal/store reads per second shared by every followed run (one watcher per run, whatever
    # the number of viewers): with n runs followed each is read every max(0.1 s, n / this) seconds
    live_reads_per_second: float = Field(default=20.0, gt=0, le=1000)
    # a followed run is read at most this often (None: 0.1 s with the SQLite store; 1 s with
    # --store kubernetes, where each read is an API request)
    live_poll_seconds: Seconds | None = None
    max_upload_parts: int = Field(default=10, ge=2, le=100)  # parts of a plan upload; more: 400, reading stops


class ServeConfig(_Section):
    listen: str = "127.0.0.1:8080"
    # Where people reach this server (e.g. https://runbook.example.org): notifications link the run's
    # console page, {public_url}/ui/runs/{id}, and the console's cookies are Secure when it is https.
    public_url: str | None = None
    webhook_token: Secret | None = Field(default=None, repr=False)  # = auth.senders.alertmanager
    protect_reads: bool = False  # true: = auth.reads: token
    force_mode: Literal["approve"] | None = None  # "approve": no automatic run at all
    mode_overrides: dict[str, Literal["auto", "approve"]] = Field(default_factory=dict)  # runbook -> mode
    max_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    workers: int = Field(default=2, ge=1, le=64)
    queue_size: int = Field(default=50, ge=0, le=10000)
    cluster_cache_ttl: Seconds = 5.0
    # The cluster snapshot is re-read in the background this often, so a page waits on no API round
    # trip (None: half of cluster_cache_ttl; 0: only when a page finds it older than the TTL).
    cluster_refresh: Seconds | None = None
    shutdown_grace: Seconds = 30.0
    deferred_poll: Seconds = 30.0  # how often a run deferred to its maintenance window asks again
    # uvicorn's line per HTTP request. Off by default, as gunicorn's: a storm of duplicate pages would
    # write thousands of lines a second (~17 % of the webhook's CPU); requests are counted per
    # endpoint and outcome in /metrics, and every run's story is in the journal and run events.
    access_log: bool = False
    dedup: DedupConfig = Field(default_factory=DedupConfig)
    breaker: BreakerConfig = Field(default_factory=BreakerConfig)
    exclusions: ExclusionConfig = Field(default_factory=ExclusionConfig)
    guards: GuardConfig | None = None  # the run guards (engine.run_guards); exclusions above when unset
    approvals: ApprovalConfig = Field(default_factory=ApprovalConfig)  # who may approve (engine.approval_policy)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    pagerduty: PagerDutyConfig = Field(default_factory=PagerDutyConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    console: ConsoleConfig = Field(default_factory=ConsoleConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    alertmanager: AlertmanagerConfig = Field(default_factory=AlertmanagerConfig)
    remediator: RemediatorConfig = Field(default_factory=RemediatorConfig)
    # How often the leader reads the nodes for runbook triggers with node_conditions
    # (engine.serve.node_conditions); only when such a trigger exists.
    node_conditions_interval: Seconds = Field(default=10.0, gt=0)

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, v: str | None) -> str | None:
        return _check_http_url(v, "public_url")

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
        if self.cluster_refresh and self.cluster_refresh >= self.cluster_cache_ttl:
            raise ValueError(f"cluster_refresh ({self.cluster_refresh:g}s) must be shorter than cluster_cache_ttl "
                             f"({self.cluster_cache_ttl:g}s), or the snapshot expires between two refreshes")
        return self

    def run_guards(self) -> GuardConfig:
        """The guards every run of this server obeys: ``guards:``, else the defaults with the
        ``exclusions:`` section's labels and kured settings."""
        if self.guards is not None:
            return self.guards
        return GuardConfig(labels=dict(self.exclusions.labels), kured=self.exclusions.kured)

    def with_compat(self) -> ServeConfig:
        """Fold the older keys into ``auth``: ``webhook_token`` is the sender ``alertmanager``'s token,
        ``protect_reads: true`` is ``auth.reads: token``."""
        auth = self.auth
        if self.webhook_token and "alertmanager" not in auth.senders:
            auth = auth.model_copy(update={"senders": {"alertmanager": self.webhook_token, **auth.senders}})
        if self.protect_reads and auth.reads == "auto":
            auth = auth.model_copy(update={"reads": "token"})
        return self if auth is self.auth else self.model_copy(update={"auth": auth})

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


_ROLE_ENV = {"RUNBOOK_SENDER_TOKEN_": "senders", "RUNBOOK_APPROVER_TOKEN_": "approvers",
             "RUNBOOK_READER_TOKEN_": "readers"}


def _from_env(env: Mapping[str, str], data: dict[str, Any], where: dict[str, str]) -> None:
    """Secrets and the forced mode from the environment into ``data``; ``where`` maps each secret's
    config key to the variable it came from (errors name the variable, never the value)."""
    if "RUNBOOK_WEBHOOK_TOKEN" in env:  # Why "in": a blank value is an error, not "unset"
        data["webhook_token"] = env["RUNBOOK_WEBHOOK_TOKEN"]
        where["webhook_token"] = "RUNBOOK_WEBHOOK_TOKEN"
    if env.get("RUNBOOK_SERVE_FORCE_MODE"):
        data["force_mode"] = env["RUNBOOK_SERVE_FORCE_MODE"]
    for var in sorted(env):
        for prefix, role in _ROLE_ENV.items():
            if var.startswith(prefix) and len(var) > len(prefix):
                name = var[len(prefix):].lower().replace("_", "-")
                auth = dict(data.get("auth") or {})
                auth[role] = {**dict(auth.get(role) or {}), name: env[var]}
                data["auth"] = auth
                where[f"auth.{role}.{name}"] = var


def check_secrets(data: Mapping[str, Any], where: Mapping[str, str], origin: str) -> None:
    """Refuse blank, whitespace-only and short (< 16 bytes) tokens and secrets, and one token given to
    two identities (a sender's token must never approve). Errors name the key, never the value."""
    found: list[tuple[str, Any]] = []
    if "webhook_token" in data:
        found.append(("webhook_token", data["webhook_token"]))
    auth = data.get("auth")
    if isinstance(auth, Mapping):
        for role in ("senders", "approvers", "readers"):
            creds = auth.get(role)
            if isinstance(creds, Mapping):
                found += [(f"auth.{role}.{name}", value) for name, value in creds.items()]
    notify = data.get("notify")
    if isinstance(notify, Mapping) and notify.get("secret") is not None:
        found.append(("notify.secret", notify["secret"]))
    if isinstance(notify, Mapping):
        for key in ONCALL_SECRETS:
            _, section, name = key.split(".")
            block = notify.get(section)
            if isinstance(block, Mapping) and name in block:
                found.append((key, block[name]))
    pd = data.get("pagerduty")
    if isinstance(pd, Mapping) and isinstance(pd.get("secrets"), list | tuple):
        found += [(f"pagerduty.secrets[{i}]", v) for i, v in enumerate(pd["secrets"])]
    owners: dict[str, str] = {}
    for key, value in found:
        named = where.get(key, f"{origin}: {key}")
        if value is None and key == "webhook_token":
            continue
        if not isinstance(value, str):
            raise UsageError(f"{named}: must be a string")
        if not value.strip():
            raise UsageError(f"{named}: is blank; a blank secret is an error, not 'unset'")
        if value != value.strip():
            raise UsageError(f"{named}: has leading or trailing whitespace")
        if key in _NOT_TOKENS:
            continue
        if len(value.encode("utf-8")) < MIN_SECRET_BYTES:
            raise UsageError(f"{named}: is shorter than {MIN_SECRET_BYTES} bytes; use a random secret "
                             "(e.g. `openssl rand -hex 24`)")
        # Why notify.secret too: a receiver holding it must not hold a token
        if not key.startswith(("pagerduty.", "notify.pagerduty_rest.", "notify.slack.")):
            other = owners.get(value)
            if other is not None and other != key and {other, key} != {"webhook_token", "auth.senders.alertmanager"}:
                raise UsageError(f"{named}: the same token is also given to {where.get(other, other)}; "
                                 "every identity needs its own")
            owners[value] = key


def load_config(path: Path | str | None = None, *, env: Mapping[str, str] | None = None,
                overrides: Mapping[str, Any] | None = None) -> ServeConfig:
    """Defaults < YAML file < ``overrides`` (CLI options) < environment -> ``ServeConfig``.

    The environment only carries secrets, the notification URL and the forced mode; a PagerDuty
    secret from the environment is added to those of the file (rotation)."""
    env = os.environ if env is None else env
    data: dict[str, Any] = {}
    where = str(path) if path else "(environment)"
    if path is not None:
        data = read_mapping(path, "the serve configuration")
    data.update(overrides or {})
    sources: dict[str, str] = {}
    _from_env(env, data, sources)
    notify_url = env.get("RUNBOOK_NOTIFY_URL")
    if notify_url:
        data["notify"] = {**dict(data.get("notify") or {}), "url": notify_url}
    if "RUNBOOK_NOTIFY_SECRET" in env:
        data["notify"] = {**dict(data.get("notify") or {}), "secret": env["RUNBOOK_NOTIFY_SECRET"]}
        sources["notify.secret"] = "RUNBOOK_NOTIFY_SECRET"
    if env.get("RUNBOOK_PAGERDUTY_ROUTING_KEY"):
        notify = dict(data.get("notify") or {})
        if not isinstance(notify.get("pagerduty"), Mapping):
            notify["pagerduty"] = {}
        notify["pagerduty"] = {**dict(notify["pagerduty"]), "routing_key": env["RUNBOOK_PAGERDUTY_ROUTING_KEY"]}
        data["notify"] = notify
    for key, var in ONCALL_SECRETS.items():
        if var in env:  # Why "in": a blank value is an error, not "unset"
            _, section, name = key.split(".")
            notify = dict(data.get("notify") or {})
            notify[section] = {**dict(notify.get(section) or {}), name: env[var]}
            data["notify"] = notify
            sources[key] = var
    if "RUNBOOK_PAGERDUTY_SECRET" in env:
        pd = dict(data.get("pagerduty") or {})
        pd["secrets"] = (env["RUNBOOK_PAGERDUTY_SECRET"], *tuple(pd.get("secrets") or ()))
        data["pagerduty"] = pd
        sources["pagerduty.secrets[0]"] = "RUNBOOK_PAGERDUTY_SECRET"
    check_secrets(data, sources, where)
    try:
        config = ServeConfig.model_validate(data)
    except ValidationError as e:
        raise UsageError(f"{where}: invalid serve configuration: {format_validation_error(e, limit=10)}") from e
    secrecy.register(*secret_values(config))  # the JSON logs mask every Secret-typed setting
    return config.with_compat()
