"""hpcnet.ckpt.state and hpcnet.ckpt.parts: model, optimizer and RNG state to tensors and back, and TrainState."""

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.ckpt.parts import ModelState, OptimizerState
from hpcnet.ckpt.state import RngState, rng_state, set_rng_state
from hpcnet.errors import UsageError
from hpcnet.stateful import Entries, Saved, Stateful
from tests.helpers.ckpt import (
    assert_same_tensors,
    model_and_optimizer_state,
    model_and_optimizers,
    restore_split_state,
    split_state,
    train_steps,
)
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
        ModelState(nn.Linear(2, 2)).load_entries(Saved(copy, {"state": meta["sgd"]}))




class _Sampler(Stateful):
    """A data position: the meta's ``sampler``."""

    def __init__(self, position=None, fail=False):
        self.state, self.position, self.fail = None, position, fail

    def state_entries(self):
        return Entries(meta={"sampler": self.position})

    def load_entries(self, saved):
        if self.fail:
            raise ValueError("sampler state is malformed")
        self.state = saved.meta["sampler"]


def _parts(model, optimizer, sampler, seed=0, rank=0):
    return [ModelState(model), OptimizerState(optimizer), sampler, RngState(seed, rank)]


@pytest.mark.mpi
def test_train_state_saves_and_resumes_model_optimizer_sampler_and_rng(comm, mpi_tmp_path):
    from hpcnet.ckpt.state import TrainState
    from hpcnet.config.load import load_config

    cfg = load_config(overrides=["run.seed=3"])
    directory = fresh_dir(comm, mpi_tmp_path / "trainstate")
    model, sgd, _ = model_and_optimizers()
    train_steps(model, [sgd], 2)
    with CheckpointManager(comm, directory, async_save=False) as manager:
        state = TrainState(cfg, _parts(model, sgd, _Sampler({"epoch": 0, "offset": 48}), 3, comm.Get_rank()), manager)
        assert state.start("") == 0 and state.last_saved_step == -1
        assert state.is_finite()
        torch.manual_seed(50 + comm.Get_rank())
        path = state.save(12)
        expected = torch.rand(3)
        assert path.name == "ckpt-0000000012.h5" and state.last_saved_step == 12
    saved = {k: v.clone() for k, v in model_and_optimizer_state(model, sgd).tensors.items()}
    model2, sgd2, _ = model_and_optimizers(seed=7)
    with CheckpointManager(comm, directory, async_save=False) as manager:
        sampler = _Sampler()
        resumed = TrainState(cfg, _parts(model2, sgd2, sampler, 3, comm.Get_rank()), manager)
        assert resumed.start("auto") == 12 and resumed.last_saved_step == 12
        assert torch.equal(torch.rand(3), expected)  # this rank's RNG continues where it was saved
        assert sampler.state == {"epoch": 0, "offset": 48}
        loaded = manager.load("auto")
    assert_same_tensors(saved, model_and_optimizer_state(model2, sgd2).tensors)
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
        assert not TrainState(load_config(), _parts(model, sgd, _Sampler()), manager).is_finite()


@pytest.mark.mpi
def test_a_sampler_state_that_fails_on_resume_fails_every_rank(comm, mpi_tmp_path):
    from hpcnet.ckpt.state import TrainState
    from hpcnet.config.load import load_config

    directory = fresh_dir(comm, mpi_tmp_path / "bad-sampler")
    model, sgd, _ = model_and_optimizers()
    with CheckpointManager(comm, directory, async_save=False) as manager:
        TrainState(load_config(), _parts(model, sgd, _Sampler({"offset": 0})), manager).save(1)
        sampler = _Sampler(fail=comm.Get_rank() == comm.Get_size() - 1)  # a shrunk dataset, seen by one rank
        with pytest.raises((ValueError, RuntimeError), match="sampler state is malformed"):
            TrainState(load_config(), _parts(model, sgd, sampler), manager).start("auto")


def test_a_sharded_optimizer_s_rank_wants_the_model_and_its_own_state_only():
    from hpcnet.comm.costmodel import OwnerAssignment
    from hpcnet.comm.sharding.layout import ShardLayout
    from hpcnet.comm.sharding.optimizer import ShardedOptimizer
    from hpcnet.stateful import wanted_by

    replicated = OptimizerState(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    assert wanted_by([replicated]) is None  # replicated: all
    # 8 KiB cut in two row ranges at 2 ranks (units of at most 4 KiB), and a bias; rank 1 owns rows 32-64 and the bias.
    params = [torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(3))]
    layout = ShardLayout(params, 2)
    assert [(u.param, u.lo, u.hi) for u in layout.units] == [(0, 0, 32), (0, 32, 64), (1, 0, 3)]
    names = ("model/w", "model/blocks/1/b", "optim/0/exp_avg:0-32", "optim/0/exp_avg:32-64", "optim/0/exp_avg:16-40",
             "optim/0/exp_avg", "optim/0/step", "optim/1/exp_avg", "optim/1/step")
    wanted = {}
    for rank in (0, 1):
        owners = OwnerAssignment([0, 1, 1], [4096, 4108], [1.0, 1.0])
        sharded = ShardedOptimizer(torch.optim.AdamW(params, lr=0.1), owners, layout, _FakeComm(rank, 2), stage=1,
                                   elementwise=True)
        wanted[rank] = [name for name in names if wanted_by([sharded])(name)]
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
