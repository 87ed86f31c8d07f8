"""train.nonfinite: a non-finite loss, gradient norm or state stops every rank, or skips the update."""

import json
import re

import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpcnet.ckpt.load import load_checkpoint
from hpcnet.config.load import load_config
from hpcnet.errors import ConfigError, ExitCode
from hpcnet.train import run
from tests.helpers.data import shared_data_dir, tiny_images
from tests.helpers.train import StopAfter, train_config


class GoesBadAt(nn.Module):
    """A small MLP whose training forward on one rank goes wrong at call ``at``.

    ``kind='loss'``: that rank's output (so its loss, and through the average every
    rank's gradient) is NaN. ``kind='state'``: that rank's last bias becomes
    infinite after the output is computed, so the loss and gradient stay finite
    and only the updated state is bad (as when an update overflows).
    """

    def __init__(self, info, *, at, kind, hidden=16):
        super().__init__()
        c, h, w = info.input_shape
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, hidden), nn.ReLU(),
                                 nn.Linear(hidden, info.num_classes))
        self.at, self.kind, self.calls = at, kind, 0

    def forward(self, x):
        out = self.net(x)
        if self.training:
            self.calls += 1
            if self.calls == self.at and MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
                if self.kind == "loss":
                    out = out * float("nan")
                else:
                    with torch.no_grad():
                        self.net[-1].bias[0] = float("inf")
        return out


def make_model(info, at=0, kind="loss"):
    return GoesBadAt(info, at=at, kind=kind)


def _cfg(tmp, name, *extra):
    return train_config(tmp, tmp / "nonfinite-images.h5", name, "train.steps=6", "checkpoint.every_steps=1",
                        "checkpoint.full_every=1", "checkpoint.keep=10",
                        "model.factory=tests.test_nonfinite:make_model", "optim.warmup_steps=100", "run.log_every=1",
                        *extra)


def _dataset(comm, tmp):
    tiny_images(comm, tmp, "nonfinite-images.h5", num_train=256, num_eval=32, seed=5)


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _newest_committed(comm, directory):
    """The step ``latest`` names, and the step ``--resume auto`` would load, with its state checked finite."""
    latest = (directory / "latest").read_text().strip()
    loaded = load_checkpoint(comm, "auto", directory)
    assert all(torch.isfinite(t).all() for t in loaded.tensors.values() if t.is_floating_point())
    assert latest == loaded.path.name
    return loaded.step


def test_the_option_is_checked():
    assert load_config().train.nonfinite == "stop"
    with pytest.raises(ConfigError, match="train.nonfinite: 'halt' is not one of 'stop', 'skip', 'ignore'"):
        load_config(overrides=["train.nonfinite=halt"])


@pytest.mark.mpi
@pytest.mark.parametrize("grad_clip", [0.0, 0.5])
def test_nan_loss_on_one_rank_stops_every_rank_after_that_step(comm, data_plane, mpi_tmp_path, grad_clip):
    """Without clipping only the last rank's local loss says so: the step boundary makes it every rank's."""
    _dataset(comm, mpi_tmp_path)
    name = f"stop-{grad_clip}"
    result = run(_cfg(mpi_tmp_path, name, "model.options.at=4", f"optim.grad_clip={grad_clip}"), comm,
                 plane=data_plane)
    assert result.exit_code == ExitCode.DIVERGED
    assert result.summary["steps"] == 4
    expected = "loss (on at least one rank)" + (" and gradient norm" if grad_clip else "")
    assert result.summary["diverged"] == f"non-finite {expected} at step 4"
    comm.Barrier()
    assert _newest_committed(comm, mpi_tmp_path / "ckpt" / name) == 3  # step 4 was never saved
    assert sorted(p.name for p in (mpi_tmp_path / "ckpt" / name).glob("*.h5"))[-1] == "ckpt-0000000003.h5"
    if comm.Get_rank() == 0:
        summary = json.loads((mpi_tmp_path / "runs" / name / "summary.json").read_text())
        assert summary["steps"] == 4 and summary["diverged"] == result.summary["diverged"]
    comm.Barrier()



SAVES = {  # which save falls on step 3, and the newest checkpoint before it
    "periodic": (["checkpoint.every_steps=1"], None, 2),
    "time-based": (["checkpoint.every_steps=0", "checkpoint.every_s=1e-9"], None, 2),
    "preemption": (["checkpoint.every_steps=0"], lambda: StopAfter(3), None),
    "at-end": (["checkpoint.every_steps=0", "train.steps=3"], None, None),
}


@pytest.mark.mpi
@pytest.mark.parametrize("save", sorted(SAVES))
def test_non_finite_state_is_never_saved(comm, data_plane, mpi_tmp_path, save):
    """Step 3's loss and gradient are finite but its update left one rank's bias infinite: no save of it."""
    _dataset(comm, mpi_tmp_path)
    extra, make_stop, newest = SAVES[save]
    result = run(_cfg(mpi_tmp_path, f"state-{save}", "model.options.at=3", "model.options.kind=state", *extra),
                 comm, plane=data_plane, stop=make_stop() if make_stop else None)
    assert result.exit_code == ExitCode.DIVERGED  # also over a preemption: a restart would diverge again
    assert result.summary["steps"] == 3
    assert result.summary["diverged"].startswith("non-finite model or optimizer state after step 3")
    comm.Barrier()
    directory = mpi_tmp_path / "ckpt" / f"state-{save}"
    if newest is None:
        assert not list(directory.glob("*.h5")) and not (directory / "latest").exists()
    else:
        assert _newest_committed(comm, directory) == newest
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.parametrize("grad_clip", [0.0, 0.5])
def test_skip_drops_the_update_and_counts_it(comm, data_plane, mpi_tmp_path, grad_clip):
    _dataset(comm, mpi_tmp_path)
    clip = f"optim.grad_clip={grad_clip}"
    skipped = run(_cfg(mpi_tmp_path, f"skip-{grad_clip}", "model.options.at=3", "train.nonfinite=skip", clip,
                       "train.steps=3"), comm, plane=data_plane)
    assert skipped.exit_code == ExitCode.OK
    assert skipped.summary["skipped_steps"] == 1 and skipped.summary["steps"] == 3
    # The same run stopped before the bad step: step 3 changed nothing (warm-up: the lr does not depend on steps).
    before = run(_cfg(mpi_tmp_path, f"skip-ref-{grad_clip}", "train.steps=2", clip), comm, plane=data_plane)
    assert torch.equal(_params(skipped.model), _params(before.model))
    moments = [[t for s in r.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
               for r in (skipped, before)]
    assert all(torch.equal(a, b) for a, b in zip(*moments, strict=True))
    # ... and training goes on from there, on every rank alike.
    longer = run(_cfg(mpi_tmp_path, f"skip-on-{grad_clip}", "model.options.at=3", "train.nonfinite=skip", clip),
                 comm, plane=data_plane)
    assert longer.exit_code == ExitCode.OK and longer.summary["skipped_steps"] == 1
    assert torch.isfinite(_params(longer.model)).all() and longer.summary["final_loss"] == longer.summary["final_loss"]
    gathered = comm.allgather(_params(longer.model))
    assert all(torch.equal(gathered[0], g) for g in gathered)
    comm.Barrier()
    if comm.Get_rank() == 0:
        summary = json.loads((mpi_tmp_path / "runs" / f"skip-on-{grad_clip}" / "summary.json").read_text())
        assert summary["skipped_steps"] == 1
    comm.Barrier()


@pytest.mark.mpi
def test_ignore_trains_on(comm, data_plane, mpi_tmp_path):
    _dataset(comm, mpi_tmp_path)
    result = run(_cfg(mpi_tmp_path, "ignore", "model.options.at=2", "train.nonfinite=ignore"), comm, plane=data_plane)
    assert result.exit_code == ExitCode.OK and result.summary["steps"] == 6
    assert result.summary["final_loss"] != result.summary["final_loss"]  # NaN, as asked
    comm.Barrier()


@pytest.mark.launch
def test_huge_learning_rate_stops_with_status_65_and_keeps_the_last_good_checkpoint(launch, tmp_path):
    """The command line of the issue: optim.lr=1e30 used to exit 0 with 'final loss nan' over NaN checkpoints."""
    from hpcnet.launch.restarts import describe_status, is_restartable

    ckpt = tmp_path / "ckpt"
    out = launch(2, f"data.dir={shared_data_dir(tmp_path)}", f"run.dir={tmp_path / 'runs'}", f"checkpoint.dir={ckpt}",
                 "model.name=mlp", "train.batch_size=16", "train.steps=30", "train.eval_every=0",
                 "optim.lr=1e30", "checkpoint.every_steps=1", "checkpoint.keep=50", timeout=240)
    assert out.returncode == ExitCode.DIVERGED == 65, out.stderr
    found = re.search(r"non-finite .* at step (\d+): every rank stops after step \1/30", out.stderr)
    assert found, out.stderr
    bad = int(found.group(1))
    assert f"the newest checkpoint, step {bad - 1}, is kept" in out.stderr and "status 65" in out.stderr
    assert (ckpt / "latest").read_text().strip() == f"ckpt-{bad - 1:010d}.h5"
    assert max(int(p.stem.split("-")[1]) for p in ckpt.glob("ckpt-*.h5")) == bad - 1
    (summary,) = (tmp_path / "runs").glob("hpcnet-*/summary.json")
    assert json.loads(summary.read_text())["steps"] == bad
    assert not is_restartable(out.returncode) and "non-finite" in describe_status(out.returncode)
