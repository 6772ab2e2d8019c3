"""Errors of the lab (test bed): a component failed to start, assets are missing, a prerequisite lacks.

Must not import anything from the lab itself (every lab module imports this one).
"""

from __future__ import annotations

from engine.errors import RunbookError


class LabError(RunbookError):
    """The lab (control plane, node hosts, assets) could not be started, reached or stopped."""


class AssetsError(LabError):
    """The control-plane binaries are missing and could not be built."""
