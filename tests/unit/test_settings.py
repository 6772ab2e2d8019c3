"""``engine.settings.STORES``: the run stores a command can open, one entry each; ``--store``'s
choices, its default and the unknown-store message are read from it (docs/design.md, "How to add a
store")."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from engine import settings as settings_module
from engine.cli import run
from engine.errors import UsageError
from engine.journal import Journal
from engine.settings import DEFAULT_STORE, STORES, Settings
from engine.store import RunStore


def test_an_unknown_store_is_a_usage_error_naming_every_store() -> None:
    with pytest.raises(UsageError, match=r"^--store etcd: unknown store \(sqlite or kubernetes\)$"):
        Settings(store="etcd").open_journal()


def test_the_cli_offers_exactly_the_registered_stores_with_sqlite_by_default() -> None:
    option = next(p for p in run.params if p.name == "store")
    assert isinstance(option.type, click.Choice)
    assert list(option.type.choices) == list(STORES) == ["sqlite", "kubernetes"]
    assert option.default == DEFAULT_STORE == "sqlite"


def test_a_new_store_is_opened_through_its_entry_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[RunStore] = []

    def open_memory(s: Settings) -> RunStore:
        opened.append(Journal(tmp_path / f"{s.store}.sqlite"))
        return opened[-1]

    monkeypatch.setitem(settings_module.STORES, "memory", settings_module.StoreKind(open_memory))
    monkeypatch.setenv("RUNBOOK_BECOME_PASSWORD", "hunter2-secret")
    store = Settings(store="memory").open_journal()
    try:
        assert opened == [store] and Path(tmp_path / "memory.sqlite").exists()
        run_id = store.create_run("rb", {"note": "hunter2-secret"}, ["omen2"])
        assert store.get_run(run_id).params == {"note": "***"}  # the secret is masked, whatever the store
    finally:
        store.close()
    with pytest.raises(UsageError, match=r"unknown store \(sqlite, kubernetes or memory\)"):
        Settings(store="etcd").open_journal()


def test_cluster_mode_is_the_store_kinds_flag_not_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What cluster mode changes (node Leases in the store namespace, ...) follows ``in_cluster``."""
    assert Settings(store="kubernetes").cluster_mode and not Settings(store="sqlite").cluster_mode
    monkeypatch.setitem(settings_module.STORES, "etcd-direct",
                        settings_module.StoreKind(lambda s: Journal(tmp_path / "x.sqlite"), in_cluster=True))
    shared = Settings(store="etcd-direct", store_namespace="runs-here")
    assert shared.cluster_mode and shared.lease_namespace == "runs-here"
    assert Settings(store="sqlite", store_namespace="runs-here").lease_namespace == "kube-system"
    with pytest.raises(UsageError, match="unknown store"):
        _ = Settings(store="etcd").cluster_mode
