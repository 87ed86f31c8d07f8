"""Replicas kept equal: rank 0's buffers in one flat broadcast (``hpcnet.comm.replicas``)."""

import pytest
import torch
from torch import nn

from hpcnet.comm.replicas import broadcast_buffers
from tests.helpers.comm import FakeComm, FakeWork


class _BufferNet(nn.Module):
    def __init__(self, fill: float):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)  # float32 statistics and an int64 counter
        self.register_buffer("mask", torch.tensor([True, False, fill > 0]))
        self.register_buffer("halves", torch.full((2, 3), fill, dtype=torch.float16))
        with torch.no_grad():
            self.bn.running_mean.fill_(fill)
            self.bn.num_batches_tracked.fill_(int(fill) + 7)


class _CountingComm:
    def __init__(self, comm):
        self.comm, self.bcasts = comm, 0

    def Get_size(self):
        return self.comm.Get_size()

    def Bcast(self, buf, root=0):
        self.bcasts += 1
        return self.comm.Bcast(buf, root=root)


@pytest.mark.mpi
def test_buffers_of_every_dtype_travel_in_one_broadcast(comm):
    model, counting = _BufferNet(float(comm.Get_rank())), _CountingComm(comm)
    broadcast_buffers(model, counting)
    assert counting.bcasts == (1 if comm.Get_size() > 1 else 0)
    for got, want in zip(model.buffers(), _BufferNet(0.0).buffers()):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_buffers_on_a_nccl_group_are_broadcast_on_the_device(monkeypatch):
    """The NCCL path: one broadcast of the flat tensor, waited for on the stream; no MPI, no host copy."""
    import torch.distributed as dist

    rank0 = torch.cat([b.reshape(-1).view(torch.uint8)
                       for b in sorted(_BufferNet(5.0).buffers(), key=lambda b: -b.element_size())])
    log = []

    def broadcast(tensor, src, group=None, async_op=False):
        log.append((tensor.dtype, tensor.numel(), src, group, async_op))
        tensor.copy_(rank0)  # what rank 0 sends
        return FakeWork(log, "broadcast")

    monkeypatch.setattr(dist, "broadcast", broadcast)

    class NoMpi(FakeComm):
        def Bcast(self, *args, **kwargs):
            raise AssertionError("buffers on a NCCL group must not go through MPI")

    model = _BufferNet(1.0)
    broadcast_buffers(model, NoMpi(size=2), group="world")
    assert log == [(torch.uint8, rank0.numel(), 0, "world", True), ("wait", "broadcast", (), {})]
    for got, want in zip(model.buffers(), _BufferNet(5.0).buffers()):
        assert torch.equal(got, want)
