"""What the job runs on: hosts, GPUs, network, and measured latency and bandwidth.

``probe(comm, world)`` collects every rank's host, local rank and GPUs, each
node's network interfaces and InfiniBand ports and the interface its host uses
towards rank 0, and times MPI ping-pong between all pairs of node leaders and
between each leader and a few ranks of its own node (``pingpong``: rounds of
disjoint pairs, each in a time slot, so the whole probe takes about
``budget_s`` seconds at any size; bandwidth in each direction).  Rank 0
assembles a ``Topology`` and broadcasts it, so every rank holds the same one.
The interfaces and ports are ``netif``'s.

``host_links(topology)`` sums it up per node (its ranks, its interface, its
intra-node link and its link to the other nodes) and ``slow_hosts`` names a
node whose link to the others is far below theirs; both are pure.

``recommend(topology)`` turns it into decisions (NCCL interface, whether to
disable NCCL's InfiniBand transport, flat or hierarchical all-reduce); it is
pure, like the pair schedule, and tested on one process.

Figures: latency is half the round trip of a small message, the *median* over
the repetitions; bandwidth is the large message's size over the *mean* half
round trip (one-way throughput: total bytes over total time, as
``mpi4py.bench pingpong`` computes it), in Gbit/s (1e9 bit/s; divide by 8 for
GB/s); each direction's figure is the size over the median time of the message
one way and a 1-byte answer.  Run on its own:

    mpirun -np 4 python -m mpi4py -m hpcnet.comm.topology [--out DIR] [--budget-s S] [--interface SPEC]
"""

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcnet.agree import shared_errors
from hpcnet.comm.netif import IbPort, Interface, ib_ports, interface_towards, interfaces, preference, rendezvous_order
from hpcnet.comm.pingpong import INTRA_SAMPLES, direction_key, pair_rounds, play_rounds
from hpcnet.comm.route import hierarchical_layout
from hpcnet.world import World, discover

FORMAT = "hpcnet-topology/2"
"""Written as ``format`` in topology.json; bumped when the layout changes."""
READABLE = (FORMAT, "hpcnet-topology/1")
"""Formats ``Topology.from_dict`` reads (a /1 document has no ``uses`` nor ``directed_gbps``)."""

SLOW_RATIO = 0.5
"""``slow_hosts``: a node whose link to the others is under this fraction of the other nodes' median is named."""

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


@dataclass(kw_only=True, slots=True)
class Topology:
    """The probe's result, equal on every rank.

    Pair figures are keyed ``"i-j"`` with global ranks ``i < j`` (``pair_key``);
    only the probed pairs are present.
    """

    size: int
    num_nodes: int
    virtual_nodes: bool
    """True when nodes share a host: HPCNET_RANKS_PER_NODE split it into virtual nodes."""
    nodes: list[Node]
    ranks: list[RankInfo]
    latency_us: dict[str, float]
    """Half round trip of ``small_bytes`` messages, median over repetitions, microseconds."""
    bandwidth_gbps: dict[str, float]
    """``large_bytes`` over its mean half round trip, Gbit/s (1e9 bit/s; /8 for GB/s)."""
    directed_gbps: dict[str, float] = field(default_factory=dict)
    """``large_bytes`` one way over the median time of it and a 1-byte answer, per direction ``"i->j"``
    (``pingpong.direction_key``): both directions of every probed pair."""
    small_bytes: int
    large_bytes: int
    rounds: int
    """Rounds of concurrent pairs the probe played."""
    budget_s: float
    probe_s: float
    """Wall time of the measurement, seconds."""

    def is_intra(self, key: str) -> bool:
        """True when the pair ``key`` lies inside one node."""
        i, j = (int(r) for r in key.split("-"))
        return self.ranks[i].node_index == self.ranks[j].node_index

    def _median(self, figures: dict[str, float], intra: bool) -> float | None:
        values = [v for k, v in figures.items() if self.is_intra(k) == intra]
        return statistics.median(values) if values else None

    @property
    def intra_latency_us(self) -> float | None:
        """Median over the intra-node pairs; None when there are none."""
        return self._median(self.latency_us, True)

    @property
    def inter_latency_us(self) -> float | None:
        return self._median(self.latency_us, False)

    @property
    def intra_bandwidth_gbps(self) -> float | None:
        return self._median(self.bandwidth_gbps, True)

    @property
    def inter_bandwidth_gbps(self) -> float | None:
        return self._median(self.bandwidth_gbps, False)

    def to_dict(self) -> dict[str, Any]:
        data = {"format": FORMAT, **dataclasses.asdict(self)}
        for node, record in zip(self.nodes, data["nodes"]):
            record["interfaces"] = [i.to_dict() for i in node.interfaces]
        data["summary"] = {name: getattr(self, name) for name in _SUMMARY_FIELDS}
        hosts = host_links(self)
        data["hosts"] = [h.to_dict() for h in hosts]
        data["slow_hosts"] = [dataclasses.asdict(s) for s in slow_hosts(hosts)]
        data["slow_links"] = [dataclasses.asdict(s) for s in slow_links(hosts, self)]
        data["warnings"] = link_warnings(self, hosts)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Topology":
        data = dict(data)
        if data.pop("format", FORMAT) not in READABLE:
            raise ValueError(f"not a {FORMAT} document")
        for derived in _DERIVED:  # from the pair figures
            data.pop(derived, None)
        data["nodes"] = [
            Node(**{**n, "interfaces": [Interface.from_dict(i) for i in n["interfaces"]],
                    "ib_ports": [IbPort(**p) for p in n["ib_ports"]], "gpus": [Gpu(**g) for g in n["gpus"]],
                    "uses": InterfaceUse(**n["uses"]) if n.get("uses") else None})
            for n in data["nodes"]]
        data["ranks"] = [RankInfo(**r) for r in data["ranks"]]
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        return cls.from_dict(json.loads(text))

    def write(self, path: str | os.PathLike) -> Path:
        """Write the JSON to ``path`` atomically (call it on one rank)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n")
        os.replace(tmp, path)
        return path

    def summary(self) -> str:
        """A few lines for the console."""
        per_node = sorted({len(n.ranks) for n in self.nodes})
        hosts = sorted({n.host for n in self.nodes})
        lines = [f"topology: {self.size} ranks on {self.num_nodes} {'virtual ' if self.virtual_nodes else ''}"
                 f"node(s) ({'/'.join(map(str, per_node))} per node), host(s) {', '.join(hosts[:4])}"
                 + (" ..." if len(hosts) > 4 else "")]
        leader = self.nodes[0]
        models = collections.Counter(f"{g.name} ({g.memory_bytes / 2**30:.0f} GiB)" for g in leader.gpus)
        lines.append(f"  GPUs: {sum(len(n.gpus) for n in self.nodes)} in all; node 0: "
                     + (", ".join(f"{count} x {model}" for model, count in models.items()) or "none"))
        nets = ", ".join(f"{i.name} ({i.speed_mbps} Mb/s)" if i.speed_mbps > 0 else f"{i.name} (speed unknown)"
                         for i in leader.interfaces) or "none"
        ib = "InfiniBand/RDMA on every node" if all(n.has_ib for n in self.nodes) else (
            "InfiniBand/RDMA on some nodes" if any(n.has_ib for n in self.nodes) else "no InfiniBand/RDMA")
        lines.append(f"  node 0 network: {nets}; {ib}")
        for kind, lat, bw in (("intra-node", self.intra_latency_us, self.intra_bandwidth_gbps),
                              ("inter-node", self.inter_latency_us, self.inter_bandwidth_gbps)):
            count = sum(self.is_intra(k) == (kind == "intra-node") for k in self.latency_us)
            if count:
                lines.append(f"  {kind}: latency {lat:.2f} us ({self.small_bytes} B), bandwidth {bw:.2f} Gbit/s "
                             f"= {bw / 8:.2f} GB/s ({_size(self.large_bytes)}), median of {count} pair(s)")
        lines.append(f"  probe: {len(self.latency_us)} pair(s) in {self.rounds} round(s), {self.probe_s:.2f} s")
        lines += ["  " + line for line in host_lines(host_links(self))]
        return "\n".join(lines)

    def warnings(self) -> list[str]:
        """``link_warnings``: a slow host (or, on two hosts, a slow direction), one line each; empty when none."""
        return link_warnings(self, host_links(self))


_SUMMARY_FIELDS = ("intra_latency_us", "inter_latency_us", "intra_bandwidth_gbps", "inter_bandwidth_gbps")
_DERIVED = ("summary", "hosts", "slow_hosts", "slow_links", "warnings")
MAX_HOST_LINES = 16
"""The console summary lists this many nodes (the slow ones first); topology.json has them all."""


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 and nbytes % (1 << 20) == 0 else f"{nbytes} B"


# --------------------------------------------------------------------------- pure logic


@dataclass(kw_only=True, slots=True)
class HostLinks:
    """One node's ranks, interface and measured links (``host_links``)."""

    node: int
    host: str
    name: str
    """How messages name it: the host, or ``host/node<i>`` where virtual nodes share a host."""
    shared: bool
    """Its host has other nodes too (virtual nodes): no NIC of its own, so ``slow_hosts`` leaves it out."""
    ranks: list[int]
    interface: InterfaceUse | None
    intra_latency_us: float | None
    """Median over its leader's pairs with ranks of its own node; None when it has one rank."""
    intra_bandwidth_gbps: float | None
    inter_latency_us: float | None
    """Median over its leader's pairs with the other nodes' leaders; None on one node."""
    inter_bandwidth_gbps: float | None
    """Median of those pairs' (two-way) bandwidth."""
    send_gbps: float | None
    """Its best one-way figure towards another node: what its own sending reaches when a peer is healthy."""
    receive_gbps: float | None
    """Its best one-way figure from another node."""
    peers: int
    """Other nodes its leader was timed against."""

    @property
    def link_gbps(self) -> float | None:
        """Its link to the others: the lower of ``send_gbps`` and ``receive_gbps`` (None: not measured)."""
        if self.send_gbps is None or self.receive_gbps is None:
            return None
        return min(self.send_gbps, self.receive_gbps)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "link_gbps": self.link_gbps}


@dataclass(kw_only=True, slots=True)
class SlowHost:
    """A node whose link to the others is under ``SLOW_RATIO`` of the other nodes' median (``slow_hosts``)."""

    node: int
    host: str
    link_gbps: float
    send_gbps: float
    receive_gbps: float
    others_median_gbps: float


@dataclass(kw_only=True, slots=True)
class SlowLink:
    """On two nodes: one direction under ``SLOW_RATIO`` of the other (``slow_links``); either end may be at fault."""

    source: str
    """The sending node's name (``HostLinks.name``)."""
    target: str
    gbps: float
    reverse_gbps: float


def _ranks_text(ranks: list[int]) -> str:
    """``rank 3``, ``ranks 0-3`` (consecutive) or ``ranks 0, 2, 5``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _gbit(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def host_links(topology: Topology) -> list[HostLinks]:
    """Per node, in node order: its ranks, interface, and intra- and inter-node figures (pure logic).

    The inter-node ``send_gbps``/``receive_gbps`` are the *best* one-way figures of its leader towards/from
    the other leaders: a pair is as slow as its slower end, so a node's best pair shows its own link whenever
    one peer is healthy, and a slow peer does not drag a healthy node down.
    """
    node_of = {r.rank: r.node_index for r in topology.ranks}
    hosts = [n.host for n in topology.nodes]
    result = []
    for node in topology.nodes:
        intra_lat, intra_bw, inter_lat, inter_bw = [], [], [], []
        for key, latency in topology.latency_us.items():
            i, j = (int(r) for r in key.split("-"))
            if node.leader not in (i, j):
                continue
            peer = j if i == node.leader else i
            same = node_of.get(peer) == node.index
            (intra_lat if same else inter_lat).append(latency)
            bandwidth = topology.bandwidth_gbps.get(key)
            if bandwidth is not None:
                (intra_bw if same else inter_bw).append(bandwidth)
        sends, receives, peers = [], [], set()
        for key, gbps in topology.directed_gbps.items():
            source, target = (int(r) for r in key.split("->"))
            if node.leader not in (source, target) or node_of.get(source) == node_of.get(target):
                continue
            (sends if source == node.leader else receives).append(gbps)
            peers.add(target if source == node.leader else source)
        median = _median_or_none
        result.append(HostLinks(
            node=node.index, host=node.host, ranks=list(node.ranks), interface=node.uses,
            name=node.host if hosts.count(node.host) == 1 else f"{node.host}/node{node.index}",
            shared=hosts.count(node.host) > 1,
            intra_latency_us=median(intra_lat), intra_bandwidth_gbps=median(intra_bw),
            inter_latency_us=median(inter_lat), inter_bandwidth_gbps=median(inter_bw),
            send_gbps=max(sends, default=None), receive_gbps=max(receives, default=None), peers=len(peers)))
    return result


def slow_hosts(hosts: list[HostLinks], ratio: float = SLOW_RATIO) -> list[SlowHost]:
    """The nodes whose ``link_gbps`` is under ``ratio`` times the median of the other nodes' (pure logic).

    On two nodes both figures are the same pair's slower direction, so nothing is named: which end is slow
    cannot be told (``slow_links`` says which direction).  Equal nodes are never named; when most nodes are
    slow, the median is theirs and only a minority can stand out.  Virtual nodes (``shared``) take no part:
    their links are their host's memory, not a NIC.
    """
    hosts = [h for h in hosts if not h.shared]
    found = []
    for host in hosts:
        link = host.link_gbps
        others = [o.link_gbps for o in hosts if o is not host and o.link_gbps is not None]
        if link is None or not others:
            continue
        median = statistics.median(others)
        if link < ratio * median:
            found.append(SlowHost(node=host.node, host=host.name, link_gbps=link, send_gbps=host.send_gbps,
                                  receive_gbps=host.receive_gbps, others_median_gbps=median))
    return found


def slow_links(hosts: list[HostLinks], topology: Topology, ratio: float = SLOW_RATIO) -> list[SlowLink]:
    """On exactly two nodes: the direction between their leaders that is under ``ratio`` times the other
    (pure logic; empty otherwise: on more nodes ``slow_hosts`` names the host)."""
    if len(hosts) != 2 or any(h.shared for h in hosts):
        return []
    a, b = hosts
    forward = topology.directed_gbps.get(direction_key(topology.nodes[a.node].leader, topology.nodes[b.node].leader))
    backward = topology.directed_gbps.get(direction_key(topology.nodes[b.node].leader, topology.nodes[a.node].leader))
    if forward is None or backward is None:
        return []
    if forward < ratio * backward:
        return [SlowLink(source=a.name, target=b.name, gbps=forward, reverse_gbps=backward)]
    if backward < ratio * forward:
        return [SlowLink(source=b.name, target=a.name, gbps=backward, reverse_gbps=forward)]
    return []


def link_warnings(topology: Topology, hosts: list[HostLinks] | None = None) -> list[str]:
    """One line per slow host (``slow_hosts``) or, on two nodes, slow direction (``slow_links``) (pure logic)."""
    hosts = host_links(topology) if hosts is None else hosts
    lines = [f"host {s.host}: link to the others measured {_gbit(s.link_gbps)} Gbit/s (sending "
             f"{_gbit(s.send_gbps)}, receiving {_gbit(s.receive_gbps)}), under half of the others' median "
             f"{_gbit(s.others_median_gbps)} Gbit/s: a slow or misconfigured NIC?" for s in slow_hosts(hosts)]
    lines += [f"link {s.source} -> {s.target} measured {_gbit(s.gbps)} Gbit/s, under half of {s.target} -> "
              f"{s.source} ({_gbit(s.reverse_gbps)} Gbit/s): {s.source}'s sending or {s.target}'s receiving is "
              "slow (with two hosts the slow end cannot be told)" for s in slow_links(hosts, topology)]
    return lines


def host_lines(hosts: list[HostLinks], limit: int = MAX_HOST_LINES) -> list[str]:
    """One line per node for the console and the log (pure logic): the slow ones first, at most ``limit``."""
    slow = {s.node for s in slow_hosts(hosts)}
    shown = sorted(hosts, key=lambda h: h.node not in slow)[:limit]
    lines = []
    for h in sorted(shown, key=lambda h: h.node):
        where = (f"{h.interface.name} {h.interface.address} ({h.interface.reason})" if h.interface
                 else "no interface found towards rank 0")
        parts = [f"host {h.name} ({_ranks_text(h.ranks)}): {where}"]
        if h.intra_latency_us is not None and h.intra_bandwidth_gbps is not None:
            parts.append(f"intra-host {h.intra_latency_us:.1f} us, {_gbit(h.intra_bandwidth_gbps)} Gbit/s")
        if h.inter_latency_us is not None and h.send_gbps is not None and h.receive_gbps is not None:
            parts.append(f"to {h.peers} other(s) {h.inter_latency_us:.1f} us, send {_gbit(h.send_gbps)} / "
                         f"receive {_gbit(h.receive_gbps)} Gbit/s")
        lines.append("; ".join(parts))
    if len(hosts) > len(shown):
        lines.append(f"... and {len(hosts) - len(shown)} more host(s) in topology.json")
    return lines


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


def recommend(topology: Topology) -> dict[str, Any]:
    """Decisions from a probe (pure logic).

    Returns:
        ``nccl_socket_ifname``: the fastest interface every node has (None if none);
        ``nccl_ib_disable``: True unless every node has an active InfiniBand/RDMA
        port (NCCL cannot mix its IB and socket transports, so "IB on some nodes"
        disables it too); ``hierarchical``: more than one node and as many ranks,
        more than one, on every node; ``num_nodes``, ``ranks_per_node`` (the largest);
        measured ``intra_``/``inter_node_latency_us`` and
        ``intra_``/``inter_node_bandwidth_gbps`` (None where no such pair) for a
        cost model.
    """
    nodes = topology.nodes
    local_sizes = [len(n.ranks) for n in nodes]
    return {
        "nccl_socket_ifname": common_interface(nodes),
        "nccl_ib_disable": not (nodes and all(n.has_ib for n in nodes)),
        "hierarchical": hierarchical_layout(len(nodes), min(local_sizes, default=0), max(local_sizes, default=0)),
        "num_nodes": len(nodes),
        "ranks_per_node": max(local_sizes, default=0),
        "intra_node_latency_us": topology.intra_latency_us,
        "inter_node_latency_us": topology.inter_latency_us,
        "intra_node_bandwidth_gbps": topology.intra_bandwidth_gbps,
        "inter_node_bandwidth_gbps": topology.inter_bandwidth_gbps,
    }


# --------------------------------------------------------------------------- local hardware


def local_gpus(properties: bool) -> tuple[int, list[Gpu]]:
    """GPUs torch can see: their count, and (when ``properties``) model and memory.

    Only node leaders ask for properties, so one process per node talks to
    the driver beyond counting.
    """
    if "torch" not in sys.modules and not _gpu_driver_present():
        return 0, []  # importing torch takes seconds per rank, for nothing on a CPU node
    try:
        import torch
    except ImportError:
        return 0, []
    if not torch.cuda.is_available():
        return 0, []
    count = torch.cuda.device_count()
    gpus = []
    if properties:
        for index in range(count):
            props = torch.cuda.get_device_properties(index)
            gpus.append(Gpu(index=index, name=props.name, memory_bytes=int(props.total_memory)))
    return count, gpus


def _gpu_driver_present() -> bool:
    """An NVIDIA or AMD (ROCm) kernel driver is loaded: torch.cuda may find a GPU."""
    return (Path("/proc/driver/nvidia").exists() or Path("/dev/kfd").exists()
            or any(Path("/dev").glob("nvidia[0-9]*")))


def probe(comm: Any, world: World, *, budget_s: float = 3.0, sizes: tuple[int, int] = (8, 4 << 20),
          intra_pairs: int = INTRA_SAMPLES, interface: str = "") -> Topology:
    """Collective: describe the ranks of ``comm`` and time ping-pong between them.

    Args:
        comm: the communicator to probe (rank order kept).
        world: its layout from ``hpcnet.world.discover(comm)``; its nodes
            (virtual ones included) decide which pairs are inter-node.
        budget_s: about how long the timing takes, whatever the size (each
            round of concurrent pairs gets ``budget_s / rounds``; a link too
            slow for one repetition of the large message in its slot overruns).
        sizes: ``(small_bytes, large_bytes)``: the latency and the bandwidth message.
        intra_pairs: how many ranks of its node each leader is timed against.
        interface: ``dist.interface`` (names or patterns): each node's ``uses`` is the interface among them
            that reaches rank 0's first rendezvous candidate (``expected_rendezvous``).
    """
    if not budget_s > 0:
        raise ValueError("budget_s must be greater than 0")
    small_bytes, large_bytes = sizes
    if not 0 < small_bytes <= large_bytes:
        raise ValueError("sizes must be (small_bytes, large_bytes) with 0 < small_bytes <= large_bytes")
    import numpy as np

    comm = comm.Dup()  # private tags: no clash with the caller's messages
    try:
        with shared_errors(comm):  # a driver error on one rank stops every rank alike
            leader_view = world.local_rank == 0
            gpu_count, gpus = local_gpus(properties=leader_view)
            hardware = (interfaces(), ib_ports(), gpus) if leader_view else None
        # Rank 0 (node 0's leader) sends its interfaces along: the addresses it may offer for the rendezvous.
        nodes_ranks, offered = _nodes_ranks(comm, world, hardware[0] if comm.Get_rank() == 0 else None)
        rounds = pair_rounds(nodes_ranks, intra_pairs)
        # Written, so every page is real: an untouched buffer maps to the one
        # shared zero page, stays in cache and flatters the sender (as
        # mpi4py.bench's numpy.empty buffers do).
        small = np.ones(small_bytes, dtype=np.uint8)
        large = np.ones(large_bytes, dtype=np.uint8)
        measured, probe_s = play_rounds(comm, rounds, small, large, budget_s=budget_s)
        # Each leader's interface towards each address rank 0 may offer (no extra round trip: rank 0 picks
        # the one for the address it will offer first once it knows every node's interfaces).
        uses = _interface_uses(offered, interface) if leader_view else {}
        gathered = comm.gather((gpu_count, hardware, uses, measured), root=0)
        data = None
        if comm.Get_rank() == 0:
            # Ibarrier completed on rank 0 only once every rank had finished: its clock is the job's.
            data = _assemble(world, nodes_ranks, gathered, interface=interface, rounds=len(rounds),
                             budget_s=budget_s, probe_s=probe_s, sizes=(small_bytes, large_bytes)).to_dict()
        # A plain dict travels (small, pickled once); every rank rebuilds the same Topology.
        return Topology.from_dict(comm.bcast(data, root=0))
    finally:
        comm.Free()


def _nodes_ranks(comm: Any, world: World, extra: Any = None) -> tuple[list[list[int]], Any]:
    """Collective: the global ranks of each node, in local-rank order (leader first), and rank 0's ``extra``."""
    placement = comm.allgather((world.node_index, world.local_rank, extra))
    nodes_ranks: list[list[int]] = [[] for _ in range(max(n for n, _, _ in placement) + 1)]
    for rank, (node, _local, _) in sorted(enumerate(placement), key=lambda item: item[1][:2]):
        nodes_ranks[node].append(rank)
    return nodes_ranks, placement[0][2]


def _interface_uses(offered: list[Interface] | None, spec: str) -> dict[str, InterfaceUse | None]:
    """This host's interface towards each address rank 0 may offer for the rendezvous (its interfaces,
    ``MASTER_ADDR``, the loopback): ``netif.interface_towards``, None where none is found or on an error (a
    description, decided on each host alone, that no collective depends on)."""
    targets = {i.address for i in offered or []} | {"127.0.0.1"}
    if os.environ.get("MASTER_ADDR"):
        targets.add(os.environ["MASTER_ADDR"])
    try:
        found = interfaces(loopback=True)
    except Exception:  # noqa: BLE001 - never raise on one rank alone before the gather
        return {}
    uses: dict[str, InterfaceUse | None] = {}
    for target in sorted(targets):
        try:
            choice = interface_towards(target, spec, found=found)
        except Exception:  # noqa: BLE001 - a lookup that fails describes nothing; the bootstrap reports it
            choice = None
        uses[target] = (InterfaceUse(name=choice.interface.name, address=choice.interface.address,
                                     reason=choice.reason) if choice else None)
    return uses


def _assemble(world: World, nodes_ranks: list[list[int]], gathered: list[Any], *, interface: str, rounds: int,
              budget_s: float, probe_s: float, sizes: tuple[int, int]) -> Topology:
    nodes = []
    for index, members in enumerate(nodes_ranks):
        nets, ports, gpus = gathered[members[0]][1]
        nodes.append(Node(index=index, host=world.hostnames[members[0]], ranks=members, interfaces=nets,
                          ib_ports=ports, gpus=gpus))
    target = expected_rendezvous(nodes, interface)
    for node in nodes:
        node.uses = gathered[node.leader][2].get(target) if target else None
    ranks = [RankInfo(rank=r, host=world.hostnames[r], node_index=i, local_rank=members.index(r),
                      gpu_count=gathered[r][0])
             for i, members in enumerate(nodes_ranks) for r in members]
    ranks.sort(key=lambda info: info.rank)
    latency_us, bandwidth_gbps, directed_gbps = {}, {}, {}
    for *_, measured in gathered:
        for key, (lat, bw, out_gbps, in_gbps) in measured.items():
            latency_us[key], bandwidth_gbps[key] = lat, bw
            low, high = key.split("-")  # the initiator is the lower rank
            directed_gbps[f"{low}->{high}"], directed_gbps[f"{high}->{low}"] = out_gbps, in_gbps
    order = sorted(latency_us, key=lambda k: tuple(map(int, k.split("-"))))
    return Topology(size=world.size, num_nodes=len(nodes), virtual_nodes=len({n.host for n in nodes}) < len(nodes),
                    nodes=nodes, ranks=ranks,
                    latency_us={k: latency_us[k] for k in order},
                    bandwidth_gbps={k: bandwidth_gbps[k] for k in order},
                    directed_gbps={k: directed_gbps[k] for k in sorted(
                        directed_gbps, key=lambda k: tuple(map(int, k.split("->"))))},
                    small_bytes=sizes[0], large_bytes=sizes[1], rounds=rounds, budget_s=budget_s, probe_s=probe_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcnet.comm.topology``: probe COMM_WORLD, print the summary, write topology.json."""
    from mpi4py import MPI

    parser = argparse.ArgumentParser(prog="python -m hpcnet.comm.topology", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".", help="directory for topology.json (default: .)")
    parser.add_argument("--budget-s", type=float, default=3.0, help="about how long the timing takes, seconds")
    parser.add_argument("--small-bytes", type=int, default=8, help="latency message size")
    parser.add_argument("--large-bytes", type=int, default=4 << 20, help="bandwidth message size")
    parser.add_argument("--interface", default="", help="as dist.interface: the interfaces each host may use "
                        "towards rank 0 (names or patterns, comma-separated)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    world = discover(comm)
    topology = probe(comm, world, budget_s=args.budget_s, sizes=(args.small_bytes, args.large_bytes),
                     interface=args.interface)
    if comm.Get_rank() == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = topology.write(out / "topology.json")
        print(topology.summary())
        for line in topology.warnings():
            print(f"warning: {line}")
        print(f"  wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
