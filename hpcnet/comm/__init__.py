"""The data plane and what decides it, on the ranks, nodes and devices of ``hpcnet.world``.

``netif`` (network interfaces), ``nodes``, ``pingpong``, ``measured`` and ``topology`` (the measured
topology; ``python -m hpcnet.comm.topology``), ``costmodel``, ``route`` and ``forecast`` (which transport, which
path, what a step's communication should take), ``bootstrap`` (torch.distributed from MPI), ``transport`` (how a
bucket is summed: NCCL, gloo, MPI, shared memory, hierarchical; and how stage 3's gathers move), ``buckets`` and
``reducer`` (buckets filled during backward), ``replicas`` (replicas kept equal), ``sharding`` (what each rank
owns, and all that differs by ``dist.zero`` stage), ``exchange`` and ``dataparallel`` (the wrapper the loop
drives).  Reference: docs/communication.md, docs/memory.md, docs/topology.md.
"""

from hpcnet import _lazy_exports

__all__, __getattr__, __dir__ = _lazy_exports(__name__, {
    "DataParallel": "dataparallel", "Reducer": "reducer", "build_transport": "transport", "agree_route": "route",
    "init_data_plane": "bootstrap", "DataPlane": "bootstrap", "probe": "topology", "recommend": "topology",
    "LinkCost": "costmodel",
})
