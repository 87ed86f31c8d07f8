"""Topology probe: recommendations, JSON, and the probe under MPI at any size."""

import itertools
import json
import math
import time

import numpy as np
import pytest

from hpcnet.comm.measured import Topology
from hpcnet.comm.netif import IbPort, Interface, interfaces, kind_of
from hpcnet.comm.nodes import Gpu, InterfaceUse, Node, RankInfo, common_interface
from hpcnet.comm.pingpong import pair_key, pair_rounds
from hpcnet.comm.topology import local_gpus, main, probe, recommend
from hpcnet.world import discover, node_layout, wait_sleeping
from tests.helpers.comm import nodes_of

BUDGET_S = 0.5  # the tests check figures for sanity, not precision


def _eth(name="eth0", speed=10000, ib=False):
    return Interface(name, "10.0.0.1", "ipoib" if ib else kind_of(name, link_type="", rdma_device=False), speed)


def _topology(local_sizes, *, nets=None, ib=False, pairs=None) -> Topology:
    nodes_ranks = nodes_of(local_sizes)
    nodes = [Node(index=i, host=f"n{i}", ranks=m, interfaces=list(nets or [_eth()]),
                  ib_ports=[IbPort(device="mlx5_0", port=1, state="ACTIVE", rate_gbps=200.0,
                                   link_layer="InfiniBand")] if ib else [],
                  gpus=[Gpu(index=0, name="H100", memory_bytes=80 << 30)])
             for i, m in enumerate(nodes_ranks)]
    ranks = [RankInfo(rank=r, host=f"n{i}", node_index=i, local_rank=k, gpu_count=1)
             for i, m in enumerate(nodes_ranks) for k, r in enumerate(m)]
    pairs = pairs if pairs is not None else [p for rnd in pair_rounds(nodes_ranks) for p in rnd]
    lat = {pair_key(*p): (2.0 if ranks[p[0]].node_index == ranks[p[1]].node_index else 20.0) for p in pairs}
    bw = {pair_key(*p): (100.0 if ranks[p[0]].node_index == ranks[p[1]].node_index else 10.0) for p in pairs}
    return Topology(size=len(ranks), num_nodes=len(nodes), virtual_nodes=False, nodes=nodes, ranks=ranks,
                    latency_us=lat, bandwidth_gbps=bw, small_bytes=8, large_bytes=4 << 20, rounds=3,
                    budget_s=3.0, probe_s=0.5)


def test_recommend_on_synthetic_topologies():
    flat = recommend(_topology([1, 1, 1]))
    assert flat["nccl_ib_disable"] is True and flat["hierarchical"] is False
    assert flat["nccl_socket_ifname"] == "eth0" and flat["inter_node_bandwidth_gbps"] == 10.0
    assert flat["intra_node_bandwidth_gbps"] is None

    hier = recommend(_topology([4, 4], ib=True))
    assert hier["hierarchical"] is True and hier["nccl_ib_disable"] is False
    assert (hier["intra_node_latency_us"], hier["inter_node_latency_us"]) == (2.0, 20.0)
    assert (hier["num_nodes"], hier["ranks_per_node"]) == (2, 4)

    one_node = recommend(_topology([8]))
    assert one_node["hierarchical"] is False and one_node["inter_node_bandwidth_gbps"] is None
    # a node with a single rank leaves nothing to reduce inside it
    assert recommend(_topology([2, 1]))["hierarchical"] is False


def test_interface_choice():
    fast = [_eth("eth0", 1000), _eth("ib0", 100000, ib=True), _eth("docker0", 10000), _eth("ens1", 25000)]
    t = _topology([2, 2], nets=fast)
    assert common_interface(t.nodes) == "ib0"
    t.nodes[1].interfaces = [_eth("eth0", 1000), _eth("ens1", 25000), _eth("docker0", 10000)]
    assert common_interface(t.nodes) == "ens1"  # ib0 is not on every node
    t.nodes[1].interfaces = [_eth("docker0", 10000)]
    assert common_interface(t.nodes) == "docker0"  # a bridge only when nothing else is common
    t.nodes[1].interfaces = [_eth("enp3", 1000)]
    assert common_interface(t.nodes) is None
    # IPoIB alone (no RDMA port listed) still counts as InfiniBand
    t.nodes[1].interfaces = t.nodes[0].interfaces = [_eth("ib0", 100000, ib=True)]
    assert recommend(t)["nccl_ib_disable"] is False


def test_local_gpus_through_torch_cuda(monkeypatch):
    """The CUDA path, with torch.cuda faked: no GPU here (count only, unless asked for properties)."""
    from types import SimpleNamespace

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(name=f"Fake GPU {i}", total_memory=(i + 1) << 30))
    assert local_gpus(properties=False) == (2, [])
    assert local_gpus(properties=True) == (2, [Gpu(index=0, name="Fake GPU 0", memory_bytes=1 << 30),
                                               Gpu(index=1, name="Fake GPU 1", memory_bytes=2 << 30)])


def test_json_round_trip(tmp_path):
    t = _topology([2, 2], ib=True)
    assert Topology.from_json(t.to_json()) == t
    path = t.write(tmp_path / "topology.json")
    data = json.loads(path.read_text())
    assert data["format"] == "hpcnet-topology/2" and data["latency_us"]["0-2"] == 20.0
    assert data["summary"]["inter_bandwidth_gbps"] == 10.0 and data["summary"]["intra_latency_us"] == 2.0
    assert Topology.from_dict(data) == t
    text = t.summary()
    assert "inter-node" in text and "intra-node" in text and len(text.splitlines()) <= 8 + len(t.nodes)
    with pytest.raises(ValueError, match="budget_s"):
        probe(None, None, budget_s=0)


def _check_probe(topology: Topology, comm, layout: list[tuple[int, int, int]]) -> None:
    size = comm.Get_size()
    assert topology.size == size and len(topology.ranks) == size
    assert [(r.node_index, r.local_rank) for r in topology.ranks] == [(n, k) for n, k, _ in layout]
    nodes = [n.ranks for n in topology.nodes]
    required = {pair_key(*p) for rnd in pair_rounds(nodes) for p in rnd}
    assert set(topology.latency_us) == required == set(topology.bandwidth_gbps)
    assert set(topology.directed_gbps) == {f"{a}->{b}" for key in required for a, b in
                                           (key.split("-"), key.split("-")[::-1])}
    for key in required:
        lat, bw = topology.latency_us[key], topology.bandwidth_gbps[key]
        assert math.isfinite(lat) and lat > 0 and math.isfinite(bw) and bw > 0, (key, lat, bw)
    assert all(math.isfinite(v) and v > 0 for v in topology.directed_gbps.values()), topology.directed_gbps
    # the same Topology on every rank
    assert comm.allgather(topology.to_json()) == [topology.to_json()] * size


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_probe_any_size(comm):
    world = discover(comm, environ={})
    topology = probe(comm, world, budget_s=BUDGET_S)
    layout = node_layout(list(world.hostnames))
    _check_probe(topology, comm, layout)
    # a node per host: one on this machine, several on the local cluster (scripts/test.sh's 2 x 2 pass)
    assert topology.num_nodes == len(set(world.hostnames)) and not topology.virtual_nodes
    assert (topology.inter_latency_us is None) == (topology.num_nodes == 1)
    assert (topology.intra_latency_us is None) == all(len(n.ranks) == 1 for n in topology.nodes)
    sizes = {len(n.ranks) for n in topology.nodes}
    assert recommend(topology)["hierarchical"] == (topology.num_nodes > 1 and len(sizes) == 1 and sizes != {1})
    # each leader reports the one lister's interfaces: this rank's own where it shares the leader's host
    mine = topology.nodes[layout[comm.Get_rank()][0]]
    assert [(i.name, i.infiniband) for i in mine.interfaces] == [(i.name, i.infiniband) for i in interfaces()]
    if topology.num_nodes == 1:  # the data plane's rendezvous is on the loopback, which the host uses
        assert topology.nodes[0].uses == InterfaceUse(name="lo", address="127.0.0.1", reason="holds 127.0.0.1")


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ranks_per_node", [1, 2])
def test_probe_virtual_nodes_make_leaders(comm, ranks_per_node):
    world = discover(comm, environ={"HPCNET_RANKS_PER_NODE": str(ranks_per_node)})
    topology = probe(comm, world, budget_s=BUDGET_S, sizes=(8, 1 << 20))
    size = comm.Get_size()
    layout = node_layout(list(world.hostnames), ranks_per_node)
    _check_probe(topology, comm, layout)
    leaders = [r for r, (_, local, _) in enumerate(layout) if local == 0]
    assert [n.leader for n in topology.nodes] == leaders
    assert topology.num_nodes == len(leaders)
    assert topology.virtual_nodes == (len(leaders) > len(set(world.hostnames)))  # nodes share a host
    # every pair of leaders is inter-node and measured
    for a, b in itertools.combinations(leaders, 2):
        assert not topology.is_intra(pair_key(a, b)) and pair_key(a, b) in topology.latency_us
    assert (topology.inter_bandwidth_gbps is None) == (len(leaders) == 1)
    assert recommend(topology)["hierarchical"] == (ranks_per_node == 2 and size >= 4)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_bandwidth_is_plausible(comm):
    """The probe's large-message figure is within a broad factor of a plain timed loop (no timing asserts)."""
    if comm.Get_size() < 2:
        pytest.skip("needs two ranks")
    world = discover(comm, environ={})
    large = 1 << 20
    topology = probe(comm, world, budget_s=BUDGET_S, sizes=(8, large))
    # A direct Sendrecv exchange between ranks 0 and 1: each iteration moves
    # `large` bytes each way, so its time is about one one-way transfer.
    rank = comm.Get_rank()
    direct_gbps = 0.0
    if rank < 2:
        send, recv = np.ones(large, np.uint8), np.empty(large, np.uint8)
        comm.Sendrecv(send, 1 - rank, 0, recv, 1 - rank, 0)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            comm.Sendrecv(send, 1 - rank, 0, recv, 1 - rank, 0)
            times.append(time.perf_counter() - start)
        direct_gbps = large * 8 / float(np.median(times)) / 1e9
    wait_sleeping(comm.Ibarrier())  # the other ranks sleep instead of spinning on the two cores
    direct_gbps = comm.bcast(direct_gbps, root=0)
    measured = topology.bandwidth_gbps["0-1"]
    # Broad on purpose: a shared 2-core machine swings several-fold between runs.
    assert direct_gbps / 30 < measured < direct_gbps * 30, (measured, direct_gbps)
    assert 0 < topology.latency_us["0-1"] < 1e5


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_main_in_process(comm, mpi_tmp_path, capsys):
    out = mpi_tmp_path / "topo"
    assert main(["--out", str(out), "--budget-s", str(BUDGET_S), "--large-bytes", str(1 << 20)]) == 0
    comm.Barrier()
    data = json.loads((out / "topology.json").read_text())
    assert data["size"] == comm.Get_size() and data["large_bytes"] == 1 << 20
    printed = capsys.readouterr().out
    assert ("topology:" in printed) == (comm.Get_rank() == 0)


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_cli_writes_topology_json(launch, tmp_path):
    out = tmp_path / "out"
    result = launch(2, "--out", str(out), "--budget-s", "1", module="hpcnet.comm.topology", timeout=100,
                    env={"HPCNET_RANKS_PER_NODE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads((out / "topology.json").read_text())
    assert data["size"] == 2 and data["num_nodes"] == 2 and data["virtual_nodes"] is True
    assert set(data["latency_us"]) == {"0-1"} and data["bandwidth_gbps"]["0-1"] > 0
    assert result.stdout.count("topology:") == 1 and "inter-node: latency" in result.stdout
