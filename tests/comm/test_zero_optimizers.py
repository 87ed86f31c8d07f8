"""Optimizers other than SGD and AdamW at every ``dist.zero`` stage: Muon and Adafactor (not elementwise: every
parameter owned and stepped whole), Adam, and Lion from a library (lion-pytorch, through optim.factory): each
stage equals one process on the same global batch; their state resumes on another number of ranks; a row-cut
layout never reaches an optimizer that is not elementwise."""

import json

import pytest
import torch
from mpi4py import MPI
from torch import nn

from hpcnet.comm.costmodel import OwnerAssignment
from hpcnet.comm.sharding.layout import ShardLayout, split_units
from hpcnet.comm.sharding.optimizer import ShardedOptimizer
from hpcnet.config.load import load_config
from hpcnet.optim import build_optimizer
from hpcnet.train import run
from tests.helpers.data import tiny_images, tiny_tokens
from tests.helpers.train import StopAfter, assert_same, flat_params, train_config

# The MLP of tests/comm/test_zero.py: its first layer (64 x 32) is cut into row ranges at 2 ranks and more
# whenever the optimizer is elementwise.
MODEL = ["model.name=mlp", "model.options.hidden=[32,24]"]
# tests/comm/test_zero3.py's, on 512 tokens: its embedding (512 x 32) is cut at 2 ranks and more for an elementwise
# optimizer.
TRANSFORMER = ["model.name=transformer", "model.options.d_model=32", "model.options.n_layers=3",
               "model.options.n_heads=2"]


def lion(param_groups, cfg):
    """optim.factory: lion-pytorch's Lion (elementwise, a class hpcnet.config.optimizers knows)."""
    from lion_pytorch import Lion

    return Lion(param_groups, lr=cfg.lr)


OPTIMIZERS = {
    "adafactor": ["optim.name=adafactor", "optim.lr=0.01"],
    "muon": ["optim.name=muon", "optim.lr=0.01"],
    "adam": ["optim.name=adam", "optim.lr=0.003"],
    "lion": ["optim.factory=tests.comm.test_zero_optimizers:lion", "optim.lr=0.0003"],
}
ELEMENTWISE = {"adafactor": False, "muon": False, "adam": True, "lion": True}
BOUND = {"adafactor": 1e-5, "muon": 1e-3, "adam": 1e-5, "lion": 1e-5, "muon-transformer": 5e-3}
"""After 20 steps, each stage's parameters against one process's (other summation orders): Muon orthogonalises
in bfloat16 (torch's Newton-Schulz), so a difference in the last bit of a gradient can move an update by a bfloat16
rounding of lr (1e-2 here): 1e-3 absolute on the MLP, 2.1e-3 seen on the transformer at stage 0 already (2 ranks);
the others follow the gradients to float32 rounding."""


def _dataset(comm, tmp):
    return tiny_images(comm, tmp, "zero-optim-images.h5", num_train=512, num_eval=32, seed=5)


def _tokens(comm, tmp):
    return tiny_tokens(comm, tmp, "zero-optim-tokens.h5", num_train=256, num_eval=16, seq_len=16, vocab_size=512,
                       seed=3)


def _cfg(tmp, dataset, name, *extra, model=tuple(MODEL)):
    return train_config(tmp, dataset, name, "train.steps=20", "optim.warmup_steps=2", "optim.grad_clip=0.5",
                        "checkpoint.at_end=false", "dist.backend=mpi", "dist.fallback=none", "dist.owners=uniform",
                        *model, *extra)


@pytest.mark.mpi
@pytest.mark.parametrize("optim,model", [*((name, "mlp") for name in sorted(OPTIMIZERS)), ("muon", "transformer")])
def test_every_stage_equals_one_process(comm, data_plane, mpi_tmp_path, optim, model):
    size, rank = comm.Get_size(), comm.Get_rank()
    dataset = _dataset(comm, mpi_tmp_path) if model == "mlp" else _tokens(comm, mpi_tmp_path)
    args = OPTIMIZERS[optim]
    spec = MODEL if model == "mlp" else TRANSFORMER
    bound = BOUND[optim if model == "mlp" else f"{optim}-{model}"]
    alone = None
    if rank == 0:  # one process on the same global batch
        alone = flat_params(run(_cfg(mpi_tmp_path, dataset, f"{optim}-{model}-alone", *args,
                                     f"train.batch_size={4 * size}", model=spec), MPI.COMM_SELF))
    alone = comm.bcast(alone, root=0)
    stages = {}
    for zero in (0, 1, 2, 3):
        result = run(_cfg(mpi_tmp_path, dataset, f"{optim}-{model}-z{zero}", *args, f"dist.zero={zero}", model=spec),
                     comm, plane=data_plane)
        stages[zero] = flat_params(result)
        torch.testing.assert_close(stages[zero], alone, rtol=0, atol=bound)
        if zero:
            layout = result.optimizer.layout
            would_cut = any(not u.whole for u in split_units(layout.params, size))
            assert would_cut == (size > 1)  # the model is large enough for the test to mean something
            assert layout.cut == (would_cut and ELEMENTWISE[optim]), [u for u in layout.units if not u.whole]
    # Bit for bit where the sums agree: stage 1 adds as stage 0 does; stage 2 and 3 reduce-scatter, which adds the
    # same numbers in another order past 2 ranks.
    assert torch.equal(stages[1], stages[0])
    for zero in (2, 3):
        assert_same(stages[0], stages[zero], exact=size <= 2, atol=bound)
    comm.Barrier()


def _state_by_param(optimizer):
    """A sharded optimizer's state of the parameters this rank owns, by the full optimizer's index (whole
    parameters: the optimizer is not elementwise)."""
    assert not optimizer.layout.cut
    return {optimizer.full_index[optimizer.layout.units[k].param]: values
            for k, values in optimizer.unit_state().items()}


@pytest.mark.mpi
@pytest.mark.parametrize("optim,saved_zero,resumed_zero", [("muon", 2, 3), ("adafactor", 3, 1)])
def test_a_run_saved_on_fewer_ranks_resumes_its_state_bit_for_bit_on_more_at_another_stage(
        comm, data_plane, mpi_tmp_path, optim, saved_zero, resumed_zero):
    """Saved by size - 1 ranks, resumed by size ranks: every parameter's state (Muon's momentum, Adafactor's
    row and column statistics, AdamW's moments, the step counters) reaches its new owner as it was saved."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        pytest.skip("saved by one rank fewer than resume it: needs 2 ranks or more")
    dataset = _dataset(comm, mpi_tmp_path)
    common = [*OPTIMIZERS[optim], "checkpoint.every_steps=0"]
    name = f"grow-{optim}"
    saved = {}
    sub = comm.Split(0 if rank < size - 1 else MPI.UNDEFINED, rank)
    if sub != MPI.COMM_NULL:
        first = run(_cfg(mpi_tmp_path, dataset, name, *common, f"dist.zero={saved_zero}"), sub, stop=StopAfter(10))
        assert first.summary["steps"] == 10
        saved = _state_by_param(first.optimizer)
        sub.Free()
    saved = {index: values for part in comm.allgather(saved) for index, values in part.items()}
    second = run(_cfg(mpi_tmp_path, dataset, name, *common, "train.steps=10", f"dist.zero={resumed_zero}",
                      "checkpoint.resume=auto"), comm, plane=data_plane)
    assert second.summary["start_step"] == 10
    resumed = _state_by_param(second.optimizer)
    assert sorted(i for part in comm.allgather(sorted(resumed)) for i in part) == sorted(saved)
    for index, values in resumed.items():
        assert values.keys() == saved[index].keys(), index
        for key, value in values.items():
            assert torch.equal(value, saved[index][key]) if torch.is_tensor(value) else value == saved[index][key]
    comm.Barrier()


@pytest.mark.launch
def test_muon_killed_9_resumes_to_the_uninterrupted_run_s_bits(launch, tmp_path):
    """Muon + AdamW at stage 2 on 2 ranks under a StepLR schedule, a rank killed -9 at step 8: resumed from the
    step-5 checkpoint, the run takes the uninterrupted run's learning rates (the schedule's state from the
    checkpoint, no replay) and ends with its parameters and optimizer state, bit for bit."""
    from hpcnet.ckpt.load import load_checkpoint

    dataset = tiny_images(MPI.COMM_SELF, tmp_path, "muon.h5", num_train=96, num_eval=16, seed=3)
    common = [f"data.dataset={dataset}", "run.dir_exact=true", *MODEL, "train.batch_size=4", "train.eval_every=0",
              "dist.probe=false", "dist.owners=uniform", "checkpoint.every_s=0", "checkpoint.every_steps=5",
              "checkpoint.async_save=false", "checkpoint.at_end=true", "train.steps=12", "dist.zero=2",
              "run.log_every=1", "optim.schedule=StepLR", "optim.schedule_options.step_size=3",
              "optim.schedule_options.gamma=0.5", *OPTIMIZERS["muon"]]
    straight = launch(2, *common, f"run.dir={tmp_path / 'straight'}", f"checkpoint.dir={tmp_path / 'c-straight'}",
                      timeout=240)
    assert straight.returncode == 0, straight.stderr
    killed = [*common, f"checkpoint.dir={tmp_path / 'c-killed'}"]
    first = launch(2, *killed, f"run.dir={tmp_path / 'first'}", "fault.kill_at_step=8", timeout=240)
    assert first.returncode != 0 and "step 12/12" not in first.stderr, first.stderr
    second = launch(2, *killed, f"run.dir={tmp_path / 'second'}", "--resume", "auto", timeout=240)
    assert second.returncode == 0 and "at step 5 (saved by 2 rank(s)" in second.stderr, second.stderr
    assert "optim.schedule:" not in second.stderr  # no replay: the schedule's state came from the checkpoint

    def rates(run_dir):
        lines = (tmp_path / run_dir / "metrics.rank0.jsonl").read_text().splitlines()
        return [(r["step"], r["lr"]) for r in map(json.loads, lines) if "loss" in r]

    assert rates("second") == rates("straight")[5:] and len({lr for _, lr in rates("straight")}) == 4
    a = load_checkpoint(MPI.COMM_SELF, str(tmp_path / "c-straight"))
    b = load_checkpoint(MPI.COMM_SELF, str(tmp_path / "c-killed"))
    assert a.step == b.step == 12
    names = sorted(k for k in a.tensors if k.startswith(("model/", "optim/")))
    assert any("momentum_buffer" in k for k in names) and any("exp_avg_sq" in k for k in names)
    assert names == sorted(k for k in b.tensors if k.startswith(("model/", "optim/")))
    for name in names:
        assert torch.equal(a.tensors[name], b.tensors[name]), name


class Packed(torch.Tensor):
    """A tensor subclass, as torchao's low-bit optimizer states are."""


class PackedSGD(torch.optim.SGD):
    """SGD that also keeps a tensor subclass in its state."""

    elementwise = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["packed"] = torch.Tensor._make_subclass(Packed, p.detach().clone())
        return loss


def packed_sgd(param_groups, cfg):
    """optim.factory: ``PackedSGD``."""
    return PackedSGD(param_groups, lr=cfg.lr)


@pytest.mark.mpi
@pytest.mark.parametrize("zero", [0, 2])
def test_a_tensor_subclass_in_the_optimizer_state_is_refused_on_every_rank_naming_it(comm, data_plane, mpi_tmp_path,
                                                                                     zero):
    from hpcnet.errors import UsageError

    dataset = _dataset(comm, mpi_tmp_path)
    with pytest.raises(UsageError, match=r"optimizer PackedSGD: state 'packed' of parameter \d+ is a Packed, a tensor "
                                         r"subclass, which a checkpoint cannot hold"):
        run(_cfg(mpi_tmp_path, dataset, f"packed-{zero}", "optim.factory=tests.comm.test_zero_optimizers:packed_sgd",
                 "train.steps=4", "checkpoint.every_steps=2", f"dist.zero={zero}"), comm, plane=data_plane)
    comm.Barrier()


# --- one process: the layout an optimizer gets ----------------------------------------------------------------------

class _Comm:
    """Enough of a communicator for a stage-3 sharded optimizer in one process (nothing is broadcast)."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2


class Unknown(torch.optim.SGD):
    """A factory's optimizer of a class hpcnet does not know."""


def _model():
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 4))


@pytest.mark.parametrize("overrides", [["optim.name=adafactor"], ["optim.name=muon"]])
def test_a_row_cut_layout_never_reaches_an_optimizer_that_is_not_elementwise(overrides):
    model = _model()
    params = list(model.parameters())
    full = build_optimizer(model, load_config(overrides=overrides).optim)
    cut = ShardLayout(params, 2)
    assert cut.cut  # 16 KiB of 17 cut in row ranges at 2 ranks
    owners = OwnerAssignment([k % 2 for k in range(len(cut.units))], [0, 0], [0.0, 0.0])
    for elementwise in (False, True):  # a caller's claim does not outweigh what the class is known to be
        with pytest.raises(ValueError, match="is not elementwise: it must own whole parameters"):
            ShardedOptimizer(full, owners, cut, _Comm(), 3, elementwise=elementwise)
    whole = ShardLayout(params, 2, cut=False)
    assert not whole.cut and len(whole.units) == len(params)
    sharded = ShardedOptimizer(full, OwnerAssignment([0, 1, 1, 0], [0, 0], [0.0, 0.0]), whole, _Comm(), 3,
                               elementwise=False)
    assert type(sharded.inner) is type(full)


def test_a_factory_s_unknown_optimizer_is_given_whole_parameters_unless_declared_elementwise():
    params = list(_model().parameters())
    cut = ShardLayout(params, 2)
    owners = OwnerAssignment([k % 2 for k in range(len(cut.units))], [0, 0], [0.0, 0.0])
    with pytest.raises(ValueError, match="Unknown is not elementwise"):
        ShardedOptimizer(Unknown(params, lr=0.1), owners, cut, _Comm(), 3, elementwise=False)
    assert ShardedOptimizer(Unknown(params, lr=0.1), owners, cut, _Comm(), 3, elementwise=True).layout.cut
