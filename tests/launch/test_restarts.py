"""Restart decisions (pure): which statuses restart, the backoff, the budget, progress, what a failure was."""

import os
import signal

import pytest

from hpcnet.launch.restarts import (
    RestartBudget,
    backoff_s,
    committed_checkpoints,
    describe_failure,
    failed_where,
    failure_from_line,
    is_restartable,
    new_checkpoints,
    normalise_status,
    read_failure,
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
