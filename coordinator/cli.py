"""The `cellmesh` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["main"]

LOG_LEVEL_ENV = "CELLMESH_LOG_LEVEL"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cellmesh",
                                     description="cellmesh: distributed training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("worker", help="run a worker process (see `cellmesh worker --help`)", add_help=False)
    demo = sub.add_parser("demo", help="two local processes exercise the communication front end")
    demo.add_argument("--backend", default="zmq", choices=["zmq", "gloo"], help="communication backend")
    demo.add_argument("--world-size", type=int, default=2, help="number of local processes")
    demo.add_argument("--timeout", type=float, default=120.0, help="seconds before the demo gives up")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # the worker process has its own thin main()
        from services.worker import main as worker_main

        return worker_main(argv[1:])
    logging.basicConfig(
        level=os.environ.get(LOG_LEVEL_ENV, "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from coordinator.demo import run_demo

        return run_demo(args.backend, args.world_size, args.timeout)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
