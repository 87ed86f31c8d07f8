"""hpcnet's training entry point: data-parallel training, one loop you can read.

Launch:
    mpirun -np 4 python -m mpi4py -m hpcnet.train [--config run.toml] [section.key=value ...]
    python -m hpcnet.train                       # a single process works too
    python -m hpcnet.train --help                # every option, with its doc
    python -m hpcnet.train --help-config         # the same as Markdown (docs/configuration.md)

Every rank runs the same loop on its own slice of each global batch; the
gradients are averaged across ranks, so N ranks with batch B train exactly as
one rank with batch N*B would.
"""

if __name__ == "__main__":
    # First, before the seconds of importing torch: a stop signal (preemption) from here to the exit is a request
    # to save and stop, never the default action that kills the rank (hpcnet.launch.stop says why).
    from hpcnet.launch.stop import hold_stop_signals

    _STOP = hold_stop_signals()

import functools
import json
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcnet import __version__
from hpcnet.agree import is_agreed, shared_errors
from hpcnet.ckpt.damage import corrupt_newest
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.ckpt.parts import ModelState, OptimizerState
from hpcnet.ckpt.state import RngState, TrainState
from hpcnet.comm.bootstrap import DataPlane, init_data_plane
from hpcnet.comm.costmodel import LinkCost
from hpcnet.comm.dataparallel import DataParallel
from hpcnet.comm.route import Route, agree_route
from hpcnet.comm.topology import measured_links
from hpcnet.config import Config
from hpcnet.config.importing import import_for_training
from hpcnet.config.load import (
    check_same_config,
    command_line_config,
    config_reference,
    describe_options,
    parse_command_line,
    to_toml,
)
from hpcnet.data.balance import Balancer
from hpcnet.data.loader import BatchLoader, open_dataset
from hpcnet.data.sampler import GlobalBatchSampler
from hpcnet.errors import ConfigError, ExitCode, exit_code_of
from hpcnet.fault.grow import Growing, join_if_spawned
from hpcnet.fault.inject import FaultInjector
from hpcnet.fault.live import Live
from hpcnet.fault.monitor import Monitor
from hpcnet.fault.survive import track
from hpcnet.fault.watchdog import startup_phase
from hpcnet.launch.park import park
from hpcnet.launch.stop import StopRequest
from hpcnet.loop import Loop, record_checkpoint
from hpcnet.models import build_from_config, count_parameters
from hpcnet.models.blocks import checkpoint_blocks, find_blocks
from hpcnet.models.blocks import describe as describe_blocks
from hpcnet.models.device import BatchMover, DeviceSettings, apply_settings, device_settings
from hpcnet.objective import Objective
from hpcnet.observe.runlog import (
    MetricsWriter,
    OptionalFile,
    close_logging,
    format_duration,
    make_run_dir,
    setup_logging,
    strict_json,
)
from hpcnet.observe.tensorboard import TensorBoardWriter, require_tensorboard
from hpcnet.observe.trace import StepTracer, parse_steps
from hpcnet.optim import Schedule, build_optimizer, is_elementwise
from hpcnet.optim import describe as describe_optimizer
from hpcnet.paths import CONFIG_FILE, SUMMARY_FILE, TENSORBOARD_DIR, checkpoint_dir, metrics_file
from hpcnet.plan.measure import ResidentPeak, measure_config
from hpcnet.plan.peaks import cap_in_bytes, choose, configured_bucket_bytes
from hpcnet.stateful import Stateful
from hpcnet.world import World, choose_device, cpu_threads, discover, machine_sharing, mpi_yield_when_idle

log = logging.getLogger("hpcnet.train")


@dataclass
class TrainResult:
    """What ``run`` returns: the trained model and a summary of the run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int = ExitCode.OK


def run(cfg: Config, comm: Any, *, plane: DataPlane | None = None, stop: StopRequest | None = None,
        joining: bool = False) -> TrainResult:
    """Train with ``cfg`` on the ranks of ``comm`` (collective).

    Args:
        cfg: the resolved configuration, equal on every rank.
        comm: the MPI communicator of the job.
        plane: an initialised data plane over the same ranks; created (and
            closed) here when None and there is more than one rank.
        stop: where signal handlers record a stop request, or None.
        joining: this process replaces a lost rank (``hpcnet.fault.grow``): ``comm`` is the grown job's, ``cfg``
            the survivors' options.

    With ``fault.recovery=shrink`` (a fault-tolerant MPI), ranks that die are left behind: the survivors build the
    run again on their own communicator and go on (``hpcnet.fault.live``).
    """
    t_start = time.perf_counter()
    import_for_training()
    comm = track(comm.Dup())  # hpcnet's control-plane traffic never mixes with the caller's
    live = Live(cfg)
    if joining:
        cfg = live.receive(comm)
    while True:
        try:
            result, world, run_dir = _attempt(cfg, comm, plane, stop, live)
        except Growing:
            comm, plane = live.grow(), None
            continue
        except Exception as exc:
            if not live.survives(exc, comm):
                live.dismiss(lost=True)
                raise
            comm, plane = live.recover(comm, exc), None  # the caller's plane went with the lost ranks
            continue
        break
    live.dismiss()  # replacements that have not joined leave
    result.summary.update(wall_s=time.perf_counter() - t_start, **live.summary())
    _finish(result, world, run_dir, cfg.train.steps)
    if live.grows:  # no rank leaves before rank 0 has written summary.json: mpirun may end once a replacement has
        comm.Barrier()
    comm.Free()
    return result


def _attempt(cfg: Config, comm: Any, plane: DataPlane | None, stop: StopRequest | None, live: Live
             ) -> tuple[TrainResult, World, Path]:
    """One world of the run: start-up, the data plane, training; what holds ``comm`` is closed whatever happens."""
    own_plane = False
    monitor = None
    try:
        world, run_dir, device, monitor = _start(cfg, comm, live)
        live.mark("monitor")
        # The transport, decided once (dist.backend=auto resolved here): an
        # impossible choice stops every rank before the probe, the rendezvous,
        # the data and the model; the torch.distributed group is the one it needs, if any.
        route = live.route(lambda: agree_route(comm, world, cfg.dist, device_type=device.type), world)
        faults = FaultInjector(cfg.fault, world, checkpoint_dir=checkpoint_dir(cfg.run.dir, cfg.run.name,
                                                                               cfg.checkpoint.dir),
                               generation=live.generation, killed=live.killed)
        # Each start-up phase on the network runs under dist.startup_timeout_s (hpcnet.fault.watchdog).
        faults.before_phase("probe")
        if live.probed is None:
            live.probed = measured_links(comm, world, cfg.dist, device.type, run_dir, monitor.deadlines)
        prefer, link, intra_link = live.probed
        live.mark("route")
        if plane is None and world.size > 1 and route.torch_backend:
            faults.before_phase("rendezvous")
            plane = init_data_plane(comm, world, backend=route.torch_backend, device=device,
                                    timeout_s=cfg.dist.timeout_s, interface=cfg.dist.interface, prefer=prefer,
                                    deadlines=monitor.deadlines, startup_timeout_s=cfg.dist.startup_timeout_s)
            own_plane = True
            live.mark("rendezvous")
        result = _train(cfg, comm, world, device, route, run_dir, monitor, stop, faults, live, link, intra_link)
        return result, world, run_dir
    finally:
        if monitor is not None:
            monitor.stop()
        if _may_communicate():
            if own_plane and plane is not None:
                plane.close()
            if sys.exc_info()[1] is not None:  # a grow; on success run() frees it once the run is finished
                comm.Free()
        elif own_plane and plane is not None and live.mode == "shrink":
            plane.abort()  # never waited on: its peers may be gone (torch.distributed's groups are made again)


def _start(cfg: Config, comm: Any, live: Live) -> tuple[World, Path, torch.device, Monitor]:
    """Ranks, the run directory and its logs, the device, the monitor thread, the resolved config written, the
    recovery mode decided (the first world)."""
    world = discover(comm)
    if live.world is not None:  # a rebuild: the same run, its directory and logs already made
        return _restart(cfg, comm, world, live)
    check_same_config(comm, cfg)
    if cfg.run.tensorboard:  # the same on every rank (check_same_config): no collective for runs without it
        with shared_errors(comm):  # before the run directory: only rank 0 writes the events, every rank stops alike
            if world.is_main:
                require_tensorboard()
    run_dir = make_run_dir(comm, cfg.run.dir, cfg.run.name, exact=cfg.run.dir_exact)
    setup_logging(run_dir, world.rank)
    live.decide(comm, world, run_dir)  # before the monitor: an impossible fault.recovery stops every rank here
    # More ranks than cores on this machine (hosts that share one count together): blocked MPI calls must give the
    # core away, or waiting ranks take it from computing ones (docs/communication.md, "Oversubscribed machines").
    ranks, cores = machine_sharing(comm)
    yielding = mpi_yield_when_idle() if ranks > cores else None
    if comm.allreduce(int(bool(yielding))) and world.is_main:
        log.info("more ranks than cores on a machine (%d on %d here): Open MPI's blocked calls now yield the core "
                 "(mpi_yield_when_idle)", ranks, cores)
    torch.set_num_threads(cpu_threads(world, cfg.train.threads))
    with shared_errors(comm):
        device = choose_device(world, cfg.dist.device)
    # Heartbeats, stall/desync watchdog, memory watch (monitor.*): a thread from here to the end.
    monitor = Monitor(cfg.monitor, comm, world, run_dir, device=device).start()
    try:
        with shared_errors(comm):  # rank 0 writes; an unwritable directory or option stops every rank
            if world.is_main:
                resolved = to_toml(cfg)
                (run_dir / CONFIG_FILE).write_text(resolved)
    except BaseException:
        monitor.stop()  # run() never gets it to stop: a thread left beating would judge, and abort, later
        raise
    if world.is_main:
        log.info("hpcnet %s, torch %s: %d rank(s) on %d node(s) (%s), device %s, %d threads/rank",
                 __version__, torch.__version__, world.size, world.num_nodes, world.launcher,
                 device, torch.get_num_threads())
        log.info("run directory: %s\nresolved config:\n%s", run_dir, resolved)
    return world, run_dir, device, monitor


def _restart(cfg: Config, comm: Any, world: World, live: Live) -> tuple[World, Path, torch.device, Monitor]:
    """A rebuild's start-up (``hpcnet.fault.live``): the first world's run directory; each rank's log named by its
    rank in the new world (a survivor that became rank 0 speaks for the job); the device; a new monitor."""
    run_dir = live.run_dir
    setup_logging(run_dir, world.rank)
    with shared_errors(comm):
        device = choose_device(world, cfg.dist.device)
    monitor = Monitor(cfg.monitor, comm, world, run_dir, device=device).start()
    return world, run_dir, device, monitor


def _data(cfg: Config, comm: Any, world: World, global_batch: int | None = None
          ) -> tuple[Any, Any, GlobalBatchSampler]:
    """The train and eval splits and the sampler: every rank opens the same files and validates them alike,
    so a bad dataset is the same clear error everywhere.  ``global_batch``: a shrunk job's (``hpcnet.fault.live``)."""
    with shared_errors(comm):
        train_split = open_dataset(cfg.data.dataset, "train", directory=cfg.data.dir, comm=comm,
                                   options=cfg.data.options, seed=cfg.run.seed)
        eval_split = open_dataset(cfg.data.dataset, "eval", directory=cfg.data.dir, comm=comm,
                                  options=cfg.data.options, seed=cfg.run.seed)
        sampler = GlobalBatchSampler(len(train_split), batch_size=cfg.train.batch_size,
                                     rank=world.rank, world_size=world.size,
                                     seed=cfg.run.seed, shuffle=cfg.data.shuffle, global_batch=global_batch)
    return train_split, eval_split, sampler


def _model(cfg: Config, comm: Any, world: World, device: torch.device, split: Any, route: Route,
           monitor: Monitor, link: LinkCost | None = None, run_dir: Path | None = None,
           intra_link: LinkCost | None = None
           ) -> tuple[DataParallel, torch.optim.Optimizer, DeviceSettings, "MemoryPlan | None", Objective]:
    """The same seed on every rank, then rank 0's weights broadcast (inside DataParallel), so a
    rank-dependent factory cannot make the replicas diverge; the ``cuda.*`` settings applied."""
    torch.manual_seed(cfg.run.seed)
    resident = ResidentPeak() if cfg.dist.memory_cap_gb else None
    with shared_errors(comm):
        model = build_from_config(cfg.model, split.info).to(device)
    settings = device_settings(cfg.cuda, device, model)
    model = apply_settings(settings, model)
    with shared_errors(comm):  # an objective that cannot be computed stops every rank alike, before any step
        objective = Objective(cfg.model.loss, device=device, precision=cfg.train.precision)
        objective.check(model, split, BatchMover(device, settings))
    objective.agree_names(comm)  # one exchange at start-up: the metrics are averaged over the ranks by name
    memory_plan = _plan_memory(cfg, comm, world, model, split, resident) if resident is not None else None
    if cfg.train.activation_checkpointing != "off":
        _checkpoint_activations(cfg, comm, world, model, None if memory_plan is None else memory_plan.predicted)
    blocks = _zero3_blocks(cfg, comm, world, model) if cfg.dist.zero == 3 else None
    # Before DataParallel: whether its update is elementwise decides the units of ownership (whole parameters if
    # not); what torch or a factory refuses (optim.*) stops every rank alike, before any collective.
    with shared_errors(comm):
        optimizer = build_optimizer(model, cfg.optim, fused=settings.fused_optimizer)
    elementwise = is_elementwise(optimizer, cfg.optim)
    log.info(describe_optimizer(optimizer, elementwise))
    with startup_phase(monitor.deadlines, "dist.groups", cfg.dist.startup_timeout_s):
        dp = DataParallel(model, comm, world, cfg.dist, device=device, route=route, recorder=monitor.recorder,
                          link=link, intra_link=intra_link, blocks=blocks, elementwise=elementwise)
    optimizer = dp.shard_optimizer(optimizer, run_dir)
    torch.manual_seed(cfg.run.seed + 1 + world.rank)  # dropout etc. differ per rank
    random.seed(cfg.run.seed + world.rank)
    return dp, optimizer, settings, memory_plan, objective


@dataclass
class MemoryPlan:
    """dist.memory_cap_gb: the planner's choice and this rank's resident memory since it was made."""

    predicted: Any
    resident: ResidentPeak

    def summary(self, comm: Any, world: World) -> dict[str, Any]:
        """The prediction beside the measured peak, the largest rank's (collective); logged by rank 0."""
        from mpi4py import MPI

        measured = comm.allreduce(self.resident.peak_bytes(), op=MPI.MAX)
        if world.is_main:
            log.info("memory: predicted peak %.3f GB a rank, measured %.3f GB (resident above the start, the "
                     "largest rank's; prediction %+.1f%%)", self.predicted.peak / 1e9, measured / 1e9,
                     100 * (self.predicted.peak / measured - 1) if measured else 0.0)
        return {**self.predicted.to_json(), "measured_peak_bytes": measured}


def _plan_memory(cfg: Config, comm: Any, world: World, model: nn.Module, split: Any,
                 resident: ResidentPeak) -> MemoryPlan:
    """dist.memory_cap_gb: rank 0 measures one step (``hpcnet.plan``) and chooses dist.zero and
    train.activation_checkpointing for every rank (set in ``cfg``); nothing fitting is the same error on every
    rank."""
    chosen = None
    with shared_errors(comm):
        if world.is_main:
            chosen = choose(measure_config(cfg, model, split), ranks=world.size,
                            cap_bytes=cap_in_bytes(cfg.dist.memory_cap_gb),
                            bucket_bytes=configured_bucket_bytes(cfg.dist),
                            checkpointing=cfg.train.activation_checkpointing)
    chosen = comm.bcast(chosen, root=0)
    cfg.dist.zero = chosen.stage
    resident.reset()  # the measurement's own memory is not the run's
    if world.is_main:
        log.info("dist.memory_cap_gb=%g: %s (the fastest choice that fits; dist.zero set by the planner%s)",
                 cfg.dist.memory_cap_gb, chosen.describe(),
                 ", and how many blocks to checkpoint" if cfg.train.activation_checkpointing == "auto" else "")
    return MemoryPlan(chosen, resident)


def _zero3_blocks(cfg: Config, comm: Any, world: World, model: nn.Module) -> list[tuple[str, nn.Module]]:
    """dist.zero=3: the blocks of model.blocks, each gathered apart; none found: the whole model is gathered for
    each forward and backward (only the time between steps holds a share), which the log says."""
    with shared_errors(comm):
        blocks = find_blocks(model, cfg.model.blocks)
    if world.is_main:
        log.info("dist.zero=3: %s", describe_blocks(blocks, model) if blocks else
                 f"model.blocks={cfg.model.blocks} finds no blocks in this model: the whole model is gathered for "
                 "each forward and backward (name its blocks with model.blocks to gather one at a time)")
    return blocks


def _checkpoint_activations(cfg: Config, comm: Any, world: World, model: nn.Module, chosen: Any = None) -> None:
    """train.activation_checkpointing=blocks: the blocks of model.blocks recompute their activations in backward;
    'auto': the first ``chosen.blocks`` of them (the planner's choice).  A model without blocks is the same error on
    every rank."""
    with shared_errors(comm):
        blocks = find_blocks(model, cfg.model.blocks)
        if not blocks:
            raise ConfigError(f"train.activation_checkpointing={cfg.train.activation_checkpointing}: model.blocks="
                              f"{cfg.model.blocks} finds no blocks in this model (no module class repeats side by "
                              "side); name them with model.blocks")
    if cfg.train.activation_checkpointing == "auto":
        blocks = blocks[:chosen.blocks]
    checkpoint_blocks(blocks)
    if world.is_main:
        log.info("activation checkpointing: %s", describe_blocks(blocks, model) if blocks else
                 "none (train.activation_checkpointing=auto: the cap fits without)")


def _train(cfg: Config, comm: Any, world: World, device: torch.device, route: Route, run_dir: Path,
           monitor: Monitor, stop: StopRequest | None, faults: FaultInjector, live: Live,
           link: LinkCost | None = None, intra_link: LinkCost | None = None) -> TrainResult:
    """Data, model, checkpoints, then the loop from where the checkpoints (or, after ranks were lost, the
    survivors: ``hpcnet.fault.live``) say; closed whatever happens."""
    train_split, eval_split, sampler = _data(cfg, comm, world, live.global_batch)
    live.mark("data")
    faults.before_phase("groups")
    dp, optimizer, settings, memory_plan, objective = _model(cfg, comm, world, device, train_split, route, monitor,
                                                             link, run_dir, intra_link)
    live.mark("model")
    metrics = MetricsWriter(run_dir / metrics_file(world.rank)
                            if cfg.run.metrics == "all" or (cfg.run.metrics == "rank0" and world.is_main) else None,
                            tensorboard=TensorBoardWriter(run_dir / TENSORBOARD_DIR)
                            if cfg.run.tensorboard and world.is_main else None)
    if world.is_main:
        log.info("model %s: %s parameters; dataset %s: %d train / %d eval samples; global batch %d",
                 cfg.model.describe(),
                 f"{count_parameters(dp.model):,}", cfg.data.dataset,
                 len(train_split), len(eval_split), sampler.global_batch_size * cfg.train.grad_accumulation)
        log.info("%s", dp.describe())
        log.info("device settings (cuda.*): %s", settings.describe())
    directory = checkpoint_dir(cfg.run.dir, cfg.run.name, cfg.checkpoint.dir)
    manager = CheckpointManager(comm, directory,
                                keep=cfg.checkpoint.keep, full_every=cfg.checkpoint.full_every,
                                async_save=cfg.checkpoint.async_save, move_aside=cfg.checkpoint.move_aside,
                                fault=faults.io_fault, deadlines=monitor.deadlines, timeout_s=cfg.checkpoint.timeout_s)
    manager.on_finished = functools.partial(record_checkpoint, metrics)  # a committed save's times
    result = TrainResult(dp.model, optimizer)
    loader = state = loop = None
    try:
        loader = BatchLoader(train_split, sampler)  # a resume drops the batch it read ahead and reads from its position
        balancer = (Balancer(comm, loader, dp, every=cfg.data.balance_every, device=device, monitor=monitor)
                    if cfg.data.balance == "auto" else None)
        with shared_errors(comm):  # optim.schedule: a bad name, option or function stops every rank alike
            schedule = Schedule(optimizer, cfg.optim, cfg.train.steps)  # before a resume sets the groups' lrs
        state = TrainState(cfg, state_parts(cfg, world, dp, optimizer, schedule, loader, balancer), manager)
        start_step = live.restore(state, comm, _first_source(cfg))
        if start_step is None:
            if cfg.checkpoint.resume:
                faults.before_resume(functools.partial(corrupt_newest, manager.directory), comm)
            start_step = state.start(cfg.checkpoint.resume, otherwise=cfg.checkpoint.resume_else)
        if len(set(sampler.sizes)) > 1 and balancer is None:  # a shrunk job's unequal slices
            dp.set_share(sampler.local_batch_size / sampler.global_batch_size)
        live.rebuilt(comm, world, start_step)
        if start_step >= cfg.train.steps and world.is_main:
            log.warning("nothing to train: the run resumed at step %d and train.steps is %d. Raise train.steps "
                        "to train on; another run.name or checkpoint.dir starts a new run", start_step,
                        cfg.train.steps)
        steps = parse_steps(cfg.train.trace_steps)
        tracer = (StepTracer(comm, steps, dp.clock, monitor.recorder, run_dir, ops=cfg.train.trace_ops, device=device)
                  if steps else None)  # clocks compared over MPI here, once
        loop = Loop(cfg, comm, world, dp, optimizer, schedule, loader, eval_split, device, metrics, state, faults,
                    monitor, stop, mover=BatchMover(device, settings), balancer=balancer, tracer=tracer,
                    objective=objective, grow=live, mirror=live.mirror)
        result.summary = loop.run(start_step)
    except Exception as exc:
        if isinstance(exc, Growing):
            live.hold(state, exc.step)  # collective: every rank stopped at this boundary
        elif loop is not None and loop.progress is not None and live.survives(exc, comm):
            live.keep(state, loop.progress.step)
        raise
    finally:
        if _may_communicate():
            manager.close()  # a checkpoint still being written is committed before we leave
        if loader is not None:
            loader.close()
        metrics.close()
        dp.close(collective=_may_communicate())
    result.summary.update(world_size=world.size, run_dir=str(run_dir), comm=dp.summary(), monitor=monitor.summary())
    if memory_plan is not None:
        result.summary["memory_plan"] = memory_plan.summary(comm, world)
    return result


def state_parts(cfg: Config, world: World, dp: DataParallel, optimizer: torch.optim.Optimizer, schedule: Schedule,
                loader: BatchLoader, balancer: Balancer | None) -> list[Stateful]:
    """The trainer's parts that hold state (``hpcnet.stateful``), in the order a checkpoint lists their tensors
    and a resume gives them back: the model (at ``dist.zero=3`` its parameters from their owners), the optimizer
    (sharded from stage 1), the learning-rate schedule, the owners in force (before any tensor is read), int8's
    residuals, the data position, the balance shares (after the position: they are its slice sizes), the RNG
    (last).  The seam of a rebuild on a new communicator (docs/architecture.md, "Parts and rebuilds")."""
    parts: list[Stateful] = [ModelState(dp.model, owned=dp.sharded_params),
                             dp.optimizer if dp.optimizer is not None else OptimizerState(optimizer), schedule]
    if dp.owners is not None:
        parts.append(dp.owners)
    parts += [dp.feedback, loader, *([balancer] if balancer is not None else []), RngState(cfg.run.seed, world.rank)]
    return parts


def _first_source(cfg: Config) -> str:
    """Where the run began when not from its own directory (a path given to checkpoint.resume, or
    checkpoint.resume_else): a reload before the run's first committed checkpoint goes back there."""
    return cfg.checkpoint.resume if cfg.checkpoint.resume not in ("", "auto") else cfg.checkpoint.resume_else


def _finish(result: TrainResult, world: World, run_dir: Path, total_steps: int) -> None:
    """The exit status, ``summary.json`` (best effort: the checkpoints are committed by now) and the last line.

    A stop that the ranks agreed on at the last step boundary (``total_steps``) leaves a finished run, saved:
    status 0, as a stop signal that comes after the loop does; a requeue would only find nothing to train.
    """
    summary = result.summary
    if summary.get("diverged"):
        result.exit_code = ExitCode.DIVERGED  # before a signal: a restart would diverge again
    elif summary.get("stopped_by_signal") and summary["steps"] < total_steps:
        result.exit_code = (ExitCode.INTERRUPTED if summary["stopped_by_signal"] == signal.SIGINT
                            else ExitCode.PREEMPTED)
    if world.is_main:
        summary_text = json.dumps(strict_json(summary), indent=2, allow_nan=False) + "\n"
        OptionalFile(run_dir / SUMMARY_FILE).write_text(summary_text)
        if summary["steps"] > summary["start_step"]:
            log.info("%s: %d steps in %s, final loss %.4f%s", "stopped" if summary.get("diverged") else "done",
                     summary["steps"], format_duration(summary["wall_s"]), summary["final_loss"],
                     "".join(f", {k} {v:.4f}" for k, v in summary.get("eval", {}).items()))


def _may_communicate() -> bool:
    """False while an error raised on this rank alone propagates (inside ``finally``).

    Its peers may be waiting in a collective that will never finish, so
    collective clean-up would hang; the entry point aborts the job instead.
    """
    error = sys.exc_info()[1]
    return error is None or is_agreed(error)


def main(argv: list[str] | None = None, stop: StopRequest | None = None) -> int:
    """Entry point of ``python -m hpcnet.train``; the only place that uses COMM_WORLD.

    Args:
        argv: the options (default ``sys.argv[1:]``).
        stop: the stop-signal handler, installed by the caller for the life of the process (``python -m
            hpcnet.train`` does so first thing); None: installed here and restored on return.
    """
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    joined = join_if_spawned()  # a replacement for a lost rank waits here to be called in (hpcnet.fault.grow)
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    rank = comm.Get_rank()
    if args.help:
        if rank == 0:
            print(__doc__.strip() + "\n\nOptions (defaults shown):\n" + describe_options())
        return ExitCode.OK
    if args.help_config:
        if rank == 0:
            print(config_reference(), end="")
        return ExitCode.OK
    own_stop = stop is None
    if stop is None:
        stop = StopRequest().install()
    try:
        with shared_errors(comm):  # a config file missing on one node fails everywhere
            cfg = command_line_config(args)
        if args.print_config:
            if rank == 0:
                print(to_toml(cfg), end="")
            return ExitCode.OK
        return run(cfg, comm if joined is None else joined, stop=stop, joining=joined is not None).exit_code
    except Exception as exc:
        code = exit_code_of(exc)
        logger = logging.getLogger("hpcnet")
        if is_agreed(exc):
            # Every rank reached the same verdict; rank 0 says it for all.
            logger.debug("stopping: %s", exc, exc_info=True)
            if rank == 0:
                print(f"hpcnet: error: {exc}", file=sys.stderr)
            return code
        # This rank alone failed: the others may be inside a collective and
        # would wait forever, so end the whole job now.
        logger.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc, exc_info=True)
        print(f"hpcnet: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        close_logging()
        comm.Abort(code)
        return code
    finally:
        if own_stop:
            stop.restore()
        close_logging()


if __name__ == "__main__":
    park(sys.argv[1:])  # a warm standby of hpcnet.launch waits here, imported, before MPI starts
    # The handler stays to the exit: a stop signal after the loop (the final save, MPI_Finalize, the exit) changes
    # nothing, where the default action would turn a finished run into a death by signal.
    code = main(stop=_STOP)
    _STOP.ignore()  # the status is decided
    sys.stdout.flush()
    sys.stderr.flush()
    from hpcnet.fault.survive import survived_a_loss

    if survived_a_loss():
        os._exit(code)  # never MPI_Finalize with lost peers: it may wait for them for good (survived_a_loss)
    if code:
        # Every rank returns the same status; finalize cleanly so the launcher
        # reports our status rather than an MPI_Abort (python -m mpi4py aborts
        # on any non-zero SystemExit).
        from mpi4py import MPI

        from hpcnet.ckpt.collective import unclosed_files
        from hpcnet.comm.transport.base import release_workers

        # HDF5's teardown (at MPI_Finalize, at exit) would crash on a file it failed to close, and Open MPI's
        # MPI_Finalize with a worker thread inside a collective its peers abandoned.
        if unclosed_files() or release_workers():
            os._exit(code)
        if not MPI.Is_finalized():
            MPI.Finalize()
    sys.exit(code)
