"""Tensors between ranks as raw bytes in messages below MPI's count limit: ``exchange`` and the reassignment's move of
optimizer state (``ShardedOptimizer.reshard``), with the limit lowered so small tensors go in many pieces; a real
message of more than 2**31 bytes in the slow tests (``--slow``: scripts/test.sh --slow) where memory allows."""

import io
import pickle

import numpy as np
import pytest
import torch
from torch import nn

from hpcnet.comm import exchange as exchange_mod
from hpcnet.comm.costmodel import OwnerAssignment
from hpcnet.comm.exchange import exchange, pieces
from hpcnet.comm.sharding.assign import assign_owners
from hpcnet.comm.sharding.layout import ShardLayout
from hpcnet.comm.sharding.optimizer import ParamGather, ShardedOptimizer
from tests.helpers.comm import owned_params


class _NoTensors(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, (torch.Tensor, np.ndarray)):
            raise AssertionError(f"a {type(obj).__name__} pickled into an MPI message")
        return NotImplemented


class LimitedComm:
    """A communicator that refuses what MPI refuses past ``limit`` bytes a message (its C int count, lowered here)
    and a tensor pickled into a message (buffers carry tensors; pickle only small Python objects).  Records the
    size of every point-to-point buffer message in ``sizes``."""

    def __init__(self, comm, limit, sizes=None):
        self._comm, self.limit = comm, limit
        self.sizes = sizes if sizes is not None else []

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def Dup(self):
        return LimitedComm(self._comm.Dup(), self.limit, self.sizes)

    def _pickled(self, obj):
        _NoTensors(io.BytesIO()).dump(obj)

    def _buffer(self, buf):
        data = buf[0] if isinstance(buf, (list, tuple)) else buf
        nbytes = memoryview(data).nbytes
        if nbytes > self.limit:
            raise AssertionError(f"MPI_ERR_ARG: a message of {nbytes} bytes, over the limit of {self.limit}")
        self.sizes.append(nbytes)

    def alltoall(self, objs):
        for obj in objs:
            self._pickled(obj)
        return self._comm.alltoall(objs)

    def allgather(self, obj):
        self._pickled(obj)
        return self._comm.allgather(obj)

    def bcast(self, obj, root=0):
        self._pickled(obj)
        return self._comm.bcast(obj, root=root)

    def Isend(self, buf, dest, tag=0):
        self._buffer(buf)
        return self._comm.Isend(buf, dest, tag)

    def Irecv(self, buf, source, tag):
        self._buffer(buf)
        return self._comm.Irecv(buf, source, tag)


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same(got, want):
    assert set(got) == set(want)
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert isinstance(got[name], torch.Tensor) and got[name].device.type == "cpu"
            assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
            assert torch.equal(_bits(got[name]), _bits(value)), name
        else:
            assert got[name] == value, name


def _payload(source, dest):
    g = torch.Generator().manual_seed(1000 * source + dest)
    return {"exp_avg": torch.randn(37, 5, generator=g),  # 740 bytes: 8 pieces of 100
            "half": torch.randn(61, generator=g).to(torch.bfloat16),
            "step": torch.tensor(float(source + 2 * dest)),
            "every_third": torch.arange(150)[::3],  # not contiguous
            "empty": torch.empty(0, 4),
            "flags": torch.tensor([True, False, source > dest]),
            "note": f"from {source} to {dest}", "count": source}


def test_pieces_cover_the_bytes_below_the_limit(monkeypatch):
    assert pieces(2**31 + 1) == [(0, 2**30), (2**30, 2**31), (2**31, 2**31 + 1)]  # MPI counts are C ints
    monkeypatch.setattr(exchange_mod, "MAX_MESSAGE_BYTES", 100)
    assert pieces(0) == [] and pieces(100) == [(0, 100)] and pieces(250) == [(0, 100), (100, 200), (200, 250)]


@pytest.mark.mpi
def test_exchange_moves_every_tensor_bit_for_bit_in_pieces_below_the_limit(comm, monkeypatch):
    monkeypatch.setattr(exchange_mod, "MAX_MESSAGE_BYTES", 100)
    limited = LimitedComm(comm, 100)
    rank, size = comm.Get_rank(), comm.Get_size()
    got = exchange(limited, [{("unit", rank, dest): _payload(rank, dest)} for dest in range(size)])
    assert set(got) == {("unit", source, rank) for source in range(size)}
    for source in range(size):
        _assert_same(got[("unit", source, rank)], _payload(source, rank))
    if size > 1:  # per peer: 8 + 2 + 1 + 4 + 1 messages (the empty tensor sends none)
        assert len(limited.sizes) == 2 * 16 * (size - 1) and max(limited.sizes) == 100
    comm.Barrier()


def _grads(params, step):
    return [torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)) for i, p in enumerate(params)]


@pytest.mark.mpi
@pytest.mark.parametrize("stage", [1, 2])
def test_reshard_moves_the_state_bit_for_bit_as_bytes_below_the_limit(comm, monkeypatch, stage):
    """Every unit changes owner (a cut parameter's rows among them); what each new owner holds is, bit for bit,
    what the old one held, and went in messages of at most the (lowered) limit, no tensor pickled."""
    monkeypatch.setattr(exchange_mod, "MAX_MESSAGE_BYTES", 256)
    limited = LimitedComm(comm, 256)
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 64), nn.ReLU(), nn.Linear(64, 8))
    params = list(model.parameters())
    layout = ShardLayout(params, size)
    assert size == 1 or any(not u.whole for u in layout.units)  # the 64x40 weight is cut into row ranges
    assignment, _ = assign_owners(layout.tensors, limited, mode="uniform")
    optimizer = ShardedOptimizer(torch.optim.AdamW(params, lr=1e-2), assignment, layout, limited, stage,
                                 elementwise=True)
    for step in range(2):
        grads = _grads(params, step)
        if stage == 1:
            for p, g in zip(params, grads):
                p.grad = g
        else:  # stage 2: only the owned units' gradients, on the units' tensors
            for k in optimizer.owned:
                u = layout.units[k]
                layout.tensors[k].grad = grads[u.param] if u.whole else grads[u.param][u.lo:u.hi]
        optimizer.step()
        optimizer.zero_grad()
    held = {}
    for part in comm.allgather({k: {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in values.items()}
                                for k, values in optimizer.unit_state().items()}):
        held.update(part)
    assert sorted(held) == list(range(len(layout.units)))
    moved = OwnerAssignment([(o + 1) % size for o in assignment.owner], assignment.rank_bytes, assignment.rank_time_s)
    limited.sizes.clear()
    sent = optimizer.reshard(moved)
    state = optimizer.unit_state()
    assert set(state) == {k for k, o in enumerate(moved.owner) if o == rank}
    for k, values in state.items():
        _assert_same(values, held[k])
    if size > 1:
        assert sent == sum(v.numel() * v.element_size() for k, o in enumerate(assignment.owner) if o == rank
                           for v in held[k].values())
        assert max(limited.sizes) <= 256 and len(limited.sizes) > 2 * len(state)  # the larger tensors in pieces
    optimizer.close()
    comm.Barrier()


@pytest.mark.mpi
def test_param_gather_in_blocks_below_the_limit(comm, monkeypatch):
    """A parameter larger than the limit is listed in blocks below it; every rank still gets every owner's values."""
    monkeypatch.setattr(exchange_mod, "MAX_MESSAGE_BYTES", 12)
    params, owner = owned_params(comm)
    sizes = [p.numel() for p in params]
    gather = ParamGather(params, owner, comm)
    lengths = [n for t in gather.types if t is not None for n in t.decode()[2]["blocklengths"]]
    assert max(lengths) == 12 and sum(lengths) == 4 * sum(sizes)  # every owner's parameters, in blocks of 12
    gather.run()
    gather.close()
    for i, p in enumerate(params):
        assert torch.equal(p, torch.arange(p.numel(), dtype=torch.float32) + 1000 * i)


def _available_bytes():
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


@pytest.mark.mpi
@pytest.mark.slow  # moves 2 x 2 GiB: what it needs is in docs/testing.md
def test_more_than_2_gib_in_one_tensor(comm):
    """At 2 ranks: rank 0 sends rank 1 one tensor of 2**31 + 4096 bytes (exchange), then broadcasts a parameter of
    that size (ParamGather); each was one message before, which MPI refuses (its count is a C int)."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        pytest.skip("a 2-rank test")
    if not comm.allreduce(_available_bytes() > 6 * 2**30, op=MPI.LAND):
        pytest.skip("less than 6 GiB of memory available")
    nbytes = 2**31 + 4096

    def marks(modulus):  # one byte in every 4096 set: what to check without a second 2 GiB tensor
        return torch.arange(-(-nbytes // 4096)).remainder(modulus).to(torch.uint8)

    big = torch.zeros(nbytes, dtype=torch.uint8)
    if rank == 0:
        big[::4096] = marks(251)
    got = exchange(comm, [{}, {"big": {"exp_avg": big}}] if rank == 0 else [{}, {}])
    if rank == 1:
        arrived = got["big"]["exp_avg"]
        assert arrived.numel() == nbytes and torch.equal(arrived[::4096], marks(251))
        del arrived, got
    else:
        big[::4096] = marks(239)
    gather = ParamGather([big], [0], comm)
    gather.run()
    gather.close()
    assert torch.equal(big[::4096], marks(239))
    comm.Barrier()
