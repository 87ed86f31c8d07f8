"""How an attempt ended: a launcher's status 0 is a finished run only when the run says it finished."""

import json
import os
import time

from hpcnet.errors import ExitCode
from hpcnet.launch.attempt import Attempt, settle, unfinished
from hpcnet.launch.restarts import host_loss_from_line, merge_host_loss
from hpcnet.paths import CONFIG_FILE, SUMMARY_FILE

PRTERUN_LOST = ("A daemon failed to report back after being spawned. This could", "  Remote host:   hostB")
"""What Open MPI 5's prterun printed here, status 0, when every process of a host (its daemon too) was killed."""


def _attempt(tmp_path, status=0, *, run=True, lines=()):
    record = Attempt(attempt=1, command=["mpirun"], run_dir=str(tmp_path) if run else None,
                     start_unix=time.time() - 5, status=status)
    for line in lines:
        found = host_loss_from_line(line)
        if found is not None:
            record.launcher_loss = merge_host_loss(record.launcher_loss, found)
    return record


def _finish(run_dir, steps, total=None, age_s=0.0):
    """The files hpcnet.train leaves: summary.json (``steps`` done), config.toml (``train.steps = total``)."""
    (run_dir / SUMMARY_FILE).write_text(json.dumps({"steps": steps, "start_step": 0}))
    if age_s:
        old = time.time() - age_s
        os.utime(run_dir / SUMMARY_FILE, (old, old))
    if total is not None:
        (run_dir / CONFIG_FILE).write_text(f'[run]\nname = "x"\n\n[train]\nsteps = {total}\n')


def test_a_run_that_wrote_its_summary_with_every_step_finished(tmp_path):
    _finish(tmp_path, 20, total=20)
    assert unfinished(_attempt(tmp_path)) == ""
    record = _attempt(tmp_path, lines=PRTERUN_LOST)  # its summary decides, whatever the launcher printed after it
    settle(record, None, all_started=True, start_timeout_s=0, launcher_grace_s=30)
    assert record.status == 0 and not record.restartable and record.cause == ""


def test_a_run_without_a_summary_of_this_attempt_or_every_step_did_not_finish(tmp_path):
    assert "wrote no summary.json" in unfinished(_attempt(tmp_path))
    _finish(tmp_path, 20, total=20, age_s=600)  # an earlier attempt's, in a reused directory
    assert "wrote no summary.json" in unfinished(_attempt(tmp_path))
    _finish(tmp_path, 12, total=20)
    assert unfinished(_attempt(tmp_path)) == "the run stopped after step 12 of 20 (summary.json)"
    (tmp_path / SUMMARY_FILE).write_text("{")
    assert unfinished(_attempt(tmp_path)) == "its summary.json cannot be read"


def test_another_command_finished_unless_its_launcher_reported_a_lost_daemon(tmp_path):
    assert unfinished(_attempt(tmp_path, run=False)) == ""
    assert "reported a lost daemon or node (A daemon failed to report back" in unfinished(
        _attempt(tmp_path, run=False, lines=PRTERUN_LOST))


def test_a_launcher_that_ends_0_on_an_unfinished_run_leaves_a_restartable_lost_host(tmp_path):
    """Open MPI 5's prterun ends with 0 when it loses a daemon: the attempt is a lost host (hostB, named by the
    message), restartable, never a finished run."""
    record = _attempt(tmp_path, lines=PRTERUN_LOST)
    reports = tmp_path / "ready"
    reports.mkdir()
    for rank, host in enumerate(("hostA", "hostA", "hostB", "hostB")):
        (reports / f"ready.{rank}").write_text(f"4 {1000 + rank} {time.time():.3f} {host}\n")
    settle(record, reports, all_started=True, start_timeout_s=0, launcher_grace_s=30)
    assert record.status == ExitCode.RESTARTABLE and record.restartable
    assert record.lost_host["host"] == "hostB" and record.lost_host["ranks"] == [2, 3]
    assert "the launcher ended with status 0, but the run wrote no summary.json" in record.cause
    silent = _attempt(tmp_path)  # no line at all: still not finished, restartable, no host to blame
    settle(silent, None, all_started=True, start_timeout_s=0, launcher_grace_s=30)
    assert silent.status == ExitCode.RESTARTABLE and silent.restartable and silent.lost_host is None
