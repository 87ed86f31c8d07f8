"""Which transport a job's route makes (``build_transport``: NCCL, gloo, MPI, shared memory, hierarchical), and
which of stage 3's gathers (``build_group_gather``: MPI's or torch.distributed's)."""

import datetime
from typing import Any

from hpcnet.comm.transport.base import GatherGroup, GroupGather, Transport
from hpcnet.comm.transport.hierarchical import PIPELINE_CHUNK_BYTES, HierarchicalTransport
from hpcnet.comm.transport.mpi import MpiGroupGather, MpiTransport
from hpcnet.comm.transport.shm import ShmTransport
from hpcnet.comm.transport.torchdist import TorchGroupGather, TorchTransport
from hpcnet.world import World


def build_transport(kind: str, hierarchical: bool, comm: Any, world: World, *,
                    timeout_s: float | None = None, progress: str = "thread",
                    inter_node: str | None = None, wire: Any = None, feedback: Any = None,
                    chunk_bytes: int = PIPELINE_CHUNK_BYTES) -> Transport:
    """Create a transport over the ranks of ``comm`` (collective).

    ``timeout_s`` (``dist.timeout_s``; None: torch's default) is given to
    every torch.distributed group created here: NCCL enforces it in its own
    watchdog, so nothing waits on a NCCL work with a CPU timeout (see
    the ``TorchHandle`` docstring).  ``progress`` ('thread' or 'inline',
    ``hpcnet.comm.route.mpi_progress``) says where MPI collectives run;
    ``inter_node`` (``Route.inter_node``) what a hierarchical transport uses
    between the nodes when not ``kind``; ``wire`` (``dist.compression``'s
    dtype) is applied by a hierarchical transport with gloo between the nodes,
    there only, and ignored by the others (the reducer compresses for them);
    ``feedback`` (``hpcnet.comm.quantize.ErrorFeedback``) keeps int8's residuals; ``chunk_bytes`` is a
    hierarchical transport's pipelined chunk.
    """
    if kind == "shm":
        return ShmTransport(comm, world)  # hierarchical by construction: shared memory in a node, MPI across
    if hierarchical and world.size > 1:
        between = inter_node or kind
        return HierarchicalTransport(comm, node_index=world.node_index, local_rank=world.local_rank, kind=kind,
                                     timeout_s=timeout_s, progress=progress, cross_kind=inter_node,
                                     wire=wire if between == "gloo" else None, feedback=feedback,
                                     chunk_bytes=chunk_bytes)
    if kind == "mpi":
        return MpiTransport(comm, progress)
    import torch.distributed as dist

    if world.size == 1:
        return TorchTransport(None, kind, 1)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    group = dist.group.WORLD if dist.get_backend() == kind else dist.new_group(backend=kind, timeout=timeout)
    return TorchTransport(group, kind, world.size)


def build_group_gather(kind: str, comm: Any, groups: list[GatherGroup], tensors: list[Any],
                       owner: list[int]) -> GroupGather:
    """Stage 3's gathers over the ranks of ``comm`` (collective): 'mpi' (CPU tensors) or 'torch'
    (``torch.distributed``'s default group: CUDA, or gloo)."""
    if kind == "mpi":
        return MpiGroupGather(comm, groups, tensors, owner)
    if kind == "torch":
        return TorchGroupGather(comm, groups, tensors, owner)
    raise ValueError(f"a group gather is 'mpi' or 'torch', not {kind!r}")
