"""The public package: ``import cellmesh`` is light, and every public name resolves."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cellmesh


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    return out.stdout.strip()


def test_import_does_not_load_torch() -> None:
    assert _run("import sys, cellmesh; print('torch' in sys.modules)") == "False"


def test_first_use_loads_the_name() -> None:
    assert _run("import sys, cellmesh; cellmesh.Job; print('torch' in sys.modules)") == "True"


@pytest.mark.parametrize("name", [n for n in cellmesh.__all__ if n != "__version__"])
def test_every_public_name_resolves(name: str) -> None:
    value = getattr(cellmesh, name)
    assert getattr(value, "__name__", name) == name
    assert name in dir(cellmesh)


def test_the_names_are_the_real_objects() -> None:
    from coordinator.runtime.job import Job
    from services.compute.cell import Cell

    assert cellmesh.Job is Job
    assert cellmesh.Cell is Cell
    assert issubclass(cellmesh.CommTimeoutError, TimeoutError)


def test_unknown_name_is_an_attribute_error_listing_the_public_ones() -> None:
    with pytest.raises(AttributeError, match=r"no attribute 'Pipeline'.*Job"):
        cellmesh.Pipeline  # noqa: B018


def test_version_is_a_string() -> None:
    assert isinstance(cellmesh.__version__, str) and cellmesh.__version__
