"""Elastic shrink and grow under ``python -m hpcnet.launch --exclude-failed-hosts --min-ranks N``, for real, on the
local cluster (docs/fault-tolerance.md, "Shrink and grow").

The job is the supervisor over ``mpirun $(scripts/cluster.sh env) -np 4`` on two hosts (two ranks each), listed
by their addresses as a cluster's host file often lists them: the ranks' host names (``failure.json``'s) are not
the launcher's entries, and do not resolve on the launching host.  Rank 1 (on the first host, there in every
attempt) sleeps in every step so that the faults land mid-training.  The second host is cut off (``cluster.sh
partition``): both sides name each other in ``failure.json``; the supervisor maps each name to its address by what
the ranks reported at their start, and its probe of the addresses tells which one the launcher cannot reach; the
next attempt runs its 2 ranks on the first host; the link healed, the probe answers, the attempt saves and stops,
and the last one runs 4 ranks on both hosts again.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

from hpcnet.bench.common import step_times
from hpcnet.paths import metrics_file, rank_log
from tests.helpers.cluster import cli
from tests.helpers.launch import Watched, clean_env, wait_for

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(360),
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="starts mpirun on the local cluster; serial pass"),
]

STEPS = 40
EVERY = 10
BATCH = 8
FAULT_AT = 13


def _train_args(data: Path, runs: Path) -> list[str]:
    return [f"data.dir={data}", f"run.dir={runs}", "run.name=x", "model.name=mlp", "model.options.hidden=[32]",
            f"train.batch_size={BATCH}", f"train.steps={STEPS}", "train.eval_every=0", "run.log_every=1",
            "checkpoint.every_s=0", f"checkpoint.every_steps={EVERY}", "checkpoint.full_every=1",
            "dist.probe=false", "monitor.heartbeat_interval_s=1", "monitor.heartbeat_misses=5",
            "fault.slow_s=0.3", "fault.rank=1"]


class Elastic(Watched):
    """The supervised job, its output read as it comes."""

    def __init__(self, tmp_path: Path, data: Path, addresses: list[str]) -> None:
        self.runs = tmp_path / "runs"
        options = cli("env").stdout.split()
        at = options.index("--host")
        options[at:at + 2] = ["--host", ",".join(f"{address}:2" for address in addresses)]
        mpirun = ["mpirun", *options, "-np", "4", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train",
                  *_train_args(data, self.runs)]
        super().__init__([sys.executable, "-m", "hpcnet.launch", "--max-restarts", "2", "--standby", "off",
                          "--backoff-s", "0", "--launcher-grace-s", "5", "--exclude-failed-hosts", "--min-ranks",
                          "2", "--probe-every-s", "1", "--probe-timeout-s", "4", "--", *mpirun], tmp_path)

    def wait_said(self, pattern: str, after: float = 0.0, timeout_s: float = 60) -> float:
        assert wait_for(lambda: self.said(pattern, after) or self.proc.poll() is not None, timeout_s), \
            f"no {pattern!r} in {timeout_s} s:\n{self.output[-3000:]}"
        when = self.said(pattern, after)
        assert when is not None, f"the job ended before {pattern!r}:\n{self.output[-3000:]}"
        return when

    def launch_dir(self) -> Path:
        return next(self.runs.glob("x-*"))

    def log(self, attempt: int) -> str:
        return (self.launch_dir() / f"attempt-{attempt}" / rank_log(0)).read_text()

    def steps(self, attempt: int) -> list[int]:
        return sorted(step_times(self.launch_dir() / f"attempt-{attempt}" / metrics_file(0)))


@pytest.fixture
def hosts(cluster):
    yield cluster.hostnames[:2]
    for host in cluster.hostnames:
        cli("heal", host, check=False)


def test_a_lost_host_shrinks_the_job_and_its_return_grows_it_back(cluster, hosts, tmp_path):
    a, b = hosts
    ia, ib = (cluster.addresses[cluster.hostnames.index(h)] for h in hosts)
    job = Elastic(tmp_path, tmp_path / "data", [ia, ib])
    healed = False
    try:
        job.wait_said(rf"step {FAULT_AT:2d}/{STEPS}", timeout_s=120)  # a start-up on a loaded machine
        cli("partition", b)
        shrunk = job.wait_said(r"shrinking: 4 -> 2 rank\(s\)", timeout_s=60)
        job.wait_said(r"attempt 2/", after=shrunk)
        job.wait_said(r"resumed from", after=shrunk)
        job.wait_said(rf"step \d+/{STEPS}", after=shrunk)  # training on the survivors
        cli("heal", b)
        healed = True
        status = job.proc.wait(timeout=240)
        job.reader.join(10)
    finally:
        if not healed:
            cli("heal", b, check=False)
        job.stop()
    out = job.output
    assert status == 0, out[-4000:]
    record = json.loads((job.launch_dir() / "launch.json").read_text())
    first, second, third = record["attempts"]
    # the partition: both sides named by their host names, each mapped to its address in the launcher's list; the
    # probe of the addresses decides that the second host is the one lost
    assert first["restartable"], first
    assert all(f"{h} (the launcher's {i}: an address its ranks reported)" in out for h, i in ((a, ia), (b, ib))), \
        out[-4000:]
    assert f"{ib} did not answer the probe" in out and f"{ia} answered it (kept)" in out, out[-4000:]
    assert f"shrinking: 4 -> 2 rank(s) on {ia} (without {ib})" in out, out[-4000:]
    assert second["excluded_hosts"] == [ib] and second["ranks"] == 2, second
    assert f"--host {ia}:2 " in " ".join(second["command"]), second["command"]
    # the host back: the shrunk attempt saved and stopped (76), the last one ran at the full size
    assert second["grow"] == [ib] and second["status"] == 76, second
    assert f"excluded host {ib} answers again" in out and "every host is back" in out, out[-4000:]
    assert third["excluded_hosts"] == [] and third["ranks"] == 4 and third["status"] == 0, third
    assert "4 rank(s) on 2 node(s)" in job.log(1), job.log(1)[:2000]
    assert "2 rank(s) on 1 node(s)" in job.log(2), job.log(2)[:2000]
    assert "4 rank(s) on 2 node(s)" in job.log(3), job.log(3)[:2000]
    # attempt 2 resumed from the last checkpoint attempt 1 committed; attempt 3 from the one attempt 2 saved as it
    # stopped: the failure's steps since the checkpoint are recomputed once, the grow recomputes nothing
    resumed = [int(re.search(r"resumed from \S+ at step (\d+)", job.log(n)).group(1)) for n in (2, 3)]
    committed = sorted(int(re.search(r"(\d+)", name).group(1)) for name in first["new_checkpoints"])
    assert resumed[0] == committed[-1], (resumed, first["new_checkpoints"])
    steps = [job.steps(n) for n in (1, 2, 3)]
    assert steps[1] == list(range(resumed[0] + 1, resumed[1] + 1)), steps[1]
    assert steps[2] == list(range(resumed[1] + 1, STEPS + 1)), steps[2]
    assert resumed[0] < resumed[1] < STEPS, resumed
    # every step once from the checkpoint attempt 2 resumed from: the data position is the samples of each step
    from hpcnet.ckpt.load import load_checkpoint

    final = load_checkpoint(MPI.COMM_SELF, "auto", job.runs / "x.ckpt")
    assert final is not None and final.step == STEPS
    samples = BATCH * (4 * resumed[0] + 2 * (resumed[1] - resumed[0]) + 4 * (STEPS - resumed[1]))
    sampler = final.meta["sampler"]
    train_samples = int(re.search(r"(\d+) train / \d+ eval samples", job.log(1)).group(1))
    assert sampler["epoch"] * train_samples + sampler["samples_consumed_in_epoch"] == samples, (sampler, samples)
    verify = subprocess.run([sys.executable, "-m", "hpcnet.ckpt", "verify", str(job.runs / "x.ckpt")],
                            env=clean_env(), capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    print(f"shrink at step {resumed[0]} (4 -> 2 ranks), grow at step {resumed[1]} (2 -> 4 ranks)")
