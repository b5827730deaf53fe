"""The one logging setup (comm/logs.py): level from the environment, human and JSON lines, context fields."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from comm.logs import (
    LOG_FORMAT_ENV,
    LOG_LEVEL_ENV,
    child_env,
    configure_logging,
    current_format,
    file_level,
    log_context,
    log_to_file,
    set_process_context,
    terminal_level,
)


@pytest.fixture(autouse=True)
def _restore_root() -> Iterator[None]:
    """Each test configures the root logger; put back what pytest had."""
    root = logging.getLogger()
    handlers, level, fmt = list(root.handlers), root.level, current_format()
    yield
    configure_logging(fmt=fmt, stream=io.StringIO())  # current_format() as it was
    root.handlers[:] = handlers
    root.setLevel(level)
    set_process_context(worker=None, rank=None)


def test_levels_come_from_the_one_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    assert (file_level(), terminal_level()) == (logging.INFO, logging.WARNING)
    monkeypatch.setenv(LOG_LEVEL_ENV, "debug")
    assert (file_level(), terminal_level()) == (logging.DEBUG, logging.DEBUG)
    monkeypatch.setenv(LOG_LEVEL_ENV, "LOUD")
    with pytest.raises(ValueError, match=f"{LOG_LEVEL_ENV}='LOUD' is not a log level"):
        file_level()


def test_a_level_and_format_told_win_over_the_variables_which_win_over_the_defaults(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_LEVEL_ENV, "error")
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    configure_logging(stream=io.StringIO())  # nothing told: the variables
    assert (file_level(), terminal_level(), current_format()) == (logging.ERROR, logging.ERROR, "json")
    assert child_env() == {LOG_FORMAT_ENV: "json", LOG_LEVEL_ENV: "ERROR"}
    terminal = io.StringIO()
    configure_logging(fmt="human", level="debug", terminal=True, stream=terminal)  # told: over the variables
    assert (file_level(), terminal_level(), current_format()) == (logging.DEBUG, logging.DEBUG, "human")
    assert child_env() == {LOG_FORMAT_ENV: "human", LOG_LEVEL_ENV: "DEBUG"}  # what started workers get
    logging.getLogger("cellmesh.test").debug("shown")
    assert terminal.getvalue().endswith("cellmesh.test: shown\n")
    monkeypatch.setenv(LOG_LEVEL_ENV, "LOUD")  # a variable that is not read is not checked
    assert file_level() == logging.DEBUG
    monkeypatch.delenv(LOG_LEVEL_ENV)
    monkeypatch.delenv(LOG_FORMAT_ENV)
    configure_logging(stream=io.StringIO())  # neither: the defaults
    assert (file_level(), terminal_level(), current_format()) == (logging.INFO, logging.WARNING, "human")
    assert child_env() == {LOG_FORMAT_ENV: "human"}
    with pytest.raises(ValueError, match="level='LOUD' is not a log level"):
        configure_logging(level="LOUD", stream=io.StringIO())


def test_json_lines_carry_the_context(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    stream = io.StringIO()
    configure_logging(fmt="json", stream=stream)
    log = logging.getLogger("cellmesh.test")
    set_process_context(worker="local-1", rank=1)
    log.info("before")
    with log_context(service="run/compute-r0-s1", step=7):
        log.info("in %s", "step")
        seen: list[str] = []

        def other_thread() -> None:  # threads see the process's fields, not another thread's request
            log.warning("elsewhere")
            seen.append("ok")

        t = threading.Thread(target=other_thread)
        t.start()
        t.join(5)
    log.debug("not at INFO")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [r["message"] for r in records] == ["before", "in step", "elsewhere", "failed"]
    fields = [(r["worker"], r["service"], r["step"], r["rank"]) for r in records]
    assert fields == [("local-1", None, None, 1), ("local-1", "run/compute-r0-s1", 7, 1),
                      ("local-1", None, None, 1), ("local-1", None, None, 1)]
    assert records[1]["level"] == "INFO" and records[1]["logger"] == "cellmesh.test"
    assert "RuntimeError: boom" in records[3]["exception"] and seen == ["ok"]


def test_human_lines_name_the_known_context_and_the_file_gets_info(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    terminal = io.StringIO()
    configure_logging(fmt="human", terminal=True, stream=terminal)
    log = logging.getLogger("cellmesh.test")
    path = tmp_path / "coordinator.log"
    with log_to_file(path), log_context(step=3):
        log.info("quiet on the terminal")
        log.warning("loud")
    log.info("after the file closed")
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and lines[0].endswith("cellmesh.test: quiet on the terminal {step=3}"), lines
    assert " WARNING " in lines[1]
    assert terminal.getvalue().count("\n") == 1 and "loud {step=3}" in terminal.getvalue()


def test_the_format_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOG_FORMAT_ENV, "xml")
    with pytest.raises(ValueError, match="CELLMESH_LOG_FORMAT='xml' is not a log format"):
        configure_logging(stream=io.StringIO())
    monkeypatch.setenv(LOG_FORMAT_ENV, "json")
    configure_logging(stream=io.StringIO())
    assert current_format() == "json"
