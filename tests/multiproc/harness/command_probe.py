"""A command for ``test_commands.py``: it prints what it sees of its start, then ends as its argument says."""

from __future__ import annotations

import atexit
import json
import os
import sys
import time


def main() -> None:
    mode = sys.argv[1]
    atexit.register(lambda: print("atexit ran", flush=True))
    seen = {"argv": sys.argv[1:], "name": __name__, "cwd": os.getcwd(), "path0": sys.path[0],
            "probe": os.environ.get("PROBE"), "on_path": os.environ.get("PROBE_DIR", "") in sys.path}
    print(json.dumps(seen))
    print("to stderr", file=sys.stderr)
    if mode == "raise":
        raise RuntimeError("the probe raised")
    if mode == "exit-message":
        sys.exit("the probe failed")
    if mode == "exit-3":
        sys.exit(3)
    if mode == "sleep":
        time.sleep(60)


if __name__ == "__main__":
    main()
