"""Facts are parsed at the connector boundary: command outputs and API JSON in, typed facts out."""

from __future__ import annotations

import base64
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from engine.connectors.ansible import explain_failure, task_message, unified_diffs
from engine.connectors.kube import (
    format_microtime,
    lease_record_from_dict,
    node_facts_from_dict,
    parse_time,
    pod_ref_from_dict,
)
from engine.errors import HostError
from engine.facts import SwapDevice
from engine.hostfacts import (
    decode_probes,
    fstab_active_swap,
    parse_cgroup,
    parse_cuda_processes,
    parse_lspci,
    parse_proc_swaps,
    parse_swapon,
    parse_unit_properties,
    probe_task_file,
    unhandled_swap_sources,
)
from engine.hostfacts import parse_host_facts as parse_runbook_facts

REPO = Path(__file__).resolve().parents[2]

LSPCI_NVIDIA = """\
01:00.0 VGA compatible controller [0300]: NVIDIA Corporation GB202 [GeForce RTX 5090] [10de:2b85] (rev a1)
\tSubsystem: NVIDIA Corporation Device [10de:2055]
\tKernel driver in use: nvidia
\tKernel modules: nvidiafb, nouveau, nvidia_drm, nvidia
01:00.1 Audio device [0403]: NVIDIA Corporation Device [10de:22e8] (rev a1)
\tSubsystem: NVIDIA Corporation Device [10de:0000]
\tKernel driver in use: snd_hda_intel
\tKernel modules: snd_hda_intel
"""
LSPCI_VFIO = LSPCI_NVIDIA.replace("Kernel driver in use: nvidia", "Kernel driver in use: vfio-pci")
LSPCI_UNBOUND = """\
0000:41:00.0 3D controller [0302]: NVIDIA Corporation GA102 [GeForce RTX 3090] [10de:2204] (rev a1)
\tSubsystem: Micro-Star International Co., Ltd. [MSI] Device [1462:3881]
\tKernel modules: nvidiafb, nouveau
"""

TRICKY_FSTAB = """\
# /etc/fstab: static file system information.
# <file system> <mount point>   <type>  <options>       <dump>  <pass>
UUID=1111-2222 /               ext4    errors=remount-ro 0       1
# swap was on /dev/sda3 during installation; see swapfile notes
#/dev/sda3 none swap sw 0 0
  # /swap.img none swap sw 0 0
/dev/sdb1 /data/swapfiles-backup ext4 defaults 0 2
/swapfile                                 none            swap    sw              0       0
UUID=5d2e6b1a-9f0e-4b5c-8c11-7a7c1b0d2e3f none swap sw,pri=5 0 0
\t/swap2.img\tnone\tswap\tdefaults\t0\t0
tmpfs /tmp tmpfs defaults,size=2G 0 0
/swapdir/data /srv/swapped ext4 defaults 0 2
LABEL=fastswap none swap nofail 0 0
PARTUUID=0a1b2c3d-02 none swap sw,pri=10,nofail 0 0
/dev/mapper/vg0-swap none swap sw 0 0
UUID=9f9f-0001 none swap noauto 0 0
LABEL=spare none swap sw,noauto,pri=1 0 0
/dev/sdb2 /mnt/noauto-swap ext4 noauto 0 0
"""
ACTIVE_IN_TRICKY = (  # the entries that turn swap on at boot: any device spec, not noauto
    "/swapfile                                 none            swap    sw              0       0",
    "UUID=5d2e6b1a-9f0e-4b5c-8c11-7a7c1b0d2e3f none swap sw,pri=5 0 0",
    "/swap2.img\tnone\tswap\tdefaults\t0\t0",
    "LABEL=fastswap none swap nofail 0 0",
    "PARTUUID=0a1b2c3d-02 none swap sw,pri=10,nofail 0 0",
    "/dev/mapper/vg0-swap none swap sw 0 0",
)


def probe_lines(**outputs: tuple[int, str]) -> list[str]:
    """What tasks/facts.yml prints: NAME RC BASE64(stdout)."""
    return [f"{name.replace('__', ':')} {rc} {base64.b64encode(text.encode()).decode()}"
            for name, (rc, text) in outputs.items()]


# -- GPU driver binding ----------------------------------------------------------------------------
def test_lspci_with_the_nvidia_driver_bound_gives_one_gpu_and_skips_the_audio_function() -> None:
    (gpu,) = parse_lspci(LSPCI_NVIDIA)
    assert gpu.slot == "01:00.0"
    assert gpu.vendor_device == "10de:2b85"
    assert gpu.driver == "nvidia"
    assert "GeForce RTX 5090" in gpu.name


def test_lspci_after_a_passthrough_rebind_shows_vfio_pci() -> None:
    assert [g.driver for g in parse_lspci(LSPCI_VFIO)] == ["vfio-pci"]


def test_lspci_without_a_kernel_driver_in_use_line_means_driver_none() -> None:
    (gpu,) = parse_lspci(LSPCI_UNBOUND)
    assert (gpu.slot, gpu.vendor_device, gpu.driver) == ("0000:41:00.0", "10de:2204", "none")


def test_lspci_with_no_nvidia_device_gives_no_gpu() -> None:
    assert parse_lspci("") == ()


# -- swap ------------------------------------------------------------------------------------------
def test_swapon_raw_bytes_output_gives_devices_with_sizes_and_unescaped_names() -> None:
    text = "/swapfile file 34359738368 0 -2\n/dev/zram0 partition 8589934592 1024 100\n" \
           "/var/swap\\x20file file 1024 0 -3\n"
    assert parse_swapon(text) == (SwapDevice("/swapfile", "file", 34359738368),
                                  SwapDevice("/dev/zram0", "partition", 8589934592),
                                  SwapDevice("/var/swap file", "file", 1024))
    assert parse_swapon("") == ()


def test_proc_swaps_header_only_means_no_swap_and_sizes_are_kib() -> None:
    header = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
    assert parse_proc_swaps(header) == ()
    assert parse_proc_swaps(header + "/swapfile                               file\t\t33554428\t0\t\t-2\n") == \
        (SwapDevice("/swapfile", "file", 33554428 * 1024),)


def test_fstab_active_swap_is_only_uncommented_lines_of_type_swap() -> None:
    assert fstab_active_swap(TRICKY_FSTAB) == ACTIVE_IN_TRICKY
    assert fstab_active_swap("") == ()


def test_the_swap_off_playbook_comments_out_exactly_the_lines_the_facts_call_active() -> None:
    """The playbook's replace regexp and the engine's parser must agree on every tricky line."""
    play = yaml.safe_load((REPO / "playbooks" / "swap-off.yml").read_text())
    tasks = play[0]["tasks"][0]["block"]
    replace = next(t["ansible.builtin.replace"] for t in tasks if "ansible.builtin.replace" in t)
    # ansible.builtin.replace applies the regexp with re.MULTILINE
    result = re.sub(replace["regexp"], replace["replace"], TRICKY_FSTAB, flags=re.M)
    assert fstab_active_swap(result) == ()
    assert "\nUUID=9f9f-0001 none swap noauto 0 0\n" in result  # noauto entries stay as they are
    changed = [(a, b) for a, b in zip(TRICKY_FSTAB.splitlines(), result.splitlines(), strict=True) if a != b]
    assert [a.strip() for a, _ in changed] == [line.strip() for line in ACTIVE_IN_TRICKY]
    assert all(b.startswith("# ") for _, b in changed)
    again = re.sub(replace["regexp"], replace["replace"], result, flags=re.M)
    assert again == result  # idempotent


def test_zram_devices_and_swap_units_not_from_fstab_are_unhandled_sources() -> None:
    devices = (SwapDevice("/swapfile"), SwapDevice("/dev/zram0", "partition"))
    units = parse_unit_properties(
        "Id=swapfile.swap\nActiveState=active\nFragmentPath=/run/systemd/generator/swapfile.swap\n"
        "SourcePath=/etc/fstab\n\n"
        "Id=dev-zram0.swap\nActiveState=active\nFragmentPath=/run/systemd/generator/dev-zram0.swap\n"
        "SourcePath=/usr/lib/systemd/zram-generator.conf\n\n"
        "Id=dev-sda2.swap\nActiveState=active\nFragmentPath=\nSourcePath=\n\n"
        "Id=extra.swap\nActiveState=inactive\nFragmentPath=/etc/systemd/system/extra.swap\nSourcePath=\n")
    assert unhandled_swap_sources(devices, units) == (
        "zram device /dev/zram0",
        "systemd unit dev-zram0.swap (/run/systemd/generator/dev-zram0.swap)",
        "systemd unit extra.swap (/etc/systemd/system/extra.swap)",
    )


# -- CUDA processes ---------------------------------------------------------------------------------
def test_nvidia_smi_compute_apps_csv_gives_pids_and_names() -> None:
    procs = parse_cuda_processes("4242, python3\n4243, /usr/bin/torchrun\n")
    assert [(p.pid, p.name) for p in procs] == [(4242, "python3"), (4243, "/usr/bin/torchrun")]
    assert parse_cuda_processes("No running processes found\n") == ()


# -- the whole runbook_facts record --------------------------------------------------------------------
def sample_facts(**overrides: tuple[int, str]) -> dict[str, object]:
    outputs = {
        "swapon": (0, "/swapfile file 34359738368 0 -2\n"),
        "proc_swaps": (0, "Filename\tType\tSize\tUsed\tPriority\n/swapfile file 33554428 0 -2\n"),
        "fstab": (0, TRICKY_FSTAB),
        "swap_units": (0, "swapfile.swap loaded active active /swapfile\n"),
        "active__kubelet": (3, "activating\n"),
        "journal__kubelet": (0, 'E0710 15:39:51 run.go:72] "command failed" err="failed to run Kubelet: '
                                'running with swap on is not supported, please disable swap"\n'),
        "lspci": (0, LSPCI_NVIDIA),
        "nvidia_smi": (0, "4242, python3\n"),
    }
    outputs.update(overrides)
    return {"version": 1, "host": "omen2", "node": "omen2", "services": ["kubelet"],
            "probes": probe_lines(**outputs)}


def test_runbook_facts_of_the_incident_node_parse_into_host_facts() -> None:
    facts = parse_runbook_facts("omen2", sample_facts())
    assert facts.swap_active
    assert facts.swap_devices[0].size_bytes == 34359738368
    assert facts.fstab_active_swap == ACTIVE_IN_TRICKY
    assert facts.unhandled_swap_sources == ()
    # is-active exits 3 for "activating": the state is the word, not a failure
    assert facts.service("kubelet").state == "activating"
    assert "swap on is not supported" in facts.service("kubelet").journal_tail
    assert facts.gpu_driver == "nvidia"
    assert [p.pid for p in facts.cuda_processes] == [4242]


UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def test_a_cuda_process_cgroup_names_its_pod_with_either_cgroup_driver_and_a_host_process_none() -> None:
    systemd = ("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
               f"{UID.replace('-', '_')}.slice/cri-containerd-0123abcd.scope\n")
    assert parse_cgroup(systemd) == (systemd.split("::")[1].strip(), UID)
    cgroupfs_v1 = (f"12:pids:/kubepods/burstable/pod{UID}/0123abcd\n"
                   f"1:name=systemd:/kubepods/burstable/pod{UID}/0123abcd\n")
    assert parse_cgroup(cgroupfs_v1)[1] == UID
    assert parse_cgroup("0::/system.slice/train.service\n") == ("/system.slice/train.service", "")
    assert parse_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n")[1] == ""
    # a pod-looking name outside kubepods is not a pod
    assert parse_cgroup(f"0::/system.slice/pod{UID}.service\n")[1] == ""
    assert parse_cgroup("") == ("", "")


def test_each_cuda_process_gets_the_pod_its_cgroup_names_and_an_unreadable_one_none() -> None:
    facts = parse_runbook_facts("gpu-quad", sample_facts(
        nvidia_smi=(0, "4242, python3, 00000000:01:00.0\n5001, train.py, 00000000:02:00.0\n"
                       "5002, gone.py, 00000000:02:00.0\n"),
        cgroup__4242=(0, "0::/system.slice/cuda-job.service\n"),
        cgroup__5001=(0, f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/cri-containerd-1.scope\n"),
        cgroup__5002=(1, "")))  # exited between nvidia-smi and the read, or hidden (hidepid)
    assert [(p.pid, p.gpu, p.pod_uid) for p in facts.cuda_processes] == [
        (4242, "01:00.0", ""), (5001, "02:00.0", UID), (5002, "02:00.0", "")]
    assert facts.cuda_processes[0].cgroup == "/system.slice/cuda-job.service" and facts.cuda_processes[2].cgroup == ""


def test_the_boot_id_is_read_and_garbage_is_no_boot_id() -> None:
    boot = "6b1f0c52-1d0e-4a8e-9d7a-3f5e2c1b0a99"
    assert parse_runbook_facts("omen2", sample_facts(boot_id=(0, boot + "\n"))).boot_id == boot
    assert parse_runbook_facts("omen2", sample_facts(boot_id=(1, ""))).boot_id == ""
    assert parse_runbook_facts("omen2", sample_facts(boot_id=(0, "not a boot id\n"))).boot_id == ""


def test_missing_lspci_and_nvidia_smi_mean_no_gpu_and_no_cuda_processes() -> None:
    facts = parse_runbook_facts("omen2", sample_facts(lspci=(127, ""), nvidia_smi=(127, "")))
    assert facts.gpus == () and facts.gpu_driver == "none"
    assert facts.cuda_processes == ()


def test_a_failing_swapon_falls_back_to_proc_swaps() -> None:
    facts = parse_runbook_facts("omen2", sample_facts(swapon=(127, "")))
    assert [d.name for d in facts.swap_devices] == ["/swapfile"]


def test_no_readable_swap_state_is_an_error_not_no_swap() -> None:
    with pytest.raises(HostError, match="swap state"):
        parse_runbook_facts("omen2", sample_facts(swapon=(1, ""), proc_swaps=(1, "")))


def test_a_missing_systemctl_leaves_the_service_state_unknown() -> None:
    facts = parse_runbook_facts("omen2", sample_facts(active__kubelet=(127, "")))
    assert facts.service("kubelet").state == "unknown"
    assert facts.service("containerd").state == "unknown"  # never asked for


def test_requested_files_report_existence_content_and_digest() -> None:
    data = sample_facts(file__0=(0, "marker=done\n"),
                        sha256__0=(0, "ab12  /var/tmp/runbook-example\n"),
                        file__1=(1, ""), sha256__1=(1, ""))
    data["files"] = ["/var/tmp/runbook-example", "/nope"]
    facts = parse_runbook_facts("omen2", data)
    assert facts.files["/var/tmp/runbook-example"].content == "marker=done\n"
    assert facts.files["/var/tmp/runbook-example"].sha256 == "ab12"
    assert not facts.files["/nope"].exists


def test_an_unknown_facts_version_is_refused() -> None:
    with pytest.raises(HostError, match="version"):
        parse_runbook_facts("omen2", {"version": 2, "probes": []})


def test_garbled_probe_lines_are_skipped() -> None:
    assert decode_probes(["swapon 0 !!notbase64", "x", "fstab 0", "lspci abc Zm9v"]) == {"fstab": (0, "")}


def test_raw_task_output_from_a_tty_and_the_plain_swap_lines_for_playbooks_are_read_right() -> None:
    """tasks/facts-probe.yml is a raw task: its output comes through a tty (\\r\\n, a blank first
    line) and carries plain "swap-device"/"swap-unhandled" lines for swap-off.yml."""
    swapon = base64.b64encode(b"/swapfile file 34359738368 0 -2\n").decode()
    lines = ["", f"swapon 0 {swapon}\r", "swap-device /swapfile", "swap-device 5",
             "swap-unhandled systemd unit dev-zram0.swap (/etc/systemd/system/dev-zram0.swap)", "fstab 0 \r"]
    probes = decode_probes(lines)
    assert probes["swapon"] == (0, "/swapfile file 34359738368 0 -2\n") and probes["fstab"] == (0, "")
    assert set(probes) <= {"swapon", "fstab", "swap-device"}  # a plain line is never a probe the parser reads


# -- task results -------------------------------------------------------------------------------------
def test_check_mode_diffs_become_unified_diff_text() -> None:
    (text,) = unified_diffs([{"before": "a\nb\n", "after": "a\n# b\n", "before_header": "/etc/fstab",
                              "after_header": "/etc/fstab"}, {"before": "same", "after": "same"}])
    assert text.startswith("--- /etc/fstab\n+++ /etc/fstab\n")
    assert "-b\n+# b\n" in text
    assert unified_diffs({"prepared": "changed: x"}) == ("changed: x",)


def test_become_failures_are_named_in_plain_words() -> None:
    assert explain_failure("omen2", "Task failed: Incorrect sudo password").startswith(
        "become password rejected on omen2")
    assert explain_failure("omen2", "Task failed: Missing sudo password").startswith(
        "become password needed on omen2")
    assert explain_failure("omen2", "boom") == "omen2: boom"
    assert task_message({"msg": "", "stderr": "swapoff: /swapfile:\n failed"}) == "swapoff: /swapfile: failed"


# -- Kubernetes API objects -----------------------------------------------------------------------------
def test_a_node_as_the_api_serves_it_becomes_node_facts() -> None:
    node = node_facts_from_dict({
        "metadata": {"name": "omen2", "resourceVersion": "42",
                     "labels": {"nvidia.com/gpu.workload.config": "vm-passthrough"}},
        "spec": {"unschedulable": True, "taints": [
            {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                                   "message": "Kubelet stopped posting node status."}],
                   "allocatable": {"nvidia.com/gpu": "1", "cpu": "16"}},
    })
    assert node.name == "omen2" and node.exists and not node.ready and node.unschedulable
    assert node.labels["nvidia.com/gpu.workload.config"] == "vm-passthrough"
    assert node.taints[0].key == "node.kubernetes.io/unreachable" and node.taints[0].value == ""
    assert node.condition("Ready").reason == "NodeStatusUnknown"  # type: ignore[union-attr]
    assert node.allocatable["nvidia.com/gpu"] == "1"
    assert node.resource_version == "42"


def test_microtime_always_has_six_fractional_digits_even_on_a_whole_second() -> None:
    whole = datetime(2026, 7, 10, 15, 39, 51, tzinfo=UTC).timestamp()
    assert format_microtime(whole) == "2026-07-10T15:39:51.000000Z"
    assert format_microtime(whole + 0.25) == "2026-07-10T15:39:51.250000Z"
    assert parse_time("2026-07-10T15:39:51.250000Z") == whole + 0.25
    assert parse_time("2026-07-10T15:39:51Z") == whole
    assert parse_time(None) == 0.0


def test_a_lease_as_the_api_serves_it_becomes_a_lease_record() -> None:
    lease = lease_record_from_dict({
        "metadata": {"name": "runbook-node-omen2", "namespace": "kube-system", "resourceVersion": "7"},
        "spec": {"holderIdentity": "runbook/abc", "leaseDurationSeconds": 60,
                 "acquireTime": "2026-07-10T15:39:51.000000Z", "renewTime": "2026-07-10T15:40:01.500000Z"}})
    assert (lease.holder, lease.duration_seconds, lease.resource_version) == ("runbook/abc", 60, "7")
    assert lease.renew_time - lease.acquire_time == pytest.approx(10.5)


def test_a_pod_as_the_api_serves_it_becomes_a_pod_ref_with_what_it_asks_for() -> None:
    pod = pod_ref_from_dict({
        "metadata": {"namespace": "ml", "name": "train", "labels": {"app": "torch"}},
        "spec": {"nodeName": "omen2", "containers": [
            {"name": "a", "resources": {"limits": {"nvidia.com/gpu": "1"}, "requests": {"cpu": "500m"}}},
            {"name": "b", "resources": {"requests": {"nvidia.com/gpu": "1", "cpu": "1"}}}]},
        "status": {"phase": "Running"}})
    assert (pod.namespace, pod.name, pod.node, pod.phase) == ("ml", "train", "omen2", "Running")
    assert pod.labels["app"] == "torch"
    assert pod.requests["nvidia.com/gpu"] == "2"  # a limit-only extended resource counts
    assert pod.requests["cpu"] == "1.5"  # summed by engine.resources (500m + 1)


def test_the_committed_facts_probe_task_is_what_the_host_fact_units_generate() -> None:
    """tasks/facts-probe.yml is generated from engine/hostfacts.py: one raw task, each fact's lines."""
    committed = (REPO / "playbooks/tasks/facts-probe.yml").read_text()
    assert committed == probe_task_file(), \
        "regenerate: python -m engine.hostfacts > playbooks/tasks/facts-probe.yml"
    tasks = yaml.safe_load(committed)
    assert len(tasks) == 1 and "ansible.builtin.raw" in tasks[0]  # still one SSH round trip
