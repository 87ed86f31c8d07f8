"""Deadlines on checkpoint I/O and start-up, and saves that must not be failures.

Pure logic on one process; the monitor's deadlines under MPI at any size;
and launches (serial pass): a checkpoint writer stuck with the GIL released
(the monitors report it), every rank stuck holding the GIL (only the native
watchdog can), a hang at start-up, a peer whose saves are 10 s slow (not a
failure), and the stacks signal while a thread holds the GIL.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcnet.config import CheckpointConfig, DistConfig, FaultConfig, MonitorConfig
from hpcnet.errors import ConfigError, ExitCode
from hpcnet.fault.failure import DUMP_SIGNAL, stall_report
from hpcnet.fault.heartbeat import decode
from hpcnet.fault.monitor import Monitor
from hpcnet.fault.watchdog import (
    IO_TIMEOUT_FLOOR_S,
    STARTUP_PHASES,
    Deadlines,
    analyze_phase,
    io_timeout_s,
    startup_phase,
)
from hpcnet.world import discover
from tests.helpers.data import shared_data_dir
from tests.helpers.dirs import made_dir
from tests.helpers.launch import PROGRAMS, ROOT, clean_env, wait_for

# --- pure logic ------------------------------------------------------------------


def test_io_timeout_rules():
    assert io_timeout_s(30.0, 500.0, 10**12) == 30.0  # configured wins
    assert io_timeout_s(0.0, None) == IO_TIMEOUT_FLOOR_S == 120.0
    assert io_timeout_s(0.0, 3.0) == 120.0  # 10 x 3 s is under the floor
    assert io_timeout_s(0.0, 40.0) == 400.0  # 10 x the last save
    assert io_timeout_s(0.0, None, 50 * 2**30) == 5120.0  # a first save of 50 GiB: at 10 MiB/s


def test_deadlines_expire_the_first_and_start_up_does_not_count_loads():
    changes = []
    deadlines = Deadlines(on_change=lambda: changes.append(len(deadlines.guards())))
    startup = deadlines.open("startup", 5.0, kind="startup", option="monitor.startup_timeout_s")
    assert deadlines.expired(startup.started + 4.9) is None
    assert deadlines.expired(startup.started + 5.1) is startup
    with deadlines.guard("checkpoint.load", 100.0, what="checkpoint.load") as load:
        assert deadlines.innermost() is load and deadlines.earliest() is startup and deadlines.quiet() is None
        time.sleep(0.2)
    assert startup.extra_s >= 0.2  # the load's time is given back to start-up
    assert deadlines.expired(startup.started + 5.1) is None
    structure = deadlines.open("checkpoint.structure", 60.0, quiet=True)
    wait = deadlines.open("checkpoint.wait", 60.0)
    assert deadlines.quiet() is structure and deadlines.innermost() is structure  # a wait names what it waits for
    deadlines.close(wait)
    deadlines.close(structure)
    deadlines.close(structure)  # twice is harmless
    deadlines.close(startup)
    assert deadlines.guards() == [] and changes == [1, 2, 1, 2, 3, 2, 1, 0]
    with pytest.raises(ValueError, match="unknown guard"):
        deadlines.open("checkpoint.typo", 1.0)
    with pytest.raises(ValueError, match="positive number"):
        deadlines.open("checkpoint.load", float("nan"))


def test_new_options_are_validated():
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="checkpoint.timeout_s"):
            CheckpointConfig(timeout_s=bad)
        with pytest.raises(ConfigError, match="fault.slow_save_s"):
            FaultConfig(slow_save_s=bad)
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="monitor.startup_timeout_s"):
            MonitorConfig(startup_timeout_s=bad)
    for name in ("stuck_save_at_step", "stuck_fs_at_step"):
        with pytest.raises(ConfigError, match=f"fault.{name}"):
            FaultConfig(**{name: -1})
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="dist.startup_timeout_s"):
            DistConfig(startup_timeout_s=bad)
    assert DistConfig().startup_timeout_s == 120.0
    with pytest.raises(ConfigError, match="fault.hang_at_startup"):
        FaultConfig(hang_at_startup="first-step")


def _answer(guard, guard_s=0.0):
    return {"guard": guard, "guard_s": guard_s, "step": 0}


def test_a_start_up_phase_names_the_ranks_and_hosts_that_did_not_arrive():
    hosts = ("hostA", "hostA", "hostB", "hostB", "hostC")
    states = {0: _answer("dist.rendezvous", 120.0), 1: _answer("dist.rendezvous", 119.5),
              2: _answer("startup"), 3: None, 4: _answer("dist.groups")}
    analysis = analyze_phase(states, "dist.rendezvous", hosts)
    assert analysis["behind"] == [2] and analysis["silent"] == [3]
    assert analysis["lines"] == [
        "rank 0 on hostA: in the rendezvous for 120.0 s", "rank 1 on hostA: in the rendezvous for 119.5 s",
        "rank 2 on hostB: did not arrive (not in a start-up phase; its log says why)",
        "rank 3 on hostB: no answer (hung, dead, or its monitor thread is blocked)",
        "rank 4 on hostC: past it, in the transport's process groups and first collectives",
        "the rendezvous (dist.rendezvous) waits for ranks [2, 3] on hostB: they did not arrive"]
    report = stall_report("startup", "the rendezvous has not finished after 120.0 s (dist.startup_timeout_s = 120 s)",
                          states, hosts, detector=0, phase="dist.rendezvous")
    assert report["phase"] == "dist.rendezvous" and report["kind"] == "startup"
    assert [(f["rank"], f["host"], f["why"]) for f in report["failed"]] == [(2, "hostB", "behind"),
                                                                           (3, "hostB", "silent")]
    assert report["message"].startswith("start-up phase dist.rendezvous past its deadline detected by rank 0 on hostA")
    everyone = analyze_phase({r: _answer("dist.probe", 5.0) for r in range(2)}, "dist.probe", hosts)
    assert everyone["behind"] == everyone["silent"] == []
    assert "every rank is in the topology probe" in everyone["lines"][-1]
    assert list(STARTUP_PHASES) == ["dist.probe", "dist.rendezvous", "dist.first", "dist.groups"]  # start-up order


# --- the monitor's deadlines under MPI ---------------------------------------------------

def _monitor(comm, run_dir, found, **options):
    cfg = MonitorConfig(heartbeat_interval_s=0.5, memory_every_steps=0, **options)
    return Monitor(cfg, comm, discover(comm), run_dir, on_failure=found.append)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_an_expired_checkpoint_deadline_is_reported_like_a_stall(comm, mpi_tmp_path):
    rank, size = comm.Get_rank(), comm.Get_size()
    last_host = comm.allgather(MPI.Get_processor_name())[-1]  # another host than rank 0's on the local cluster
    run_dir = made_dir(comm, mpi_tmp_path / "ckpt-deadline")
    found = []
    monitor = _monitor(comm, run_dir, found).start()
    monitor.step(1)
    # Every rank saves; the last one never gets to the create, the others wait for it there. Rank 0's
    # deadline comes first: one reporter, whose question every other rank answers from inside its guards.
    write = monitor.deadlines.open("checkpoint.write", 0.6 if rank == 0 else 30.0, what="checkpoint.write (step 1)")
    waiting = monitor.deadlines.open("checkpoint.create" if rank == size - 1 else "checkpoint.meet", 30.0)
    if rank == 0:
        wait_for(lambda: found, 20)
    dumped = wait_for(lambda: (run_dir / f"stall.rank{rank}.txt").exists(), 20)
    # Every rank keeps its guards open until rank 0 has its report (its answer says where it is), then
    # closes them at once: a test that lingered past the deadline plus the grace would meet the native watchdog.
    comm.Barrier()
    monitor.deadlines.close(waiting)
    monitor.deadlines.close(write)
    monitor.stop()
    assert dumped
    dump = (run_dir / f"stall.rank{rank}.txt").read_text()
    assert "== guarded waits" in dump and "checkpoint.write (step 1)" in dump
    if rank == 0:
        assert found, "the expired deadline was not reported"
        report = found[0]
        assert report["kind"] == "checkpoint" and "checkpoint.write (step 1) has not finished" in report["detail"]
        assert "(checkpoint.timeout_s = 1 s)" in report["detail"]
        if size > 1:
            assert report["failed"] == [{"rank": size - 1, "host": last_host, "last_step": 1, "why": "behind"}]


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_start_up_has_a_deadline(comm, mpi_tmp_path):
    rank = comm.Get_rank()
    run_dir = made_dir(comm, mpi_tmp_path / "startup")
    found = []
    monitor = _monitor(comm, run_dir, found, startup_timeout_s=0.5).start()
    # No first step: start-up never ends.  Whichever rank's deadline is seen first reports (at 4 ranks on
    # 2 cores not always rank 0): failure.json is written before the recorder is called.
    wait_for(lambda: (run_dir / "failure.json").exists(), 20)
    wait_for(lambda: (run_dir / f"stall.rank{rank}.txt").exists(), 20)
    monitor.step(1)  # ends start-up at once (see the test above)
    comm.Barrier()
    monitor.stop()
    reports = [report for found_here in comm.allgather(found) for report in found_here]
    startup = [report for report in reports if report["kind"] == "startup"]
    assert startup, reports
    assert "start-up (before the first step) has not finished" in startup[0]["detail"]
    assert "monitor.startup_timeout_s" in startup[0]["detail"]
    calm = []
    monitor = _monitor(comm, run_dir, calm, startup_timeout_s=0.5).start()
    monitor.step(1)  # the first step ends start-up
    time.sleep(1.0)
    comm.Barrier()
    monitor.stop()
    assert calm == []


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_a_start_up_phase_that_a_rank_never_joins_is_reported_with_that_rank(comm, mpi_tmp_path):
    """The last rank never reaches the rendezvous; the others wait there: the report names the phase and that rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    last_host = comm.allgather(MPI.Get_processor_name())[-1]
    run_dir = made_dir(comm, mpi_tmp_path / "phase")
    found = []
    monitor = _monitor(comm, run_dir, found).start()
    joined = rank < size - 1 or size == 1
    phase = startup_phase(monitor.deadlines, "dist.rendezvous", 0.6 if rank == 0 else 30.0) if joined else None
    guard = phase.__enter__() if phase else None
    if rank == 0:
        wait_for(lambda: found, 20)
    wait_for(lambda: (run_dir / f"stall.rank{rank}.txt").exists(), 20)
    comm.Barrier()
    monitor.deadlines.close(guard)
    monitor.step(1)
    monitor.stop()
    if rank == 0:
        assert found, "the expired phase was not reported"
        report = found[0]
        assert report["kind"] == "startup" and report["phase"] == "dist.rendezvous"
        assert "(dist.startup_timeout_s = 1 s)" in report["detail"]
        if size > 1:
            assert [(f["rank"], f["host"]) for f in report["failed"]] == [(size - 1, last_host)]
            assert f"waits for ranks [{size - 1}] on {last_host}: it did not arrive" in report["message"]
        else:
            assert report["failed"] == [] and "every rank is in the rendezvous" in report["message"]


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_checkpoint_operations_are_guarded(comm, mpi_tmp_path):
    import torch

    from hpcnet.ckpt.manager import CheckpointManager

    opened = []

    class Recording(Deadlines):
        def open(self, name, timeout_s, **options):
            opened.append((name, timeout_s))
            return super().open(name, timeout_s, **options)

    deadlines = Recording()
    tensors = {"model/w": torch.arange(64, dtype=torch.float32).reshape(8, 8)}
    with CheckpointManager(comm, mpi_tmp_path / "guarded", deadlines=deadlines, timeout_s=0.0) as manager:
        manager.save(1, tensors, {"state": {}}, {"rank": comm.Get_rank()})
        manager.wait()
        assert manager._last_save_s is not None
        manager.load("auto")
    assert deadlines.guards() == []  # all closed, the writer thread's too
    # checkpoint.write: each stretch of the save, in the training thread or the writer's, has its own guard
    assert sorted(set(n for n, _ in opened)) == ["checkpoint.create", "checkpoint.load", "checkpoint.meet",
                                                 "checkpoint.save", "checkpoint.structure", "checkpoint.wait",
                                                 "checkpoint.write"]
    assert all(t == 120.0 for _, t in opened)  # a small checkpoint: the floor


# --- launches -------------------------------------------------------------------------

def _train(tmp_path: Path, *extra: str) -> list[str]:
    return ["data.dataset=synthetic-images", f"data.dir={shared_data_dir(tmp_path)}", "data.options.num_train=512",
            "data.options.num_eval=64", f"run.dir={tmp_path / 'run'}", "run.dir_exact=true",
            f"checkpoint.dir={tmp_path / 'ckpt'}", "model.name=mlp", "train.batch_size=8", "train.steps=12",
            "train.eval_every=0", "dist.probe=false", "checkpoint.every_steps=6", *extra]


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_a_stuck_checkpoint_write_ends_the_job_with_75(launch, tmp_path):
    started = time.time()
    out = launch(2, *_train(tmp_path, "checkpoint.timeout_s=5", "fault.stuck_save_at_step=6"), timeout=180)
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    print(f"stuck write: status 75 {time.time() - started:.1f} s after the start, "
          f"{report['detected_wall'] - started:.1f} s to the report")
    # The file's collective create is the first stretch of a save, in the training thread: the save is what hangs.
    assert report["kind"] == "checkpoint" and "checkpoint.save (step 6) has not finished" in report["detail"]
    assert [f["rank"] for f in report["failed"]] == [1]  # the last rank (fault.rank=-1) never got to the create
    assert all((tmp_path / "run" / f"stall.rank{r}.txt").exists() for r in range(2))
    assert "in _io_fault" in (tmp_path / "run" / "stall.rank1.txt").read_text()  # where its save is stuck
    assert "checkpoint I/O past its deadline detected" in out.stderr
    assert not (tmp_path / "ckpt" / "ckpt-0000000006.h5").exists()


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_a_stuck_file_system_ends_the_job_with_75_although_no_python_runs(launch, tmp_path):
    started = time.time()
    out = launch(2, *_train(tmp_path, "checkpoint.timeout_s=5", "fault.stuck_fs_at_step=6",
                            "monitor.heartbeat_interval_s=0.5"), timeout=180)
    elapsed = time.time() - started
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    print(f"stuck file system: status 75 after {elapsed:.1f} s; failure.json by the native watchdog of rank "
          f"{report['detected_by']}")
    assert report["kind"] == "checkpoint" and report["native"] is True
    assert "checkpoint.save (step 6) did not finish within 5 s (checkpoint.timeout_s)" in report["detail"]
    assert "no Python code could run on this rank" in out.stderr
    assert "in block_holding_the_gil" in out.stderr  # the stacks, printed by faulthandler's C thread


@pytest.mark.launch
@pytest.mark.timeout(300)
def test_a_peer_whose_saves_are_10_s_slow_is_not_a_failure(launch, tmp_path):
    """Item 5: the others wait for it outside HDF5, beating; with the defaults (deadline 120 s). 10 s is longer
    than the heartbeats' 6 s (3 missed beats of 2 s), so a save that blocked beats would be declared a hang."""
    started = time.monotonic()
    out = launch(2, *_train(tmp_path, "fault.slow_save_s=10", "fault.rank=0"), timeout=280)
    elapsed = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "run" / "failure.json").exists()
    assert (tmp_path / "ckpt" / "ckpt-0000000012.h5").exists()
    assert elapsed > 20  # two saves, each 10 s late on rank 0
    print(f"10 s slow saves on rank 0: finished with 0 in {elapsed:.1f} s, no failure.json")


@pytest.mark.launch
@pytest.mark.timeout(200)
def test_a_hang_at_start_up_ends_within_the_start_up_deadline(launch, tmp_path):
    started = time.time()
    out = launch(2, "data.dataset=slow_dataset:make_dataset", f"run.dir={tmp_path / 'run'}", "run.dir_exact=true",
                 "model.name=mlp", "dist.probe=false", "monitor.startup_timeout_s=10",
                 env={"PYTHONPATH": f"{PROGRAMS}:{ROOT}"}, timeout=180)
    elapsed = time.time() - started
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    print(f"start-up hang: status 75 after {elapsed:.1f} s ({report['detected_wall'] - started:.1f} s to the report)")
    assert report["kind"] == "startup" and "monitor.startup_timeout_s = 10 s" in report["detail"]
    assert "in make_dataset" in (tmp_path / "run" / "stall.rank1.txt").read_text()
    assert elapsed < 120


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_a_rank_that_never_joins_the_rendezvous_ends_the_job_within_the_deadline(launch, tmp_path):
    """fault.hang_at_startup: rank 1 never joins the torch.distributed rendezvous; rank 0 waits in it."""
    started = time.time()
    out = launch(2, *_train(tmp_path, "dist.backend=gloo", "dist.startup_timeout_s=4",
                            "fault.hang_at_startup=rendezvous", "fault.rank=1"), timeout=100)
    elapsed = time.time() - started
    assert out.returncode == ExitCode.RESTARTABLE, out.stderr
    report = json.loads((tmp_path / "run" / "failure.json").read_text())
    print(f"rank 1 never joins the rendezvous: status 75 after {elapsed:.1f} s "
          f"({report['detected_wall'] - started:.1f} s to the report)")
    assert report["kind"] == "startup" and report["phase"] == "dist.rendezvous"
    assert "(dist.startup_timeout_s = 4 s)" in report["detail"]
    assert [f["rank"] for f in report["failed"]] == [1]
    assert "start-up phase dist.rendezvous past its deadline" in out.stderr
    assert "waits for ranks [1] on" in out.stderr
    assert "in before_phase" in (tmp_path / "run" / "stall.rank1.txt").read_text()
    assert elapsed < 60


@pytest.mark.launch
@pytest.mark.timeout(120)
def test_stacks_signal_works_while_a_thread_holds_the_gil_and_another_waits_in_mpi(tmp_path):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("launches its own mpirun; runs in the serial pass")
    holder = PROGRAMS / "gil_holder.py"
    proc = subprocess.Popen(["mpirun", "-np", "2", sys.executable, "-m", "mpi4py", str(holder),
                             str(tmp_path)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "holding"
        time.sleep(1.0)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(ranks) == 2
        for pid in ranks:
            os.kill(int(pid), DUMP_SIGNAL)
        time.sleep(3.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    lines = holder.read_text().splitlines()
    barrier_line = lines.index(next(line for line in lines if "comm.Barrier()" in line))
    assert "in block_holding_the_gil" in err  # the thread that holds the GIL
    assert f'holder.py", line {barrier_line + 1} in <module>' in err  # the main thread, inside MPI_Barrier
    assert "in _run" in err  # the monitor threads, blocked behind the GIL on rank 0
    assert err.count("most recent call first") >= 4  # several threads on each of the two ranks


class _Link:
    session = 1

    def __init__(self):
        self.beats = []

    def send_beat(self, dests, vector):
        self.beats.append(decode(vector))


def test_extra_beats_never_delay_the_next_regular_one(tmp_path):
    """A guard's announcement is an extra beat; a burst of them (a save opens and closes several) must
    not push the regular beats back, or the watchers see a silence after the burst."""
    world = discover(MPI.COMM_SELF)
    monitor = Monitor(MonitorConfig(heartbeat_interval_s=2.0), MPI.COMM_SELF, world, tmp_path)
    monitor._link = link = _Link()
    monitor._beat_if_due(0.0)
    for t in np.arange(0.1, 1.9, 0.1):  # 18 announcements within one interval
        monitor._beat_now = True
        monitor._beat_if_due(t)
    monitor._beat_if_due(1.95)
    assert len(link.beats) == 19
    monitor._beat_if_due(2.0)  # the regular beat, on time
    assert len(link.beats) == 20
