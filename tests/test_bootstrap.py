"""torch.distributed bootstrapped from MPI: address choice, store, collectives."""

import re

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcnet.bootstrap import init_data_plane, interfaces
from hpcnet.world import discover


def test_interfaces_are_usable():
    for iface in interfaces():
        assert iface.name != "lo" and iface.address.count(".") == 3


def test_the_backend_is_decided_before_the_bootstrap():
    """'auto' is resolved once, by the transport plan (hpcnet.dataparallel), not again here."""
    world = discover(MPI.COMM_SELF)
    for backend, device in (("auto", "cpu"), ("mpi", "cpu"), ("nccl", "cpu")):
        with pytest.raises(ValueError, match=f"backend '{backend}' on a cpu device"):
            init_data_plane(MPI.COMM_SELF, world, backend=backend, device=torch.device(device), timeout_s=10)


@pytest.mark.mpi
def test_data_plane_allreduce(data_plane, comm):
    assert dist.is_initialized() and dist.get_world_size() == comm.Get_size()
    assert dist.get_rank() == comm.Get_rank()
    t = torch.full((1000,), float(comm.Get_rank() + 1))
    dist.all_reduce(t)
    n = comm.Get_size()
    assert torch.all(t == n * (n + 1) / 2)
    # every rank agrees on the rendezvous that rank 0 chose; one node: loopback
    assert comm.allgather((data_plane.address, data_plane.port)) == [(data_plane.address, data_plane.port)] * n
    assert data_plane.address == "127.0.0.1"


@pytest.mark.launch
def test_bootstrap_across_virtual_nodes_and_master_addr(launch, tmp_path):
    """Virtual nodes force the multi-node path: an interface every rank can reach."""
    script = tmp_path / "probe.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from mpi4py import MPI\n"
        "from hpcnet.bootstrap import init_data_plane\n"
        "from hpcnet.world import discover\n"
        "comm = MPI.COMM_WORLD\n"
        "world = discover(comm)\n"
        "plane = init_data_plane(comm, world, backend='auto', device=torch.device('cpu'), timeout_s=60)\n"
        "t = torch.ones(4) * (world.rank + 1); dist.all_reduce(t)\n"
        "print(f'RESULT {world.rank} {world.num_nodes} {plane.address} {plane.interface} {t[0].item()}', flush=True)\n"
        "plane.close()\n")
    out = launch(3, str(script), module=None, env={"HPCNET_RANKS_PER_NODE": "2"}, timeout=120)
    assert out.returncode == 0, out.stderr
    # ranks' output lines may interleave: pick the records out of the stream
    lines = sorted(m.split() for m in re.findall(r"RESULT \d+ \d+ \S+ \S+ [\d.]+(?=RESULT|\s|$)", out.stdout))
    assert len(lines) == 3
    for _, rank, nodes, address, iface, value in lines:
        assert nodes == "2" and float(value) == 6.0
        # two virtual nodes: a real interface was tested for reachability, not loopback
        assert (address, iface) == (lines[0][3], lines[0][4]) and iface != "lo"
    out = launch(2, str(script), module=None, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"},
                 timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("RESULT") == 2 and out.stdout.count(" 127.0.0.1 ") == 2
