"""The command line: every config field a flag, the old short flags as aliases, and a parser without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coordinator.commands import cli
from coordinator.planning.config import settable_fields

ROOT = Path(__file__).resolve().parents[3]


def imported_modules(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``cellmesh ARGS`` with ``-X importtime``; return the process and every module it imported."""
    code = "from coordinator.commands.cli import main; raise SystemExit(main())"  # what the script runs
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")}
    return proc, modules


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["run", "--help"], ["coordinator", "--help"],
                                  ["k8s", "render", "--help"]])
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
