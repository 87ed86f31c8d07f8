"""The learning-rate schedule (hpcnet.optim.schedule): the built-in warm-up and decay, torch's schedulers by name,
a user's function; each on a shadow optimizer, checkpointed and resumed exactly."""

import logging

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from hpcnet.config import OptimConfig
from hpcnet.errors import ConfigError
from hpcnet.optim import Schedule, build_optimizer, lr_factor
from hpcnet.stateful import Saved


def step_then_halve(optimizer, total_steps, every=3):
    """A user's schedule (``optim.schedule = 'tests.optim.test_schedule:step_then_halve'``)."""
    return lr_scheduler.StepLR(optimizer, step_size=every, gamma=0.5)


def not_a_scheduler(optimizer, total_steps):
    return optimizer


def raises(optimizer, total_steps):
    raise RuntimeError("no schedule today")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _optimizer(name: str = "adamw") -> torch.optim.Optimizer:
    return build_optimizer(_model(), OptimConfig(name=name, lr=0.1))


def _lrs(schedule: Schedule, optimizer: torch.optim.Optimizer, steps: range) -> list[list[float]]:
    out = []
    for step in steps:
        schedule.apply(optimizer, step)
        out.append([group["lr"] for group in optimizer.param_groups])
    return out


def _resume(cfg: OptimConfig, total: int, meta: dict, step: int) -> Schedule:
    schedule = Schedule(_optimizer(), cfg, total)
    schedule.load_entries(Saved(tensors={}, meta=meta, step=step))
    return schedule


def test_the_default_is_optim_lr_times_lr_factor_bit_for_bit():
    cfg = OptimConfig(name="adamw", lr=0.1, warmup_steps=3, decay="cosine", min_lr_ratio=0.1)
    optimizer = build_optimizer(_model(), cfg)
    schedule = Schedule(optimizer, cfg, 20)
    assert _lrs(schedule, optimizer, range(20)) == [[cfg.lr * lr_factor(s, 20, cfg)] * 2 for s in range(20)]
    assert schedule.state_entries().meta == {}  # a function of the step: nothing to save


@pytest.mark.parametrize("name, options", [
    ("StepLR", {"step_size": 3, "gamma": 0.5}),
    ("steplr", {"step_size": 3}),  # any case
    ("OneCycleLR", {"max_lr": 0.3}),  # total_steps: train.steps
    ("CosineAnnealingLR", {}),  # T_max: train.steps
    ("CosineAnnealingWarmRestarts", {"T_0": 4}),
    ("ExponentialLR", {"gamma": 0.9}),
])
def test_a_torch_scheduler_by_name_sets_what_it_sets_on_the_optimizer_itself(name, options):
    """On the shadow, the real groups get the learning rates (and OneCycleLR's betas) that the scheduler bound
    to the real optimizer gives."""
    total = 12
    optimizer, direct_optimizer = _optimizer(), _optimizer()
    cls = {"steplr": lr_scheduler.StepLR}.get(name, getattr(lr_scheduler, name, None))
    length = {"OneCycleLR": {"total_steps": total}, "CosineAnnealingLR": {"T_max": total}}.get(name, {})
    direct = cls(direct_optimizer, **options, **length)
    schedule = Schedule(optimizer, OptimConfig(name="adamw", lr=0.1, schedule=name, schedule_options=options), total)
    for step in range(total):
        schedule.apply(optimizer, step)
        for group, expected in zip(optimizer.param_groups, direct_optimizer.param_groups, strict=True):
            assert (group["lr"], group["betas"]) == (expected["lr"], expected["betas"])
        direct_optimizer.step()
        direct.step()


def test_a_user_function_builds_the_schedule_with_its_options():
    cfg = OptimConfig(name="sgd", lr=0.1, schedule="tests.optim.test_schedule:step_then_halve",
                      schedule_options={"every": 2})
    optimizer = _optimizer("sgd")
    lrs = [lr for lr, _ in _lrs(Schedule(optimizer, cfg, 6), optimizer, range(6))]
    assert lrs == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]


def test_every_rank_s_groups_get_the_same_rates_whatever_they_hold():
    """The sharded optimizer's groups differ by rank (an owner may hold none of a group's parameters)."""
    cfg = OptimConfig(name="sgd", lr=0.1, schedule="ExponentialLR", schedule_options={"gamma": 0.5})
    full = _optimizer("sgd")
    part = torch.optim.SGD([{**g, "params": []} for g in full.param_groups[:1]] +
                           [{**full.param_groups[1], "params": full.param_groups[1]["params"]}], lr=0.1)
    schedule = Schedule(full, cfg, 5)
    schedule.apply(part, 3)
    assert [g["lr"] for g in part.param_groups] == [0.1 * 0.5**3] * 2


@pytest.mark.parametrize("name, options", [
    ("StepLR", {"step_size": 2, "gamma": 0.5}),  # chained: each rate from the group's last one
    ("CosineAnnealingWarmRestarts", {"T_0": 3, "T_mult": 2}),
    ("OneCycleLR", {"max_lr": 0.3}),
    ("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 3}),
])
def test_a_resume_goes_on_with_the_same_rates_bit_for_bit(name, options):
    cfg = OptimConfig(name="adamw", lr=0.1, schedule=name, schedule_options=options)
    total, cut = 16, 7
    optimizer = _optimizer()
    whole = Schedule(optimizer, cfg, total)
    expected = _lrs(whole, optimizer, range(total))
    optimizer = _optimizer()
    first = Schedule(optimizer, cfg, total)
    before = _lrs(first, optimizer, range(cut))
    meta = first.state_entries().meta
    second = _resume(cfg, total, meta, cut)
    assert second.steps == cut - 1  # from the checkpoint, not replayed
    optimizer = _optimizer()
    after = _lrs(second, optimizer, range(cut, total))
    assert before + after == expected
    assert optimizer.param_groups[0]["betas"] == _betas_at(cfg, total, total - 1)


def _betas_at(cfg: OptimConfig, total: int, step: int) -> tuple[float, float]:
    optimizer = _optimizer()
    Schedule(optimizer, cfg, total).apply(optimizer, step)
    return optimizer.param_groups[0]["betas"]


def test_reduce_on_plateau_steps_on_the_logged_loss_and_resumes():
    cfg = OptimConfig(name="sgd", lr=0.1, schedule="ReduceLROnPlateau", schedule_options={"patience": 1})
    losses = [1.0, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9]

    def run(schedule, optimizer, values):
        out = []
        for loss in values:
            schedule.apply(optimizer, 0)
            out.append(optimizer.param_groups[0]["lr"])
            schedule.observe(loss)
        return out
    optimizer = _optimizer("sgd")
    expected = run(Schedule(optimizer, cfg, 10), optimizer, losses)
    assert expected[0] == 0.1 and expected[-1] < 0.1  # the loss stalled: the rate fell
    optimizer = _optimizer("sgd")
    first = Schedule(optimizer, cfg, 10)
    before = run(first, optimizer, losses[:3])
    second = Schedule(_optimizer("sgd"), cfg, 10)
    second.load_entries(Saved(tensors={}, meta=first.state_entries().meta, step=3))
    assert before + run(second, _optimizer("sgd"), losses[3:]) == expected


def test_a_resume_with_other_options_follows_the_new_schedule_and_says_so(caplog):
    old = OptimConfig(name="adamw", lr=0.1, schedule="StepLR", schedule_options={"step_size": 2})
    new = OptimConfig(name="adamw", lr=0.1, schedule="StepLR", schedule_options={"step_size": 3})
    optimizer = _optimizer()
    first = Schedule(optimizer, old, 12)
    _lrs(first, optimizer, range(5))
    with caplog.at_level(logging.WARNING, logger="hpcnet.train"):
        second = _resume(new, 12, first.state_entries().meta, 5)
    assert "optim.schedule" in caplog.text and "step_size': 2" in caplog.text and "up to step 5" in caplog.text
    optimizer = _optimizer()
    fresh = _lrs(Schedule(_optimizer(), new, 12), _optimizer(), range(12))
    assert _lrs(second, optimizer, range(5, 12)) == fresh[5:]


def test_a_schedule_asked_for_an_earlier_step_gives_that_step_s_rates():
    """A survivor's state one step ahead of the step the job goes back to (hpcnet.fault.live)."""
    cfg = OptimConfig(name="adamw", lr=0.1, schedule="StepLR", schedule_options={"step_size": 2, "gamma": 0.5})
    optimizer = _optimizer()
    schedule = Schedule(optimizer, cfg, 10)
    schedule.apply(optimizer, 5)
    schedule.apply(optimizer, 3)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1 * 0.5] * 2


def test_a_checkpoint_without_a_schedule_replays_the_configured_one():
    cfg = OptimConfig(name="adamw", lr=0.1, schedule="ExponentialLR", schedule_options={"gamma": 0.5})
    schedule = _resume(cfg, 10, {}, 4)
    optimizer = _optimizer()
    schedule.apply(optimizer, 4)
    assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**4


@pytest.mark.parametrize("schedule, options, needle", [
    ("NoSuchLR", {}, "optim.schedule: 'NoSuchLR' is neither one of torch's schedulers (StepLR"),
    ("LambdaLR", {}, "optim.schedule: LambdaLR takes functions or other schedulers"),
    ("StepLR", {"step_sise": 3}, "optim.schedule_options.step_sise: not an option of StepLR (it takes step_size, "
                                 "gamma)"),
    ("StepLR", {}, "optim.schedule_options.step_size: StepLR needs it"),
    ("StepLR", {"step_size": 2, "last_epoch": 4}, "optim.schedule_options.last_epoch: set by hpcnet"),
    ("OneCycleLR", {"max_lr": 0.3, "pct_start": 2}, "optim.schedule_options: torch's OneCycleLR refuses them: "
                                                    "Expected float between 0 and 1 pct_start"),
    ("tests.optim.test_schedule:raises", {}, "optim.schedule: tests.optim.test_schedule:raises raised "
                                             "RuntimeError: no schedule today"),
    ("tests.optim.test_schedule:not_a_scheduler", {}, "not_a_scheduler returned _Shadow, not a "
                                                      "torch.optim.lr_scheduler.LRScheduler"),
    ("tests.optim.nowhere:f", {}, "optim.schedule: cannot import module 'tests.optim.nowhere'"),
    # torch takes these and trains: StepLR's rate grows 1/gamma-fold every 3 steps, ExponentialLR's flips its sign.
    ("StepLR", {"step_size": -3}, "optim.schedule_options.step_size: StepLR counts steps with it: at least 1, got -3"),
    ("ExponentialLR", {"gamma": -1.0}, "optim.schedule: ExponentialLR with optim.schedule_options {'gamma': -1.0} "
                                       "gives a learning rate of -0.1 at step 1"),
])
def test_a_bad_schedule_is_a_config_error_naming_the_option(schedule, options, needle):
    with pytest.raises(ConfigError) as err:
        Schedule(_optimizer(), OptimConfig(name="adamw", schedule=schedule, schedule_options=options), 10)
    assert needle in str(err.value)


def test_schedule_options_without_a_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="optim.schedule_options needs optim.schedule"):
        OptimConfig(schedule_options={"gamma": 0.5})


def test_a_schedule_past_its_length_names_the_option():
    cfg = OptimConfig(name="adamw", schedule="OneCycleLR", schedule_options={"max_lr": 0.3, "total_steps": 4})
    optimizer = _optimizer()
    schedule = Schedule(optimizer, cfg, 10)
    schedule.apply(optimizer, 4)  # torch's last step of a cycle of 4 (step 0 is its construction)
    with pytest.raises(ConfigError, match="optim.schedule: OneCycleLR refuses step 5"):
        schedule.apply(optimizer, 5)
