"""The communication layer: buckets, overlap, backends, hierarchy, fallback, accumulation."""

import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpcnet.comm.reducer import Reducer, plan_buckets
from hpcnet.config import DistConfig, load_config
from hpcnet.comm.dataparallel import DataParallel, Plan, build_transport, decide_plan, plan_transport
from hpcnet.errors import RestartableError, UsageError
from hpcnet.comm.world import discover


def test_plan_buckets_reverse_order_and_caps():
    assert plan_buckets([4, 4, 4, 4], 8) == [[3, 2], [1, 0]]
    assert plan_buckets([4, 4, 4, 4], 8, first_bucket_bytes=4) == [[3], [2, 1], [0]]
    assert plan_buckets([100, 1, 1], 8) == [[2, 1], [0]]  # an oversized tensor gets its own bucket
    every = sorted(i for b in plan_buckets(list(range(1, 50)), 64, 16) for i in b)
    assert every == list(range(49))
    with pytest.raises(ValueError):
        plan_buckets([1], 0)


@pytest.mark.parametrize("cfg, kw, expected", [
    ({}, dict(device_type="cpu", num_nodes=1, min_local_size=4), Plan("mpi", False, "gloo")),
    ({}, dict(device_type="cuda", num_nodes=2, min_local_size=8), Plan("nccl", True, "gloo")),
    ({}, dict(device_type="cuda", num_nodes=2, min_local_size=1), Plan("nccl", False, "gloo")),
    ({"backend": "gloo"}, dict(device_type="cpu", num_nodes=1, min_local_size=2), Plan("gloo", False, "mpi")),
    ({"hierarchical": "on", "fallback": "none"}, dict(device_type="cpu", num_nodes=1, min_local_size=2),
     Plan("mpi", True, None)),
    ({"backend": "mpi", "fallback": "mpi"}, dict(device_type="cpu", num_nodes=1, min_local_size=2),
     Plan("mpi", False, None)),
])
def test_plan_transport(cfg, kw, expected):
    assert plan_transport(DistConfig(**cfg), **kw) == expected


def test_plan_transport_errors():
    with pytest.raises(UsageError, match="dist.backend: 'nccl' needs a GPU"):
        plan_transport(DistConfig(backend="nccl"), device_type="cpu", num_nodes=1, min_local_size=1)
    with pytest.raises(UsageError, match="CUDA-aware"):
        plan_transport(DistConfig(backend="mpi"), device_type="cuda", num_nodes=1, min_local_size=1)
    with pytest.raises(UsageError, match="dist.compression"):
        plan_transport(DistConfig(backend="mpi", compression="bf16"), device_type="cpu", num_nodes=1,
                       min_local_size=1)


def test_compression_is_checked_against_the_resolved_backend():
    """'auto' is mpi on CPU, which cannot sum half precision: an error before training, not in backward."""
    cpu = dict(device_type="cpu", num_nodes=1, min_local_size=2)
    with pytest.raises(UsageError, match=r"dist.compression: bf16 .* dist.backend 'auto' is mpi on CPU"):
        plan_transport(DistConfig(compression="bf16"), **cpu)
    # gloo carries it; its automatic fallback (mpi) could not, so there is none
    assert plan_transport(DistConfig(backend="gloo", compression="fp16"), **cpu) == Plan("gloo", False, None)
    with pytest.raises(UsageError, match="dist.fallback: 'mpi' cannot carry dist.compression=bf16"):
        plan_transport(DistConfig(backend="gloo", compression="bf16", fallback="mpi"), **cpu)
    gpu = dict(device_type="cuda", num_nodes=1, min_local_size=2)
    assert plan_transport(DistConfig(compression="bf16"), **gpu) == Plan("nccl", False, "gloo")
    load_config(overrides=["dist.compression=bf16"])  # the option alone is valid: the device decides


@pytest.mark.parametrize("plan, torch_backend", [
    (Plan("mpi", False, None), None), (Plan("mpi", True, None), None),
    (Plan("mpi", False, "gloo"), "gloo"), (Plan("gloo", False, "mpi"), "gloo"),
    (Plan("nccl", True, "gloo"), "nccl"), (Plan("nccl", False, None), "nccl"),
])
def test_the_plan_says_which_torch_group_the_bootstrap_starts(plan, torch_backend):
    assert plan.torch_backend == torch_backend


def test_the_topology_hint_decides_auto_only():
    kw = dict(device_type="cpu", num_nodes=2, min_local_size=2)
    assert plan_transport(DistConfig(), **kw).hierarchical
    assert not plan_transport(DistConfig(), **kw, hierarchical_hint=False).hierarchical
    assert plan_transport(DistConfig(hierarchical="on"), **kw, hierarchical_hint=False).hierarchical


@pytest.mark.mpi
def test_ranks_with_different_devices_are_an_error_on_every_rank(comm):
    world = discover(comm, environ={})
    last = comm.Get_rank() == comm.Get_size() - 1 and comm.Get_size() > 1
    cfg = DistConfig(backend="gloo")
    assert decide_plan(comm, world, cfg, device_type="cpu") == Plan("gloo", False, "mpi")
    if comm.Get_size() == 1:
        return
    with pytest.raises(UsageError, match=rf"ranks chose different transports: .*\(ranks \[{comm.Get_size() - 1}\]"):
        decide_plan(comm, world, cfg, device_type="cuda" if last else "cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _reference_grads(model, x, y, comm):
    """Plain reduction: local gradients, then one MPI allreduce each, divided by the size."""
    loss = nn.functional.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    out = []
    for g in grads:
        g = g.clone()
        comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
        out.append(g / comm.Get_size())
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("kind, hierarchical, compression", [
    ("mpi", False, None), ("gloo", False, None), ("mpi", True, None), ("gloo", True, None),
    ("gloo", False, torch.bfloat16),
])
def test_bucketed_overlapped_equals_plain(comm, data_plane, kind, hierarchical, compression):
    world = discover(comm, environ={"HPCNET_RANKS_PER_NODE": "2"} if hierarchical else {})
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(100 + comm.Get_rank())  # different data on every rank
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    expected = _reference_grads(model, x, y, comm)
    # tiny buckets: many of them, launched from hooks during backward
    reducer = Reducer(list(model.named_parameters()), build_transport(kind, hierarchical, comm, world), comm,
                      bucket_bytes=4096, first_bucket_bytes=512, compression=compression)
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


@pytest.mark.mpi
def test_mismatched_models_are_an_error_on_every_rank(comm):
    world = discover(comm, environ={})
    model = nn.Linear(4, 4 + (comm.Get_rank() == comm.Get_size() - 1 and comm.Get_size() > 1))
    if comm.Get_size() == 1:
        DataParallel(model, comm, world, DistConfig(), device=torch.device("cpu")).close()
        return
    with pytest.raises(UsageError, match=rf"model differs across ranks: ranks \[{comm.Get_size() - 1}\]"):
        DataParallel(model, comm, world, DistConfig(), device=torch.device("cpu"))


# --- whole runs -------------------------------------------------------------

def _run(comm, plane, tmp, name, *extra):
    from hpcnet.train import run
    from tests.helpers import tiny_images

    path = tiny_images(comm, tmp, "tiny.h5", num_train=256, num_eval=64, seed=5)
    cfg = load_config(overrides=[
        f"data.dataset={path}", f"run.dir={tmp / name}", "run.dir_exact=true", "train.batch_size=4",
        "train.steps=6", "train.eval_every=0", "model.name=mlp", "model.options.hidden=[32, 32]",
        "optim.name=adamw", "optim.lr=0.01", "dist.bucket_mb=0.002", "dist.first_bucket_mb=0.001",
        "dist.probe=false", *extra])
    result = run(cfg, comm, plane=plane)
    return torch.cat([p.detach().reshape(-1) for p in result.model.parameters()]), result.summary


@pytest.mark.mpi
def test_backends_train_alike(comm, data_plane, mpi_tmp_path, monkeypatch):
    base, summary = _run(comm, data_plane, mpi_tmp_path, "mpi", "dist.backend=mpi")
    assert summary["comm"]["backend"] == "mpi"
    for name, extra in [("gloo", ["dist.backend=gloo"]), ("hier", ["dist.hierarchical=on"])]:
        monkeypatch.setenv("HPCNET_RANKS_PER_NODE", "2")
        params, summary = _run(comm, data_plane, mpi_tmp_path, name, *extra)
        torch.testing.assert_close(params, base, rtol=1e-4, atol=1e-5)
    comm.Barrier()


@pytest.mark.mpi
def test_fallback_mid_run_gives_the_same_parameters(comm, data_plane, mpi_tmp_path):
    base, _ = _run(comm, data_plane, mpi_tmp_path, "nofault", "dist.backend=gloo")
    last = comm.Get_size() - 1
    params, summary = _run(comm, data_plane, mpi_tmp_path, "fault", "dist.backend=gloo", "dist.fail_at_step=3",
                           f"dist.fail_ranks=[{last}]")
    fallbacks = summary["comm"]["fallbacks"]
    assert [(f["step"], f["from"], f["to"]) for f in fallbacks] == [(3, "gloo", "mpi")]
    assert summary["comm"]["backend"] == "mpi"
    torch.testing.assert_close(params, base, rtol=1e-5, atol=1e-6)
    with pytest.raises(RestartableError, match="no fallback left"):
        _run(comm, data_plane, mpi_tmp_path, "nofallback", "dist.fail_at_step=2", "dist.fallback=none")
    comm.Barrier()


@pytest.mark.mpi
def test_accumulation_matches_a_large_batch(comm, data_plane, mpi_tmp_path):
    big, _ = _run(comm, data_plane, mpi_tmp_path, "big", "train.batch_size=8")
    accumulated, _ = _run(comm, data_plane, mpi_tmp_path, "acc", "train.batch_size=4", "train.grad_accumulation=2")
    torch.testing.assert_close(accumulated, big, rtol=1e-4, atol=1e-5)
    comm.Barrier()


@pytest.mark.mpi
def test_fail_at_step_counts_global_steps_like_fault_options(comm, data_plane, mpi_tmp_path):
    """A resumed run injects at the same step as an uninterrupted one (fault.* count global steps too)."""
    ckpt = f"checkpoint.dir={mpi_tmp_path / 'global-steps.ckpt'}"
    _run(comm, data_plane, mpi_tmp_path, "first-half", "dist.backend=gloo", "train.steps=2", ckpt)
    _, summary = _run(comm, data_plane, mpi_tmp_path, "second-half", "dist.backend=gloo", "train.steps=4", ckpt,
                      "checkpoint.resume=auto", "dist.fail_at_step=3")
    assert summary["start_step"] == 2
    assert [(f["step"], f["from"], f["to"]) for f in summary["comm"]["fallbacks"]] == [(3, "gloo", "mpi")]
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("option, needle", [
    ("dist.compression=bf16", "dist.compression: bf16 needs the nccl or gloo backend"),
    ("dist.backend=nccl", "dist.backend: 'nccl' needs a GPU"),
])
def test_an_impossible_transport_stops_before_the_data_and_the_model(comm, mpi_tmp_path, option, needle):
    from hpcnet.train import run

    cfg = load_config(overrides=[
        f"run.dir={mpi_tmp_path / 'impossible'}", "run.dir_exact=true", "dist.probe=false", "dist.device=cpu",
        "data.dataset=/nonexistent/set.h5", option])  # opening the data would be the first error otherwise
    with pytest.raises(UsageError, match=needle):
        run(cfg, comm)  # no plane given: the rendezvous would come before the data
    comm.Barrier()


# --- NCCL ordering, checked on CPU with a stand-in for torch.distributed ---------------------

class _FakeWork:
    def __init__(self, log, op):
        self.log, self.op = log, op

    def wait(self, *args, **kwargs):
        self.log.append(("wait", self.op, args, kwargs))
        return True


class _FakeComm:
    """A 4-rank job on 2 nodes as seen from rank 0, for the constructor's splits (no communication)."""

    def __init__(self, size=4, local=2):
        self.size, self.local = size, local

    def Get_size(self):
        return self.size

    def Split(self, color, key):
        return _FakeComm(self.local if color == 0 and key == 0 else self.size // self.local, self.local)

    def allgather(self, item):
        return [(r // self.local, r % self.local) for r in range(self.size)]

    def Free(self):
        pass


@pytest.fixture
def fake_nccl(monkeypatch):
    """torch.distributed's collectives replaced by fakes that log enqueues and waits."""
    import torch.distributed as dist

    log = []

    def collective(op):
        def enqueue(*args, group=None, async_op=False, **kwargs):
            # Each phase must be ordered after the previous one before it is enqueued.
            log.append(("enqueue", op, group, async_op))
            return _FakeWork(log, op) if async_op else None
        return enqueue

    def subgroups(ranks, timeout=None, backend=None):
        log.append(("new_group", backend, timeout))
        return f"group{len([e for e in log if e[0] == 'new_group'])}", []

    for name, op in [("reduce_scatter_single", "reduce_scatter"), ("reduce_scatter_tensor", "reduce_scatter"),
                     ("all_gather_single", "all_gather"), ("all_gather_into_tensor", "all_gather"),
                     ("all_reduce", "all_reduce")]:
        monkeypatch.setattr(dist, name, collective(op), raising=False)
    monkeypatch.setattr(dist, "new_subgroups_by_enumeration", subgroups)
    return log


def test_hierarchical_nccl_phases_wait_for_each_other_on_the_stream(fake_nccl):
    import datetime

    from hpcnet.comm.transport import HierarchicalTransport

    transport = HierarchicalTransport(_FakeComm(), node_index=0, local_rank=0, kind="nccl", timeout_s=42)
    # the subgroups get dist.timeout_s: NCCL's watchdog enforces it, not a CPU wait
    assert [e for e in fake_nccl if e[0] == "new_group"] == [("new_group", "nccl", datetime.timedelta(seconds=42))] * 2
    fake_nccl.clear()
    flat = torch.arange(11, dtype=torch.float32)  # odd: a padded work buffer
    handle = transport.start(flat)
    assert fake_nccl == [
        ("enqueue", "reduce_scatter", "group1", True),
        ("wait", "reduce_scatter", (), {}),  # no timeout: a stream wait, the CPU goes on
        ("enqueue", "all_reduce", "group2", True),
        ("wait", "all_reduce", (), {}),
        ("enqueue", "all_gather", "group1", True),
    ]
    handle.wait(30.0)
    assert fake_nccl[-1] == ("wait", "all_gather", (), {})  # no timed (CPU-spinning) wait on NCCL
    assert torch.equal(flat, torch.arange(11, dtype=torch.float32))  # copied back out of the padded buffer
    transport.close()


def test_only_gloo_works_are_waited_for_with_a_timeout(fake_nccl):
    import datetime

    from hpcnet.comm.transport import TorchTransport

    TorchTransport("g", "nccl", 2).start(torch.zeros(4)).wait(30.0)
    assert fake_nccl[-1] == ("wait", "all_reduce", (), {})
    TorchTransport("g", "gloo", 2).start(torch.zeros(4)).wait(30.0)
    assert fake_nccl[-1] == ("wait", "all_reduce", (datetime.timedelta(seconds=30),), {})


# --- buffers: one flat tensor -----------------------------------------------------------------

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
    from hpcnet.comm.reducer import broadcast_buffers

    model, counting = _BufferNet(float(comm.Get_rank())), _CountingComm(comm)
    broadcast_buffers(model, counting)
    assert counting.bcasts == (1 if comm.Get_size() > 1 else 0)
    for got, want in zip(model.buffers(), _BufferNet(0.0).buffers()):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_buffers_on_a_nccl_group_are_broadcast_on_the_device(monkeypatch):
    """The NCCL path: one broadcast of the flat tensor, waited for on the stream; no MPI, no host copy."""
    import torch.distributed as dist

    from hpcnet.comm.reducer import broadcast_buffers

    rank0 = torch.cat([b.reshape(-1).view(torch.uint8)
                       for b in sorted(_BufferNet(5.0).buffers(), key=lambda b: -b.element_size())])
    log = []

    def broadcast(tensor, src, group=None, async_op=False):
        log.append((tensor.dtype, tensor.numel(), src, group, async_op))
        tensor.copy_(rank0)  # what rank 0 sends
        return _FakeWork(log, "broadcast")

    monkeypatch.setattr(dist, "broadcast", broadcast)

    class NoMpi(_FakeComm):
        def Bcast(self, *args, **kwargs):
            raise AssertionError("buffers on a NCCL group must not go through MPI")

    model = _BufferNet(1.0)
    broadcast_buffers(model, NoMpi(size=2), group="world")
    assert log == [(torch.uint8, rank0.numel(), 0, "world", True), ("wait", "broadcast", (), {})]
    for got, want in zip(model.buffers(), _BufferNet(5.0).buffers()):
        assert torch.equal(got, want)
