"""The measured topology, ``Topology``: equal on every rank, written as topology.json, and what it shows per host.

A ``Topology`` holds the nodes and ranks (``hpcnet.comm.nodes``) and the pair figures of the probe
(``hpcnet.comm.topology``).  ``host_links(topology)`` sums it up per node (its ranks, its interface, its
intra-node link and its link to the other nodes) and ``slow_hosts`` names a node whose link to the others is far
below theirs (``slow_links``, on two nodes, a slow direction); ``host_lines`` and ``link_warnings`` are their
console lines.  All of it is pure, tested on one process.

Figures: latency is half the round trip of a small message, the *median* over
the repetitions; bandwidth is the large message's size over the *mean* half
round trip (one-way throughput: total bytes over total time, as
``mpi4py.bench pingpong`` computes it), in Gbit/s (1e9 bit/s; divide by 8 for
GB/s); each direction's figure is the size over the median time of the message
one way and a 1-byte answer.
"""

import collections
import dataclasses
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcnet.comm.netif import IbPort, Interface
from hpcnet.comm.nodes import Gpu, InterfaceUse, Node, RankInfo
from hpcnet.comm.pingpong import direction_key

FORMAT = "hpcnet-topology/2"
"""Written as ``format`` in topology.json; bumped when the layout changes."""
READABLE = (FORMAT, "hpcnet-topology/1")
"""Formats ``Topology.from_dict`` reads (a /1 document has no ``uses`` nor ``directed_gbps``)."""

SLOW_RATIO = 0.5
"""``slow_hosts``: a node whose link to the others is under this fraction of the other nodes' median is named."""


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

