"""The one logging setup of every cellmesh process: level, format, and who/where/when each record is from.

The coordinator process (``coordinator/commands/cli.py``) and the worker processes
(``services/host/worker.py``) both call :func:`configure_logging`; it lives in ``comm``,
the lowest layer, because the service host (``comm/rpc/service.py``) is where a request's
service and step become known (:func:`log_context`).

Settings:

* the level: ``CELLMESH_LOG_LEVEL`` (:data:`LOG_LEVEL_ENV`; ``DEBUG``, ``INFO``, ``WARNING``,
  ``ERROR``), default ``INFO`` for a log file and a worker's output, ``WARNING`` on the
  terminal of ``cellmesh run`` (:func:`terminal_level`), so progress stays readable;
* the format: ``human`` (one line: time, level, logger, message and the known context) or
  ``json`` (one JSON object a line), from ``--log-format`` or ``CELLMESH_LOG_FORMAT``
  (:data:`LOG_FORMAT_ENV`: how a coordinator passes its format to the workers it starts).

Context: every record carries ``worker``, ``service``, ``step`` and ``rank`` (None when not
known). ``worker`` and ``rank`` are the process's (:func:`set_process_context`: a worker
knows them once at start, and threads do not inherit context variables); ``service`` and
``step`` are the request's, set by :func:`log_context` for the duration of a call (a
``contextvars`` variable, so each thread and copied context sees its own).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Literal, TextIO, get_args

__all__ = ["CONTEXT_FIELDS", "LOG_FORMAT_ENV", "LOG_LEVEL_ENV", "ContextFilter", "HumanFormatter",
           "JsonFormatter", "LogFormat", "configure_logging", "current_format", "file_level", "log_context",
           "log_to_file", "set_process_context", "terminal_level"]

LOG_LEVEL_ENV = "CELLMESH_LOG_LEVEL"
LOG_FORMAT_ENV = "CELLMESH_LOG_FORMAT"
LogFormat = Literal["human", "json"]
CONTEXT_FIELDS = ("worker", "service", "step", "rank")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_process: dict[str, object] = {}  # worker and rank: the same in every thread
_request: ContextVar[dict[str, object] | None] = ContextVar("cellmesh_log_context", default=None)
_format: list[LogFormat] = ["human"]  # what configure_logging last applied


def _env_level() -> int | None:
    """``CELLMESH_LOG_LEVEL`` as a logging level, None when unset.

    Raises:
        ValueError: It is set to something that is not a level name.
    """
    text = os.environ.get(LOG_LEVEL_ENV, "").strip().upper()
    if not text:
        return None
    if text not in LEVELS:
        raise ValueError(f"{LOG_LEVEL_ENV}={text!r} is not a log level: use one of {', '.join(LEVELS)}")
    return int(logging.getLevelName(text))


def file_level() -> int:
    """The level of a log file or a worker's output: ``CELLMESH_LOG_LEVEL``, else INFO."""
    level = _env_level()
    return logging.INFO if level is None else level


def terminal_level() -> int:
    """The level of a terminal that also shows progress: ``CELLMESH_LOG_LEVEL`` when set, else WARNING."""
    level = _env_level()
    return logging.WARNING if level is None else level


def _env_format() -> LogFormat:
    text = os.environ.get(LOG_FORMAT_ENV, "human").strip() or "human"
    if text not in get_args(LogFormat):
        raise ValueError(f"{LOG_FORMAT_ENV}={text!r} is not a log format: use human or json")
    return "json" if text == "json" else "human"


def current_format() -> LogFormat:
    """The format :func:`configure_logging` last applied in this process (what started workers use)."""
    return _format[0]


def set_process_context(**fields: object) -> None:
    """Set ``worker`` and/or ``rank`` for every record of this process (None removes one)."""
    for key, value in fields.items():
        if key not in CONTEXT_FIELDS:
            raise ValueError(f"unknown log context field {key!r}; the fields are {CONTEXT_FIELDS}")
        if value is None:
            _process.pop(key, None)
        else:
            _process[key] = value


@contextlib.contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Within the block (this thread or context), records carry ``fields`` (e.g. ``service``, ``step``).

    None values are left out, so a caller may pass what it knows without checking.
    """
    current = _request.get()
    merged = dict(current or {})
    merged.update((k, v) for k, v in fields.items() if v is not None)
    token = _request.set(merged)
    try:
        yield
    finally:
        _request.reset(token)


class ContextFilter(logging.Filter):
    """Sets ``record.worker``, ``.service``, ``.step`` and ``.rank`` (None when not known)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = _request.get() or {}
        for key in CONTEXT_FIELDS:
            if not hasattr(record, key):
                setattr(record, key, request.get(key, _process.get(key)))
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the context fields, and the traceback."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
            + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((key, getattr(record, key, None)) for key in CONTEXT_FIELDS)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class HumanFormatter(logging.Formatter):
    """``time LEVEL logger: message {worker=... step=...}`` (only the known context fields)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        known = [f"{k}={getattr(record, k)}" for k in CONTEXT_FIELDS if getattr(record, k, None) is not None]
        if not known:
            return text
        head, newline, rest = text.partition("\n")  # the context stays on the message's line
        return f"{head} {{{' '.join(known)}}}{newline}{rest}"


def _formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else HumanFormatter()


class _Handler(logging.StreamHandler[TextIO]):
    """A stream handler :func:`configure_logging` installed (and so may replace)."""


def configure_logging(*, fmt: LogFormat | None = None, level: int | None = None,
                      stream: TextIO | None = None) -> None:
    """Log this process's records to ``stream`` (stderr by default) at ``level`` in format ``fmt``.

    Args:
        fmt: ``human`` or ``json``; None: ``CELLMESH_LOG_FORMAT``, else ``human``.
        level: None: :func:`file_level` (``CELLMESH_LOG_LEVEL``, else INFO).
        stream: Where the records go.

    Calling it again replaces what an earlier call installed (handlers of others stay).

    Raises:
        ValueError: ``CELLMESH_LOG_LEVEL`` or ``CELLMESH_LOG_FORMAT`` holds no level or format.
    """
    fmt = fmt or _env_format()
    _format[0] = fmt
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler(stream or sys.stderr)
    handler.setLevel(file_level() if level is None else level)
    handler.addFilter(ContextFilter())
    handler.setFormatter(_formatter(fmt))
    root.addHandler(handler)
    root.setLevel(handler.level)
    logging.captureWarnings(True)  # a warning is a record too (a JSON line in a JSON log)


@contextlib.contextmanager
def log_to_file(path: Path, *, fmt: LogFormat | None = None) -> Iterator[None]:
    """Within the block, this process's records also go to ``path`` (appended) at :func:`file_level`.

    The file has the format of :func:`configure_logging` (or ``fmt``); the root logger's level
    is lowered for the block so the file gets its records even when the terminal shows fewer.
    """
    root = logging.getLogger()
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(file_level())
    handler.addFilter(ContextFilter())
    handler.setFormatter(_formatter(fmt or current_format()))
    previous = root.level
    root.addHandler(handler)
    root.setLevel(min(previous, handler.level))
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(previous)
