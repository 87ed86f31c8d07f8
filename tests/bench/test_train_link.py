"""bench train's link figures: interface counters from a sysfs tree, the link floor, the per-host summary (pure),
and ``gather_link`` under MPI at any size."""

import argparse

import pytest

from hpcnet.bench.common import counter_delta, link_floor_s, link_speed_gbit, net_counters, net_interfaces
from hpcnet.bench.train import _parse_args
from hpcnet.bench.train_link import (
    MEASURED,
    _link_result,
    gather_link,
    host_link_record,
    link_floor,
    link_summary,
    measured_link_gbit,
)
from hpcnet.bench.train_report import _describe_link
from hpcnet.comm.measured import HostLinks

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
                           "floor_bytes_per_host": gradient, "nominal_gbit": 10.0,
                           "nominal_source": "/sys/class/net/eth0/speed"}
    hp, ddp, local = (res["contenders"][n] for n in ("hpcnet", "ddp-gloo", "local"))
    assert hp["link_tx_bytes_per_step"] == 40 * MIB and hp["link_bytes_vs_ddp"] == pytest.approx(2 / 3)
    assert hp["exposed_comm_vs_link_floor"] == pytest.approx(400 / floor_ms) and not hp["exposed_comm_estimated"]
    # DDP waits inside backward: its exposed comm is its backward over local's, an estimate.
    assert ddp["exposed_comm_ms"] == 600.0 and ddp["exposed_comm_estimated"]
    assert ddp["link_bytes_vs_ddp"] == 1.0 and local["exposed_comm_vs_link_floor"] is None

    # Without --link-gbit: the probe's measured rate, not the interfaces' nominal 10 Gbit/s; on one host: no floor
    # and no bytes.
    res = model_result()
    _link_result(res, gradient, "ddp-gloo", summary, argparse.Namespace(link_gbit=None), measured_gbit=0.94)
    assert res["link"]["gbit"] == 0.94 and res["link"]["gbit_source"] == MEASURED
    assert res["contenders"]["hpcnet"]["exposed_comm_vs_link_floor"] == pytest.approx(400 / (floor_ms / 0.94))
    res = model_result()
    alone = link_summary([record("a", {"hpcnet": (1.0, 1.0), "ddp-gloo": (1.0, 1.0), "local": (0.0, 0.0)})])
    _link_result(res, gradient, "ddp-gloo", alone, argparse.Namespace(link_gbit=1.0))
    assert res["link"]["floor_ms"] is None and res["link"]["floor_bytes_per_host"] is None
    assert all(c["link_tx_bytes_per_step"] is None and c["exposed_comm_vs_link_floor"] is None
               for c in res["contenders"].values())


def test_the_floor_is_at_the_measured_rate_not_the_interface_s_nominal_speed():
    """A veth shaped to 1 Gbit/s says 10 in sysfs; the probe measures about 0.94: the floor is 10.6 times the
    nominal one, and exposed/floor reads 0.94 where it read 9.39."""
    gradient = 40 * MIB
    link = link_floor(gradient, 2, given_gbit=None, measured_gbit=0.94, nominal=(10.0, "eth0"))
    floor_ms = 40 * MIB * 8 / 0.94e9 * 1e3
    assert link == {"hosts": 2, "gbit": 0.94, "gbit_source": MEASURED, "floor_ms": pytest.approx(floor_ms),
                    "floor_bytes_per_host": gradient, "nominal_gbit": 10.0,
                    "nominal_source": "/sys/class/net/eth0/speed"}
    exposed_ms = 9.39 * link_floor(gradient, 2, given_gbit=10.0, measured_gbit=None, nominal=None)["floor_ms"]
    assert exposed_ms / link["floor_ms"] == pytest.approx(0.94 * 9.39 / 10)
    # --link-gbit says what the link is; with no rate at all, no floor: a nominal speed is not one.
    given = link_floor(gradient, 4, given_gbit=1.0, measured_gbit=0.94, nominal=(10.0, "eth0"))
    assert (given["gbit"], given["gbit_source"]) == (1.0, "--link-gbit")
    assert given["floor_ms"] == pytest.approx(1.5 * 40 * MIB * 8 / 1e9 * 1e3)
    unknown = link_floor(gradient, 2, given_gbit=None, measured_gbit=None, nominal=(10.0, "eth0"))
    assert unknown["gbit"] is None and unknown["floor_ms"] is None and unknown["nominal_gbit"] == 10.0
    alone = link_floor(gradient, 1, given_gbit=1.0, measured_gbit=None, nominal=None)
    assert alone["floor_ms"] is None and alone["floor_bytes_per_host"] is None and alone["nominal_gbit"] is None


def host(node, send, receive, shared=False):
    return HostLinks(node=node, host=f"h{node}", name=f"h{node}", shared=shared, ranks=[node], interface=None,
                     intra_latency_us=None, intra_bandwidth_gbps=None, inter_latency_us=30.0,
                     inter_bandwidth_gbps=None, send_gbps=send, receive_gbps=receive, peers=1)


def test_the_measured_rate_is_the_slowest_host_s_link():
    assert measured_link_gbit([host(0, 0.95, 0.94), host(1, 0.97, 0.96)]) == 0.94
    # Virtual nodes sharing a host have no link of their own; a host without a figure says nothing.
    assert measured_link_gbit([host(0, 0.9, 0.9), host(1, 20.0, 20.0, shared=True), host(2, None, 1.0)]) == 0.9
    assert measured_link_gbit([host(0, None, None)]) is None and measured_link_gbit([]) is None


def test_the_line_above_the_table_names_the_rate_s_source_and_the_nominal_speed():
    res = {"link": link_floor(40 * MIB, 2, given_gbit=None, measured_gbit=0.94, nominal=(10.0, "eth0"))}
    line = _describe_link(res)
    assert line.startswith(f"link: 2 hosts, 0.94 Gbit/s ({MEASURED}); nominal 10 Gbit/s (/sys/class/net/eth0/speed); "
                           "floor: an exact hierarchical all-reduce sends 40.0 MiB out of each host a step, 357"), line
    res = {"link": link_floor(40 * MIB, 2, given_gbit=None, measured_gbit=None, nominal=(10.0, "eth0"))}
    assert _describe_link(res) == ("link: 2 hosts, rate not measured (--link-gbit G for the floor); nominal 10 Gbit/s "
                                   "(/sys/class/net/eth0/speed)")


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
