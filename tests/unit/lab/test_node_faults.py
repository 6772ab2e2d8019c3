"""``runbook lab inject`` words ``kubelet-cert-expired``, ``swap``, ``containerd`` (engine/lab/node_faults.py):
each put into a healthy node's host state folder, then kubelet's next start as the simulator steps it
(``sim_kubelet.step``): the scenario node's lines, the crash loop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine.lab import inject, sim_kubelet
from engine.lab.hoststate import HostState
from engine.lab.scenario import load_scenario
from engine.lab.sim_seed import host_state

NOW = 1_780_000_000.0
WORDS = {"kubelet-cert-expired", "swap", "containerd"}


class FakeLab:
    """What ``inject`` reads of a lab: its record (node -> state folder, no SSH host) and that it runs."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.dir = folder, Path("/nonexistent-lab")

    def record(self) -> dict[str, Any]:
        return {"nodes": {"worker-1": {"state_dir": str(self.folder)}}, "hosts": {}}

    def running(self) -> bool:
        return True


@pytest.fixture
def healthy(tmp_path: Path) -> HostState:
    sc = load_scenario()
    state, journal = host_state(sc.node("worker-1"), sc, NOW)
    hs = HostState(tmp_path / "state")
    hs.initialise(state, journal)
    return hs


def put(hs: HostState, word: str) -> str:
    return str(inject.inject(FakeLab(hs.folder), word, "worker-1")["did"])  # type: ignore[arg-type]


def next_start(hs: HostState) -> str:
    """kubelet's journal lines of the start the injection asked for."""
    entries: list[dict[str, Any]] = []
    later = time.time() + 10  # the injection restarted kubelet now (wall clock): its start is evaluated later
    hs.update(lambda s: entries.extend(sim_kubelet.step(s, later, 1.0, 2.0)))
    return "\n".join(e["msg"] for e in entries)


def test_the_three_words_are_registered_with_a_summary_and_take_no_gpu() -> None:
    known = inject.faults()
    assert set(known) >= WORDS
    assert all(known[w].summary and not known[w].gpu for w in WORDS)


def test_kubelet_cert_expired_makes_kubelet_exit_with_its_expired_certificate_lines(healthy: HostState) -> None:
    assert "client certificate expired" in put(healthy, "kubelet-cert-expired")
    assert healthy.read()["kubelet"]["client_cert_expired"] is True
    lines = next_start(healthy)
    assert "bootstrap client certificate in /etc/kubernetes/kubelet.conf is expired" in lines
    assert "unable to load bootstrap kubeconfig" in lines and "status=1/FAILURE" in lines


def test_swap_turns_a_swapfile_on_and_kubelet_refuses_to_start(healthy: HostState) -> None:
    put(healthy, "swap")
    state = healthy.read()
    assert state["swap"]["active"] == ["/swap.img"]
    assert "/swap.img" in healthy.proc_swaps_path.read_text()
    assert "running with swap on is not supported" in next_start(healthy)


def test_containerd_fails_and_kubelet_cannot_reach_the_cri_socket(healthy: HostState) -> None:
    put(healthy, "containerd")
    state = healthy.read()
    assert state["units"]["containerd"]["active"] == "failed"
    assert "containerd.sock" in next_start(healthy)
    journal = "\n".join(e["msg"] for e in healthy.journal("containerd"))
    assert "Failed to start containerd.service" in journal
