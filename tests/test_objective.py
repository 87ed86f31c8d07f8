"""model.loss and the default objective (hpcnet.objective): what a batch's loss is, its metrics, evaluation, and the
trainer's paths with it (stages, precision, accumulation, data.balance, the non-finite guard)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from examples import objectives as ex
from hpcnet.data.info import DatasetInfo
from hpcnet.data.user import TorchDatasetSplit
from hpcnet.errors import ConfigError, DatasetError, ExitCode, UsageError
from hpcnet.models.device import map_tensors
from hpcnet.objective import Objective, compute_loss, samples_in
from hpcnet.train import run
from tests.helpers.data import tiny_images
from tests.helpers.launch import ROOT
from tests.helpers.train import assert_same, flat_params, train_config


# -- objectives the tests name by import path ----------------------------------------------------------------------
def cross_entropy(model, batch):
    """The default objective written as a user function: a run with it must be the default run, bit for bit."""
    x, y = batch
    return F.cross_entropy(model(x), y)


def with_metrics(model, batch):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits, y), {"top1": (logits.argmax(-1) == y).float().mean(), "one": 1}


def returns_none(model, batch):
    return None


def detached(model, batch):
    return torch.tensor(1.0)


def bad_metric(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1]), {"a b": 1.0}


def reserved_metric(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1]), {"loss": 1.0}


class Logits(nn.Module):
    """A linear model whose output carries ``.logits`` (and ``.loss`` when given labels), as Hugging Face's do."""

    def __init__(self, features=6, classes=3):
        super().__init__()
        self.linear = nn.Linear(features, classes)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return SimpleNamespace(logits=logits, loss=loss)


def _pair(n=8, features=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


# -- the default objective and the user function -------------------------------------------------------------------
def test_the_default_loss_reads_logits_from_a_tensor_an_output_with_logits_or_a_dict_batch_with_labels():
    torch.manual_seed(0)
    model = Logits()
    x, y = _pair()
    expected = F.cross_entropy(model.linear(x), y)
    assert torch.equal(compute_loss(model, (x, y)), expected)  # .logits
    assert torch.equal(compute_loss(model.linear, (x, y)), expected)  # a tensor
    assert torch.equal(compute_loss(model, {"x": x, "labels": y}), expected)  # model(**batch).loss
    assert torch.equal(compute_loss(model, [x, y]), expected)  # a list pair, as default_collate makes


@pytest.mark.parametrize(("batch", "match"), [
    ((torch.randn(8, 6), torch.randn(8)), "targets are torch.float32, not class indices: set model.loss"),
    ({"x": torch.randn(8, 6)}, "without a .loss: put the labels in the batch"),
    ((torch.randn(8, 6), torch.zeros(8, dtype=torch.long), torch.zeros(8)), "yields a tuple of 3"),
])
def test_what_the_default_loss_cannot_read_says_set_model_loss(batch, match):
    with pytest.raises(UsageError, match=match):
        compute_loss(Logits(), batch)


def test_an_output_without_logits_is_named():
    with pytest.raises(UsageError, match="returned a dict with keys 'h', not logits"):
        compute_loss(lambda x: {"h": x}, _pair())


def test_a_user_function_s_loss_and_metrics_are_kept_and_averaged_over_its_calls():
    objective = Objective(f"{__name__}:with_metrics")
    model = nn.Linear(6, 3)
    split = TorchDatasetSplit(torch.utils.data.TensorDataset(*_pair(16)), "test")
    objective.check(model, split, lambda b: b)
    assert objective.names == ["one", "top1"]
    firsts = []
    for seed in (1, 2):
        x, y = _pair(seed=seed)
        loss = objective(model, (x, y))
        assert torch.equal(loss, F.cross_entropy(model(x), y)) and loss.requires_grad
        firsts.append((model(x).argmax(-1) == y).float().mean().item())
    taken = objective.take_metrics()
    assert taken == pytest.approx({"top1": sum(firsts) / 2, "one": 1.0})
    assert objective.take_metrics() == {}  # taken once
    objective(model, _pair(seed=3))
    objective.start_step()  # a new step: the earlier calls' metrics are not its own
    x, y = _pair(seed=4)
    objective(model, (x, y))
    assert objective.take_metrics()["top1"] == pytest.approx((model(x).argmax(-1) == y).float().mean().item())


@pytest.mark.parametrize(("fn", "error", "match"), [
    ("returns_none", UsageError, "returned a NoneType as the loss; return a floating-point scalar tensor"),
    ("detached", UsageError, "does not depend on the model's parameters"),
    ("bad_metric", UsageError, "a metric named 'a b'"),
    ("reserved_metric", UsageError, "a metric named 'loss', which hpcnet logs itself"),
    ("no_such_function", ConfigError, "model.loss: module 'tests.test_objective' has no attribute"),
])
def test_a_wrong_user_function_is_named_at_start_up(fn, error, match):
    split = TorchDatasetSplit(torch.utils.data.TensorDataset(*_pair(16)), "test")
    with pytest.raises(error, match=match):
        Objective(f"{__name__}:{fn}").check(nn.Linear(6, 3), split, lambda b: b)


def test_the_start_up_check_keeps_the_model_s_mode_and_the_random_state():
    split = TorchDatasetSplit(torch.utils.data.TensorDataset(*_pair(16)), "test")
    model = nn.Sequential(nn.Linear(6, 3), nn.Dropout(0.5))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    Objective().check(model, split, lambda b: b)
    assert model.training and torch.equal(torch.rand(3), expected)


def test_evaluation_runs_in_eval_mode_and_leaves_the_model_as_it_was():
    """Dropout off and batch norm from its running statistics: two evaluations agree, the statistics do not move,
    and the model is back in training mode after."""
    x, y = _pair(16)
    split = TorchDatasetSplit(torch.utils.data.TensorDataset(x, y), "test")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    stats = model[1].running_mean.clone()
    objective = Objective()

    def evaluate():
        return objective.evaluate(model, split, MPI.COMM_SELF, indices=np.arange(16), batch_size=4, max_batches=0,
                                  move=lambda b: b)
    first = evaluate()
    assert evaluate() == first and model.training and torch.equal(model[1].running_mean, stats)
    with torch.no_grad():
        expected = F.cross_entropy(model.eval()(x), y).item()
    assert first["eval_loss"] == pytest.approx(expected, rel=1e-6)


def test_evaluation_weights_batches_by_their_samples():
    """Batches of 5 and 3 samples: the means are over the 8 samples, not the mean of the two batches' means."""
    x, y = _pair(8)
    split = TorchDatasetSplit(torch.utils.data.TensorDataset(x, y.float()), "test")  # float targets: 'other'
    model = nn.Linear(6, 1)
    objective = Objective("examples.objectives:mse")
    objective.check(model, split, lambda b: b)
    result = objective.evaluate(model, split, MPI.COMM_SELF, indices=np.arange(8), batch_size=5, max_batches=0,
                                move=lambda b: b)
    with torch.no_grad():
        error = model(x).squeeze(-1) - y.float()
    assert result["eval_loss"] == pytest.approx(error.pow(2).mean().item(), rel=1e-6)
    assert result["eval_mae"] == pytest.approx(error.abs().mean().item(), rel=1e-6)
    assert set(result) == {"eval_loss", "eval_mae"}


# -- datasets of any structure -------------------------------------------------------------------------------------
class Items(torch.utils.data.Dataset):
    def __init__(self, make, n=6):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.make(i)


def test_sequences_dicts_and_float_targets_get_their_kinds_and_batch_as_their_structure():
    sequence = TorchDatasetSplit(Items(lambda i: (torch.arange(4) + i, i % 3)), "x")
    assert sequence.info == DatasetInfo("sequence", (4,), 3)
    x, y = sequence.read(np.array([2, 0]))
    assert x.tolist() == [[2, 3, 4, 5], [0, 1, 2, 3]] and y.tolist() == [2, 0]
    dicts = TorchDatasetSplit(Items(lambda i: {"ids": torch.arange(3) + i, "mask": torch.ones(3), "w": 0.5}), "x")
    assert dicts.info == DatasetInfo("other", (3,), 0)
    batch = dicts.read(np.array([1, 4]))
    assert batch["ids"].tolist() == [[1, 2, 3], [4, 5, 6]] and batch["w"].tolist() == [0.5, 0.5]
    assert samples_in(batch) == 2
    regression = TorchDatasetSplit(ex.Regression("train", n=6, features=2), "x")
    assert regression.info == DatasetInfo("other", (2,), 0)
    inputs, targets = regression.read(np.array([0, 1, 2]))
    assert inputs.shape == (3, 2) and targets.dtype == torch.float32
    moved = map_tensors(lambda t: t.double(), {"a": (torch.zeros(1), [torch.ones(1)]), "b": "text"})
    assert moved["a"][0].dtype == moved["a"][1][0].dtype == torch.float64 and moved["b"] == "text"


def test_items_that_do_not_batch_together_are_a_dataset_error():
    ragged = TorchDatasetSplit(Items(lambda i: {"ids": torch.arange(3 + i)}), "data.dataset: 'x:y' (train split)")
    with pytest.raises(DatasetError, match=r"data.dataset: 'x:y' \(train split\): items \[0, 1\] do not batch"):
        ragged.read(np.array([0, 1]))
    with pytest.raises(DatasetError, match="holds no tensor or number"):
        TorchDatasetSplit(Items(lambda i: {"name": "x"}), "x")


# -- the trainer ---------------------------------------------------------------------------------------------------
MLP = ["model.name=mlp", "model.options.hidden=[16]", "optim.name=sgd", "optim.lr=0.2", "checkpoint.at_end=false",
       "dist.owners=uniform"]  # dist.owners=auto places shards by measured speeds: other owners, other orders of sums


@pytest.mark.mpi
@pytest.mark.parametrize("extra", [
    ["dist.zero=0", "train.grad_accumulation=2"],
    ["dist.zero=2", "optim.name=adamw", "optim.lr=0.003"],
    ["dist.zero=3", "train.precision=bf16"],
])
def test_a_user_objective_trains_as_the_default_one_bit_for_bit(comm, data_plane, mpi_tmp_path, extra):
    """The default cross-entropy written as model.loss: the same parameters, losses and evaluation, at every stage,
    with accumulation and in bf16; with metrics, those are logged and evaluated."""
    dataset = tiny_images(comm, mpi_tmp_path, "objective.h5", num_train=128, num_eval=32, seed=2)
    args = [*MLP, "train.steps=6", "train.eval_every=6", *extra]
    name = "-".join(x.split("=")[1] for x in extra)
    default = run(train_config(mpi_tmp_path, dataset, f"default-{name}", *args), comm, plane=data_plane)
    user = run(train_config(mpi_tmp_path, dataset, f"user-{name}", *args, f"model.loss={__name__}:with_metrics",
                            "run.log_every=3"), comm, plane=data_plane)
    assert_same(flat_params(default), flat_params(user), exact=True)
    assert user.summary["final_loss"] == default.summary["final_loss"]
    assert user.summary["eval"]["eval_loss"] == pytest.approx(default.summary["eval"]["eval_loss"], rel=1e-12)
    # a float32 mean a batch against a count: equal to float32's rounding
    assert user.summary["eval"]["eval_top1"] == pytest.approx(default.summary["eval"]["eval_accuracy"], rel=1e-6)
    assert user.summary["eval"]["eval_one"] == 1.0
    if comm.Get_rank() == 0:
        lines = [json.loads(line) for line in (mpi_tmp_path / "runs" / f"user-{name}" / "metrics.rank0.jsonl")
                 .read_text().splitlines()]
        logged = [line for line in lines if "train_top1" in line]
        assert [line["step"] for line in logged] == [3, 6] and all(line["train_one"] == 1.0 for line in logged)
    comm.Barrier()


def named_by_rank(model, batch):
    """Cross-entropy, and one metric whose name depends on the rank: a=1 on rank 0, b=100 on the others."""
    x, y = batch
    first = MPI.COMM_WORLD.Get_rank() == 0
    return F.cross_entropy(model(x), y), {"a": 1.0} if first else {"b": 100.0}


@pytest.mark.mpi(min_size=2)
def test_metric_names_that_differ_between_ranks_stop_every_rank_naming_them(comm, data_plane, mpi_tmp_path):
    """The ranks' metrics are averaged name by name (evaluation sums them by position): rank 0's a=1 and rank 1's
    b=100 would be reported as 'a 50.5', and logged as 'a nan | b nan'. Every rank refuses at start-up."""
    dataset = tiny_images(comm, mpi_tmp_path, "objective.h5", num_train=128, num_eval=32, seed=2)
    cfg = train_config(mpi_tmp_path, dataset, "named-by-rank", *MLP, "train.steps=2", "train.eval_every=2",
                       f"model.loss={__name__}:named_by_rank")
    others = list(range(1, comm.Get_size()))
    with pytest.raises(UsageError) as raised:
        run(cfg, comm, plane=data_plane)
    assert str(raised.value) == (
        f"model.loss: '{__name__}:named_by_rank' returns other metric names on other ranks: rank 0: ['a']; "
        f"{f'ranks {others}' if len(others) > 1 else 'rank 1'}: ['b']; return the same names on every rank (their "
        "values are averaged over the ranks name by name)")
    comm.Barrier()


def metrics_from_the_second_call(model, batch):
    """Cross-entropy; a metric from the second call on (the first is the start-up check)."""
    metrics_from_the_second_call.calls = getattr(metrics_from_the_second_call, "calls", 0) + 1
    x, y = batch
    return F.cross_entropy(model(x), y), {} if metrics_from_the_second_call.calls == 1 else {"late": 1.0}


def test_metric_names_are_those_of_the_start_up_check_even_when_it_returned_none():
    model, batch = nn.Linear(6, 3), _pair()
    objective = Objective(f"{__name__}:metrics_from_the_second_call")
    metrics_from_the_second_call.calls = 0
    objective.check(model, TorchDatasetSplit(torch.utils.data.TensorDataset(*batch), "test"), lambda b: b)
    with pytest.raises(UsageError, match=r"returned metrics \['late'\], where its first call returned \[\]"):
        objective(model, batch)


@pytest.mark.mpi
def test_regression_with_data_balance_is_the_single_process_update(comm, data_plane, mpi_tmp_path):
    """MSE on float targets (kind 'other'), a slow last rank given fewer samples: each rank's mean loss is weighted
    by its share, so the update is one process's on the same global batch; the metric too."""
    size, rank = comm.Get_size(), comm.Get_rank()
    args = ["data.dataset=examples.objectives:regression", "data.options.n=256", "data.options.features=4",
            "model.factory=examples.objectives:regressor", "model.options.hidden=8",
            "model.loss=examples.objectives:mse", "optim.name=sgd", "optim.lr=0.05", "train.steps=8",
            "checkpoint.at_end=false", "run.log_every=8"]
    balanced = run(train_config(mpi_tmp_path, "unused", "balanced", *args, "data.balance=auto",
                                "data.balance_every=2", "fault.slow_per_sample_s=0.02"), comm, plane=data_plane)
    sizes = balanced.summary["balance"]["sizes"]
    if size > 1:
        assert sizes[-1] < 4 and sum(sizes) == 4 * size
    alone = run(train_config(mpi_tmp_path, "unused", f"alone{rank}", *args, f"train.batch_size={4 * size}"),
                MPI.COMM_SELF)
    torch.testing.assert_close(flat_params(balanced), flat_params(alone), rtol=1e-4, atol=1e-5)
    assert balanced.summary["final_loss"] == pytest.approx(alone.summary["final_loss"], rel=1e-4)
    comm.Barrier()


def nan_at_step_3(model, batch):
    """MSE, non-finite on every rank's third call (the third step: no accumulation here)."""
    nan_at_step_3.calls = getattr(nan_at_step_3, "calls", 0) + 1
    loss, metrics = ex.mse(model, batch)
    return (loss * float("nan") if nan_at_step_3.calls == 4 else loss), metrics  # call 1 is the start-up check


@pytest.mark.mpi
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_the_non_finite_guard_sees_a_user_objective(comm, data_plane, mpi_tmp_path, policy):
    nan_at_step_3.calls = 0
    args = ["data.dataset=examples.objectives:regression", "data.options.n=64", "data.options.features=4",
            "model.factory=examples.objectives:regressor", f"model.loss={__name__}:nan_at_step_3",
            "train.steps=5", f"train.nonfinite={policy}", "checkpoint.at_end=false"]
    result = run(train_config(mpi_tmp_path, "unused", f"nan-{policy}", *args), comm, plane=data_plane)
    if policy == "skip":
        assert result.summary["skipped_steps"] == 1 and result.summary["steps"] == 5
        assert torch.isfinite(flat_params(result)).all()
    else:
        assert result.summary["diverged"].startswith("non-finite loss") and result.summary["steps"] == 3
        assert result.exit_code == ExitCode.DIVERGED
    comm.Barrier()


@pytest.mark.mpi
def test_a_model_that_returns_its_own_loss_from_dict_batches_learns(comm, data_plane, mpi_tmp_path):
    """No model.loss: dict batches go in as model(**batch), the output's .loss is the loss; evaluation reports it
    (no accuracy: nothing to count)."""
    args = ["data.dataset=examples.objectives:dict_tokens", "data.options.n=256",
            "model.factory=examples.objectives:self_loss", "optim.name=adamw", "optim.lr=0.01", "train.steps=30",
            "train.eval_every=30", "train.batch_size=8", "checkpoint.at_end=false"]
    result = run(train_config(mpi_tmp_path, "unused", "dict", *args), comm, plane=data_plane)
    assert set(result.summary["eval"]) == {"eval_loss"}
    assert result.summary["eval"]["eval_loss"] < 0.5 * np.log(32)  # from log(vocab) at the start
    comm.Barrier()


@pytest.mark.launch
@pytest.mark.parametrize(("extra", "status", "needle"), [
    (["model.factory=examples.objectives:regressor"], ExitCode.USAGE_ERROR,
     "model.loss is not set, so the loss is cross-entropy over classes, and the targets are torch.float32"),
    (["model.factory=examples.objectives:regressor", "model.loss=examples.objectives:missing"],
     ExitCode.USAGE_ERROR, "model.loss: module 'examples.objectives' has no attribute 'missing'"),
    (["model.factory=examples.objectives:regressor", "model.loss=examples.objectives:Regression"],
     ExitCode.CODE_ERROR, "model.loss 'examples.objectives:Regression' failed on the first 2 samples"),
])
def test_an_objective_that_cannot_be_computed_stops_every_rank_with_one_line(launch, tmp_path, extra, status, needle):
    out = launch(2, f"run.dir={tmp_path / 'runs'}", "data.dataset=examples.objectives:regression",
                 "data.options.n=256", "train.steps=2", "dist.probe=false", *extra, timeout=120,
                 env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == status, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line or ("rank" in line and "Error" in line)]
    assert errors == [errors[0]] and errors[0].startswith(f"hpcnet: error: {needle}"), out.stderr
    assert "Traceback" not in out.stderr, out.stderr
