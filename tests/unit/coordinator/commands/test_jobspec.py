"""Loading a job file: the spec is the config, settings apply over it, its own modules are found beside it."""

from __future__ import annotations

import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from coordinator.commands.jobspec import JobSpecError, load_job, read_spec

REPO = Path(__file__).resolve().parents[4]
FACTORIES = """\
import torch
from torch import nn


def model(width=8):
    return [nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2)]


def data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)
"""


def unique(prefix: str) -> str:
    """A module name no other test imported (modules stay in sys.modules)."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def spec_beside_its_factories(directory: Path, **extra: str) -> tuple[Path, str]:
    parts = unique("jobparts")
    (directory / f"{parts}.py").write_text(FACTORIES)
    spec = directory / "tiny.yaml"
    lines = [f"model: {{factory: {parts}:model, kwargs: {{width: 16}}}}", f"data: {{factory: {parts}:data}}",
             "loss: {factory: torch.nn:MSELoss}", "steps: 7", *extra.values()]
    spec.write_text("\n".join(lines) + "\n")
    return spec, parts


def test_a_spec_finds_its_factories_beside_it_and_leaves_sys_path_alone(tmp_path: Path) -> None:
    spec, parts = spec_beside_its_factories(tmp_path)
    before = list(sys.path)
    loaded = load_job(spec, {"plan.num_stages": 2, "model.kwargs.width": 4})
    assert sys.path == before
    config = loaded.job.config
    assert config.runtime.code_dir == str(tmp_path.resolve())
    assert config.plan.num_stages == 2 and config.model.kwargs == {"width": 4} and loaded.steps == 7
    assert (loaded.name, loaded.source, loaded.module) == ("tiny", f"job spec {spec}", None)
    assert sys.modules[parts].__file__ == str(tmp_path / f"{parts}.py")
    assert loaded.job.build_model()[0].out_features == 4  # the setting reached the factory


def test_a_code_dir_in_the_spec_is_relative_to_it(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    spec, _ = spec_beside_its_factories(tmp_path / "lib")
    moved = tmp_path / "tiny.yaml"
    moved.write_text(spec.read_text() + "runtime: {code_dir: lib}\n")
    assert load_job(moved).job.config.runtime.code_dir == str((tmp_path / "lib").resolve())


def test_a_setting_that_breaks_the_spec_names_the_key(tmp_path: Path) -> None:
    spec, _ = spec_beside_its_factories(tmp_path)
    with pytest.raises(JobSpecError, match=r"tiny.yaml with the command line's settings is invalid: field "
                                           r"'plan.num_stages': Input should be greater than or equal to 1"):
        load_job(spec, {"plan.num_stages": 0})
    with pytest.raises(JobSpecError, match=r"field 'plan.stages': unknown field"):
        load_job(spec, {"plan.stages": 2})


def test_a_bad_spec_names_the_file_the_key_and_the_value(tmp_path: Path) -> None:
    spec, _ = spec_beside_its_factories(tmp_path, bad="plan: {mode: ps, num_microbatches: many}")
    with pytest.raises(JobSpecError) as info:
        read_spec(spec)
    message = str(info.value)
    assert message.startswith(f"job spec {spec} is invalid: ")
    assert "field 'plan.mode'" in message and "(got 'ps')" in message
    assert "field 'plan.num_microbatches'" in message and "(got 'many')" in message
    not_yaml = tmp_path / "broken.yaml"
    not_yaml.write_text("model: [\n")
    with pytest.raises(JobSpecError, match=r"broken.yaml is not valid YAML"):
        load_job(not_yaml)
    with pytest.raises(JobSpecError, match=r"does not exist"):
        load_job(tmp_path / "missing.yaml")


def test_a_factory_that_does_not_import_is_named(tmp_path: Path) -> None:
    spec = tmp_path / "gone.json"
    spec.write_text('{"model": {"factory": "no_such_module_x:model"}, "data": {"factory": "a:b"}, '
                    '"loss": {"factory": "torch.nn:MSELoss"}}')
    with pytest.raises(JobSpecError, match=r"model factory 'no_such_module_x:model': cannot import"):
        load_job(spec)


def write_module(directory: Path, body: str) -> Path:
    name = unique("jobmod")
    (directory / f"{name}.py").write_text(FACTORIES + textwrap.dedent(body))
    return directory / f"{name}.py"


def test_a_module_returning_a_job_is_imported_by_its_stem_from_its_directory(tmp_path: Path) -> None:
    module = write_module(tmp_path, """
        from coordinator.runtime.job import Job


        def job():
            return Job(model=model, data=data, loss="torch.nn:MSELoss", global_batch=8, steps=3, name="mod")
        """)
    before = list(sys.path)
    loaded = load_job(module, {"runtime.workers": 1})
    assert sys.path == before
    config = loaded.job.config
    assert config.model.factory == f"{module.stem}:model"
    assert config.runtime.code_dir == str(tmp_path.resolve())
    assert (loaded.name, loaded.steps, loaded.job.resources.num_workers) == ("mod", 3, 1)
    assert loaded.module is sys.modules[module.stem]


def test_a_module_may_return_a_config(tmp_path: Path) -> None:
    module = write_module(tmp_path, """
        from coordinator.planning.config import parse_config


        def job():
            name = __name__
            return parse_config({"model": {"factory": f"{name}:model"}, "data": {"factory": f"{name}:data"},
                                 "loss": {"factory": "torch.nn:MSELoss"}, "plan": {"num_stages": 2}})
        """)
    loaded = load_job(module)
    assert loaded.job.config.plan.num_stages == 2 and loaded.name == module.stem


@pytest.mark.parametrize(("body", "needle"), [
    ("""
     from coordinator.planning.resources import Resources
     from coordinator.runtime.job import Job


     def job():
         return Job(model=model, data=data, loss="torch.nn:MSELoss", resources=Resources.local(3))
     """, "returned a Job with its own resources= or plan="),
    ("def job():\n    return 42\n", "returned 42 (int), not a JobConfig"),
    ("def job():\n    raise RuntimeError('no data')\n", "job() raised RuntimeError: no data (at "),
    ("STEPS = 3\n", "has no job() function"),
])
def test_a_module_that_cannot_make_a_job_says_why(tmp_path: Path, body: str, needle: str) -> None:
    with pytest.raises(JobSpecError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_job(write_module(tmp_path, body))


def test_a_module_named_like_another_is_refused(tmp_path: Path) -> None:
    (tmp_path / "json.py").write_text("def job():\n    return None\n")
    with pytest.raises(JobSpecError, match=r"the name 'json' is taken by another module"):
        load_job(tmp_path / "json.py")
    (tmp_path / "my-job.py").write_text("")
    with pytest.raises(JobSpecError, match=r"'my-job' is not an importable module name"):
        load_job(tmp_path / "my-job.py")


def test_the_example_spec_and_module_are_the_same_job() -> None:
    spec, module = load_job(REPO / "examples" / "charlm.yaml"), load_job(REPO / "examples" / "charlm.py")
    a, b = spec.job.config, module.job.config
    assert a.model.factory == b.model.factory == "charlm:model"
    assert (a.optimizer, a.data.global_batch, a.steps, a.runtime.workers) == (
        b.optimizer, b.data.global_batch, b.steps, b.runtime.workers)
    assert a.runtime.code_dir == b.runtime.code_dir == str((REPO / "examples").resolve())
