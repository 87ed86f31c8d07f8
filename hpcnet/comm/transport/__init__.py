"""Transports: how one flat gradient bucket is summed across ranks.

Each transport starts a sum-all-reduce of a 1-d tensor in place and returns a
handle whose ``wait`` finishes it.  Four kinds:

- ``TorchTransport``: ``torch.distributed.all_reduce(async_op=True)`` on a
  NCCL or gloo group; NCCL and gloo progress on their own threads.
- ``MpiTransport``: ``MPI_Allreduce`` on the tensor's memory (no copy), on a
  private communicator, progressed one of two ways (``dist.progress``):
  ``thread``: from one worker thread per transport, so it runs while autograd
  computes the next gradients (mpi4py releases the GIL in MPI calls; MPI is
  initialised with ``MPI_THREAD_MULTIPLE``; Open MPI progresses non-blocking
  collectives only inside MPI calls, which is why a thread and not
  ``Iallreduce``); ``inline``: in the caller (the reducer's ``finish``), for a rank
  with no core to spare for a worker: the hand-off to a thread and back, and
  a busy-polling thread on the core that computes, cost more than the overlap
  gains there (see benchmarks/README.md).
- ``ShmTransport`` (``shm``): buckets in a node-shared MPI
  window, each rank summing its slice of them; MPI across nodes.
- ``HierarchicalTransport``: reduce-scatter inside the node, all-reduce of
  each shard among the ranks with the same local rank on other nodes, then
  all-gather inside the node, so each byte crosses the inter-node network
  once per node rather than once per rank.

Stage 3's gathers move parameters in rounds (``GroupGather``): ``MpiGroupGather`` (one ``MPI_Ialltoallw`` a
round, CPU) or ``TorchGroupGather`` (broadcasts, or sends and receives; CUDA); ``build_group_gather`` picks one.

Modules: ``base`` (the base classes and what each transport may offer, handles, ``CollectiveExecutor``,
``wait_all``), ``torchdist``, ``mpi``, ``hierarchical``, ``shm``, ``faulty``; ``build_transport`` picks one.
"""

import datetime
from typing import Any

from hpcnet.comm.transport.base import (
    WANTS_NOTHING,
    CollectiveExecutor,
    CommFailure,
    Done,
    Failed,
    GatherGroup,
    GatherHandle,
    GroupGather,
    Handle,
    Transport,
    succeeded,
    wait_all,
)
from hpcnet.comm.transport.faulty import FaultyTransport
from hpcnet.comm.transport.hierarchical import PIPELINE_CHUNK_BYTES, HierarchicalTransport, enqueue_in_order
from hpcnet.comm.transport.mpi import MpiGroupGather, MpiTransport
from hpcnet.comm.transport.shm import ShmTransport
from hpcnet.comm.transport.torchdist import TorchGroupGather, TorchTransport
from hpcnet.world import World

__all__ = ["WANTS_NOTHING", "CollectiveExecutor", "CommFailure", "Done", "Failed", "FaultyTransport", "GatherGroup",
           "GatherHandle", "GroupGather", "Handle", "HierarchicalTransport", "MpiGroupGather", "MpiTransport",
           "ShmTransport", "TorchGroupGather", "TorchTransport", "Transport", "build_group_gather",
           "build_transport", "enqueue_in_order", "succeeded", "wait_all"]


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
