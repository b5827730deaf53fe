"""The job config: one field list, validated once, every error naming the key to change."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from coordinator.planning.config import (
    FLAT_KEYS,
    ConfigError,
    FactoryKwargs,
    JobConfig,
    apply_settings,
    from_flat,
    parse_config,
    section_of,
    settable_fields,
    setting_value,
)

BASE: dict[str, Any] = {"model": {"factory": "pkg.m:mlp"}, "data": {"factory": "pkg.m:data"},
                        "loss": {"factory": "torch.nn:MSELoss"}}


def with_(**sections: Any) -> dict[str, Any]:
    return {**BASE, **sections}


def test_the_module_imports_no_torch() -> None:
    code = "import sys, coordinator.planning.config; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_defaults_and_sections() -> None:
    config = parse_config(BASE)
    assert (config.version, config.steps, config.name) == (2, 100, None)
    assert config.data.global_batch == 32 and config.data.shuffle and config.data.seed == 0
    assert config.optimizer.name == "SGD" and config.optimizer.kwargs == {"lr": 0.01}
    assert config.plan.strategy == "auto" and config.plan.num_stages is None
    assert config.plan.cutter == "minmax"
    assert config.runtime.workers == 2 and config.runtime.comm_backend == "auto"
    assert config.runtime.device == "auto" and config.runtime.pipeline_backend is None
    assert config.runtime.step_timeout_s == 300.0 and config.runtime.code_dir is None
    assert config.checkpoint.directory is None
    assert config.logging.model_dump() == {  # unset: the environment, then the defaults
        "level": None, "format": None, "run_dir": None, "metrics_port": None, "tensorboard_dir": None}
    with pytest.raises(ValueError, match="frozen"):
        config.steps = 3  # type: ignore[misc]


@pytest.mark.parametrize(("raw", "needles"), [
    (with_(data={"factory": "pkg.m:data", "global_bach": 16}), ["field 'data.global_bach': unknown field"]),
    ({"model": {"factory": "pkg.m:mlp"}, "loss": {"factory": "a:b"}}, ["field 'data': missing (required)"]),
    (with_(model={"factory": "no colon"}),
     ["field 'model.factory': String should match pattern", "'no colon'"]),
    (with_(plan={"num_stages": 0}),
     ["field 'plan.num_stages': Input should be greater than or equal to 1 (got 0)"]),
    (with_(data={"factory": "pkg.m:data", "global_batch": True}),  # YAML's `global_batch: yes` (before: 1)
     ["field 'data.global_batch': give a number, not true (got True)"]),
    (with_(plan={"mode": "ps"}), ["field 'plan.mode'", "'collective' or 'parameter_server' (got 'ps')"]),
    (with_(plan={"schedule": "zigzag"}), ["field 'plan.schedule': unknown schedule 'zigzag'; use one of"]),
    (with_(plan={"strategy": "pipeline", "data_parallel": 2}),
     ["plan: strategy='pipeline' means data_parallel=1, not 2: change plan.strategy or plan.data_parallel"]),
    (with_(plan={"balance": [2, 3], "num_stages": 3}), ["change plan.balance or plan.num_stages"]),
    (with_(optimizer={"kwargs": {"lr": "fast"}}),
     ["field 'optimizer.kwargs.lr': 'fast' is none of the accepted types (float, int, bool, list[float])"]),
    (with_(checkpoint={"every_steps": 0}), ["checkpoint.every_steps"]),
    (with_(data={"factory": "a:b", "num_samples": 8, "global_batch": 16}),
     ["data.num_samples=8 is below data.global_batch=16"]),
    (with_(runtime={"comm_backend": "mpi"}), ["field 'runtime.comm_backend'", "(got 'mpi')"]),
    (with_(logging={"metrics_port": 70000}), ["field 'logging.metrics_port'", "(got 70000)"]),
    (with_(logging={"format": "xml"}), ["field 'logging.format'", "'human' or 'json' (got 'xml')"]),
    (with_(logging={"level": "loud"}), ["field 'logging.level'", "(got 'LOUD')"]),
    ({**BASE, "version": 1}, ["field 'version': Input should be 2 (got 1)"]),
    (with_(model="pkg.m:mlp"), ["field 'model': a section, give its fields as a mapping", "got 'pkg.m:mlp'"]),
])
def test_errors_name_the_key_and_the_value(raw: dict[str, Any], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(raw)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(with_(steps=-1, plan={"num_stages": 0, "cutter": 3}, sleep=1))
    message = str(info.value)
    assert all(k in message for k in ("'steps'", "'plan.num_stages'", "'plan.cutter'", "'sleep'")), message


def test_logging_level_is_case_blind_and_checkpoint_fields_validate() -> None:
    config = parse_config(with_(logging={"level": "info", "metrics_port": 0},
                                checkpoint={"directory": "ck", "every_seconds": 60}))
    assert config.logging.level == "INFO" and config.checkpoint.every_seconds == 60
    assert config.logging.metrics_port == 0  # any free port


def test_settings_set_dotted_keys_and_are_validated_with_the_config() -> None:
    config = parse_config(with_(model={"factory": "pkg.m:mlp", "kwargs": {"width": 64, "depth": 2}}))
    changed = config.updated({"plan.num_stages": 2, "model.kwargs.width": 32, "steps": 7,
                              "runtime.workers": 4})
    assert changed.plan.num_stages == 2 and changed.steps == 7 and changed.runtime.workers == 4
    assert changed.model.kwargs == {"width": 32, "depth": 2}  # one kwarg changed, the other kept
    assert config.plan.num_stages is None  # the original is untouched
    with pytest.raises(ConfigError, match=r"field 'plan.num_stagez': unknown field"):
        config.updated({"plan.num_stagez": 2})
    with pytest.raises(ConfigError, match=r"setting 'steps.x': 'steps' is a value, not a section"):
        config.updated({"steps.x": 1})
    with pytest.raises(ConfigError, match=r"not a dotted key"):
        apply_settings(BASE, {"plan.": 1})


@pytest.mark.parametrize(("key", "text", "value"), [
    ("plan.num_stages", "2", 2),
    ("plan.num_stages", "null", None),
    ("plan.balance", "[2, 3]", [2, 3]),
    ("plan.schedule", "1f1b", "1f1b"),
    ("name", "007", "007"),  # a text field keeps the text
    ("data.shuffle", "false", False),
    ("optimizer.kwargs", "{lr: 0.1, betas: [0.9, 0.95]}", {"lr": 0.1, "betas": [0.9, 0.95]}),
    ("model.kwargs.width", "64", 64),  # inside a mapping: YAML
])
def test_command_line_text_is_read_as_yaml(key: str, text: str, value: Any) -> None:
    assert setting_value(key, text) == value


def test_text_that_is_not_yaml_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"setting 'plan.balance': '\[2, ' is not a YAML value"):
        setting_value("plan.balance", "[2, ")


def test_every_field_is_settable_and_has_a_description() -> None:
    keys = dict(settable_fields())
    sections = [n for n, f in JobConfig.model_fields.items() if n not in ("version", "name", "steps")]
    assert sections == ["model", "data", "loss", "eval", "optimizer", "plan", "checkpoint", "logging",
                        "runtime"]
    for section in sections:
        kind = section_of(JobConfig.model_fields[section])  # eval: an optional section
        assert kind is not None
        for field in kind.model_fields:  # type: ignore[attr-defined]
            assert f"{section}.{field}" in keys
    assert "version" not in keys
    assert all(info.description for info in keys.values())


def test_flat_keywords_are_generated_one_per_field() -> None:
    assert len(FLAT_KEYS) == len(dict(settable_fields()))
    assert FLAT_KEYS["model"] == "model.factory" and FLAT_KEYS["model_kwargs"] == "model.kwargs"
    assert FLAT_KEYS["optimizer"] == "optimizer.name" and FLAT_KEYS["optimizer_kwargs"] == "optimizer.kwargs"
    assert FLAT_KEYS["global_batch"] == "data.global_batch" and FLAT_KEYS["num_stages"] == "plan.num_stages"
    assert FLAT_KEYS["workers"] == "runtime.workers" and FLAT_KEYS["steps"] == "steps"
    config = from_flat({"model": "a:b", "data": "a:c", "loss": "a:d", "num_stages": 2,
                        "model_kwargs": {"w": 1}, "optimizer": "Adam", "global_batch": 8, "workers": 3})
    assert config == parse_config({
        "model": {"factory": "a:b", "kwargs": {"w": 1}}, "data": {"factory": "a:c", "global_batch": 8},
        "loss": {"factory": "a:d"}, "optimizer": {"name": "Adam"}, "plan": {"num_stages": 2},
        "runtime": {"workers": 3}})
    with pytest.raises(ConfigError, match=r"unknown job field\(s\) \['num_stagez'\]"):
        from_flat({"model": "a:b", "data": "a:c", "loss": "a:d", "num_stagez": 2})


def test_checkpoint_and_logging_fields_flatten_with_their_section_name() -> None:
    prefixed = {key: name for name, key in FLAT_KEYS.items() if key.startswith(("checkpoint.", "logging."))}
    assert prefixed == {f"{s}.{f}": f"{s}_{f}" for s, f in (k.split(".") for k in prefixed)}
    assert set(prefixed) == {k for k, _ in settable_fields() if k.startswith(("checkpoint.", "logging."))}
    assert not {"level", "format", "directory", "keep", "run_dir", "metrics_port"} & set(FLAT_KEYS)
    config = from_flat({"model": "pkg.m:mlp", "data": "pkg.m:data", "loss": "torch.nn:MSELoss",
                        "logging_format": "json", "logging_run_dir": "runs/x", "checkpoint_directory": "ck",
                        "checkpoint_keep": 3})
    assert config == parse_config(with_(logging={"format": "json", "run_dir": "runs/x"},
                                        checkpoint={"directory": "ck", "keep": 3}))


def test_factory_kwargs_are_what_the_protocol_carries() -> None:
    from services.protocol import FactoryKwargs as OnTheWire

    assert FactoryKwargs == OnTheWire
