"""Restart decisions (pure): which statuses restart, the backoff, the budget, progress, what a failure was."""

import os
import signal

import pytest

from hpcnet.launch.hosts import RankPlace
from hpcnet.launch.restarts import (
    RestartBudget,
    backoff_s,
    committed_checkpoints,
    declared,
    describe_failure,
    describe_loss,
    describe_status,
    failed_where,
    failure_from_line,
    host_loss_from_line,
    is_abort_line,
    is_restartable,
    lost_host,
    merge_host_loss,
    new_checkpoints,
    normalise_status,
    read_failure,
    read_rank_hosts,
    read_rank_places,
)


@pytest.mark.parametrize("status, restart", [
    (0, False), (1, False), (2, False), (75, True), (76, False), (130, False), (143, False), (127, False),
    (137, True), (139, True), (135, True), (134, True),  # SIGKILL, SIGSEGV, SIGBUS, SIGABRT
])
def test_which_statuses_restart(status, restart):
    assert is_restartable(status) is restart


def test_signal_deaths_of_the_launcher_read_like_a_shell():
    assert normalise_status(-9) == 137 and normalise_status(75) == 75
    assert is_restartable(normalise_status(-signal.SIGKILL)) and not is_restartable(normalise_status(-signal.SIGINT))


@pytest.mark.launch
@pytest.mark.parametrize("flag, value", [("--backoff-s", "1e12"), ("--max-backoff-s", "1e12"), ("--backoff-s", "nan")])
def test_backoff_flags_are_bounded(tmp_path, flag, value):
    """A wait beyond 30 days (or nan) is refused up front, naming the flag, not an OverflowError traceback from
    the wait before the first restart."""
    import subprocess
    import sys

    from tests.helpers.launch import clean_env

    other = "--max-backoff-s" if flag == "--backoff-s" else "--backoff-s"
    out = subprocess.run([sys.executable, "-m", "hpcnet.launch", "--max-restarts", "1", flag, value, other, "1",
                          "--", "sh", "-c", "exit 75"], cwd=tmp_path, env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    shown = value.replace("1e12", "1e+12")
    assert f"error: {flag} must be a number of seconds in [0, 2592000] (30 days), got {shown}" in out.stderr \
        and "Traceback" not in out.stderr, out.stderr


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_s(k, 1.0, 10.0) for k in range(1, 7)] == [1, 2, 4, 8, 10, 10]
    assert backoff_s(100, 0.5, 60) == 60 and backoff_s(3, 0.0, 60) == 0
    with pytest.raises(ValueError):
        backoff_s(0, 1, 1)


def test_launcher_reports_of_dead_ranks():
    found = failure_from_line("mpirun noticed that process rank 3 with PID 0 on node n17 exited on signal 9 (Killed).")
    assert (found["rank"], found["host"], found["signal"]) == (3, "n17", 9)
    assert describe_failure(found) == "rank 3 on n17 died of signal 9 (SIGKILL)"
    found = failure_from_line("srun: error: n04: task 5: Killed")
    assert (found["rank"], found["host"]) == (5, "n04") and "Killed" in describe_failure(found)
    assert failure_from_line("step 3/10 | loss 2.1") is None
    report = {"kind": "heartbeat", "rank": 1, "host": "n2", "step": 7, "collective": "allreduce #12"}
    assert describe_failure(report) == "heartbeat: rank 1 on n2 at step 7 in allreduce #12"
    report = {"kind": "stall", "detail": "loss.allreduce (#29) at step 6 has not finished after 30.0 s",
              "failed": [{"rank": 1, "host": "n2"}, {"rank": 2, "host": "n2"}]}
    assert failed_where(report) == ([1, 2], ["n2"])
    assert describe_failure(report).startswith("stall: ranks 1, 2 on n2 (loss.allreduce (#29) at step 6")


def test_committed_checkpoints_and_what_is_new(tmp_path):
    assert committed_checkpoints(tmp_path / "missing") == {} and committed_checkpoints(None) == {}
    for name in ("ckpt-0000000010.h5", "ckpt-0000000020.h5.tmp", "latest", "ckpt-12.h5", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    before = committed_checkpoints(tmp_path)
    assert sorted(before) == ["ckpt-0000000010.h5"]  # a save in flight, `latest` and strays do not count
    assert new_checkpoints(before, before) == []
    (tmp_path / "ckpt-0000000030.h5").write_bytes(b"xy")
    os.utime(tmp_path / "ckpt-0000000010.h5", ns=(1, 1))  # written again
    after = committed_checkpoints(tmp_path)
    assert new_checkpoints(before, after) == ["ckpt-0000000010.h5", "ckpt-0000000030.h5"]
    (tmp_path / "ckpt-0000000010.h5").unlink()  # retention removed one: not progress by itself
    assert new_checkpoints(after, committed_checkpoints(tmp_path)) == []


def test_the_budget_counts_restarts_without_progress():
    budget = RestartBudget(2)
    assert budget.last_attempt(1) == 3
    assert [budget.take(), budget.take(), budget.take()] == [1, 2, None]
    assert budget.last_attempt(3) == 3 and budget.progress() is True
    assert budget.progress() is False and budget.take() == 1 and budget.last_attempt(4) == 5


def test_the_monitor_report_is_read_from_the_run_directory(tmp_path):
    assert read_failure(None) is None and read_failure(str(tmp_path)) is None
    (tmp_path / "failure.json").write_text('{"kind": "stall", "failed": [{"rank": 2, "host": "n1"}]}')
    assert failed_where(read_failure(str(tmp_path))) == ([2], ["n1"])
    (tmp_path / "failure.json").write_text("{half")
    assert read_failure(str(tmp_path))["kind"] == "unreadable failure.json"
    (tmp_path / "failure.json").write_text("[1]")
    assert read_failure(str(tmp_path)) == {"kind": "unreadable failure.json"}


# --- a lost host: from failure.json, the launcher's own messages, the attempt's state ---------------------------------

# Open MPI 4.1's messages as mpirun prints them (help-errmgr-base.txt, filled in), and srun's.
MPIRUN_NODE_DIED = """--------------------------------------------------------------------------
ORTE has lost communication with a remote daemon.

  HNP daemon   : [[41235,0],0] on node hostA
  Remote daemon: [[41235,0],1] on node hostB

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------"""
MPIRUN_DAEMONS_NOT_STARTED = """--------------------------------------------------------------------------
ORTE was unable to reliably start one or more daemons.
This usually is caused by:

* not finding the required libraries and/or binaries on
  one or more nodes. Please check your PATH and LD_LIBRARY_PATH
  settings, or configure OMPI with --enable-orterun-prefix-by-default
--------------------------------------------------------------------------"""
MPIRUN_DAEMON_FAILED = """--------------------------------------------------------------------------
An ORTE daemon has unexpectedly failed after launch and before
communicating back to mpirun. This could be caused by a number
of factors, including an inability to create a connection back
to mpirun due to a lack of common network interfaces and/or no
route found between them. Please check network connectivity
(including firewalls and network routing requirements).
--------------------------------------------------------------------------"""
MPIRUN_ABORT = """--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD
with errorcode 75.
"""
SRUN_NODE_FAILURE = """srun: error: Node failure on node07
srun: Job step aborted: Waiting up to 32 seconds for job step to finish.
srun: error: node07: tasks 4-7: Killed"""
# Open MPI 5.0.11's (PRRTE 3.0.11's prterun), as it printed them here: a daemon whose rsh agent died (its host
# killed), which ends the job with status 0; the others from help-errmgr-base.txt and help-plm-base.txt, filled in.
PRTERUN_DAEMON_NOT_REPORTED = """------------------------------------------------------------
A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the
daemon executable, or the executable was unable to find its
required supporting libraries. In some cases, the daemon was
able to execute, but was unable to complete a TCP connection
back to prterun:

  Local host:    hostA
  Remote host:   hostB
  Daemon exit status: 0

This may also be caused by a firewall on the remote host. Please
check that any firewall (e.g., iptables) has been disabled and
try again.
------------------------------------------------------------"""
PRTERUN_NODE_DIED = """--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-hostA-2811@0] on node hostA
  Remote daemon: [prterun-hostA-2811@1] on node hostB

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------"""
PRTERUN_DAEMON_DIED = """--------------------------------------------------------------------------
A daemon died unexpectedly on signal 9  while attempting to
launch so we are aborting.
--------------------------------------------------------------------------"""
HOSTS = {0: "hostA", 1: "hostA", 2: "hostB", 3: "hostB"}


def _notes(text):
    notes = None
    for line in text.splitlines():
        found = host_loss_from_line(line)
        if found is not None:
            notes = merge_host_loss(notes, found)
    return notes


def _heartbeat_failure(ranks, hosts=("hostA", "hostA", "hostB", "hostB")):
    """failure.json as the monitor on rank 0 writes it when ``ranks`` go silent."""
    from hpcnet.fault.failure import heartbeat_report

    report = heartbeat_report({r: (6.0, None) for r in ranks}, hosts, detector=0, interval_s=2.0, misses=3)
    return {**report, "exit_code": 75, "detected_by": 0, "detected_host": hosts[0], "detected_wall": 1.0}


def test_the_launchers_messages_of_a_lost_host():
    assert _notes(MPIRUN_NODE_DIED) == {"what": "daemon lost", "host": "hostB",
                                        "line": "ORTE has lost communication with a remote daemon."}
    assert _notes(MPIRUN_DAEMONS_NOT_STARTED)["what"] == "start" and "host" not in _notes(MPIRUN_DAEMONS_NOT_STARTED)
    assert _notes(MPIRUN_DAEMON_FAILED)["what"] == "start"
    assert _notes(SRUN_NODE_FAILURE) == {"what": "node failure", "host": "node07",
                                         "line": "srun: error: Node failure on node07"}
    assert _notes(MPIRUN_ABORT) is None and _notes("HNP daemon   : [[41235,0],0] on node hostA") is None
    assert is_abort_line(MPIRUN_ABORT.splitlines()[1]) and not is_abort_line(MPIRUN_NODE_DIED)
    # a start-up message first, the loss after: the loss is what counts
    assert _notes(MPIRUN_DAEMONS_NOT_STARTED + "\n" + MPIRUN_NODE_DIED)["what"] == "daemon lost"


def test_open_mpi_5s_messages_of_a_lost_daemon_name_its_host():
    """PRRTE (Open MPI 5's mpirun) says PRTE, and names the host of a daemon that never reported on a line of its
    own ("Remote host", not the "Local host" before it): a lost host once the ranks had all started."""
    notes = _notes(PRTERUN_DAEMON_NOT_REPORTED)
    assert notes == {"what": "start", "host": "hostB",
                     "line": "A daemon failed to report back after being spawned. This could"}
    loss = lost_host(None, notes, HOSTS, started=True)
    assert loss["host"] == "hostB" and loss["ranks"] == [2, 3] and "after the ranks had started" in loss["evidence"]
    assert lost_host(None, notes, HOSTS, started=False) is None  # a launch that failed
    assert _notes(PRTERUN_NODE_DIED) == {"what": "daemon lost", "host": "hostB",
                                         "line": "PRTE has lost communication with a remote daemon."}
    assert _notes(PRTERUN_DAEMON_DIED)["what"] == "start" and "host" not in _notes(PRTERUN_DAEMON_DIED)
    assert _notes("  Local host:    hostA") is None


def test_a_lost_host_from_the_launchers_message_whatever_its_status():
    loss = lost_host(None, _notes(MPIRUN_NODE_DIED), HOSTS, started=True)
    assert loss["host"] == "hostB" and loss["ranks"] == [2, 3] and "lost its daemon" in loss["evidence"]
    assert lost_host(None, _notes(MPIRUN_NODE_DIED), {}, started=False)["host"] == "hostB"  # a loss at any time
    assert lost_host(None, _notes(SRUN_NODE_FAILURE), {}, started=True)["host"] == "node07"
    assert is_restartable(9, host_lost=True) and not is_restartable(9)
    assert is_restartable(205, host_lost=True) and describe_status(205) == "failed with status 205"
    assert "host hostB lost (ranks 2, 3): the launcher lost its daemon there" in describe_loss(loss)


def test_a_daemon_that_fails_is_a_lost_host_only_once_the_attempt_had_started():
    """Open MPI's mpirun prints the same words for daemons that never started (a launch that failed: restarting
    would fail again) and, seen with a killed host, for one lost mid-run: the attempt's state tells them apart."""
    for text in (MPIRUN_DAEMONS_NOT_STARTED, MPIRUN_DAEMON_FAILED):
        assert lost_host(None, _notes(text), {}, started=False) is None
        loss = lost_host(None, _notes(text), HOSTS, started=True)
        assert loss["host"] is None and "after the ranks had started" in loss["evidence"]
        # failure.json names the host where the launcher does not
        named = lost_host(_heartbeat_failure([2]), _notes(text), HOSTS, started=True)
        assert named["host"] == "hostB" and named["ranks"] == [2, 3]


def test_a_lost_host_from_failure_json():
    """The monitor's report names a whole host's ranks (a killed or cut-off host): a lost host, status aside."""
    failure = _heartbeat_failure([2, 3])
    assert declared(failure) and not declared(failure_from_line("srun: error: n1: task 2: Killed"))
    loss = lost_host(failure, None, HOSTS, started=True)
    assert loss["host"] == "hostB" and loss["ranks"] == [2, 3] and loss["evidence"].startswith("failure.json")
    assert lost_host(failure, None, {}, started=True)["host"] == "hostB"  # hosts unknown: one host, not the detector's
    # one rank of a host that has two: a hung or dead rank, not a lost host
    assert lost_host(_heartbeat_failure([2]), None, HOSTS, started=True) is None
    # the ranks of two hosts
    assert lost_host(_heartbeat_failure([1, 2]), None, HOSTS, started=True) is None
    # a stall report lists every rank's host itself
    stall = {"kind": "stall", "failed": [{"rank": 1, "host": "hostB", "why": "silent"}],
             "ranks": [{"rank": 0, "host": "hostA"}, {"rank": 1, "host": "hostB"}], "detected_host": "hostA"}
    assert lost_host(stall, None, {}, started=True)["ranks"] == [1]


@pytest.mark.parametrize("status, declared_, host_lost, restart", [
    (9, True, False, True), (9, False, True, True), (9, False, False, False), (14, True, False, True),
    # above 128: a signal's number decides; a number above the last signal is the launcher's own status (Open MPI's
    # mpirun ends with 205 when a host it runs on dies)
    (205, False, True, True), (205, False, False, False), (255, True, False, True), (129, True, True, False),
    (1, True, False, False), (1, False, True, True),  # an exception in the job, unless a host was lost
    (2, True, True, False), (65, True, True, False), (76, False, True, False), (130, False, True, False),
    (143, True, True, False), (137, False, False, True), (75, False, False, True),
])
def test_a_launchers_own_status_restarts_on_a_declared_failure_or_a_lost_host(status, declared_, host_lost, restart):
    assert is_restartable(status, declared=declared_, host_lost=host_lost) is restart


def test_the_ranks_hosts_come_from_their_ready_reports(tmp_path, monkeypatch):
    from hpcnet.launch.stop import READY, report_rank

    for rank in (0, 1):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", str(rank))
        monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
        report_rank(tmp_path, READY)
    (tmp_path / "ready.2").write_text(" 123 1.0 hostB\n")  # a rank that could not say how many there are
    (tmp_path / "ready.3").write_text("4 123 1.0\n")  # an older report without its host
    import socket

    assert read_rank_hosts(tmp_path, READY) == {0: socket.gethostname(), 1: socket.gethostname(), 2: "hostB"}
    assert read_rank_hosts(None, READY) == {} and read_rank_hosts(tmp_path / "none", READY) == {}


def test_the_ready_reports_say_which_addresses_and_scheduler_node_each_rank_had(tmp_path, monkeypatch):
    """What the supervisor maps a failed host to the launcher's entry by (``hpcnet.launch.hosts.entries_naming``)."""
    import socket

    from hpcnet.comm.netif import interfaces
    from hpcnet.launch.stop import READY, report_rank

    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("SLURMD_NODENAME", "node07")
    report_rank(tmp_path, READY)
    (tmp_path / "ready.1").write_text("2 123 1.0 hostB 10.0.0.2,192.168.1.2 -\n")
    (tmp_path / "ready.2").write_text("2 123 1.0 hostC\n")  # an earlier hpcnet's report
    places = read_rank_places(tmp_path, READY)
    assert places[0] == RankPlace(socket.gethostname(), tuple(i.address for i in interfaces()), "node07")
    assert places[1] == RankPlace("hostB", ("10.0.0.2", "192.168.1.2")) and places[2] == RankPlace("hostC")
