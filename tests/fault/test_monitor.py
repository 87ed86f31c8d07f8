"""Failure detection: heartbeats, flight recorder, stall/desync reports, memory-leak watch.

Pure logic on one process; the monitor thread under MPI at any size; and
launches (serial pass) where a rank is SIGSTOPped, stalls, or desyncs, and the
job must end with status 75 and a report naming the rank and its host.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcnet.config import MonitorConfig, load_config
from hpcnet.errors import ExitCode
from hpcnet.fault.flightrec import FlightRecorder, analyze_stall, desync, format_entries, stall_timeout
from hpcnet.fault.heartbeat import FIELDS, LEAVING, RUNNING, PeerTracker, decode, encode, ring_peers
from hpcnet.fault.memwatch import MemoryWatch, Series, steady_growth, theil_sen_slope
from hpcnet.fault.monitor import DUMP_SIGNAL, Monitor, heartbeat_report, merge_reports, stall_report, write_failure
from hpcnet.comm.world import discover

ROOT = Path(__file__).resolve().parents[1]


# --- pure logic ------------------------------------------------------------------

@pytest.mark.parametrize("size", [1, 2, 3, 5, 1000])
def test_ring_every_rank_is_watched_by_its_successors(size):
    peers = [ring_peers(r, size) for r in range(size)]
    for rank, (send_to, watch) in enumerate(peers):
        assert len(send_to) == len(watch) == min(2, size - 1)  # O(1) messages per rank, whatever the size
        assert rank not in send_to and rank not in watch
        for dest in send_to:
            assert rank in peers[dest][1]  # whoever I beat to watches me
    watchers = [[w for w in range(size) if r in peers[w][1]] for r in range(size)]
    assert all(len(w) == min(2, size - 1) for w in watchers)


def test_two_adjacent_failures_are_both_watched_by_a_live_rank():
    size = 6
    for first in range(size):
        failed = {first, (first + 1) % size}
        named = {r for w in range(size) if w not in failed for r in ring_peers(w, size)[1] if r in failed}
        assert named == failed


def test_beat_round_trip():
    vector = encode(session=12345, rank=3, state=RUNNING, step=17, seq=99, op="allreduce.bucket", bucket=2,
                    cseq=98, cop="reducer.launched", digest=2**52 - 1, open_seq=98, open_op="reducer.launched",
                    open_bucket=-1, open_s=1.5, wall=1.7e9, pid=4242, kind="stall", guard="checkpoint.create",
                    guard_s=0.25, guard_left_s=119.5)
    assert vector.shape == (len(FIELDS),) and vector.nbytes == 160
    beat = decode(vector)
    assert beat["guard"] == "checkpoint.create" and beat["guard_s"] == 0.25 and beat["guard_left_s"] == 119.5
    assert beat["rank"] == 3 and beat["step"] == 17 and beat["op"] == "allreduce.bucket" and beat["bucket"] == 2
    assert beat["cop"] == "reducer.launched" and beat["cseq"] == 98 and beat["digest"] == 2**52 - 1  # exact
    assert beat["open_op"] == "reducer.launched" and beat["open_s"] == 1.5 and beat["kind"] == "stall"
    assert decode(encode(op=200))["op"] == "op#200"


def test_peer_tracker_deadlines():
    tracker = PeerTracker([1, 2], interval_s=2.0, misses=3, now=0.0, startup_deadline_s=100.0)
    running = decode(encode(state=RUNNING, step=5))
    for t in np.arange(0.05, 5.0, 0.05):
        tracker.tick(t)
    assert tracker.overdue(5.0) == []  # nothing heard yet, still starting up: startup deadline
    tracker.heard(1, running, 5.0)
    tracker.heard(2, running, 5.0)
    for t in np.arange(5.05, 11.0, 0.05):
        tracker.tick(t)
    assert tracker.overdue(10.9) == []  # 5.9 s < 3 x 2 s
    tracker.tick(11.1)
    assert tracker.overdue(11.1) == [1, 2]
    tracker.heard(2, decode(encode(state=LEAVING, step=5)), 11.1)  # said goodbye: not a failure
    assert tracker.overdue(11.2) == [1]


def test_peer_tracker_forgives_its_own_pause():
    tracker = PeerTracker([1], interval_s=1.0, misses=3, now=0.0)
    tracker.heard(1, decode(encode(step=3)), 0.0)
    tracker.tick(0.1)
    tracker.tick(1.5)  # this rank was starved for 1.4 s: it cannot tell whether rank 1 beat meanwhile
    assert tracker.overdue(1.5) == [] and tracker.last_heard[1] == 1.5 and not tracker.judging_paused(1.5)
    tracker.tick(10.0)  # stopped for 8.5 s, longer than a peer may be silent: its watchers judged it
    assert tracker.judging_paused(10.0) and tracker.judging_paused(15.9) and not tracker.judging_paused(16.1)


def test_flight_recorder_ring():
    rec = FlightRecorder(capacity=4)
    tokens = [rec.start("allreduce.bucket", bucket=b, nbytes=100 * b) for b in range(3)]
    assert tokens == [1, 2, 3] and rec.oldest_open().seq == 1
    rec.end(tokens[0])
    rec.end(tokens[0])  # twice is harmless
    assert rec.oldest_open().seq == 2
    for token in tokens[1:]:
        rec.end(token)
    rec.step = 7
    with rec.op("step_boundary"):
        assert rec.oldest_open().op == "step_boundary"
    with pytest.raises(ValueError, match="unknown collective"):
        rec.start("allreduce.typo")
    for _ in range(3):
        with rec.op("loss.allreduce"):
            pass
    assert [e.seq for e in rec.entries()] == [4, 5, 6, 7]  # the last 4
    assert rec.entry(1) is None and rec.entry(4).step == 7 and rec.oldest_open() is None
    assert "step_boundary" in format_entries(rec.entries(), time.monotonic())


def test_stall_timeout_rules():
    assert stall_timeout(5.0, 30.0, [100.0]) == 5.0  # configured wins
    assert stall_timeout(0.0, 30.0, []) == 120.0  # no step time yet: 4 x floor
    assert stall_timeout(0.0, 30.0, [0.1, 0.2, 0.1]) == 30.0  # the floor
    assert stall_timeout(0.0, 30.0, [5.0, 6.0, 100.0]) == 60.0  # 10 x median, one slow step ignored


def test_desync_compares_the_same_position():
    rec = FlightRecorder()
    rec.start("reducer.launched")
    assert desync(rec.entry(1), 1, "reducer.launched", -1) is None
    assert desync(rec.entry(1), 1, "loss.allreduce", -1) == \
        "loss.allreduce (#1) there, reducer.launched (#1) here"
    assert desync(rec.entry(2), 2, "loss.allreduce", -1) is None  # not there yet
    # Gradient buckets may fall elsewhere between control collectives (find_unused): never compared.
    rec.start("allreduce.bucket", bucket=0)
    assert desync(rec.entry(2), 2, "reducer.outcome", -1) is None
    assert rec.latest_control().seq == 1 and rec.latest().seq == 2
    # Histories that differ earlier (a mismatch MPI matched silently) differ in the digest ever after.
    other = FlightRecorder()
    for op in ("loss.allreduce", "allreduce.bucket", "step_boundary"):
        other.start(op)
    rec.start("step_boundary")
    assert desync(rec.entry(3), 3, "step_boundary", -1, other.entry(3).digest).startswith(
        "both are at step_boundary (#3), but the collectives before it differ")
    twin = FlightRecorder()  # the same control collectives, the bucket elsewhere: no desync
    for op in ("allreduce.bucket", "reducer.launched", "step_boundary"):
        twin.start(op)
    assert desync(rec.entry(3), 3, "step_boundary", -1, twin.entry(3).digest) is None


def _state(step, seq, op="step_boundary", bucket=-1, open_seq=0, open_op="none", open_s=0.0):
    return {"step": step, "seq": seq, "op": op, "bucket": bucket, "open_seq": open_seq, "open_op": open_op,
            "open_bucket": bucket if open_seq else -1, "open_s": open_s}


def test_analyze_stall_names_who_is_behind_mismatched_or_silent():
    waiting = _state(12, 105, "allreduce.bucket", 0, open_seq=105, open_op="allreduce.bucket", open_s=31.0)
    result = analyze_stall({0: waiting, 1: _state(11, 98), 2: waiting, 3: None})
    assert result["behind"] == [1] and result["silent"] == [3] and result["mismatched"] == []
    assert "rank 1: step 11, not in a collective" in result["lines"][1] and "BEHIND by 7" in result["lines"][1]
    assert "waiting in allreduce.bucket[0] (#105) for 31.0 s" in result["lines"][0]
    assert "no answer" in result["lines"][3]
    odd = _state(3, 9, "loss.allreduce", open_seq=9, open_op="loss.allreduce")
    result = analyze_stall({0: _state(3, 9), 1: odd, 2: _state(3, 9)})
    assert result["mismatched"] == [1] and "desync" in result["lines"][-1]
    assert analyze_stall({0: _state(3, 9), 1: odd})["mismatched"] == [0, 1]  # no majority of two
    moved_on = analyze_stall({0: _state(3, 12), 1: _state(3, 11)}, known_mismatch=(1, 0))
    assert moved_on["mismatched"] == [0, 1] and moved_on["behind"] == [] and "MISMATCHED" in moved_on["lines"][1]
    same = {r: waiting for r in range(3)}
    assert "network or the collective library" in analyze_stall(same)["lines"][-1]


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
    stall = stall_report("stall", "x stuck", {0: _state(5, 30, open_seq=30, open_op="step_boundary", open_s=9.0),
                                              1: _state(4, 25)}, ("a", "b"), detector=0)
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
    late = {**stall_report("stall", "x", {0: None, 1: _state(1, 1)}, ("h", "h"), detector=1), "detected_by": 1}
    assert merge_reports(merged, late) == merged


def test_monitor_options_are_validated():
    assert load_config(overrides=["monitor.heartbeat_interval_s=0.5"]).monitor.heartbeat_interval_s == 0.5
    with pytest.raises(ValueError, match="monitor.heartbeat_misses"):
        load_config(overrides=["monitor.heartbeat_misses=0"])


# --- memory trend (synthetic series) ------------------------------------------------

STEPS = list(range(50, 550, 50))


@pytest.mark.parametrize("series, leak", [
    ([1000 + 40 * i for i in range(10)], True),  # a steady leak: 360 MiB over the window
    ([1000 + 40 * i + (25 if i % 2 else -25) for i in range(10)], True),  # with noise
    ([1000, 1000, 1120, 1120, 1120, 1240, 1240, 1240, 1360, 1360], True),  # in allocator-sized steps
    ([1000] * 5 + [1500] * 5, False),  # one jump: a cache filled once
    ([1000] * 4 + [1900] + [1000] * 5, False),  # a spike that comes back
    ([1000 + (i % 3) * 200 for i in range(10)], False),  # noisy but flat
    ([1000 + 20 * i for i in range(10)], False),  # grows, but less than the threshold
    ([1000] * 9 + [1600], False),  # a jump at the very end
])
def test_steady_growth(series, leak):
    assert (steady_growth(STEPS, series, 256.0) is not None) == leak


def test_theil_sen_ignores_outliers():
    ys = [10.0 * x for x in range(10)]
    ys[4] = 1e6
    assert theil_sen_slope(list(range(10)), ys) == pytest.approx(10.0)


def test_series_warns_once_per_window_and_reports_the_trend():
    series = Series("rss", window=5)
    warnings = [series.add(step, 100.0 + step, threshold_mb=200) for step in range(0, 2000, 100)]
    hits = [i for i, w in enumerate(warnings) if w is not None]
    assert hits[0] == 4 and all(b - a >= 5 for a, b in zip(hits, hits[1:]))  # a whole new window each time
    trend = series.trend()
    assert trend["first_mb"] == 100.0 and trend["last_mb"] == 2000.0 and trend["peak_mb"] == 2000.0
    assert trend["slope_mb_per_1000_steps"] == pytest.approx(1000.0) and trend["samples"] == 20


def test_memory_watch_samples_every_n_steps(monkeypatch, tmp_path, caplog):
    values = iter([500.0 + 50 * i for i in range(100)])
    monkeypatch.setattr("hpcnet.fault.memwatch.rss_mb", lambda: next(values))
    watch = MemoryWatch(every_steps=10, window=4, growth_mb=100.0, run_dir=tmp_path, rank=3)
    for step in range(1, 101):
        watch.maybe_sample(step)
    summary = watch.summary()
    assert summary["trend"]["rss"]["samples"] == 10 and summary["trend"]["rss"]["last_mb"] == 950.0
    assert summary["warnings"] and summary["warnings"][0]["rank"] == 3 and summary["warnings"][0]["step"] == 40
    assert "rank 3: rss memory grew steadily by 150 MiB" in caplog.text
    assert "gpu_allocated" not in summary["trend"]  # CPU device: resident memory only


# --- the monitor thread under MPI --------------------------------------------------------

def _monitor(comm, run_dir, found, **options):
    cfg = MonitorConfig(**{"heartbeat_interval_s": 0.2, **options})
    return Monitor(cfg, comm, discover(comm), run_dir, on_failure=found.append)


def _wait_for(condition, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_beats_flow_without_false_alarms(comm, mpi_tmp_path):
    found = []
    monitor = _monitor(comm, mpi_tmp_path, found).start()
    monitor.step(1)  # past start-up: the normal deadline (3 x 0.2 s) applies
    buf = np.zeros(16)
    for step in range(2, 30):  # ~1.5 s: several intervals, with recorded collectives
        with monitor.collective("step_boundary"):
            comm.Allreduce(MPI.IN_PLACE, buf)
        monitor.step(step)
        time.sleep(0.05)
    comm.Barrier()
    summary = monitor.summary()  # collective
    time.sleep(0.3)  # a rank that stops first says goodbye; the others must not call that a failure
    monitor.stop()
    assert found == [] and monitor.failure is None
    assert monitor._thread is None and monitor._link.closed
    assert monitor.recorder.seq == 28
    if comm.Get_rank() == 0 and comm.Get_size() > 1:
        assert summary["beats_received"] > 0 and summary["collectives_recorded"] == 28


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_silent_rank_is_named_by_its_watchers(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    found = []
    monitor = _monitor(comm, mpi_tmp_path, found).start()
    monitor.step(3)
    time.sleep(0.5)
    if rank == 1:
        monitor._muted = True  # stops beating, as a SIGSTOPped rank would
    watchers = [w for w in range(size) if 1 in ring_peers(w, size)[1]]
    detected = _wait_for(lambda: found, 15) if rank in watchers else True
    comm.Barrier()  # before any assert: a rank that raised here would leave the others in the barrier
    monitor.stop()
    assert detected, "the silent rank was not detected"
    if rank not in watchers:
        assert found == []
    else:
        report = found[0]
        assert report["kind"] == "heartbeat" and [f["rank"] for f in report["failed"]] == [1]
        assert report["failed"][0]["host"] == MPI.Get_processor_name() and report["failed"][0]["last_step"] == 3
        assert report["detected_by"] == rank
        assert json.loads((mpi_tmp_path / "failure.json").read_text())["failed"][0]["rank"] == 1


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_stall_dumps_every_rank_and_names_who_is_behind(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    run_dir = mpi_tmp_path / "stall"
    if rank == 0:
        run_dir.mkdir()
    comm.Barrier()
    found = []
    monitor = _monitor(comm, run_dir, found, stall_timeout_s=0.5).start()
    monitor.step(2)
    if rank == 0:
        monitor.recorder.start("allreduce.bucket", bucket=0, nbytes=4096)  # never ends: a stall
        _wait_for(lambda: found, 20)
    dumped = _wait_for(lambda: (run_dir / f"stall.rank{rank}.txt").exists(), 20)
    comm.Barrier()
    monitor.stop()
    assert dumped
    if rank == 0:
        assert found, "the stall was not detected"
        report = found[0]
        assert report["kind"] == "stall" and "allreduce.bucket[0] (#1)" in report["detail"]
        assert sorted(f["rank"] for f in report["failed"]) == list(range(1, size))  # they are behind
        assert all(r.get("answered", True) for r in report["ranks"]), report["message"]
    dump = (run_dir / f"stall.rank{rank}.txt").read_text()
    assert "== flight recorder" in dump and "== Python stacks (faulthandler) ==" in dump
    assert "test_stall_dumps_every_rank" in dump  # this very test's frame, on the main thread
    if rank == 0:
        assert "RUNNING" in dump  # the open collective


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_desync_is_seen_by_a_neighbour(comm, mpi_tmp_path):
    rank = comm.Get_rank()
    run_dir = mpi_tmp_path / "desync"
    if rank == 0:
        run_dir.mkdir()
    comm.Barrier()
    found = []
    monitor = _monitor(comm, run_dir, found).start()
    monitor.step(1)
    with monitor.collective("step_boundary"):
        pass
    with monitor.collective("loss.allreduce" if rank == 1 else "step_boundary"):  # rank 1 is out of step
        pass
    for _ in range(200):  # the same number of rounds on every rank: a collective loop
        if any(comm.allgather(bool(found))):
            break
        time.sleep(0.1)
    reports = [r for r in comm.allgather(found) for r in r]
    comm.Barrier()
    monitor.stop()
    assert len(reports) == 1 and reports[0]["kind"] == "desync"  # the lowest detecting rank reports
    assert (run_dir / f"stall.rank{rank}.txt").exists()
    assert "disagree on collective #2" in reports[0]["detail"]
    assert "loss.allreduce (#2)" in reports[0]["detail"] and "step_boundary (#2)" in reports[0]["detail"]
    assert 1 in [f["rank"] for f in reports[0]["failed"]]


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_dump_signal_prints_every_stack(comm, mpi_tmp_path, capfd):
    monitor = _monitor(comm, mpi_tmp_path, []).start()
    try:
        os.kill(os.getpid(), DUMP_SIGNAL)  # what `kill -s RTMIN+4 <pid>` does; works while the GIL is held
        time.sleep(0.2)
    finally:
        monitor.stop()
    err = capfd.readouterr().err
    assert "most recent call first" in err and "test_dump_signal_prints_every_stack" in err
    assert "in _run" in err  # the monitor thread's stack too


# --- launches: the real entry point under mpirun, a rank stopped or stalled ------------------

TINY = '''
import time
import torch
from mpi4py import MPI


def make_dataset(split, n=256):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1), y)


class Sleepy(torch.nn.Linear):
    """Rank 1 falls asleep in its forward at step 6: the others wait for it in the all-reduce."""

    calls = 0

    def forward(self, x):
        Sleepy.calls += 1
        if self.training and Sleepy.calls == 6 and MPI.COMM_WORLD.Get_rank() == 1:
            time.sleep(120)
        return super().forward(x.flatten(1))


def make_sleepy(info):
    return Sleepy(64, info.num_classes)
'''


def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["data.dataset=tiny:make_dataset", f"run.dir={tmp_path / 'run'}", "run.dir_exact=true",
            "model.name=mlp", "train.batch_size=8", "train.steps=100000",
            "train.eval_every=0", "run.log_every=1", "run.metrics=all", "dist.probe=false",
            "checkpoint.every_s=0", "checkpoint.at_end=false", "monitor.heartbeat_interval_s=0.3", *extra]


def _env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "tiny.py").write_text(TINY)
    return {"PYTHONPATH": f"{tmp_path}:{ROOT}"}


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_sigstopped_rank_ends_the_job_and_is_named(tmp_path):
    from tests.helpers import clean_env

    cmd = ["mpirun", "-np", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", *_train_args(tmp_path)]
    proc = subprocess.Popen(cmd, env=clean_env(**_env(tmp_path)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        metrics = tmp_path / "run" / "metrics.rank1.jsonl"
        assert _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 60), \
            "training did not start"
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2
        stopped_at = time.time()
        os.kill(int(ranks[1]), signal.SIGSTOP)  # hung: MPI does not notice, only the heartbeat
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    detected_s = report["detected_wall"] - stopped_at
    print(f"SIGSTOPped rank detected after {detected_s:.2f} s (interval 0.3 s x 3)")
    assert proc.returncode == ExitCode.RESTARTABLE, err
    assert detected_s < 10
    host = MPI.Get_processor_name()
    (failed,) = report["failed"]
    steps_done = len(metrics.read_text().splitlines())
    assert failed["rank"] == 1 and failed["host"] == host and 1 <= failed["last_step"] <= steps_done
    assert report["kind"] == "heartbeat" and report["detected_by"] == 0
    assert f"rank 1 on {host} missed 3 heartbeats" in err and f"step {failed['last_step']}" in err


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_stalled_rank_every_rank_dumps_and_the_job_ends(launch, tmp_path):
    started = time.monotonic()
    out = launch(2, *_train_args(tmp_path, "model.factory=tiny:make_sleepy", "monitor.stall_timeout_s=2"),
                 env=_env(tmp_path), timeout=100)
    elapsed = time.monotonic() - started
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    run_dir = tmp_path / "run"
    dumps = {r: (run_dir / f"stall.rank{r}.txt").read_text() for r in range(2)}
    assert "RUNNING" in dumps[0]  # rank 0 waits in an all-reduce
    assert "in forward" in dumps[1] and "in forward" not in dumps[0]  # rank 1's stack: asleep in the model
    report = json.loads((run_dir / "failure.json").read_text())
    assert report["kind"] == "stall" and report["failed"] == [
        {"rank": 1, "host": MPI.Get_processor_name(), "last_step": 5, "why": "behind"}]
    assert "stall detected by rank 0" in out.stderr and "rank 1: step 5, not in a collective" in out.stderr
    assert "BEHIND" in out.stderr and "has not finished after" in out.stderr
    assert elapsed < 90  # not the model's 120 s sleep


SCRIPT = '''
"""Monitor on a loop of small collectives: desync, or ranks that stop themselves."""
import os, signal, sys, time
from pathlib import Path
import numpy as np
from mpi4py import MPI
from hpcnet.config import MonitorConfig
from hpcnet.fault.monitor import Monitor
from hpcnet.comm.world import discover

mode, interval, run_dir = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
comm = MPI.COMM_WORLD.Dup()
world = discover(comm)
monitor = Monitor(MonitorConfig(heartbeat_interval_s=interval), comm, world, run_dir).start()
buf = np.zeros(8)
for step in range(1, 10**6):
    op = "step_boundary"
    if mode == "desync" and step == 4 and world.rank == 1:
        op = "loss.allreduce"  # the same MPI call for another purpose: MPI matches it silently
    with monitor.collective(op):
        comm.Allreduce(MPI.IN_PLACE, buf)
    monitor.step(step)
    if mode == "stop" and step == 6 and world.rank in [int(r) for r in sys.argv[4].split(",")]:
        (run_dir / f"stopped.rank{world.rank}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.05)
'''


def _script(tmp_path: Path) -> str:
    (tmp_path / "script.py").write_text(SCRIPT)
    (tmp_path / "run").mkdir()
    return str(tmp_path / "script.py")


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_desync_ends_the_job(launch, tmp_path):
    out = launch(2, _script(tmp_path), "desync", "0.3", str(tmp_path / "run"), module=None, timeout=50)
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    # Seen at #4 itself (op against op) or at a later beat (the history digests differ).
    assert report["kind"] == "desync" and re.search(r"disagree on collective #\d+: (loss.allreduce \(#4\) |both)",
                                                    report["detail"]), report["detail"]
    assert {(tmp_path / "run" / f"stall.rank{r}.txt").exists() for r in range(2)} == {True}
    assert "desync detected by rank" in out.stderr and "MISMATCHED" in out.stderr


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_two_adjacent_hung_ranks_are_both_named(launch, tmp_path):
    out = launch(4, _script(tmp_path), "stop", "0.3", str(tmp_path / "run"), "1,2", module=None, timeout=50)
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    assert report["kind"] == "heartbeat"
    # Rank 3 watches 2 and 1; rank 0 watches 3 and 2: whoever writes first, the merge names both.
    assert sorted(f["rank"] for f in report["failed"]) == [1, 2]
    assert all(1 <= f["last_step"] <= 6 for f in report["failed"])  # from the last beat each sent


@pytest.mark.launch
@pytest.mark.timeout(60)
def test_hang_detection_time_with_the_defaults(launch, tmp_path):
    """Default interval 2 s x 3 misses: a SIGSTOPped rank is declared failed within about 6.5 s."""
    out = launch(2, _script(tmp_path), "stop", "2.0", str(tmp_path / "run"), "1", module=None, timeout=50)
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    detected_s = report["detected_wall"] - float((tmp_path / "run" / "stopped.rank1").read_text())
    print(f"SIGSTOPped rank detected after {detected_s:.2f} s with the defaults")
    assert report["failed"][0]["rank"] == 1
    assert 3.9 < detected_s < 9.0  # 4-6 s by design (+ scheduling); generous for a loaded machine
