"""The one logging setup of every cellmesh process: level, format, and who/where/when each record is from.

The coordinator process (``coordinator/commands/cli.py``) and the worker processes
(``services/host/worker.py``) both call :func:`configure_logging`; it lives in ``comm``,
the lowest layer, because the service host (``comm/rpc/host.py``) is where a request's
service and step become known (:func:`log_context`).

Settings, each from the first that gives it: what the process was told
(:func:`configure_logging`'s ``fmt`` and ``level``: a job config's ``logging`` section, its
flags or spec), then the environment, then the default:

* the level: ``CELLMESH_LOG_LEVEL`` (:data:`LOG_LEVEL_ENV`; ``DEBUG``, ``INFO``, ``WARNING``,
  ``ERROR``), default ``INFO`` for a log file and a worker's output, ``WARNING`` on the
  terminal of ``cellmesh run`` (:func:`terminal_level`), so progress stays readable;
* the format: ``human`` (one line: time, level, logger, message and the known context) or
  ``json`` (one JSON object a line), ``CELLMESH_LOG_FORMAT`` (:data:`LOG_FORMAT_ENV`).

The two variables are also how a coordinator passes what it chose to the processes it
starts (:func:`child_env`). An invalid variable is an error naming it, unless the process
was told that setting (the variable is then not read).

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
           "JsonFormatter", "LogFormat", "LogThrottle", "child_env", "configure_logging", "current_format",
           "file_level", "log_context", "log_to_file", "set_process_context", "terminal_level"]

LOG_LEVEL_ENV = "CELLMESH_LOG_LEVEL"
LOG_FORMAT_ENV = "CELLMESH_LOG_FORMAT"
LogFormat = Literal["human", "json"]
CONTEXT_FIELDS = ("worker", "service", "step", "rank")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_process: dict[str, object] = {}  # worker and rank: the same in every thread
_request: ContextVar[dict[str, object] | None] = ContextVar("cellmesh_log_context", default=None)
_format: list[LogFormat] = ["human"]  # what configure_logging last applied
_level: list[str | None] = [None]  # the level configure_logging was told (over CELLMESH_LOG_LEVEL)


def _level_name(text: str, source: str) -> str:
    """``text`` as a level name (any case).

    Raises:
        ValueError: It is not one; the message names ``source`` (the variable or the argument).
    """
    name = text.strip().upper()
    if name not in LEVELS:
        raise ValueError(f"{source}={text!r} is not a log level: use one of {', '.join(LEVELS)}")
    return name


def _chosen_level() -> str | None:
    """The level this process was told, else ``CELLMESH_LOG_LEVEL``'s, else None (each stream's default).

    Raises:
        ValueError: The variable is read and set to something that is not a level name.
    """
    if _level[0] is not None:
        return _level[0]
    text = os.environ.get(LOG_LEVEL_ENV, "").strip()
    return _level_name(text, LOG_LEVEL_ENV) if text else None


def file_level() -> int:
    """The level of a log file or a worker's output: the chosen one (see the module docstring), else INFO."""
    name = _chosen_level()
    return logging.INFO if name is None else int(logging.getLevelName(name))


def terminal_level() -> int:
    """The level of a terminal that also shows progress: the chosen one, else WARNING."""
    name = _chosen_level()
    return logging.WARNING if name is None else int(logging.getLevelName(name))


def _env_format() -> LogFormat:
    text = os.environ.get(LOG_FORMAT_ENV, "human").strip() or "human"
    if text not in get_args(LogFormat):
        raise ValueError(f"{LOG_FORMAT_ENV}={text!r} is not a log format: use human or json")
    return "json" if text == "json" else "human"


def current_format() -> LogFormat:
    """The format :func:`configure_logging` last applied in this process."""
    return _format[0]


def child_env() -> dict[str, str]:
    """The variables a process this one starts needs to log as it does: its format, and its level if chosen.

    Raises:
        ValueError: ``CELLMESH_LOG_LEVEL`` is read and holds no level.
    """
    level = _chosen_level()
    return {LOG_FORMAT_ENV: current_format(), **({LOG_LEVEL_ENV: level} if level is not None else {})}


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


def configure_logging(*, fmt: LogFormat | None = None, level: str | None = None, terminal: bool = False,
                      stream: TextIO | None = None) -> None:
    """Log this process's records to ``stream`` (stderr by default) in format ``fmt``.

    Args:
        fmt: ``human`` or ``json``; None: ``CELLMESH_LOG_FORMAT``, else ``human``.
        level: A level name that wins over ``CELLMESH_LOG_LEVEL`` here, in :func:`log_to_file`'s
            files and in the processes started with :func:`child_env`; None: the variable's.
        terminal: ``stream`` also shows progress (a command's stderr): without a chosen level it
            shows WARNING and up (:func:`terminal_level`), not INFO (:func:`file_level`).
        stream: Where the records go.

    Calling it again replaces what an earlier call installed and told (handlers of others stay).

    Raises:
        ValueError: ``level`` is no level name, or a variable that is read holds no level or format.
    """
    fmt = fmt or _env_format()
    told = _level[0]
    _level[0] = None if level is None else _level_name(level, "level")
    try:
        threshold = terminal_level() if terminal else file_level()
    except ValueError:
        _level[0] = told
        raise
    _format[0] = fmt
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler(stream or sys.stderr)
    handler.setLevel(threshold)
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


class LogThrottle:
    """Lets one log record a key through per ``window`` seconds and counts the rest.

    For faults a peer can repeat at will (garbage frames, refused calls): the first of each
    kind is logged, the next ones only counted until the window has passed. Keys are kept
    for the process's life, so use bounded ones (a peer and a reason, not a message).
    """

    def __init__(self, window: float = 60.0) -> None:
        self.window = window
        self._last: dict[object, float] = {}
        self._suppressed: dict[object, int] = {}

    def admit(self, key: object) -> int | None:
        """None to stay quiet; else log now, and the int is how many were held back since the last one."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.window:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._suppressed.pop(key, 0)
