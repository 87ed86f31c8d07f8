"""Failure reports (pure) and failure.json: what they name, how two watchers' reports merge."""

import json
import multiprocessing
import time
from pathlib import Path

from hpcnet.fault.failure import heartbeat_report, merge_reports, stall_report, write_failure
from hpcnet.fault.heartbeat import decode, encode
from hpcnet.fault.watchdog import analyze_io
from tests.helpers.fault import rank_state


def test_reports_name_rank_host_step_and_collective(tmp_path):
    beat = decode(encode(step=42, seq=300, op="allreduce.bucket", bucket=1, open_seq=300,
                         open_op="allreduce.bucket", open_bucket=1, open_s=0.2, pid=99))
    report = heartbeat_report({3: (6.1, beat), 4: (6.0, None)}, ("n0", "n0", "n1", "n1", "n2"), detector=0,
                              interval_s=2.0, misses=3)
    assert report["failed"][0] == {"rank": 3, "host": "n1", "silent_s": 6.1, "last_step": 42, "last_beat_step": 42,
                                   "collective": "allreduce.bucket[1] (#300)",
                                   "last_collective": "allreduce.bucket[1] (#300)", "pid": 99, "guard": None}
    assert report["kind"] == "heartbeat"
    assert report["failed"][1]["last_step"] is None
    assert ("rank 3 on n1 missed 3 heartbeats (silent for 6.1 s; interval 2 s): last seen at step 42, in "
            "allreduce.bucket[1] (#300) for 0.2 s") in report["message"]
    assert "rank 4 on n2" in report["message"] and "never heard from" in report["message"]
    assert "status 75" in report["message"]
    # The detector completed step 45, which needed rank 3: it completed at least 44, whatever its last beat said.
    later = heartbeat_report({3: (6.1, beat)}, ("n0",) * 4, detector=0, interval_s=2.0, misses=3, detector_step=45)
    assert later["failed"][0]["last_step"] == 44 and later["failed"][0]["last_beat_step"] == 42
    assert "it completed step 44 (its last beat, at step 42: in allreduce.bucket[1] (#300)" in later["message"]
    stall = stall_report("stall", "x stuck", {0: rank_state(5, 30, open_seq=30, open_op="step_boundary", open_s=9.0),
                                              1: rank_state(4, 25)}, ("a", "b"), detector=0)
    assert stall["failed"] == [{"rank": 1, "host": "b", "last_step": 4, "why": "behind"}]
    assert "BEHIND" in stall["message"] and "stall.rank<r>.txt" in stall["message"]


def test_failure_file_merges_watchers_reports(tmp_path):
    first = {**heartbeat_report({2: (6.0, None)}, ("h",) * 4, detector=0, interval_s=2, misses=3),
             "detected_by": 0}
    second = {**heartbeat_report({1: (6.0, None), 2: (6.0, None)}, ("h",) * 4, detector=3, interval_s=2,
                                 misses=3), "detected_by": 3}
    write_failure(tmp_path, first)
    write_failure(tmp_path, second)
    merged = json.loads((tmp_path / "failure.json").read_text())
    assert [f["rank"] for f in merged["failed"]] == [1, 2] and merged["also_detected_by"] == [3]
    assert merged["message"] == first["message"]  # the first report stands
    # A report of another kind later (a stopped rank continued for its teardown) changes nothing.
    late = {**stall_report("stall", "x", {0: None, 1: rank_state(1, 1)}, ("h", "h"), detector=1), "detected_by": 1}
    assert merge_reports(merged, late) == merged


def _declare_at(run_dir: Path, rank: int, start: float) -> None:
    report = {**heartbeat_report({rank: (6.0, None)}, ("h",) * 16, detector=rank + 1, interval_s=2, misses=3),
              "detected_by": rank + 1}
    time.sleep(max(0.0, start - time.time()))
    write_failure(run_dir, report)


def test_watchers_that_declare_at_the_same_moment_all_end_up_in_the_file(tmp_path):
    """Each reads the file and writes it back merged: without a lock between the read and the write, the last
    writer drops what another wrote meanwhile."""
    ctx = multiprocessing.get_context("fork")
    for trial in range(5):
        run_dir = tmp_path / str(trial)
        run_dir.mkdir()
        start = time.time() + 0.3
        procs = [ctx.Process(target=_declare_at, args=(run_dir, rank, start)) for rank in range(12)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(30)
        assert [proc.exitcode for proc in procs] == [0] * 12
        merged = json.loads((run_dir / "failure.json").read_text())
        assert [f["rank"] for f in merged["failed"]] == list(range(12)), trial


def _answer(step, guard, guard_s=3.0):
    return {"step": step, "seq": 10, "op": "step_boundary", "bucket": -1, "cseq": 10, "cop": "step_boundary",
            "digest": 1, "open_seq": 0, "open_op": "none", "open_bucket": -1, "open_s": 0.0, "guard": guard,
            "guard_s": guard_s}


def test_a_checkpoint_report_names_the_rank_the_otherswait_for():
    states = {0: _answer(20, "checkpoint.meet"), 1: _answer(20, "checkpoint.create"), 2: _answer(20, "checkpoint.meet")}
    analysis = analyze_io(states)
    assert analysis["behind"] == [1] and "ranks [1] did not reach the collective file create" in analysis["lines"][-1]
    report = stall_report("checkpoint", "checkpoint.write (step 20) has not finished after 10.0 s", states,
                          ("a", "b", "c"), detector=0)
    assert report["kind"] == "checkpoint" and report["failed"] == [
        {"rank": 1, "host": "b", "last_step": 20, "why": "behind"}]
    assert "checkpoint I/O past its deadline detected by rank 0 on a" in report["message"]
    assert "rank 1: step 20, in checkpoint.create for 3.0 s <- the others wait for it" in report["message"]
    stuck = analyze_io({0: _answer(20, "checkpoint.write"), 1: None})
    assert stuck["silent"] == [1] and "did not answer" in stuck["lines"][-1] and "holding the GIL" in stuck["lines"][1]
    assert "file system (or MPI-IO) is stuck" in analyze_io({0: _answer(20, "checkpoint.write")})["lines"][-1]
