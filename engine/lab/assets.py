"""Find, or build once, the control-plane binaries (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler) in a folder laid out like envtest's ``KUBEBUILDER_ASSETS``.

Lookup order: ``KUBEBUILDER_ASSETS`` (only when it holds all four: setup-envtest's folders lack
controller-manager and scheduler), then ``RUNBOOK_ASSETS``, then ``~/.cache/runbook/k8s-v1.20.2``.
Building runs the shipped ``engine/data/build-control-plane.sh``. This module never installs anything
system-wide and never puts binaries inside the repository.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from engine.lab.errors import AssetsError

BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
KUBERNETES_VERSION = "v1.20.2"


def default_cache_dir() -> Path:
    """Where the build script puts the binaries: ``$RUNBOOK_ASSETS`` or ``~/.cache/runbook/k8s-v1.20.2``."""
    configured = os.environ.get("RUNBOOK_ASSETS")
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "runbook" / f"k8s-{KUBERNETES_VERSION}"


def assets_complete(folder: Path) -> bool:
    """True when ``folder`` holds all four binaries, non-empty and executable."""
    for name in BINARIES:
        path = folder / name
        if not (path.is_file() and path.stat().st_size > 0 and os.access(path, os.X_OK)):
            return False
    return True


def find_assets() -> Path | None:
    """The first complete assets folder (see the module docstring for the order), or None."""
    candidates = []
    if os.environ.get("KUBEBUILDER_ASSETS"):
        candidates.append(Path(os.environ["KUBEBUILDER_ASSETS"]).expanduser())
    candidates.append(default_cache_dir())
    for folder in candidates:
        if assets_complete(folder):
            return folder.resolve()
    return None


def build_script() -> Path:
    """The shipped build script (inside the installed package)."""
    return Path(str(resources.files("engine") / "data" / "build-control-plane.sh"))


def ensure_assets(progress: Callable[[str], object] = print) -> Path:
    """Return a complete assets folder, building it first (~6 min cold) when there is none.

    ``progress`` receives every line the build prints. Raises AssetsError when the build fails.
    """
    found = find_assets()
    if found is not None:
        return found
    script = build_script()
    progress(f"control-plane binaries not found: building them with {script} (about 6 minutes)")
    with subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, stdin=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            progress(line.rstrip("\n"))
        code = proc.wait()
    found = find_assets()
    if code != 0 or found is None:
        raise AssetsError(f"building the control-plane binaries failed (exit {code}); see the output above")
    return found
