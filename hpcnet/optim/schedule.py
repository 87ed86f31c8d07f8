"""The learning-rate schedule (``optim.warmup_steps``, ``optim.decay``, ``optim.schedule``).

The loop sets every param group's learning rate before each step (``Schedule.apply``).  The built-in schedule is
a function of the step (``lr_factor``).  A torch scheduler (``optim.schedule``) is not bound to the real optimizer:
the sharded optimizer (``dist.zero`` >= 1) rebuilds its inner optimizer whenever the owners change, and holds other
parameters on each rank.  It runs on a shadow optimizer instead, one empty parameter per param group with the
groups' hyperparameters, and the loop copies the shadow's values into the real groups: the same numbers on every
rank, at every stage, whatever the owners.  Its state (the scheduler's and the shadow's groups) is a part of the
run (``hpcnet.stateful``), in the checkpoint's meta: it does not depend on the world size.
"""

import inspect
import json
import logging
import math
from typing import Any

import torch
from torch.optim import lr_scheduler

from hpcnet.config import OptimConfig
from hpcnet.config.importing import is_import_path, load_object
from hpcnet.errors import ConfigError
from hpcnet.stateful import Entries, Saved, Stateful

log = logging.getLogger("hpcnet.train")

CARRIED = ("lr", "momentum", "betas")
"""The param group values a scheduler sets (OneCycleLR and CyclicLR cycle momentum or Adam's beta1 too), copied from
the shadow into the real groups that have them."""
LENGTH_OPTIONS = ("T_max", "total_steps")
"""Options that are a schedule's length, ``train.steps`` when not given (CosineAnnealingLR, OneCycleLR)."""
BUILT_BY_HPCNET = ("last_epoch", "verbose")
"""Constructor arguments hpcnet owns: a resume takes the schedule's position from the checkpoint."""
POSITIVE_OPTIONS = ("step_size", "step_size_up", "T_0", "T_max", "total_steps")
"""Options that count steps and must be at least 1, which torch does not check for all of them (StepLR with a
negative step_size multiplies the learning rate by 1/gamma every few steps)."""
PROBED_STEPS = 10_000
"""How many of a schedule's steps start-up computes on a copy to find a learning rate that is negative or not
finite (ExponentialLR with a negative gamma flips its sign every step)."""
NEEDS_CODE = ("LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler")
"""torch schedulers that take functions or other schedulers: built by a function of the user's."""


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate at ``step`` as a fraction of ``optim.lr``: linear warm-up, then decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def named_schedulers() -> dict[str, type]:
    """Torch's schedulers that ``optim.schedule`` takes by name (the class name), with their options alone."""
    return {name: cls for name, cls in vars(lr_scheduler).items()
            if inspect.isclass(cls) and issubclass(cls, lr_scheduler.LRScheduler) and not name.startswith("_")
            and name != "LRScheduler" and name not in NEEDS_CODE}


class _Shadow(torch.optim.Optimizer):
    """An optimizer over one empty tensor per param group that changes nothing: what a torch scheduler steps."""

    def __init__(self, hyper: list[dict[str, Any]], defaults: dict[str, Any]) -> None:
        super().__init__([{**h, "params": [torch.empty(0, requires_grad=True)]} for h in hyper], defaults)

    def step(self, closure: Any = None) -> None:
        """Nothing to update (torch's schedulers expect a step of their optimizer before each of theirs)."""


class Schedule(Stateful):
    """The learning rate (and what a torch scheduler cycles) of every param group at each step.

    Args:
        optimizer: the run's optimizer before its first step: its groups' learning rates are the base ones.
        cfg: ``optim.*``.
        total_steps: ``train.steps``.

    Raises:
        ConfigError: ``optim.schedule`` or ``optim.schedule_options`` cannot make a scheduler (named).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> None:
        self.cfg, self.total_steps = cfg, total_steps
        self.hyper = [{k: group[k] for k in CARRIED if k in group} for group in optimizer.param_groups]
        self.defaults = {k: optimizer.defaults[k] for k in CARRIED if k in optimizer.defaults}
        self.scheduler: Any = None
        self.steps = 0
        """Scheduler steps taken: one a training step, or one a logged loss for ReduceLROnPlateau."""
        if cfg.schedule:
            self.shadow, self.scheduler, self.arguments = self._build()
            self.on_loss = isinstance(self.scheduler, lr_scheduler.ReduceLROnPlateau)
            if not self.on_loss:
                self._probe()

    def _probe(self) -> None:
        """Compute the schedule's first ``PROBED_STEPS`` steps (at most the run's) on a copy: a learning rate that
        is negative or not finite is a ConfigError naming the step, before the run trains on it."""
        shadow, scheduler, _ = self._build()
        for step in range(1, min(self.total_steps, PROBED_STEPS) + 1):
            shadow.step()
            try:
                scheduler.step()
            except ValueError:  # past a OneCycleLR's length: the run says so at that step
                return
            bad = [g["lr"] for g in shadow.param_groups if not (math.isfinite(g["lr"]) and g["lr"] >= 0)]
            if bad:
                raise ConfigError(f"optim.schedule: {type(scheduler).__name__} with optim.schedule_options "
                                  f"{self.cfg.schedule_options} gives a learning rate of {bad[0]} at step {step}")

    def _build(self) -> tuple[_Shadow, Any, dict[str, Any]]:
        """A fresh shadow and its scheduler, and the arguments that made it."""
        cfg, shadow = self.cfg, _Shadow(self.hyper, self.defaults)
        if is_import_path(cfg.schedule):
            make = load_object(cfg.schedule, "optim.schedule")
            arguments = {"total_steps": self.total_steps, **cfg.schedule_options}
            try:
                scheduler = make(shadow, self.total_steps, **cfg.schedule_options)
            except Exception as exc:
                raise ConfigError(f"optim.schedule: {cfg.schedule} raised {type(exc).__name__}: {exc}") from exc
            if not isinstance(scheduler, lr_scheduler.LRScheduler) or scheduler.optimizer is not shadow:
                raise ConfigError(f"optim.schedule: {cfg.schedule} returned {type(scheduler).__name__}, not a "
                                  "torch.optim.lr_scheduler.LRScheduler of the optimizer it was given")
        else:
            cls = scheduler_class(cfg.schedule)
            arguments = scheduler_arguments(cls, cfg.schedule_options, self.total_steps)
            try:
                scheduler = cls(shadow, **arguments)
            except (ValueError, TypeError, KeyError) as exc:
                hint = ("; optim.schedule_options.cycle_momentum=false cycles the learning rate alone"
                        if "cycle_momentum" in str(exc) else "")
                raise ConfigError(f"optim.schedule_options: torch's {cls.__name__} refuses them: {exc}{hint}") from exc
        try:
            json.dumps(scheduler.state_dict(), allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"optim.schedule: {type(scheduler).__name__}'s state_dict cannot be saved in a "
                              f"checkpoint's meta (JSON): {exc}") from exc
        return shadow, scheduler, arguments

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Set ``optimizer``'s param groups for the step after ``step`` steps (a torch scheduler is stepped up to
        it: once a step, or replayed from 0 after a resume whose schedule changed)."""
        groups = optimizer.param_groups
        if self.scheduler is None:
            factor = lr_factor(step, self.total_steps, self.cfg)
            for group, hyper in zip(groups, self.hyper, strict=True):
                group["lr"] = hyper["lr"] * factor
            return
        if not self.on_loss:
            self._advance_to(step)
        for group, shadow in zip(groups, self.shadow.param_groups, strict=True):
            for key in CARRIED:
                if key in group and key in shadow:
                    group[key] = shadow[key]

    def observe(self, loss: float) -> None:
        """The global loss logged after a step (``run.log_every``): what ReduceLROnPlateau steps on."""
        if self.scheduler is not None and self.on_loss:
            self.shadow.step()
            self.scheduler.step(loss)
            self.steps += 1

    def _advance_to(self, step: int) -> None:
        if step < self.steps:
            # A state ahead of the step (kept by a survivor that began the next step before a rank was lost, then
            # went back with the others): replayed from step 0, the same values for a schedule of the step.
            self.shadow, self.scheduler, self.arguments = self._build()
            self.steps = 0
        while self.steps < step:
            self.shadow.step()
            try:
                self.scheduler.step()
            except ValueError as exc:  # OneCycleLR past its total_steps
                raise ConfigError(f"optim.schedule: {type(self.scheduler).__name__} refuses step {self.steps + 1}"
                                  f": {exc}") from exc
            self.steps += 1

    def _identity(self) -> dict[str, Any]:
        """What made the scheduler, as a checkpoint's meta holds it (JSON): a resume compares it with its own."""
        return json.loads(json.dumps({"schedule": self.cfg.schedule, "arguments": self.arguments,
                                      "groups": self.hyper}))

    def state_entries(self) -> Entries:
        """The scheduler's state and the shadow's groups (``schedule`` in the meta); none for the built-in."""
        if self.scheduler is None:
            return Entries()
        state = {"of": self._identity(), "steps": self.steps, "scheduler": self.scheduler.state_dict(),
                 "groups": [{k: g[k] for k in CARRIED if k in g} for g in self.shadow.param_groups]}
        return Entries(meta={"schedule": json.loads(json.dumps(state))})  # a copy: the scheduler goes on

    def load_entries(self, saved: Saved) -> None:
        """Go on from the saved schedule; one that changed (another optim.schedule, its options, train.steps where
        it is the length, the learning rates) is followed anew from step 0 (replayed), with a warning."""
        if self.scheduler is None:
            return
        state = saved.meta.get("schedule")
        if state is not None and state["of"] == self._identity():
            self.scheduler.load_state_dict(state["scheduler"])
            for group, values in zip(self.shadow.param_groups, state["groups"], strict=True):
                group.update({k: tuple(v) if k == "betas" else v for k, v in values.items()})
            self.steps = state["steps"]
            return
        was = "no optim.schedule" if state is None else f"{state['of']}"
        how = "from the first logged loss" if self.on_loss else f"as if from step 0 up to step {saved.step}"
        log.warning("optim.schedule: %s saved %s, this run has %s: the new schedule is followed %s", saved.source,
                    was, self._identity(), how)
        self.shadow, self.scheduler, self.arguments = self._build()
        self.steps = 0


def scheduler_class(name: str) -> type:
    """Torch's scheduler named ``name`` (its class name, in any case); ConfigError naming optim.schedule."""
    known = named_schedulers()
    by_lower = {key.lower(): cls for key, cls in known.items()}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    if name in NEEDS_CODE:
        raise ConfigError(f"optim.schedule: {name} takes functions or other schedulers, which an option cannot "
                          "give: name a function of yours that builds it, 'package.module:function'")
    raise ConfigError(f"optim.schedule: {name!r} is neither one of torch's schedulers ({', '.join(known)}) nor "
                      "'package.module:function'")


def scheduler_arguments(cls: type, options: dict[str, Any], total_steps: int) -> dict[str, Any]:
    """``optim.schedule_options`` checked against ``cls``'s constructor, a length (``LENGTH_OPTIONS``) not given
    being ``total_steps``; ConfigError naming the option."""
    params = inspect.signature(cls.__init__).parameters
    accepted = [n for n, p in params.items() if n not in ("self", "optimizer", *BUILT_BY_HPCNET)
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for key in options:
        if key in BUILT_BY_HPCNET:
            raise ConfigError(f"optim.schedule_options.{key}: set by hpcnet (a resume takes the schedule's position "
                              "from the checkpoint)")
        if key not in accepted:
            raise ConfigError(f"optim.schedule_options.{key}: not an option of {cls.__name__} (it takes "
                              f"{', '.join(accepted)})")
    arguments = dict(options)
    for key in LENGTH_OPTIONS:
        if key in accepted and key not in arguments and "epochs" not in arguments:
            arguments[key] = total_steps
    missing = [n for n in accepted if params[n].default is inspect.Parameter.empty and n not in arguments]
    if missing:
        raise ConfigError(f"optim.schedule_options.{missing[0]}: {cls.__name__} needs it")
    for key in POSITIVE_OPTIONS:
        value = options.get(key)
        if value is not None and not (isinstance(value, (int, float)) and value >= 1):
            raise ConfigError(f"optim.schedule_options.{key}: {cls.__name__} counts steps with it: at least 1, "
                              f"got {value!r}")
    return arguments
