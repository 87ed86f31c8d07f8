"""The one NIC lister, on fake /sys trees and on this machine."""

import pytest

from hpcnet.comm.netif import (
    Choice,
    IbPort,
    Interface,
    has_rdma_devices,
    ib_ports,
    interface_towards,
    interfaces,
    ipv4_address,
    ipv4_netmask,
    kind_of,
    matching,
    parse_patterns,
    preference,
    route_source,
)
from tests.helpers.comm import fake_net


def addresses(**table):
    return lambda name: table.get(name)


def test_kinds_from_a_fake_sys_tree(tmp_path):
    fake_net(tmp_path, "lo", operstate="unknown", link_type="772")
    fake_net(tmp_path, "eth0", speed=1000)
    fake_net(tmp_path, "ens1f0", speed=100000, rdma_device=True)  # RoCE
    fake_net(tmp_path, "ibp65s0", link_type="32", speed=200000)  # IPoIB, renamed: found by its link type
    fake_net(tmp_path, "hsn0", link_type="32")  # IPoIB, no speed reported
    fake_net(tmp_path, "docker0", speed=10000)
    found = interfaces(tmp_path, address_of=addresses(lo="127.0.0.1", eth0="10.0.0.1", ens1f0="10.1.0.1",
                                                      ibp65s0="10.2.0.1", hsn0="10.3.0.1", docker0="172.17.0.1"))
    assert [(i.name, i.kind, i.speed_mbps) for i in found] == [
        ("ibp65s0", "ipoib", 200000), ("ens1f0", "rdma", 100000), ("hsn0", "ipoib", -1),
        ("eth0", "ethernet", 1000), ("docker0", "virtual", 10000)]
    assert [i.infiniband for i in found] == [True, True, True, False, False]
    with_lo = interfaces(tmp_path, loopback=True, address_of=addresses(lo="127.0.0.1"))
    assert with_lo == [Interface("lo", "127.0.0.1", "loopback", -1)]


def test_down_or_addressless_interfaces_are_left_out(tmp_path):
    fake_net(tmp_path, "eth0", operstate="down", speed=1000)
    fake_net(tmp_path, "eth1", speed=1000)
    fake_net(tmp_path, "eth2", speed=1000)
    (tmp_path / "eth3").mkdir()  # no operstate: not an interface we can read
    assert [i.name for i in interfaces(tmp_path, address_of=addresses(eth0="10.0.0.1", eth2="10.0.0.3",
                                                                      eth3="10.0.0.4"))] == ["eth2"]
    assert interfaces(tmp_path / "missing") == []


def test_kind_of_and_preference():
    assert kind_of("lo", link_type="", rdma_device=False) == "loopback"
    assert kind_of("ib0", link_type="", rdma_device=False) == "ipoib"  # the name alone, as before
    assert kind_of("virbr0", link_type="1", rdma_device=False) == "virtual"
    assert kind_of("eno1", link_type="1", rdma_device=True) == "rdma"
    slow_ib = Interface("ib0", "", "ipoib", 10)
    fast_eth = Interface("eth0", "", "ethernet", 100000)
    bridge = Interface("br-1", "", "virtual", 10**6)
    assert sorted([bridge, fast_eth, slow_ib], key=preference) == [slow_ib, fast_eth, bridge]


@pytest.mark.parametrize("iface", [Interface("ib0", "10.0.0.1", "ipoib", 100000),
                                   Interface("eth0", "10.0.0.2", "ethernet", 1000),
                                   Interface("docker0", "172.17.0.1", "virtual", -1)])
def test_topology_record_round_trips(iface):
    record = iface.to_dict()
    assert record == {"name": iface.name, "address": iface.address, "speed_mbps": iface.speed_mbps,
                      "infiniband": iface.infiniband}  # hpcnet-topology/1, as before
    assert Interface.from_dict(record) == iface
    assert Interface.from_dict(Interface("e1", "a", "rdma", 1).to_dict()).infiniband


def test_ib_ports_from_sysfs(tmp_path):
    assert ib_ports(tmp_path / "missing") == []
    assert not has_rdma_devices(tmp_path / "missing") and has_rdma_devices(tmp_path)
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    assert ib_ports(tmp_path) == [IbPort(device="mlx5_0", port=1, state="ACTIVE", rate_gbps=200.0,
                                         link_layer="InfiniBand")]
    (tmp_path / "mlx5_1" / "ports" / "1").mkdir(parents=True)  # nothing readable: defaults
    assert ib_ports(tmp_path)[1] == IbPort(device="mlx5_1", port=1, state="", rate_gbps=0.0, link_layer="InfiniBand")


def test_this_machine():
    assert ipv4_address("lo") == "127.0.0.1" and ipv4_address("no-such-if0") is None
    found = interfaces()
    assert all(i.kind != "loopback" and i.address.count(".") == 3 for i in found)
    assert [i.kind for i in interfaces(loopback=True) if i.name == "lo"] == ["loopback"]


def _host(tmp_path, table, **links):
    """A fake host: interfaces ``name=speed`` with addresses from ``table`` (name -> address)."""
    for name, speed in links.items():
        fake_net(tmp_path, name, speed=speed)
    return interfaces(tmp_path, address_of=addresses(**table))


def test_dist_interface_names_lists_and_patterns(tmp_path):
    found = _host(tmp_path, {"eth0": "10.0.0.1", "ens1f0": "10.1.0.1", "ib0": "10.2.0.1"},
                  eth0=1000, ens1f0=1000, ib0=1000)
    assert parse_patterns(" eth*, ens* ,") == ["eth*", "ens*"]
    assert [i.name for i in matching(found, "")] == ["ib0", "ens1f0", "eth0"]  # empty: all, in preference order
    assert [i.name for i in matching(found, "eth*,ens*")] == ["ens1f0", "eth0"]
    assert [i.name for i in matching(found, "eth0")] == ["eth0"]
    assert matching(found, "eno*,hsn0") == []


def test_each_host_uses_its_own_interface_towards_rank_0(tmp_path):
    """Two hosts of different kinds: rank 0's has ethx0, the other ethy0 on the same subnet; a third reaches
    rank 0 only through a route (another subnet); names differ on each, and each finds its own."""
    masks = {"ethx0": "255.255.255.0", "ethy0": "255.255.255.0", "mgmt0": "255.255.0.0", "ens9": "255.255.255.0",
             "lo": "255.0.0.0"}
    host_x = _host(tmp_path / "x", {"ethx0": "10.78.0.1", "mgmt0": "192.168.0.1"}, ethx0=10000, mgmt0=100000)
    host_y = _host(tmp_path / "y", {"ethy0": "10.78.0.2", "mgmt0": "192.168.0.2"}, ethy0=1000, mgmt0=100000)
    host_z = _host(tmp_path / "z", {"ens9": "10.79.0.7", "mgmt0": "192.168.0.3"}, ens9=1000, mgmt0=100000)
    no_route = {"source_of": lambda address: None, "netmask_of": masks.get}
    assert interface_towards("10.78.0.1", found=host_x, **no_route) == Choice(host_x[1], "holds 10.78.0.1")
    assert interface_towards("10.78.0.1", found=host_y, **no_route) == Choice(host_y[1], "same subnet as 10.78.0.1")
    routed = interface_towards("10.78.0.1", found=host_z, netmask_of=masks.get,
                               source_of={"10.78.0.1": "10.79.0.7"}.get)
    assert routed == Choice(host_z[1], "route to 10.78.0.1")
    assert interface_towards("10.78.0.1", found=host_z, **no_route) is None  # nothing reaches it: gloo chooses
    # dist.interface narrows the choice on every host; a host without any of the named ones has no choice.
    assert interface_towards("10.78.0.1", "eth*", found=host_y, **no_route).interface.name == "ethy0"
    assert interface_towards("10.78.0.1", "eth*", found=host_z, **no_route) is None
    named = interface_towards("10.78.0.1", "eth*,ens*", found=host_z, **no_route)
    assert named == Choice(host_z[1], "named by dist.interface")  # named, reaching rank 0 or not: the user's word
    assert interface_towards("10.78.0.1", "mgmt0", found=host_y, **no_route).interface.name == "mgmt0"
    assert interface_towards("10.78.0.1", found=[], **no_route) is None


def test_route_source_and_netmask_on_this_machine():
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert ipv4_netmask("lo") == "255.0.0.0" and ipv4_netmask("no-such-if0") is None
    assert interface_towards("127.0.0.1").interface.name == "lo"
    for iface in interfaces():
        assert interface_towards(iface.address).interface == iface
