"""Host lists and leaving failed hosts out (pure): SLURM's compressed lists, mpirun's --host and hostfiles,
srun's --exclude, and which entry of such a list a failed host is.

``--exclude-failed-hosts`` (docs/fault-tolerance.md) needs an
allocation with room to spare: ``-np`` is kept.

The hard case is the last: a failure names a host as its ranks call it
(``gethostname()``), the launcher's list as the user wrote it (an address, an
InfiniBand alias ``node01-ib``, a fully qualified name).  ``entries_naming``
matches them by what the ranks reported at their start (their host's
addresses and the scheduler's name for it: ``RankPlace``), never by a guess.
Pure but ``resolve_all``, which asks the resolver.
"""

import ipaddress
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hpcnet.launch.command import (
    MPIRUN_HOSTFILES,
    MPIRUN_HOSTS,
    SRUN_EXCLUDE,
    find_option,
    launcher_kind,
    set_option,
)

RESOLVE_TIMEOUT_S = 5.0
"""How long the supervisor waits for the resolver to name the addresses of the launcher's host list, in all."""


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list (``node[01-03,07],gpu5``) as host names, in order."""
    hosts: list[str] = []
    for match in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = match.groups()
        if not ranges:
            hosts.append(prefix + (suffix or ""))
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if hi:
                hosts.extend(f"{prefix}{n:0{len(lo)}d}{suffix}" for n in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{lo}{suffix}")
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot read SLURM_TASKS_PER_NODE={text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def slurm_allocation(environ: dict[str, str]) -> list[tuple[str, int]] | None:
    """(host, slots) of the SLURM allocation, or None outside one."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_nodelist(nodelist)
    counts = expand_tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", "1"))
    if len(counts) != len(hosts):
        counts = [counts[0]] * len(hosts)
    return list(zip(hosts, counts))


def is_address(name: str) -> bool:
    """Whether ``name`` is an IP address, not a host name."""
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def same_host(a: str, b: str) -> bool:
    """Whether two host names name one host: equal, or the same short name (``n1`` and ``n1.cluster``); addresses
    only when equal (``10.0.0.1`` and ``10.0.0.2`` share no host)."""
    if a == b:
        return True
    return not is_address(a) and not is_address(b) and a.split(".")[0] == b.split(".")[0]


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank ran, as it reported at its start (``hpcnet.launch.stop.report_rank``)."""

    host: str
    """Its ``gethostname()``: how failures name its host."""
    addresses: tuple[str, ...] = ()
    """Its host's IPv4 addresses (``hpcnet.comm.netif.interfaces``)."""
    node: str = ""
    """The scheduler's name for its node (``SLURMD_NODENAME``); '' outside one."""


def entries_naming(host: str, entries: list[str] | None, places: Iterable[RankPlace],
                   resolve: Callable[[list[str]], dict[str, list[str]]]) -> tuple[list[str], str]:
    """The entries of the launcher's host list that are ``host`` (as a failure names it: its ranks' host name, or
    the launcher's own name for it), and how that is known; ``([], '')`` when none is.

    In order: an entry with one of its names (the host's, the scheduler's); one of the addresses its ranks
    reported; a name that ``resolve`` (names -> their addresses as the supervisor's host resolves them,
    ``resolve_all``) turns into one of those.  An address that ranks on two hosts reported (a ``docker0`` on every
    node) tells nothing and is not used.  ``entries`` None: the list is not known (srun outside an allocation):
    the scheduler's name for the host, else ``host`` itself.
    """
    places = list(places)
    mine = [p for p in places
            if same_host(p.host, host) or host in p.addresses or (p.node and same_host(p.node, host))]
    names = {host, *(p.host for p in mine), *(p.node for p in mine if p.node)}
    others = {a for p in places if p.host not in names for a in p.addresses}
    addresses = {a for p in mine for a in p.addresses} - others
    if entries is None:
        return [next((p.node for p in mine if p.node), host)], "the launcher's host list is not known"
    for found, how in (([e for e in entries if any(same_host(e, n) for n in names)], "by name"),
                       ([e for e in entries if e in addresses], "an address its ranks reported")):
        if found:
            return found, how
    names_left = [e for e in entries if not is_address(e)]
    resolved = resolve(names_left) if names_left and addresses else {}
    found = [e for e in names_left if addresses & set(resolved.get(e, []))]
    return (found, "resolves to an address its ranks reported") if found else ([], "")


def resolve_all(names: list[str], timeout_s: float) -> dict[str, list[str]]:
    """The IPv4 addresses of each of ``names`` ([] when it does not resolve), all asked at once, within ``timeout_s``
    in all (a resolver that does not answer must not hold the restart; its threads are left to end on their own)."""
    found: dict[str, list[str]] = {}

    def ask(name: str) -> None:
        try:
            infos = socket.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            infos = []
        found[name] = sorted({str(info[4][0]) for info in infos})

    threads = [threading.Thread(target=ask, args=(name,), daemon=True, name="hpcnet-resolve")
               for name in dict.fromkeys(names)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {n: list(found.get(n, [])) for n in names}


@dataclass(slots=True)
class Exclusion:
    """A command with failed hosts left out, and how."""

    command: list[str]
    hostfile: str | None = None
    """Contents of the filtered hostfile to write at ``hostfile_path``, if one is needed."""
    hostfile_path: str | None = None
    note: str = ""


def _not_in(hosts: list[str], listed: list[str]) -> str:
    """Those of ``hosts`` that no name of ``listed`` is, in words ('' when each is one)."""
    return ", ".join(h for h in hosts if not any(same_host(name, h) for name in listed))


def exclude_hosts(command: list[str], hosts: list[str], *, allocation: list[tuple[str, int]] | None = None,
                  read_file: Any = None, hostfile_path: str = "hostfile", kind: str = "") -> Exclusion:
    """Leave ``hosts`` out of a launcher command (pure but for ``read_file``, which reads a hostfile).

    srun: ``--exclude`` (merged with one already there).  mpirun: filter its
    ``--host`` list or its hostfile; without either, list the ``allocation``
    minus the failed hosts with ``--host``.  Anything else, or a host that is not
    in the list it would be left out of: unchanged, with a note saying why.
    """
    hosts = sorted(set(hosts))
    kind = launcher_kind(command, kind)
    if not hosts:
        return Exclusion(list(command), note="no host to exclude")
    if kind == "srun":
        if allocation and (missing := _not_in(hosts, [h for h, _ in allocation])):
            return Exclusion(list(command), note=f"cannot exclude {missing}: not a node of the SLURM allocation")
        found = find_option(command, SRUN_EXCLUDE)
        if found:
            merged = sorted(set(found[2].split(",")) | set(hosts))
            return Exclusion(set_option(command, found, ",".join(merged)), note=f"srun --exclude={','.join(merged)}")
        return Exclusion([command[0], f"--exclude={','.join(hosts)}", *command[1:]],
                         note=f"srun --exclude={','.join(hosts)}")
    if kind != "mpirun":
        return Exclusion(list(command), note=f"cannot exclude {', '.join(hosts)}: {command[0]!r} is not mpirun or srun")
    found = find_option(command, MPIRUN_HOSTS)
    if found:
        entries = [e for e in found[2].split(",") if e]
        if missing := _not_in(hosts, [e.split(":")[0] for e in entries]):
            return Exclusion(list(command), note=f"cannot exclude {missing}: not in {command[found[0]]} {found[2]}")
        kept = [e for e in entries if not any(same_host(e.split(":")[0], h) for h in hosts)]
        if not kept:
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        return Exclusion(set_option(command, found, ",".join(kept)), note=f"mpirun --host {','.join(kept)}")
    found = find_option(command, MPIRUN_HOSTFILES)
    if found:
        if read_file is None:
            return Exclusion(list(command), note="cannot read the hostfile")
        lines = read_file(found[2]).splitlines()
        listed = [ln.split()[0] for ln in lines if ln.split() and not ln.lstrip().startswith("#")]
        if missing := _not_in(hosts, listed):
            return Exclusion(list(command), note=f"cannot exclude {missing}: not in the hostfile {found[2]}")
        kept_lines = [ln for ln in lines
                      if not ln.split() or ln.lstrip().startswith("#")
                      or not any(same_host(ln.split()[0], h) for h in hosts)]
        if not any(ln.split() and not ln.lstrip().startswith("#") for ln in kept_lines):
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        return Exclusion(set_option(command, found, hostfile_path), hostfile="\n".join(kept_lines) + "\n",
                         hostfile_path=hostfile_path,
                         note=f"mpirun hostfile {hostfile_path} without {', '.join(hosts)}")
    if allocation:
        if missing := _not_in(hosts, [h for h, _ in allocation]):
            return Exclusion(list(command), note=f"cannot exclude {missing}: not a node of the SLURM allocation")
        kept_slots = [(h, n) for h, n in allocation if not any(same_host(h, x) for x in hosts)]
        if not kept_slots:
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        spec = ",".join(f"{h}:{n}" for h, n in kept_slots)
        return Exclusion([command[0], "--host", spec, *command[1:]], note=f"mpirun --host {spec}")
    return Exclusion(list(command), note=f"cannot exclude {', '.join(hosts)}: the mpirun command has no --host "
                                         "or --hostfile and there is no SLURM allocation to filter")
