"""The command line: every config field a flag, the old short flags as aliases, and a parser without torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from coordinator.commands import cli
from coordinator.commands.jobspec import load_job
from coordinator.planning.config import LoggingConfig, settable_fields

ROOT = Path(__file__).resolve().parents[4]


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``cellmesh ARGS`` with ``-X importtime``; return the process and every module it imported."""
    code = "from coordinator.commands.cli import main; raise SystemExit(main())"  # what the script runs
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")}
    return proc, modules


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["run", "--help"], ["coordinator", "--help"],
                                  ["plan", "--help"], ["k8s", "render", "--help"]])
def test_help_and_version_import_no_torch(args: list[str]) -> None:
    proc, modules = imported_modules(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {"coordinator.commands.cli", "coordinator.planning.config"} <= modules
    assert not {m for m in modules if m == "torch" or m.startswith("torch.")}, "the parser imported torch"
    if args == ["--version"]:
        assert proc.stdout.startswith("cellmesh ")
    else:
        assert "usage: " in proc.stdout


def settings_of(*argv: str) -> dict[str, object]:
    return cli._settings(cli._parser().parse_args(["run", "job.yaml", *argv]))


def test_every_config_field_is_a_flag() -> None:
    text = cli._parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    for key, _ in settable_fields():
        section, _, field = key.rpartition(".")
        flag = f"--{section + '.' if section else ''}{field.replace('_', '-')}"
        assert flag in text, flag


def test_flags_aliases_and_set_become_settings() -> None:
    assert settings_of() == {}
    assert settings_of("--plan.num-stages", "2", "--data.global-batch", "64", "--name", "007") == {
        "plan.num_stages": 2, "data.global_batch": 64, "name": "007"}
    assert settings_of("--workers", "3", "--steps", "5", "--stages", "2", "--data-parallel", "1",
                       "--microbatches", "4", "--schedule", "gpipe", "--mode", "collective",
                       "--strategy", "pipeline") == {
        "runtime.workers": 3, "steps": 5, "plan.num_stages": 2, "plan.data_parallel": 1,
        "plan.num_microbatches": 4, "plan.schedule": "gpipe", "plan.mode": "collective",
        "plan.strategy": "pipeline"}
    assert settings_of("--set", "model.kwargs.width=64", "--set", "plan.balance=[2, 3]",
                       "--plan.balance", "[1, 4]") == {"model.kwargs.width": 64, "plan.balance": [2, 3]}
    assert settings_of("--model.kwargs", "{width: 64}", "--plan.num-stages", "null") == {
        "model.kwargs": {"width": 64}, "plan.num_stages": None}


def test_the_output_flags_are_aliases_of_the_logging_section() -> None:
    assert settings_of("--run-dir", "r", "--log-format", "json", "--log-level", "debug",
                       "--metrics-port", "0", "--tensorboard", "tb") == {
        "logging.run_dir": "r", "logging.format": "json", "logging.level": "debug",
        "logging.metrics_port": 0, "logging.tensorboard_dir": "tb"}
    assert settings_of("--logging.run-dir", "a", "--run-dir", "b") == {"logging.run_dir": "b"}  # one setting
    coordinator = cli._parser().parse_args(["coordinator", "job.yaml", "--registry", "etcd://e:2379",
                                            "--metrics-port", "9090"])
    assert cli._settings(coordinator) == {"logging.metrics_port": 9090}  # the coordinator's is the same one


def help_entries(text: str) -> list[list[str]]:
    """The flags of each option a help text lists: one entry per option, its flag then its aliases."""
    entries = []
    for line in text.splitlines():
        match = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)
        if match:
            entries.append([part.split()[0] for part in match.group(1).split(", ")])
    return entries


@pytest.mark.parametrize("command", [["run"], ["plan"], ["demo"], ["coordinator"]])
def test_help_lists_each_setting_once(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([*command, "--help"])
    assert info.value.code == 0
    entries = help_entries(capsys.readouterr().out)
    counts = Counter(flag for entry in entries for flag in entry)
    assert [flag for flag, n in counts.items() if n > 1] == []  # no flag declared twice
    by_flag = {entry[0]: entry for entry in entries}
    aliases: dict[str, list[str]] = {}
    for short, key in cli.ALIASES.items():
        aliases.setdefault(key, []).append(f"--{short}")
    for key, _ in settable_fields():  # each setting: one option, its generated flag and its aliases
        section, _, field = key.rpartition(".")
        flag = f"--{section + '.' if section else ''}{field.replace('_', '-')}"
        assert by_flag[flag] == [flag, *aliases.get(key, [])], by_flag.get(flag)
    assert by_flag["--logging.metrics-port"] == ["--logging.metrics-port", "--metrics-port"]
    assert by_flag["--logging.run-dir"] == ["--logging.run-dir", "--run-dir"]
    assert by_flag["--logging.format"] == ["--logging.format", "--log-format"]
    assert by_flag["--logging.tensorboard-dir"] == ["--logging.tensorboard-dir", "--tensorboard"]


M = "tests.multiproc.coordinator.models"
SPEC = {"version": 2, "model": {"factory": f"{M}:mlp"}, "data": {"factory": f"{M}:regression"},
        "loss": {"factory": f"{M}:mse"}}


def test_the_spec_sets_the_output_and_a_flag_overrides_it(tmp_path: Path) -> None:
    spec = tmp_path / "tiny.json"
    spec.write_text(json.dumps({**SPEC, "logging": {"run_dir": "from-spec", "format": "json",
                                                    "level": "error"}}))
    assert load_job(spec, settings_of()).job.config.logging == LoggingConfig(
        run_dir="from-spec", format="json", level="ERROR")
    flagged = settings_of("--run-dir", "from-flag", "--log-format", "human",
                          "--set", "logging.metrics_port=0")
    assert load_job(spec, flagged).job.config.logging == LoggingConfig(
        run_dir="from-flag", format="human", level="ERROR", metrics_port=0)


def test_a_job_module_sets_the_output_by_flat_keywords(tmp_path: Path) -> None:
    module = tmp_path / "flatlogjob.py"
    module.write_text(textwrap.dedent(f"""
        from coordinator.runtime.job import Job

        def job():
            return Job(model="{M}:mlp", data="{M}:regression", loss="{M}:mse", logging_format="json",
                       logging_run_dir="runs/flat", logging_metrics_port=0)
    """))
    assert load_job(module, settings_of("--log-level", "DEBUG")).job.config.logging == LoggingConfig(
        format="json", run_dir="runs/flat", metrics_port=0, level="DEBUG")


def test_every_alias_names_a_config_field() -> None:
    keys = dict(settable_fields())
    assert all(key in keys for key in cli.ALIASES.values())


@pytest.mark.parametrize(("argv", "needle"), [
    (["--set", "plan.num_stages"], "--set 'plan.num_stages': expected KEY=VALUE"),
    (["--plan.balance", "[2, "], "setting 'plan.balance': '[2, ' is not a YAML value"),
])
def test_a_malformed_setting_is_a_usage_error(argv: list[str], needle: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "job.yaml", *argv])
    assert info.value.code == 2
    assert needle in capsys.readouterr().err


def test_an_unknown_optimizer_keyword_in_a_spec_is_refused_before_a_worker_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"model: {{factory: {M}:mlp}}\ndata: {{factory: {M}:regression, global_batch: 16}}\n"
                    f"loss: {{factory: {M}:mse}}\n"
                    "optimizer: {name: SGD, kwargs: {lr: 0.1, momentun: 0.9}}\n")
    assert cli.main(["run", str(spec), "--workers", "2", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("cellmesh: error: optimizer.kwargs: SGD takes no keyword 'momentun' (did you mean "
                          "'momentum'?)"), err
    assert not (tmp_path / "run").exists()  # refused before the run directory, the plan or a worker
