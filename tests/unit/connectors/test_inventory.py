"""Inventory: which inventory host runs a Kubernetes node (engine.connectors.inventory).

Every form ``ansible-playbook -i`` accepts, read by the real ``ansible-inventory`` (no fake of
Ansible): YAML, INI with ranges, folders of sources, group_vars/host_vars, scripts, plugins.
"""

from __future__ import annotations

import re
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from engine.connectors.inventory import inventory_from_listing, load_inventory, parse_failure
from engine.errors import HostError, LoadError

REPO = Path(__file__).resolve().parents[3]


def write(folder: Path, text: str, name: str = "inventory.yaml", *, mode: int | None = None) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    if mode is not None:
        path.chmod(mode)
    return path


# ---------------------------------------------------------------------------- YAML


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
    assert inv.hosts["omen2"].address == "127.0.1.5"
    assert inv.hosts["omen2"].vars["ansible_user"] == "ops"  # group variables are merged in
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
    assert inv.hosts["omen2"].vars["other"] == "{{ lookup('env', 'X') }}"


# ---------------------------------------------------------------------------- INI, ranges, vars files


def ini_inventory(folder: Path) -> Path:
    """An INI inventory with ranges and groups, and k8s_node_name from three sources."""
    write(folder, """
        [gpu]
        gpu-3090-[1:3] ansible_user=ops
        omen2-box

        [workers]
        worker[01:02]
        w-inline k8s_node_name=worker9

        [rtx5090]
        omen2-box

        [all:vars]
        ansible_port=2222
        """, "hosts.ini")
    write(folder, "ansible_python_interpreter: /usr/bin/python3\n", "group_vars/all.yml")
    write(folder, "k8s_node_name: omen2\n", "host_vars/omen2-box.yml")
    write(folder, "k8s_node_name: gpu-5090-solo\n", "group_vars/rtx5090.yml")  # host_vars wins
    write(folder, "k8s_node_name: worker-b\n", "host_vars/worker02/node.yml")  # a host_vars folder
    return folder / "hosts.ini"


def test_an_ini_inventory_expands_host_ranges_into_hosts_with_their_groups(tmp_path: Path) -> None:
    inv = load_inventory(ini_inventory(tmp_path))
    assert sorted(inv.hosts) == ["gpu-3090-1", "gpu-3090-2", "gpu-3090-3", "omen2-box", "w-inline",
                                 "worker01", "worker02"]
    assert inv.group("gpu") == ("gpu-3090-1", "gpu-3090-2", "gpu-3090-3", "omen2-box")
    assert inv.host_for_node("gpu-3090-2") == "gpu-3090-2"
    assert inv.hosts["gpu-3090-3"].vars["ansible_user"] == "ops"


def test_group_vars_and_host_vars_beside_an_ini_file_are_merged_as_ansible_merges_them(tmp_path: Path) -> None:
    inv = load_inventory(ini_inventory(tmp_path))
    for host in inv.hosts.values():
        assert host.vars["ansible_python_interpreter"] == "/usr/bin/python3"  # group_vars/all.yml
        assert host.vars["ansible_port"] == 2222  # [all:vars]


def test_k8s_node_name_is_taken_from_host_vars_group_vars_and_inline_variables(tmp_path: Path) -> None:
    inv = load_inventory(ini_inventory(tmp_path))
    assert inv.host_for_node("omen2") == "omen2-box"  # host_vars/omen2-box.yml beats group_vars
    assert inv.host_for_node("worker-b") == "worker02"  # host_vars/worker02/node.yml
    assert inv.host_for_node("worker9") == "w-inline"  # inline in the INI host line
    with pytest.raises(HostError):
        inv.host_for_node("gpu-5090-solo")


def test_k8s_node_name_from_group_vars_maps_the_groups_only_host(tmp_path: Path) -> None:
    write(tmp_path, "[rtx5090]\nbox-7\n\n[other]\nomen1\n", "hosts")
    write(tmp_path, "k8s_node_name: omen2\n", "group_vars/rtx5090.yaml")
    inv = load_inventory(tmp_path / "hosts")
    assert inv.host_for_node("omen2") == "box-7"
    assert inv.host_for_node("omen1") == "omen1"


# ---------------------------------------------------------------------------- folders, scripts, plugins


def test_a_folder_of_several_sources_is_read_as_one_inventory(tmp_path: Path) -> None:
    write(tmp_path, "all:\n  hosts:\n    omen1:\n", "01-base.yml")
    write(tmp_path, "[gpu]\nomen2\nbox-[3:4]\n", "02-gpu.ini")
    write(tmp_path, """
        #!/bin/sh
        if [ "$1" = "--list" ]; then
          echo '{"cloud": {"hosts": ["vm-9"]}, "_meta": {"hostvars": {"vm-9": {"k8s_node_name": "gpu-3090-9"}}}}'
        else
          echo '{}'
        fi
        """, "03-cloud.sh", mode=0o755)
    write(tmp_path, "notes: [ not an inventory", "README.md")  # ignored by Ansible, as here
    write(tmp_path, "k8s_node_name: omen3\n", "host_vars/box-3.yml")
    inv = load_inventory(tmp_path)
    assert inv.nodes == ("box-4", "gpu-3090-9", "omen1", "omen2", "omen3")
    assert inv.host_for_node("gpu-3090-9") == "vm-9"
    assert inv.host_for_node("omen3") == "box-3"
    assert inv.group("cloud") == ("vm-9",)


def test_an_executable_inventory_script_is_run_by_ansible(tmp_path: Path) -> None:
    script = write(tmp_path, """
        #!/usr/bin/env python3
        import json, sys
        if sys.argv[1:] == ["--list"]:
            print(json.dumps({"gpu": {"hosts": ["node-a", "node-b"], "vars": {"ansible_user": "ops"}},
                              "_meta": {"hostvars": {"node-b": {"k8s_node_name": "omen2"}}}}))
        else:
            print("{}")
        """, "inventory.py", mode=0o755)
    inv = load_inventory(script)
    assert inv.host_for_node("omen2") == "node-b"
    assert inv.host_for_node("node-a") == "node-a"
    assert inv.hosts["node-a"].vars["ansible_user"] == "ops"


def test_a_constructed_plugin_config_can_compose_k8s_node_name(tmp_path: Path) -> None:
    write(tmp_path, "[gpu]\nomen2-host\nomen3-host\n", "01-hosts.ini")
    write(tmp_path, """
        plugin: ansible.builtin.constructed
        strict: true
        compose:
          k8s_node_name: inventory_hostname | regex_replace('-host$', '')
        groups:
          rtx5090: inventory_hostname == 'omen2-host'
        """, "02-constructed.yml")
    inv = load_inventory(tmp_path)
    assert inv.host_for_node("omen2") == "omen2-host"
    assert inv.host_for_node("omen3") == "omen3-host"
    assert inv.group("rtx5090") == ("omen2-host",)


def test_a_yaml_plugin_config_is_read_by_the_auto_plugin(tmp_path: Path) -> None:
    path = write(tmp_path, "plugin: ansible.builtin.generator\nhosts:\n  name: 'gpu-{{ n }}'\n"
                           "layers:\n  n: ['1', '2']\n", "gen.yml")
    assert load_inventory(path).nodes == ("gpu-1", "gpu-2")


def test_an_inventory_script_that_hangs_is_an_error_not_a_stuck_run(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = write(tmp_path, f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 300\n", "slow.sh", mode=0o755)
    started = time.monotonic()
    with pytest.raises(LoadError) as err:
        load_inventory(script, timeout=15)  # long enough for Ansible to start the script under load
    assert time.monotonic() - started < 60
    assert f"{script}:1:" in str(err.value) and "did not finish" in str(err.value)
    pid = int(pid_file.read_text())  # the script Ansible started is gone with it

    def alive() -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive()


# ---------------------------------------------------------------------------- errors


def test_two_hosts_claiming_one_node_is_a_load_error_with_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "all:\n  hosts:\n    a:\n      k8s_node_name: omen2\n    omen2:\n")
    with pytest.raises(LoadError) as err:
        load_inventory(path)
    assert f"{path}:5:" in str(err.value)
    assert f"hosts a and omen2 both claim node omen2 (a: {path}:4)" in str(err.value)


def test_a_claim_made_in_host_vars_is_located_in_that_file(tmp_path: Path) -> None:
    ini = write(tmp_path, "[gpu]\nomen2\nbox-[1:2]\n", "hosts.ini")
    write(tmp_path, "ansible_user: ops\nk8s_node_name: omen2\n", "host_vars/box-2.yml")
    with pytest.raises(LoadError) as err:
        load_inventory(ini)
    message = str(err.value)  # both hosts named, each with the file and line of its claim
    assert "hosts box-2 and omen2 both claim node omen2" in message
    assert message.startswith(f"{ini}:2:")
    assert f"(box-2: {tmp_path / 'host_vars' / 'box-2.yml'}:2)" in message


def test_a_templated_k8s_node_name_is_refused_with_its_host(tmp_path: Path) -> None:
    path = write(tmp_path, "[gpu]\nbox k8s_node_name=\"{{ inventory_hostname }}\"\n", "hosts.ini")
    with pytest.raises(LoadError) as err:
        load_inventory(path)
    assert f"{path}:2:" in str(err.value) and "host box: k8s_node_name must be a plain node name" in str(err.value)


@pytest.mark.parametrize(("name", "text", "where", "message"), [
    ("broken.yaml", "all:\n  hosts:\n    a: [\n", ":4:1:", "YAML parsing failed"),
    ("list.yaml", "- omen2\n", ":1:", "should be a dictionary"),
    ("hosts.ini", "[gpu]\nomen2 foo\n", ":1:", "Expected key=value host variable assignment, got: foo"),
    ("hosts.ini", "[gpu\nomen2\n", ":1:", "ini plugin"),
])
def test_a_broken_inventory_is_refused_with_ansibles_reason_and_the_file(tmp_path: Path, name: str, text: str,
                                                                         where: str, message: str) -> None:
    path = write(tmp_path, text, name)
    with pytest.raises(LoadError) as err:
        load_inventory(path)
    assert str(err.value).startswith(f"{path}{where}")
    assert message in str(err.value)
    assert err.value.exit_code == 2


def test_a_broken_source_in_a_folder_fails_the_whole_inventory(tmp_path: Path) -> None:
    write(tmp_path, "all:\n  hosts:\n    omen1:\n", "good.yml")
    write(tmp_path, "[gpu]\nomen2 foo\n", "bad.ini")  # Ansible alone would warn and go on without it
    with pytest.raises(LoadError) as err:
        load_inventory(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'bad.ini'}:")


def test_an_inventory_without_hosts_is_refused_with_ansibles_warnings(tmp_path: Path) -> None:
    path = write(tmp_path, "all:\n  hostz:\n    a:\n")
    with pytest.raises(LoadError) as err:
        load_inventory(path)
    assert f"{path}:1: Ansible found no hosts" in str(err.value)
    assert "unexpected key (hostz)" in str(err.value)


def test_a_missing_inventory_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(LoadError, match="inventory not found"):
        load_inventory(tmp_path / "nope.ini")


# ---------------------------------------------------------------------------- pure parts


def test_groups_reach_hosts_through_children_in_a_listing() -> None:
    inv = inventory_from_listing(Path("x"), {
        "_meta": {"hostvars": {"h1": {"k8s_node_name": "n1"}}},
        "all": {"children": ["ungrouped", "gpu"]},
        "gpu": {"children": ["rtx"]},
        "rtx": {"hosts": ["h1"]},
        "ungrouped": {"hosts": ["h2"]},
    })
    assert inv.hosts["h1"].groups == ("all", "gpu", "rtx")
    assert inv.hosts["h2"].groups == ("all", "ungrouped")
    assert inv.host_for_node("n1") == "h1"


def test_a_yaml_files_syntax_error_is_reported_without_the_ini_plugins_noise() -> None:
    stderr = textwrap.dedent("""
        [WARNING]: Failed to parse inventory with 'auto' plugin: YAML parsing failed: bad.
        Origin: /inv/x.yml:4:1
        [WARNING]: Failed to parse inventory with 'yaml' plugin: YAML parsing failed: bad.
        Origin: <inventory plugin 'yaml' with source '/inv/x.yml'>
        [WARNING]: Failed to parse inventory with 'ini' plugin: Failed to parse inventory: Invalid host
        Origin: /inv/x.yml
        [ERROR]: Completely failed to parse inventory source /inv/x.yml
        """)
    problems = parse_failure(Path("/inv/x.yml"), stderr)
    assert [(loc.format(msg)) for loc, msg in problems] == ["/inv/x.yml:4:1: auto plugin: YAML parsing failed: bad."]


def test_an_unexplained_failure_falls_back_to_ansibles_error_line() -> None:
    problems = parse_failure(Path("/inv"), "[ERROR]: something odd\n")
    assert [loc.format(msg) for loc, msg in problems] == ["/inv:1: Ansible cannot read this inventory: something odd"]


# ---------------------------------------------------------------------------- the examples


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


def test_the_example_ini_inventory_maps_the_same_nodes_as_the_yaml_one() -> None:
    ini = load_inventory(REPO / "inventory" / "homelab-ini" / "hosts.ini")
    yml = load_inventory(REPO / "inventory" / "homelab.yaml")
    assert {h.name: h.node for h in ini.hosts.values()} == {h.name: h.node for h in yml.hosts.values()}
    assert {h.name: h.groups for h in ini.hosts.values()} == {h.name: h.groups for h in yml.hosts.values()}
    for name, host in yml.hosts.items():
        assert dict(ini.hosts[name].vars) == dict(host.vars)


# ---------------------------------------------------------------------------- reading started early (issue 32)


def test_a_read_started_early_is_collected_by_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.connectors import inventory as inv_mod

    path = write(tmp_path, "all:\n  hosts:\n    gpu-box-2:\n      k8s_node_name: omen2\n")
    inv_mod.start_reading(path)
    assert path.resolve() in inv_mod._started

    def no_second_child(p: Path) -> Any:
        raise AssertionError("the load started a second ansible-inventory instead of collecting the first")

    monkeypatch.setattr(inv_mod, "_spawn", no_second_child)
    assert load_inventory(path).host_for_node("omen2") == "gpu-box-2"
    assert path.resolve() not in inv_mod._started


@pytest.mark.parametrize(("where", "host"), [("inventory.yaml", "gpu-box-2"), ("group_vars/gpus.yml", "gpu-box-3"),
                                             ("host_vars/gpu-box-2.yml", "gpu-box-2")])
def test_a_read_started_before_its_sources_changed_is_thrown_away(tmp_path: Path, where: str, host: str) -> None:
    from engine.connectors import inventory as inv_mod

    path = write(tmp_path, "all:\n  hosts:\n    gpu-box-2:\n  children:\n    gpus:\n      hosts:\n        gpu-box-3:\n")
    write(tmp_path, "x: 1\n", "group_vars/gpus.yml")
    write(tmp_path, "y: 1\n", "host_vars/gpu-box-2.yml")
    inv_mod.start_reading(path)
    child = inv_mod._started[path.resolve()]
    child.proc.wait(60)  # it has read the old files
    if where == "inventory.yaml":
        write(tmp_path, "all:\n  hosts:\n    gpu-box-2:\n      k8s_node_name: omen2\n  children:\n    gpus:\n"
                        "      hosts:\n        gpu-box-3:\n")
    else:
        write(tmp_path, "k8s_node_name: omen2\n", where)
    assert load_inventory(path).host_for_node("omen2") == host
    assert not Path(child.folder.name).exists()  # the stale read was ended, its folder removed


def test_a_script_or_plugin_inventory_is_read_only_when_a_load_needs_it(tmp_path: Path) -> None:
    from engine.connectors import inventory as inv_mod

    script = write(tmp_path, "#!/bin/sh\necho '{}'\n", "inv.sh", mode=0o755)
    plugin = write(tmp_path, "plugin: ansible.builtin.constructed\n", "constructed.yml")
    folder = tmp_path / "folder"
    write(folder, "all:\n  hosts:\n    a:\n", "static.yml")
    write(folder, "#!/bin/sh\necho '{}'\n", "dynamic.sh", mode=0o755)
    for path in (script, plugin, folder):
        assert not inv_mod.is_static(path)
        inv_mod.start_reading(path)
        assert path.resolve() not in inv_mod._started
    static = write(tmp_path, "all:\n  hosts:\n    a:\n", "static.yml")
    assert inv_mod.is_static(static) and inv_mod.is_static(tmp_path / "folder" / "static.yml")


def test_a_broken_inventory_read_early_is_refused_by_the_load_as_before(tmp_path: Path) -> None:
    from engine.connectors import inventory as inv_mod

    path = write(tmp_path, "all:\n  hosts:\n    omen2: [\n")
    with pytest.raises(LoadError) as before:
        load_inventory(path)
    inv_mod.start_reading(path)
    assert path.resolve() in inv_mod._started
    with pytest.raises(LoadError) as early:
        load_inventory(path)
    assert str(early.value) == str(before.value)


def test_a_read_nobody_collects_is_ended_at_exit(tmp_path: Path) -> None:
    from engine.connectors import inventory as inv_mod

    path = write(tmp_path, "all:\n  hosts:\n    a:\n")
    inv_mod.start_reading(path)
    child = inv_mod._started[path.resolve()]
    inv_mod._end_uncollected()
    assert child.proc.poll() is not None and not inv_mod._started
    assert not Path(child.folder.name).exists()
