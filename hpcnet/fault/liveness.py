"""Starved or failed: what ``/proc`` says about a silent rank on this host.

On a node with more ranks than cores (or a busy one) a healthy rank's monitor
thread can wait seconds for a CPU, or for the GIL that a runnable thread of
its own holds, and miss its beats, and heartbeats alone would declare it
dead. For a silent rank on its own host a watcher therefore looks at the
rank's threads first:

- the process is gone (or another process has its pid), or a thread is
  stopped (SIGSTOP, a debugger): failed, at once;
- its monitor thread is runnable (waiting for a CPU), or it waits on a futex
  (the GIL) while another thread of the process is runnable or in I/O: starved,
  not failed; it is allowed the silence up to ``limit_s`` (the stall timeout)
  and declared failed after that, as any rank that cannot be heard;
- its monitor thread waits on a futex and no other thread runs (every thread
  blocked): failed, as heartbeats say, unless the process used CPU time in
  the last ``idle_s`` (one heartbeat deadline):
  a thread state is one instant, and on an oversubscribed host a healthy
  rank can have every thread asleep or waiting on a lock at the moment of
  the look;
  a deadlocked process uses none;
- otherwise (its monitor thread asleep, or none): failed.

Ranks on other hosts are judged by heartbeats alone, except where those
hosts are namespaces or containers of this machine (the same kernel boot id)
and their processes are visible here, as on the local test cluster: their
ranks share this machine's cores, so they starve alike, and their silence
may be starvation too.  Such a rank is first asked one more question: does
its monitor thread run (its CPU time, ``/proc/<pid>/task/<tid>/schedstat``,
grows over ``MONITOR_WINDOW_S``)?  Then it is beating and its beats do not
arrive: a network fault between the hosts (a partition), failed at once.
Otherwise the rules above apply.
"""

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MONITOR_THREAD_NAME = b"hpcnet-monitor"
"""The OS name of the monitor thread (``top -H`` shows it; a watcher looks for it in ``/proc``)."""
_PR_SET_NAME = 15
BUSY_TICKS = 2
"""CPU clock ticks (10 ms each) that count as running: a deadlocked process's threads wake for microseconds
(a GIL wait times out every 5 ms), a starved one still gets many more over a heartbeat deadline."""

LOOKS = 5
LOOK_GAP_S = 0.02
"""A rank that looks blocked is looked at ``LOOKS`` times this far apart (0.08 s in all, only for a silent rank past
its deadline) before it is declared failed: on an oversubscribed host a healthy rank's monitor thread can be asleep
with no known ``wchan`` ('S', '0') for an instant while its main thread waits in ``mmap`` ('D'), as in a start-up that
imports torch."""


MONITOR_WINDOW_S = 0.25
"""How long a watcher looks at the monitor thread of a silent rank on another host of this machine: a running
monitor ticks every 50 ms at most (``Monitor._tick_s``), so its CPU time grows within this."""


def name_this_thread(name: bytes = MONITOR_THREAD_NAME) -> None:
    """Give the calling thread its OS name (Linux ``prctl``; elsewhere nothing happens)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22): with the pid, its
    identity."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(text[text.rindex(")") + 2:].split()[19])


@dataclass(frozen=True, slots=True)
class ThreadState:
    """One thread of a process, from ``/proc``: its name, scheduler state and wait channel."""

    name: str
    state: str
    """``R`` runnable, ``S`` sleeping, ``D`` in I/O, ``T``/``t`` stopped, ``Z``/``X`` dead."""
    wchan: str
    """The kernel function it sleeps in (``futex_wait_queue``, ``hrtimer_nanosleep``, ...)."""


def cpu_ticks(pid: int) -> int | None:
    """User plus system CPU time of a process in clock ticks (``/proc/<pid>/stat`` fields 14 and 15)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])


def _tasks(pid: int) -> list[Path] | None:
    """The ``/proc`` directories of a process's threads, or None when it is gone."""
    try:
        return [Path(f"/proc/{pid}/task/{tid}") for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return None


def monitor_cpu_ns(pid: int) -> int | None:
    """The time on a CPU of a process's monitor thread, in ns (``schedstat``); None if none is found."""
    for base in _tasks(pid) or []:
        try:
            if (base / "comm").read_bytes().strip() == MONITOR_THREAD_NAME[:15]:
                return int((base / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return None


def process_threads(pid: int, started: int | None) -> list[ThreadState] | None:
    """The threads of a process on this host, or None when it is gone or the pid now names another process."""
    if started is not None and start_time(pid) != started:
        return None
    bases = _tasks(pid)
    if bases is None:
        return None
    threads = []
    for base in bases:
        try:
            stat = (base / "stat").read_text()
            wchan = (base / "wchan").read_text().strip()
        except OSError:
            continue
        threads.append(ThreadState(stat[stat.index("(") + 1:stat.rindex(")")],
                                   stat[stat.rindex(")") + 2:].split()[0], wchan))
    return threads or None


def halted(threads: Iterable[ThreadState] | None) -> bool:
    """Gone (None), or a thread stopped (SIGSTOP, a debugger) or dead: it runs no Python until resumed, if ever."""
    return threads is None or any(t.state in "TtZXx" for t in threads)


def starved(threads: Iterable[ThreadState]) -> bool | None:
    """True: starved (alive); False: blocked; None: stopped or dead (see the module docstring)."""
    threads = list(threads)
    if halted(threads):
        return None
    monitor = [t for t in threads if t.name.encode() == MONITOR_THREAD_NAME[:15]]
    if not monitor:
        return False
    if monitor[0].state == "R":
        return True
    others_busy = any(t.state in "RD" for t in threads if t is not monitor[0])
    return "futex" in monitor[0].wchan and others_busy


def _waits_for_gil(threads: Iterable[ThreadState]) -> bool:
    """Its monitor thread waits on a futex (the GIL): the one 'blocked' verdict that CPU time can overturn."""
    monitor = [t for t in threads if t.name.encode() == MONITOR_THREAD_NAME[:15]]
    return bool(monitor) and "futex" in monitor[0].wchan


class LocalLiveness:
    """Which of the silent ranks on this host to declare failed (the rest are starved, see the module docstring).

    Args:
        local: rank -> (pid, start time) of the other ranks on this host, and of the ranks on other hosts of this
            machine whose processes are visible here.
        remote: which of ``local`` are on another host of this machine.
        idle_s: how long a process whose threads are all blocked may have used
            no CPU time before it is failed (the heartbeat deadline).
        read: how to read a process's threads (tests pass a fake).
        ticks: how to read a process's CPU time (tests pass a fake).
        clock: ``time.monotonic`` (tests pass a fake).
        sleep: ``time.sleep``, between repeated looks (tests pass a fake).
        monitor_ns: how to read the CPU time of a process's monitor thread (tests pass a fake).
    """

    def __init__(self, local: dict[int, tuple[int, int | None]], idle_s: float = 6.0,
                 read: Callable[[int, int | None], list[ThreadState] | None] = process_threads,
                 ticks: Callable[[int], int | None] = cpu_ticks,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, *, remote: Iterable[int] = (),
                 monitor_ns: Callable[[int], int | None] = monitor_cpu_ns) -> None:
        self.local = local
        self.remote = frozenset(remote)
        self.idle_s = idle_s
        self._read, self._ticks, self._clock, self._sleep = read, ticks, clock, sleep
        self._monitor_ns = monitor_ns
        self._told: set[int] = set()
        self._cpu: dict[int, tuple[int, float]] = {}
        """rank -> (its CPU ticks, when they last changed), while it is silent."""

    def heard(self, rank: int) -> None:
        self._told.discard(rank)
        self._cpu.pop(rank, None)

    def _busy_lately(self, rank: int) -> bool:
        """Whether the rank's process used CPU time (``BUSY_TICKS``) within ``idle_s``; a first look counts as
        busy, and starts the count."""
        ticks, now = self._ticks(self.local[rank][0]), self._clock()
        if ticks is None:
            return False
        last = self._cpu.get(rank)
        if last is None or ticks - last[0] >= BUSY_TICKS:
            self._cpu[rank] = (ticks, now)
            return True
        return now - last[1] < self.idle_s

    def _look(self, rank: int) -> tuple[list[ThreadState] | None, bool | None]:
        """The rank's threads and ``starved`` verdict; a 'blocked' look is repeated ``LOOKS`` times ``LOOK_GAP_S``
        apart and any 'starved' one wins: one look is one instant, and a healthy rank whose threads are between
        states (its monitor thread just woken, the kernel's ``wchan`` not yet known) can look blocked."""
        threads: list[ThreadState] | None = None
        verdict: bool | None = None
        for look in range(LOOKS):
            if look:
                self._sleep(LOOK_GAP_S)
            threads = self._read(*self.local[rank])
            verdict = None if threads is None else starved(threads)
            if verdict is not False:
                break
        return threads, verdict

    def _monitor_runs(self, rank: int) -> bool:
        """Whether the rank's monitor thread got CPU time within ``MONITOR_WINDOW_S``."""
        pid = self.local[rank][0]
        before = self._monitor_ns(pid)
        if before is None:
            return False
        self._sleep(MONITOR_WINDOW_S)
        after = self._monitor_ns(pid)
        return after is not None and after > before

    def failed(self, ranks: Iterable[int], silent_s: Callable[[int], float], limit_s: float) -> list[int]:
        """Of ``ranks`` (past their heartbeat deadline), those to declare failed now."""
        out = []
        for rank in ranks:
            if rank not in self.local or silent_s(rank) > limit_s:
                out.append(rank)
                continue
            if rank in self.remote and self._monitor_runs(rank):
                out.append(rank)
                log.error("rank %d on another host of this machine: silent for %.1f s while its monitor thread "
                          "runs: its beats do not arrive (a network fault between the hosts)", rank, silent_s(rank))
                continue
            threads, verdict = self._look(rank)
            if verdict is False and _waits_for_gil(threads) and self._busy_lately(rank):
                verdict = True  # every thread blocked at this instant, but it has been running
            if not verdict:
                out.append(rank)
                log.error("rank %d on this machine: silent for %.1f s, %s; its threads: %s", rank, silent_s(rank),
                          "gone" if threads is None else "stopped" if verdict is None else "blocked",
                          ", ".join(f"{t.name}:{t.state}:{t.wchan}" for t in threads or []) or "none")
            elif rank not in self._told:
                self._told.add(rank)
                log.warning("rank %d on this machine is silent for %.1f s but its process is runnable or using CPU "
                            "(starved of CPU or of its GIL): not failed unless silent for %.0f s", rank,
                            silent_s(rank), limit_s)
        return out
