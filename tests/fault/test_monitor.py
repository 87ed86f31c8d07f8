"""The monitor thread: under MPI at any size, and launches (serial pass) where a rank is SIGSTOPped, stalls, or
desyncs, and the job must end with status 75 and a report naming the rank and its host.
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

from hpcnet.config import MonitorConfig
from hpcnet.config.load import load_config
from hpcnet.errors import ExitCode
from hpcnet.fault.failure import DUMP_SIGNAL
from hpcnet.fault.flightrec import FLOOR_SCALED_MAX_S, warmup_timeout
from hpcnet.fault.heartbeat import ring_peers
from hpcnet.fault.liveness import halted, process_threads
from hpcnet.fault.monitor import Monitor
from hpcnet.world import discover, machine_sharing
from tests.helpers.dirs import made_dir
from tests.helpers.launch import PROGRAMS, ROOT, clean_env, wait_for


def test_monitor_options_are_validated():
    assert load_config(overrides=["monitor.heartbeat_interval_s=0.5"]).monitor.heartbeat_interval_s == 0.5
    with pytest.raises(ValueError, match="monitor.heartbeat_misses"):
        load_config(overrides=["monitor.heartbeat_misses=0"])


# --- the monitor thread under MPI --------------------------------------------------------

def _monitor(comm, run_dir, found, **options):
    cfg = MonitorConfig(**{"heartbeat_interval_s": 0.2, **options})
    return Monitor(cfg, comm, discover(comm), run_dir, on_failure=found.append)


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


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_the_stall_floor_grows_with_the_ranks_per_core_of_the_machine(comm, mpi_tmp_path):
    """The floor is scaled by this machine's ranks per core (the union of their affinities), up to the cap."""
    ranks, cores = machine_sharing(comm)
    assert ranks >= comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size() and cores >= 1
    monitor = _monitor(comm, mpi_tmp_path, [], stall_floor_s=10.0).start()
    floor, first_timeout = monitor.floor_s, monitor._timeout_s
    monitor.stop()
    assert floor == pytest.approx(min(10.0 * max(1.0, ranks / cores), FLOOR_SCALED_MAX_S)) and floor >= 10.0
    assert first_timeout == pytest.approx(warmup_timeout(floor))
    fixed = _monitor(comm, mpi_tmp_path, [], stall_floor_s=10.0, stall_timeout_s=7.0).start()
    timeout = fixed._timeout_s
    fixed.stop()
    assert timeout == 7.0  # a configured timeout is used as is


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_silent_rank_is_named_by_its_watchers(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    host_of_1 = comm.allgather(MPI.Get_processor_name())[1]  # another host than some watchers' on the local cluster
    found = []
    # 0.5 s beats (1.5 s of silence is a failure): at 0.2 s a healthy rank of the 2 x 2 cluster pass, 4 ranks on 2
    # cores, once went 0.61 s unscheduled and was declared failed beside the muted one.
    monitor = _monitor(comm, mpi_tmp_path, found, heartbeat_interval_s=0.5).start()
    monitor.step(3)
    time.sleep(1.0)  # two beat intervals: a beat carrying step 3 has left before rank 1 falls silent
    if rank == 1:
        monitor._muted = True  # stops beating, as a SIGSTOPped rank would
    watchers = [w for w in range(size) if 1 in ring_peers(w, size)[1]]
    detected = wait_for(lambda: found, 15) if rank in watchers else True
    comm.Barrier()  # before any assert: a rank that raised here would leave the others in the barrier
    monitor.stop()
    assert detected, "the silent rank was not detected"
    if rank not in watchers:
        assert found == []
    else:
        report = found[0]
        assert report["kind"] == "heartbeat" and [f["rank"] for f in report["failed"]] == [1]
        assert report["failed"][0]["host"] == host_of_1 and report["failed"][0]["last_step"] == 3
        assert report["detected_by"] == rank
        assert json.loads((mpi_tmp_path / "failure.json").read_text())["failed"][0]["rank"] == 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_silent_rank_whose_collectives_keep_ending_is_alive(comm, mpi_tmp_path):
    """At 16 ranks a core a healthy rank's beats once did not arrive for 21 s while it took part in every
    collective; one that ends proves every rank was alive (FlightRecorder.all_alive_at)."""
    found = []
    monitor = _monitor(comm, mpi_tmp_path, found, heartbeat_interval_s=0.5).start()
    monitor.step(3)
    time.sleep(0.5)
    if comm.Get_rank() == 1:
        monitor._muted = True  # its beats stop: 3 s of silence is two heartbeat deadlines
    until = time.monotonic() + 3.0
    more = True
    while more:
        with monitor.collective("loss.allreduce"):
            more = comm.allreduce(int(time.monotonic() < until), op=MPI.MIN) == 1
        time.sleep(0.05)
    comm.Barrier()
    monitor.stop()
    assert found == []


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_stall_dumps_every_rank_and_names_who_is_behind(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    run_dir = made_dir(comm, mpi_tmp_path / "stall")
    found = []
    monitor = _monitor(comm, run_dir, found, stall_timeout_s=0.5).start()
    monitor.step(2)
    if rank == 0:
        monitor.recorder.start("allreduce.bucket", bucket=0, nbytes=4096)  # never ends: a stall
        wait_for(lambda: found, 20)
    dumped = wait_for(lambda: (run_dir / f"stall.rank{rank}.txt").exists(), 20)
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
    run_dir = made_dir(comm, mpi_tmp_path / "desync")
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

# --- launches: the real entry point under mpirun, a rank stopped or stalled ------------------

def _train_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["data.dataset=sleepy_model:make_dataset", f"run.dir={tmp_path / 'run'}", "run.dir_exact=true",
            "model.name=mlp", "train.batch_size=8", "train.steps=100000",
            "train.eval_every=0", "run.log_every=1", "run.metrics=all", "dist.probe=false",
            "checkpoint.every_s=0", "checkpoint.at_end=false", "monitor.heartbeat_interval_s=0.3", *extra]


def _env() -> dict[str, str]:
    return {"PYTHONPATH": f"{PROGRAMS}:{ROOT}"}  # sleepy_model


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_sigstopped_rank_ends_the_job_and_is_named(tmp_path):
    cmd = ["mpirun", "-np", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", *_train_args(tmp_path)]
    proc = subprocess.Popen(cmd, env=clean_env(**_env()), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        metrics = tmp_path / "run" / "metrics.rank1.jsonl"
        assert wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 5, 60), \
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
    out = launch(2, *_train_args(tmp_path, "model.factory=sleepy_model:make_sleepy", "monitor.stall_timeout_s=2"),
                 env=_env(), timeout=100)
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


def _script(tmp_path: Path) -> str:
    (tmp_path / "run").mkdir()
    return str(PROGRAMS / "monitor_loop.py")


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


def test_a_stopped_peer_is_not_waited_for():
    """A SIGSTOPped rank holds the dump signal until it resumes, so the rank that declares it dead does not
    wait for its stacks before the abort (half a second of every hang's recovery)."""
    def _stopped(pid):
        return halted(process_threads(pid, None))

    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert not _stopped(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not _stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert _stopped(proc.pid)  # gone
