"""The optional ``eval`` section: absent by default, set by ``Job`` keywords, flags and ``--set`` keys."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.commands import cli
from coordinator.planning.config import FLAT_KEYS, ConfigError, EvalConfig, from_flat, parse_config

BASE: dict[str, Any] = {"model": {"factory": "pkg.m:mlp"}, "data": {"factory": "pkg.m:data"},
                        "loss": {"factory": "torch.nn:MSELoss"}}


def test_a_job_evaluates_nothing_unless_it_has_an_eval_section() -> None:
    assert parse_config(BASE).eval is None
    section = {"factory": "pkg.m:held", "every_steps": 10, "metric": "pkg.m:acc"}
    config = parse_config({**BASE, "eval": section})
    assert config.eval == EvalConfig(factory="pkg.m:held", every_steps=10, metric="pkg.m:acc")
    assert (config.eval.global_batch, config.eval.num_samples, config.eval.kwargs) == (None, None, {})
    assert parse_config(config.model_dump()) == config
    assert parse_config({**BASE, "eval": None}).eval is None


@pytest.mark.parametrize(("section", "says"), [
    ({"every_steps": 2}, "field 'eval.factory': missing (required)"),
    ({"factory": "pkg.m:held", "every_steps": 0}, "field 'eval.every_steps': Input should be greater than or "
                                                  "equal to 1"),
    ({"factory": "pkg.m:held", "metric": "not a name"}, "field 'eval.metric': String should match pattern"),
    ({"factory": "pkg.m:held", "shuffle": True}, "field 'eval.shuffle': unknown field (misspelt?)"),
])
def test_a_bad_eval_section_names_the_key(section: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({**BASE, "eval": section})
    assert str(info.value).startswith(says), info.value


def test_its_fields_are_job_keywords_prefixed_with_eval() -> None:
    assert {name: key for name, key in FLAT_KEYS.items() if key.startswith("eval.")} == {
        "eval": "eval.factory", "eval_kwargs": "eval.kwargs", "eval_every_steps": "eval.every_steps",
        "eval_global_batch": "eval.global_batch", "eval_num_samples": "eval.num_samples",
        "eval_metric": "eval.metric"}
    config = from_flat({"model": "pkg.m:mlp", "data": "pkg.m:data", "loss": "torch.nn:MSELoss",
                        "eval": "pkg.m:held", "eval_global_batch": 64, "global_batch": 16})
    assert config.eval is not None and config.eval.global_batch == 64 and config.data.global_batch == 16


def test_the_command_line_sets_it_on_a_job_without_one() -> None:
    args = cli._parser().parse_args(["run", "job.yaml", "--eval.factory", "pkg.m:held",
                                     "--eval.every-steps", "5", "--set", "eval.kwargs.split=test"])
    settings = cli._settings(args)
    assert settings == {"eval.factory": "pkg.m:held", "eval.every_steps": 5, "eval.kwargs.split": "test"}
    config = parse_config(BASE).updated(settings)  # the section is created where the job has none
    assert config.eval == EvalConfig(factory="pkg.m:held", every_steps=5, kwargs={"split": "test"})
    assert config.updated({"eval": None}).eval is None
    with pytest.raises(ConfigError, match=r"field 'eval\.factory': missing"):
        parse_config(BASE).updated({"eval.every_steps": 5})
    help_text = cli._parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    assert "job config: eval:\n  Held-out data, evaluated on the training plan" in help_text
