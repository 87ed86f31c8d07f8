"""bench train's link figures: the bytes a timed step sends out of each host and receives (the interfaces'
counters, one reader a host), and the link floor they are set against, at ``--link-gbit`` or the rate the
topology probe measures between the hosts (pure but for the reading and the gather, tested on one process)."""

import argparse
import os
import statistics
from typing import Any

from hpcnet.bench.common import link_floor_s, link_speed_gbit
from hpcnet.comm.measured import HostLinks, host_links
from hpcnet.comm.topology import probe

MEASURED = "measured by the topology probe: the slowest host's link"
"""The source of the floor's rate without ``--link-gbit`` (``link_floor``)."""


def link_host_key() -> str:
    """What tells hosts' links apart: the machine (its kernel's boot id) and the network namespace.  Ranks with one
    key read the same counters (virtual nodes of ``HPCNET_RANKS_PER_NODE`` on one host); the local cluster's hosts
    share a kernel but each has a namespace of its own."""
    from hpcnet.world import machine_id

    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return f"{machine_id()} {netns}"


def host_link_record(per_step: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """This host's part of ``gather_link``: per contender, the medians over its timed blocks of the bytes sent and
    received a step (None without a reading), the host's ``link_host_key`` and ``link_speed_gbit``."""
    return {"host": link_host_key(), "speed": link_speed_gbit(),
            "per_step": {name: (statistics.median(s for s, _ in blocks), statistics.median(r for _, r in blocks))
                         if blocks else None for name, blocks in per_step.items()}}


def link_summary(records: list[dict[str, Any] | None]) -> dict[str, Any]:
    """The hosts' ``host_link_record``s (None from ranks that do not read) as figures (pure): the number of hosts,
    the slowest interface speed any reports, and per contender the bytes a step sent and received out of the
    busiest host (max over hosts; also per host).  A contender's figures are None on one host (nothing crosses
    hosts) and where a host has no reading."""
    hosts: dict[str, dict[str, Any]] = {}
    for record in records:
        if record is not None:
            hosts.setdefault(record["host"], record)
    speeds = [r["speed"] for r in hosts.values() if r["speed"] is not None]
    per_contender: dict[str, dict[str, Any] | None] = {}
    for name in dict.fromkeys(name for r in hosts.values() for name in r["per_step"]):
        figures = [r["per_step"].get(name) for r in hosts.values()]
        if len(hosts) < 2 or any(f is None for f in figures):
            per_contender[name] = None
            continue
        per_contender[name] = {"tx_bytes_per_step": max(f[0] for f in figures),
                               "rx_bytes_per_step": max(f[1] for f in figures),
                               "tx_bytes_per_step_hosts": [f[0] for f in figures],
                               "rx_bytes_per_step_hosts": [f[1] for f in figures]}
    return {"hosts": len(hosts), "speed": min(speeds) if speeds else None, "per_contender": per_contender}


def gather_link(comm: Any, per_step: dict[str, list[tuple[float, float]]] | None) -> dict[str, Any]:
    """``link_summary`` of every host's link bytes (collective: every rank calls it; the ranks that read the
    counters pass their bytes a step per timed block and contender, the others None)."""
    return link_summary(comm.allgather(None if per_step is None else host_link_record(per_step)))


def exposed_comm(name: str, profile: dict[str, Any], local_profile: dict[str, Any] | None) -> tuple[float | None, bool]:
    """A contender's exposed communication in ms from the instrumented block, and whether it is an estimate: DDP
    waits inside backward, so its figure is its backward over ``local``'s; None without one."""
    if "exposed_comm_ms" in profile:
        return profile["exposed_comm_ms"], False
    if name.startswith("ddp") and profile and local_profile:
        return profile["forward_backward_ms"] - local_profile["forward_backward_ms"], True
    return None, False


def measured_link_gbit(hosts: list[HostLinks]) -> float | None:
    """The slowest host's link to the others as the topology probe measured it (``HostLinks.link_gbps``: the
    lower of its best one-way rates out and in), Gbit/s (pure).  Virtual nodes sharing a host have no link of
    their own and are left out; None where no host has a figure."""
    return min((h.link_gbps for h in hosts if not h.shared and h.link_gbps is not None), default=None)


def probe_link_gbit(comm: Any, world: Any) -> float | None:
    """Collective: ``measured_link_gbit`` of a topology probe of ``comm``; None (no probe) on one host."""
    if len(set(world.hostnames)) < 2:
        return None
    return measured_link_gbit(host_links(probe(comm, world, budget_s=2.0)))


def link_floor(gradient_bytes: int, hosts: int, *, given_gbit: float | None, measured_gbit: float | None,
               nominal: tuple[float, str] | None) -> dict[str, Any]:
    """A model's ``link`` record (pure): the rate of the floor and its source, ``--link-gbit`` (``given_gbit``)
    else the probe's ``measured_gbit``, the floor (``link_floor_s``) and the bytes it sends out of each host;
    None where there is one host or no rate.  The interfaces' ``nominal`` speed (``link_speed_gbit``) is recorded
    beside it and is never the floor's rate: a tc limit or a slower switch port does not show there."""
    gbit, source = (given_gbit, "--link-gbit") if given_gbit else (measured_gbit, MEASURED) if measured_gbit \
        else (None, None)
    floor_s = link_floor_s(gradient_bytes, hosts, gbit) if gbit and hosts > 1 else None
    return {"hosts": hosts, "gbit": gbit, "gbit_source": source,
            "floor_ms": None if floor_s is None else floor_s * 1e3,
            "floor_bytes_per_host": gradient_bytes * 2 * (hosts - 1) / hosts if hosts > 1 else None,
            "nominal_gbit": nominal[0] if nominal else None,
            "nominal_source": f"/sys/class/net/{nominal[1]}/speed" if nominal else None}


def _link_result(result: dict[str, Any], gradient_bytes: int, ddp: str, link: dict[str, Any],
                 args: argparse.Namespace, measured_gbit: float | None = None) -> None:
    """Add the link figures (``gather_link``'s ``link``, ``link_floor`` at ``--link-gbit`` or the probe's
    ``measured_gbit``) to a model's JSON record ``result``."""
    result["gradient_bytes"] = gradient_bytes
    result["link"] = link_floor(gradient_bytes, link["hosts"], given_gbit=args.link_gbit,
                                measured_gbit=measured_gbit, nominal=link["speed"])
    floor_ms = result["link"]["floor_ms"]
    per = link["per_contender"]
    ddp_sent = (per.get(ddp) or {}).get("tx_bytes_per_step")
    local_profile = result["contenders"].get("local", {}).get("profile")
    for name, c in result["contenders"].items():
        figures = per.get(name) or {}
        exposed, estimated = exposed_comm(name, c["profile"], local_profile)
        sent = figures.get("tx_bytes_per_step")
        c.update({
            "link_tx_bytes_per_step": sent,
            "link_rx_bytes_per_step": figures.get("rx_bytes_per_step"),
            "link_tx_bytes_per_step_hosts": figures.get("tx_bytes_per_step_hosts"),
            "link_rx_bytes_per_step_hosts": figures.get("rx_bytes_per_step_hosts"),
            "link_bytes_vs_ddp": sent / ddp_sent if sent is not None and ddp_sent else None,
            "exposed_comm_ms": exposed, "exposed_comm_estimated": estimated,
            "exposed_comm_vs_link_floor": exposed / floor_ms if exposed is not None and floor_ms else None,
        })
