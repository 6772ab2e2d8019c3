"""What an action will do, decided from facts alone (pure; no I/O).

Kube verbs live in ``engine.kube_verbs`` (one module per verb, each effect variant with its apply and
preview); their deciding functions are re-exported here for the callers that plan (``kube_effect``,
``apply_to_node``, ``select_pods``). ``ansible_command`` gives the ``ansible-playbook`` line an
operator would type for a playbook step. Actions must already be bound (templates rendered,
``checks.bind``) before they come here.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

from engine.kube_verbs import KubeEffect, NodePatch, NoOp, PodOperation, Wait, apply_to_node, kube_effect, select_pods
from engine.model import AnsibleSpec

__all__ = ["KubeEffect", "NoOp", "NodePatch", "PodOperation", "Wait", "ansible_command", "apply_to_node",
           "kube_effect", "select_pods"]


def _q(text: str) -> str:
    return shlex.quote(text)


def ansible_command(spec: AnsibleSpec, host: str, *, inventory: str = "INVENTORY",
                    playbooks_dir: str = "playbooks", extravars: Mapping[str, Any] | None = None) -> str:
    """``ansible-playbook -i INV playbooks/x.yml --limit omen2 -b -e '{...}'``."""
    parts = ["ansible-playbook", "-i", _q(inventory), _q(f"{playbooks_dir.rstrip('/')}/{spec.playbook}"),
             "--limit", _q(host)]
    if spec.become:
        parts.append("-b")
    evars = dict(extravars if extravars is not None else spec.vars)
    if evars:
        parts += ["-e", _q(json.dumps(evars, sort_keys=True))]
    return " ".join(parts)
