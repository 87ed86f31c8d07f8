"""DataParallel: replicas kept equal, gradients averaged, fallback mid-run, accumulation, whole runs."""

from pathlib import Path

import pytest
import torch
from torch import nn

from hpcnet.comm.dataparallel import DataParallel
from hpcnet.comm.route import Route
from hpcnet.config import DistConfig
from hpcnet.config.load import load_config
from hpcnet.errors import RestartableError, UsageError
from hpcnet.world import discover
from tests.helpers.comm import Net, even_nodes, reference_grads

MPI_ONLY = Route("mpi", False, None)


@pytest.mark.mpi
def test_mismatched_models_are_an_error_on_every_rank(comm):
    world = discover(comm, environ={})
    model = nn.Linear(4, 4 + (comm.Get_rank() == comm.Get_size() - 1 and comm.Get_size() > 1))
    if comm.Get_size() == 1:
        DataParallel(model, comm, world, DistConfig(), device=torch.device("cpu"), route=MPI_ONLY).close()
        return
    with pytest.raises(UsageError, match=rf"model differs across ranks: ranks \[{comm.Get_size() - 1}\]"):
        DataParallel(model, comm, world, DistConfig(), device=torch.device("cpu"), route=MPI_ONLY)


def _loss(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _data(comm, n=8):
    torch.manual_seed(100 + comm.Get_rank())  # different data on every rank
    return torch.randn(n, 16), torch.randint(0, 4, (n,))


@pytest.mark.mpi
@pytest.mark.parametrize("route", [MPI_ONLY, Route("gloo", False, "mpi"), Route("mpi", True, None)])
def test_a_step_averages_the_gradients_of_equal_replicas(comm, data_plane, route):
    world = discover(comm, environ=even_nodes(comm) if route.hierarchical else {})
    torch.manual_seed(comm.Get_rank())  # replicas initialised differently: rank 0's weights win
    model = Net()
    dp = DataParallel(model, comm, world, DistConfig(bucket_mb=0.004), device=torch.device("cpu"), route=route)
    first = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert comm.allgather(first.sum().item()) == [first.sum().item()] * comm.Get_size()
    x, y = _data(comm)
    expected = reference_grads(model, x, y, comm)
    loss = dp.step([(x, y)], _loss)
    assert loss.shape == () and dp.step_count == 1
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    hierarchical = route.hierarchical and comm.Get_size() > 1
    assert dp.backend == ("hierarchical-" if hierarchical else "") + route.primary
    assert dp.summary()["hierarchical"] == route.hierarchical
    assert f"gradients: {dp.backend} all-reduce" in dp.describe()
    assert f"fallback {route.fallback or 'none'}" in dp.describe()
    dp.close()


@pytest.mark.mpi
def test_micro_batches_communicate_once_and_average(comm):
    world = discover(comm, environ={})
    torch.manual_seed(0)
    model = Net()
    dp = DataParallel(model, comm, world, DistConfig(), device=torch.device("cpu"), route=MPI_ONLY)
    x, y = _data(comm)
    expected = reference_grads(model, x, y, comm)
    before = dp.summary()["bytes_reduced"]
    dp.step([(x[:4], y[:4]), (x[4:], y[4:])], _loss)
    numel = sum(p.numel() for p in model.parameters())
    assert dp.summary()["bytes_reduced"] - before == numel * 4  # one reduction of every gradient
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    dp.close()


@pytest.mark.mpi
def test_a_failed_step_is_redone_on_the_fallback_by_every_rank(comm, data_plane):
    world = discover(comm, environ={})
    last = comm.Get_size() - 1
    cfg = DistConfig(fail_at_step=2, fail_ranks=[last])
    torch.manual_seed(0)
    model = Net()
    dp = DataParallel(model, comm, world, cfg, device=torch.device("cpu"), route=Route("gloo", False, "mpi"))
    x, y = _data(comm)
    dp.step([(x, y)], _loss)
    assert dp.backend == "gloo"
    expected = reference_grads(model, x, y, comm)
    dp.step([(x, y)], _loss)
    assert dp.backend == "mpi" and dp.route == Route("mpi", False, None)
    assert [(f["step"], f["from"], f["to"]) for f in dp.summary()["fallbacks"]] == [(2, "gloo", "mpi")]
    for p, g in zip(model.parameters(), expected):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    dp.close()


@pytest.mark.mpi
def test_a_failure_without_fallback_stops_every_rank(comm):
    world = discover(comm, environ={})
    cfg = DistConfig(fail_at_step=1, fail_ranks=[comm.Get_size() - 1])
    dp = DataParallel(Net(), comm, world, cfg, device=torch.device("cpu"), route=MPI_ONLY)
    with pytest.raises(RestartableError, match=r"step 1: mpi all-reduce failed .*; no fallback left"):
        dp.step([_data(comm)], _loss)
    dp.close()


# --- whole runs -------------------------------------------------------------

def _run(comm, plane, tmp, name, *extra):
    from hpcnet.train import run
    from tests.helpers.data import tiny_images

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
    base, summary = _run(comm, data_plane, mpi_tmp_path, "mpi", "dist.backend=mpi", "dist.hierarchical=off")
    assert summary["comm"]["backend"] == "mpi"
    for name, extra in [("gloo", ["dist.backend=gloo", "dist.hierarchical=off"]), ("hier", ["dist.hierarchical=on"])]:
        monkeypatch.setenv("HPCNET_RANKS_PER_NODE", even_nodes(comm)["HPCNET_RANKS_PER_NODE"])
        params, summary = _run(comm, data_plane, mpi_tmp_path, name, *extra)
        torch.testing.assert_close(params, base, rtol=1e-4, atol=1e-5)
    comm.Barrier()


@pytest.mark.mpi
def test_fallback_mid_run_gives_the_same_parameters(comm, data_plane, mpi_tmp_path):
    flat = ("dist.backend=gloo", "dist.hierarchical=off")  # on one host and on the local cluster's hosts alike
    base, _ = _run(comm, data_plane, mpi_tmp_path, "nofault", *flat)
    last = comm.Get_size() - 1
    params, summary = _run(comm, data_plane, mpi_tmp_path, "fault", *flat, "dist.fail_at_step=3",
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
    flat = ("dist.backend=gloo", "dist.hierarchical=off")
    _run(comm, data_plane, mpi_tmp_path, "first-half", *flat, "train.steps=2", ckpt)
    _, summary = _run(comm, data_plane, mpi_tmp_path, "second-half", *flat, "train.steps=4", ckpt,
                      "checkpoint.resume=auto", "dist.fail_at_step=3")
    assert summary["start_step"] == 2
    assert [(f["step"], f["from"], f["to"]) for f in summary["comm"]["fallbacks"]] == [(3, "gloo", "mpi")]
    comm.Barrier()


@pytest.mark.mpi
def test_the_communication_forecast_is_logged_beside_the_measured_time(comm, data_plane, mpi_tmp_path, monkeypatch):
    """With the probe, the cost model's forecast of a step's all-reduce goes to the log and the summary, and at
    step 20 the measured time beside it; across nodes the log says what lossy compression would send, without
    choosing it (dist.compression=auto stays exact)."""
    from hpcnet.paths import rank_log

    monkeypatch.setenv("HPCNET_RANKS_PER_NODE", even_nodes(comm)["HPCNET_RANKS_PER_NODE"])
    _, summary = _run(comm, data_plane, mpi_tmp_path, "forecast", "dist.probe=true", "train.steps=21")
    if comm.Get_size() == 1:
        assert "forecast" not in summary["comm"]
        return
    forecast = summary["comm"]["forecast"]
    nodes = comm.Get_size() // int(even_nodes(comm)["HPCNET_RANKS_PER_NODE"])
    assert forecast["allreduce_ms"] > 0 and summary["comm"]["allreduce_ms"] > 0
    assert forecast["wire"] == "fp32" and (forecast["host_bytes"] > 0) == (nodes > 1)
    if comm.Get_rank() == 0:
        text = (Path(summary["run_dir"]) / rank_log(0)).read_text()
        assert "communication forecast (" in text and "communication: forecast" in text and "measured" in text
        assert ("opt in with dist.compression" in text) == (nodes > 1)
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("inside_us,inside_gbit,hierarchical", [(5.0, 10.0, True), (1000.0, 0.5, False)])
def test_hierarchical_auto_follows_the_faked_probe_and_both_paths_average_alike(comm, data_plane, inside_us,
                                                                               inside_gbit, hierarchical):
    """dist.hierarchical=auto on virtual nodes of 2 with a faked probe: a 1 Gbit/s, 100 us link between the nodes
    and fast ranks inside gives the hierarchical path; ranks inside slower than the link (this small model's
    all-reduce is latency-bound: 1 ms inside) the flat one; the choice is rank 0's on every rank, and either
    path's gradients are the average."""
    from hpcnet.comm.costmodel import LinkCost

    world = discover(comm, environ=even_nodes(comm))
    if world.num_nodes < 2 or world.size == world.num_nodes:
        pytest.skip("needs nodes of 2 ranks (an even world size above 2)")
    route = Route("mpi", True, None, "gloo")
    torch.manual_seed(0)
    model = Net()
    dp = DataParallel(model, comm, world, DistConfig(bucket_mb=0.004), device=torch.device("cpu"), route=route,
                      link=LinkCost.from_probe(100.0, 1.0), intra_link=LinkCost.from_probe(inside_us, inside_gbit))
    try:
        assert dp.route.hierarchical == hierarchical and dp.summary()["path"]["hierarchical"] == hierarchical
        assert dp.backend == ("hierarchical-mpi+gloo" if hierarchical else "mpi")
        if hierarchical:
            assert dp.reducer.transport.chunk_bytes == dp.path.chunk_bytes
        x, y = _data(comm)
        expected = reference_grads(model, x, y, comm)
        dp.step([(x, y)], _loss)
        for p, g in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    finally:
        dp.close()
