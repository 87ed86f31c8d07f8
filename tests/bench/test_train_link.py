"""bench train's link figures: interface counters from a sysfs tree, the link floor, the per-host summary (pure),
and ``gather_link`` under MPI at any size."""

import argparse

import pytest

from hpcnet.bench.common import counter_delta, link_floor_s, link_speed_gbit, net_counters, net_interfaces
from hpcnet.bench.train import _link_result, _parse_args, gather_link, host_link_record, link_summary

MIB = 2**20


def fake_interface(root, name, *, kind=1, tx=None, rx=None, speed=None):
    """An interface directory as sysfs has it: ``type``, ``speed`` and ``statistics/{tx,rx}_bytes`` (None: no file)."""
    path = root / name
    (path / "statistics").mkdir(parents=True)
    (path / "type").write_text(f"{kind}\n")
    if speed is not None:
        (path / "speed").write_text(f"{speed}\n")
    if tx is not None:
        (path / "statistics" / "tx_bytes").write_text(f"{tx}\n")
    if rx is not None:
        (path / "statistics" / "rx_bytes").write_text(f"{rx}\n")


@pytest.fixture
def sysfs(tmp_path):
    """A class/net tree: loopback (twice: by name and by type), a 1 Gbit/s NIC, a 10 Gbit/s one, a veth without a
    speed, and an interface without counters."""
    root = tmp_path / "class" / "net"
    fake_interface(root, "lo", kind=772, tx=10**9, rx=10**9)
    fake_interface(root, "loop1", kind=772, tx=10**9, rx=10**9, speed=1)
    fake_interface(root, "eth0", tx=1000, rx=2000, speed=1000)
    fake_interface(root, "eth1", tx=30, rx=40, speed=10000)
    fake_interface(root, "ens9", tx=5, rx=6, speed=-1)
    fake_interface(root, "docker0", tx=7, rx=8)  # a bridge: its bytes pass a physical interface too
    fake_interface(root, "odd0", speed=100)
    return root


def test_counters_sum_the_non_loopback_interfaces(sysfs):
    assert net_interfaces(sysfs) == ["ens9", "eth0", "eth1", "odd0"]  # not docker0
    assert net_counters(sysfs) == {"eth0": (1000, 2000), "eth1": (30, 40), "ens9": (5, 6)}
    assert net_counters(sysfs / "missing") == {} and net_interfaces(sysfs / "missing") == []


def test_counter_delta_over_the_interfaces_in_both_readings(sysfs):
    before = net_counters(sysfs)
    (sysfs / "eth0" / "statistics" / "tx_bytes").write_text(f"{1000 + 40 * MIB}\n")
    (sysfs / "eth0" / "statistics" / "rx_bytes").write_text(f"{2000 + 20 * MIB}\n")
    (sysfs / "ens9" / "statistics" / "tx_bytes").write_text("0\n")  # recreated: its counter went back
    fake_interface(sysfs, "eth2", tx=10**6, rx=10**6)  # came in between
    after = net_counters(sysfs)
    assert counter_delta(before, after) == (40 * MIB, 20 * MIB)
    assert counter_delta(after, after) == (0, 0)


def test_link_speed_is_the_slowest_reported_one(sysfs):
    assert link_speed_gbit(sysfs) == (0.1, "odd0")  # loop1's speed is a loopback's: left out
    (sysfs / "odd0" / "speed").unlink()
    assert link_speed_gbit(sysfs) == (1.0, "eth0")
    for name in ("eth0", "eth1"):
        (sysfs / name / "speed").write_text("-1\n")  # what a link without a known speed says
    assert link_speed_gbit(sysfs) is None


def test_link_floor_is_the_gradient_out_of_each_host_once():
    gradient = 40 * MIB
    # Two hosts: the gradient at link speed; four: 1.5 times it (2(n-1)/n); one host: nothing crosses.
    assert link_floor_s(gradient, 2, 1.0) == pytest.approx(40 * MIB * 8 / 1e9)
    assert link_floor_s(gradient, 4, 1.0) == pytest.approx(1.5 * 40 * MIB * 8 / 1e9)
    assert link_floor_s(gradient, 2, 10.0) == pytest.approx(40 * MIB * 8 / 1e10)
    assert link_floor_s(gradient, 1, 1.0) == 0.0
    with pytest.raises(ValueError, match="hosts"):
        link_floor_s(gradient, 0, 1.0)
    with pytest.raises(ValueError, match="speed"):
        link_floor_s(gradient, 2, 0.0)


def record(host, per_step, speed=(10.0, "eth0")):
    return {"host": host, "speed": speed, "per_step": per_step}


def test_summary_is_the_busiest_host_per_contender():
    records = [record("a", {"hpcnet": (40.0, 41.0), "ddp": (60.0, 59.0), "local": (0.1, 0.2)}), None,
               record("b", {"hpcnet": (42.0, 39.0), "ddp": (58.0, 61.0), "local": (0.3, 0.1)}, (1.0, "eth-b")), None]
    summary = link_summary(records)
    assert summary["hosts"] == 2 and summary["speed"] == (1.0, "eth-b")
    assert summary["per_contender"]["hpcnet"] == {"tx_bytes_per_step": 42.0, "rx_bytes_per_step": 41.0,
                                                  "tx_bytes_per_step_hosts": [40.0, 42.0],
                                                  "rx_bytes_per_step_hosts": [41.0, 39.0]}
    assert summary["per_contender"]["ddp"]["tx_bytes_per_step"] == 60.0


def test_summary_on_one_host_or_without_a_reading_has_no_figures():
    # Virtual nodes on one host read the same counters: one host, nothing crosses.
    one = link_summary([record("a", {"hpcnet": (5.0, 5.0)}), record("a", {"hpcnet": (7.0, 7.0)})])
    assert one["hosts"] == 1 and one["per_contender"] == {"hpcnet": None}
    gap = link_summary([record("a", {"hpcnet": (5.0, 5.0)}), record("b", {"hpcnet": None}, None)])
    assert gap["hosts"] == 2 and gap["per_contender"] == {"hpcnet": None} and gap["speed"] == (10.0, "eth0")


def test_host_record_takes_the_median_of_the_blocks():
    rec = host_link_record({"hpcnet": [(10.0, 1.0), (30.0, 3.0), (20.0, 2.0)], "ddp": []})
    assert rec["per_step"] == {"hpcnet": (20.0, 2.0), "ddp": None}
    assert isinstance(rec["host"], str) and rec["host"]


def model_result():
    profile = {"forward_backward_ms": 100.0, "optimizer_ms": 10.0}
    return {"contenders": {"hpcnet": {"profile": {**profile, "exposed_comm_ms": 400.0}},
                           "ddp-gloo": {"profile": {**profile, "forward_backward_ms": 700.0}},
                           "local": {"profile": profile}}}


def test_link_result_sets_bytes_against_ddp_and_exposed_comm_against_the_floor():
    gradient = 40 * MIB
    summary = link_summary([
        record("a", {"hpcnet": (40.0 * MIB, 40.0 * MIB), "ddp-gloo": (60.0 * MIB, 60.0 * MIB), "local": (0.0, 0.0)}),
        record("b", {"hpcnet": (40.0 * MIB, 40.0 * MIB), "ddp-gloo": (60.0 * MIB, 60.0 * MIB), "local": (0.0, 0.0)}),
    ])
    res = model_result()
    _link_result(res, gradient, "ddp-gloo", summary, argparse.Namespace(link_gbit=1.0))
    floor_ms = 40 * MIB * 8 / 1e9 * 1e3
    assert res["gradient_bytes"] == gradient
    assert res["link"] == {"hosts": 2, "gbit": 1.0, "gbit_source": "--link-gbit", "floor_ms": pytest.approx(floor_ms),
                           "floor_bytes_per_host": gradient}
    hp, ddp, local = (res["contenders"][n] for n in ("hpcnet", "ddp-gloo", "local"))
    assert hp["link_tx_bytes_per_step"] == 40 * MIB and hp["link_bytes_vs_ddp"] == pytest.approx(2 / 3)
    assert hp["exposed_comm_vs_link_floor"] == pytest.approx(400 / floor_ms) and not hp["exposed_comm_estimated"]
    # DDP waits inside backward: its exposed comm is its backward over local's, an estimate.
    assert ddp["exposed_comm_ms"] == 600.0 and ddp["exposed_comm_estimated"]
    assert ddp["link_bytes_vs_ddp"] == 1.0 and local["exposed_comm_vs_link_floor"] is None

    # Without --link-gbit: the slowest interface's reported speed; on one host: no floor and no bytes.
    res = model_result()
    _link_result(res, gradient, "ddp-gloo", summary, argparse.Namespace(link_gbit=None))
    assert res["link"]["gbit"] == 10.0 and res["link"]["gbit_source"] == "/sys/class/net/eth0/speed"
    res = model_result()
    alone = link_summary([record("a", {"hpcnet": (1.0, 1.0), "ddp-gloo": (1.0, 1.0), "local": (0.0, 0.0)})])
    _link_result(res, gradient, "ddp-gloo", alone, argparse.Namespace(link_gbit=1.0))
    assert res["link"]["floor_ms"] is None and res["link"]["floor_bytes_per_host"] is None
    assert all(c["link_tx_bytes_per_step"] is None and c["exposed_comm_vs_link_floor"] is None
               for c in res["contenders"].values())


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_link_gbit_must_be_positive(value):
    with pytest.raises(SystemExit) as exc:
        _parse_args(["--link-gbit", value])
    assert exc.value.code == 2
    assert _parse_args([]).link_gbit is None and _parse_args(["--link-gbit", "2.5"]).link_gbit == 2.5


def test_gather_link_agrees_on_every_rank(comm):
    # Every rank of this test shares one host: whoever reads, nothing crosses hosts, and every rank says so.
    blocks = {"hpcnet": [(100.0, 100.0)], "local": [(0.0, 0.0)]}
    summary = gather_link(comm, blocks if comm.Get_rank() % 2 == 0 else None)
    assert summary["hosts"] == 1 and summary["per_contender"] == {"hpcnet": None, "local": None}
    assert comm.allgather(summary) == [summary] * comm.Get_size()
