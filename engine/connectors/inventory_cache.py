"""The last ``ansible-inventory --list`` of a static inventory, kept on disk for the next command.

Every command that plans or runs reads the inventory through an ``ansible-inventory`` child
(engine.connectors.inventory): ~1.2 s of CPU, most of it importing ansible-core. An inventory made
only of files (no executable script, no inventory plugin config: ``inventory.is_static``) lists the
same hosts until one of its files changes, so the listing of the last read is kept, one file per
inventory path, under ``$RUNBOOK_CACHE_DIR`` (else ``$XDG_CACHE_HOME/runbook``, else
``~/.cache/runbook``) ``/inventory/``, and used while its key still matches.

The key is everything the listing depends on: the resolved path, the stat (mtime and ctime in ns,
size, inode) of every source file and of ``group_vars/`` and ``host_vars/`` beside it, the
environment the child gets, the Python and the ansible-core version. A read is stored only when
the sources did not change while it ran. Not cached at all: dynamic inventories (scripts and
plugins, whose answer changes without a file changing), and reads under an ``ANSIBLE_*`` variable
the operator passes on (``RUNBOOK_ANSIBLE_ENV``: a vars plugin may read anything).

The cache holds what the inventory's files hold (host variables included), so its folder is the
user's own (0700) and each file 0600; where it cannot be written (a read-only root filesystem),
commands read as before. What it must not do: return a listing for other sources than those read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

CACHE_ENV = "RUNBOOK_CACHE_DIR"


def cache_dir() -> Path:
    """``$RUNBOOK_CACHE_DIR/inventory``, else ``$XDG_CACHE_HOME/runbook/inventory``, else
    ``~/.cache/runbook/inventory``."""
    base = os.environ.get(CACHE_ENV) or str(Path(os.environ.get("XDG_CACHE_HOME")
                                                 or Path.home() / ".cache") / "runbook")
    return Path(base) / "inventory"


@functools.cache
def _ansible_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ansible-core")
    except PackageNotFoundError:
        return "?"


def cache_key(resolved: Path, stamp: tuple[Any, ...], env: Mapping[str, str]) -> str | None:
    """The key of a read of ``resolved`` with sources ``stamp`` under the child's ``env``; None when
    such a read must not be cached (an ``ANSIBLE_*`` setting passed on)."""
    if any(k.startswith("ANSIBLE_") for k in env):
        return None
    material = json.dumps([str(resolved), repr(stamp), sys.executable, _ansible_version()])
    return hashlib.sha256(material.encode()).hexdigest()


def _file(resolved: Path) -> Path:
    return cache_dir() / (hashlib.sha256(str(resolved).encode()).hexdigest()[:40] + ".json")


def load(resolved: Path, key: str) -> tuple[Mapping[str, Any], list[str]] | None:
    """The listing and warnings stored for ``resolved`` under ``key``; None for no entry, another
    key (the sources changed since) or an unreadable entry."""
    try:
        entry = json.loads(_file(resolved).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("listing"), dict):
        return None
    warnings = entry.get("warnings")
    return entry["listing"], [str(w) for w in warnings] if isinstance(warnings, list) else []


def store(resolved: Path, key: str, listing: Mapping[str, Any], warnings: list[str]) -> None:
    """Keep this read for ``resolved`` (replacing the last one); never raises."""
    with contextlib.suppress(OSError, TypeError, ValueError):
        folder = cache_dir()
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = json.dumps({"key": key, "path": str(resolved), "listing": listing, "warnings": warnings})
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")  # created 0600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, _file(resolved))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
