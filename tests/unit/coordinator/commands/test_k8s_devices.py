"""`cellmesh k8s render` for GPU workers: the GPUs requested, the worker's LOCAL_RANK, and a spec that makes a
worker without CUDA an error rather than a job trained on CPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.commands.k8s.options import RenderOptions
from coordinator.commands.k8s.render import render
from coordinator.planning.config import parse_config

REPO = Path(__file__).resolve().parents[4]
CHARLM = REPO / "examples" / "charlm.yaml"


def _worker(files: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    stateful = next(o for o in files["workers"] if o["kind"] == "StatefulSet")
    return stateful["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _spec(files: dict[str, list[dict[str, Any]]]) -> Any:
    return parse_config(yaml.safe_load(files["job"][0]["data"]["job.yaml"]))


@pytest.mark.parametrize("gpus", [0, 1])
def test_gpu_workers_request_their_gpu_run_on_local_rank_0_and_require_cuda(gpus: int) -> None:
    files = render(RenderOptions(job=CHARLM, workers=2, gpus_per_worker=gpus))
    pod = _worker(files)
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["LOCAL_RANK"] == "0"  # one process per pod: its stage runs on cuda:0
    assert "CUDA_VISIBLE_DEVICES" not in env  # the device plugin shows the pod its own GPUs only
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert limits.get("nvidia.com/gpu") == requests.get("nvidia.com/gpu") == (str(gpus) if gpus else None)
    assert bool(pod.get("tolerations")) == bool(gpus)
    assert _spec(files).runtime.device == ("cuda" if gpus else "auto")


def test_a_device_the_spec_chose_is_kept(tmp_path: Path) -> None:
    spec = yaml.safe_load(CHARLM.read_text())
    spec["runtime"]["device"] = "cpu"
    job = tmp_path / "charlm.yaml"
    job.write_text(yaml.safe_dump(spec))
    assert _spec(render(RenderOptions(job=job, workers=2, gpus_per_worker=1))).runtime.device == "cpu"
