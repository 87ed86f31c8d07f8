"""The job scripts under a real SLURM: a one-node cluster on this machine (scripts/slurm.sh).

scripts/test.sh starts the cluster before the serial pass and stops it after;
without it these tests skip and say how to start it.  Every job is
``jobscripts/cpu.sbatch`` as a user submits it, with a tiny model and dataset
passed as script arguments.  The uninterrupted reference job runs alongside
the interrupted ones: each of those must end with exactly its parameters.
"""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mpi4py import MPI

from hpcnet.data.synthetic import generate_images
from hpcnet.launch import restarts as launch
from tests.helpers.launch import ROOT, clean_env

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(MPI.COMM_WORLD.Get_size() > 1, reason="submits SLURM jobs; runs in the serial pass"),
]

JOBSCRIPTS = sorted((ROOT / "jobscripts").glob("*.sbatch"))
STEPS = 60
# fault.slow_s paces the steps (the last rank sleeps 0.1 s in each), so a signal
# sent at step 10 arrives well before the end; it does not change the numbers.
TRAIN_ARGS = [f"train.steps={STEPS}", "train.batch_size=8", "train.eval_every=0", "run.log_every=1",
              "model.name=mlp", "model.options.hidden=[32]", "optim.warmup_steps=5",
              "checkpoint.every_steps=5", "dist.probe=false", "fault.slow_s=0.1"]


def _cluster_or_skip() -> None:
    if shutil.which("sbatch") is None:
        pytest.skip("SLURM is not installed (no sbatch): scripts/slurm.sh start installs and starts it (root)")
    status = subprocess.run([str(ROOT / "scripts" / "slurm.sh"), "status"], capture_output=True, text=True)
    if status.returncode != 0:
        pytest.skip("the local SLURM is not running: scripts/slurm.sh start (scripts/test.sh starts and stops it)")


class Job:
    """A submitted ``jobscripts/cpu.sbatch`` and what it wrote in its directory."""

    def __init__(self, directory: Path, dataset: Path, *args: str, env: dict[str, str] | None = None,
                 name: str = "hpcnet-test") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        environ = clean_env(HPCNET_ROOT=str(ROOT), HPCNET_VENV=sys.prefix, **(env or {}))
        out = subprocess.run(["sbatch", "--parsable", f"--chdir={directory}", f"--job-name={name}",
                              "--ntasks=2", "--time=10", str(ROOT / "jobscripts" / "cpu.sbatch"),
                              f"data.dataset={dataset}", *TRAIN_ARGS, *args],
                             env=environ, capture_output=True, text=True, timeout=30, check=True)
        self.id = out.stdout.strip().split(";")[0]
        self.name = name
        self.log = directory / f"slurm-{name}-{self.id}.out"
        self.checkpoints = directory / "runs" / self.id / f"{name}.ckpt"

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def info(self) -> dict[str, str]:
        """``scontrol show job`` as a dict (finished jobs stay listed for MinJobAge)."""
        out = subprocess.run(["scontrol", "show", "job", "-o", self.id], capture_output=True, text=True)
        return dict(field.split("=", 1) for field in out.stdout.split() if "=" in field)

    def step(self) -> int:
        """The newest step the console shows."""
        steps = re.findall(r"^step +(\d+)/", self.output(), flags=re.M)
        return int(steps[-1]) if steps else 0

    def wait(self, timeout_s: float = 200) -> dict[str, str]:
        """Wait until the job has ended for good (not merely requeued); return its final info."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            if info.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return info
            if time.monotonic() > deadline:
                subprocess.run(["scancel", self.id])
                raise AssertionError(f"job {self.id} still {info.get('JobState')} after {timeout_s} s:\n"
                                     f"{self.output()[-3000:]}")
            time.sleep(0.5)

    def rank_pid(self, rank: int) -> str:
        """The process id of ``rank`` in the job's newest step (``scontrol listpids``)."""
        out = subprocess.run(["scontrol", "listpids", self.id], capture_output=True, text=True, check=True).stdout
        tasks = [line.split() for line in out.splitlines()[1:]]
        pids = [(int(step), pid) for pid, _, step, _, global_rank in tasks
                if step.isdigit() and global_rank == str(rank)]
        assert pids, f"job {self.id}: no task of rank {rank} in\n{out}"
        return max(pids)[1]

    def summary(self) -> dict:
        """summary.json of the attempt that finished last."""
        summaries = sorted((self.directory / "runs" / self.id).rglob("summary.json"), key=lambda p: p.stat().st_mtime)
        assert summaries, f"job {self.id} wrote no summary.json:\n{self.output()[-3000:]}"
        return json.loads(summaries[-1].read_text())

    def final_state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the newest checkpoint: model parameters and optimizer state."""
        from hpcnet.ckpt.load import load_checkpoint

        loaded = load_checkpoint(MPI.COMM_SELF, str(self.checkpoints))
        assert loaded is not None and loaded.step == STEPS, f"job {self.id}: no checkpoint at step {STEPS}"
        return loaded.tensors


def _assert_finished(job: Job, info: dict[str, str]) -> None:
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{job.output()[-3000:]}"
    summary = job.summary()
    assert summary["steps"] == STEPS


def _assert_same_state(job: Job, reference: Job) -> None:
    ours, theirs = job.final_state(), reference.final_state()
    assert sorted(ours) == sorted(theirs)
    for key in ours:
        assert torch.equal(torch.as_tensor(ours[key]), torch.as_tensor(theirs[key])), key  # bit-identical


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    _cluster_or_skip()
    path = tmp_path_factory.mktemp("slurm-data") / "images.h5"
    generate_images(path, num_train=512, num_eval=32, shape=(1, 8, 8), num_classes=4, seed=3)
    return path


@pytest.fixture(scope="module")
def jobs(dataset, tmp_path_factory):
    """Every job at once (2 ranks each, OverSubscribe=FORCE lets them share the cores).

    Each interrupted job is interrupted here as soon as it reaches step 10, all
    in one polling loop: one test after another would find the later jobs
    already finished.
    """
    def submit(name, *args, standby="off"):
        # The standby is what the kill job tests; the others leave it off (HPCNET_LAUNCH_ARGS), so that five
        # jobs sharing two cores are not joined by standbys importing torch.
        return Job(tmp_path_factory.mktemp(f"slurm-{name}"), dataset, *args, name=name,
                   env={"HPCNET_LAUNCH_ARGS": f"--standby {standby}"})

    jobs = {"reference": submit("reference"), "signal": submit("signal"), "requeue": submit("requeue"),
            "kill": submit("kill", "fault.kill_at_step=12", "fault.only_attempt=1", standby="auto"),
            # No restarts inside the allocation: the failure must be retried by requeue.
            "kill-requeue": Job(tmp_path_factory.mktemp("slurm-kill-requeue"), dataset, name="kill-requeue",
                                env={"HPCNET_MAX_RESTARTS": "0"})}
    actions = {
        # What --signal=B:USR2@90 does before the time limit, sent now.
        "signal": ["scancel", "--signal=USR2", "--batch", jobs["signal"].id],
        # What preemption with PreemptMode=REQUEUE does: SIGTERM everywhere, then requeue.
        "requeue": ["scontrol", "requeue", jobs["requeue"].id],
        # A rank killed from outside (the OOM killer, say) in whatever attempt it is.
        "kill-requeue": ["kill", "-KILL", "<rank 1>"],
    }
    deadline = time.monotonic() + 150
    while actions:
        for name in list(actions):
            if jobs[name].step() >= 10:
                command = [jobs[name].rank_pid(1) if arg == "<rank 1>" else arg for arg in actions.pop(name)]
                subprocess.run(command, check=True, timeout=30)
            elif time.monotonic() > deadline or jobs[name].info().get("JobState") not in ("PENDING", "RUNNING"):
                pytest.fail(f"job {jobs[name].id} ({name}) did not reach step 10:\n{jobs[name].output()[-3000:]}")
        time.sleep(0.2)
    return jobs


def test_killed_rank_is_retried_by_requeue(jobs):
    job = jobs["kill-requeue"]
    info = job.wait()
    out = job.output()
    assert re.search(r"training exited with status (75|137) \(requeue\)", out), out[-3000:]
    assert f"requeueing job {job.id}" in out and info["Restarts"] == "1", out[-3000:]
    resumed = re.findall(r"resumed from .* at step (\d+)", out)
    assert resumed and int(resumed[0]) >= 5, out[-3000:]
    _assert_finished(job, info)
    _assert_same_state(job, jobs["reference"])


def test_uninterrupted_job_trains(jobs):
    reference = jobs["reference"]
    info = reference.wait()
    _assert_finished(reference, info)
    out = reference.output()
    losses = [float(x) for x in re.findall(r"^step +\d+/\d+ \| loss ([0-9.]+)", out, flags=re.M)]
    assert len(losses) == STEPS and losses[-1] < losses[0], out[-3000:]
    assert "training exited with status 0 (done)" in out
    assert info["Restarts"] == "0"
    assert re.search(r"running: python -m hpcnet.launch --max-restarts \d+ --standby off -- ", out), out[-3000:]


def test_preempted_by_signal_requeues_itself_and_resumes(jobs):
    job = jobs["signal"]
    info = job.wait()
    out = job.output()
    assert "SIGUSR2: preemption warning" in out and f"requeueing job {job.id}" in out, out[-3000:]
    assert info["Restarts"] == "1"
    resumed = re.findall(r"resumed from .* at step (\d+)", out)
    assert resumed and int(resumed[0]) >= 10, out[-3000:]
    _assert_finished(job, info)
    assert job.summary()["start_step"] == int(resumed[-1])
    _assert_same_state(job, jobs["reference"])


def test_requeued_by_slurm_resumes(jobs):
    job = jobs["requeue"]
    info = job.wait()
    out = job.output()
    assert "SIGTERM from SLURM" in out and "not requeueing it here" in out, out[-3000:]
    assert re.search(r"stopping after step \d+/\d+ on SIGTERM \(checkpoint saved\)", out), out[-3000:]
    assert info["Restarts"] == "1"
    resumed = re.findall(r"resumed from .* at step (\d+)", out)
    assert resumed and int(resumed[0]) >= 10, out[-3000:]
    _assert_finished(job, info)
    _assert_same_state(job, jobs["reference"])


def test_killed_rank_recovers_inside_the_allocation(jobs):
    job = jobs["kill"]
    info = job.wait()
    out = job.output()
    assert "kills itself (SIGKILL) at step 12" in out, out[-3000:]
    assert re.search(r"attempt 2/\d+ \(warm standby\): srun", out), out[-3000:]
    assert info["Restarts"] == "0"  # retried by hpcnet.launch, not requeued
    # Through the standby: an srun --overlap step in the allocation, parked, released by SIGUSR1.
    record = json.loads(next((job.directory / "runs" / job.id).glob("kill-*/launch.json")).read_text())
    assert record["attempts"][1]["standby"], record["attempts"][1]
    assert "--overlap" not in record["attempts"][1]["command"]  # what a cold restart would run
    _assert_finished(job, info)
    assert 0 < job.summary()["start_step"] <= 12
    _assert_same_state(job, jobs["reference"])


# The scripts themselves: static, so checked for syntax and for the header a user edits.

@pytest.mark.parametrize("script", JOBSCRIPTS, ids=lambda p: p.name)
def test_jobscript_syntax_and_header(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    header = text.split("source ", 1)[0]
    for needle in ("--partition", "--account", "--nodes", "--time", "--cpus-per-task", "#SBATCH --signal=B:USR2@90",
                   "#SBATCH --requeue", "#SBATCH --open-mode=append", "runs/<job id>", ".ckpt",
                   "HPCNET_LAUNCHER=mpirun", "TORCH_DISTRIBUTED_DEBUG"):
        assert needle in header, f"{script.name}: the header does not mention {needle!r}"
    if script.name.startswith("gpu"):
        for needle in ("#SBATCH --gpus-per-node", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE"):
            assert needle in header, f"{script.name}: the header does not mention {needle!r}"
    assert text.rstrip().endswith('hpcnet_job "$@"')


def test_requeue_verdict_matches_the_supervisor():
    statuses = list(range(256))
    out = subprocess.run(["bash", "-c", f"source {ROOT / 'jobscripts' / 'hpcnet-job.sh'}; "
                          "for s in " + " ".join(map(str, statuses)) + '; do hpcnet_verdict "$s"; done'],
                         capture_output=True, text=True, check=True).stdout.split()
    for status, verdict in zip(statuses, out, strict=True):
        expected = "done" if status == 0 else "requeue" if launch.is_restartable(status) or status == 76 else "fail"
        assert verdict == expected, status
    assert signal.SIGUSR2 not in launch.RESTART_SIGNALS


SUPERVISOR_STAND_IN = """
import pathlib, signal, sys, time
pathlib.Path("started").write_text("")
while not pathlib.Path("go").exists():  # an interpreter still starting: SIGUSR2's default action would kill it
    time.sleep(0.02)
signal.signal(signal.SIGUSR2, lambda *_: sys.exit(76))  # what hpcnet.launch ends with after the ranks saved
time.sleep(60)
sys.exit(1)
"""


def test_a_preemption_warning_while_the_supervisor_starts_waits_until_it_handles_it(tmp_path):
    """SIGUSR2 reaches the batch shell while the supervisor is still starting: the shell passes it on once the
    supervisor handles it (passed on at once, it died of it: 140, not requeued)."""
    (tmp_path / "supervisor.py").write_text(SUPERVISOR_STAND_IN)
    script = (f"source {ROOT / 'jobscripts' / 'hpcnet-job.sh'}; hpcnet_hold_signals; "
              f"hpcnet_supervise {sys.executable} supervisor.py; echo status=$hpcnet_status")
    with open(tmp_path / "err.txt", "w") as err:
        proc = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR2)
        while "preemption warning" not in (tmp_path / "err.txt").read_text() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # a shell that passes the signal on at once has done so by now
        (tmp_path / "go").write_text("")
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert out.split() == ["status=76"], (tmp_path / "err.txt").read_text()


def test_a_preemption_warning_before_the_supervisor_starts_it_not_and_one_after_it_ended_is_harmless(tmp_path):
    """Before: nothing is started, status 76 (requeue). After the supervisor ended: the shell lives on to act on
    its status (without the trap, SIGUSR2 killed it)."""
    script = (f"source {ROOT / 'jobscripts' / 'hpcnet-job.sh'}; hpcnet_hold_signals; kill -USR2 $$; "
              "hpcnet_supervise touch started; echo status=$hpcnet_status; "
              "hpcnet_stop_pending=0; hpcnet_supervise true; kill -USR2 $$; echo status=$hpcnet_status")
    out = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["status=76", "status=0"], out.stderr
    assert not (tmp_path / "started").exists()
