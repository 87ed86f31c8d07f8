"""The shared-memory transport: slices, exact sums at any size and on virtual nodes, training equal to MPI's,
fallback out of the shared window, and the route's rules."""

import pytest
import torch

from hpcnet.comm.dataparallel import DataParallel
from hpcnet.comm.route import Route, agree_route, choose_route
from hpcnet.comm.transport.shm import ALIGN_ELEMENTS, ShmTransport, slice_bounds
from hpcnet.config import DistConfig
from hpcnet.errors import UsageError
from hpcnet.world import discover
from tests.comm.test_dataparallel import _data, _loss
from tests.helpers.comm import Net


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 1000, 4099])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_slices_cover_every_element_once_aligned(numel, parts):
    bounds = [slice_bounds(numel, parts, k) for k in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no overlap
    assert all(lo % ALIGN_ELEMENTS == 0 or lo == numel for lo, _ in bounds)  # aligned, or empty at the end
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) < 2 * ALIGN_ELEMENTS


def _worlds(comm):
    yield discover(comm, environ={})
    if comm.Get_size() % 2 == 0:
        yield discover(comm, environ={"HPCNET_RANKS_PER_NODE": "2"})  # virtual nodes: MPI between them


@pytest.mark.mpi
@pytest.mark.parametrize("numel", [1, 11, 4096, 100_003])
def test_shm_sums_exactly_in_the_window(comm, numel):
    size, rank = comm.Get_size(), comm.Get_rank()
    for world in _worlds(comm):
        transport = ShmTransport(comm, world)
        bucket = transport.allocate(numel, torch.float32)
        assert torch.all(bucket == 0)
        for round_ in range(2):  # the window is reused: nothing of the first sum leaks into the second
            bucket.copy_(torch.arange(numel, dtype=torch.float32) + rank + round_)
            transport.start(bucket).wait(60.0)
            expected = torch.arange(numel, dtype=torch.float32) * size + size * (size - 1) / 2 + size * round_
            assert torch.equal(bucket, expected)
        with pytest.raises(ValueError, match="only buckets it allocated"):
            transport.start(torch.zeros(numel))
        transport.close()


@pytest.mark.mpi
def test_training_on_shm_equals_mpi_and_falls_back_out_of_the_window(comm):
    """Same parameters after steps on shm and on MPI (bit for bit where the sum order is the same: 1 and 2 ranks);
    an injected failure at step 3 moves the buckets out of the shared window onto MPI, redoing the step."""
    x, y = _data(comm)
    finals = {}
    for backend, extra in (("mpi", {}), ("shm", {}), ("shm-fail", {"fail_at_step": 3})):
        torch.manual_seed(0)
        model = Net()
        cfg = DistConfig(backend=backend.split("-")[0], bucket_mb=0.004, **extra)
        route = choose_route(cfg, device_type="cpu", num_nodes=1, min_local_size=comm.Get_size())
        dp = DataParallel(model, comm, discover(comm, environ={}), cfg, device=torch.device("cpu"), route=route)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for _ in range(5):
            dp.step([(x, y)], _loss)
            optimizer.step()
        assert dp.backend == ("mpi" if backend != "shm" else "shm")
        dp.close()
        grads_readable = all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        assert grads_readable  # after close: the gradients were moved out of the freed window
        finals[backend] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    exact = comm.Get_size() <= 2
    for other in ("shm", "shm-fail"):
        if exact:
            assert torch.equal(finals["mpi"], finals[other])
        else:  # MPI's sum order is its algorithm's, shm's is rank order: float32 rounding differs
            torch.testing.assert_close(finals["mpi"], finals[other], rtol=1e-5, atol=1e-6)


def test_the_route_for_shm():
    cpu = dict(device_type="cpu", num_nodes=2, min_local_size=4)
    fastest = DistConfig(backend="fastest")
    assert choose_route(fastest, **cpu, shm_wins=True) == Route("shm", False, "mpi")  # measured faster
    assert choose_route(fastest, **cpu, shm_wins=False).primary == "mpi"
    assert choose_route(DistConfig(), **cpu, shm_wins=True).primary == "mpi"  # auto: the same bits every run
    assert choose_route(DistConfig(backend="mpi"), **cpu, shm_wins=True).primary == "mpi"  # the option wins
    assert choose_route(fastest, device_type="cuda", num_nodes=1, min_local_size=2,
                        shm_wins=True).primary == "nccl"
    assert choose_route(DistConfig(backend="shm"), **cpu) == Route("shm", False, "mpi")
    assert choose_route(DistConfig(backend="shm", fallback="gloo"), **cpu) == Route("shm", False, "gloo")
    assert Route("shm", False, "mpi").torch_backend is None  # no torch.distributed at all
    with pytest.raises(UsageError, match="'shm' sums CPU tensors"):
        choose_route(DistConfig(backend="shm"), device_type="cuda", num_nodes=1, min_local_size=1)
    with pytest.raises(UsageError, match="dist.compression: bf16 needs the nccl or gloo backend"):
        choose_route(DistConfig(backend="shm", compression="bf16"), **cpu)


@pytest.mark.mpi
def test_fastest_picks_the_faster_sum_measured_the_same_on_every_rank(comm, monkeypatch):
    import hpcnet.comm.transport.shm as shm

    world = discover(comm, environ={})
    mpi_s, shm_s = shm.race_shm_against_mpi(comm, world, 1 << 16)
    assert comm.allgather((mpi_s, shm_s)) == [(mpi_s, shm_s)] * comm.Get_size() and mpi_s > 0 and shm_s > 0
    for measured, expected in (((2.0, 1.0), "shm"), ((1.0, 2.0), "mpi")):
        monkeypatch.setattr(shm, "race_shm_against_mpi", lambda *args, m=measured: m)
        route = agree_route(comm, world, DistConfig(backend="fastest"), device_type="cpu")
        assert route.primary == (expected if comm.Get_size() > 1 else "mpi")  # one rank: nothing to race
        assert agree_route(comm, world, DistConfig(), device_type="cpu").primary == "mpi"  # auto never races
