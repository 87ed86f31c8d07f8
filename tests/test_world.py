"""World discovery, scheduler variables, device choice and shared errors."""

import pytest
import torch

from hpcnet import world as world_module
from hpcnet.agree import agree_on_error, is_agreed, shared_errors
from hpcnet.errors import ConfigError, UsageError
from hpcnet.world import (
    MACHINE_ID_FILE,
    SCHEDULER_ENV,
    choose_device,
    cpu_threads,
    discover,
    launcher_env,
    machine_id,
    machine_sharing,
    mpi_yield_when_idle,
    node_layout,
    sharing,
)
from tests.helpers.comm import hostnames


def test_launcher_env_table():
    assert launcher_env({}) == ("singleton", {})
    name, values = launcher_env({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
                                 "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    assert name == "openmpi" and values == {"global_rank": "3", "world_size": "8", "local_rank": "1"}
    # mpirun inside sbatch is still a SLURM job
    name, values = launcher_env({"SLURM_JOB_ID": "42", "OMPI_COMM_WORLD_RANK": "0"})
    assert name == "slurm" and values["job_id"] == "42"
    assert launcher_env({"PMI_RANK": "2", "PMI_SIZE": "4"})[0] == "hydra"
    for table in SCHEDULER_ENV.values():
        assert "global_rank" in table


def test_node_layout_pure():
    hosts = ["a", "a", "b", "b", "a", "c"]
    assert node_layout(hosts) == [(0, 0, 3), (0, 1, 3), (1, 0, 2), (1, 1, 2), (0, 2, 3), (2, 0, 1)]
    assert node_layout(["h"] * 5, ranks_per_node=2) == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2), (2, 0, 1)]


@pytest.mark.mpi
def test_discover(comm):
    world = discover(comm, environ={})
    assert (world.rank, world.size) == (comm.Get_rank(), comm.Get_size())
    # a node per host (one here, or the local cluster's hosts), in the order of their first rank
    names = hostnames(comm)
    hosts = list(dict.fromkeys(names))
    mine = [r for r, name in enumerate(names) if name == names[comm.Get_rank()]]
    assert world.num_nodes == len(hosts) and world.node_index == hosts.index(names[comm.Get_rank()])
    assert world.local_size == len(mine) and world.local_rank == mine.index(comm.Get_rank())
    assert len(world.hostnames) == world.size and world.hostname in world.hostnames
    assert world.launcher == "singleton"


@pytest.mark.mpi
def test_virtual_nodes(comm):
    world = discover(comm, environ={"HPCNET_RANKS_PER_NODE": "2"})
    size = comm.Get_size()
    assert world.num_nodes == (size + 1) // 2
    assert (world.node_index, world.local_rank) == divmod(comm.Get_rank(), 2)
    with pytest.raises(UsageError, match="HPCNET_RANKS_PER_NODE"):
        discover(comm, environ={"HPCNET_RANKS_PER_NODE": "two"})


def test_srun_without_pmix_is_caught():
    from mpi4py import MPI

    comm = MPI.COMM_SELF  # a singleton, as each process of a bare `srun python` is
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("needs a singleton MPI process")
    with pytest.raises(UsageError, match="--mpi=pmix"):
        discover(comm, environ={"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"})


@pytest.mark.mpi
def test_device_and_threads(comm):
    world = discover(comm, environ={})
    if not torch.cuda.is_available():
        assert choose_device(world, "auto").type == "cpu"
        with pytest.raises(UsageError, match="dist.device: 'cuda'"):
            choose_device(world, "cuda")
    assert choose_device(world, "cpu").type == "cpu"
    assert cpu_threads(world, 3) == 3
    assert cpu_threads(world) >= 1


@pytest.mark.mpi
def test_shared_errors_raise_on_every_rank(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    with pytest.raises(ConfigError if rank == size - 1 else UsageError, match="bad option x") as info:
        with shared_errors(comm):
            if rank == size - 1:
                raise ConfigError("bad option x")
    assert is_agreed(info.value)
    with pytest.raises(RuntimeError if rank else KeyError, match=r"rank 0: KeyError: .*boom" if rank else "boom"):
        with shared_errors(comm):
            if rank == 0:
                raise KeyError("boom")
    agree_on_error(comm, None)  # nothing pending: returns on every rank
    comm.Barrier()


@pytest.mark.mpi
def test_discover_lists_every_rank_s_own_host_in_rank_order(comm):
    """On the local cluster's 4-rank pass the ranks are on two hosts; MPI may shorten a fully qualified name."""
    world = discover(comm, environ={})
    assert [name.split(".")[0] for name in world.hostnames] == [name.split(".")[0] for name in hostnames(comm)]
    assert world.hostname == world.hostnames[comm.Get_rank()]


def test_sharing_counts_the_ranks_and_cores_of_one_machine_across_its_hosts():
    # Four hosts (namespaces) of one machine, 8 ranks each on cores {0, 1}, and a real second machine.
    ids = [("boot-a", frozenset({0, 1}))] * 32 + [("boot-b", frozenset({0})), ("boot-b", frozenset({1, 2}))]
    assert sharing(ids, 0) == sharing(ids, 31) == (32, 2)
    assert sharing(ids, 32) == sharing(ids, 33) == (2, 3)  # the union of the affinities


def test_machine_id_is_the_kernel_boot_id(comm):
    with open(MACHINE_ID_FILE) as f:
        assert machine_id() == f.read().strip() != ""
    ranks, cores = machine_sharing(comm)
    assert ranks == comm.Get_size() and cores >= 1  # the test ranks run on this machine


def test_mpi_yield_when_idle_sets_open_mpi_once(comm, monkeypatch):
    from mpi4py import MPI

    monkeypatch.delenv(world_module.YIELD_ENV, raising=False)
    if "Open MPI" not in MPI.Get_library_version():
        assert mpi_yield_when_idle() is None
        return
    first = mpi_yield_when_idle()
    assert first in (True, False)  # False: mpirun had turned it on (an oversubscribed node)
    assert mpi_yield_when_idle() is False  # on now


def test_mpi_yield_when_idle_leaves_an_explicit_setting_alone(monkeypatch):
    monkeypatch.setattr(world_module.ctypes, "CDLL", None)  # would fail if it were looked at
    monkeypatch.setenv(world_module.YIELD_ENV, "0")
    assert mpi_yield_when_idle() is False


def test_mpi_yield_when_idle_without_the_switch_changes_nothing(monkeypatch):
    monkeypatch.delenv(world_module.YIELD_ENV, raising=False)
    class NoSwitch:  # an MPI library that is not Open MPI
        def __init__(self, name):
            pass

    monkeypatch.setattr(world_module.ctypes, "CDLL", NoSwitch)
    assert mpi_yield_when_idle() is None
