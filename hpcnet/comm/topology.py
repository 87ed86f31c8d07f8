"""The topology probe: what the job runs on (hosts, GPUs, network) and the measured latency and bandwidth.

``probe(comm, world)`` collects every rank's host, local rank and GPUs, each
node's network interfaces and InfiniBand ports and the interface its host uses
towards rank 0, and times MPI ping-pong between all pairs of node leaders and
between each leader and a few ranks of its own node (``pingpong``: rounds of
disjoint pairs, each in a time slot, so the whole probe takes about
``budget_s`` seconds at any size; bandwidth in each direction).  Rank 0
assembles a ``Topology`` (``measured``: its figures, topology.json, each host's
links) and broadcasts it, so every rank holds the same one.  The interfaces
and ports are ``netif``'s, the nodes ``nodes``'.

``recommend(topology)`` turns it into decisions (NCCL interface, whether to
disable NCCL's InfiniBand transport, flat or hierarchical all-reduce); it is
pure, like the pair schedule, and tested on one process.  Run on its own:

    mpirun -np 4 python -m mpi4py -m hpcnet.comm.topology [--out DIR] [--budget-s S] [--interface SPEC]
"""

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from hpcnet.agree import shared_errors
from hpcnet.comm.costmodel import LinkCost
from hpcnet.comm.measured import Topology
from hpcnet.comm.netif import Interface, ib_ports, interface_towards, interfaces
from hpcnet.comm.nodes import Gpu, InterfaceUse, Node, RankInfo, common_interface, expected_rendezvous
from hpcnet.comm.pingpong import INTRA_SAMPLES, pair_rounds, play_rounds
from hpcnet.comm.route import hierarchical_layout
from hpcnet.world import World, discover

log = logging.getLogger(__name__)


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


def measured_links(comm: Any, world: World, dist: Any, device_type: str, run_dir: Path, deadlines: Any
                   ) -> tuple[str, LinkCost | None, LinkCost | None]:
    """Measured latency/bandwidth (``dist.probe``): the interface name rank 0 tries first for the rendezvous
    address (the fastest every node has; empty: none, or ``dist.interface`` decides), the slowest measured link
    (inter-node where there are nodes) for the cost model (None: not measured), and the intra-node link where
    there are nodes (the hierarchical path's forecast; None: one node, or not measured).

    Collective, at start-up (``hpcnet.train``; ``dist``: the ``dist`` options), under ``dist.startup_timeout_s``.
    Each host still uses its own interface towards that address (``hpcnet.comm.bootstrap.host_interfaces``)."""
    from hpcnet.fault.watchdog import startup_phase
    from hpcnet.observe.runlog import OptionalFile

    if not dist.probe or world.size == 1:
        return "", None, None
    with startup_phase(deadlines, "dist.probe", dist.startup_timeout_s):
        topology = probe(comm, world, budget_s=2.0, interface=dist.interface)
    advice = recommend(topology)
    if world.is_main:
        OptionalFile(run_dir / "topology.json").write_text(topology.to_json() + "\n")
        log.info("%s", topology.summary())
        for line in topology.warnings():  # a slow host: a slow or misconfigured NIC
            log.warning("%s", line)
    prefer = ""
    if not dist.interface and world.num_nodes > 1 and advice["nccl_socket_ifname"]:
        prefer = advice["nccl_socket_ifname"]
    if advice["nccl_ib_disable"] and device_type == "cuda":
        os.environ.setdefault("NCCL_IB_DISABLE", "1")
    where = "inter" if advice["inter_node_latency_us"] and advice["inter_node_bandwidth_gbps"] else "intra"
    latency, bandwidth = advice[f"{where}_node_latency_us"], advice[f"{where}_node_bandwidth_gbps"]
    link = LinkCost.from_probe(latency, bandwidth) if latency and bandwidth else None
    intra = None
    if where == "inter" and advice["intra_node_latency_us"] and advice["intra_node_bandwidth_gbps"]:
        intra = LinkCost.from_probe(advice["intra_node_latency_us"], advice["intra_node_bandwidth_gbps"])
    return prefer, link, intra


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

