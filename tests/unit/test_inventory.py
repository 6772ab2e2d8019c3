"""Inventory: which inventory host runs a Kubernetes node (engine.connectors.inventory)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.connectors.inventory import load_inventory
from engine.errors import HostError, LoadError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_node_maps_to_the_host_of_the_same_name(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, "all:\n  hosts:\n    omen2:\n      ansible_host: 127.0.1.5\n"))
    assert inv.host_for_node("omen2") == "omen2"
    assert inv.hosts["omen2"].address == "127.0.1.5"


def test_a_node_maps_to_the_host_whose_k8s_node_name_names_it(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, """
all:
  hosts:
    gpu-box-2:
      k8s_node_name: omen2
    omen2-old: {}
"""))
    assert inv.host_for_node("omen2") == "gpu-box-2"
    assert inv.node_for_host("gpu-box-2") == "omen2"
    assert inv.host_for_node("omen2-old") == "omen2-old"


def test_an_unknown_node_is_a_host_error_that_names_node_and_inventory(tmp_path: Path) -> None:
    path = write(tmp_path, "all:\n  hosts:\n    omen1:\n")
    inv = load_inventory(path)
    with pytest.raises(HostError) as err:
        inv.host_for_node("omen2")
    assert "omen2" in str(err.value) and str(path) in str(err.value)
    assert err.value.host == "omen2"


def test_hosts_in_nested_groups_are_found_once_with_all_their_groups(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, """
all:
  vars: {ansible_user: ops}
  children:
    gpu_nodes:
      hosts:
        omen2: {ansible_host: 127.0.1.5}
      children:
        rtx5090:
          hosts:
            omen2:
    workers:
      hosts:
        worker1:
        omen2:
"""))
    assert sorted(inv.hosts) == ["omen2", "worker1"]
    assert inv.hosts["omen2"].groups == ("all", "gpu_nodes", "rtx5090", "workers")
    assert inv.hosts["omen2"].address == "127.0.1.5"  # variables from the first listing survive
    assert inv.group("gpu_nodes") == ("omen2",)
    assert inv.nodes == ("omen2", "worker1")


def test_vaulted_and_templated_values_load_without_being_interpreted(tmp_path: Path) -> None:
    inv = load_inventory(write(tmp_path, """
all:
  hosts:
    omen2:
      ansible_become_password: !vault |
        $ANSIBLE_VAULT;1.1;AES256
        3132333435
      other: "{{ lookup('env', 'X') }}"
      port: 2222
"""))
    assert inv.host_for_node("omen2") == "omen2"
    assert inv.hosts["omen2"].vars["port"] == 2222


def test_two_hosts_claiming_one_node_is_a_load_error_with_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "all:\n  hosts:\n    a:\n      k8s_node_name: omen2\n    omen2:\n")
    with pytest.raises(LoadError) as err:
        load_inventory(path)
    assert f"{path}:5:" in str(err.value)
    assert "both claim node omen2" in str(err.value)


@pytest.mark.parametrize(("text", "line", "message"), [
    ("all:\n  hosts:\n    a: [\n", 4, "invalid YAML"),
    ("- omen2\n", 1, "mapping of groups"),
    ("all:\n  hostz:\n    a:\n", 2, "unknown key 'hostz'"),
    ("all:\n  hosts:\n    - omen2\n", 3, "hosts must be a mapping"),
    ("", 1, "empty inventory"),
])
def test_a_broken_inventory_is_reported_as_path_line_message(tmp_path: Path, text: str, line: int,
                                                             message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(LoadError) as err:
        load_inventory(path)
    assert f"{path}:{line}" in str(err.value)
    assert message in str(err.value)


def test_a_folder_inventory_reads_every_yaml_file(tmp_path: Path) -> None:
    write(tmp_path, "all:\n  hosts:\n    omen1:\n", "a.yml")
    write(tmp_path, "gpu:\n  hosts:\n    omen2:\n", "b.yaml")
    write(tmp_path, "not yaml: [", "notes.txt")
    inv = load_inventory(tmp_path)
    assert inv.nodes == ("omen1", "omen2")


def test_the_example_homelab_inventory_describes_the_incidents_eight_nodes() -> None:
    inv = load_inventory(REPO / "inventory" / "homelab.yaml")
    assert len(inv.hosts) == 8
    assert inv.host_for_node("omen2") == "omen2"
    assert inv.host_for_node("cp1") == "cp1-host"
    assert set(inv.group("gpu_nodes")) == {"omen1", "omen2", "omen3", "omen4"}
    assert inv.group("control_plane") == ("cp1-host",)
    for host in inv.hosts.values():  # never a password in the repository
        assert not any("password" in key for key in host.vars)
    text = (REPO / "inventory" / "homelab.yaml").read_text()
    assert not re.search(r"^[^#]*password[^:#]*:", text, re.M)
