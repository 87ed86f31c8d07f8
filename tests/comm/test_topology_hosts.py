"""The probe's per-host view (pure): each node's ranks, interface and links, the slow-host rule, the console
lines and the report's section, on synthetic topologies."""

import json
import random

import pytest

from hpcnet.comm.measured import Topology, host_lines, host_links, link_warnings, slow_hosts, slow_links
from hpcnet.comm.netif import Interface, rendezvous_order
from hpcnet.comm.nodes import InterfaceUse, Node, RankInfo, expected_rendezvous
from hpcnet.comm.pingpong import direction_key, pair_key, pair_rounds
from hpcnet.comm.topology import probe
from hpcnet.report.markdown import topology_section
from hpcnet.world import discover
from tests.helpers.comm import nodes_of


def _topology(local_sizes, *, send=None, receive=None, noise=0.0, seed=0, hosts=None, intra_gbps=20.0):
    """Nodes ``h0, h1, ...`` whose leader pairs carry ``min(send[i], receive[j])`` Gbit/s from node i to j
    (a link is as slow as its slower end), times ``1 ± noise``; 1 Gbit/s for every node by default."""
    rng = random.Random(seed)
    nodes_ranks = nodes_of(local_sizes)
    names = hosts or [f"h{i}" for i in range(len(nodes_ranks))]
    send = send or [1.0] * len(nodes_ranks)
    receive = receive or [1.0] * len(nodes_ranks)
    nodes = [Node(index=i, host=names[i], ranks=m,
                  interfaces=[Interface(f"eth{i}", f"10.0.0.{i + 1}", "ethernet", 1000)],
                  uses=InterfaceUse(name=f"eth{i}", address=f"10.0.0.{i + 1}",
                                    reason="holds 10.0.0.1" if i == 0 else "same subnet as 10.0.0.1"))
             for i, m in enumerate(nodes_ranks)]
    node_of = {r: i for i, m in enumerate(nodes_ranks) for r in m}
    ranks = [RankInfo(rank=r, host=names[i], node_index=i, local_rank=k, gpu_count=0)
             for i, m in enumerate(nodes_ranks) for k, r in enumerate(m)]
    latency, bandwidth, directed = {}, {}, {}
    for a, b in (p for rnd in pair_rounds(nodes_ranks) for p in rnd):
        same = node_of[a] == node_of[b]
        for src, dst in ((a, b), (b, a)):
            rate = intra_gbps if same else min(send[node_of[src]], receive[node_of[dst]])
            directed[direction_key(src, dst)] = rate * (1 + rng.uniform(-noise, noise))
        fwd, back = directed[direction_key(a, b)], directed[direction_key(b, a)]
        latency[pair_key(a, b)] = 2.0 if same else 30.0
        bandwidth[pair_key(a, b)] = 2 / (1 / fwd + 1 / back)
    return Topology(size=len(ranks), num_nodes=len(nodes), virtual_nodes=len(set(names)) < len(names), nodes=nodes,
                    ranks=ranks, latency_us=latency, bandwidth_gbps=bandwidth, directed_gbps=directed,
                    small_bytes=8, large_bytes=4 << 20, rounds=3, budget_s=2.0, probe_s=2.0)


def test_host_links_give_each_node_its_ranks_interface_and_links():
    t = _topology([2, 2, 2], send=[1.0, 0.2, 1.0])
    a, b, c = host_links(t)
    assert (a.name, a.ranks, a.interface.name, a.interface.address) == ("h0", [0, 1], "eth0", "10.0.0.1")
    assert (b.name, b.ranks, b.interface.reason) == ("h1", [2, 3], "same subnet as 10.0.0.1")
    assert a.intra_latency_us == 2.0 and a.intra_bandwidth_gbps == pytest.approx(20.0)
    assert a.inter_latency_us == 30.0 and a.peers == 2 and c.peers == 2
    # h1 sends slowly: its send figure is its own, its receive figure (from healthy peers) is not dragged down,
    # and the healthy nodes keep a full link through each other
    assert (b.send_gbps, b.receive_gbps, b.link_gbps) == (pytest.approx(0.2), pytest.approx(1.0), pytest.approx(0.2))
    assert (a.send_gbps, a.receive_gbps, a.link_gbps) == (pytest.approx(1.0),) * 3
    assert a.inter_bandwidth_gbps == pytest.approx((2 / (1 / 1.0 + 1 / 0.2) + 1.0) / 2)  # median of its 2 pairs
    one = host_links(_topology([4]))
    assert len(one) == 1 and one[0].send_gbps is None and one[0].link_gbps is None and one[0].peers == 0
    # virtual nodes share a host: each is named by host and node, and no NIC of theirs is judged
    virtual = _topology([1, 1, 1], hosts=["box"] * 3, send=[1.0, 1.0, 0.1])
    assert [(h.name, h.shared) for h in host_links(virtual)] == [("box/node0", True), ("box/node1", True),
                                                                 ("box/node2", True)]
    assert slow_hosts(host_links(virtual)) == [] and link_warnings(virtual) == []
    assert link_warnings(_topology([1, 1], hosts=["box"] * 2, send=[1.0, 0.1])) == []


@pytest.mark.parametrize("send,receive", [([1.0, 1.0, 0.2], None),  # a rate limit on sending (tc tbf)
                                          (None, [1.0, 1.0, 0.2]),  # on receiving
                                          ([1.0, 1.0, 0.2], [1.0, 1.0, 0.2])])  # both: a NIC at a low speed
def test_a_slow_host_among_three_is_named_whichever_way_it_is_slow(send, receive):
    t = _topology([1, 1, 1], send=send, receive=receive, noise=0.15)
    [slow] = slow_hosts(host_links(t))
    assert (slow.node, slow.host) == (2, "h2") and slow.link_gbps < 0.25 and 0.8 < slow.others_median_gbps < 1.2
    [line] = link_warnings(t)
    assert line.startswith("host h2: link to the others measured 0.2") and line.endswith("misconfigured NIC?")
    assert "under half of the others' median 0.9" in line or "under half of the others' median 1.0" in line, line
    assert slow_links(host_links(t), t) == []


def test_the_warning_line_reads_as_documented():
    t = _topology([2, 2, 2], send=[1.0, 0.2, 1.0])
    assert link_warnings(t) == ["host h1: link to the others measured 0.20 Gbit/s (sending 0.20, receiving 1.0), "
                                "under half of the others' median 1.0 Gbit/s: a slow or misconfigured NIC?"]


@pytest.mark.parametrize("seed", range(20))
def test_equal_hosts_are_never_named_even_with_noise(seed):
    """±30% on every one-way figure (a loaded 2-core machine) names nobody: each node's best pair stands, and
    two directions of one link stay within a factor 0.7 / 1.3 > 1/2."""
    for count in (2, 3, 4, 8):
        t = _topology([2] * count, noise=0.3, seed=seed)
        assert slow_hosts(host_links(t)) == [] and link_warnings(t) == [], (count, host_links(t))


def test_a_single_node_or_a_single_rank_has_nothing_to_compare():
    for t in (_topology([1]), _topology([4]), _topology([1], send=[0.01])):
        assert slow_hosts(host_links(t)) == [] and slow_links(host_links(t), t) == [] and link_warnings(t) == []


def test_two_hosts_name_the_slow_direction_but_neither_host():
    """One link: a rate limit on h1's sending and one on h0's receiving measure alike."""
    t = _topology([2, 2], send=[1.0, 0.2])
    hosts = host_links(t)
    assert hosts[0].link_gbps == hosts[1].link_gbps == pytest.approx(0.2)  # the one link's slower direction
    assert slow_hosts(hosts) == []
    [link] = slow_links(hosts, t)
    assert (link.source, link.target, link.gbps, link.reverse_gbps) == ("h1", "h0", pytest.approx(0.2),
                                                                      pytest.approx(1.0))
    assert link_warnings(t) == ["link h1 -> h0 measured 0.20 Gbit/s, under half of h0 -> h1 (1.0 Gbit/s): h1's "
                                "sending or h0's receiving is slow (with two hosts the slow end cannot be told)"]
    assert link_warnings(_topology([2, 2], receive=[0.2, 1.0]))[0].startswith("link h1 -> h0 measured 0.20")
    # slow both ways (a NIC at a low speed): nothing to compare with
    assert link_warnings(_topology([2, 2], send=[1.0, 0.2], receive=[1.0, 0.2])) == []


def test_most_hosts_slow_leaves_the_median_theirs():
    # two of three hosts slow both ways: the healthy one's best pair is slow too; nobody stands out
    t = _topology([1, 1, 1], send=[1.0, 0.2, 0.2], receive=[1.0, 0.2, 0.2])
    assert slow_hosts(host_links(t)) == []
    # one slow host of four: named; two of four: both named (each under half of the others' median)
    assert [s.host for s in slow_hosts(host_links(_topology([1] * 4, send=[1, 1, 1, 0.1])))] == ["h3"]
    assert [s.host for s in slow_hosts(host_links(_topology([1] * 4, send=[1, 0.1, 1, 0.1])))] == ["h1", "h3"]


def test_host_lines_list_each_host_the_slow_first_when_cut():
    t = _topology([2, 2, 2], send=[1.0, 0.2, 1.0])
    lines = host_lines(host_links(t))
    assert lines[0] == ("host h0 (ranks 0-1): eth0 10.0.0.1 (holds 10.0.0.1); intra-host 2.0 us, 20 Gbit/s; "
                        "to 2 other(s) 30.0 us, send 1.0 / receive 1.0 Gbit/s")
    assert lines[1].startswith("host h1 (ranks 2-3): eth1 10.0.0.2 (same subnet as 10.0.0.1)")
    assert "send 0.20 / receive 1.0 Gbit/s" in lines[1]
    many = _topology([1] * 6, send=[1, 1, 1, 1, 1, 0.1])
    cut = host_lines(host_links(many), limit=2)
    assert [line.split(" (")[0] for line in cut[:2]] == ["host h0", "host h5"] and "4 more host(s)" in cut[2]
    assert host_lines(host_links(_topology([1])))[0] == "host h0 (rank 0): eth0 10.0.0.1 (holds 10.0.0.1)"
    t.nodes[2].uses = None
    assert "host h2 (ranks 4-5): no interface found towards rank 0;" in host_lines(host_links(t))[2]
    text = t.summary()
    assert "host h1 (ranks 2-3)" in text and "warning" not in text  # warnings are lines of their own
    assert t.warnings() == link_warnings(t)


def test_json_carries_the_hosts_and_the_warning_and_reads_back(tmp_path):
    t = _topology([2, 2, 2], send=[1.0, 0.2, 1.0])
    data = json.loads(t.to_json())
    assert data["format"] == "hpcnet-topology/2"
    assert [h["name"] for h in data["hosts"]] == ["h0", "h1", "h2"]
    assert data["hosts"][1]["interface"] == {"name": "eth1", "address": "10.0.0.2", "reason": "same subnet as 10.0.0.1"}
    assert data["hosts"][1]["link_gbps"] == pytest.approx(0.2) and data["nodes"][1]["uses"]["name"] == "eth1"
    assert [s["host"] for s in data["slow_hosts"]] == ["h1"] and data["slow_links"] == []
    assert data["warnings"] == link_warnings(t) and data["directed_gbps"]["2->0"] == pytest.approx(0.2)
    assert Topology.from_dict(data) == t
    # a document of the first format (no interface in use, no directions) still reads
    old = {k: v for k, v in data.items() if k not in ("directed_gbps", "hosts", "slow_hosts", "slow_links")}
    old["format"] = "hpcnet-topology/1"
    old["nodes"] = [{k: v for k, v in n.items() if k != "uses"} for n in data["nodes"]]
    back = Topology.from_dict(old)
    assert back.directed_gbps == {} and back.nodes[0].uses is None and back.warnings() == []
    with pytest.raises(ValueError, match="hpcnet-topology/2"):
        Topology.from_dict({**data, "format": "hpcnet-topology/9"})


def test_expected_rendezvous_is_what_rank_0_offers_first():
    eth = Interface("eth0", "10.0.0.1", "ethernet", 1000)
    ib = Interface("ib0", "10.1.0.1", "ipoib", 100000)
    node = Node(index=0, host="a", ranks=[0], interfaces=[ib, eth])
    other = Node(index=1, host="b", ranks=[1], interfaces=[Interface("eth0", "10.0.0.2", "ethernet", 1000)])
    assert expected_rendezvous([node], environ={}) == "127.0.0.1"  # one node: the loopback
    assert expected_rendezvous([node], "eth*", environ={}) == "10.0.0.1"
    assert expected_rendezvous([node, other], environ={}) == "10.0.0.1"  # eth0: on every node, tried first
    assert expected_rendezvous([node, other], "ib0", environ={}) == "10.1.0.1"
    assert expected_rendezvous([node, other], "nothing*", environ={}) is None
    assert expected_rendezvous([node, other], environ={"MASTER_ADDR": "10.9.9.9"}) == "10.9.9.9"
    assert [i.name for i in rendezvous_order([ib, eth], "", "eth0")] == ["eth0", "ib0"]
    assert [i.name for i in rendezvous_order([ib, eth], "ib*", "eth0")] == ["ib0"]
    assert [i.name for i in rendezvous_order([ib, eth])] == ["ib0", "eth0"]


def test_report_section_shows_hosts_links_and_the_warning():
    data = json.loads(_topology([2, 2, 2], send=[1.0, 0.2, 1.0]).to_json())
    md = "\n".join(topology_section(data))
    assert md.startswith("## Hosts and links")
    assert "| h1 | 2-3 | eth1 10.0.0.2 | 2.0 us | 20 | 30.0 us | 0.20 | 1.0 | 0.20 |" in md, md
    assert "- **warning:** host h1: link to the others measured 0.20 Gbit/s" in md
    fine = "\n".join(topology_section(json.loads(_topology([1, 1, 1]).to_json())))
    assert "No host's link is far below the others'." in fine and "warning" not in fine
    two = "\n".join(topology_section(json.loads(_topology([1, 1]).to_json())))
    assert "a slow host cannot be told from its peer" in two
    old = "\n".join(topology_section({"size": 4, "num_nodes": 2, "summary": {"inter_bandwidth_gbps": 0.9}}))
    assert "0.90 Gbit/s" in old and "No per-host figures" in old
    assert topology_section(None) == []


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_probe_gives_each_host_its_interface_towards_rank_0(comm):
    """On one host, the loopback; on several (the cluster pass), rank 0's host holds the address and every other
    host uses one of its own interfaces."""
    topology = probe(comm, discover(comm, environ={}), budget_s=0.5, sizes=(8, 1 << 16))
    hosts = host_links(topology)
    assert [h.ranks for h in hosts] == [n.ranks for n in topology.nodes]
    first = topology.nodes[0].uses
    if topology.num_nodes == 1:
        assert first == InterfaceUse(name="lo", address="127.0.0.1", reason="holds 127.0.0.1")
        return
    assert first is not None and first.reason == f"holds {first.address}", first
    for node, host in zip(topology.nodes, hosts):
        assert node.uses is not None and node.uses.address in {i.address for i in node.interfaces}, node
        assert host.interface == node.uses and host.peers == topology.num_nodes - 1, host
        assert host.send_gbps > 0 and host.receive_gbps > 0, host
