"""The node hosts' shims (run as programs on a temporary state folder) and the kubelet unit they drive.

Each test builds a host's state folder from the incident scenario, points the shims at it with
``RUNBOOK_LAB_HOST_STATE`` (and ``RUNBOOK_LAB_FSTAB``), and checks the real tools' output formats.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.lab import sim_kubelet
from engine.lab.hoststate import HostState
from engine.lab.scenario import KubeletFault, load_scenario
from engine.lab.sim_seed import fstab_text, host_state

SHIMS = Path(__file__).resolve().parents[3] / "engine" / "lab" / "shims"
NOW = 1_752_161_991.0
SWAP_LINE = ('"command failed" err="failed to run Kubelet: running with swap on is not supported, please '
             'disable swap or set --fail-swap-on flag to false"')

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mutating shims refuse non-root users, like the real tools")


@pytest.fixture
def host(tmp_path: Path) -> HostState:
    sc = load_scenario()
    node = sc.node("omen2")
    state, journal = host_state(node, sc, NOW)
    hs = HostState(tmp_path / "state")
    hs.initialise(state, journal)
    (tmp_path / "fstab").write_text(fstab_text(node))
    return hs


def run(host: HostState, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RUNBOOK_LAB_HOST_STATE": str(host.folder),
           "RUNBOOK_LAB_FSTAB": str(host.folder.parent / "fstab"), "TZ": "UTC"}
    return subprocess.run([sys.executable, str(SHIMS / tool), *args], capture_output=True, text=True, env=env,
                          check=False)


def advance(host: HostState, now: float) -> list[dict]:
    entries: list[dict] = []
    host.update(lambda s: entries.extend(sim_kubelet.step(s, now, 1.0, 2.0)))
    host.append_entries(entries)
    return entries


def test_swapon_show_prints_the_util_linux_table(host: HostState) -> None:
    assert run(host, "swapon", "--show").stdout == (
        "NAME      TYPE SIZE USED PRIO\n"
        "/swapfile file  32G 1.5G   -2\n")
    assert run(host, "swapon").stdout == run(host, "swapon", "--show").stdout


def test_swapon_show_raw_bytes_without_headings(host: HostState) -> None:
    result = run(host, "swapon", "--show", "--noheadings", "--raw", "--bytes")
    assert result.returncode == 0
    assert result.stdout == "/swapfile file 34359738368 1610612736 -2\n"
    assert run(host, "swapon", "--show=NAME", "--noheadings").stdout == "/swapfile\n"


def test_proc_swaps_has_the_kernel_format(host: HostState) -> None:
    lines = host.proc_swaps_path.read_text().splitlines()
    assert lines[0] == "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority"
    assert lines[1].split() == ["/swapfile", "file", "33554428", "1572864", "-2"]
    assert run(host, "swapon", "-s").stdout == host.proc_swaps_path.read_text()


@needs_root
def test_swapoff_all_turns_swap_off_and_is_recorded(host: HostState) -> None:
    inode = host.proc_swaps_path.stat().st_ino
    result = run(host, "swapoff", "-a")
    assert result.returncode == 0, result.stderr
    assert run(host, "swapon", "--show").stdout == ""
    assert host.proc_swaps_path.read_text().count("\n") == 1  # header only = off
    assert host.proc_swaps_path.stat().st_ino == inode  # rewritten in place (a bind mount follows the inode)
    assert [c["argv"] for c in host.calls("swapoff")] == [["-a"]]
    assert run(host, "swapoff", "/swapfile").returncode == 4  # not active any more


@needs_root
def test_swapon_all_enables_only_active_fstab_entries(host: HostState) -> None:
    run(host, "swapoff", "-a")
    fstab = host.folder.parent / "fstab"
    fstab.write_text(fstab.read_text().replace("/swapfile ", "#/swapfile ", 1))
    assert run(host, "swapon", "-a").returncode == 0
    assert run(host, "swapon", "--show").stdout == ""
    fstab.write_text(fstab.read_text().replace("#/swapfile ", "/swapfile ", 1))
    assert run(host, "swapon", "-a").returncode == 0
    assert run(host, "swapon", "--show", "--noheadings").stdout.startswith("/swapfile")
    assert [c["cmd"] for c in host.calls()] == ["swapoff", "swapon", "swapon"]


def test_systemctl_reports_a_crash_looping_kubelet_as_activating(host: HostState) -> None:
    result = run(host, "systemctl", "is-active", "kubelet")
    assert (result.stdout, result.returncode) == ("activating\n", 3)
    status = run(host, "systemctl", "status", "kubelet")
    assert status.returncode == 3
    assert "Active: activating (auto-restart) (Result: exit-code)" in status.stdout
    assert "status=1/FAILURE" in status.stdout
    show = run(host, "systemctl", "show", "kubelet", "-p", "ActiveState,SubState", "--value")
    assert show.stdout == "activating\nauto-restart\n"


def test_systemctl_lists_the_active_swap_unit(host: HostState) -> None:
    result = run(host, "systemctl", "list-units", "--type", "swap", "--all", "--no-legend", "--plain")
    assert result.stdout.split() == ["swapfile.swap", "loaded", "active", "active", "/swapfile"]


def test_systemctl_show_tells_a_fstab_swap_unit_from_others(host: HostState) -> None:
    result = run(host, "systemctl", "show", "--property=Id,FragmentPath,SourcePath", "--", "swapfile.swap")
    assert result.stdout == ("Id=swapfile.swap\nFragmentPath=/run/systemd/generator/swapfile.swap\n"
                             "SourcePath=/etc/fstab\n")
    # the fstab line commented out: turned on by hand now, a transient unit (no unit file, no source)
    fstab = host.folder.parent / "fstab"
    fstab.write_text(fstab.read_text().replace("/swapfile ", "# /swapfile ", 1))
    result = run(host, "systemctl", "show", "-p", "FragmentPath,SourcePath,Transient", "swapfile.swap")
    assert result.stdout == "FragmentPath=\nSourcePath=\nTransient=yes\n"
    # not in fstab and a unit file of its own (/etc/systemd/system)
    host.update(lambda s: s["swap"]["devices"]["/swapfile"].update(in_fstab=False))
    result = run(host, "systemctl", "show", "-p", "FragmentPath,SourcePath", "swapfile.swap")
    assert result.stdout == "FragmentPath=/etc/systemd/system/swapfile.swap\nSourcePath=\n"


def _swap_host(host: HostState, fstab: str, devices: dict[str, dict[str, object]], active: list[str]) -> None:
    (host.folder.parent / "fstab").write_text(fstab)
    host.update(lambda s: s.update(swap={"devices": devices, "active": active}))


def test_systemd_names_fstab_swap_units_after_their_spec_and_follows_the_devices_aliases(host: HostState) -> None:
    _swap_host(host, "UUID=5d2e-11 none swap sw 0 0\nLABEL=fast none swap nofail 0 0\n"
               "PARTUUID=0a1b-02 none swap sw,pri=5 0 0\n/dev/mapper/vg0-swap none swap sw 0 0\n",
               {"/dev/sdb2": {"type": "partition", "size": 1 << 30, "uuid": "5d2e-11"},
                "/dev/sdc1": {"type": "partition", "size": 1 << 30, "label": "fast"},
                "/dev/nvme0n1p3": {"type": "partition", "size": 1 << 30, "partuuid": "0a1b-02"},
                "/dev/dm-1": {"type": "partition", "size": 1 << 30, "aliases": ["/dev/mapper/vg0-swap"]}},
               ["/dev/sdb2", "/dev/sdc1", "/dev/nvme0n1p3", "/dev/dm-1"])
    listing = run(host, "systemctl", "list-units", "--type", "swap", "--all", "--plain", "--no-legend").stdout
    names = [line.split()[0] for line in listing.splitlines()]
    assert names == sorted(["dev-disk-by\\x2duuid-5d2e\\x2d11.swap", "dev-disk-by\\x2dlabel-fast.swap",
                            "dev-disk-by\\x2dpartuuid-0a1b\\x2d02.swap", "dev-mapper-vg0\\x2dswap.swap",
                            "dev-sdb2.swap", "dev-sdc1.swap", "dev-nvme0n1p3.swap", "dev-dm\\x2d1.swap"])
    show = run(host, "systemctl", "show", "-p", "Id,ActiveState,FragmentPath,SourcePath", "--", *names).stdout
    blocks = [dict(line.split("=", 1) for line in b.splitlines()) for b in show.strip().split("\n\n")]
    assert {b["Id"]: b["ActiveState"] for b in blocks} == dict.fromkeys(names, "active")  # each spec finds its device
    generated = {b["Id"] for b in blocks if b["SourcePath"] == "/etc/fstab"}
    assert generated == {n for n in names if n.startswith(("dev-disk", "dev-mapper"))}
    assert all(b["FragmentPath"] == "" for b in blocks if b["Id"] not in generated)  # the devices' own units


@needs_root
def test_swapoff_by_an_alias_and_swapon_all_with_pri_and_noauto_like_util_linux(host: HostState) -> None:
    _swap_host(host, "UUID=5d2e-11 none swap sw,pri=5 0 0\n/dev/mapper/vg0-swap none swap nofail 0 0\n"
               "LABEL=spare none swap noauto 0 0\n",
               {"/dev/sdb2": {"type": "partition", "size": 1 << 30, "uuid": "5d2e-11"},
                "/dev/dm-1": {"type": "partition", "size": 1 << 30, "aliases": ["/dev/mapper/vg0-swap"]},
                "/dev/sdd1": {"type": "partition", "size": 1 << 30, "label": "spare"}},
               ["/dev/dm-1"])
    assert run(host, "swapoff", "/dev/mapper/vg0-swap").returncode == 0
    assert run(host, "swapon", "--show").stdout == ""
    assert run(host, "swapon", "-a").returncode == 0  # every entry but the noauto one, pri= as priority
    shown = run(host, "swapon", "--show=NAME,PRIO", "--noheadings", "--raw").stdout.split("\n")
    assert shown[:2] == ["/dev/sdb2 5", "/dev/dm-1 -3"]
    assert len([x for x in shown if x]) == 2
    assert host.proc_swaps_path.read_text().splitlines()[1].split()[-1] == "5"
    assert run(host, "swapon", "LABEL=spare").returncode == 0  # by hand, by its label
    assert run(host, "swapon", "--show=NAME", "--noheadings").stdout.split() == ["/dev/sdb2", "/dev/dm-1", "/dev/sdd1"]


def test_journalctl_prints_the_kubelet_swap_error_and_systemd_lines(host: HostState) -> None:
    result = run(host, "journalctl", "-u", "kubelet", "-n", "5", "--no-pager")
    lines = result.stdout.splitlines()
    assert result.returncode == 0 and len(lines) == 5
    assert all(re.match(r"^\w{3} \d\d \d\d:\d\d:\d\d omen2 (kubelet|systemd)\[\d+\]: ", line) for line in lines)
    error = next(line for line in lines if "run.go:72]" in line)
    assert re.search(r"kubelet\[\d+\]: E\d{4} \d\d:\d\d:\d\d\.\d{6} +\d+ run\.go:72\] ", error)
    assert error.endswith(SWAP_LINE)
    assert lines[-2].endswith("systemd[1]: kubelet.service: Main process exited, code=exited, status=1/FAILURE")
    assert lines[-1].endswith("systemd[1]: kubelet.service: Failed with result 'exit-code'.")
    assert "Scheduled restart job, restart counter is at" in run(host, "journalctl", "-u", "kubelet").stdout


@needs_root
def test_restart_exits_zero_and_kubelet_dies_a_moment_later_while_swap_is_on(host: HostState) -> None:
    assert run(host, "systemctl", "restart", "kubelet").returncode == 0
    assert run(host, "systemctl", "is-active", "kubelet").stdout == "active\n"  # for a moment
    state = host.read()
    assert state["units"]["kubelet"]["active"] == "active"  # until the simulator sees it fail
    assert advance(host, state["units"]["kubelet"]["since"] + 0.5) == []  # still starting
    entries = advance(host, state["units"]["kubelet"]["since"] + 1.5)
    assert any(e["msg"].endswith(SWAP_LINE) for e in entries)
    assert run(host, "systemctl", "is-active", "kubelet").stdout == "activating\n"
    assert [c["argv"] for c in host.calls("systemctl")] == [["restart", "kubelet"]]


@needs_root
def test_kubelet_comes_up_at_its_next_automatic_restart_once_swap_is_off(host: HostState) -> None:
    run(host, "swapoff", "-a")
    restart_at = host.read()["units"]["kubelet"]["next_restart_at"]
    entries = advance(host, restart_at + 0.1)
    assert any("Scheduled restart job" in e["msg"] for e in entries)
    state = host.read()
    assert state["units"]["kubelet"]["active"] == "active" and state["kubelet"]["healthy"] is True
    assert run(host, "systemctl", "is-active", "kubelet").returncode == 0


@needs_root
def test_a_containerd_fault_clears_once_containerd_is_started(tmp_path: Path) -> None:
    sc = load_scenario()
    state, journal = host_state(sc.node("gpu-3090-2"), sc, NOW)
    hs = HostState(tmp_path / "state")
    hs.initialise(state, journal)
    assert "validate CRI v1 runtime API" in run(hs, "journalctl", "-u", "kubelet", "-n", "3").stdout
    assert run(hs, "systemctl", "is-active", "containerd").stdout == "failed\n"
    assert run(hs, "systemctl", "start", "containerd").returncode == 0
    advance(hs, hs.read()["units"]["kubelet"]["next_restart_at"] + 0.1)
    assert hs.read()["kubelet"]["healthy"] is True


def gpu_3090_2(tmp_path: Path) -> HostState:
    sc = load_scenario()
    state, journal = host_state(sc.node("gpu-3090-2"), sc, NOW)
    hs = HostState(tmp_path / "state")
    hs.initialise(state, journal)
    return hs


def test_crictl_answers_only_while_containerd_is_active(tmp_path: Path) -> None:
    hs = gpu_3090_2(tmp_path)
    down = run(hs, "crictl", "--runtime-endpoint", "unix:///run/containerd/containerd.sock", "info")
    assert down.returncode == 1 and "connect: no such file or directory" in down.stderr
    hs.update(lambda s: s["units"]["containerd"].update(active="active", sub="running"))
    up = run(hs, "crictl", "--runtime-endpoint", "unix:///run/containerd/containerd.sock", "info")
    assert up.returncode == 0 and "RuntimeReady" in up.stdout


@needs_root
def test_a_unit_whose_start_fails_is_left_failed_with_its_journal(tmp_path: Path) -> None:
    hs = gpu_3090_2(tmp_path)
    hs.update(lambda s: s["units"]["containerd"].update(
        start_error={"status": 1, "lines": ['level=fatal msg="failed to load TOML"']}))
    r = run(hs, "systemctl", "start", "containerd")
    assert r.returncode == 1 and "Job for containerd.service failed" in r.stderr
    assert run(hs, "systemctl", "is-active", "containerd").stdout == "failed\n"
    journal = run(hs, "journalctl", "-u", "containerd", "-n", "5").stdout
    assert "failed to load TOML" in journal and "Failed to start containerd.service" in journal
    assert [c["rc"] for c in hs.calls("systemctl")] == [1]


def test_lspci_shows_the_gpu_and_its_driver_binding(host: HostState) -> None:
    assert run(host, "lspci", "-nnk", "-d", "10de:").stdout == (
        "01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GB202 [GeForce RTX 5090] [10de:2b85] (rev a1)\n"
        "\tSubsystem: NVIDIA Corporation Device [10de:2055]\n"
        "\tKernel driver in use: nvidia\n"
        "\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia\n"
        "01:00.1 Audio device [0403]: NVIDIA Corporation Device [10de:22e8] (rev a1)\n"
        "\tSubsystem: NVIDIA Corporation Device [10de:2055]\n"
        "\tKernel driver in use: snd_hda_intel\n"
        "\tKernel modules: snd_hda_intel\n")
    host.update(lambda s: s["pci_devices"][0].update(driver="vfio-pci"))
    assert "\tKernel driver in use: vfio-pci\n" in run(host, "lspci", "-nnk", "-d", "10de:2b85").stdout


def test_nvidia_smi_lists_host_cuda_processes_only_on_the_nvidia_driver(host: HostState) -> None:
    query = ("--query-compute-apps=pid,process_name", "--format=csv,noheader")
    assert run(host, "nvidia-smi", *query).stdout == "41000, python3\n"
    assert run(host, "nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv").stdout == (
        "pid, used_gpu_memory [MiB]\n41000, 21504 MiB\n")
    host.update(lambda s: s["pci_devices"][0].update(driver="vfio-pci"))
    result = run(host, "nvidia-smi", *query)
    assert (result.stdout, result.returncode) == ("No devices were found\n", 6)


@pytest.fixture
def quad(tmp_path: Path) -> HostState:
    sc = load_scenario(SHIMS.parent / "scenarios" / "multi-gpu.yaml")
    state, journal = host_state(sc.node("gpu-quad"), sc, NOW)
    hs = HostState(tmp_path / "quad")
    hs.initialise(state, journal)
    return hs


def test_lspci_lists_each_gpu_of_a_node_with_its_own_slot_model_and_driver(quad: HostState) -> None:
    out = run(quad, "lspci", "-nnk", "-d", "10de:").stdout
    gpus = re.findall(r"^(\S+) VGA compatible controller \[0300\]: NVIDIA Corporation (.+) \[(10de:\w+)\] "
                      r"\(rev a1\)\n(?:\t.*\n)*?(?:\tKernel driver in use: (\S+)\n)?\tKernel modules", out, re.M)
    assert gpus == [("01:00.0", "GB202 [GeForce RTX 5090]", "10de:2b85", "nvidia"),
                    ("02:00.0", "GB202 [GeForce RTX 5090]", "10de:2b85", "vfio-pci"),
                    ("41:00.0", "GA102 [GeForce RTX 3090]", "10de:2204", "nvidia"),
                    ("c1:00.0", "AD102 [GeForce RTX 4090]", "10de:2684", "")]


def test_nvidia_smi_shows_each_cuda_job_on_its_own_gpu(quad: HostState) -> None:
    apps = run(quad, "nvidia-smi", "--query-compute-apps=pid,process_name,gpu_bus_id", "--format=csv,noheader")
    assert apps.stdout == "41000, python3, 00000000:01:00.0\n41001, train.py, 00000000:41:00.0\n"
    gpus = run(quad, "nvidia-smi", "--query-gpu=index,pci.bus_id,memory.used", "--format=csv,noheader,nounits")
    assert gpus.stdout == "0, 00000000:01:00.0, 21504\n1, 00000000:41:00.0, 18432\n"  # vfio-pci, none: invisible
    assert re.findall(r"GPU (\d)  PID (\d+)", run(quad, "nvidia-smi").stdout) == [("0", "41000"), ("1", "41001")]


def test_read_only_tools_work_without_the_state_lock_being_writable(host: HostState) -> None:
    for tool, args in (("journalctl", ["-u", "kubelet", "-n", "1"]), ("lspci", ["-nn"]),
                       ("swapon", ["--show"]), ("systemctl", ["is-active", "kubelet"])):
        assert run(host, tool, *args).stderr == "", tool


def test_a_no_heartbeat_fault_keeps_kubelet_active_but_silent(tmp_path: Path) -> None:
    sc = load_scenario()
    fault = KubeletFault(mode="no-heartbeat", lines=[
        "E bootstrap.go:266] part of the existing bootstrap client certificate in /etc/kubernetes/kubelet.conf "
        "is expired: 2025-03-20 08:12:44 +0000 UTC"])
    node = sc.node("worker-1").model_copy(update={"host": sc.node("worker-1").host.model_copy(update={
        "kubelet": sc.node("gpu-3090-3").host.kubelet.model_copy(update={"fault": fault,
                                                                         "client_cert_expired": False})})})
    state, journal = host_state(node, sc, NOW)
    hs = HostState(tmp_path / "state")
    hs.initialise(state, journal)
    assert hs.read()["units"]["kubelet"]["active"] == "active"  # it runs...
    assert hs.read()["kubelet"]["healthy"] is False  # ...but posts no heartbeat
    assert "bootstrap client certificate" in run(hs, "journalctl", "-u", "kubelet").stdout
