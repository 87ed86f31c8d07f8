"""data.balance=auto: per-rank batch sizes by measured speed; the same global batches and the same update; the
sizes kept in checkpoints (pure parts in one process, the trainer under MPI)."""

import json

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpcnet.config.load import load_config
from hpcnet.data import balance
from hpcnet.data.balance import balanced_sizes, predicted_step_s
from hpcnet.data.h5 import open_split
from hpcnet.data.loader import BatchLoader
from hpcnet.data.sampler import GlobalBatchSampler
from hpcnet.errors import ConfigError
from hpcnet.paths import metrics_file
from hpcnet.train import run
from tests.helpers.data import tiny_images
from tests.helpers.train import StopAfter, train_config


# -- pure ------------------------------------------------------------------------------------------------------
def test_sizes_follow_speeds_and_sum_to_the_global_batch():
    assert balanced_sizes([1.0, 1.0], 8) == [4, 4]
    assert balanced_sizes([3.0, 1.0], 16) == [12, 4]
    assert balanced_sizes([1.0, 1.0, 1.0], 8) == [3, 3, 2]  # the remainder to the lower ranks
    assert balanced_sizes([1000.0, 1.0], 8) == [7, 1]  # a rank keeps one sample however slow
    sizes = balanced_sizes([2.0, 1.3, 0.4, 5.0], 64)
    assert sum(sizes) == 64 and min(sizes) >= 1 and sizes.index(max(sizes)) == 3
    assert predicted_step_s([12, 4], [1 / 3.0, 1.0]) == pytest.approx(4.0)


@pytest.mark.parametrize("speeds,batch,match", [([1.0, 0.0], 8, "positive"), ([1.0, float("nan")], 8, "positive"),
                                                ([1.0] * 3, 2, "cannot give")])
def test_bad_speeds_are_refused(speeds, batch, match):
    with pytest.raises(ValueError, match=match):
        balanced_sizes(speeds, batch)


def _global(samplers):
    return np.concatenate([s.next_indices() for s in samplers])


def test_unequal_slices_cover_the_same_global_batches():
    even = [GlobalBatchSampler(100, 4, rank=r, world_size=3, seed=2) for r in range(3)]
    uneven = [GlobalBatchSampler(100, 4, rank=r, world_size=3, seed=2) for r in range(3)]
    for s in uneven:
        s.set_sizes([7, 1, 4])
    for _ in range(12):  # past the end of an epoch
        a = _global(even)
        assert np.array_equal(a, _global(uneven))
    assert [len(s.next_indices()) for s in uneven] == [7, 1, 4]
    state = uneven[0].state_dict()
    assert state["batch_sizes"] == [7, 1, 4] and "batch_sizes" not in even[0].state_dict()
    uneven[1].set_sizes([4, 4, 4])  # equal again: saved as before
    assert "batch_sizes" not in uneven[1].state_dict()


def test_saved_sizes_are_offered_only_where_they_fit():
    saved = {"epoch": 0, "samples_consumed_in_epoch": 24, "seed": 2, "batch_sizes": [7, 1, 4]}
    same = GlobalBatchSampler(100, 4, rank=1, world_size=3, seed=2)
    same.load_state_dict(saved)
    assert same.resumed_sizes == [7, 1, 4] and same.sizes == [4, 4, 4]  # the caller decides
    for other in (GlobalBatchSampler(100, 6, rank=0, world_size=2), GlobalBatchSampler(100, 4, rank=0, world_size=2)):
        other.load_state_dict(saved)
        assert other.resumed_sizes is None


@pytest.mark.parametrize("sizes,match", [([4, 4], "3 positive"), ([12, 0, 0], "3 positive"),
                                         ([5, 5, 5], "not the global batch")])
def test_bad_sizes_are_refused(sizes, match):
    with pytest.raises(ValueError, match=match):
        GlobalBatchSampler(100, 4, rank=0, world_size=3).set_sizes(sizes)


def test_loader_rereads_the_batch_read_ahead_with_new_sizes(tmp_path):
    path = tiny_images(MPI.COMM_SELF, tmp_path, "images.h5", num_train=64, num_eval=8, seed=1)
    split = open_split(path, "train")
    with BatchLoader(split, GlobalBatchSampler(64, 4, rank=1, world_size=2, seed=3)) as loader:
        loader.next()
        loader.set_sizes([5, 3])
        assert loader.state_dict()["batch_sizes"] == [5, 3]
        x, _ = loader.next()
    reference = GlobalBatchSampler(64, 4, rank=1, world_size=2, seed=3)
    reference.next_indices()
    reference.set_sizes([5, 3])
    assert torch.equal(x, split.read(reference.next_indices())[0])


def test_balance_options_are_checked():
    with pytest.raises(ConfigError, match="data.balance must be 'off' or 'auto'"):
        load_config(overrides=["data.balance=on"])
    with pytest.raises(ConfigError, match="data.balance_every must be at least 2"):
        load_config(overrides=["data.balance_every=1"])
    with pytest.raises(ConfigError, match="fault.slow_per_sample_s"):
        load_config(overrides=["fault.slow_per_sample_s=-1"])


# -- the trainer -------------------------------------------------------------------------------------------------
MODEL = ["model.name=mlp", "model.options.hidden=[32,24]", "optim.name=sgd", "optim.lr=0.2",
         "optim.warmup_steps=2", "checkpoint.at_end=false"]


def _params(result):
    return torch.cat([p.detach().reshape(-1) for p in result.model.parameters()])


@pytest.mark.mpi
def test_a_slow_rank_gets_fewer_samples_and_the_update_is_the_single_process_one(comm, data_plane, mpi_tmp_path):
    size, rank = comm.Get_size(), comm.Get_rank()
    dataset = tiny_images(comm, mpi_tmp_path, "balance.h5", num_train=256, num_eval=16, seed=4)
    # The last rank sleeps 20 ms per sample in its forward: far slower than the tiny model's compute.
    balanced = run(train_config(mpi_tmp_path, dataset, "balanced", *MODEL, "train.steps=8", "data.balance=auto",
                                "data.balance_every=2", "fault.slow_per_sample_s=0.02"), comm, plane=data_plane)
    sizes = balanced.summary["balance"]["sizes"]
    assert sum(sizes) == 4 * size
    if size > 1:
        assert sizes[-1] < 4 and balanced.summary["balance"]["changes"] >= 1
    # One process on the same global batches (batch 4 x size): the same mean gradient, summed in another order.
    alone = run(train_config(mpi_tmp_path, dataset, f"alone{rank}", *MODEL, "train.steps=8",
                             f"train.batch_size={4 * size}"), MPI.COMM_SELF)
    torch.testing.assert_close(_params(balanced), _params(alone), rtol=1e-4, atol=1e-5)
    assert balanced.summary["final_loss"] == pytest.approx(alone.summary["final_loss"], rel=1e-4)
    comm.Barrier()


@pytest.mark.mpi
def test_resume_goes_on_with_the_saved_sizes_bit_for_bit(comm, data_plane, mpi_tmp_path, monkeypatch):
    """Measured speeds fixed (rank r: r + 1 ms a sample), so the decisions repeat; a run stopped at step 6 and
    resumed equals the straight run bit for bit, and starts from the sizes it saved."""
    monkeypatch.setattr(balance.Balancer, "seconds_per_sample", lambda self: 1e-3 * (self.rank + 1))
    size = comm.Get_size()
    dataset = tiny_images(comm, mpi_tmp_path, "balance.h5", num_train=256, num_eval=16, seed=4)
    extra = [*MODEL, "train.steps=10", "data.balance=auto", "data.balance_every=3"]
    straight = run(train_config(mpi_tmp_path, dataset, "straight", *extra), comm, plane=data_plane)
    first = run(train_config(mpi_tmp_path, dataset, "stopped", *extra), comm, plane=data_plane, stop=StopAfter(6))
    assert first.summary["steps"] == 6
    resumed = run(train_config(mpi_tmp_path, dataset, "stopped", *extra, "checkpoint.resume=auto"), comm,
                  plane=data_plane)
    assert resumed.summary["start_step"] == 6
    expected = balanced_sizes([1 / (r + 1) for r in range(size)], 4 * size)
    assert straight.summary["balance"]["sizes"] == resumed.summary["balance"]["sizes"] == expected
    assert resumed.summary["balance"]["changes"] == 0  # taken up from the checkpoint, not decided again
    assert torch.equal(_params(straight), _params(resumed))
    comm.Barrier()


def _logged_losses(run_dir):
    lines = [json.loads(line) for line in (run_dir / metrics_file(0)).read_text().splitlines()]
    return {r["step"]: r["global_loss"] for r in lines if "global_loss" in r}


@pytest.mark.mpi
def test_the_logged_loss_at_a_re_split_step_is_that_step_s_global_batch_mean(comm, data_plane, mpi_tmp_path,
                                                                              monkeypatch):
    """Measured speeds fixed (rank r: r + 1 ms a sample): the ranks re-split after step 3. The loss logged at every
    step, step 3 among them (computed on equal slices, logged after the re-split), is the mean over that step's
    global batch: data.balance=off's on the same batches, to rounding."""
    monkeypatch.setattr(balance.Balancer, "seconds_per_sample", lambda self: 1e-3 * (self.rank + 1))
    size = comm.Get_size()
    dataset = tiny_images(comm, mpi_tmp_path, "balance.h5", num_train=256, num_eval=16, seed=4)
    extra = [*MODEL, "train.steps=8", "run.log_every=1", "data.balance_every=3"]
    balanced = run(train_config(mpi_tmp_path, dataset, "logged-auto", *extra, "data.balance=auto"), comm,
                   plane=data_plane)
    off = run(train_config(mpi_tmp_path, dataset, "logged-off", *extra, "data.balance=off"), comm, plane=data_plane)
    if size > 1:
        assert [h["step"] for h in balanced.summary["balance"]["history"]] == [3]
    # The premise: the same global batches give the same updates (summed in another order).
    torch.testing.assert_close(_params(balanced), _params(off), rtol=1e-5, atol=1e-6)
    if comm.Get_rank() == 0:
        logged, expected = (_logged_losses(mpi_tmp_path / "runs" / name) for name in ("logged-auto", "logged-off"))
        assert sorted(logged) == sorted(expected) == list(range(1, 9))
        for step in expected:
            assert logged[step] == pytest.approx(expected[step], rel=1e-5, abs=1e-6), step
    assert balanced.summary["final_loss"] == pytest.approx(off.summary["final_loss"], rel=1e-5)
    comm.Barrier()
