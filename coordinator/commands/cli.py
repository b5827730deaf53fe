"""The `cellmesh` command line: ``run``, ``demo``, ``worker``, ``coordinator`` and ``k8s render``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, get_args

if TYPE_CHECKING:
    from coordinator.commands.run import RunOptions

__all__ = ["main"]

DEMO_WORKERS = 2


def _count(text: str) -> int:
    """argparse type: an int >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_training_options(parser: argparse.ArgumentParser, *, workers: int | None,
                          metrics_port: bool = True) -> None:
    from coordinator.commands.output import add_output_arguments
    from coordinator.planning.plan import Mode
    from coordinator.planning.planner import Strategy
    from coordinator.planning.schedules import SCHEDULES

    parser.add_argument("--workers", type=_positive, default=workers, metavar="N",
                        help="local worker processes" + (f" (default {workers})" if workers else
                                                         " (default: the job's, else 2)"))
    parser.add_argument("--steps", type=_count, metavar="K", help="steps to train (default: the job's)")
    parser.add_argument("--strategy", choices=get_args(Strategy), help="what the planner may choose from")
    parser.add_argument("--data-parallel", type=_positive, metavar="D", help="fix the number of replicas")
    parser.add_argument("--stages", type=_positive, metavar="P", help="fix the number of pipeline stages")
    parser.add_argument("--microbatches", type=_positive, metavar="M",
                        help="fix microbatches per replica per step")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), help="fix the pipeline schedule")
    parser.add_argument("--mode", choices=get_args(Mode), help="fix the gradient path")
    parser.add_argument("--output", "-o", type=Path, metavar="PATH",
                        help="also write the final state_dict here (the run directory's model.pt has it too)")
    parser.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto",
                        help="a progress bar, log lines, or a bar only on a terminal (default)")
    parser.add_argument("--log-every", type=_positive, metavar="S", help="steps between log lines")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of an error too")
    add_output_arguments(parser, metrics_port=metrics_port)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cellmesh",
                                     description="cellmesh: distributed training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("worker", help="run a worker process (see `cellmesh worker --help`)", add_help=False)
    run = sub.add_parser("run", help="train a job on local worker processes",
                         description="Plan a job, train it on local worker processes and write its "
                                     "final state_dict. JOB is a job module (.py exposing job()) or a "
                                     "job spec (.yaml, .yml, .json); see docs/running.md.")
    run.add_argument("job", metavar="JOB", help="a job module (.py) or a job spec (.yaml/.yml/.json)")
    _add_training_options(run, workers=None)
    demo = sub.add_parser("demo", help="train the example character-level language model on 2 workers "
                                       "(--comm: exercise the communication front end instead)")
    _add_training_options(demo, workers=DEMO_WORKERS)
    _add_coordinator(sub)
    _add_k8s(sub)
    comm = demo.add_argument_group("the communication demo (--comm)")
    comm.add_argument("--comm", action="store_true", help="run the communication demo instead")
    comm.add_argument("--backend", default="zmq", choices=["zmq", "gloo"], help="communication backend")
    comm.add_argument("--world-size", type=int, default=2, help="number of local processes")
    comm.add_argument("--timeout", type=float, default=120.0, help="seconds before the demo gives up")
    return parser


def _add_coordinator(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    coord = sub.add_parser(
        "coordinator", help="coordinate a job on workers started elsewhere (the coordinator pod's command)",
        description="Wait until the job's workers registered in the registry, plan, train, write the final "
                    "state_dict, then serve until stopped; see docs/kubernetes.md.")
    coord.add_argument("job", metavar="JOB", help="a job spec (.yaml/.yml/.json) or job module (.py)")
    _add_training_options(coord, workers=None, metrics_port=False)  # it has its own, with the probes
    coord.add_argument("--registry", required=True, help="where the workers register: etcd://host:port "
                                                         "(or tcp://host:port for a served registry)")
    coord.add_argument("--host", default=None,
                       help="address the control port binds (default: $CELLMESH_HOST, else 127.0.0.1)")
    coord.add_argument("--port", type=int, default=0, help="the control port (default: any free one)")
    coord.add_argument("--metrics-port", type=int, default=None,
                       help="serve /healthz, /readyz and /metrics over HTTP on this port")
    coord.add_argument("--health-host", default=None,
                       help="interface of that HTTP endpoint (default: as --host)")
    coord.add_argument("--wait-timeout", type=float, default=600.0, metavar="S",
                       help="seconds to wait for the workers to register (default 600)")
    coord.add_argument("--exit-when-done", action="store_true",
                       help="exit after writing the state_dict instead of serving until SIGTERM")


def _add_k8s(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from coordinator.commands.k8s.render import add_render_arguments

    k8s = sub.add_parser("k8s", help="Kubernetes manifests for a job (`cellmesh k8s render --help`)")
    k8s_sub = k8s.add_subparsers(dest="k8s_command", required=True)
    render = k8s_sub.add_parser("render", help="write the manifests of a job",
                                description="Write the Kubernetes manifests that run JOB (a job spec) on N "
                                            "worker pods with etcd and a coordinator; apply them with "
                                            "`kubectl apply -k DIR`. See docs/kubernetes.md.")
    add_render_arguments(render)


def _coordinator(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from coordinator.commands.server import CoordinatorOptions, serve_job

    options = CoordinatorOptions(
        run=_run_options(args, args.job), registry=args.registry, workers=args.workers, host=args.host,
        port=args.port, metrics_port=args.metrics_port, health_host=args.health_host,
        wait_timeout=timedelta(seconds=args.wait_timeout), exit_when_done=args.exit_when_done)
    return serve_job(options, show_traceback=args.traceback)


def _run_options(args: argparse.Namespace, job: str) -> RunOptions:
    from coordinator.commands.jobspec import Overrides
    from coordinator.commands.output import output_options
    from coordinator.commands.run import RunOptions

    overrides = Overrides(workers=args.workers, steps=args.steps, strategy=args.strategy,
                          data_parallel=args.data_parallel, num_stages=args.stages, mode=args.mode,
                          schedule=args.schedule, num_microbatches=args.microbatches)
    bar = {"auto": None, "bar": True, "lines": False}[args.progress]
    return RunOptions(job=job, overrides=overrides, output=args.output, bar=bar, log_every=args.log_every,
                      outputs=output_options(args))


def _train(args: argparse.Namespace) -> int:
    from coordinator.commands import run

    try:
        with run.use_termination_as_exception():
            if args.command == "demo":
                run.run_demo_job(_run_options(args, str(run.demo_job_path())))
            else:
                run.run_job(_run_options(args, args.job))
    except run.REPORTED as exc:
        return run.report(exc, show_traceback=args.traceback)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # the worker process has its own thin main()
        from services.host.worker import main as worker_main

        return worker_main(argv[1:])
    from comm.logs import configure_logging, terminal_level

    parser = _parser()
    args = parser.parse_args(argv)
    try:  # the terminal shows warnings and progress unless CELLMESH_LOG_LEVEL asks for more
        configure_logging(fmt=getattr(args, "log_format", None), level=terminal_level())
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "demo" and args.comm:
        from coordinator.commands.demo import run_demo

        return run_demo(args.backend, args.world_size, args.timeout)
    if args.command in ("run", "demo"):
        return _train(args)
    if args.command == "coordinator":
        return _coordinator(args)
    if args.command == "k8s":
        from coordinator.commands.k8s.render import render_command

        return render_command(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
