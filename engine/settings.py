"""Shared command options as one value, and the connectors built from them.

Connectors are created on first use so read-only commands never pay for Kubernetes or
Ansible imports. The become password comes from ``RUNBOOK_BECOME_PASSWORD``, a file, or a
prompt; it is never written anywhere.

``STORES`` names the run stores a command can record into (``--store NAME``) and how each is
opened; the store modules are imported only by their opener, when a command opens its store (this
module stays cheap to import: ``runbook --help`` reads ``STORES`` for its choices).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from engine.errors import KubeError, UsageError

if TYPE_CHECKING:
    from engine.approval_policy import ApprovalConfig
    from engine.connectors.base import KubeAPI, NodeAutomation, ObjectAPI
    from engine.run_guards import GuardConfig
    from engine.store import RunStore

DEFAULT_STORE = "sqlite"  # --store: a name of ``STORES`` (below)
DEFAULT_STORE_NAMESPACE = "runbook-system"  # --store-namespace


@dataclass
class Settings:
    kubeconfig: str | None = None
    context: str | None = None
    inventory: Path | None = None
    runbooks_dir: Path | None = None
    journal: Path | None = None
    store: str = DEFAULT_STORE  # where runs are recorded: a name of ``STORES`` (the journal file, or ``kubernetes``)
    store_namespace: str = DEFAULT_STORE_NAMESPACE  # the RemediationRuns' namespace (``--store kubernetes``)
    become_password_file: Path | None = None
    ask_become_pass: bool = False
    debug: bool = False
    guards_config: Path | None = None  # a YAML file with a ``guards:`` section (``engine.run_guards``)
    namespace: str | None = None  # where the node Leases live (None: ``lease_namespace`` decides)
    request_timeout: float | None = None  # seconds an API request may take (None: the connector's default)
    no_tty: bool = False  # plain progress lines even on a terminal (``engine.live``)
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def become_password(self) -> str | None:
        """``--become-password-file``, else ``--ask-become-pass`` (a prompt), else
        ``RUNBOOK_BECOME_PASSWORD``. Kept in memory only; the journal masks it wherever it appears."""
        if "become" not in self._cache:
            value: str | None = os.environ.get("RUNBOOK_BECOME_PASSWORD")
            if self.become_password_file is not None:
                try:
                    value = self.become_password_file.read_text().rstrip("\n")
                except (OSError, UnicodeDecodeError) as e:
                    raise UsageError(f"{self.become_password_file}: cannot read the become password: "
                                     f"{type(e).__name__}") from None
            elif self.ask_become_pass:
                import getpass

                value = getpass.getpass("BECOME password: ")
            self._cache["become"] = value
            if "journal" in self._cache:
                self._cache["journal"].add_secret(value)
        return self._cache["become"]

    def kube(self) -> KubeAPI:
        if "kube" not in self._cache:
            from engine.connectors.kube import KubeConnector

            # Inside a pod with no kubeconfig at hand: the service account's in-cluster config.
            in_cluster = (self.kubeconfig is None and "KUBERNETES_SERVICE_HOST" in os.environ
                          and not (Path.home() / ".kube" / "config").exists())
            if not in_cluster:
                self._check_kubeconfig()
            read = self.request_timeout or 30.0
            try:
                self._cache["kube"] = KubeConnector(kubeconfig=self.kubeconfig, context=self.context,
                                                    in_cluster=in_cluster, read_timeout=read,
                                                    connect_timeout=min(5.0, read))
            except KubeError as e:
                raise UsageError(f"{e}\n{self.kube_hint()}") from None
        return self._cache["kube"]

    def objects(self) -> ObjectAPI:
        """The same connector as ``kube()``, for objects of any kind (the RemediationRuns)."""
        return cast("ObjectAPI", self.kube())

    def kubeconfig_used(self) -> str:
        """The kubeconfig this command reads, as a person would name it."""
        if self.kubeconfig:
            return self.kubeconfig
        return f"{Path.home() / '.kube' / 'config'} (the default)"

    def kube_hint(self) -> str:
        """Which kubeconfig and context were used, and how to choose others (for errors)."""
        ctx = f"context {self.context}" if self.context else "its current context"
        return (f"  used kubeconfig {self.kubeconfig_used()}, {ctx}; choose another with --kubeconfig FILE "
                f"(or env KUBECONFIG) and --context NAME")

    def inventory_hint(self) -> str:
        where = str(self.inventory) if self.inventory else "none"
        return f"  used inventory {where}; choose another with --inventory FILE (or env RUNBOOK_INVENTORY)"

    def _check_kubeconfig(self) -> None:
        """A kubeconfig that is not there is a usage error (exit 2), said before anything is tried."""
        files = [f for f in (self.kubeconfig or "").split(os.pathsep) if f]
        if not files:
            default = Path.home() / ".kube" / "config"
            if not default.exists():
                raise UsageError(f"no kubeconfig: {default} does not exist and neither --kubeconfig nor KUBECONFIG "
                                 f"is set\n  give --kubeconfig FILE or set KUBECONFIG (inside a pod, the service "
                                 f"account is used when no kubeconfig is given)")
            return
        missing = [f for f in files if not Path(f).is_file()]
        if len(missing) == len(files):
            raise UsageError(f"kubeconfig {self.kubeconfig} not found (from --kubeconfig or env KUBECONFIG)\n"
                             f"  give --kubeconfig FILE or set KUBECONFIG to an existing file")

    def start_inventory_read(self) -> None:
        """Begin reading the inventory now, in the background, when it is plain files (its
        ``ansible-inventory`` child then runs while the command imports and loads; ``nodes()``
        collects it): for the commands that plan or run. Errors are ``nodes()``'s to report."""
        if self.inventory is not None:
            from engine.connectors.inventory import start_reading

            start_reading(self.inventory)

    def nodes(self, playbooks_dir: Path) -> NodeAutomation:
        if "nodes" not in self._cache:
            if self.inventory is None:
                raise UsageError("this runbook needs node hosts: give --inventory FILE or set RUNBOOK_INVENTORY")
            if not self.inventory.exists():
                raise UsageError(f"{self.inventory}: inventory not found (from --inventory or env RUNBOOK_INVENTORY)"
                                 f"\n  give --inventory FILE or set RUNBOOK_INVENTORY to an existing inventory")
            from engine.connectors.ansible import AnsibleConnector

            self._cache["nodes"] = AnsibleConnector(self.inventory, playbooks_dir,
                                                    become_password=self.become_password())
        return self._cache["nodes"]

    def guard_config(self) -> GuardConfig:
        """The run guards' configuration: ``--guards-config`` (its ``guards:`` section), else the defaults."""
        if "guards" not in self._cache:
            from engine.run_guards import load_guard_config

            self._cache["guards"] = load_guard_config(self.guards_config)
        return self._cache["guards"]

    @property
    def lease_namespace(self) -> str:
        """Where node Leases live: ``--namespace``; else, in cluster mode (``--store kubernetes``), the
        store namespace, so that the engine's ServiceAccount needs no Lease rights in kube-system
        (where the controller-manager's and scheduler's leader Leases live); else kube-system."""
        from engine.locks import DEFAULT_NAMESPACE

        if self.namespace:
            return self.namespace
        return self.store_namespace if self.cluster_mode else DEFAULT_NAMESPACE

    def approval_config(self) -> ApprovalConfig:
        """The approval policy: the serve configuration's ``approvals:`` (set by serve), else the
        ``approvals:`` section of ``--guards-config``, else the default (one approval by anyone)."""
        if "approvals" not in self._cache:
            from engine.approval_policy import load_approval_config

            self._cache["approvals"] = load_approval_config(self.guards_config)
        return cast("ApprovalConfig", self._cache["approvals"])

    def open_journal(self) -> RunStore:
        """The run store of this command (``--store``, one of ``STORES``): the SQLite journal, or
        RemediationRuns."""
        if "journal" not in self._cache:
            j = self._store_kind().open(self)
            j.add_secret(self.become_password() if "become" in self._cache else
                         os.environ.get("RUNBOOK_BECOME_PASSWORD"))
            wrap = self._cache.pop("journal_wrap", None)
            self._cache["journal"] = wrap(j) if wrap is not None else j
        return self._cache["journal"]

    @property
    def cluster_mode(self) -> bool:
        """Runs are recorded in the cluster (``StoreKind.in_cluster``): cluster mode."""
        return self._store_kind().in_cluster

    def _store_kind(self) -> StoreKind:
        kind = STORES.get(self.store)
        if kind is None:
            raise UsageError(f"--store {self.store}: unknown store ({_either(STORES)})")
        return kind

    def wrap_journal(self, wrap: Callable[[RunStore], RunStore]) -> None:
        """Use ``wrap(store)`` as this command's run store (``open_journal``) from now on, opened when
        first needed (``--notify-config`` notes the runs the command creates or resumes this way)."""
        if "journal" in self._cache:
            self._cache["journal"] = wrap(self._cache["journal"])
        else:
            self._cache["journal_wrap"] = wrap

    def abort_actions(self) -> None:
        """Stop the running playbook now (its whole process tree); later playbooks are refused.
        Safe to call from a signal handler."""
        nodes = self._cache.get("nodes")
        if nodes is not None:
            nodes.cancel()

    def close(self) -> None:
        nodes = self._cache.pop("nodes", None)
        if nodes is not None:
            nodes.close()


# -- the run stores a command can open (``--store NAME``) ------------------------------------------


def _open_sqlite(settings: Settings) -> RunStore:
    """The SQLite journal (``--journal``, else its default path)."""
    from engine.journal import Journal

    return Journal(settings.journal)


def _open_kubernetes(settings: Settings) -> RunStore:
    """RemediationRun objects in ``--store-namespace``, through the Kubernetes connector."""
    from engine.kube_store import KubeRunStore

    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", settings.store_namespace):
        raise UsageError(f"--store-namespace {settings.store_namespace!r}: not a namespace name (lower-case "
                         f"letters, digits and '-', at most 63; env RUNBOOK_STORE_NAMESPACE)")
    return KubeRunStore(settings.objects(), settings.store_namespace)


@dataclass(frozen=True)
class StoreKind:
    """A run store a command can open: how, and what recording there means for the rest of the
    engine. ``in_cluster``: the runs live in the cluster's API (cluster mode), so every replica and
    CLI shares them (serve's replicas elect a leader and share the webhook dedup), the API server's
    RBAC names approvers (never a typed name), and node Leases live in the store namespace."""

    open: Callable[[Settings], RunStore]
    in_cluster: bool = False


# ``--store NAME`` -> that store (the CLI's choices and the messages read this). A new store is its
# module (a ``RunStore`` on ``store.StoreBase``), its opener and entry here, and its ``StoreBed`` in
# tests/unit/test_store_contract.py (docs/design.md, "How to add a store").
STORES: dict[str, StoreKind] = {
    "sqlite": StoreKind(_open_sqlite),
    "kubernetes": StoreKind(_open_kubernetes, in_cluster=True),
}


def _either(names: Iterable[str]) -> str:
    """``a or b``, ``a, b or c``."""
    items = list(names)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"
