"""A host lost and a network partitioned under ``python -m hpcnet.launch``, for real, on the local cluster.

Every job is the supervisor over ``mpirun $(scripts/cluster.sh env) -np 4`` on two hosts (two ranks each, the same
interface names on both); rank 3 (on the second host) sleeps in every step of the first attempt only
(``fault.slow_s``, ``fault.only_attempt=1``) so that the fault lands mid-training.  What the tests show about Open
MPI's mpirun is in docs/fault-tolerance.md ("A lost host", "A launcher that does not exit").
"""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from tests.helpers.ckpt import assert_same_tensors
from tests.helpers.cluster import cli
from tests.helpers.launch import Watched, clean_env, wait_for

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(240),
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts mpirun on the local cluster; serial pass"),
]

STEPS = 30
FAULT_AT = 15
HEARTBEAT_S = 1.0
MISSES = 3
DETECTION_S = MISSES * HEARTBEAT_S + 1.0
"""A lost host's ranks are named within this many seconds of the fault: 3 missed heartbeats + 1 s."""


def _train_args(data: Path, runs: Path) -> list[str]:
    return [f"data.dir={data}", f"run.dir={runs}", "run.name=x", "model.name=mlp", "model.options.hidden=[32]",
            "train.batch_size=8", f"train.steps={STEPS}", "train.eval_every=0", "run.log_every=1",
            "checkpoint.every_s=0", "checkpoint.every_steps=10", "checkpoint.full_every=1", "dist.probe=false",
            f"monitor.heartbeat_interval_s={HEARTBEAT_S:g}", f"monitor.heartbeat_misses={MISSES}"]


def _mpirun(*args: str) -> list[str]:
    return ["mpirun", *cli("env").stdout.split(), "-np", "4", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
            *args]


@pytest.fixture(scope="module")
def hosts(cluster):
    """The cluster's first two hosts, as the cluster has them (distinct interface names by default); every link
    healed afterwards."""
    yield cluster.hostnames[:2]
    for host in cluster.hostnames:
        cli("heal", host, check=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tmp_path_factory.mktemp("cluster-faults-data")


def _final_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from hpcnet.ckpt.load import load_checkpoint

    loaded = load_checkpoint(MPI.COMM_SELF, str(directory))
    assert loaded is not None and loaded.step == STEPS, f"no checkpoint at step {STEPS} in {directory}"
    return loaded.tensors


@pytest.fixture(scope="module")
def reference(hosts, data, tmp_path_factory):
    """The final checkpoint's tensors of the same job on the same hosts, uninterrupted."""
    runs = tmp_path_factory.mktemp("cluster-faults-reference")
    out = subprocess.run(_mpirun(*_train_args(data, runs)), cwd=runs, env=clean_env(), capture_output=True, text=True,
                         timeout=150)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return _final_tensors(runs / "x.ckpt")


class Supervised(Watched):
    """``python -m hpcnet.launch ... -- mpirun <cluster options> -np 4 ... hpcnet.train``, its output read as it
    comes."""

    def __init__(self, tmp_path: Path, data: Path, *launch_args: str, faults: tuple[str, ...] = ()) -> None:
        self.runs = tmp_path / "runs"
        super().__init__([sys.executable, "-m", "hpcnet.launch", "--max-restarts", "2", "--standby", "off",
                          *launch_args, "--",
                          *_mpirun(*_train_args(data, self.runs), "fault.slow_s=0.3", "fault.rank=3",
                                   "fault.only_attempt=1", *faults)], tmp_path)

    def wait_for_step(self, step: int, timeout_s: float = 60) -> None:
        assert wait_for(lambda: self.said(rf"step {step:2d}/{STEPS}") or self.proc.poll() is not None, timeout_s), \
            self.output[-3000:]
        assert self.proc.poll() is None, f"the job ended before step {step}:\n{self.output[-3000:]}"

    def wait(self, timeout_s: float = 100) -> int:
        try:
            status = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"the supervised job did not end in {timeout_s} s:\n{self.output[-4000:]}")
        self.reader.join(10)
        return status

    def launch_record(self) -> dict:
        (path,) = self.runs.glob("x-*/launch.json")
        return json.loads(path.read_text())

    def failure_path(self, attempt: int = 1) -> Path:
        return next(self.runs.glob("x-*")) / f"attempt-{attempt}" / "failure.json"

    def failure(self, attempt: int = 1) -> dict | None:
        paths = list(self.runs.glob(f"x-*/attempt-{attempt}/failure.json"))
        return json.loads(paths[0].read_text()) if paths else None


def _train_pids(cluster, host: str) -> list[str]:
    """The hpcnet.train processes in a host's namespace."""
    found = []
    for pid in cluster.pids(host):
        try:
            if b"hpcnet.train" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def _verify(directory: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "hpcnet.ckpt", "verify", str(directory)], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"step {STEPS}" in out.stdout, out.stdout
    return out.stdout


def _threads(pids: list[str]) -> dict[str, list[str]]:
    """What each thread of ``pids`` is doing, as the kernel sees it ("name state wait-channel"): the ranks of a cut-off
    host cannot send their stacks anywhere (their output goes to the unreachable mpirun)."""
    found = {}
    for pid in pids:
        rows = []
        for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
            try:
                stat = (task / "stat").read_text()
                rows.append(f"{stat[stat.index('(') + 1:stat.rindex(')')]} {stat[stat.rindex(')') + 2]} "
                            f"{(task / 'wchan').read_text()}")
            except (OSError, ValueError):
                continue
        found[pid] = rows
    return found


def _partition_until_restarted(job: "Supervised", cluster, host: str, grace_s: float) -> tuple[float, dict, float, int]:
    """Cut ``host`` off; once a failure is declared, its ranks ended by themselves and the supervisor ended the
    launcher and waits to restart, heal it; the job's end.  Returns (when cut, the first failure.json read, when the
    host's ranks were gone, the supervisor's status)."""
    healed = False
    try:
        cut = time.time()
        cli("partition", host)
        assert wait_for(lambda: job.failure(1) is not None or job.proc.poll() is not None, 30), job.output[-3000:]
        failure = job.failure(1)
        assert failure is not None, job.output[-3000:]
        # The cut-off host's ranks end by themselves: their monitors miss the other side's heartbeats too.
        assert wait_for(lambda: _train_pids(cluster, host) == [], MISSES * HEARTBEAT_S + 10), \
            (_threads(_train_pids(cluster, host)), job.output[-3000:])
        ranks_gone = time.time()
        # The launcher, which cannot reach its daemon there, is ended within the grace; then heal before the restart.
        assert wait_for(lambda: job.said("restarting from the newest checkpoint") or job.proc.poll() is not None,
                        grace_s + 20), job.output[-3000:]
        cli("heal", host)
        healed = True
        return cut, failure, ranks_gone, job.wait()
    finally:
        if not healed:
            cli("heal", host, check=False)
        job.stop()


def test_a_killed_host_is_named_restarted_and_the_run_ends_bit_identical(cluster, hosts, data, reference, tmp_path):
    a, b = hosts
    # The host is back as soon as `fail` returns; `fail` kills whatever appears on the host until nothing is left, so
    # a restart within its loop (--backoff-s 0) would lose its new daemon there and mpirun would wait for it forever.
    job = Supervised(tmp_path, data, "--backoff-s", "1")
    try:
        job.wait_for_step(FAULT_AT)
        killed = time.time()
        cli("fail", b)
        assert wait_for(lambda: cluster.pids(b) == [], 5), cluster.pids(b)
        status = job.wait()
    finally:
        job.stop()
    record = job.launch_record()
    first, *later = record["attempts"]
    # Open MPI's mpirun sees the TCP connection to the killed host's daemon close and ends the whole job at once
    # ("ORTE has lost communication with a remote daemon", naming the host; status 205), before the surviving ranks'
    # monitors miss a heartbeat: the supervisor names the host and its ranks from that message.
    assert first["lost_host"] and first["lost_host"]["host"] == b and first["lost_host"]["ranks"] == [2, 3], first
    assert first["restartable"], first
    failure = job.failure(1)
    if failure is not None:  # the surviving ranks' monitors got there first
        named = {entry["rank"]: entry["host"] for entry in failure["failed"]}
        assert named.get(2) == b and named.get(3) == b and failure["detected_host"] == a, failure
        detected = failure["detected_wall"]
    else:
        detected = first["end_unix"]
    print(f"host kill: named after {detected - killed:.2f} s ({'failure.json' if failure else 'mpirun'}), mpirun "
          f"status {first['status']}")
    assert detected - killed <= DETECTION_S, (detected - killed, first)
    assert f"host {b} lost (ranks 2, 3)" in job.output, job.output[-3000:]
    # the host back (nothing to do: `fail` leaves it up, empty), the next attempt resumes and finishes
    assert status == 0, job.output[-4000:]
    assert [attempt["status"] for attempt in later] == [0], record["attempts"]
    assert "resumed from" in job.output and f"done: {STEPS} steps" in job.output, job.output[-3000:]
    _verify(job.runs / "x.ckpt")
    assert_same_tensors(_final_tensors(job.runs / "x.ckpt"), reference)


def test_a_partition_mid_step_ends_both_sides_and_the_launcher_then_restarts(cluster, hosts, data, reference,
                                                                              tmp_path):
    a, b = hosts
    grace_s = 5.0
    # The backoff leaves time to heal the link after the launcher ended and before the next attempt starts.
    job = Supervised(tmp_path, data, "--backoff-s", "3", "--launcher-grace-s", f"{grace_s:g}")
    try:
        job.wait_for_step(FAULT_AT)
    except BaseException:
        job.stop()
        raise
    cut, failure, ranks_gone, status = _partition_until_restarted(job, cluster, b, grace_s)
    # Rank 0's side names the cut-off host's ranks within 3 missed heartbeats + 1 s (each side names the other: the
    # reports of both sides are merged into one failure.json on the shared file system).
    # The first report is either side's; the first host's ranks merge theirs into it by the time the launcher ended.
    assert failure["detected_wall"] - cut <= DETECTION_S, (failure, cut)
    merged_at = job.failure_path(1).stat().st_mtime
    failure = job.failure(1)
    assert {failure["detected_by"], *failure.get("also_detected_by", [])} & {0, 1}, failure
    # The first detector names the peers it watches on the cut-off host (one or both of its ranks).
    named = {entry["rank"]: entry["host"] for entry in failure["failed"]}
    assert {rank for rank, host in named.items() if host == b} & {2, 3}, failure
    # The message is the first report's: either side's (the cut-off host names the first one's ranks too).
    assert re.search(rf"rank \d on ({a}|{b}) missed {MISSES} heartbeats", failure["message"]), failure["message"]
    assert ranks_gone - cut <= MISSES * HEARTBEAT_S + 10, ranks_gone - cut
    record = job.launch_record()
    first, *later = record["attempts"]
    assert first["restartable"] and first["declared_unix"], first
    # mpirun ended (by itself, or killed by the supervisor) within the grace after the declared failure
    assert first["end_unix"] - first["declared_unix"] <= grace_s + 2, first
    print(f"partition: declared after {failure['detected_wall'] - cut:.2f} s (by rank {failure['detected_by']}, "
          f"last merge after {merged_at - cut:.2f} s), host's ranks gone after "
          f"{ranks_gone - cut:.2f} s, launcher status {first['status']} ended "
          f"{first['end_unix'] - first['declared_unix']:.2f} s after the declaration (ended by the supervisor: "
          f"{first['launcher_ended']})")
    assert status == 0, job.output[-4000:]
    assert [attempt["status"] for attempt in later] == [0], record["attempts"]
    _verify(job.runs / "x.ckpt")
    assert_same_tensors(_final_tensors(job.runs / "x.ckpt"), reference)


def test_a_partition_mid_checkpoint_commits_nothing_of_that_save_and_the_run_ends_bit_identical(
        cluster, hosts, data, reference, tmp_path):
    """The cut lands in the save of step 20, once every rank has told its watchers that it is in the save, while
    rank 3 (on the cut-off host) takes 4 s to arrive at the ranks' meeting before the file's collective create:
    the others wait for it there, outside HDF5, beating.  Nothing the ranks announced lets their watchers allow
    them more silence there (only the structure calls after the create are quiet), so both sides declare the
    failure within 3 missed heartbeats and the cut-off ranks end themselves.  That save is never committed
    (rank 0 commits; attempt 1's fence is closed before attempt 2 starts), every committed file verifies, and the
    restart from step 10 ends bit-identical to an uninterrupted run."""
    _, b = hosts
    grace_s = 5.0
    job = Supervised(tmp_path, data, "--backoff-s", "3", "--launcher-grace-s", f"{grace_s:g}",
                     faults=("fault.slow_save_s=4",))
    try:
        job.wait_for_step(20, 90)  # the save of step 20 starts; rank 3 sleeps in it for 4 s
        time.sleep(1.5)  # every rank has told its watchers that it is in the save (beats every 1 s)
        assert not job.said("checkpoint at step 20"), job.output[-3000:]
    except BaseException:
        job.stop()
        raise
    cut, failure, _, status = _partition_until_restarted(job, cluster, b, grace_s)
    assert failure["detected_wall"] - cut <= DETECTION_S, (failure, cut)
    record = job.launch_record()
    first, *later = record["attempts"]
    print(f"partition mid-checkpoint: declared after {failure['detected_wall'] - cut:.2f} s ({failure['kind']}), "
          f"launcher status {first['status']}, attempt 1 committed {first['new_checkpoints']}")
    assert first["restartable"] and first["end_unix"] - first["declared_unix"] <= grace_s + 2, first
    assert first["new_checkpoints"] == ["ckpt-0000000010.h5"], first
    assert status == 0, job.output[-4000:]
    assert [attempt["status"] for attempt in later] == [0], record["attempts"]
    assert "resumed from" in job.output and "at step 10" in job.output, job.output[-3000:]
    _verify(job.runs / "x.ckpt")
    assert_same_tensors(_final_tensors(job.runs / "x.ckpt"), reference)
