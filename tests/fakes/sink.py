"""A recording ``EventSink`` for unit tests of the executor and the run service."""

from __future__ import annotations

from typing import Any


class RecordingSink:
    """An EventSink keeping every event; ``fail_on`` makes emit raise for one kind (journal failure)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.fail_on = fail_on

    def emit(self, kind: str, **data: Any) -> None:
        if kind == self.fail_on:
            raise OSError(f"journal unavailable (while recording {kind})")
        self.events.append((kind, data))

    def kinds(self, step: str | None = None) -> list[str]:
        return [k for k, d in self.events if step is None or d.get("step") == step]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [d for k, d in self.events if k == kind]

