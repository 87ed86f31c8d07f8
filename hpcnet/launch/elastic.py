"""Elastic shrink and grow (``hpcnet.launch --exclude-failed-hosts --min-ranks N``; docs/fault-tolerance.md).

Shrink: once a lost host is left out (``hpcnet.launch.hosts.exclude_hosts``), the next attempt runs as many ranks
as the surviving hosts hold (``host_slots``), never more than the user asked for and never fewer than
``--min-ranks`` (``fit_ranks``, which rewrites mpirun's ``-np`` or srun's ``-n``).  Grow: while hosts are left out,
a background thread (``HostWatch``) asks the launcher every few seconds whether one of them answers again
(``probe_command``: the launcher's own way of reaching a host, under a timeout); when one does, the supervisor asks
the running attempt to save and stop and restarts it with the host back.  The same probe decides which host a
failure lost when the failure names hosts on both sides of a partition (``unreachable``).

Everything here is pure but ``run_probe``, ``probe_hosts`` and ``HostWatch``, which run probe commands.
"""

import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcnet.launch.command import (
    LAUNCHER_KINDS,
    MPIRUN_HOSTFILES,
    MPIRUN_HOSTS,
    MPIRUN_PLACEMENT,
    CommandError,
    find_option,
    launcher_end,
    launcher_kind,
    parse_host_list,
    parse_hostfile,
    ranks_of,
    set_ranks,
)
from hpcnet.launch.hosts import RankPlace, entries_naming, exclude_hosts, same_host

PROBE_EVERY_S = 5.0
"""Default of ``--probe-every-s``: how often an excluded host is asked whether it answers again."""
PROBE_TIMEOUT_S = 10.0
"""Default of ``--probe-timeout-s``: how long one probe may take (a host that does not answer makes the launcher
wait for its daemon for ever: the probe is killed then, and the host counts as unreachable)."""
HOST_PLACEHOLDER = "{host}"


class ElasticError(CommandError):
    """The job cannot run elastically as asked (a message for the user, naming the option or host)."""


def host_slots(command: list[str], *, allocation: list[tuple[str, int]] | None = None, excluded: Iterable[str] = (),
               read_file: Callable[[str], str] | None = None, kind: str = "") -> list[tuple[str, int]] | None:
    """The (host, slots) a launcher command may place ranks on, ``excluded`` hosts left out; None when unknown.

    mpirun: its ``--host`` list or hostfile, else the SLURM ``allocation``.  srun: the ``allocation``.
    """
    kind = launcher_kind(command, kind)
    found: list[tuple[str, int]] | None = None
    if kind == "mpirun":
        if (hosts := find_option(command, MPIRUN_HOSTS)) is not None:
            found = parse_host_list(hosts[2])
        elif (hostfile := find_option(command, MPIRUN_HOSTFILES)) is not None and read_file is not None:
            found = parse_hostfile(read_file(hostfile[2]))
    if found is None and kind in ("mpirun", "srun") and allocation:
        found = list(allocation)
    if found is None:
        return None
    gone = list(excluded)
    return [(h, n) for h, n in found if not any(same_host(h, x) for x in gone)]


def host_names(command: list[str], *, allocation: list[tuple[str, int]] | None,
               read_file: Callable[[str], str], kind: str = "") -> list[str] | None:
    """The hosts of the launcher's list (``host_slots``); None when it has none, or cannot be read
    (``exclude_hosts`` then says what is wrong with it)."""
    try:
        slots = host_slots(command, allocation=allocation, read_file=read_file, kind=kind)
    except (CommandError, OSError):
        return None
    return None if slots is None else [h for h, _ in slots]


@dataclass(slots=True)
class Fit:
    """The ranks of the next attempt on the hosts that are left."""

    command: list[str]
    ranks_before: int
    ranks_after: int
    hosts: list[str] = field(default_factory=list)

    def line(self, excluded: list[str]) -> str:
        """What the supervisor says about it, on one line."""
        left = ", ".join(self.hosts)
        if self.ranks_after == self.ranks_before:
            return f"{self.ranks_after} rank(s) on {left} (without {', '.join(excluded)})"
        return (f"shrinking: {self.ranks_before} -> {self.ranks_after} rank(s) on {left} (without "
                f"{', '.join(excluded)}); the run resumes at the smaller world size")


def fit_ranks(command: list[str], wanted: int, slots: list[tuple[str, int]], min_ranks: int, kind: str = "") -> Fit:
    """The next attempt's command on ``slots`` (the hosts left): ``wanted`` ranks (the user's), or as many as the
    slots hold when they hold fewer, never below ``min_ranks`` (``ElasticError`` then)."""
    total = sum(n for _, n in slots)
    ranks = min(wanted, total)
    hosts = [h for h, _ in slots]
    if ranks < min_ranks:
        raise ElasticError(f"the hosts left ({', '.join(hosts) or 'none'}) hold {total} slot(s), fewer than "
                           f"--min-ranks {min_ranks}")
    return Fit(set_ranks(command, ranks, nodes=len(slots), kind=kind) if ranks != wanted else list(command), wanted,
               ranks, hosts)


def known_kind(command: list[str], kind: str, option: str, why: str) -> str:
    """The launcher's kind (``hpcnet.launch.command.launcher_kind``), or ``ElasticError`` saying that ``option``
    needs one (``why``) and how to declare it."""
    kind = launcher_kind(command, kind)
    if kind not in LAUNCHER_KINDS:
        raise ElasticError(f"{option} needs an mpirun or srun command ({why}): if {Path(command[0]).name!r} wraps "
                           "one and takes its options, say which with --launcher-kind mpirun|srun")
    return kind


def elastic_ranks(command: list[str], min_ranks: int, *, allocation: list[tuple[str, int]] | None = None,
                  read_file: Callable[[str], str] | None = None, kind: str = "") -> int:
    """The ranks ``command`` runs at its full size (what a grow goes back to), checked against ``--min-ranks``;
    ``ElasticError`` (a usage error) when the command cannot run elastically."""
    kind = known_kind(command, kind, "--min-ranks", "it rewrites -np or -n")
    try:
        ranks = ranks_of(command, kind)
        slots = host_slots(command, allocation=allocation, read_file=read_file, kind=kind)
    except (CommandError, OSError) as exc:
        raise ElasticError(f"--min-ranks: {exc}") from None
    if ranks is None:
        if slots is None:
            raise ElasticError("--min-ranks: the command names no number of ranks (-np, -n) and no hosts with slots "
                               "(--host, --hostfile, a SLURM allocation): cannot tell how many ranks it runs")
        ranks = sum(n for _, n in slots)
    if min_ranks > ranks:
        raise ElasticError(f"--min-ranks {min_ranks} is more than the {ranks} rank(s) the command runs")
    return ranks


@dataclass(slots=True)
class Placement:
    """The next attempts' command: the user's without the excluded hosts, and how (``place``)."""

    command: list[str]
    excluded: list[str]
    note: str
    """What the supervisor says, on one line."""
    hostfile: str | None = None
    """The filtered hostfile to write at ``hostfile_path`` first, if one is needed."""
    hostfile_path: str | None = None
    error: str | None = None
    """Why no attempt may follow: the command cannot leave the hosts out (``exclude_hosts`` says why), so the next
    attempt would run there again; or the hosts left hold fewer than ``min_ranks`` slots."""


def place(command: list[str], excluded: list[str], *, allocation: list[tuple[str, int]] | None,
          min_ranks: int | None, ranks: int, ranks_now: int | None, read_file: Callable[[str], str],
          hostfile_path: str, kind: str = "") -> Placement:
    """The user's ``command`` without the ``excluded`` hosts (pure but for ``read_file``, which reads a hostfile).

    ``min_ranks`` None: ``-np`` is kept (``exclude_hosts`` alone).  Else (elastic) the ranks are what the hosts left
    hold, at most ``ranks`` (the command's full size), at least ``min_ranks`` (``error`` otherwise); ``ranks_now``,
    the current attempt's, is what the note compares with.  No host excluded: the user's command as it is.
    """
    if not excluded:
        change = (f" ({ranks_now} -> {ranks} ranks); the run resumes at the full world size"
                  if min_ranks is not None and ranks_now not in (None, ranks) else "")
        return Placement(list(command), [], f"every host is back: {ranks} rank(s) on the full host list{change}")
    exclusion = exclude_hosts(command, excluded, allocation=allocation, read_file=read_file,
                              hostfile_path=hostfile_path, kind=kind)
    if exclusion.command == command:
        return Placement(list(command), list(excluded), "",
                         error=f"{exclusion.note}: not starting another attempt that would run there again")
    placed = Placement(exclusion.command, list(excluded), f"excluding {', '.join(excluded)}: {exclusion.note}",
                       hostfile=exclusion.hostfile, hostfile_path=exclusion.hostfile_path)
    if min_ranks is None:
        return placed

    def read(name: str) -> str:
        if name == hostfile_path and exclusion.hostfile is not None:
            return exclusion.hostfile
        return read_file(name)

    slots = host_slots(exclusion.command, allocation=allocation, excluded=excluded, read_file=read, kind=kind)
    if slots is None:
        placed.note += "; cannot tell how many slots the hosts left hold: the rank count is kept"
        return placed
    try:
        fit = fit_ranks(exclusion.command, ranks, slots, min_ranks, kind)
    except ElasticError as exc:
        return Placement(list(command), list(excluded), "", error=f"cannot run without {', '.join(excluded)}: {exc}")
    placed.command = fit.command
    placed.note += f"; {fit.line(excluded)}"
    if ranks_now not in (None, fit.ranks_after, ranks):  # a host back, others still out
        placed.note += f" (from {ranks_now} rank(s) now: {ranks_now} -> {fit.ranks_after})"
    return placed


def probe_command(command: list[str], host: str, template: str | None = None, kind: str = "") -> list[str] | None:
    """A command that succeeds when the launcher of ``command`` can start a process on ``host``; None when there is
    no way to build one (a launcher other than mpirun or srun, no ``template``).

    ``template`` (``--probe-command``): a shell-style command line with ``{host}``.  mpirun: its own options (the
    rsh agent, the interfaces) without those that place the ranks, then ``--host HOST:1 -np 1 true``; srun:
    ``srun -w HOST -N1 -n1 true`` (a step within the allocation).
    """
    if template:
        return [arg.replace(HOST_PLACEHOLDER, host) for arg in shlex.split(template)]
    kind = launcher_kind(command, kind)
    if kind == "srun":
        return [command[0], "-w", host, "-N1", "-n1", "true"]
    if kind != "mpirun":
        return None
    options: list[str] = []
    args = command[1:launcher_end(command)]
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in MPIRUN_PLACEMENT:
            i += 2
            continue
        if any(arg.startswith(name + "=") for name in MPIRUN_PLACEMENT if name.startswith("--")):
            i += 1
            continue
        options.append(arg)
        i += 1
    return [command[0], *options, "--host", f"{host}:1", "-np", "1", "true"]


def check_template(template: str) -> str:
    """A ``--probe-command`` template, or ``ElasticError`` saying what is wrong with it."""
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise ElasticError(f"--probe-command: cannot split {template!r}: {exc}") from None
    if not words:
        raise ElasticError("--probe-command is empty")
    if not any(HOST_PLACEHOLDER in w for w in words):
        raise ElasticError(f"--probe-command must name the host as {HOST_PLACEHOLDER}: {template!r}")
    return template


def unreachable(candidates: list[str], reachable: dict[str, bool] | None) -> tuple[list[str], str]:
    """Which of the hosts a failure names to leave out, and why (pure).

    ``reachable``: the probe's answer per host; None when no probe can be made (the named hosts are all left out,
    as the evidence says).  With a probe, a host that answers stays (each side of a partition names the other:
    only the side the launcher cannot reach is lost), and one that does not is left out.
    """
    if reachable is None:
        return list(candidates), "named by the failure (no probe for this launcher)"
    lost = [h for h in candidates if not reachable.get(h, False)]
    kept = [h for h in candidates if reachable.get(h, False)]
    parts = []
    if lost:
        parts.append(f"{', '.join(lost)} did not answer the probe")
    if kept:
        parts.append(f"{', '.join(kept)} answered it (kept)")
    return lost, "; ".join(parts)


def lost_entries(named: list[str], entries: list[str] | None, places: Iterable[RankPlace], *, excluded: list[str],
                 resolve: Callable[[list[str]], dict[str, list[str]]],
                 probe: Callable[[list[str]], dict[str, bool] | None]) -> tuple[list[str], str, str | None]:
    """Which entries of the launcher's host list to leave out after a failure that names the hosts ``named``.

    Each named host is mapped to the entries that are it (``hpcnet.launch.hosts.entries_naming``, by what its ranks
    reported in ``places``); those not yet ``excluded`` are probed (``probe``: hosts -> answered, None when no probe
    can be made), and the ones that do not answer are lost (``unreachable``).  A host that no entry is gets probed
    by its own name: one that answers needs no exclusion, one that does not cannot be left out of a command that
    does not name it, so no attempt may follow (it would run there again).

    Returns (the entries lost, what to say, why no attempt may follow or None).
    """
    places = list(places)
    mapped = {h: entries_naming(h, entries, places, resolve) for h in named}
    targets = list(dict.fromkeys(e for found, _ in mapped.values() for e in found if e not in excluded))
    unmapped = [h for h, (found, _) in mapped.items() if not found and h not in targets]
    if not targets and not unmapped:
        return [], "", None
    lost, why = unreachable([*targets, *unmapped], probe([*targets, *unmapped]))
    said = f"the failure names {', '.join(_as_entries(h, *mapped[h]) for h in named)}: {why}"
    if stuck := [h for h in unmapped if h in lost]:
        listed = f" ({', '.join(entries)})" if entries else ""
        return [], said, (f"cannot leave out {', '.join(stuck)}: no entry of the launcher's host list{listed} is it "
                          "(by its name, the scheduler's name for it or an address its ranks reported), and it does "
                          "not answer the probe; not starting another attempt that would run there again")
    return [h for h in lost if h in targets], said, None


def _as_entries(host: str, found: list[str], how: str) -> str:
    """A named host and the launcher's entries that are it, in words."""
    if found == [host]:
        return host
    return f"{host} (the launcher's {', '.join(found)}: {how})" if found else f"{host} (no entry of the launcher's)"


def run_probe(command: list[str], timeout_s: float, env: dict[str, str] | None,
              reap: Callable[[int], Any]) -> bool:
    """Run a probe in a session of its own; True if it ended with 0 within ``timeout_s``. ``reap(sid)`` ends what is
    left of its session (a launcher waiting for a daemon it cannot reach does not end by itself)."""
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    except OSError:
        return False
    try:
        status = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        status = -1
    reap(proc.pid)
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    return status == 0


def probe_hosts(hosts: list[str], make: Callable[[str], list[str] | None], timeout_s: float,
                env: dict[str, str] | None, reap: Callable[[int], Any]) -> dict[str, bool] | None:
    """Probe ``hosts`` at once (one thread each); None when ``make`` cannot build a probe."""
    commands = {h: make(h) for h in hosts}
    if any(c is None for c in commands.values()):
        return None
    answers: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda h=h, c=c: answers.__setitem__(h, run_probe(c, timeout_s, env, reap)),
                                daemon=True) for h, c in commands.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


class HostWatch:
    """Ask, in a background thread, whether one of the excluded ``hosts`` answers again: each in turn, one probe at a
    time, a probe started every ``every_s`` at most.  ``back`` holds the hosts that answered; ``answered`` is set
    at the first. Never blocks its caller; ``stop`` ends the thread after the probe in flight."""

    def __init__(self, hosts: list[str], make: Callable[[str], list[str] | None], *, every_s: float,
                 timeout_s: float, env: dict[str, str] | None, reap: Callable[[int], Any]) -> None:
        self.hosts, self.make, self.every_s, self.timeout_s, self.env, self.reap = hosts, make, every_s, timeout_s, \
            env, reap
        self.back: list[str] = []
        self.answered = threading.Event()
        self.answered_unix: float | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="hpcnet-hostwatch")

    def start(self) -> "HostWatch":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            for host in [h for h in self.hosts if h not in self.back]:
                began = time.monotonic()
                command = self.make(host)
                if command is None or self._stop.is_set():
                    return
                if run_probe(command, self.timeout_s, self.env, self.reap):
                    self.back.append(host)
                    if self.answered_unix is None:
                        self.answered_unix = time.time()
                    self.answered.set()
                if self._stop.wait(max(0.0, self.every_s - (time.monotonic() - began))):
                    return
            if len(self.back) == len(self.hosts):
                return

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=self.timeout_s + 5)
