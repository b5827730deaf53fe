"""The fault-injection hook's ``delay`` action: a slow phase (slow storage for ``save``) that goes on."""

from __future__ import annotations

import time

import pytest

from services import faults


def test_a_delay_parses_with_or_without_its_seconds_and_refuses_a_bad_one() -> None:
    spec = faults.parse("6:save:delay=0.5")
    assert (spec.step, spec.phase, spec.action, spec.seconds) == (6, "save", "delay", 0.5)
    assert faults.parse("6:save:delay").seconds == faults.DELAY_S and repr(spec) == "6:save:delay=0.5"
    bad_specs = [("6:save:delay=soon", "delay='soon' is not a number"), ("6:save:kill=2", "action 'kill=2'")]
    for bad, says in bad_specs:
        with pytest.raises(ValueError, match=says):
            faults.parse(bad)


def test_a_delay_sleeps_at_its_step_and_phase_only_and_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults, "_spec", faults.parse("2:save:delay=0.3"))
    start = time.monotonic()
    faults.at(1, "save")
    faults.at(2, "forward")
    assert time.monotonic() - start < 0.2
    faults.at(2, "save")  # the process goes on after it
    assert time.monotonic() - start >= 0.3
