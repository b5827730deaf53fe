"""Imports go downward only: between the packages, and between the layers inside each package.

Every ``import`` statement counts, the ones inside functions too (a lazy import is still an
edge of the graph). The layers, lowest first; a module may import its own layer and any
layer below it, never one above:

* packages: ``comm`` < ``services`` < ``coordinator`` < ``cellmesh`` (the public facade);
* ``comm``: the core modules (errors, codec, sockets, wire, base...) < ``rpc`` < ``registry``
  < ``rendezvous`` < the backends ``zmq`` and ``torch`` < ``factory``;
* ``services``: the shared modules (protocol, link, barrier) < ``params`` < ``compute`` < ``host``;
* ``coordinator``: ``planning`` < ``runtime`` < ``commands``.

Two modules of one layer may import each other only when they sit in the same subpackage
(``comm.zmq`` and ``comm.torch`` are one layer, but neither may import the other).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("comm", "services", "coordinator", "cellmesh")

# (prefix, rank): the longest matching prefix names a module's layer.
LAYERS: dict[str, int] = {
    "comm": 0,
    "comm.rpc": 1,
    "comm.registry": 2,
    "comm.rendezvous": 3,
    "comm.zmq": 4,
    "comm.torch": 4,
    "comm.factory": 5,
    "services": 10,
    "services.params": 11,
    "services.compute": 12,
    "services.host": 13,
    "coordinator": 20,
    "coordinator.planning": 21,
    "coordinator.runtime": 22,
    "coordinator.commands": 23,
    "cellmesh": 30,
}


def layer_of(module: str) -> str:
    """The longest prefix of ``module`` in LAYERS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in LAYERS:
            return prefix
    raise KeyError(module)


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module) of every import in the file that names one of our packages."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                # ``from comm.zmq import shm`` imports the module comm.zmq.shm
                yield node.lineno, f"{target}.{alias.name}"


def our_modules() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def edge_fault(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target`` (None: it may), by the layer table."""
    src, dst = layer_of(source), layer_of(target)
    if LAYERS[dst] > LAYERS[src]:
        return f"upward ({src} -> {dst})"
    if LAYERS[dst] == LAYERS[src] and dst != src:
        return f"sideways ({src} -> {dst})"
    return None


def violations() -> list[str]:
    found = []
    for path in our_modules():
        source = module_name(path)
        for line, target in imports_of(path):
            if target.split(".")[0] not in PACKAGES:
                continue
            fault = edge_fault(source, target)
            if fault is not None:
                found.append(f"{path.relative_to(ROOT)}:{line} imports {target}: {fault}")
    return found


def test_every_module_has_a_layer() -> None:
    modules = [module_name(p) for p in our_modules()]
    assert modules, "no modules found"
    for module in modules:
        layer_of(module)


def test_imports_go_downward_only() -> None:
    assert violations() == []


@pytest.mark.parametrize(("source", "target", "allowed"), [
    ("comm.zmq.communicator", "services.protocol", False),
    ("coordinator.planning.planner", "coordinator.runtime.job", False),
    ("coordinator.commands.cli", "coordinator.runtime.job", True),
    ("comm.zmq.communicator", "comm.torch.communicator", False),
    ("services.compute.executor", "services.params.grad_path", True),
    ("services.params.grad_path", "services.compute.executor", False),
])
def test_the_rule_itself(source: str, target: str, allowed: bool) -> None:
    """The checker the tree is held to tells an upward or sideways edge from a downward one."""
    assert (edge_fault(source, target) is None) is allowed
