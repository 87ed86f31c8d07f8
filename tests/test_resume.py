"""Checkpoints in the training loop: exact resume, resume at another world size, preemption."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from mpi4py import MPI

from hpcnet.config import load_config
from tests.conftest import tiny_images
from hpcnet.errors import ExitCode
from hpcnet.train import run


class StopAfter:
    """Stands in for the signal handler: reports SIGUSR2 once ``steps`` steps have run."""

    def __init__(self, steps):
        self.calls, self.steps = 0, steps

    @property
    def signum(self):
        self.calls += 1
        return signal.SIGUSR2 if self.calls >= self.steps else 0


def _dataset(comm, tmp):
    return tiny_images(comm, tmp, "resume-images.h5", num_train=320, num_eval=32, seed=7)


def _cfg(tmp, dataset, name, *extra):
    return load_config(overrides=[
        f"data.dataset={dataset}", f"run.dir={tmp / 'runs' / name}", "run.dir_exact=true", "run.name=resume",
        f"checkpoint.dir={tmp / 'ckpt' / name}", "train.steps=20", "train.batch_size=4", "train.eval_every=0",
        "checkpoint.every_steps=10", "dist.probe=false", *extra])


def _state(result):
    params = [p.detach().clone() for p in result.model.parameters()]
    buffers = [b.detach().clone() for b in result.model.buffers()]
    opt = [t.clone() for s in result.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return params, buffers, opt


MODELS = {
    "resnet-sgd": ["model.name=resnet_tiny", "model.options.width=4", "optim.name=sgd"],
    "mlp-dropout-adamw": ["model.name=mlp", "model.options.hidden=[32]", "model.options.dropout=0.2",
                          "optim.name=adamw", "optim.lr=0.003"],
}


@pytest.mark.mpi
@pytest.mark.parametrize("model", sorted(MODELS))
def test_stop_and_resume_is_bit_identical(comm, data_plane, mpi_tmp_path, model):
    dataset = _dataset(comm, mpi_tmp_path)
    straight = run(_cfg(mpi_tmp_path, dataset, f"straight-{model}", *MODELS[model]), comm, plane=data_plane)
    first = run(_cfg(mpi_tmp_path, dataset, f"split-{model}", *MODELS[model]), comm, plane=data_plane,
                stop=StopAfter(10))
    assert first.summary["steps"] == 10 and first.exit_code == ExitCode.PREEMPTED
    second = run(_cfg(mpi_tmp_path, dataset, f"split-{model}", *MODELS[model], "checkpoint.resume=auto"), comm,
                 plane=data_plane)
    assert second.summary["start_step"] == 10 and second.summary["steps"] == 20
    for a, b in zip(_state(straight), _state(second)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert torch.equal(x, y)  # bit-identical, not merely close
    comm.Barrier()


@pytest.mark.mpi
def test_resume_on_one_rank_what_n_ranks_saved(comm, data_plane, mpi_tmp_path):
    """N ranks save at step 10; every rank alone (batch N*B) resumes and matches the N-rank run."""
    size, rank = comm.Get_size(), comm.Get_rank()
    dataset = _dataset(comm, mpi_tmp_path)
    extra = MODELS["mlp-dropout-adamw"][:2] + ["optim.name=sgd"]
    straight = run(_cfg(mpi_tmp_path, dataset, "reshard-straight", *extra), comm, plane=data_plane)
    run(_cfg(mpi_tmp_path, dataset, "reshard", *extra, "train.steps=20"), comm, plane=data_plane, stop=StopAfter(10))
    comm.Barrier()
    alone = run(_cfg(mpi_tmp_path, dataset, "reshard", *extra, f"train.batch_size={4 * size}",
                     "checkpoint.resume=auto", f"run.dir={mpi_tmp_path / 'runs' / f'alone{rank}'}",
                     "checkpoint.at_end=false", "checkpoint.every_steps=0"), MPI.COMM_SELF)
    assert alone.summary["start_step"] == 10
    for x, y in zip(_state(straight)[0], _state(alone)[0]):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    comm.Barrier()


@pytest.mark.mpi
def test_bad_resume_path_fails_on_every_rank(comm, data_plane, mpi_tmp_path):
    from hpcnet.errors import UsageError

    dataset = _dataset(comm, mpi_tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        run(_cfg(mpi_tmp_path, dataset, "bad", "model.name=mlp", f"checkpoint.resume={mpi_tmp_path}/nope.h5"),
            comm, plane=data_plane)
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_rng_state_that_fails_to_restore_on_one_rank_stops_every_rank(comm, data_plane, mpi_tmp_path, monkeypatch):
    """Each rank restores its own RNG state: a failure there is shared, not a hang of the others."""
    from hpcnet import trainstate

    dataset = _dataset(comm, mpi_tmp_path)
    run(_cfg(mpi_tmp_path, dataset, "rng", "model.name=mlp", "train.steps=10"), comm, plane=data_plane)
    last = comm.Get_size() - 1

    def broken(state):
        if comm.Get_rank() == last:
            raise ValueError(f"rank {last}: RNG state of another torch build")

    monkeypatch.setattr(trainstate, "set_rng_state", broken)
    with pytest.raises(Exception, match=f"rank {last}: RNG state of another torch build"):
        run(_cfg(mpi_tmp_path, dataset, "rng", "model.name=mlp", "checkpoint.resume=auto"), comm, plane=data_plane)
    comm.Barrier()


@pytest.mark.launch
def test_sigterm_saves_then_resume_continues(tmp_path):
    from tests.conftest import clean_env

    common = [f"data.dir={tmp_path / 'data'}", f"run.dir={tmp_path / 'runs'}", "model.name=mlp",
              "train.batch_size=16", "train.eval_every=0", "run.log_every=1", "run.metrics=all",
              "checkpoint.every_s=0", "checkpoint.every_steps=0"]
    cmd = ["mpirun", "-np", "2", sys.executable, "-m", "mpi4py", "-m", "hpcnet.train", *common]
    proc = subprocess.Popen([*cmd, "train.steps=100000"], env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not list((tmp_path / "runs").glob("*/metrics.rank0.jsonl")):
            time.sleep(0.5)
        time.sleep(1.0)
        ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        os.kill(int(ranks[0]), signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, err
    saved = int(next(line for line in err.splitlines() if "checkpoint at step" in line).split("step ")[1].split(":")[0])
    committed = list((tmp_path / "runs" / "hpcnet.ckpt").glob("*.h5"))
    assert committed, err
    out = subprocess.run([*cmd, f"train.steps={saved + 3}", "--resume", "auto"], env=clean_env(),
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"at step {saved}" in out.stderr and f"step {saved + 3}/{saved + 3}" in out.stderr
    summary = json.loads(sorted((tmp_path / "runs").glob("hpcnet-*/summary.json"))[-1].read_text())
    assert (summary["start_step"], summary["steps"]) == (saved, saved + 3)
