"""The hosts and GPUs a job runs on, as the topology probe finds them (pure).

A ``Node`` is a node (or a virtual node: ``HPCNET_RANKS_PER_NODE``) with its ranks, the GPUs and network
interfaces its leader sees and the interface its host uses towards rank 0; a ``RankInfo`` places one rank.
``common_interface`` is the fastest interface name every node has, and ``expected_rendezvous`` the address rank 0
offers first for the rendezvous.  ``hpcnet.comm.topology`` fills them in; ``hpcnet.comm.measured`` holds them in
the ``Topology``.
"""

import os
from dataclasses import dataclass, field
from typing import Any

from hpcnet.comm.netif import IbPort, Interface, preference, rendezvous_order


@dataclass(kw_only=True, slots=True)
class Gpu:
    """A GPU visible to a node's leader."""

    index: int
    name: str
    memory_bytes: int


@dataclass(kw_only=True, slots=True)
class InterfaceUse:
    """The interface a host uses towards rank 0's rendezvous address (``netif.interface_towards``)."""

    name: str
    address: str
    reason: str
    """``holds <address>``, ``same subnet as <address>``, ``route to <address>`` or ``named by dist.interface``."""


@dataclass(kw_only=True, slots=True)
class Node:
    """A node (or a virtual node): its ranks and the hardware its leader sees."""

    index: int
    host: str
    ranks: list[int]
    """Global ranks, in local-rank order; ``ranks[0]`` is the leader."""
    interfaces: list[Interface] = field(default_factory=list)
    """Up, non-loopback IPv4 interfaces, best first (``netif.interfaces``)."""
    ib_ports: list[IbPort] = field(default_factory=list)
    gpus: list[Gpu] = field(default_factory=list)
    uses: InterfaceUse | None = None
    """The interface its host uses towards the address rank 0 offers first for the rendezvous; None: none found."""

    @property
    def leader(self) -> int:
        return self.ranks[0]

    @property
    def has_ib(self) -> bool:
        """An active RDMA port, or an IPoIB interface."""
        return any(p.state == "ACTIVE" for p in self.ib_ports) or any(i.infiniband for i in self.interfaces)


@dataclass(kw_only=True, slots=True)
class RankInfo:
    """Where one rank runs."""

    rank: int
    host: str
    node_index: int
    local_rank: int
    gpu_count: int
    """GPUs this rank can see (after CUDA_VISIBLE_DEVICES)."""



def expected_rendezvous(nodes: list[Node], spec: str = "", environ: Any = None) -> str | None:
    """The address rank 0 offers first for the rendezvous, as known before it (pure logic): ``MASTER_ADDR``
    when set; 127.0.0.1 on one node without ``dist.interface``; else rank 0's first candidate
    (``netif.rendezvous_order``, the fastest interface name every node has first, as ``hpcnet.train``
    prefers it).  None: rank 0 has no candidate.
    """
    environ = os.environ if environ is None else environ
    if environ.get("MASTER_ADDR"):
        return environ["MASTER_ADDR"]
    if len(nodes) == 1 and not spec:
        return "127.0.0.1"
    prefer = "" if spec else (common_interface(nodes) or "")
    order = rendezvous_order(nodes[0].interfaces, spec, prefer) if nodes else []
    return order[0].address if order else None


def common_interface(nodes: list[Node]) -> str | None:
    """The fastest interface name every node has, or None (pure logic).

    ``netif.preference`` over the nodes' links of each name: InfiniBand (IPoIB)
    first, then by the slowest node's link speed (unknown speeds last); virtual
    bridges only when nothing else is common.
    """
    if not nodes:
        return None
    names = set.intersection(*({i.name for i in n.interfaces} for n in nodes))
    if not names:
        return None

    def weakest(name: str) -> Interface:
        """What every node's link of that name can be counted on for: InfiniBand only if all are, the lowest speed."""
        links = [i for n in nodes for i in n.interfaces if i.name == name]
        kind = ("virtual" if any(i.virtual for i in links) else
                "ipoib" if all(i.infiniband for i in links) else "ethernet")
        return Interface(name, "", kind, min(i.speed_mbps for i in links))

    return min(names, key=lambda name: preference(weakest(name)))

