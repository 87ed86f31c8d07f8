"""torch.distributed bootstrapped from MPI: address choice, store, collectives."""

import dataclasses
import ipaddress
import json
import logging
import os
import re
import socket

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcnet.agree import is_agreed
from hpcnet.comm import bootstrap
from hpcnet.comm.bootstrap import choose_address, host_interfaces, init_data_plane
from hpcnet.comm.netif import Choice, Interface, interfaces, matching
from hpcnet.errors import UsageError, exit_code_of
from hpcnet.world import discover
from tests.helpers.comm import fake_net, hostnames, listening_sockets
from tests.helpers.launch import PROGRAMS


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def test_listening_sockets_are_read_right():
    with socket.create_server(("127.0.0.1", 0)) as a, socket.create_server(("::", 0), family=socket.AF_INET6) as b:
        found = set(listening_sockets().values())
        assert ("127.0.0.1", a.getsockname()[1]) in found and ("::", b.getsockname()[1]) in found
    assert is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1") and not is_loopback("0.0.0.0")


def test_interfaces_are_usable():
    for iface in interfaces():
        assert iface.name != "lo" and iface.address.count(".") == 3


def test_the_backend_is_decided_before_the_bootstrap():
    """'auto' is resolved once, by the route (hpcnet.comm.route), not again here."""
    world = discover(MPI.COMM_SELF)
    for backend, device in (("auto", "cpu"), ("mpi", "cpu"), ("nccl", "cpu")):
        with pytest.raises(ValueError, match=f"backend '{backend}' on a cpu device"):
            init_data_plane(MPI.COMM_SELF, world, backend=backend, device=torch.device(device), timeout_s=10)


@pytest.mark.mpi
def test_the_rendezvous_prefers_ipoib_from_the_one_lister(comm, tmp_path, monkeypatch):
    """Rank 0's candidates are netif's, best first: an IPoIB interface (by link type) before Ethernet."""
    if len(set(hostnames(comm))) > 1:
        pytest.skip("fakes rank 0's interfaces with loopback addresses, which the other hosts cannot reach")
    fake_net(tmp_path, "eth0", speed=100000)
    fake_net(tmp_path, "ibp65s0", link_type="32", speed=1000)
    table = {"eth0": "127.0.0.3", "ibp65s0": "127.0.0.2"}  # loopback addresses: reachable from every rank
    monkeypatch.setattr(bootstrap, "interfaces", lambda: interfaces(tmp_path, address_of=table.get))
    nodes = discover(comm, environ={"HPCNET_RANKS_PER_NODE": "1"})  # a node per rank: the multi-node path
    expected = ("127.0.0.2", "ibp65s0") if comm.Get_size() > 1 else ("127.0.0.1", "lo")
    assert choose_address(comm, nodes) == expected
    assert choose_address(comm, nodes, interface="eth0") == ("127.0.0.3", "eth0")
    # A list of patterns, in preference order (named: used on one node too)
    assert choose_address(comm, nodes, interface="ib*,eth*") == ("127.0.0.2", "ibp65s0")
    assert choose_address(comm, nodes, prefer="eth0") == (("127.0.0.3", "eth0") if comm.Get_size() > 1 else
                                                          ("127.0.0.1", "lo"))  # the probe's advice first
    with pytest.raises(UsageError, match="dist.interface='ib9': rank 0 .* has no interface it names"):
        choose_address(comm, nodes, interface="ib9")


def _hosts(world, per_host=1):
    """``world`` as if every ``per_host`` ranks were a host of their own, named host<i>."""
    names = tuple(f"host{r // per_host}" for r in range(world.size))
    return dataclasses.replace(world, hostname=names[world.rank], hostnames=names,
                               num_nodes=len(set(names)), node_index=world.rank // per_host)


@pytest.mark.mpi
def test_each_host_chooses_its_own_interface_and_rank_0_logs_one_line_per_host(comm, monkeypatch, caplog):
    """Hosts whose interfaces have different names (ethx0, ethy0, ...): each rank gets its own host's interface
    towards rank 0's address, not rank 0's name."""
    rank = comm.Get_rank()
    world = _hosts(discover(comm))
    mine = Interface(f"eth{'xyzw'[rank % 4]}{rank}", f"127.0.0.{rank + 2}", "ethernet", 1000)
    monkeypatch.setattr(bootstrap, "interfaces", lambda loopback=False: [mine])
    monkeypatch.setattr(bootstrap, "interface_towards",
                        lambda address, spec="": Choice(mine, "same subnet as " + address) if matching([mine], spec)
                        else None)
    with caplog.at_level(logging.INFO, logger="hpcnet.comm.bootstrap"):
        assert host_interfaces(comm, world, "127.0.0.2") == mine
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("network interface on")]
    if rank == 0:
        assert lines == [f"network interface on host{r} (rank {r}): eth{'xyzw'[r % 4]}{r} 127.0.0.{r + 2} "
                         f"(same subnet as 127.0.0.2)" for r in range(comm.Get_size())]
    else:
        assert lines == []
    assert host_interfaces(comm, world, "127.0.0.2", "eth*") == mine
    # A name only rank 0's host has: every other host lacks it, an error that names them, on every rank.
    if comm.Get_size() > 1:
        with pytest.raises(UsageError, match=r"dist.interface='ethx0': host host1 \(rank 1\) has none of them; "
                                             r"its interfaces: ethy1") as raised:
            host_interfaces(comm, world, "127.0.0.2", "ethx0")
        assert is_agreed(raised.value) and exit_code_of(raised.value) == 2
    else:
        assert host_interfaces(comm, world, "127.0.0.2", "ethx0") == mine


@pytest.mark.mpi
def test_data_plane_allreduce(data_plane, comm):
    assert dist.is_initialized() and dist.get_world_size() == comm.Get_size()
    assert dist.get_rank() == comm.Get_rank()
    t = torch.full((1000,), float(comm.Get_rank() + 1))
    dist.all_reduce(t)
    n = comm.Get_size()
    assert torch.all(t == n * (n + 1) / 2)
    # every rank agrees on the rendezvous that rank 0 chose; one host: loopback, several: not loopback
    assert comm.allgather((data_plane.address, data_plane.port)) == [(data_plane.address, data_plane.port)] * n
    one_host = len(set(hostnames(comm))) == 1
    assert (data_plane.address == "127.0.0.1") == one_host, data_plane.address
    if comm.Get_rank() == 0:  # the store listens there, and there only
        ports = [address for address, port in listening_sockets().values() if port == data_plane.port]
        assert ports == [data_plane.address]


def _opened(stdout: str) -> dict[int, list[str]]:
    """Per rank, the addresses the data plane opened listening sockets on."""
    return dict(json.loads(m) for m in re.findall(r"OPENED (\[\d+, \[[^\]]*\]\])", stdout))


@pytest.mark.launch
def test_one_node_listens_on_loopback_only(launch, tmp_path):
    """The rendezvous store (unauthenticated) and gloo's sockets are not reachable from other hosts."""
    script = PROGRAMS / "bootstrap_listeners.py"
    out = launch(2, str(script), module=None, timeout=120)
    assert out.returncode == 0, out.stderr
    opened = _opened(out.stdout)
    assert sorted(opened) == [0, 1] and opened[0], out.stdout  # rank 0 at least has the store
    for rank, addresses in opened.items():
        assert all(is_loopback(a) for a in addresses), (rank, addresses)


@pytest.mark.launch
def test_bootstrap_across_virtual_nodes_and_master_addr(launch, tmp_path):
    """Virtual nodes force the multi-node path: an interface every rank can reach."""
    script = PROGRAMS / "bootstrap_listeners.py"
    out = launch(3, str(script), module=None, env={"HPCNET_RANKS_PER_NODE": "2"}, timeout=120)
    assert out.returncode == 0, out.stderr
    # ranks' output lines may interleave: pick the records out of the stream
    lines = sorted(m.split() for m in re.findall(r"RESULT \d+ \d+ \S+ \S+ [\d.]+(?=RESULT|\s|$)", out.stdout))
    assert len(lines) == 3
    for _, _rank, nodes, address, iface, value in lines:
        assert nodes == "2" and float(value) == 6.0
        # two virtual nodes: a real interface was tested for reachability, not loopback
        assert (address, iface) == (lines[0][3], lines[0][4]) and iface != "lo"
    # the store (and gloo) listen on the chosen address, not on every interface (gloo stays on
    # loopback when this process's GLOO_SOCKET_IFNAME, from an earlier one-node plane, is inherited)
    opened = [a for addresses in _opened(out.stdout).values() for a in addresses]
    assert lines[0][3] in opened and all(a == lines[0][3] or is_loopback(a) for a in opened), out.stdout
    out = launch(2, str(script), module=None, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"},
                 timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("RESULT") == 2 and out.stdout.count(" 127.0.0.1 ") == 2


def test_what_the_data_plane_set_stays_out_of_the_jobs_this_process_starts(monkeypatch):
    """An in-process plane on one host sets GLOO_SOCKET_IFNAME=lo: a job this process starts on several hosts must
    not inherit it (its gloo would listen on loopback on every host); a value set before is the user's and kept."""
    from hpcnet.comm.bootstrap import SET_ENV, _set_default_env, unset_own_env
    from tests.helpers.launch import clean_env

    monkeypatch.delenv("HPCNET_TEST_IFNAME", raising=False)
    monkeypatch.setenv("HPCNET_TEST_USERS", "eth9")
    _set_default_env("HPCNET_TEST_IFNAME", "lo")
    _set_default_env("HPCNET_TEST_USERS", "lo")
    assert os.environ["HPCNET_TEST_IFNAME"] == "lo" and SET_ENV["HPCNET_TEST_IFNAME"] == "lo"
    env = clean_env()
    assert "HPCNET_TEST_IFNAME" not in env and env["HPCNET_TEST_USERS"] == "eth9"
    unset_own_env()
    assert "HPCNET_TEST_IFNAME" not in os.environ and os.environ["HPCNET_TEST_USERS"] == "eth9" and not SET_ENV
