"""The `cellmesh` command line: ``run``, ``plan``, ``demo``, ``worker``, ``coordinator`` and ``k8s render``.

[Note: config flags] Every field of the job config (``coordinator/planning/config.py``) is a
flag of ``run``, ``plan``, ``demo`` and ``coordinator``, generated from the config's models and never
declared here: ``--steps``, ``--name`` and ``--<section>.<field>`` (``--plan.num-stages 2``,
``--data.global-batch 64``, ``--model.kwargs '{width: 64}'``), values read as YAML
(:func:`~coordinator.planning.config.setting_value`). ``--set KEY=VALUE`` sets any dotted
key, also one inside a mapping (``--set model.kwargs.width=64``). The short flags users rely
on are aliases from one table, :data:`ALIASES`, also those of where the output goes
(``--run-dir``, ``--log-level``, ``--log-format``, ``--metrics-port``, ``--tensorboard``: the
``logging`` section, see [Note: one home for the output settings] in
``coordinator/commands/output.py``); no flag is declared twice. The settings apply over the
job file's config and are validated with it: an error names the key.

Building the parser imports no torch (the config module is pydantic only), so ``cellmesh
--help`` and ``--version`` return at once; a command imports what it runs.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args, get_origin

if TYPE_CHECKING:
    from coordinator.commands.run import RunOptions

__all__ = ["ALIASES", "main"]

SETTING = "setting:"  # the argparse dest prefix of a generated config flag
# short flag -> the config key it sets (the flags of the command line before the config had sections)
ALIASES: dict[str, str] = {
    "workers": "runtime.workers",
    "strategy": "plan.strategy",
    "data-parallel": "plan.data_parallel",
    "stages": "plan.num_stages",
    "microbatches": "plan.num_microbatches",
    "schedule": "plan.schedule",
    "mode": "plan.mode",
    "run-dir": "logging.run_dir",
    "log-level": "logging.level",
    "log-format": "logging.format",
    "metrics-port": "logging.metrics_port",
    "tensorboard": "logging.tensorboard_dir",
    "checkpoint-dir": "checkpoint.directory",
    "checkpoint-every": "checkpoint.every_steps",
    "max-restarts": "runtime.max_restarts",
}


def _positive(text: str) -> int:
    """argparse type: an int >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _metavar(annotation: Any) -> str:
    """How a flag's value looks: its choices, or its kind (N, X, BOOL, TEXT, LIST, MAP)."""
    if get_origin(annotation) is Annotated:
        return _metavar(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return _metavar(args[0]) if len(args) == 1 else "VALUE"
    if get_origin(annotation) is Literal:
        return "{" + ",".join(map(str, get_args(annotation))) + "}"
    kinds = {int: "N", float: "X", bool: "BOOL", str: "TEXT", list: "LIST", dict: "MAP"}
    return kinds.get(get_origin(annotation) or annotation, "VALUE")


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field (see [Note: config flags]), grouped by section, with its aliases."""
    from coordinator.planning.config import JobConfig, section_of, settable_fields

    aliases: dict[str, list[str]] = {}
    for short, key in ALIASES.items():
        aliases.setdefault(key, []).append(f"--{short}")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for key, info in settable_fields():
        section, _, field = key.rpartition(".")
        if section not in groups:
            doc = (section_of(JobConfig.model_fields[section]).__doc__ or "") if section else (
                "Every field of the job config (docs/running.md); a flag given changes the job file's value.")
            title = f"job config: {section}" if section else "job config"
            groups[section] = parser.add_argument_group(title, doc.split("\n")[0].replace("``", ""))
        default = info.get_default(call_default_factory=True)
        shown = (" (required unless the job file gives it)" if info.is_required()
                 else "" if default is None else f" (default {default})")
        flags = [f"--{(section + '.') if section else ''}{field.replace('_', '-')}", *aliases.get(key, [])]
        groups[section].add_argument(*flags, dest=SETTING + key, default=argparse.SUPPRESS,
                                     metavar=_metavar(info.annotation), help=f"{info.description}{shown}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set any config key, also inside a mapping: --set model.kwargs.width=64")


def _add_training_options(parser: argparse.ArgumentParser) -> None:
    _add_config_flags(parser)
    parser.add_argument("--output", "-o", type=Path, metavar="PATH",
                        help="also write the final state_dict here (the run directory's model.pt has it too)")
    parser.add_argument("--progress", choices=["auto", "bar", "lines"], default="auto",
                        help="a progress bar, log lines, or a bar only on a terminal (default)")
    parser.add_argument("--log-every", type=_positive, metavar="S", help="steps between log lines")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of an error too")
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="DIR",
                        help="continue from a checkpoint: the newest of this job's (no DIR), or DIR (a "
                             "step-* checkpoint, or the newest under DIR); the run ends at the step an "
                             "uninterrupted one would")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cellmesh")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cellmesh",
                                     description="cellmesh: distributed training for PyTorch")
    parser.add_argument("--version", action="version", version=f"cellmesh {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("worker", help="run a worker process (see `cellmesh worker --help`)", add_help=False)
    run = sub.add_parser("run", help="train a job on local worker processes",
                         description="Plan a job, train it on local worker processes and write its "
                                     "final state_dict. JOB is a job module (.py exposing job()) or a "
                                     "job spec (.yaml, .yml, .json); see docs/running.md.")
    run.add_argument("job", metavar="JOB", help="a job module (.py) or a job spec (.yaml/.yml/.json)")
    _add_training_options(run)
    run.add_argument("--trace", type=Path, metavar="FILE",
                     help="also write the Chrome trace (Perfetto) of the measured steps with the predicted "
                          "ones beside them here (the run directory's trace.json has it too)")
    _add_plan(sub)
    demo = sub.add_parser("demo", help="train the example character-level language model on 2 workers "
                                       "(--comm: exercise the communication front end instead)")
    _add_training_options(demo)
    _add_coordinator(sub)
    _add_k8s(sub)
    comm = demo.add_argument_group("the communication demo (--comm)")
    comm.add_argument("--comm", action="store_true", help="run the communication demo instead")
    comm.add_argument("--backend", default="zmq", choices=["zmq", "gloo"], help="communication backend")
    comm.add_argument("--world-size", type=int, default=2, help="number of local processes")
    comm.add_argument("--timeout", type=float, default=120.0, help="seconds before the demo gives up")
    return parser


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    plan = sub.add_parser("plan", help="print the plan of a job and its predicted step, without workers",
                          description="Profile JOB on a sample microbatch, print the plan `cellmesh run` "
                                      "would use and the simulator's prediction of one step; no worker "
                                      "starts. See docs/running.md.")
    plan.add_argument("job", metavar="JOB", help="a job module (.py) or a job spec (.yaml/.yml/.json)")
    _add_config_flags(plan)
    plan.add_argument("--timeline", type=Path, metavar="FILE",
                      help="draw the predicted step here: .svg, or .png/.pdf with matplotlib "
                           "(pip install 'cellmesh[plot]')")
    plan.add_argument("--resources", type=Path, metavar="FILE",
                      help="plan for the workers this resource file lists (YAML/JSON: hosts of several "
                           "workers and their links) instead of this machine's; see docs/running.md")
    plan.add_argument("--runners-up", type=int, default=5, metavar="N",
                      help="print the N fastest plans the planner weighed (default 5; 0: none)")
    plan.add_argument("--traceback", action="store_true", help="print the traceback of an error too")


def _add_coordinator(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    coord = sub.add_parser(
        "coordinator", help="coordinate a job on workers started elsewhere (the coordinator pod's command)",
        description="Wait until the job's workers registered in the registry, plan, train, write the final "
                    "state_dict, then serve until stopped; see docs/kubernetes.md.")
    coord.add_argument("job", metavar="JOB", help="a job spec (.yaml/.yml/.json) or job module (.py)")
    _add_training_options(coord)
    coord.add_argument("--registry", required=True, help="where the workers register: etcd://host:port "
                                                         "(or tcp://host:port for a served registry)")
    coord.add_argument("--keys-dir", default=None,
                       help="the job's keys (default: $CELLMESH_KEYS_DIR; `cellmesh keys DIR` makes them, a "
                            "cluster mounts them from the job's Secret)")
    coord.add_argument("--insecure", action="store_true",
                       help="run without keys: serve anyone who reaches the ports (trusted networks only)")
    coord.add_argument("--host", default=None,
                       help="address the control port binds (default: $CELLMESH_HOST, else 127.0.0.1)")
    coord.add_argument("--port", type=int, default=0, help="the control port (default: any free one)")
    coord.add_argument("--health-host", default=None,
                       help="interface of the /healthz, /readyz and /metrics endpoint at --metrics-port "
                            "(logging.metrics_port) (default: as --host)")
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
    keys = k8s_sub.add_parser("keys", help="make a job's keys; print the commands that store them as Secrets",
                              description="Write the job's keys under DIR and print the two `kubectl create "
                                          "secret` commands the rendered manifests expect. See "
                                          "docs/kubernetes.md.")
    from coordinator.commands.k8s.keys import add_keys_arguments

    add_keys_arguments(keys)


def _coordinator(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    from datetime import timedelta

    from comm import auth
    from coordinator.commands.server import CoordinatorOptions, serve_job

    try:  # before any socket: every one the coordinator makes speaks the job's keys
        auth.install(auth.credentials_for("coordinator", args.keys_dir, insecure=args.insecure))
    except (ValueError, OSError) as exc:
        print(f"cellmesh coordinator: {exc}", file=sys.stderr)
        return 2
    options = CoordinatorOptions(
        run=_run_options(args, args.job, settings), registry=args.registry, host=args.host,
        port=args.port, health_host=args.health_host,
        wait_timeout=timedelta(seconds=args.wait_timeout), exit_when_done=args.exit_when_done)
    return serve_job(options, show_traceback=args.traceback)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config settings the command line gives: generated flags, then ``--set`` (later wins).

    Raises:
        ConfigError: A value is not YAML, or a ``--set`` is not ``KEY=VALUE``.
    """
    from coordinator.planning.config import ConfigError, setting_value

    given = [(dest.removeprefix(SETTING), text) for dest, text in vars(args).items()
             if dest.startswith(SETTING)]
    for item in args.set:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set plan.num_stages=2")
        given.append((key.strip(), text))
    return {key: setting_value(key, text) for key, text in given}


def _run_options(args: argparse.Namespace, job: str, settings: dict[str, Any]) -> RunOptions:
    from coordinator.commands.run import RunOptions

    bar = {"auto": None, "bar": True, "lines": False}[args.progress]
    return RunOptions(job=job, settings=settings, output=args.output, bar=bar, log_every=args.log_every,
                      resume=args.resume, trace=getattr(args, "trace", None))


def _train(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    from coordinator.commands import run

    try:
        with run.use_termination_as_exception():
            if args.command == "demo":
                run.run_demo_job(_run_options(args, str(run.demo_job_path()), settings))
            else:
                run.run_job(_run_options(args, args.job, settings))
    except run.REPORTED as exc:
        return run.report(exc, show_traceback=args.traceback)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # the worker process has its own thin main()
        from services.host.worker import run as run_worker

        run_worker(argv[1:])
    from comm.logs import configure_logging

    parser = _parser()
    args = parser.parse_args(argv)
    try:  # from the environment until the job's config is known (its logging section wins then)
        configure_logging(terminal=True)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "demo" and args.comm:
        from coordinator.commands.demo import run_demo

        return run_demo(args.backend, args.world_size, args.timeout)
    if args.command in ("run", "plan", "demo", "coordinator"):
        from coordinator.planning.config import ConfigError

        try:
            settings = _settings(args)
        except ConfigError as exc:
            parser.error(str(exc))
        if args.command == "plan":
            from coordinator.commands.plan import plan_command

            return plan_command(args.job, settings, args.timeline, show_traceback=args.traceback,
                                resources=args.resources, runners_up=args.runners_up)
        return _train(args, settings) if args.command != "coordinator" else _coordinator(args, settings)
    if args.command == "k8s" and args.k8s_command == "keys":
        from coordinator.commands.k8s.keys import keys_command

        return keys_command(args)
    if args.command == "k8s":
        from coordinator.commands.k8s.render import render_command

        return render_command(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
