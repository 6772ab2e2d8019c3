"""One root error, a subclass per kind of failure raised; each maps to a CLI exit code.

Blocked preconditions and guards, failed actions and failed verifications are not exceptions: they
are values (a blocked ``Plan``, a ``StepOutcome``, a ``RunResult`` with its exit code), so no error
class stands for them.

Exit codes are a contract (README, issue #3): 0 success, 1 failed, 2 usage/invalid,
3 blocked, 4 cancelled, 5 stale plan or invalid approval, 6 the journal cannot be read or written
(locked, disk full, read-only, corrupt: issue #14).
"""

from __future__ import annotations

from dataclasses import dataclass


class ExitCode:
    OK = 0
    FAILED = 1
    USAGE = 2
    BLOCKED = 3
    CANCELLED = 4
    STALE = 5
    JOURNAL = 6


class RunbookError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code: int = ExitCode.FAILED
    retryable: bool = False


@dataclass(frozen=True)
class Location:
    """Where in a user's file a problem is: ``path:line[:column]: where: message``."""

    path: str
    line: int = 1
    column: int | None = None
    where: str = ""  # e.g. "steps[2].verify[0]"

    def format(self, message: str) -> str:
        col = f":{self.column}" if self.column else ""
        where = f" {self.where}:" if self.where else ""
        return f"{self.path}:{self.line}{col}:{where} {message}"


class LoadError(RunbookError):
    """A runbook, scenario, inventory or plan file is invalid. Carries every problem found."""

    exit_code = ExitCode.USAGE

    def __init__(self, problems: list[tuple[Location, str]]) -> None:
        self.problems = problems
        super().__init__("\n".join(loc.format(msg) for loc, msg in problems))


class UsageError(RunbookError):
    """Bad command-line use or an invalid parameter value."""

    exit_code = ExitCode.USAGE


class PlanError(RunbookError):
    """The runbook cannot be planned (e.g. ``requires`` order violated)."""

    exit_code = ExitCode.USAGE


class LockHeld(RunbookError):
    """Another run holds the node's remediation Lease."""

    exit_code = ExitCode.BLOCKED


class Cancelled(RunbookError):
    """The operator (SIGINT/SIGTERM) or a refusal at the prompt stopped the run."""

    exit_code = ExitCode.CANCELLED


class LockLost(Cancelled):
    """The node's Lease is no longer this run's (taken over, deleted, or not renewed in time): the
    run stops before its next action (exit 4, cancelled)."""


class ActionFailed(RunbookError):
    """A kube verb's action failed (raised by engine.kube_verbs; the executor turns it into a failed
    step outcome with its evidence)."""

    exit_code = ExitCode.FAILED


class StalePlan(RunbookError):
    """A saved plan no longer matches reality, or an approval names another plan."""

    exit_code = ExitCode.STALE


class ApprovalRefused(RunbookError):
    """The approval policy does not let this person approve this run (not an approver, the requester,
    or an approval already given)."""

    exit_code = ExitCode.BLOCKED


class JournalError(RunbookError):
    """The journal cannot be opened, read or written (locked by another writer past the wait, disk
    full, read-only, corrupt). One line naming the file and the cause; nothing more is done, and no
    action whose intent could not be recorded is taken."""

    exit_code = ExitCode.JOURNAL


class ConnectorError(RunbookError):
    """An outside system (Kubernetes API, Ansible/SSH) failed. Wraps the library's exception."""

    exit_code = ExitCode.FAILED

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class KubeError(ConnectorError):
    """The Kubernetes API answered with an error or could not be reached."""

    def __init__(self, message: str, *, status: int | None = None, retryable: bool = False) -> None:
        super().__init__(message, retryable=retryable)
        self.status = status


class NamespaceTerminating(KubeError):
    """An eviction (a create) refused because the pod's namespace is being deleted (HTTP 403, cause
    ``NamespaceTerminating``): kubectl drain waits for a pod already deleting, else retries."""


class NotFound(KubeError):
    """The object does not exist (HTTP 404)."""


class Conflict(KubeError):
    """Optimistic concurrency conflict (HTTP 409)."""


class Forbidden(KubeError):
    """RBAC refused the request (HTTP 403): the identity lacks a permission. Blocked (exit 3), not
    failed: nothing was changed by the refused request, and retrying will not help until someone
    grants the permission. The message names the verb and the resource (the API server's own words:
    ``User "..." cannot patch resource "nodes" ...``)."""

    exit_code = ExitCode.BLOCKED


class HostError(ConnectorError):
    """Ansible could not run, a host was unreachable, or a playbook task failed."""

    def __init__(self, message: str, *, host: str | None = None, unreachable: bool = False,
                 retryable: bool = False) -> None:
        super().__init__(message, retryable=retryable)
        self.host = host
        self.unreachable = unreachable
