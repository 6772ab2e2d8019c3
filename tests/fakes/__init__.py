"""Every test double of the unit tests, in one package (nothing of them ships in ``engine``).

One module a thing faked, each with the behaviours all its users need:

* ``clock``: ``FakeClock`` (fake time; unit tests never really sleep), ``wait_for`` (the one poll in
  real time) and ``raise_scripted`` (the ``fail`` mappings every fake connector scripts its failures with).
* ``kube``: ``FakeKube``, the one fake ``KubeAPI`` (nodes, pods, objects, Leases, Node Events; the
  server's cluster view reads it too), and ``make_node``, the one node builder.
* ``hosts``: ``FakeNodes`` (``NodeAutomation`` over scripted host facts) and ``make_host``.
* ``sink``: ``RecordingSink``, an ``EventSink`` that keeps what it is given.
* ``incident``: the omen2 incident as facts, and the flagship's host behaviour on the fakes.
* ``serve``: ``runbook serve`` without run machinery or a cluster (``FakeRunStarter``,
  ``FakeLeadership``, ``StaticClusterView``, ``alert``/``webhook``, ``served``).
* Loopback HTTP fakes of outside services, imported from their modules: ``notify`` (PagerDuty
  Events v2 and a webhook receiver), ``oncall`` (PagerDuty REST, Slack's Web API, Alertmanager's
  status); ``http`` holds what they share.

The names of the in-process fakes are re-exported here: ``from tests.fakes import FakeKube``.
The run store's contract suite is not a fake: it is ``tests/store_contract.py``.
"""

from tests.fakes.clock import FakeClock, raise_scripted, wait_for
from tests.fakes.hosts import FakeNodes, PlaybookEffect, make_host, quad_gpus
from tests.fakes.incident import (
    GPU_LABEL,
    SWAP_REFUSAL,
    GpuHostLog,
    KubeletComeback,
    healthy_host,
    healthy_node,
    incident_host,
    incident_node,
    install_gpu_host,
    install_recovery_effects,
)
from tests.fakes.kube import GPU_COUNT_LABEL, FakeKube, make_node
from tests.fakes.serve import (
    APPROVE,
    APPROVER_TOKEN,
    AUTH,
    DIGEST,
    FSTAB_DIFF,
    INCIDENT_NODES,
    READ,
    READER_TOKEN,
    TOKEN,
    FakeLeadership,
    FakeRunStarter,
    Served,
    StaticClusterView,
    alert,
    saved_plan,
    served,
    trigger_spec,
    two_steps_then,
    webhook,
)
from tests.fakes.sink import RecordingSink

__all__ = [
    "APPROVE", "APPROVER_TOKEN", "AUTH", "DIGEST", "FSTAB_DIFF", "GPU_COUNT_LABEL", "GPU_LABEL", "INCIDENT_NODES",
    "READ", "READER_TOKEN", "SWAP_REFUSAL", "TOKEN", "FakeClock", "FakeKube", "FakeLeadership", "FakeNodes",
    "FakeRunStarter", "GpuHostLog", "KubeletComeback", "PlaybookEffect", "RecordingSink", "Served",
    "StaticClusterView", "alert", "healthy_host", "healthy_node", "incident_host", "incident_node",
    "install_gpu_host", "install_recovery_effects", "make_host", "make_node", "quad_gpus", "raise_scripted",
    "saved_plan", "served", "trigger_spec", "two_steps_then", "wait_for", "webhook",
]
