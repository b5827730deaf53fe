"""A job whose factories live in a directory only the coordinator's ``sys.path`` names (a notebook's
``sys.path.append``) trains on local workers, as ``multiprocessing``'s spawn would run it.

[Note: where a job's modules are found] in ``coordinator/runtime/factories.py``.
"""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.factories import factory_roots
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

MODULE = textwrap.dedent('''
    import torch
    from torch import nn

    def model():
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()

    def data():
        x = torch.randn(32, 4, dtype=torch.float64)
        return x, x[:, :2] * 2

    def loss():
        return nn.MSELoss()
''')


@pytest.fixture
def elsewhere(tmp_path: Path) -> Iterator[str]:
    """A package in a directory that only this process's sys.path has (not the cwd, not PYTHONPATH)."""
    pkg = tmp_path / "nb_models_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "parts.py").write_text(MODULE)
    assert str(tmp_path) not in os.environ.get("PYTHONPATH", "") and Path.cwd() != tmp_path
    sys.path.append(str(tmp_path))
    try:
        yield str(tmp_path)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("nb_models_pkg")]:
            del sys.modules[name]


def test_factories_imported_from_the_coordinator_s_own_path_train_on_local_workers(elsewhere: str) -> None:
    p = "nb_models_pkg.parts"
    job = Job(model=f"{p}:model", data=f"{p}:data", loss=f"{p}:loss", optimizer="SGD",
              optimizer_kwargs={"lr": 0.1}, global_batch=8, seed=2, resources=Resources.local(workers=2),
              data_parallel=2, num_stages=1, step_timeout_s=30)
    assert factory_roots([f"{p}:model", "torch.nn:MSELoss"]) == [str(Path(elsewhere).resolve())]
    result = job.fit(3)
    ref = train_reference(job, 3)
    assert max_abs_diff(result.state_dict, ref.state_dict) < 1e-12
