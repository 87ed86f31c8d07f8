"""The gradients' route: which backend carries them, flat or hierarchical, and the fallback.

A pure function of the ``dist`` options, the device and the job's layout (``choose_route``), agreed on once
per job before the topology probe and the rendezvous (``agree_route``), so an impossible choice stops every
rank before anything is set up.  The choices are described in docs/communication.md.
"""

import logging
from dataclasses import dataclass
from typing import Any

from hpcnet.agree import mark_agreed, shared_errors
from hpcnet.config import DistConfig
from hpcnet.errors import UsageError
from hpcnet.world import World, cores_per_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Route:
    """Which transports to use (pure decision, see ``choose_route``); given to the bootstrap
    (``torch_backend``) and to ``DataParallel``."""

    primary: str
    hierarchical: bool
    fallback: str | None
    inter_node: str | None = None
    """Between nodes on the hierarchical path, when not ``primary``: 'gloo' under 'mpi' (``dist.inter_node``)."""

    @property
    def torch_backend(self) -> str | None:
        """The torch.distributed default group the route needs: 'nccl', 'gloo', or None (MPI only).

        The gloo fallback of a NCCL run is a subgroup created on demand from
        the NCCL default group, so NCCL wins.
        """
        kinds = {self.primary, self.fallback, self.inter_node} - {None, "mpi", "shm"}
        return "nccl" if "nccl" in kinds else ("gloo" if kinds else None)


HALF_PRECISIONS = ("fp16", "bf16")
"""``dist.compression`` values that are a wire dtype: the reducer casts buckets to it, or a hierarchical transport
the shards that cross the nodes (int8 is always the latter)."""

SPARE_CORES_FOR_THREAD = 2
"""A rank needs this many cores of its own for a worker thread to overlap MPI with backward (``mpi_progress``)."""


def hierarchical_layout(num_nodes: int, min_local_size: int, max_local_size: int | None = None) -> bool:
    """Hierarchical all-reduce pays when there are several nodes and every node has several ranks; it works only
    when every node has as many (``max_local_size``, default ``min_local_size``): each node's reduce-scatter cuts
    a bucket into as many shards as it has ranks, and shard i of every node is summed across the nodes."""
    max_local_size = min_local_size if max_local_size is None else max_local_size
    return num_nodes > 1 and min_local_size > 1 and max_local_size == min_local_size


def choose_route(cfg: DistConfig, *, device_type: str, num_nodes: int, min_local_size: int,
                 cuda_aware: bool = False, hierarchical_hint: bool | None = None,
                 shm_wins: bool = False, max_local_size: int | None = None,
                 cores_per_rank: float = SPARE_CORES_FOR_THREAD) -> Route:
    """Decide the primary backend, flat or hierarchical, and the fallback (pure logic).

    The one place where ``dist.backend = 'auto'`` is resolved: the bootstrap
    and ``DataParallel`` both follow the route this returns.  An impossible
    choice is a ``UsageError`` naming the option.

    Args:
        cfg: the ``dist`` options.
        device_type: 'cpu' or 'cuda'.
        num_nodes: nodes in the job (virtual nodes count).
        min_local_size: ranks on the node with the fewest.
        max_local_size: ranks on the node with the most (default ``min_local_size``): hierarchical needs them
            equal; ``dist.hierarchical=on`` on nodes of unequal sizes is a ``UsageError``.
        cuda_aware: the MPI library can read GPU memory.
        hierarchical_hint: a measured topology's advice, used when
            ``dist.hierarchical`` is 'auto' (None: ``hierarchical_layout``;
            ``topology.recommend`` advises the same rule today).
        shm_wins: shm's sum measured faster than MPI's (``race_shm_against_mpi``):
            'fastest' on CPU is then 'shm'. 'auto' never races: a timing flips
            between runs, and shm and MPI differ in the last bits.
        cores_per_rank: the fewest cores a rank has (``dist.inter_node=auto``: gloo between the nodes of a
            hierarchical mpi route below ``SPARE_CORES_FOR_THREAD``, where MPI's polling would take the core that
            computes).
    """
    gpu = device_type == "cuda"
    primary = cfg.backend
    if primary in ("auto", "fastest"):
        primary = "nccl" if gpu else "shm" if shm_wins and cfg.backend == "fastest" else "mpi"
    if primary == "nccl" and not gpu:
        raise UsageError("dist.backend: 'nccl' needs a GPU device (dist.device is cpu or no GPU is visible)")
    if primary == "mpi" and gpu and not cuda_aware:
        raise UsageError("dist.backend: 'mpi' on GPU tensors needs a CUDA-aware MPI; use 'nccl'")
    if primary == "shm" and gpu:
        raise UsageError("dist.backend: 'shm' sums CPU tensors in shared memory; on GPU use 'nccl'")
    halves = cfg.compression in HALF_PRECISIONS  # the reducer casts whole buckets, or a hierarchical gloo hop
    int8 = cfg.compression == "int8"  # between the nodes only, always by a hierarchical transport with gloo there
    if int8:
        _check_int8(primary, cfg, num_nodes, min_local_size, max_local_size)
    if primary == "shm":
        hierarchical = False  # a node's ranks share memory, nodes use MPI: hierarchical by construction
    elif int8:
        hierarchical = num_nodes > 1  # even one rank a node: the transport is where the int8 exchange lives
    elif cfg.hierarchical == "auto":
        even = max_local_size is None or max_local_size == min_local_size
        hierarchical = (hierarchical_layout(num_nodes, min_local_size, max_local_size) if hierarchical_hint is None
                        else hierarchical_hint and even)
    else:
        hierarchical = cfg.hierarchical == "on"
        if hierarchical and max_local_size is not None and max_local_size != min_local_size:
            raise UsageError(f"dist.hierarchical=on needs as many ranks on every node; these nodes have "
                             f"{min_local_size} to {max_local_size}: set dist.hierarchical=auto or off")
    if cfg.fallback == "none":
        fallback = None
    elif cfg.fallback == "auto":
        fallback = "mpi" if primary in ("gloo", "shm") and (not gpu or cuda_aware) else "gloo"
        if fallback == "mpi" and halves:
            fallback = None  # the wire format cannot change mid-run, and MPI cannot sum it
    else:
        fallback = cfg.fallback
    if fallback == primary and fallback != "gloo":
        fallback = None  # a fresh gloo group is a real alternative; the same MPI communicator is not
    if fallback == "mpi" and gpu and not cuda_aware:
        raise UsageError("dist.fallback: 'mpi' on GPU tensors needs a CUDA-aware MPI; use 'gloo'")
    if fallback == "mpi" and halves:
        raise UsageError(f"dist.fallback: 'mpi' cannot carry dist.compression={cfg.compression} "
                         "(MPI has no half-precision sum); use 'gloo' or 'none'")
    inter_node = None
    if hierarchical and primary == "mpi" and not gpu and (
            int8 or cfg.inter_node == "gloo"
            or (cfg.inter_node == "auto" and cores_per_rank < SPARE_CORES_FOR_THREAD)):
        inter_node = "gloo"
    if halves and primary in ("mpi", "shm") and inter_node is None:
        which = f"{cfg.backend!r} is mpi on CPU" if cfg.backend in ("auto", "fastest") else f"is {primary!r}"
        raise UsageError(f"dist.compression: {cfg.compression} needs the nccl or gloo backend, or gloo between the "
                         f"nodes of a hierarchical mpi route, and dist.backend {which} here (MPI has no "
                         "half-precision sum); set dist.backend=gloo")
    return Route(primary, hierarchical, fallback, inter_node)


def _check_int8(primary: str, cfg: DistConfig, num_nodes: int, min_local_size: int,
                max_local_size: int | None) -> None:
    """``dist.compression=int8``'s conditions (pure): it runs between the nodes of a hierarchical transport, with
    gloo there (``HierarchicalTransport._start_int8``); a UsageError naming the option otherwise."""
    if primary == "nccl":
        raise UsageError("dist.compression: int8 runs between the nodes over gloo, and dist.backend is nccl here; "
                         "on GPUs use bf16 or fp16")
    if primary == "shm":
        raise UsageError("dist.compression: int8 runs on the hierarchical path; dist.backend=shm has none: set "
                         "dist.backend to mpi or gloo")
    if num_nodes > 1 and cfg.hierarchical == "off":
        raise UsageError("dist.compression: int8 compresses the sums between the nodes of the hierarchical path, and "
                         "dist.hierarchical is off: set it to auto")
    if num_nodes > 1 and max_local_size is not None and max_local_size != min_local_size:
        raise UsageError(f"dist.compression: int8 needs as many ranks on every node (the hierarchical path); these "
                         f"nodes have {min_local_size} to {max_local_size}")
    if primary == "mpi" and cfg.inter_node == "primary":
        raise UsageError("dist.compression: int8 runs between the nodes over gloo, and dist.inter_node is primary "
                         "(MPI): set it to auto or gloo")


def mpi_progress(option: str, cores_per_rank: float) -> str:
    """Where MPI collectives of the data plane run, 'thread' or 'inline' (pure; ``dist.progress``).

    A worker thread overlaps the all-reduce with backward only if it has a
    core to run on: on a rank with one core (or less) it busy-polls the core
    that computes, and each hand-off waits for the scheduler, so 'auto' is
    inline there (see benchmarks/README.md).
    """
    if option != "auto":
        return option
    return "thread" if cores_per_rank >= SPARE_CORES_FOR_THREAD else "inline"


def agree_route(comm: Any, world: World, cfg: DistConfig, *, device_type: str,
                hierarchical_hint: bool | None = None) -> Route:
    """Collective: ``choose_route`` for this job, the same on every rank, or the same error on every rank.

    Ranks that see different devices (a node without GPUs under
    ``dist.device=auto``) would initialise different backends and wait for
    each other forever; that is an error naming them.
    """
    # One exchange for the layout: each rank's node size and cores.
    sizes, cores = zip(*comm.allgather((world.local_size, cores_per_rank(world))))
    min_local, max_local = min(sizes), max(sizes)
    shm_wins = False
    if cfg.backend == "fastest" and device_type == "cpu" and cfg.compression in ("none", "auto") and min_local > 1 \
            and max_local == min_local:
        from hpcnet.comm.transport.shm import RACE_BYTES, race_shm_against_mpi

        mpi_s, shm_s = race_shm_against_mpi(comm, world, RACE_BYTES)
        shm_wins = shm_s < mpi_s
        if world.is_main:
            log.info("dist.backend=fastest: %s; %d MiB sums measured: shm %.2f ms, mpi %.2f ms (slowest rank's "
                     "median)", "shm" if shm_wins else "mpi", RACE_BYTES >> 20, shm_s * 1e3, mpi_s * 1e3)
    with shared_errors(comm):
        route = choose_route(cfg, device_type=device_type, num_nodes=world.num_nodes, min_local_size=min_local,
                             cuda_aware=device_type == "cuda" and cuda_aware_mpi(),
                             hierarchical_hint=hierarchical_hint, shm_wins=shm_wins, max_local_size=max_local,
                             cores_per_rank=min(cores))
    routes = comm.allgather((device_type, route))
    odd = [r for r, p in enumerate(routes) if p != routes[0]]
    if odd:
        raise mark_agreed(UsageError(
            f"the ranks chose different transports: rank 0 has a {routes[0][0]} device and {routes[0][1]}, rank "
            f"{odd[0]} a {routes[odd[0]][0]} device and {routes[odd[0]][1]} (ranks {odd} differ); set dist.device"))
    return route


def cuda_aware_mpi() -> bool:
    """True when the MPI library says it can read CUDA device memory."""
    try:
        from mpi4py import MPI

        query = getattr(MPI, "Query_cuda_support", None)
        return bool(query()) if query else False
    except Exception:  # noqa: BLE001 - an MPI without the query is not CUDA-aware for us
        return False

