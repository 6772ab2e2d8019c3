"""The kept listing of a static inventory (engine.connectors.inventory_cache): a second load of
unchanged files starts no ``ansible-inventory`` child; any change to a source, to ``group_vars/``
or to what the child would be given reads anew; dynamic inventories are never kept.

The real ``ansible-inventory`` reads (no fake of Ansible); the children are counted by wrapping the
module's own spawn function.
"""

from __future__ import annotations

import os
import stat
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.connectors import inventory, inventory_cache
from engine.connectors.inventory import load_inventory


@pytest.fixture
def children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """The paths an ``ansible-inventory`` child was started for, with a cache folder of this test."""
    monkeypatch.setenv(inventory_cache.CACHE_ENV, str(tmp_path / "cache"))
    started: list[Path] = []
    real = inventory._spawn

    def counted(path: Path) -> inventory._Child:
        started.append(path)
        return real(path)

    monkeypatch.setattr(inventory, "_spawn", counted)
    yield started


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def test_an_unchanged_static_inventory_is_read_once_and_kept_private(tmp_path: Path, children: list[Path]) -> None:
    path = write(tmp_path / "inv" / "hosts.yaml", "all:\n  hosts:\n    box2:\n      k8s_node_name: omen2\n")
    first = load_inventory(path)
    second = load_inventory(path)
    assert len(children) == 1
    assert second == first and second.host_for_node("omen2") == "box2"
    folder = inventory_cache.cache_dir()
    (entry,) = folder.iterdir()
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(entry.stat().st_mode) == 0o600


def test_an_edit_of_the_file_or_of_its_group_vars_is_read_anew(tmp_path: Path, children: list[Path]) -> None:
    path = write(tmp_path / "inv" / "hosts.yaml", "all:\n  hosts:\n    omen2: {}\n")
    assert load_inventory(path).host_for_node("omen2") == "omen2"
    write(path, "all:\n  hosts:\n    box2:\n      k8s_node_name: omen2\n")  # same size or not: ctime changes
    assert load_inventory(path).host_for_node("omen2") == "box2"
    write(tmp_path / "inv" / "group_vars" / "all.yaml", "ansible_host: 127.0.0.9\n")
    assert load_inventory(path).hosts["box2"].address == "127.0.0.9"
    assert len(children) == 3
    load_inventory(path)
    assert len(children) == 3


def test_a_script_inventory_is_never_kept(tmp_path: Path, children: list[Path]) -> None:
    path = write(tmp_path / "inv.sh", """
        #!/bin/sh
        echo '{"all": {"hosts": ["omen2"]}, "_meta": {"hostvars": {}}}'
        """)
    path.chmod(0o755)
    load_inventory(path)
    load_inventory(path)
    assert len(children) == 2
    assert not inventory_cache.cache_dir().exists() or not any(inventory_cache.cache_dir().iterdir())


def test_an_ansible_setting_passed_on_is_never_kept(tmp_path: Path, children: list[Path],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBOOK_ANSIBLE_ENV", "ANSIBLE_VARS_ENABLED")
    monkeypatch.setenv("ANSIBLE_VARS_ENABLED", "host_group_vars")
    path = write(tmp_path / "hosts.yaml", "all:\n  hosts:\n    omen2: {}\n")
    load_inventory(path)
    load_inventory(path)
    assert len(children) == 2


def test_a_changed_environment_for_the_child_reads_anew(tmp_path: Path, children: list[Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "hosts.yaml", "all:\n  hosts:\n    omen2: {}\n")
    load_inventory(path)
    monkeypatch.setenv("LC_RUNBOOK_TEST", "another")  # LC_* reaches the child
    load_inventory(path)
    assert len(children) == 2


def test_an_unwritable_cache_folder_only_costs_the_reads(tmp_path: Path, children: list[Path],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(inventory_cache.CACHE_ENV, str(blocker))
    path = write(tmp_path / "hosts.yaml", "all:\n  hosts:\n    omen2: {}\n")
    assert load_inventory(path).host_for_node("omen2") == "omen2"
    assert load_inventory(path).host_for_node("omen2") == "omen2"
    assert len(children) == 2


def test_a_kept_listing_for_another_key_or_a_corrupt_entry_is_not_used(tmp_path: Path, children: list[Path]) -> None:
    path = write(tmp_path / "hosts.yaml", "all:\n  hosts:\n    omen2: {}\n")
    load_inventory(path)
    (entry,) = inventory_cache.cache_dir().iterdir()
    entry.write_text("{not json")
    assert load_inventory(path).nodes == ("omen2",)
    assert len(children) == 2
    os.utime(path)  # touched: another key, the kept listing is for the old stamp
    load_inventory(path)
    assert len(children) == 3
