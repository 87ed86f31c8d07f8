"""The gradients' route: a pure function of the options, the device and the layout, agreed on once, before the
probe."""

import pytest

from hpcnet.comm.route import Route, agree_route, choose_route, hierarchical_layout
from hpcnet.config import DistConfig
from hpcnet.config.load import load_config
from hpcnet.errors import ConfigError, UsageError
from hpcnet.world import discover


@pytest.mark.parametrize("cfg, kw, expected", [
    ({}, dict(device_type="cpu", num_nodes=1, min_local_size=4), Route("mpi", False, "gloo")),
    ({}, dict(device_type="cuda", num_nodes=2, min_local_size=8), Route("nccl", True, "gloo")),
    ({}, dict(device_type="cuda", num_nodes=2, min_local_size=1), Route("nccl", False, "gloo")),
    ({"backend": "gloo"}, dict(device_type="cpu", num_nodes=1, min_local_size=2), Route("gloo", False, "mpi")),
    ({"hierarchical": "on", "fallback": "none"}, dict(device_type="cpu", num_nodes=1, min_local_size=2),
     Route("mpi", True, None)),
    ({"backend": "mpi", "fallback": "mpi"}, dict(device_type="cpu", num_nodes=1, min_local_size=2),
     Route("mpi", False, None)),
])
def test_choose_route(cfg, kw, expected):
    assert choose_route(DistConfig(**cfg), **kw) == expected


@pytest.mark.parametrize("option, cores, expected", [
    ("auto", 1.0, "gloo"), ("auto", 2.0, None), ("gloo", 8.0, "gloo"), ("primary", 1.0, None)])
def test_between_nodes_a_hierarchical_mpi_route_takes_gloo_where_polling_would_take_the_core(option, cores, expected):
    """dist.inter_node: gloo's sockets block while they wait; MPI polls.  Only the hierarchical mpi route on CPU
    has a choice to make; gloo then is the torch backend the route needs."""
    layout = dict(device_type="cpu", num_nodes=2, min_local_size=2, cores_per_rank=cores)
    route = choose_route(DistConfig(inter_node=option, fallback="none"), **layout)
    assert route == Route("mpi", True, None, expected)
    assert route.torch_backend == expected
    flat = choose_route(DistConfig(inter_node=option), **{**layout, "num_nodes": 1})
    assert flat.inter_node is None
    gpu = choose_route(DistConfig(inter_node=option), **{**layout, "device_type": "cuda"})
    assert gpu.inter_node is None and gpu.primary == "nccl"
    with pytest.raises(ConfigError, match="dist.inter_node: 'tcp' is not one of"):
        DistConfig(inter_node="tcp")
    # dist.compression under mpi: only where gloo carries the sums between the nodes (bf16 there only)
    compressed = DistConfig(inter_node=option, compression="bf16")
    if expected:
        assert choose_route(compressed, **layout).inter_node == "gloo"
    else:
        with pytest.raises(UsageError, match="gloo between the nodes of a hierarchical mpi route"):
            choose_route(compressed, **layout)


def test_hierarchical_on_nodes_of_unequal_sizes_is_an_error_naming_the_option():
    """Nodes of 3 and 2 ranks: the nodes' shards would not line up across nodes (sums of unequal buffers, or a
    hang); auto leaves it flat, on is refused."""
    uneven = dict(device_type="cpu", num_nodes=2, min_local_size=2, max_local_size=3)
    assert not choose_route(DistConfig(), **uneven).hierarchical
    assert not choose_route(DistConfig(hierarchical="off"), **uneven).hierarchical
    with pytest.raises(UsageError, match="dist.hierarchical=on needs as many ranks on every node; these nodes "
                                         "have 2 to 3"):
        choose_route(DistConfig(hierarchical="on"), **uneven)
    assert choose_route(DistConfig(hierarchical="on"), **{**uneven, "min_local_size": 3}).hierarchical


@pytest.mark.mpi(min_size=3)
def test_a_hierarchical_transport_on_nodes_of_unequal_sizes_fails_on_every_rank(comm):
    """Virtual nodes of 3 ranks at 4 ranks (3 and 1): a clear error on every rank, not a hang in the sums."""
    from hpcnet.comm.transport import build_transport
    from hpcnet.world import discover

    world = discover(comm, environ={"HPCNET_RANKS_PER_NODE": str(comm.Get_size() - 1)})
    with pytest.raises(ValueError, match=f"as many ranks on every node; these nodes have 1 to {comm.Get_size() - 1}"):
        build_transport("mpi", True, comm, world, timeout_s=60)
    comm.Barrier()


def test_choose_route_errors():
    with pytest.raises(UsageError, match="dist.backend: 'nccl' needs a GPU"):
        choose_route(DistConfig(backend="nccl"), device_type="cpu", num_nodes=1, min_local_size=1)
    with pytest.raises(UsageError, match="CUDA-aware"):
        choose_route(DistConfig(backend="mpi"), device_type="cuda", num_nodes=1, min_local_size=1)
    with pytest.raises(UsageError, match="dist.compression"):
        choose_route(DistConfig(backend="mpi", compression="bf16"), device_type="cpu", num_nodes=1,
                     min_local_size=1)


def test_compression_is_checked_against_the_resolved_backend():
    """'auto' is mpi on CPU, which cannot sum half precision: an error before training, not in backward."""
    cpu = dict(device_type="cpu", num_nodes=1, min_local_size=2)
    with pytest.raises(UsageError, match=r"dist.compression: bf16 .* dist.backend 'auto' is mpi on CPU"):
        choose_route(DistConfig(compression="bf16"), **cpu)
    # gloo carries it; its automatic fallback (mpi) could not, so there is none
    assert choose_route(DistConfig(backend="gloo", compression="fp16"), **cpu) == Route("gloo", False, None)
    with pytest.raises(UsageError, match="dist.fallback: 'mpi' cannot carry dist.compression=bf16"):
        choose_route(DistConfig(backend="gloo", compression="bf16", fallback="mpi"), **cpu)
    gpu = dict(device_type="cuda", num_nodes=1, min_local_size=2)
    assert choose_route(DistConfig(compression="bf16"), **gpu) == Route("nccl", False, "gloo")
    load_config(overrides=["dist.compression=bf16"])  # the option alone is valid: the device decides


@pytest.mark.parametrize("route, torch_backend", [
    (Route("mpi", False, None), None), (Route("mpi", True, None), None),
    (Route("mpi", False, "gloo"), "gloo"), (Route("gloo", False, "mpi"), "gloo"),
    (Route("nccl", True, "gloo"), "nccl"), (Route("nccl", False, None), "nccl"),
])
def test_the_route_says_which_torch_group_the_bootstrap_starts(route, torch_backend):
    assert route.torch_backend == torch_backend


def test_the_topology_hint_decides_auto_only():
    kw = dict(device_type="cpu", num_nodes=2, min_local_size=2)
    assert choose_route(DistConfig(), **kw).hierarchical
    assert not choose_route(DistConfig(), **kw, hierarchical_hint=False).hierarchical
    assert choose_route(DistConfig(hierarchical="on"), **kw, hierarchical_hint=False).hierarchical


@pytest.mark.mpi
def test_ranks_with_different_devices_are_an_error_on_every_rank(comm):
    world = discover(comm, environ={})
    last = comm.Get_rank() == comm.Get_size() - 1 and comm.Get_size() > 1
    cfg = DistConfig(backend="gloo", hierarchical="off")  # flat on the local cluster's real hosts too
    assert agree_route(comm, world, cfg, device_type="cpu") == Route("gloo", False, "mpi")
    if comm.Get_size() == 1:
        return
    with pytest.raises(UsageError, match=rf"ranks chose different transports: .*\(ranks \[{comm.Get_size() - 1}\]"):
        agree_route(comm, world, cfg, device_type="cuda" if last else "cpu")


@pytest.mark.mpi
@pytest.mark.parametrize("option, needle", [
    # flat: on the local cluster's real hosts a hierarchical mpi route sends bf16 between them over gloo
    ("dist.compression=bf16 dist.hierarchical=off", "dist.compression: bf16 needs the nccl or gloo backend"),
    ("dist.backend=nccl", "dist.backend: 'nccl' needs a GPU"),
])
def test_an_impossible_transport_stops_before_the_data_and_the_model(comm, mpi_tmp_path, option, needle):
    from hpcnet.train import run

    cfg = load_config(overrides=[
        f"run.dir={mpi_tmp_path / 'impossible'}", "run.dir_exact=true", "dist.probe=false", "dist.device=cpu",
        "data.dataset=/nonexistent/set.h5", *option.split()])  # opening the data would be the first error otherwise
    with pytest.raises(UsageError, match=needle):
        run(cfg, comm)  # no plane given: the rendezvous would come before the data
    comm.Barrier()


def test_the_layout_rule_is_the_topologys_advice():
    """The probe's 'hierarchical' advice is this rule, so choosing the route before the probe changes nothing."""
    from hpcnet.comm.measured import Topology
    from hpcnet.comm.nodes import Node
    from hpcnet.comm.topology import recommend

    for local_sizes in ([1], [4], [1, 1], [2, 2], [2, 1], [3, 3, 3], [3, 2], [4, 4, 2]):
        starts = [sum(local_sizes[:i]) for i in range(len(local_sizes))]
        nodes = [Node(index=i, host=f"n{i}", ranks=list(range(s, s + n)))
                 for i, (s, n) in enumerate(zip(starts, local_sizes))]
        topology = Topology(size=sum(local_sizes), num_nodes=len(nodes), virtual_nodes=False, nodes=nodes, ranks=[],
                            latency_us={}, bandwidth_gbps={}, small_bytes=8, large_bytes=8, rounds=0, budget_s=1.0,
                            probe_s=0.0)
        layout = hierarchical_layout(len(local_sizes), min(local_sizes), max(local_sizes))
        assert layout == (len(local_sizes) > 1 and min(local_sizes) == max(local_sizes) > 1)
        assert recommend(topology)["hierarchical"] == layout
        cpu = dict(device_type="cpu", num_nodes=len(local_sizes), min_local_size=min(local_sizes),
                   max_local_size=max(local_sizes))
        assert choose_route(DistConfig(), **cpu).hierarchical == layout
        assert choose_route(DistConfig(), **cpu, hierarchical_hint=True).hierarchical == (
            min(local_sizes) == max(local_sizes))


@pytest.mark.mpi
def test_an_impossible_transport_stops_before_the_probe_on_every_rank(comm, mpi_tmp_path, monkeypatch):
    """dist.backend=nccl on a CPU-only job: the route's error, not a probe, on every rank."""
    from hpcnet import train
    from hpcnet.comm import topology

    def no_probe(*args, **kwargs):
        raise AssertionError("the probe ran before the route was chosen")

    monkeypatch.setattr(topology, "probe", no_probe)
    cfg = load_config(overrides=[f"run.dir={mpi_tmp_path / 'before-probe'}", "run.dir_exact=true",
                                 "dist.probe=true", "dist.device=cpu", "dist.backend=nccl",
                                 "data.dataset=/nonexistent/set.h5"])
    with pytest.raises(UsageError, match=r"dist.backend: 'nccl' needs a GPU device"):
        train.run(cfg, comm)
    comm.Barrier()


def test_mpi_progress_is_inline_without_a_spare_core_and_the_option_wins():
    from hpcnet.comm.route import mpi_progress

    assert mpi_progress("auto", 1.0) == mpi_progress("auto", 0.125) == "inline"  # 2 ranks on 2 cores; 16 a core
    assert mpi_progress("auto", 2.0) == mpi_progress("auto", 8.0) == "thread"
    assert mpi_progress("thread", 0.5) == "thread" and mpi_progress("inline", 8.0) == "inline"
    with pytest.raises(ConfigError, match="dist.progress: 'fast' is not one of"):
        DistConfig(progress="fast")


def test_int8_takes_the_hierarchical_path_with_gloo_between_the_nodes():
    """dist.compression=int8 compresses only between nodes, in a hierarchical transport with gloo there: even at
    one rank a node, even where polling would not take the core; on one node the sums are plain and exact."""
    int8 = DistConfig(compression="int8")
    cpu = dict(device_type="cpu", cores_per_rank=8)
    assert choose_route(int8, num_nodes=2, min_local_size=2, **cpu) == Route("mpi", True, "gloo", "gloo")
    assert choose_route(int8, num_nodes=3, min_local_size=1, **cpu) == Route("mpi", True, "gloo", "gloo")
    assert choose_route(int8, num_nodes=2, min_local_size=2, hierarchical_hint=False, **cpu).hierarchical
    assert choose_route(int8, num_nodes=1, min_local_size=4, **cpu) == Route("mpi", False, "gloo")
    gloo = DistConfig(backend="gloo", compression="int8")
    assert choose_route(gloo, num_nodes=2, min_local_size=2, **cpu) == Route("gloo", True, "mpi")
    for cfg, kw, needle in [
            (DistConfig(compression="int8"), dict(device_type="cuda"), "int8 runs between the nodes over gloo, and "
                                                                        "dist.backend is nccl"),
            (DistConfig(backend="shm", compression="int8"), cpu, "int8 runs on the hierarchical path; .*shm"),
            (DistConfig(compression="int8", hierarchical="off"), cpu, "int8 .* dist.hierarchical is off"),
            (DistConfig(compression="int8", inter_node="primary"), cpu, "int8 .* dist.inter_node is primary"),
    ]:
        with pytest.raises(UsageError, match=f"dist.compression: {needle}"):
            choose_route(cfg, num_nodes=2, min_local_size=2, **kw)
    with pytest.raises(UsageError, match="int8 needs as many ranks on every node"):
        choose_route(int8, num_nodes=2, min_local_size=1, max_local_size=2, **cpu)


def test_compression_auto_is_exact():
    assert DistConfig().compression == "auto"
    cpu = dict(device_type="cpu", num_nodes=2, min_local_size=2, cores_per_rank=8)
    assert choose_route(DistConfig(), **cpu) == choose_route(DistConfig(compression="none"), **cpu)
    with pytest.raises(Exception, match="dist.compression: .int4. is not one of .auto., .none., .fp16., .bf16."):
        load_config(overrides=["dist.compression=int4"])
