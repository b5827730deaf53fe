"""The launcher variables a worker honours (services/host/launch.py): torchrun's and Kubeflow's PET_*."""

from __future__ import annotations

import pytest

from services.host.launch import LaunchEnv, LaunchEnvError, read_launch_env


def test_nothing_set_says_nothing() -> None:
    env = read_launch_env({})
    assert env == LaunchEnv()
    assert env.default_name() is None


def test_torchrun_variables() -> None:
    env = read_launch_env(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "MASTER_ADDR": "w-0.ws", "MASTER_PORT": "29500"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (
        3,
        8,
        0,
        "w-0.ws",
        29500,
    )
    assert env.default_name() == "worker-3"


def test_pet_variables_derive_what_torchrun_would_set() -> None:
    environ = {
        "PET_NNODES": "4",
        "PET_NODE_RANK": "2",
        "PET_NPROC_PER_NODE": "1",
        "PET_MASTER_ADDR": "m",
        "PET_MASTER_PORT": "1234",
        "PET_RDZV_BACKEND": "etcd",
        "PET_RDZV_ENDPOINT": "etcd-0.etcd:2379",
        "PET_RDZV_ID": "charlm",
    }
    env = read_launch_env(environ)
    assert (env.rank, env.world_size, env.local_rank) == (2, 4, 0)
    assert (env.master_addr, env.master_port) == ("m", 1234)
    assert env.registry == "etcd://etcd-0.etcd:2379" and env.job == "charlm"
    exported: dict[str, str] = {"MASTER_PORT": "999"}  # what is already set stays
    env.export(exported)
    assert exported == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "m",
        "MASTER_PORT": "999",
    }


def test_fixed_elastic_range_is_accepted_and_a_real_range_refused() -> None:
    assert read_launch_env({"PET_NNODES": "3:3"}).world_size == 3
    with pytest.raises(LaunchEnvError, match="elastic range"):
        read_launch_env({"PET_NNODES": "1:4"})


def test_cellmesh_variables_win_over_the_rendezvous() -> None:
    env = read_launch_env(
        {
            "CELLMESH_REGISTRY": "tcp://127.0.0.1:5",
            "CELLMESH_JOB": "j",
            "PET_RDZV_ID": "other",
            "PET_RDZV_BACKEND": "etcd",
            "PET_RDZV_ENDPOINT": "e:1",
            "CELLMESH_CPUS": "4",
            "CELLMESH_MEMORY_BYTES": "1073741824",
        }
    )
    assert (env.registry, env.job, env.cpus, env.memory_bytes) == ("tcp://127.0.0.1:5", "j", 4, 2**30)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "x"}, "RANK='x' is not an integer"),
        ({"RANK": "-1"}, "RANK=-1 must be >= 0"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 is not below WORLD_SIZE=4"),
        ({"RANK": "1", "PET_NODE_RANK": "2"}, "RANK=1 contradicts PET_NODE_RANK=2"),
        ({"WORLD_SIZE": "2", "PET_NNODES": "3"}, "WORLD_SIZE=2 contradicts PET_NNODES=3"),
        ({"PET_NPROC_PER_NODE": "4"}, "one process per pod"),
        ({"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "m:29400"}, "through etcd"),
        ({"PET_RDZV_BACKEND": "etcd"}, "needs PET_RDZV_ENDPOINT"),
        ({"MASTER_PORT": "70000"}, "not a TCP port"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ],
)
def test_bad_values_name_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_launch_env(environ)
