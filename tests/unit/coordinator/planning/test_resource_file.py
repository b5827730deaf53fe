"""Resource files: the compact form (hosts of several workers) expands to the resource list it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator.planning.resource_file import ResourceFileError, load_resources
from coordinator.planning.resources import CLUSTER_BANDWIDTH_BPS, LOCAL_BANDWIDTH_BPS, Resources, Worker


def test_hosts_expand_to_named_workers_and_links(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("""
hosts:
  - {name: gpu, count: 2, workers: 4, device: cuda, gpus: 1, memory: 80GiB, speed: 2}
  - {name: cpu, workers: 2, cpus: 8, memory: 512MB}
intra_host: {bandwidth_bps: 300e9, latency_s: 5e-6}
inter_host: {bandwidth_bps: 50e9, latency_s: 2e-5}
host_links: [{a: gpu-0, b: cpu, bandwidth_bps: 1e9, latency_s: 1e-3}]
links: [{a: gpu-1-0, b: gpu-1-1, bandwidth_bps: 1e10, latency_s: 1e-5}]
""")
    res = load_resources(path)
    gpus = [f"gpu-{h}-{i}" for h in (0, 1) for i in range(4)]
    assert [w.name for w in res.workers] == [*gpus, "cpu-0", "cpu-1"]
    assert res.worker("gpu-1-3") == Worker(name="gpu-1-3", device="cuda", gpus=1, memory_bytes=80 * 2**30,
                                           speed=2, host="gpu-1")
    assert res.worker("cpu-1") == Worker(name="cpu-1", cpus=8, memory_bytes=512 * 10**6, host="cpu")
    assert res.link("gpu-0-0", "gpu-0-3") == (300e9, 5e-6)  # inside a host
    assert res.link("gpu-0-0", "gpu-1-0") == (50e9, 2e-5)  # between hosts
    assert res.link("cpu-0", "gpu-0-2") == (1e9, 1e-3)  # the host pair's
    assert res.link("gpu-1-1", "gpu-1-0") == (1e10, 1e-5)  # the worker pair's
    assert res.host_groups == (tuple(f"gpu-0-{i}" for i in range(4)), tuple(f"gpu-1-{i}" for i in range(4)),
                               ("cpu-0", "cpu-1"))


def test_defaults_and_the_whole_form(tmp_path: Path) -> None:
    compact = tmp_path / "c.json"
    compact.write_text(json.dumps({"hosts": [{"name": "n", "count": 3, "workers": 2, "memory": 1000}]}))
    res = load_resources(compact)
    assert res.link("n-0-0", "n-0-1")[0] == LOCAL_BANDWIDTH_BPS
    assert res.link("n-0-0", "n-2-1")[0] == CLUSTER_BANDWIDTH_BPS
    whole = tmp_path / "w.yaml"
    whole.write_text(Resources.local(2, memory_bytes=10).model_dump_json())  # JSON is YAML
    assert load_resources(whole) == Resources.local(2, memory_bytes=10)


@pytest.mark.parametrize(("text", "message"), [
    ("hosts: [{name: a, workers: 2}]", r"hosts\.0\.memory: Field required"),
    ("hosts: [{name: a, workers: 2, memory: 1, colour: red}]", r"hosts\.0\.colour: Extra inputs"),
    ("hosts: [{name: a, workers: 0, memory: 1}]", r"hosts\.0\.workers: Input should be greater than"),
    ("hosts: [{name: a, workers: 1, memory: lots}]", r"hosts\.0\.memory"),
    ("hosts: [{name: a, workers: 1, memory: 1}, {name: a, workers: 1, memory: 1}]", "duplicate worker names"),
    ("hosts: [{name: a, workers: 1, memory: 1}]\nhost_links: [{a: a, b: z, bandwidth_bps: 1, latency_s: 0}]",
     "unknown hosts"),
    ("workers: []\nhosts: []", "not both"),
    ("gpus: 8", "expected a mapping with 'hosts:'"),
    ("hosts: [", "not valid YAML"),
])
def test_bad_files_name_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ResourceFileError, match=message) as info:
        load_resources(path)
    assert str(path) in str(info.value)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ResourceFileError, match=r"missing\.yaml cannot be read"):
        load_resources(tmp_path / "missing.yaml")
