"""Factory resolution (services/factories.py): the allow-list, the rules, and where the list comes from."""

from __future__ import annotations

import re
import sys
import uuid
from pathlib import Path

import pytest
from torch import nn

from coordinator.commands.jobspec import load_job
from coordinator.runtime.factories import job_factories
from services.compute.stage import build_stage
from services.factories import FactoryAllowList, FactoryError, factories_in_spec, resolve, spec_factories
from services.host.worker import allowed_factories
from services.protocol import Assignment, ComputeOptions

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def bait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A module that marks its import, imports os, and re-exports os.system; its name and marker."""
    name = f"bait_{uuid.uuid4().hex[:8]}"
    marker = tmp_path / "imported"
    (tmp_path / f"{name}.py").write_text(
        f"import os\nfrom os import system\nopen({str(marker)!r}, 'w').close()\n"
        "def model():\n    return [1]\n\nVALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, marker


def test_a_name_not_in_the_list_is_refused_before_its_module_is_imported(bait: tuple[str, Path]) -> None:
    name, marker = bait
    allowed = FactoryAllowList.of(["torch.nn:MSELoss"], "the job spec job.yaml")
    with pytest.raises(FactoryError, match=rf"model factory '{name}:model' is not a factory of this worker's "
                                           r"job \(allowed: torch.nn:MSELoss; from the job spec job.yaml\)"):
        allowed.resolve(f"{name}:model", what="model factory")
    assert not marker.exists() and name not in sys.modules
    assert allowed.resolve("torch.nn:MSELoss", what="loss factory") is nn.MSELoss
    with pytest.raises(FactoryError, match="'os:system' is not a factory"):
        allowed.require({"loss factory": "torch.nn:MSELoss", "model factory": "os:system"})


@pytest.mark.parametrize("name", ["os:system", "subprocess:run", "builtins:eval", "shutil:rmtree",
                                  "importlib:import_module", "os.path:join", "posix:system"])
def test_the_standard_library_is_never_a_factory_even_when_listed(name: str) -> None:
    with pytest.raises(FactoryError, match="standard library"):
        resolve(name, what="model factory")
    with pytest.raises(FactoryError, match="standard library"):
        FactoryAllowList.of([name], "a spec that lists it")


def test_a_factory_is_named_by_its_own_module(bait: tuple[str, Path]) -> None:
    name, marker = bait
    with pytest.raises(FactoryError, match=rf"'os' is a module imported by '{name}'; name the factory by its "
                                           r"own module \('os:\.\.\.'\)"):
        resolve(f"{name}:os.system", what="model factory")
    with pytest.raises(FactoryError, match=r"is posix\.system of Python's standard library"):
        resolve(f"{name}:system", what="model factory")
    with pytest.raises(FactoryError, match=r"is not callable \(an int\)"):
        resolve(f"{name}:VALUE", what="model factory")
    assert resolve(f"{name}:model", what="model factory")() == [1]
    assert marker.exists()  # allowed names do import


@pytest.mark.parametrize(("name", "says"), [
    ("no colon", "expected 'package.module:function'"),
    ("pkg:fn()", "expected 'package.module:function'"),
    ("pkg:__class__", "starts with '__'"),
    ("torch.nn:MSELoss.__init__.__globals__", "starts with '__'"),
    ("torch.nn:Nope", "'torch.nn' has no attribute 'Nope'"),
    ("no_such_module_x:f", "cannot import 'no_such_module_x': ModuleNotFoundError"),
])
def test_malformed_or_missing_names_say_what_is_wrong(name: str, says: str) -> None:
    with pytest.raises(FactoryError, match=re.escape(says)):
        resolve(name, what="model factory")


def test_the_list_is_every_section_factory_of_the_spec(tmp_path: Path) -> None:
    spec = REPO / "examples" / "charlm.yaml"
    assert spec_factories(spec) == ["charlm:data", "charlm:loss", "charlm:model"]
    assert job_factories(load_job(spec).job.config) == spec_factories(spec)
    extra = {"model": {"factory": "a:m"}, "data": {"factory": "a:d"}, "loss": {"factory": "a:m"},
             "metrics": {"factory": "b:metric"}, "steps": 3, "optimizer": {"name": "SGD"}}
    assert factories_in_spec(extra) == ["a:d", "a:m", "b:metric"]
    empty = tmp_path / "empty.yaml"
    empty.write_text("steps: 3\n")
    with pytest.raises(FactoryError, match="names no factory"):
        spec_factories(empty)
    with pytest.raises(FactoryError, match="cannot read it"):
        spec_factories(tmp_path / "missing.yaml")


def test_the_eval_sections_metric_is_listed_and_no_other_sections(bait: tuple[str, Path]) -> None:
    spec: dict[str, object] = {
        "model": {"factory": "a:m"}, "data": {"factory": "a:d"}, "loss": {"factory": "a:l"},
        "eval": {"factory": "a:held", "metric": "b:accuracy"}, "plan": {"metric": "c:x"},
        "runtime": {"metric": 3}}
    assert factories_in_spec(spec) == ["a:d", "a:held", "a:l", "a:m", "b:accuracy"]
    assert factories_in_spec({**spec, "eval": {"factory": "a:held", "metric": None}}) == [
        "a:d", "a:held", "a:l", "a:m"]
    config = load_job(REPO / "examples" / "charlm.yaml", {"eval.factory": "charlm:data",
                                                          "eval.metric": "torch.nn:L1Loss"}).job.config
    assert job_factories(config) == ["charlm:data", "charlm:loss", "charlm:model", "torch.nn:L1Loss"]

    name, marker = bait  # a stage whose metric is not one of its job's is refused before importing it
    m = "tests.multiproc.coordinator.models"
    allowed = FactoryAllowList.of([f"{m}:mlp", f"{m}:regression", f"{m}:mse"], "a test")
    options = ComputeOptions(stage=0, num_stages=1, data=f"{m}:regression", loss=f"{m}:mse",
                             eval_data=f"{m}:regression", metric=f"{name}:model")
    assignment = Assignment(service="c", kind="compute", factory=f"{m}:mlp", nodes=[0, 6], seed=0,
                            options=options.model_dump())
    with pytest.raises(FactoryError, match=f"metric factory '{name}:model' is not a factory of this worker"):
        build_stage(assignment, options, allowed)
    assert not marker.exists()


def test_the_worker_list_joins_its_spec_and_its_factory_options(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("model: {factory: 'a:m'}\ndata: {factory: 'a:d'}\nloss: {factory: 'torch.nn:MSELoss'}\n")
    allowed = allowed_factories(str(spec), ["b:extra"])
    assert allowed.names == {"a:m", "a:d", "torch.nn:MSELoss", "b:extra"}
    assert allowed.source == f"the job spec {spec} and --factory b:extra"
    assert allowed_factories(None, []).names == frozenset()
    spec.write_text("model: {factory: 'os:system'}\n")
    with pytest.raises(FactoryError, match="'os:system': 'os' is part of Python's standard library"):
        allowed_factories(str(spec), [])
