"""``python -m cellmesh``: the ``cellmesh`` command."""

from coordinator.commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
