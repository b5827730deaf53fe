"""``cellmesh.reproducible``: a user's own loop over the model itself draws what a cellmesh run draws."""

from __future__ import annotations

import torch

import cellmesh
from coordinator.planning.resources import Resources
from coordinator.runtime.factories import build_data
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference

M = "tests.multiproc.coordinator.models"
R = "tests.multiproc.coordinator.random_models"


def test_a_plain_loop_inside_reproducible_trains_as_the_reference() -> None:
    job = Job(model=f"{R}:dropout_mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
              optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, global_batch=16, seed=7,
              resources=Resources.local(workers=2))
    model = job.build_model()  # the unwrapped model: nn.Sequential of the factory's list, no cells
    source = build_data(f"{M}:regression", {}, 7)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sampler, seed = job.sampler(), job.config.data.seed
    for step in range(4):
        batch = sampler.indices(step)
        inputs, targets = source.load(batch)
        optimizer.zero_grad()
        with cellmesh.reproducible(model, seed=seed, step=step, samples=batch):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
    ref = train_reference(job, 4)
    assert max_abs_diff(model.state_dict(), ref.state_dict) < 1e-12
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-3  # training moved them
