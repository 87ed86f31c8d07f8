"""The bucketed reducer: bucket layout, overlap with backward, unused parameters."""

import pytest
import torch
from torch import nn

from hpcnet.comm.buckets import bucket_layout
from hpcnet.comm.reducer import Reducer
from hpcnet.comm.sharding.placement import ShardedGradients
from hpcnet.comm.transport import build_transport
from hpcnet.world import discover
from tests.helpers.comm import Net, even_nodes, reference_grads


def _sharded(owners, comm):
    """dist.zero=2's placement with every parameter whole and its owner from ``owners``; None (the default,
    replicated) without owners."""
    if owners is None:
        return None
    return ShardedGradients(owners, None, n_params=len(owners), rank=comm.Get_rank(), world_size=comm.Get_size())


def test_bucket_layout_takes_reverse_order_and_caps():
    assert bucket_layout([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert bucket_layout([4, 4, 4, 4], 8, first_bucket_bytes=4) == [[3], [2, 1], [0]]
    assert bucket_layout([100, 1, 1], 8) == [[2, 1, 0]]  # a bucket closes once full: a big tensor goes at once
    # An MLP (weight, bias per layer; last layer first): a big weight closes its bucket, never waits for the
    # next layer's bias.
    assert bucket_layout([16, 1, 16, 1, 2, 1], 8, first_bucket_bytes=1) == [[5], [4, 3, 2], [1, 0]]
    every = sorted(i for b in bucket_layout(list(range(1, 50)), 64, 16) for i in b)
    assert every == list(range(49))
    with pytest.raises(ValueError):
        bucket_layout([1], 0)


@pytest.mark.mpi
@pytest.mark.parametrize("kind, hierarchical, compression", [
    ("mpi", False, None), ("gloo", False, None), ("mpi", True, None), ("gloo", True, None),
    ("gloo", False, torch.bfloat16),
])
def test_bucketed_overlapped_equals_plain(comm, data_plane, kind, hierarchical, compression):
    world = discover(comm, environ=even_nodes(comm) if hierarchical else {})
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(100 + comm.Get_rank())  # different data on every rank
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    expected = reference_grads(model, x, y, comm)
    # tiny buckets: many of them, launched from hooks during backward
    reducer = Reducer(list(model.named_parameters()), build_transport(kind, hierarchical, comm, world), comm,
                      bucket_bytes=1024, first_bucket_bytes=16, compression=compression)
    assert len(reducer.buckets) >= 4
    launched_during_backward = []
    reducer.buckets[0].params[0].register_post_accumulate_grad_hook(
        lambda p: launched_during_backward.append(reducer.buckets[0].launched))
    reducer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    reducer.finish()
    tol = dict(rtol=2e-2, atol=2e-3) if compression else dict(rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, **tol)
    assert launched_during_backward == [True]  # the last layer's bucket went out before backward ended
    reducer.close()


@pytest.mark.mpi
@pytest.mark.parametrize("hierarchical", [False, True])
def test_inline_and_threaded_mpi_give_the_same_bits(comm, hierarchical):
    """Gradients are handed over (``.grad`` None after zero_grad), folded times 1/n into the buckets, and end
    as views of them; either way a step has one control exchange."""
    from hpcnet.fault.flightrec import FlightRecorder

    world = discover(comm, environ=even_nodes(comm) if hierarchical else {})
    torch.manual_seed(100 + comm.Get_rank())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    grads, exchanges = {}, {}
    for progress in ("thread", "inline"):
        torch.manual_seed(0)
        model = Net()
        recorder = FlightRecorder()
        reducer = Reducer(list(model.named_parameters()),
                          build_transport("mpi", hierarchical, comm, world, progress=progress), comm,
                          bucket_bytes=4096, first_bucket_bytes=512, recorder=recorder)
        assert reducer.transport.synchronous == (progress == "inline" or comm.Get_size() == 1)
        for _ in range(2):  # a second step: nothing of the first one's buckets leaks into it
            reducer.zero_grad()
            assert all(p.grad is None for p in model.parameters())
            nn.functional.cross_entropy(model(x), y).backward()
            reducer.finish()
        for bucket in reducer.buckets:
            base = bucket.buffer.data_ptr()
            end = base + bucket.buffer.numel() * bucket.buffer.element_size()
            assert all(base <= p.grad.data_ptr() < end for p in bucket.params)
        grads[progress] = [p.grad.clone() for p in model.parameters()]
        ops = [e.op for e in recorder.entries()]
        exchanges[progress] = ops.count("reducer.outcome")
        reducer.close()
    expected = reference_grads(_seeded_net(), x, y, comm)
    for a, b, g in zip(grads["thread"], grads["inline"], expected):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, g, rtol=1e-5, atol=1e-6)
    assert exchanges["inline"] == exchanges["thread"] == 2  # one a step


@pytest.mark.mpi
@pytest.mark.parametrize("kind, sharded", [("mpi", False), ("gloo", False), ("mpi", True)])
def test_a_bucket_of_one_parameter_is_its_gradient_summed_in_place(comm, data_plane, kind, sharded):
    """Tiny buckets (one parameter each): the bucket takes autograd's gradient itself, no copy, and gives the
    bits of the copying path (a placement that does not adopt), step after step, with micro-batches and with
    a parameter unused in a step; between steps the bucket lets its memory go."""
    world = discover(comm, environ={})
    n = comm.Get_size()
    torch.manual_seed(100 + comm.Get_rank())
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(4)]
    grads = {}
    for adopt in (True, False):
        model = _seeded_net()
        named = list(model.named_parameters())
        owners = [i % n for i in range(len(named))] if sharded else None
        reducer = Reducer(named, build_transport(kind, False, comm, world), comm, bucket_bytes=1,
                          first_bucket_bytes=1, placement=_sharded(owners, comm), find_unused=True)
        assert all(b.single for b in reducer.buckets) and len(reducer.buckets) == len(named)
        if not adopt:
            reducer.placement.adopts = False
        handed = {}
        hooks = [p.register_post_accumulate_grad_hook(
                     lambda p, name=name, handed=handed: handed.__setitem__(name, p.grad.data_ptr()))
                 for name, p in named]
        hooks += [p.register_post_accumulate_grad_hook(reducer._on_grad) for _, p in named]
        for hook in reducer._hooks:  # the reducer's own hook runs after the one that notes autograd's tensor
            hook.remove()
        reducer._hooks = hooks
        steps = []
        for step, (x, y) in enumerate(batches):
            reducer.zero_grad()
            if adopt and not sharded:
                assert all(b.buffer.numel() == 0 for b in reducer.buckets)  # the last step's gradient let go
            if step == 1:  # two micro-batches: autograd accumulates in .grad, the last one's hook folds
                with reducer.no_sync():
                    nn.functional.cross_entropy(model(x[:4]), y[:4]).backward()
                nn.functional.cross_entropy(model(x[4:]), y[4:]).backward()
            elif step == 2:  # layer c unused: its bucket is zeros, made in finish
                torch.relu(model.b(torch.relu(model.a(x)))).sum().backward()
            else:
                nn.functional.cross_entropy(model(x), y).backward()
            reducer.finish()
            got = [(t.grad.clone() if t.grad is not None else None)
                   for b in reducer.buckets for t in b.entry_tensor]
            steps.append(got)
            if adopt and not sharded and step in (0, 3):
                for name, p in named:  # the sum is in the tensor autograd handed over
                    assert p.grad.data_ptr() == handed[name], name
        grads[adopt] = steps
        reducer.close()
    for a, b in zip(grads[True], grads[False]):
        for ga, gb in zip(a, b):
            assert (ga is None and gb is None) or torch.equal(ga, gb)


def _seeded_net():
    torch.manual_seed(0)
    return Net()


@pytest.mark.mpi
def test_an_inline_failure_on_one_rank_fails_the_step_on_every_rank(comm):
    from hpcnet.comm.transport import CommFailure, FaultyTransport

    world = discover(comm, environ={})
    last = comm.Get_rank() == comm.Get_size() - 1
    model = Net()
    reducer = Reducer(list(model.named_parameters()),
                      FaultyTransport(build_transport("mpi", False, comm, world, progress="inline"), fail=last),
                      comm, bucket_bytes=4096)
    reducer.arm_fault(True)
    reducer.zero_grad()
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(CommFailure, match="mpi all-reduce failed" + (" here: injected" if last else "")):
        reducer.finish()
    reducer.arm_fault(False)
    reducer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    reducer.finish()  # the next step works
    reducer.close()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind, progress, sharded", [("mpi", "inline", False), ("mpi", "thread", False),
                                                     ("shm", "inline", False), ("mpi", "inline", True),
                                                     ("mpi", "thread", True)])
def test_a_parameter_unused_on_one_rank_only_is_an_error_or_a_zero_never_a_hang(comm, kind, progress, sharded):
    """Rank 0's graph skips layer b, the others' do not: rank 0 cannot complete b's bucket while its peers
    can.  At dist.zero=2 (``sharded``) the hooks run even a synchronous transport's collectives: the peers
    wait in b's until rank 0 completes it in ``finish``, and go on in the same order."""
    from mpi4py import MPI

    world = discover(comm, environ={})
    rank = comm.Get_rank()

    class Sometimes(Net):
        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.c(h if rank == 0 else torch.relu(self.b(h)))

    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    # The reference: local gradients (zeros where none), summed, divided.
    torch.manual_seed(0)
    plain = Sometimes()
    local = torch.autograd.grad(nn.functional.cross_entropy(plain(x), y), list(plain.parameters()),
                                allow_unused=True)
    expected = []
    for g, p in zip(local, plain.parameters()):
        g = torch.zeros_like(p) if g is None else g.clone()
        comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        expected.append(g / comm.Get_size())
    for find_unused in (False, True):
        torch.manual_seed(0)
        model = Sometimes()
        owners = [i % comm.Get_size() for i in range(len(expected))] if sharded else None
        reducer = Reducer(list(model.named_parameters()),
                          build_transport(kind, False, comm, world, progress=progress), comm,
                          bucket_bytes=1024, first_bucket_bytes=16, find_unused=find_unused,
                          placement=_sharded(owners, comm))
        reducer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if find_unused:
            reducer.finish()
            for i, (p, want) in enumerate(zip(model.parameters(), expected)):
                if sharded and owners[i] != rank:
                    assert p.grad is None
                else:
                    torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)
        else:
            with pytest.raises(RuntimeError, match="no gradient this step"):
                reducer.finish()
        reducer.close()


class Deep(nn.Module):
    """Eight layers of 64x64: buckets that fill one after the other during backward."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])

    def forward(self, x):
        return self.layers(x)[:, :4]


@pytest.mark.mpi
@pytest.mark.parametrize("kind, progress", [("mpi", "inline"), ("mpi", "thread"), ("gloo", "inline")])
def test_stage_2_drops_each_bucket_once_its_sum_is_in(comm, data_plane, kind, progress):
    """dist.zero=2: a bucket goes out as soon as it is complete, even on a synchronous transport, and is dropped
    once its sum is in, so the whole gradient is never alive at once (the stage's memory saving); the owners'
    gradients equal the plain reduction's. At dist.zero=0 every bucket lives on (it is the gradient)."""
    world = discover(comm, environ={})
    size, rank = comm.Get_size(), comm.Get_rank()
    torch.manual_seed(0)
    model = Deep()
    torch.manual_seed(100 + rank)
    x, y = torch.randn(8, 64), torch.randint(0, 4, (8,))
    expected = reference_grads(model, x, y, comm)
    params = list(model.parameters())
    layer_bytes = (64 * 64 + 64) * 4
    for sharded in (True, False):
        owners = [i % size for i in range(len(params))] if sharded else None
        reducer = Reducer(list(model.named_parameters()), build_transport(kind, False, comm, world, progress=progress),
                          comm, bucket_bytes=layer_bytes, first_bucket_bytes=layer_bytes,
                          placement=_sharded(owners, comm))
        assert len(reducer.buckets) == 8
        live = []  # bucket bytes alive after each parameter's hook (ours run after the reducer's)
        owned = []  # and this rank's owned sums (dist.zero=2) alive then

        def note(_: torch.Tensor, live=live, owned=owned, reducer=reducer) -> None:
            live.append(sum(b.buffer.numel() * 4 for b in reducer.buckets))
            owned.append(sum(b.shard.owned.numel() * 4 for b in reducer.buckets
                             if b.shard is not None and b.shard.owned is not None))

        hooks = [p.register_post_accumulate_grad_hook(note) for p in params]
        for _ in range(2):  # a second step makes the dropped buckets again
            live.clear()
            owned.clear()
            reducer.zero_grad()
            # The last step's owned sums are dropped with the gradients: made again as each bucket goes out.
            assert all((b.shard is None or b.shard.owned is None) and p.grad is None
                       for b in reducer.buckets for p in b.params)
            nn.functional.cross_entropy(model(x), y).backward()
            at_end = live[-1]
            reducer.finish()
            for i, (p, want) in enumerate(zip(params, expected)):
                if sharded and owners[i] != rank:
                    assert p.grad is None
                else:
                    torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)
            total = sum(p.numel() * 4 for p in params)
            if not sharded:
                assert at_end == total  # every bucket alive: at dist.zero=0 they are the gradients
            elif reducer.transport.synchronous:
                # Each sum was in when its hook returned: at most the bucket being filled is alive, and the owned
                # sums grow bucket by bucket (the first hooks see at most the first bucket's).
                assert max(live) <= layer_bytes and at_end == 0, live
                assert owned[0] <= layer_bytes and owned == sorted(owned), owned
            else:
                # A worker thread's or gloo's sums finish while backward goes on: fewer than all alive at
                # some point would be timing; what holds is that nothing is kept past finish.
                assert max(live) <= total
            if sharded:
                assert all(b.buffer.numel() == 0 for b in reducer.buckets)
        for hook in hooks:
            hook.remove()
        reducer.close()


@pytest.mark.mpi
def test_unused_parameters(comm):
    world = discover(comm, environ={})

    class Partial(Net):
        def forward(self, x):
            return self.c(torch.relu(self.a(x)) @ torch.eye(64))  # self.b unused

    torch.manual_seed(0)
    model = Partial()
    x, y = torch.randn(4, 16), torch.randint(0, 4, (4,))
    reducer = Reducer(list(model.named_parameters()), build_transport("mpi", False, comm, world), comm,
                      bucket_bytes=2**20)
    reducer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=r"no gradient this step \(b\.bias, b\.weight\).*dist.find_unused"):
        reducer.finish()
    reducer.close()
    reducer = Reducer(list(model.named_parameters()), build_transport("mpi", False, comm, world), comm,
                      bucket_bytes=2**20, find_unused=True)
    reducer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    reducer.finish()
    assert torch.all(model.b.weight.grad == 0)
    reducer.close()
