"""A bounded HTTP GET for tests of the probe and metrics endpoints (services/host/health.py)."""

from __future__ import annotations

import urllib.error
import urllib.request

__all__ = ["http_get"]


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """``(status, body)``; an error status is returned, not raised; no connection is status 0."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)
