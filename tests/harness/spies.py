"""Recording the calls a test makes through a real object (the object still does the work)."""

from __future__ import annotations

from typing import Any

import pytest


def record_calls(monkeypatch: pytest.MonkeyPatch, obj: object, name: str) -> list[tuple[Any, ...]]:
    """Every later call of ``obj.name``'s positional arguments, in order; the call itself goes through."""
    calls: list[tuple[Any, ...]] = []
    real = getattr(obj, name)

    def recording(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, recording)
    return calls
