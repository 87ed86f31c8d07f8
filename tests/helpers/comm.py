"""Communication: node layouts, a fake /sys/class/net, listening sockets, a model and its reference gradients,
stand-ins for works and communicators, and parameters with owners."""

import ipaddress
import os
import socket
from pathlib import Path

import torch
from torch import nn


def nodes_of(local_sizes: list[int]) -> list[list[int]]:
    """Consecutive global ranks grouped into nodes of the given sizes: ``[2, 1]`` -> ``[[0, 1], [2]]``."""
    ranks = iter(range(sum(local_sizes)))
    return [[next(ranks) for _ in range(n)] for n in local_sizes]


def hostnames(comm) -> list[str]:
    """Every rank's host name (a collective): one name when the ranks share a host, several on the local cluster."""
    return comm.allgather(socket.gethostname())


def even_nodes(comm) -> dict[str, str]:
    """The environment for virtual nodes of 2 ranks (of 1 at an odd world size: a hierarchical all-reduce needs
    as many ranks on every node)."""
    return {"HPCNET_RANKS_PER_NODE": "2" if comm.Get_size() % 2 == 0 else "1"}


def fake_net(root, name, *, operstate="up", link_type="1", speed=None, rdma_device=False):
    """Add interface ``name`` to a fake /sys/class/net tree at ``root`` (``hpcnet.comm.netif`` reads it)."""
    base = root / name
    base.mkdir(parents=True)
    (base / "operstate").write_text(operstate + "\n")
    (base / "type").write_text(link_type + "\n")
    if speed is not None:
        (base / "speed").write_text(f"{speed}\n")
    if rdma_device:
        (base / "device" / "infiniband" / "mlx5_0").mkdir(parents=True)
    return base


def listening_sockets(pid: str = "self") -> dict[str, tuple[str, int]]:
    """This process's listening TCP sockets: inode -> (address, port), from /proc (no psutil)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            # The kernel prints the address as 32-bit words in host (little-endian) order.
            raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
            found[inode] = (str(ipaddress.ip_address(raw[:width])), int(hex_port, 16))
    return found


class Net(nn.Module):
    """A three-layer MLP, 16 inputs, 4 classes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def reference_grads(model, x, y, comm):
    """Plain reduction: local cross-entropy gradients, then one MPI allreduce each, divided by the size."""
    from mpi4py import MPI

    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    out = []
    for g in grads:
        g = g.clone()
        comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        out.append(g / comm.Get_size())
    return out


class FakeWork:
    """A torch.distributed work that logs its waits."""

    def __init__(self, log, op):
        self.log, self.op = log, op

    def wait(self, *args, **kwargs):
        self.log.append(("wait", self.op, args, kwargs))
        return True


class FakeComm:
    """A 4-rank job on 2 nodes as seen from rank 0, for the constructor's splits (no communication)."""

    def __init__(self, size=4, local=2):
        self.size, self.local = size, local

    def Get_size(self):
        return self.size

    def Split(self, color, key):
        return FakeComm(self.local if color == 0 and key == 0 else self.size // self.local, self.local)

    def allgather(self, item):
        return [(r // self.local, r % self.local) for r in range(self.size)]

    def Free(self):
        pass


def owned_params(comm, sizes=(7, 1, 300, 2, 5)):
    """Parameters of ``sizes`` elements, each with an owner rank (a rank may own nothing at 4 ranks): the owner's
    holds ``arange + 1000 * index``, the others -1 (what ``ParamGather`` must give every rank)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    owner = [(i * 3) % size for i in range(len(sizes))]
    params = [torch.full((n,), -1.0) for n in sizes]
    for i, p in enumerate(params):
        if owner[i] == rank:
            p.copy_(torch.arange(p.numel(), dtype=torch.float32) + 1000 * i)
    return params, owner
