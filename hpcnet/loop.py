"""The training loop: one optimizer step per iteration, progress logs, evaluation, and the step boundary at
which every rank agrees on stopping, saving and non-finite values (docs/fault-tolerance.md, docs/checkpoints.md)."""

import logging
import math
import signal
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcnet.ckpt.schedule import NONFINITE_GRAD, NONFINITE_LOSS, SavePolicy
from hpcnet.ckpt.state import TrainState
from hpcnet.comm.dataparallel import DataParallel
from hpcnet.config import Config
from hpcnet.data.balance import Balancer
from hpcnet.data.loader import BatchLoader
from hpcnet.data.sampler import eval_indices
from hpcnet.errors import ExitCode
from hpcnet.fault.grow import Growing
from hpcnet.fault.inject import FaultInjector
from hpcnet.fault.monitor import Monitor
from hpcnet.models.device import BatchMover, DeviceSettings
from hpcnet.objective import Objective
from hpcnet.observe.phases import bucket_times, rss_mib
from hpcnet.observe.runlog import MetricsWriter, format_duration
from hpcnet.observe.stats import job_step_stats, rank_step_stats
from hpcnet.observe.trace import StepTracer
from hpcnet.optim import Schedule
from hpcnet.world import World

log = logging.getLogger("hpcnet.train")


def finite_flags(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> tuple[bool, bool]:
    """Whether this rank's loss and the gradient norm (None: not computed) are finite.

    One device-to-host copy for both: the only per-step synchronisation with
    the GPU that ``train.nonfinite`` adds ('ignore' adds none).
    """
    norm = torch.zeros_like(loss) if grad_norm is None else grad_norm
    loss_ok, grad_ok = torch.isfinite(torch.stack([loss.detach().float(), norm.detach().float()])).tolist()
    return loss_ok, grad_ok


def record_checkpoint(metrics: MetricsWriter, step: int, timings: dict[str, float]) -> None:
    """A save's times in the metrics (and TensorBoard): at the save, or once committed (``io_s`` and each stretch:
    the checkpoint manager's ``on_finished``)."""
    metrics.write(step=step, checkpoint={k: round(v, 6) for k, v in timings.items()})


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.0f} ms" if seconds >= 0.01 else f"{1e3 * seconds:.1f} ms"


def _update(optimizer: torch.optim.Optimizer, loss: torch.Tensor, grad_norm: torch.Tensor | None,
            on_nonfinite: str) -> tuple[bool, int]:
    """Run the optimizer step unless ``train.nonfinite=skip`` drops it.

    Returns whether the update was applied, and the ``NONFINITE_*`` bits this
    rank brings to the step boundary.
    """
    if on_nonfinite == "ignore":
        optimizer.step()
        return True, 0
    if on_nonfinite == "skip":
        loss_ok, grad_ok = finite_flags(loss, grad_norm)  # before the update it may drop
        if not grad_ok:
            return False, 0  # on every rank alike: the averaged gradients are the same everywhere
        optimizer.step()
        # A non-finite loss with a finite gradient stops the run: dropping updates cannot help it.
        return True, 0 if loss_ok else NONFINITE_LOSS
    optimizer.step()
    loss_ok, grad_ok = finite_flags(loss, grad_norm)  # after the update is queued: the GPU need not wait for it
    return True, (0 if loss_ok else NONFINITE_LOSS) | (0 if grad_ok else NONFINITE_GRAD)


def _nonfinite_message(step: int, nonfinite: int) -> str:
    """What the ranks agreed was non-finite at ``step`` (``NONFINITE_*`` bits)."""
    what = [name for bit, name in ((NONFINITE_LOSS, "loss (on at least one rank)"), (NONFINITE_GRAD, "gradient norm"))
            if nonfinite & bit]
    return f"non-finite {' and '.join(what)} at step {step}"


@dataclass
class LoopProgress:
    """Where the loop is: the step, the last logged step and loss, evaluation, and why it stopped."""

    step: int
    start_step: int
    t_loop: float = field(default_factory=time.perf_counter)
    t_last: float = 0.0
    last_step: int = 0
    loss_value: float = float("nan")
    evaluation: dict[str, float] = field(default_factory=dict)
    skipped_steps: int = 0
    stopped_by: int = 0
    diverged: str = ""
    shares: list[float] | None = None
    """data.balance: each rank's fraction of the global batch in the last step computed; a re-split after it
    changes the balancer's, not these, so the step's loss is weighted as it was computed."""

    def __post_init__(self) -> None:
        self.t_last, self.last_step = self.t_loop, self.step


class Loop:
    """One pass of the training loop over ``dp``'s model, from a start step to ``train.steps`` (collective)."""

    def __init__(self, cfg: Config, comm: Any, world: World, dp: DataParallel, optimizer: torch.optim.Optimizer,
                 schedule: Schedule, loader: BatchLoader, eval_split: Any, device: torch.device, metrics: MetricsWriter,
                 state: TrainState, faults: FaultInjector, monitor: Monitor, stop: Any = None,
                 mover: BatchMover | None = None, balancer: Balancer | None = None,
                 tracer: StepTracer | None = None, objective: Objective | None = None,
                 grow: Any = None, mirror: Any = None) -> None:
        self.cfg, self.comm, self.world, self.dp, self.optimizer = cfg, comm, world, dp, optimizer
        self.schedule = schedule  # built before a resume, from the optimizer's first learning rates
        self.loader, self.eval_split, self.device, self.metrics = loader, eval_split, device, metrics
        self.state, self.faults, self.monitor, self.stop = state, faults, monitor, stop
        self.total = cfg.train.steps
        self.global_batch = loader.sampler.global_batch_size * cfg.train.grad_accumulation
        self.on_nonfinite = cfg.train.nonfinite  # stop | skip | ignore
        self.policy = SavePolicy.from_config(cfg)
        # model.loss (checked at start-up by the trainer), under train.precision
        self.objective = objective or Objective(cfg.model.loss, device=device, precision=cfg.train.precision)
        if cfg.fault.slow_per_sample_s:
            self.objective.slow = faults.slow_compute
        self.mover = mover or BatchMover(device, DeviceSettings())
        self.balancer = balancer
        self.clock = dp.clock  # where each step's time goes (hpcnet.observe.phases); DataParallel marks its part
        self.tracer = tracer  # train.trace_steps
        self._log_from_step = 0
        self.grow = grow
        """Replacements for lost ranks (``hpcnet.fault.live.Live``): started at a boundary, and the loop stops at
        the boundary after which they wait to join, for the job to grow back."""
        self.mirror = mirror
        """``fault.replicas=1``: this rank's state copied, and its ward's kept, at every step's end
        (``hpcnet.fault.mirror.Mirror``)."""
        self.progress: LoopProgress | None = None
        """Where ``run`` is (what a rebuild after lost ranks goes on from: ``hpcnet.fault.live``)."""

    def run(self, start_step: int) -> dict[str, Any]:
        """Train from ``start_step``; the run's summary."""
        p = self.progress = LoopProgress(step=start_step, start_step=start_step, shares=self._slices())
        loss = None
        self.dp.model.train()
        self._log_from_step = start_step
        if p.step >= self.total and self.policy.at_end and self.state.last_saved_step < p.step:
            self._save(p)  # a state newer than its newest checkpoint: the survivors' memory after a loss at the end
        self._mirror(p)  # a loss in the first step is covered too
        while p.step < self.total:
            loss, nonfinite = self._step(p)
            self._log_if_due(p, loss)
            self._evaluate_if_due(p)
            stop = self._boundary(p, nonfinite)
            if self.tracer is not None:
                self.tracer.after_step(p.step)  # after END: every rank's events to trace.json (collective)
            if stop:
                break
        if self.tracer is not None:
            self.tracer.close(p.step)
        self.clock.end()
        if loss is not None and p.step % self.cfg.run.log_every and p.step != self.total:  # stopped between logs
            p.loss_value = self._gather_log(loss.item(), self.objective.take_metrics(), p.shares, [])[0]
        self.dp.sync_buffers()
        step_stats = self._step_stats()
        elapsed = time.perf_counter() - p.t_loop
        return {"steps": p.step, "start_step": p.start_step, "final_loss": p.loss_value, "eval": p.evaluation,
                "samples_per_s": (p.step - p.start_step) * self.global_batch / max(elapsed, 1e-9),
                "stopped_by_signal": p.stopped_by, "diverged": p.diverged, "skipped_steps": p.skipped_steps,
                **({"step_stats": step_stats} if step_stats is not None else {}),
                **({"balance": self.balancer.summary()} if self.balancer is not None else {})}

    def _slices(self) -> list[float] | None:
        """Each rank's fraction of the global batch where they differ (a job that lost ranks keeps its global
        batch), else None (equal)."""
        sizes = self.loader.sampler.sizes
        return [b / sum(sizes) for b in sizes] if len(set(sizes)) > 1 else None

    def _step(self, p: LoopProgress) -> tuple[torch.Tensor, int]:
        """Forward, backward, averaged gradients, the update; the ``NONFINITE_*`` bits this rank brings."""
        cfg = self.cfg
        self.clock.start_step()
        if self.tracer is not None:
            self.tracer.before_step(p.step + 1)
        self.schedule.apply(self.optimizer, p.step)
        batches = [self.mover(self.loader.next()) for _ in range(cfg.train.grad_accumulation)]
        self.objective.start_step()  # the metrics logged are this step's, as its loss is
        self.clock.mark("data")
        loss = self.dp.step(batches, self.objective, step=p.step + 1)
        # The averaged gradients are the same on every rank, so a verdict from their norm needs
        # no collective; computing it costs a pass over them, paid only for clipping or skip.
        grad_norm = None
        if cfg.optim.grad_clip > 0:
            grad_norm = self.dp.clip_grad_norm_(cfg.optim.grad_clip)  # dist.zero=2: gathered from the owners
        elif self.on_nonfinite == "skip":
            grad_norm = self.dp.grad_norm()
        applied, nonfinite = _update(self.optimizer, loss, grad_norm, self.on_nonfinite)
        self.clock.mark("optimizer")
        p.step += 1
        if self.balancer is not None:
            p.shares = self.balancer.shares
            self.balancer.after_step(p.step)  # data.balance=auto: every data.balance_every steps, collective
        self.dp.after_step(p.step)  # dist.reassign_every with dist.zero > 0: every that many steps, collective
        self._mirror(p)  # before anything can end the step: a loss from here on goes on from this step
        self.monitor.step(p.step)  # heartbeats carry it; step times set the stall timeout; memory samples
        self.faults.at_step(p.step)  # fault.* injection; a no-op unless configured
        if not applied:
            p.skipped_steps += 1
            if self.world.is_main:
                log.warning("step %d: non-finite gradient norm, update skipped (train.nonfinite=skip; %d so far)",
                            p.step, p.skipped_steps)
        return loss, nonfinite

    def _mirror(self, p: LoopProgress) -> None:
        """``fault.replicas=1``: the state after ``p.step`` copied and mirrored on the keepers (collective)."""
        if self.mirror is None:
            return
        self.clock.mark("other")  # what came before (balancing, owners) is not the mirror's
        self.mirror.capture(self.state, p.step, self.comm, self.monitor)
        self.clock.mark("mirror")

    def _gather_log(self, local_loss: float, metrics: dict[str, float], shares: list[float] | None,
                    step_s: list[float], comm_s: float = 0.0
                    ) -> tuple[float, list[tuple[float, float, float, dict[str, float]]], dict[str, float]]:
        """The global loss of a step computed with batch ``shares`` (None: equal), every rank's (loss, median
        step seconds, exposed-communication share, model.loss's metrics) of the interval, and the metrics'
        global means, weighted as the loss is (collective)."""
        median = statistics.median(step_s) if step_s else 0.0
        with self.monitor.collective("loss.allreduce"):
            every = self.comm.allgather((local_loss, median, comm_s / sum(step_s) if step_s else 0.0, metrics))
        weights = (list(shares) if shares is not None and len(set(shares)) > 1
                   else [1 / self.world.size] * self.world.size)  # unequal slices: each rank's mean by its share

        def mean(values: list[float]) -> float:
            return math.fsum(value * weight for value, weight in zip(values, weights))
        names = sorted(set().union(*(m for *_, m in every)))
        return (mean([loss for loss, *_ in every]), every,
                {name: mean([m.get(name, math.nan) for *_, m in every]) for name in names})

    def _log_if_due(self, p: LoopProgress, loss: torch.Tensor) -> None:
        if p.step % self.cfg.run.log_every and p.step != self.total:
            return
        self.clock.split()  # the interval's steps end here; what follows is the next step's
        step_s, phases = self.clock.take_interval()
        local_loss = loss.item()
        p.loss_value, every, metrics = self._gather_log(local_loss, self.objective.take_metrics(), p.shares, step_s,
                                                        phases["comm"])
        self.schedule.observe(p.loss_value)  # ReduceLROnPlateau's metric: the same on every rank
        self.clock.mark("comm")
        now = time.perf_counter()
        rate = (p.step - p.last_step) * self.global_batch / max(now - p.t_last, 1e-9)
        eta = (now - p.t_loop) / (p.step - p.start_step) * (self.total - p.step)
        lr = self.optimizer.param_groups[0]["lr"]
        slowest = max(range(len(every)), key=lambda r: (every[r][1], -r))
        if self.world.is_main:
            log.info("step %*d/%d | loss %.4f%s | lr %.2e | %.0f samples/s | step %s (slowest: rank %d, %s) "
                     "| comm %.0f%% | eta %s", len(str(self.total)), p.step, self.total, p.loss_value,
                     "".join(f" | {name} {value:.4g}" for name, value in metrics.items()), lr, rate,
                     _ms(every[0][1]), slowest, _ms(every[slowest][1]),
                     100 * statistics.fmean(c for _, _, c, _ in every), format_duration(eta))
        extra: dict[str, Any] = {}
        if self.device.type == "cuda":
            extra["cuda_mb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        self.metrics.write(step=p.step, loss=local_loss, global_loss=p.loss_value, lr=lr, samples_per_s=rate,
                           epoch=self.loader.epoch, steps=len(step_s), step_s=[round(t, 6) for t in step_s],
                           phases_s={k: round(v, 6) for k, v in phases.items()}, rss_mb=round(rss_mib(), 1),
                           buckets=bucket_times(self.monitor.recorder.entries(), self._log_from_step),
                           slowest_rank=slowest, slowest_step_s=round(every[slowest][1], 6),
                           **{f"train_{name}": value for name, value in metrics.items()}, **extra)
        self._log_from_step = p.step
        p.t_last, p.last_step = now, p.step

    def _step_stats(self) -> dict[str, Any] | None:
        """Every rank's step-time figures, gathered on rank 0 for summary.json (collective; None elsewhere).
        The run's first step (lazy initialisation) is left out when there are others."""
        step_s = self.clock.step_s[1:] if len(self.clock.step_s) > 1 else self.clock.step_s
        mine = rank_step_stats(step_s, {k: round(v, 6) for k, v in self.clock.totals.items()})
        with self.monitor.collective("stats.gather"):
            every = self.comm.gather(mine, root=0)
        return job_step_stats(every) if every is not None else None

    def _evaluate_if_due(self, p: LoopProgress) -> None:
        every = self.cfg.train.eval_every
        if not every or (p.step % every and p.step != self.total):
            return
        self.dp.sync_buffers()
        p.evaluation = self.objective.evaluate(
            self.dp.model, self.eval_split, self.comm, indices=eval_indices(len(self.eval_split), self.world.rank,
                                                                            self.world.size),
            batch_size=self.cfg.train.batch_size, max_batches=self.cfg.train.eval_batches, move=self.mover,
            recorder=self.monitor.recorder, scope=self.dp.params_in_use)
        self.clock.mark("eval")
        if self.world.is_main:
            log.info("eval at step %d: %s", p.step, ", ".join(
                f"accuracy {100 * value:.2f}%" if name == "eval_accuracy" else f"{name[5:]} {value:.4f}"
                for name, value in p.evaluation.items()))
        self.metrics.write(step=p.step, **p.evaluation)

    def _boundary(self, p: LoopProgress, nonfinite: int) -> bool:
        """Every rank agrees on stopping and saving after this step; True: the loop ends here."""
        manager = self.state.manager
        with self.monitor.collective("step_boundary"):
            p.stopped_by, save, nonfinite, writing, grow = self.policy.agree(
                self.comm, p.step, self.stop.signum if self.stop else 0, nonfinite=nonfinite, writing=manager.busy(),
                grow=self.grow.grow_flag(p.step) if self.grow is not None else 0)
        self.clock.mark("comm")
        if nonfinite:
            p.diverged = _nonfinite_message(p.step, nonfinite)
        elif save:
            self._save(p)
        elif manager.in_flight and not writing:
            # Every rank's background stretch of the save is done: its next collective stretch runs here, in
            # the training thread, so the writer thread never enters MPI (hpcnet.ckpt.write).
            manager.advance()  # guarded by the checkpoint deadlines, as a save is
            self.clock.mark("checkpoint")
        if p.diverged:
            self._report_divergence(p)
            return True
        if p.stopped_by:
            log.warning("stopping after step %d/%d on %s (checkpoint saved)", p.step, self.total,
                        signal.Signals(p.stopped_by).name)
            return True
        if grow == 1:
            self.grow.start_replacements(self.comm, p.step)
            self.clock.mark("comm")
        elif grow == 2:
            raise Growing(p.step)  # every rank, here: the job grows back and goes on from this step
        return False

    def _save(self, p: LoopProgress) -> None:
        self.dp.sync_buffers()
        finite = True
        if self.on_nonfinite != "ignore":
            with self.monitor.collective("state.is_finite"):
                finite = self.state.is_finite()
        if finite:
            self.state.save(p.step)  # the loader's position among the parts (hpcnet.train)
            self.policy.saved()
            timings = self.state.manager.last_timings
            if self.tracer is not None:
                self.tracer.checkpoint(p.step, timings)
            if self.state.manager.in_flight:  # what it blocked; the manager's on_finished records the whole save
                record_checkpoint(self.metrics, p.step, timings)
        else:
            p.diverged = (f"non-finite model or optimizer state after step {p.step} (an update overflowed, "
                          "or a forward pass left non-finite statistics)")
        self.clock.mark("checkpoint")

    def _report_divergence(self, p: LoopProgress) -> None:
        if not self.world.is_main:
            return
        last = self.state.last_saved_step
        kept = f"the newest checkpoint, step {last}, is kept" if last >= 0 else "no checkpoint was saved"
        log.error("%s: every rank stops after step %d/%d and saves nothing of it (train.nonfinite=%s); "
                  "%s. A restart would diverge again: lower optim.lr or check the data (status %d)",
                  p.diverged, p.step, self.total, self.on_nonfinite, kept, ExitCode.DIVERGED)
