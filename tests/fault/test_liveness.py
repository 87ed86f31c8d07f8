"""Starved or failed: the /proc check a watcher makes before declaring a silent rank on its host dead."""

import os
import signal
import subprocess
import sys
import time

import pytest

from hpcnet.fault.liveness import (
    MONITOR_WINDOW_S,
    LocalLiveness,
    ThreadState,
    monitor_cpu_ns,
    process_threads,
    start_time,
    starved,
)
from tests.helpers.launch import PROGRAMS, ROOT

MONITOR = "hpcnet-monitor"


@pytest.fixture
def process(request):
    proc = subprocess.Popen([sys.executable, str(PROGRAMS / "blocked_monitor.py"), request.param],
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    yield proc
    proc.kill()
    proc.wait()


def test_states_decide():
    mon_running = ThreadState(MONITOR, "R", "0")
    mon_futex = ThreadState(MONITOR, "S", "futex_wait_queue")
    mon_sleeping = ThreadState(MONITOR, "S", "hrtimer_nanosleep")
    main_running, main_blocked = ThreadState("python", "R", "0"), ThreadState("python", "S", "futex_wait_queue")
    assert starved([main_blocked, mon_running]) is True              # waits for a CPU
    assert starved([main_running, mon_futex]) is True                # waits for the GIL a runnable thread holds
    assert starved([ThreadState("python", "D", "io"), mon_futex]) is True
    assert starved([main_blocked, mon_futex]) is False               # everything blocked: a deadlock
    assert starved([main_running, mon_sleeping]) is False            # its monitor could beat and did not
    assert starved([ThreadState("python", "T", "do_signal_stop"), mon_running]) is None  # stopped
    assert starved([main_running]) is False                          # no monitor thread at all


def test_failed_keeps_a_starved_rank_until_the_limit():
    states = {1: [ThreadState("python", "R", "0"), ThreadState(MONITOR, "S", "futex_wait_queue")],
              2: [ThreadState("python", "S", "futex_wait_queue"), ThreadState(MONITOR, "S", "futex_wait_queue")],
              3: None}
    now = [0.0]
    live = LocalLiveness({1: (11, None), 2: (12, None), 3: (13, None)}, idle_s=6.0,
                         read=lambda pid, _: states[pid - 10], ticks=lambda pid: 100, clock=lambda: now[0])
    silent = {1: 7.0, 2: 7.0, 3: 7.0, 4: 7.0}
    assert live.failed([1, 2, 3, 4], silent.get, limit_s=30.0) == [3, 4]  # 4 is on another host; 3 is gone
    now[0] = 6.5  # 2: every thread blocked and no CPU time for idle_s: a deadlock
    assert live.failed([1, 2, 3, 4], silent.get, limit_s=30.0) == [2, 3, 4]
    silent[1] = 31.0
    assert live.failed([1], silent.get, limit_s=30.0) == [1]


@pytest.mark.parametrize("process", ["spin"], indirect=True)
def test_a_spinning_process_is_starved_not_failed(process):
    threads = process_threads(process.pid, start_time(process.pid))
    assert threads is not None and MONITOR in {t.name for t in threads}
    assert starved(threads) is True


@pytest.mark.parametrize("process", ["sleep"], indirect=True)
def test_a_blocked_process_is_failed(process):
    assert starved(process_threads(process.pid, start_time(process.pid))) is False


@pytest.mark.parametrize("process", ["spin"], indirect=True)
def test_a_stopped_process_is_failed_at_once(process):
    os.kill(process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while (threads := process_threads(process.pid, None)) and all(t.state not in "Tt" for t in threads):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert starved(threads) is None
    finally:
        os.kill(process.pid, signal.SIGCONT)


@pytest.mark.parametrize("process", ["spin"], indirect=True)
def test_a_gone_or_reused_pid_is_failed(process):
    started = start_time(process.pid)
    assert process_threads(process.pid, started + 1) is None  # another process now has this pid
    process.kill()
    process.wait()
    assert process_threads(process.pid, started) is None


def test_a_blocked_looking_process_that_uses_cpu_is_kept_until_it_stops_using_it():
    """Every thread blocked at the instant of the look, but CPU time moving: starved; no CPU for idle_s: failed."""
    blocked = [ThreadState("python", "S", "futex_wait_queue"), ThreadState(MONITOR, "S", "futex_wait_queue")]
    now, ticks = [100.0], [500]
    live = LocalLiveness({1: (11, None)}, idle_s=6.0, read=lambda pid, _: blocked, ticks=lambda pid: ticks[0],
                         clock=lambda: now[0])
    silent = {1: 7.0}.get
    assert live.failed([1], silent, limit_s=30.0) == []       # first look: the count starts
    now[0], ticks[0] = 104.0, 520
    assert live.failed([1], silent, limit_s=30.0) == []       # it ran: 20 ticks in 4 s
    now[0], ticks[0] = 109.0, 521
    assert live.failed([1], silent, limit_s=30.0) == []       # 1 tick is noise, but 5 s < idle_s since it ran
    now[0] = 110.5
    assert live.failed([1], silent, limit_s=30.0) == [1]      # no CPU for 6.5 s: failed
    live.heard(1)                                              # heard again: the count starts over
    assert live.failed([1], silent, limit_s=30.0) == []
    gone = LocalLiveness({1: (11, None)}, read=lambda pid, _: blocked, ticks=lambda pid: None)
    assert gone.failed([1], silent, limit_s=30.0) == [1]      # no /proc/<pid>/stat: gone


def test_cpu_ticks_of_a_spinning_process_grow():
    from hpcnet.fault.liveness import cpu_ticks

    before, cpu_before = cpu_ticks(os.getpid()), time.process_time()
    while time.process_time() - cpu_before < 0.2:  # 0.2 s of CPU, however loaded the machine
        pass
    assert cpu_ticks(os.getpid()) - before >= 15  # 20 ticks of 10 ms, less the rounding


def test_a_blocked_look_is_repeated_and_a_starved_one_wins():
    """One look is one instant: a healthy rank caught between thread states is looked at again before it fails."""
    from hpcnet.fault.liveness import LOOKS

    main_io, mon_unknown = ThreadState("python", "D", "vm_mmap_pgoff"), ThreadState(MONITOR, "S", "0")
    mon_gil, mon_asleep = ThreadState(MONITOR, "S", "futex_do_wait"), ThreadState(MONITOR, "S", "hrtimer_nanosleep")
    looks = {1: [[main_io, mon_unknown], [main_io, mon_unknown], [main_io, mon_gil]],
             2: [[ThreadState("python", "S", "futex_do_wait"), mon_asleep]] * LOOKS}
    seen = {1: 0, 2: 0}
    slept = []

    def read(pid, _):
        rank = pid - 10
        seen[rank] += 1
        return looks[rank][min(seen[rank], len(looks[rank])) - 1]

    live = LocalLiveness({1: (11, None), 2: (12, None)}, read=read, ticks=lambda pid: 100, sleep=slept.append)
    assert live.failed([1, 2], {1: 130.0, 2: 130.0}.get, limit_s=1920.0) == [2]
    assert seen == {1: 3, 2: LOOKS}  # 1 starved at the third look; 2 blocked at every one
    assert len(slept) == 2 + LOOKS - 1 and all(0 < s <= 0.1 for s in slept)


def test_a_rank_of_another_host_of_this_machine_whose_monitor_runs_is_failed_at_once():
    """Hosts that are namespaces of one machine share its cores: a silent rank there may be starved, as one on this
    host may; but one whose monitor thread runs is beating, and its beats do not arrive: a partition."""
    starving = [ThreadState("python", "R", "0"), ThreadState(MONITOR, "R", "0")]  # looks starved
    monitor_ns = {11: iter([5_000, 5_000]), 12: iter([5_000, 9_000]), 13: iter([None])}
    slept = []
    live = LocalLiveness({1: (11, None), 2: (12, None), 3: (13, None), 4: (14, None)}, read=lambda pid, _: starving,
                         ticks=lambda pid: 100, sleep=slept.append, remote={1, 2, 3},
                         monitor_ns=lambda pid: next(monitor_ns[pid]))
    silent = {1: 7.0, 2: 7.0, 3: 7.0, 4: 7.0}.get
    # 1: its monitor got no CPU (starved, kept); 2: its monitor ran (failed); 3: no monitor thread found: the usual
    # look (starved, kept); 4: on this host, never asked
    assert live.failed([1, 2, 3, 4], silent, limit_s=30.0) == [2]
    assert slept.count(MONITOR_WINDOW_S) == 2


@pytest.mark.parametrize("process", ["ticking"], indirect=True)
def test_the_cpu_time_of_a_ticking_monitor_thread_grows_and_a_blocked_ones_does_not(process):
    first = monitor_cpu_ns(process.pid)
    time.sleep(MONITOR_WINDOW_S)
    assert first is not None and monitor_cpu_ns(process.pid) > first
    assert monitor_cpu_ns(os.getpid()) is None  # no monitor thread here
    blocked = subprocess.Popen([sys.executable, str(PROGRAMS / "blocked_monitor.py"), "sleep"],
                               env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        assert blocked.stdout.readline().strip() == "ready"
        time.sleep(0.1)
        before = monitor_cpu_ns(blocked.pid)
        time.sleep(MONITOR_WINDOW_S)
        assert before is not None and monitor_cpu_ns(blocked.pid) == before
    finally:
        blocked.kill()
        blocked.wait()
