"""Who is where: ranks, nodes and devices, discovered through MPI, and what the machine under a rank offers (its
cores, its kernel); below every package that takes the job's ``World`` (the data plane, the checkpoints, the
monitor and the injector).

The MPI communicator is the source of truth for rank and size.  The launcher's
environment (SLURM, Open MPI, MPICH/PMI, PMIx) is read through one mapping
table, ``SCHEDULER_ENV``, for job ids and to catch a classic mistake: ``srun``
without ``--mpi=pmix`` starts N singleton MPI processes that each think they
are alone.
"""

import ctypes
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpcnet.errors import UsageError
from hpcnet.paths import RANKS_PER_NODE_ENV

log = logging.getLogger(__name__)

MACHINE_ID_FILE = "/proc/sys/kernel/random/boot_id"
"""The running kernel's id: processes that read the same one share a machine, and its cores."""

# One table for every scheduler variable hpcnet reads (after submitit's
# slurm.py): launcher -> our name -> environment variable.
SCHEDULER_ENV: dict[str, dict[str, str]] = {
    "slurm": {
        "job_id": "SLURM_JOB_ID",
        "global_rank": "SLURM_PROCID",
        "world_size": "SLURM_NTASKS",
        "local_rank": "SLURM_LOCALID",
        "node_index": "SLURM_NODEID",
        "num_nodes": "SLURM_JOB_NUM_NODES",
        "cpus_per_task": "SLURM_CPUS_PER_TASK",
        "restart_count": "SLURM_RESTART_COUNT",
    },
    "openmpi": {
        "job_id": "OMPI_MCA_orte_ess_jobid",
        "global_rank": "OMPI_COMM_WORLD_RANK",
        "world_size": "OMPI_COMM_WORLD_SIZE",
        "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
        "local_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    "pmix": {
        "global_rank": "PMIX_RANK",
    },
    "hydra": {  # MPICH and Intel MPI
        "global_rank": "PMI_RANK",
        "world_size": "PMI_SIZE",
        "local_rank": "MPI_LOCALRANKID",
        "local_size": "MPI_LOCALNRANKS",
    },
}


def launcher_env(environ: Mapping[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """Return the launcher that started this process and its variables by our names.

    SLURM wins over the MPI runtime, because ``mpirun`` inside ``sbatch`` is
    still a SLURM job.  ``("singleton", {})`` when nothing is set.
    """
    environ = os.environ if environ is None else environ
    for launcher, table in SCHEDULER_ENV.items():
        values = {name: environ[var] for name, var in table.items() if var in environ}
        if "global_rank" in values or (launcher == "slurm" and "job_id" in values):
            return launcher, values
    return "singleton", {}


@dataclass(frozen=True, slots=True)
class World:
    """The layout of one MPI job, equal in content on every rank but rank fields."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    node_index: int
    num_nodes: int
    hostname: str
    hostnames: tuple[str, ...]
    """Host of every rank, indexed by rank."""
    launcher: str
    job_id: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def node_layout(hostnames: list[str], ranks_per_node: int = 0) -> list[tuple[int, int, int]]:
    """Per rank, ``(node_index, local_rank, local_size)`` from hosts (pure logic).

    Nodes are numbered in order of their lowest rank.  ``ranks_per_node > 0``
    splits ranks into virtual nodes of consecutive ranks instead.
    """
    keys: list[Any] = ([r // ranks_per_node for r in range(len(hostnames))] if ranks_per_node > 0
                       else list(hostnames))
    order: dict[Any, int] = {}
    members: dict[Any, list[int]] = {}
    for rank, key in enumerate(keys):
        order.setdefault(key, len(order))
        members.setdefault(key, []).append(rank)
    return [(order[key], members[key].index(rank), len(members[key])) for rank, key in enumerate(keys)]


def discover(comm: Any, environ: Mapping[str, str] | None = None) -> World:
    """Discover the world of ``comm`` (collective).

    Local ranks come from ``Split_type(COMM_TYPE_SHARED)`` (ranks sharing
    memory), unless ``HPCNET_RANKS_PER_NODE`` asks for virtual nodes.
    """
    from mpi4py import MPI

    environ = os.environ if environ is None else environ
    launcher, values = launcher_env(environ)
    rank, size = comm.Get_rank(), comm.Get_size()
    if MPI.COMM_WORLD.Get_size() == 1 and int(values.get("world_size", "1") or 1) > 1:
        # Every process is a singleton: the launcher did not wire up MPI.
        raise UsageError(
            f"this process is MPI rank 0 of 1, but {launcher} started {values['world_size']} tasks: "
            "the processes did not join one MPI job (with srun use --mpi=pmix; check `srun --mpi=list`)"
        )
    hostname = MPI.Get_processor_name() or socket.gethostname()
    hostnames = comm.allgather(hostname)
    try:
        virtual = int(environ.get(RANKS_PER_NODE_ENV, "0") or 0)
    except ValueError:
        raise UsageError(f"{RANKS_PER_NODE_ENV}={environ[RANKS_PER_NODE_ENV]!r} is not an integer") from None
    if virtual > 0:
        node_index, local_rank, local_size = node_layout(hostnames, virtual)[rank]
    else:
        # Shared-memory split is what the hardware says; hostnames can lie
        # (containers) and are only a label here.
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        try:
            local_rank, local_size = local.Get_rank(), local.Get_size()
            leader_rank = local.bcast(rank, root=0)
        finally:
            local.Free()
        leaders = sorted(set(comm.allgather(leader_rank)))
        node_index = leaders.index(leader_rank)
    num_nodes = comm.allreduce(node_index, op=MPI.MAX) + 1
    return World(
        rank=rank, size=size, local_rank=local_rank, local_size=local_size,
        node_index=node_index, num_nodes=num_nodes, hostname=hostname,
        hostnames=tuple(hostnames), launcher=launcher, job_id=values.get("job_id", ""),
    )


def usable_cores() -> frozenset[int]:
    """The CPUs this process may run on (its affinity: a SLURM cpuset, a binding), or all of them."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return frozenset(range(os.cpu_count() or 1))


def machine_id() -> str:
    """This machine's kernel boot id (hostname when unreadable).

    Hosts made of network namespaces or containers on one machine have their
    own hostnames and addresses but one kernel and one set of cores: the boot
    id tells them apart from real hosts, which is what oversubscription is
    about (``machine_sharing``).
    """
    try:
        with open(MACHINE_ID_FILE) as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def sharing(ids: list[tuple[str, frozenset[int]]], rank: int) -> tuple[int, int]:
    """``(ranks, cores)`` on ``rank``'s machine (pure): the ranks with its machine id and the union of their
    CPU affinities. ``ids`` holds every rank's ``(machine_id(), usable_cores())``."""
    mine = ids[rank][0]
    here = [cores for machine, cores in ids if machine == mine]
    return len(here), len(frozenset().union(*here))


def machine_sharing(comm: Any) -> tuple[int, int]:
    """``(ranks, cores)`` on this rank's machine, across the job's hosts on it (collective; see ``sharing``)."""
    return sharing(comm.allgather((machine_id(), usable_cores())), comm.Get_rank())


YIELD_ENV = "OMPI_MCA_mpi_yield_when_idle"
"""Where ``mpirun --mca mpi_yield_when_idle N`` reaches a rank: an explicit choice, kept."""


def mpi_yield_when_idle() -> bool | None:
    """Make Open MPI's blocked calls give the core away (``sched_yield``) when they have nothing to progress.

    Open MPI busy-polls inside every blocking call.  ``mpirun`` turns yielding
    on (``mpi_yield_when_idle``) only where it knows a node holds more ranks
    than the slots it was given; ranks on hosts that share one machine's cores
    (namespaces, containers), or a host file with more slots than cores, get
    the aggressive polling, and a waiting rank then takes the core from one
    that computes.  The switch is read once at ``MPI_Init``; this sets it in
    the running library (Open MPI's ``opal_progress_set_yield_when_idle``).

    An explicit ``mpi_yield_when_idle`` (``mpirun --mca mpi_yield_when_idle 0``,
    ``OMPI_MCA_mpi_yield_when_idle``) is left as it is.

    Returns True when it is now on, False when it was on already or was set
    explicitly, None when the MPI library has no such switch (not Open MPI):
    nothing changed.
    """
    if os.environ.get(YIELD_ENV, "") != "":
        return False
    try:
        lib = ctypes.CDLL(None)
        setter = lib.opal_progress_set_yield_when_idle
        current = ctypes.c_bool.in_dll(lib, "opal_progress_yield_when_idle")
    except (AttributeError, OSError, ValueError):
        return None
    if current.value:
        return False
    setter.argtypes = [ctypes.c_bool]
    setter.restype = None
    setter(True)
    return True


def cores_per_rank(world: World) -> float:
    """This rank's share of the cores it may run on (its affinity divided among the node's ranks)."""
    return len(usable_cores()) / world.local_size


def cpu_threads(world: World, requested: int = 0) -> int:
    """Torch threads for this rank: ``requested``, or the node's cores divided among its ranks."""
    if requested > 0:
        return requested
    return max(1, int(cores_per_rank(world)))


def choose_device(world: World, requested: str = "auto") -> Any:
    """``cuda:<local rank>`` when GPUs exist (or are asked for), else the CPU."""
    import torch

    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise UsageError(f"dist.device: 'cuda' was requested but rank {world.rank} on {world.hostname} sees no GPU")
    if requested == "cpu" or not has_cuda:
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if world.local_size > count:
        # Sharing a GPU between ranks works but is rarely intended.
        import logging
        logging.getLogger(__name__).warning(
            "%d ranks on %s share %d GPU(s)", world.local_size, world.hostname, count)
    device = torch.device("cuda", world.local_rank % count)
    torch.cuda.set_device(device)
    return device


def wait_sleeping(request: Any, poll_s: float = 0.0005, status: Any = None) -> None:
    """Complete an MPI request (filling ``status``) polling it with sleeps: a blocked MPI call busy-polls a
    core (Open MPI), which the ranks still working need on an oversubscribed node."""
    while not request.Test(status):
        time.sleep(poll_s)
