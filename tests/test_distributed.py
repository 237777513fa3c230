"""Rank and world size from the environment, sharding, the master address: `pytest tests/test_distributed.py`."""

from __future__ import annotations

import socket

import pytest

from ncfcli.errors import NcfError
from ncfcli.launch import distributed, environment
from ncfcli.launch.environment import DistEnv, env_from_environ, first_slurm_host, slurm_master


def test_no_variables_is_one_process() -> None:
    assert env_from_environ({}) == DistEnv(rank=0, world_size=1, local_rank=0)
    assert not DistEnv().enabled and DistEnv().is_main


def test_torchrun_variables() -> None:
    env = env_from_environ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert env == DistEnv(rank=5, world_size=8, local_rank=1)
    assert env.enabled and not env.is_main


def test_torchrun_variables_win_over_slurm() -> None:
    # `srun ... ncf train --gpus 8`: the launcher's variables describe the workers, not srun's
    environ = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "SLURM_STEP_NUM_TASKS": "2",
               "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}  # fmt: skip
    assert env_from_environ(environ) == DistEnv(rank=3, world_size=4, local_rank=3)


def test_srun_step_variables() -> None:
    environ = {"SLURM_STEP_NUM_TASKS": "16", "SLURM_NTASKS": "16", "SLURM_PROCID": "9",
               "SLURM_LOCALID": "1"}  # fmt: skip
    assert env_from_environ(environ) == DistEnv(rank=9, world_size=16, local_rank=1)


def test_sbatch_script_without_srun_is_one_process() -> None:
    # an sbatch script has SLURM_NTASKS and SLURM_PROCID too; reading them would wait forever
    environ = {"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}
    assert env_from_environ(environ) == DistEnv()


def test_local_rank_defaults_to_rank() -> None:
    assert env_from_environ({"RANK": "1", "WORLD_SIZE": "2"}).local_rank == 1


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2, WORLD_SIZE=2"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK must be an integer, got 'x'"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ],
)
def test_inconsistent_environment_is_one_line(environ: dict[str, str], message: str) -> None:
    with pytest.raises(NcfError, match=message) as e:
        env_from_environ(environ)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("n", [0, 1, 5, 8, 300, 1001])
def test_shards_cover_every_item_once(world: int, n: int) -> None:
    shards = [DistEnv(rank=r, world_size=world).shard(n) for r in range(world)]
    covered = [i for start, end in shards for i in range(start, end)]
    assert covered == list(range(n))
    sizes = [end - start for start, end in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the first n % world ranks take the extra one


def test_shard_exact_values() -> None:
    assert [DistEnv(rank=r, world_size=3).shard(10) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [
        ("gpu07", "gpu07"),
        ("gpu[07-09,12]", "gpu07"),
        ("node[3,5-6],login1", "node3"),
        ("a1,b[2-3]", "a1"),
        ("dgx-[001-004]-ib", "dgx-001-ib"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_slurm_master_prefers_the_step_nodes_and_derives_the_port() -> None:
    environ = {
        "SLURM_JOB_NODELIST": "n[1-8]",
        "SLURM_STEP_NODELIST": "n[3-4]",
        "SLURM_JOB_ID": "123457",
    }
    assert slurm_master(environ) == ("n3", 20000 + 123457 % 20000)


def test_collectives_are_noops_at_world_size_one() -> None:
    import torch

    env = DistEnv()
    distributed.init(env, "cpu")
    t = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce_sum(t, env).tolist() == [1.0, 2.0]
    distributed.barrier(env)
    distributed.shutdown(env)


def test_port_in_use_at_init_names_the_port(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.setenv("NCF_DIST_TIMEOUT", "5")
        with pytest.raises(NcfError, match=f"--master-port {port} is in use"):
            distributed.init(DistEnv(rank=0, world_size=2), "cpu")


@pytest.mark.parametrize("value", ["0", "-3", "soon"])
def test_bad_timeout_is_one_line(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("NCF_DIST_TIMEOUT", value)
    with pytest.raises(NcfError, match="NCF_DIST_TIMEOUT"):
        environment.timeout_seconds()


def test_the_collective_backend_follows_the_device_unless_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(environment.BACKEND_ENV, raising=False)
    assert (environment.backend_for("cuda:1"), environment.backend_for("cpu")) == ("nccl", "gloo")
    # gloo lets two ranks share a GPU (NCCL refuses): the device check's sharded run on one GPU
    monkeypatch.setenv(environment.BACKEND_ENV, "gloo")
    assert environment.backend_for("cuda:0") == "gloo"
    monkeypatch.setenv(environment.BACKEND_ENV, "NCCL")
    assert environment.backend_for("cuda") == "nccl"
    for value, message in (("mpi", "must be gloo or nccl, got 'mpi'"),
                           ("nccl", "NCF_DIST_BACKEND=nccl needs GPU workers")):  # fmt: skip
        monkeypatch.setenv(environment.BACKEND_ENV, value)
        with pytest.raises(NcfError, match=message) as e:
            environment.backend_for("cpu")
        assert "\n" not in str(e.value)
