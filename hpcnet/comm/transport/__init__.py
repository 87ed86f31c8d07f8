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
``wait_all``), ``torchdist``, ``mpi``, ``hierarchical``, ``shm``, ``faulty``; ``build`` (``build_transport`` picks
one, ``build_group_gather`` stage 3's gathers).
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "WANTS_NOTHING": "base", "CollectiveExecutor": "base", "CommFailure": "base", "Done": "base", "Failed": "base",
    "GatherGroup": "base", "GatherHandle": "base", "GroupGather": "base", "Handle": "base", "Transport": "base",
    "succeeded": "base", "wait_all": "base",
    "FaultyTransport": "faulty",
    "HierarchicalTransport": "hierarchical", "PIPELINE_CHUNK_BYTES": "hierarchical", "enqueue_in_order": "hierarchical",
    "MpiGroupGather": "mpi", "MpiTransport": "mpi",
    "ShmTransport": "shm",
    "TorchGroupGather": "torchdist", "TorchTransport": "torchdist",
    "build_transport": "build", "build_group_gather": "build",
})
