"""hpcnet.ckpt.state: model, optimizer and RNG state to tensors and back, and TrainState."""

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.ckpt.state import flatten_state, restore_state, rng_state, set_rng_state
from hpcnet.errors import UsageError
from tests.helpers.ckpt import assert_same_tensors, model_and_optimizers, restore_split_state, split_state, train_steps
from tests.helpers.dirs import fresh_dir

pytestmark = pytest.mark.timeout(120)


def test_rng_state_round_trips_through_json():
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    state = json.loads(json.dumps(rng_state()))
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(state)
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]
    state["torch"] = state["torch"][:-2]
    with pytest.raises(ValueError, match="torch"):
        set_rng_state(state)


def test_flatten_restore_round_trip_in_memory():
    model, sgd, adamw = model_and_optimizers()
    train_steps(model, [sgd, adamw], 3)
    tensors, meta = split_state(model, sgd, adamw)
    assert "optim/0/momentum_buffer" in tensors and "adamw/0/step" in tensors
    copy = {k: v.clone() for k, v in tensors.items()}
    model2, sgd2, adamw2 = model_and_optimizers(seed=5)
    restore_split_state(model2, sgd2, adamw2, copy, json.loads(json.dumps(meta)))
    train_steps(model, [sgd, adamw], 2)
    train_steps(model2, [sgd2, adamw2], 2)
    assert_same_tensors(split_state(model, sgd, adamw)[0], split_state(model2, sgd2, adamw2)[0])
    with pytest.raises(UsageError, match="does not match the model"):
        restore_state(nn.Linear(2, 2), None, copy, meta["sgd"])




class _Sampler:
    def __init__(self, fail=False):
        self.state, self.fail = None, fail

    def load_state_dict(self, state):
        if self.fail:
            raise ValueError("sampler state is malformed")
        self.state = state


@pytest.mark.mpi
def test_train_state_saves_and_resumes_model_optimizer_sampler_and_rng(comm, mpi_tmp_path):
    from hpcnet.ckpt.state import TrainState
    from hpcnet.config.load import load_config

    cfg = load_config(overrides=["run.seed=3"])
    directory = fresh_dir(comm, mpi_tmp_path / "trainstate")
    model, sgd, _ = model_and_optimizers()
    train_steps(model, [sgd], 2)
    with CheckpointManager(comm, directory, async_save=False) as manager:
        state = TrainState(cfg, model, sgd, _Sampler(), manager)
        assert state.start("", rank=comm.Get_rank()) == 0 and state.last_saved_step == -1
        assert state.is_finite()
        torch.manual_seed(50 + comm.Get_rank())
        path = state.save(12, {"epoch": 0, "offset": 48})
        expected = torch.rand(3)
        assert path.name == "ckpt-0000000012.h5" and state.last_saved_step == 12
    saved = {k: v.clone() for k, v in flatten_state(model, sgd)[0].items()}
    model2, sgd2, _ = model_and_optimizers(seed=7)
    with CheckpointManager(comm, directory, async_save=False) as manager:
        resumed = TrainState(cfg, model2, sgd2, _Sampler(), manager)
        assert resumed.start("auto", rank=comm.Get_rank()) == 12 and resumed.last_saved_step == 12
        assert torch.equal(torch.rand(3), expected)  # this rank's RNG continues where it was saved
        assert resumed.sampler.state == {"epoch": 0, "offset": 48}
        loaded = manager.load("auto")
    assert_same_tensors(saved, flatten_state(model2, sgd2)[0])
    assert loaded.meta["config"]["run"]["seed"] == 3 and loaded.meta["step"] == 12


@pytest.mark.mpi
def test_a_non_finite_state_on_one_rank_is_not_finite_on_every_rank(comm, mpi_tmp_path):
    from hpcnet.ckpt.state import TrainState
    from hpcnet.config.load import load_config

    model, sgd, _ = model_and_optimizers()
    if comm.Get_rank() == comm.Get_size() - 1:
        with torch.no_grad():
            model[1].weight[0, 0] = float("inf")
    with CheckpointManager(comm, fresh_dir(comm, mpi_tmp_path / "nonfinite-state"), async_save=False) as manager:
        assert not TrainState(load_config(), model, sgd, _Sampler(), manager).is_finite()


@pytest.mark.mpi
def test_a_sampler_state_that_fails_on_resume_fails_every_rank(comm, mpi_tmp_path):
    from hpcnet.ckpt.state import TrainState
    from hpcnet.config.load import load_config

    directory = fresh_dir(comm, mpi_tmp_path / "bad-sampler")
    model, sgd, _ = model_and_optimizers()
    with CheckpointManager(comm, directory, async_save=False) as manager:
        TrainState(load_config(), model, sgd, _Sampler(), manager).save(1, {"offset": 0})
        sampler = _Sampler(fail=comm.Get_rank() == comm.Get_size() - 1)  # a shrunk dataset, seen by one rank
        with pytest.raises((ValueError, RuntimeError), match="sampler state is malformed"):
            TrainState(load_config(), model, sgd, sampler, manager).start("auto", rank=comm.Get_rank())


def test_a_sharded_optimizer_s_rank_wants_the_model_and_its_own_state_only():
    from hpcnet.ckpt.state import state_wanted
    from hpcnet.comm.costmodel import ShardPlan
    from hpcnet.comm.sharding.layout import ShardLayout
    from hpcnet.comm.sharding.optimizer import ShardedOptimizer

    assert state_wanted(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)) is None  # replicated: all
    # 8 KiB cut in two row ranges at 2 ranks (units of at most 4 KiB), and a bias; rank 1 owns rows 32-64 and the bias.
    params = [torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(3))]
    layout = ShardLayout(params, 2)
    assert [(u.param, u.lo, u.hi) for u in layout.units] == [(0, 0, 32), (0, 32, 64), (1, 0, 3)]
    names = ("model/w", "model/blocks/1/b", "optim/0/exp_avg:0-32", "optim/0/exp_avg:32-64", "optim/0/exp_avg:16-40",
             "optim/0/exp_avg", "optim/0/step", "optim/1/exp_avg", "optim/1/step")
    wanted = {}
    for rank in (0, 1):
        sharded = ShardedOptimizer(torch.optim.AdamW(params, lr=0.1), ShardPlan([0, 1, 1], [4096, 4108], [1.0, 1.0]),
                                   layout, _FakeComm(rank, 2), stage=1)
        wanted[rank] = [name for name in names if state_wanted(sharded)(name)]
        sharded.close()
    assert wanted[0] == ["model/w", "model/blocks/1/b", "optim/0/exp_avg:0-32", "optim/0/exp_avg:16-40",
                         "optim/0/exp_avg", "optim/0/step"]
    assert wanted[1] == ["model/w", "model/blocks/1/b", "optim/0/exp_avg:32-64", "optim/0/exp_avg:16-40",
                         "optim/0/exp_avg", "optim/0/step", "optim/1/exp_avg", "optim/1/step"]


class _FakeComm:
    """Enough of a communicator to build a sharded optimizer in one process."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Dup(self):
        return self

    def Free(self):
        pass
