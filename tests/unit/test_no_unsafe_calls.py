"""No call in the tree that turns bytes into code or objects: pickle, eval, exec, unsafe YAML or torch.load.

Parsed with ``ast``, so prose that names these calls (docstrings, comments) does not count,
while every real call does, however it is imported. The allowed forms:
``yaml.safe_load`` and ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("cellmesh", "comm", "services", "coordinator", "examples", "bench", "tests")
BANNED_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}
UNSAFE_YAML = {"load", "unsafe_load", "full_load", "load_all", "unsafe_load_all", "full_load_all"}


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def findings(source: str, where: str) -> list[str]:
    """Every unsafe import or call in ``source``, as ``where:line what``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{where}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            found.append(f"{where}:{node.lineno} imports from {node.module}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            last = name.rsplit(".", 1)[-1]
            if name in BANNED_CALLS or (name.startswith("builtins.") and last in BANNED_CALLS):
                found.append(f"{where}:{node.lineno} calls {name}()")
            elif name.startswith("yaml.") and last in UNSAFE_YAML:
                found.append(f"{where}:{node.lineno} calls {name}() (use yaml.safe_load)")
            elif name.endswith("torch.load"):
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                           and k.value.value is True for k in node.keywords)
                if not safe:
                    found.append(f"{where}:{node.lineno} calls torch.load() without weights_only=True")
    return found


def test_the_tree_has_no_unsafe_calls() -> None:
    found = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.py")):
            found += findings(path.read_text(), str(path.relative_to(ROOT)))
    assert found == []


@pytest.mark.parametrize("code", [
    "import pickle",
    "from pickle import loads",
    "import cloudpickle as cp",
    "eval('1')",
    "exec(text)",
    "builtins.eval(x)",
    "yaml.load(f)",
    "yaml.unsafe_load(f)",
    "torch.load(p)",
    "torch.load(p, weights_only=False)",
])
def test_the_check_finds_each_unsafe_form(code: str) -> None:
    assert findings(code, "x.py"), code


@pytest.mark.parametrize("code", [
    "yaml.safe_load(f)",
    "torch.load(p, weights_only=True)",
    "'''we never pickle'''",
    "model.eval()",
])
def test_the_check_allows_the_safe_forms(code: str) -> None:
    assert findings(code, "x.py") == []
