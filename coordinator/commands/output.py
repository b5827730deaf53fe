"""Where a run's output goes and how it logs: the job config's ``logging`` section, acted on.

[Note: one home for the output settings] The run directory, the log level and format, the
metrics port and the TensorBoard directory are fields of the job config's ``logging``
section (``coordinator/planning/config.py``: :class:`~coordinator.planning.config.LoggingConfig`)
and nothing else declares them. A spec file or a job module sets them; on the command line
they are generated flags (``--logging.run-dir``) with short aliases from the CLI's one alias
table (``--run-dir``, ``--log-level``, ``--log-format``, ``--metrics-port``,
``--tensorboard``: ``cli.ALIASES``) and ``--set`` keys. ``cellmesh run``, ``demo`` and
``coordinator`` read them from the resolved config only, through this module:

* :func:`apply_logging`: this process logs in the section's format at its level, over
  ``CELLMESH_LOG_FORMAT`` and ``CELLMESH_LOG_LEVEL``, and passes both to the workers it starts
  (``comm/logs.py``); unset, the variables decide, then the defaults. So: flag > spec > env >
  default;
* :func:`open_recorder`: the run directory (``logging.run_dir``, else a new
  ``out/<job>-<timestamp>/``) and its recorder (``coordinator/commands/recorder.py``), which
  writes the TensorBoard scalars and serves the metrics on loopback. ``cellmesh coordinator``
  serves ``logging.metrics_port`` itself, on the pod's address together with its probes
  (``coordinator/commands/server.py``), so its recorder serves nothing.
"""

from __future__ import annotations

from pathlib import Path

from comm.logs import configure_logging
from coordinator.commands.metrics import RunMetrics
from coordinator.commands.recorder import RunRecorder
from coordinator.commands.rundir import RunDir
from coordinator.planning.config import LoggingConfig

__all__ = ["apply_logging", "open_recorder"]


def apply_logging(settings: LoggingConfig) -> None:
    """Log this process's records to stderr (which shows progress too) as ``settings`` say.

    Raises:
        ValueError: A variable the settings leave to the environment holds no level or format.
    """
    configure_logging(fmt=settings.format, level=settings.level, terminal=True)


def open_recorder(job: str, steps: int, settings: LoggingConfig, *, serve_metrics: bool = True,
                  spec_sha256: str = "", metrics: RunMetrics | None = None) -> RunRecorder:
    """A recorder on the run directory of ``settings`` (created), not yet entered.

    Args:
        job: The job's name (the new run directory's prefix).
        steps: Steps the run trains.
        settings: The config's logging section.
        serve_metrics: Serve ``logging.metrics_port`` on loopback (False: the caller serves it).
        spec_sha256: The job file's digest, kept in the record.
        metrics: The metrics to update (default: new ones).

    Raises:
        ValueError: The run directory cannot be created or written (names it).
    """
    run_dir = RunDir.create(job, Path(settings.run_dir) if settings.run_dir is not None else None)
    return RunRecorder(run_dir, job=job, steps=steps,
                       metrics_port=settings.metrics_port if serve_metrics else None,
                       tensorboard_dir=settings.tensorboard_dir, spec_sha256=spec_sha256, metrics=metrics)
