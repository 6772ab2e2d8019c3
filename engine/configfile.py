"""Reading an operator's YAML configuration file (``serve`` config, ``--guards-config``) as a mapping.

One place for the file-level errors every configuration shares: unreadable file, invalid YAML (with
its line), a document that is not a mapping. Each is a ``UsageError`` naming the file. What the keys
mean is left to the owner of each section; this module never interprets them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from engine.errors import UsageError


def read_mapping(path: Path | str, what: str) -> dict[str, Any]:
    """The top-level mapping of the YAML file ``path`` (``{}`` for an empty file); ``what`` names
    the configuration in errors ("the serve configuration")."""
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"{path}: cannot read {what}: {e.strerror}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise UsageError(f"{path}{line}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if raw is not None and not isinstance(raw, dict):
        raise UsageError(f"{path}: {what} must be a mapping")
    return dict(raw or {})
