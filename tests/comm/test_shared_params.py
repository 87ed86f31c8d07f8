"""A parameter used more than once in a step: weight tying, a layer applied several times, and activation
checkpointing of a shared layer (ALBERT), reentrant (one backward per segment: the gradient arrives once per
segment) and not; every arrival is summed once, at every stage and with either progress."""

import contextlib
import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcnet.comm.dataparallel import DataParallel
from hpcnet.comm.reducer import LateGradient, Reducer
from hpcnet.comm.route import Route
from hpcnet.comm.sharding.layout import ShardLayout
from hpcnet.comm.sharding.placement import ShardedGradients
from hpcnet.comm.transport import build_transport
from hpcnet.config import DistConfig
from hpcnet.errors import UsageError
from hpcnet.world import discover

MODES = ["plain", "reentrant", "nonreentrant"]
DEPTH = 3


class Shared(nn.Module):
    """ALBERT in small: one layer applied ``DEPTH`` times, and an input projection whose weight is used again
    inside every application and, transposed, as the output layer (weight tying).  ``mode``: how each application
    runs: in the one graph ('plain'), or under reentrant or non-reentrant activation checkpointing.  The layer's
    weight (16 KiB) is cut into row ranges at dist.zero=2 from 2 ranks on."""

    def __init__(self, mode: str = "plain", depth: int = DEPTH, tied_inside: bool = True):
        super().__init__()
        self.mode, self.depth, self.tied_inside = mode, depth, tied_inside
        self.inp = nn.Linear(16, 64)
        self.layer = nn.Linear(64, 64)
        self.out_bias = nn.Parameter(torch.zeros(16))

    def block(self, h):
        out = torch.tanh(self.layer(h))
        if self.tied_inside:
            out = out + 0.1 * torch.tanh(h @ self.inp.weight) @ self.inp.weight.t()
        return out

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.depth):
            h = self.block(h) if self.mode == "plain" else checkpoint(self.block, h,
                                                                     use_reentrant=self.mode == "reentrant")
        return nn.functional.linear(h, self.inp.weight.t(), self.out_bias)


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _backward(model, x, y, parts, reducer=None):
    """One step's backward over ``parts`` micro-batches (all but the last under ``no_sync``), as DataParallel."""
    if reducer is None:
        for p in model.parameters():
            p.grad = None
    else:
        reducer.zero_grad()
    for k, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts))):
        quiet = reducer is not None and k < parts - 1
        with reducer.no_sync() if quiet else contextlib.nullcontext():
            (_loss(model, (xs, ys)) / parts).backward()


class _Replica:
    """A model and its reducer (dist.zero=0, or =2 with every unit owned round robin)."""

    def __init__(self, model, comm, world, kind, progress, stage, **options):
        self.model, self.rank = model, comm.Get_rank()
        params = list(model.parameters())
        self.layout = ShardLayout(params, comm.Get_size()) if stage == 2 else None
        owners = [k % comm.Get_size() for k in range(len(self.layout.units))] if stage == 2 else None
        self.owners = owners
        placement = (ShardedGradients(owners, self.layout, n_params=len(params), rank=self.rank,
                                      world_size=comm.Get_size()) if stage == 2 else None)
        self.reducer = Reducer(list(model.named_parameters()), build_transport(kind, False, comm, world,
                                                                               progress=progress),
                               comm, bucket_bytes=1024, first_bucket_bytes=64, placement=placement, **options)

    def grads(self):
        """This rank's averaged gradients: every parameter's, or (dist.zero=2) its own units'."""
        if self.layout is None:
            return [p.grad for p in self.model.parameters()]
        assert all(t.grad is None for k, t in enumerate(self.layout.tensors) if self.owners[k] != self.rank)
        return [t.grad for k, t in enumerate(self.layout.tensors) if self.owners[k] == self.rank]


def _summed(local, comm):
    """The single-process gradients of every rank, summed over MPI and divided by the size."""
    out = []
    for g in local:
        g = g.clone()
        comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        out.append(g / comm.Get_size())
    return out


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("kind, progress", [("mpi", "inline"), ("mpi", "thread"), ("gloo", "inline")])
def test_every_arrival_of_a_gradient_is_summed_once(comm, data_plane, mode, stage, kind, progress):
    """The reducer's sums equal those of the gradient plain autograd accumulates on each rank, handed over once
    (the same buckets, transport and summation order): bit for bit where the world size is a power of two
    (scaling each arrival by 1/n is then exact), else to rounding; and the MPI sum of the single-process
    gradients to rounding.  Reentrant checkpointing brings the layer's gradient once per segment: where the
    hooks send buckets before backward ends, the first backward raises LateGradient on every rank, and the
    redone one (and every later one, micro-batches too) waits for all arrivals."""
    world = discover(comm, environ={})
    size, rank = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    base = Shared(mode)
    hooked = _Replica(copy.deepcopy(base), comm, world, kind, progress, stage)
    handed = _Replica(copy.deepcopy(base), comm, world, kind, progress, stage, find_unused=True)
    local = copy.deepcopy(base)
    exact = size & (size - 1) == 0
    early = size == 1 or stage == 2 or progress == "thread" or kind == "gloo"  # hooks send buckets
    torch.manual_seed(100 + rank)
    for step, parts in ((1, 1), (2, 2)):  # the second step in two micro-batches
        x, y = torch.randn(8, 16), torch.randint(0, 16, (8,))
        _backward(local, x, y, parts)
        want = [p.grad.clone() for p in local.parameters()]
        handed.reducer.zero_grad()
        for p, g in zip(handed.model.parameters(), want):
            p.grad = g.clone()
        handed.reducer.finish()  # every gradient folded once, in finish
        late = False
        try:
            _backward(hooked.model, x, y, parts, hooked.reducer)
            hooked.reducer.finish()
        except LateGradient as exc:
            late = True
            assert "layer.weight (3 times)" in str(exc) or "on another rank" in str(exc)
            _backward(hooked.model, x, y, parts, hooked.reducer)
            hooked.reducer.finish()
        for got, expected in zip(hooked.grads(), handed.grads()):
            if exact:
                assert torch.equal(got, expected), (got - expected).abs().max()
            else:
                torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        if stage == 0:
            for got, expected in zip(hooked.grads(), _summed(want, comm)):
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert late == (step == 1 and mode == "reentrant" and early)
    hooked.reducer.close()
    handed.reducer.close()


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("progress", ["inline", "thread"])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_n_ranks_train_as_one_with_n_times_the_batch(comm, mode, progress, zero):
    """Three SGD steps (the last in two micro-batches) at n ranks x batch 4 give the parameters of one process
    with batch 4n.  A redone first step (reentrant checkpointing, where hooks send buckets early) is one more
    reduction, never a wrong update."""
    world = discover(comm, environ={})
    size, rank = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    model = Shared(mode)
    alone = copy.deepcopy(model)
    dp = DataParallel(model, comm, world, DistConfig(bucket_mb=0.001, first_bucket_mb=0.0001, progress=progress,
                                                     zero=zero, owners="uniform"),
                      device=torch.device("cpu"), route=Route("mpi", False, None))
    optimizer = dp.shard_optimizer(torch.optim.SGD(model.parameters(), lr=0.5))
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for parts in (1, 1, 2):
        x, y = torch.randn(4 * size, 16, generator=generator), torch.randint(0, 16, (4 * size,), generator=generator)
        mine = slice(4 * rank, 4 * rank + 4)
        dp.step(list(zip(x[mine].chunk(parts), y[mine].chunk(parts))), _loss)
        optimizer.step()
        alone_optimizer.zero_grad()
        _loss(alone, (x, y)).backward()
        alone_optimizer.step()
    for name, (a, b) in zip([n for n, _ in model.named_parameters()], zip(model.parameters(), alone.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    early = size == 1 or zero == 2 or progress == "thread"
    assert dp.reducer.stats.steps == 3 + (mode == "reentrant" and early)
    dp.close()


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("progress", ["inline", "thread"])
def test_a_count_that_grows_after_single_arrivals_stops_every_rank(comm, progress):
    """A first step with one reentrant segment, a second with two: where the hooks sent the layer's bucket
    before its second arrival, the step cannot be redone (no snapshot was taken: nothing had arrived twice), and
    every rank raises the same UsageError naming the parameter; where finish sends the buckets, it is right."""
    world = discover(comm, environ={})
    size = comm.Get_size()
    torch.manual_seed(0)
    model = Shared("reentrant", depth=1, tied_inside=False)
    dp = DataParallel(model, comm, world, DistConfig(bucket_mb=0.001, first_bucket_mb=0.0001, progress=progress),
                      device=torch.device("cpu"), route=Route("mpi", False, None))
    torch.manual_seed(100 + comm.Get_rank())
    x, y = torch.randn(4, 16), torch.randint(0, 16, (4,))
    dp.step([(x, y)], _loss)
    model.depth = 2
    local = copy.deepcopy(model)
    _backward(local, x, y, 1)
    if size == 1 or progress == "thread":
        with pytest.raises(UsageError, match=r"step 2: .*layer\.weight \(2 times\).*cannot be redone .*"
                                             r"use_reentrant=False"):
            dp.step([(x, y)], _loss)
    else:
        dp.step([(x, y)], _loss)
        for got, expected in zip(model.parameters(), _summed([p.grad for p in local.parameters()], comm)):
            torch.testing.assert_close(got.grad, expected, rtol=1e-5, atol=1e-6)
    dp.close()


class Albert(nn.Module):
    """An image classifier whose one hidden layer runs ``depth`` times, each under ``checkpointing``: 'none',
    'reentrant' or 'nonreentrant' activation checkpointing."""

    def __init__(self, info, checkpointing, width, depth):
        super().__init__()
        self.inp = nn.Linear(int(torch.tensor(info.input_shape).prod()), width)
        self.layer = nn.Linear(width, width)
        self.head = nn.Linear(width, info.num_classes)
        self.checkpointing, self.depth = checkpointing, depth

    def block(self, h):
        return torch.tanh(self.layer(h))

    def forward(self, x):
        h = self.inp(x.flatten(1))
        for _ in range(self.depth):
            h = self.block(h) if self.checkpointing == "none" else checkpoint(
                self.block, h, use_reentrant=self.checkpointing == "reentrant")
        return self.head(h)


def make_albert(info, checkpointing="none", width=32, depth=3):
    """A user's model factory (``model.factory=tests.comm.test_shared_params:make_albert``)."""
    return Albert(info, checkpointing, width, depth)


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero, extra", [(0, ["dist.progress=thread"]),
                                         (2, ["dist.progress=inline", "train.grad_accumulation=2"])])
def test_a_user_s_checkpointed_shared_layer_trains_as_without_checkpointing(comm, data_plane, mpi_tmp_path, zero,
                                                                           extra):
    """The whole trainer with a user's factory: the same parameters after 6 steps whichever way the shared layer
    is checkpointed (to rounding: autograd adds the layer's uses in another order without checkpointing)."""
    from hpcnet.train import run
    from tests.helpers.data import tiny_images
    from tests.helpers.train import train_config

    dataset = tiny_images(comm, mpi_tmp_path, "albert-images.h5", num_train=256, num_eval=32, seed=5)
    params = {}
    for checkpointing in ("none", "reentrant", "nonreentrant"):
        name = f"albert-{zero}-{checkpointing}"
        cfg = train_config(mpi_tmp_path, dataset, name, "train.steps=6", "optim.name=sgd", "optim.lr=0.2",
                           "optim.warmup_steps=0", "checkpoint.at_end=false", "dist.bucket_mb=0.002",
                           "dist.first_bucket_mb=0.001", f"dist.zero={zero}",
                           "model.factory=tests.comm.test_shared_params:make_albert",
                           f"model.options.checkpointing={checkpointing}", *extra)
        result = run(cfg, comm, plane=data_plane)
        params[checkpointing] = torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])
    for checkpointing in ("reentrant", "nonreentrant"):
        torch.testing.assert_close(params[checkpointing], params["none"], rtol=1e-5, atol=1e-6)
    comm.Barrier()
