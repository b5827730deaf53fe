"""Where a run's output goes: the options of ``cellmesh run``/``demo``/``coordinator`` that say so.

:func:`add_output_arguments` adds the flags to a command's parser and :func:`output_options`
reads them back as an :class:`OutputOptions`; ``coordinator/commands/recorder.py`` does
what they ask. The flags:

================== ==================================================================
``--run-dir DIR``  the run directory (default ``out/<job>-<YYYYmmdd-HHMMSS>/``)
``--log-format F`` ``human`` (default) or ``json`` lines, for the coordinator and workers
``--metrics-port P`` serve Prometheus ``/metrics`` on 127.0.0.1:P while the run trains
``--tensorboard DIR`` write the loss and samples/s of every step as TensorBoard scalars
================== ==================================================================

(``cellmesh coordinator`` has a ``--metrics-port`` of its own, served on the pod's address
with its probes, so :func:`add_output_arguments` leaves that flag out there.)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import get_args

from comm.logs import LogFormat

__all__ = ["OutputOptions", "add_output_arguments", "output_options"]

METRICS_DEST = "run_metrics_port"  # not "metrics_port": `cellmesh coordinator` has its own flag of that name


@dataclass(frozen=True)
class OutputOptions:
    """What a run writes besides its progress.

    Attributes:
        run_dir: The run directory as given (None: a new ``out/<job>-<timestamp>/``).
        log_format: ``human`` or ``json`` (the log files of the coordinator and the workers, and stderr).
        metrics_port: Serve the run's Prometheus metrics on loopback at this port (None: do not; 0: any).
        tensorboard: Write TensorBoard event files here (None: do not).
    """

    run_dir: Path | None = None
    log_format: LogFormat = "human"
    metrics_port: int | None = None
    tensorboard: Path | None = None


def _port(text: str) -> int:
    """argparse type: a TCP port, 0 for any free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {value}")
    return value


def add_output_arguments(parser: argparse.ArgumentParser, *, metrics_port: bool = True) -> None:
    """Add ``--run-dir``, ``--log-format``, ``--tensorboard`` (and ``--metrics-port`` if asked)."""
    group = parser.add_argument_group("where the output goes (docs/running.md)")
    group.add_argument("--run-dir", type=Path, metavar="DIR",
                       help="the run directory: plan, logs, trace, run record, state_dict "
                            "(default out/<job>-<YYYYmmdd-HHMMSS>)")
    group.add_argument("--log-format", choices=get_args(LogFormat), default="human",
                       help="log lines for people (human, default) or one JSON object a line (json)")
    if metrics_port:
        group.add_argument("--metrics-port", type=_port, metavar="P", dest=METRICS_DEST,
                           help="serve Prometheus /metrics on 127.0.0.1:P while training (0: any free port)")
    group.add_argument("--tensorboard", type=Path, metavar="DIR",
                       help="write loss and samples/s per step as TensorBoard scalars to DIR "
                            "(needs cellmesh[tensorboard])")


def output_options(args: argparse.Namespace) -> OutputOptions:
    """The :class:`OutputOptions` of parsed arguments (of a parser :func:`add_output_arguments` extended)."""
    return OutputOptions(run_dir=args.run_dir, log_format=args.log_format,
                         metrics_port=getattr(args, METRICS_DEST, None), tensorboard=args.tensorboard)
