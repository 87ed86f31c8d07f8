"""Host lists and leaving failed hosts out (pure): SLURM's compressed lists, mpirun's --host and hostfiles,
srun's --exclude.

``--exclude-failed-hosts`` (docs/fault-tolerance.md) needs an
allocation with room to spare: ``-np`` is kept.
"""

import re
from dataclasses import dataclass
from typing import Any

from hpcnet.launch.command import launcher_kind

_MPIRUN_HOST_OPTS = ("--host", "-host", "-H", "--H")
MPIRUN_HOSTFILE_OPTIONS = ("--hostfile", "-hostfile", "--machinefile", "-machinefile", "--default-hostfile")


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


def _same_host(a: str, b: str) -> bool:
    return a == b or a.split(".")[0] == b.split(".")[0]


def _option_value(command: list[str], names: tuple[str, ...]) -> tuple[int, int, str] | None:
    """(index of the option, index of its value, value) of the first of ``names`` (``--opt v`` or ``--opt=v``)."""
    for i, arg in enumerate(command):
        for name in names:
            if arg == name and i + 1 < len(command):
                return i, i + 1, command[i + 1]
            if arg.startswith(name + "="):
                return i, i, arg.split("=", 1)[1]
    return None


def _set_value(command: list[str], where: tuple[int, int, str], value: str) -> list[str]:
    i, j, _ = where
    out = list(command)
    out[j] = value if i != j else f"{command[i].split('=', 1)[0]}={value}"
    return out


@dataclass(slots=True)
class Exclusion:
    """A command with failed hosts left out, and how."""

    command: list[str]
    hostfile: str | None = None
    """Contents of the filtered hostfile to write at ``hostfile_path``, if one is needed."""
    hostfile_path: str | None = None
    note: str = ""


def exclude_hosts(command: list[str], hosts: list[str], *, allocation: list[tuple[str, int]] | None = None,
                  read_file: Any = None, hostfile_path: str = "hostfile", kind: str = "") -> Exclusion:
    """Leave ``hosts`` out of a launcher command (pure but for ``read_file``, which reads a hostfile).

    srun: ``--exclude`` (merged with one already there).  mpirun: filter its
    ``--host`` list or its hostfile; without either, list the ``allocation``
    minus the failed hosts with ``--host``.  Anything else: unchanged, with a
    note saying why.
    """
    hosts = sorted(set(hosts))
    kind = launcher_kind(command, kind)
    if not hosts:
        return Exclusion(list(command), note="no host to exclude")
    if kind == "srun":
        found = _option_value(command, ("--exclude", "-x"))
        if found:
            merged = sorted(set(found[2].split(",")) | set(hosts))
            return Exclusion(_set_value(command, found, ",".join(merged)), note=f"srun --exclude={','.join(merged)}")
        return Exclusion([command[0], f"--exclude={','.join(hosts)}", *command[1:]],
                         note=f"srun --exclude={','.join(hosts)}")
    if kind != "mpirun":
        return Exclusion(list(command), note=f"cannot exclude {', '.join(hosts)}: {command[0]!r} is not mpirun or srun")
    found = _option_value(command, _MPIRUN_HOST_OPTS)
    if found:
        entries = [e for e in found[2].split(",") if e]
        kept = [e for e in entries if not any(_same_host(e.split(":")[0], h) for h in hosts)]
        if not kept:
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        return Exclusion(_set_value(command, found, ",".join(kept)), note=f"mpirun --host {','.join(kept)}")
    found = _option_value(command, MPIRUN_HOSTFILE_OPTIONS)
    if found:
        if read_file is None:
            return Exclusion(list(command), note="cannot read the hostfile")
        lines = read_file(found[2]).splitlines()
        kept_lines = [ln for ln in lines
                      if not ln.split() or ln.lstrip().startswith("#")
                      or not any(_same_host(ln.split()[0], h) for h in hosts)]
        if not any(ln.split() and not ln.lstrip().startswith("#") for ln in kept_lines):
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        return Exclusion(_set_value(command, found, hostfile_path), hostfile="\n".join(kept_lines) + "\n",
                         hostfile_path=hostfile_path,
                         note=f"mpirun hostfile {hostfile_path} without {', '.join(hosts)}")
    if allocation:
        kept_slots = [(h, n) for h, n in allocation if not any(_same_host(h, x) for x in hosts)]
        if not kept_slots:
            return Exclusion(list(command), note=f"not excluding {', '.join(hosts)}: no host would be left")
        spec = ",".join(f"{h}:{n}" for h, n in kept_slots)
        return Exclusion([command[0], "--host", spec, *command[1:]], note=f"mpirun --host {spec}")
    return Exclusion(list(command), note=f"cannot exclude {', '.join(hosts)}: the mpirun command has no --host "
                                         "or --hostfile and there is no SLURM allocation to filter")
