"""hpcnet's training entry point: data-parallel training, one loop you can read.

Launch:
    mpirun -np 4 python -m mpi4py -m hpcnet.train [--config run.toml] [section.key=value ...]
    python -m hpcnet.train                       # a single process works too
    python -m hpcnet.train --help                # every option, with its doc

Every rank runs the same loop on its own slice of each global batch; the
gradients are averaged across ranks, so N ranks with batch B train exactly as
one rank with batch N*B would.
"""

import json
import logging
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hpcnet import __version__
from hpcnet.comm.bootstrap import DataPlane, init_data_plane
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.config import Config, OptimConfig
from hpcnet.config_manager import check_same_config, describe_options, load_config, parse_command_line, to_toml
from hpcnet.data.loader import BatchLoader, open_dataset
from hpcnet.data.sampler import GlobalBatchSampler, eval_indices
from hpcnet.comm.dataparallel import DataParallel
from hpcnet.errors import ExitCode
from hpcnet.fault.inject import FaultInjector
from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.models import build_model, count_parameters
from hpcnet.fault.monitor import Monitor
from hpcnet.runlog import MetricsWriter, close_logging, format_duration, make_run_dir, setup_logging
from hpcnet.comm.plan import decide_plan
from hpcnet.comm.topology import probe, recommend
from hpcnet.ckpt.policy import NONFINITE_GRAD, NONFINITE_LOSS, SavePolicy
from hpcnet.ckpt.state import TrainState
from hpcnet.comm.world import World, choose_device, cpu_threads, discover
from hpcnet.agree import is_agreed, shared_errors
from hpcnet.layout import CONFIG_FILE, SUMMARY_FILE, checkpoint_dir, metrics_file
from hpcnet.errors import exit_code_of

log = logging.getLogger("hpcnet.train")


class StopRequest:
    """Remember a SIGINT/SIGTERM/SIGUSR2 so the loop can stop at a step boundary.

    The signal handler only sets a flag; the ranks agree on it once per step,
    so all of them stop after the same step even when only one was signalled.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopRequest":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class TrainResult:
    """What ``run`` returns: the trained model and a summary of the run."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: int = ExitCode.OK


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD with momentum or AdamW; no weight decay on biases and norm weights (1-d tensors)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Learning rate at ``step`` as a fraction of ``optim.lr``: linear warm-up, then decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def finite_flags(loss: torch.Tensor, grad_norm: torch.Tensor | None) -> tuple[bool, bool]:
    """Whether this rank's loss and the gradient norm (None: not computed) are finite.

    One device-to-host copy for both: the only per-step synchronisation with
    the GPU that ``train.nonfinite`` adds ('ignore' adds none).
    """
    norm = torch.zeros_like(loss) if grad_norm is None else grad_norm
    loss_ok, grad_ok = torch.isfinite(torch.stack([loss.detach().float(), norm.detach().float()])).tolist()
    return loss_ok, grad_ok


def compute_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The training loss of one micro-batch."""
    return loss_and_correct(model(inputs), targets)[0]


def loss_and_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the number of correct predictions (tokens or images)."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    loss = F.cross_entropy(logits, targets)
    correct = (logits.argmax(dim=-1) == targets).sum()
    return loss, correct


@torch.no_grad()
def evaluate(model: nn.Module, split: Any, comm: Any, *, batch_size: int, max_batches: int,
             device: torch.device, recorder: Any = NULL_RECORDER) -> dict[str, float]:
    """Loss and accuracy on the held-out split, each rank on its own shard (collective)."""
    from mpi4py import MPI

    was_training = model.training
    model.eval()
    indices = eval_indices(len(split), comm.Get_rank(), comm.Get_size())
    totals = np.zeros(3)  # loss sum, correct, count
    for n, start in enumerate(range(0, len(indices), batch_size)):
        if max_batches and n >= max_batches:
            break
        inputs, targets = split.read(indices[start:start + batch_size])
        inputs, targets = inputs.to(device), targets.to(device)
        loss, correct = loss_and_correct(model(inputs), targets)
        count = targets.numel()
        totals += (loss.item() * count, correct.item(), count)
    with recorder.op("eval.allreduce"):
        comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
    model.train(was_training)
    count = max(totals[2], 1)
    return {"eval_loss": totals[0] / count, "eval_accuracy": totals[1] / count}


def run(cfg: Config, comm: Any, *, plane: DataPlane | None = None, stop: StopRequest | None = None) -> TrainResult:
    """Train with ``cfg`` on the ranks of ``comm`` (collective).

    Args:
        cfg: the resolved configuration, equal on every rank.
        comm: the MPI communicator of the job.
        plane: an initialised data plane over the same ranks; created (and
            closed) here when None and there is more than one rank.
        stop: where signal handlers record a stop request, or None.
    """
    t_start = time.perf_counter()
    comm = comm.Dup()  # hpcnet's control-plane traffic never mixes with the caller's
    own_plane = False
    monitor = None
    try:
        world = discover(comm)
        check_same_config(comm, cfg)
        run_dir = make_run_dir(comm, cfg.run.dir, cfg.run.name, exact=cfg.run.dir_exact)
        setup_logging(run_dir, world.rank)
        torch.set_num_threads(cpu_threads(world, cfg.train.threads))
        with shared_errors(comm):
            device = choose_device(world, cfg.dist.device)
        # Heartbeats, stall/desync watchdog, memory watch (monitor.*): a thread from here to the end.
        monitor = Monitor(cfg.monitor, comm, world, run_dir, device=device).start()
        with shared_errors(comm):  # rank 0 writes; an unwritable directory or option stops every rank
            if world.is_main:
                resolved = to_toml(cfg)
                (run_dir / CONFIG_FILE).write_text(resolved)
        if world.is_main:
            log.info("hpcnet %s, torch %s: %d rank(s) on %d node(s) (%s), device %s, %d threads/rank",
                     __version__, torch.__version__, world.size, world.num_nodes, world.launcher,
                     device, torch.get_num_threads())
            log.info("run directory: %s\nresolved config:\n%s", run_dir, resolved)
        # The transport, decided once (dist.backend=auto resolved here): an
        # impossible choice stops every rank before the probe, the rendezvous,
        # the data and the model; the torch.distributed group is the one it needs, if any.
        plan = decide_plan(comm, world, cfg.dist, device_type=device.type)
        interface = cfg.dist.interface
        if cfg.dist.probe and world.size > 1:
            # Measured latency/bandwidth pick the network interface.
            topology = probe(comm, world, budget_s=2.0)
            advice = recommend(topology)
            if world.is_main:
                topology.write(run_dir / "topology.json")
                log.info("%s", topology.summary())
            if not interface and world.num_nodes > 1 and advice["nccl_socket_ifname"]:
                interface = advice["nccl_socket_ifname"]
            if advice["nccl_ib_disable"] and device.type == "cuda":
                os.environ.setdefault("NCCL_IB_DISABLE", "1")
        if plane is None and world.size > 1 and plan.torch_backend:
            plane = init_data_plane(comm, world, backend=plan.torch_backend, device=device,
                                    timeout_s=cfg.dist.timeout_s, interface=interface)
            own_plane = True

        # Data: every rank opens the same files and validates them alike, so a
        # bad dataset is the same clear error everywhere.
        with shared_errors(comm):
            train_split = open_dataset(cfg.data.dataset, "train", directory=cfg.data.dir, comm=comm,
                                       options=cfg.data.options, seed=cfg.run.seed)
            eval_split = open_dataset(cfg.data.dataset, "eval", directory=cfg.data.dir, comm=comm,
                                      options=cfg.data.options, seed=cfg.run.seed)
            sampler = GlobalBatchSampler(len(train_split), batch_size=cfg.train.batch_size,
                                         rank=world.rank, world_size=world.size,
                                         seed=cfg.run.seed, shuffle=cfg.data.shuffle)

        # Model: the same seed on every rank, then rank 0's weights broadcast
        # (inside DataParallel), so a rank-dependent factory cannot make the
        # replicas diverge.
        torch.manual_seed(cfg.run.seed)
        with shared_errors(comm):
            model = build_model(cfg.model.name, train_split.info, cfg.model.options,
                                factory=cfg.model.factory).to(device)
        dp = DataParallel(model, comm, world, cfg.dist, device=device, plan=plan, recorder=monitor.recorder)
        optimizer = build_optimizer(model, cfg.optim)
        torch.manual_seed(cfg.run.seed + 1 + world.rank)  # dropout etc. differ per rank
        random.seed(cfg.run.seed + world.rank)
        metrics = MetricsWriter(run_dir / metrics_file(world.rank)
                                if cfg.run.metrics == "all" or (cfg.run.metrics == "rank0" and world.is_main)
                                else None)
        if world.is_main:
            log.info("model %s: %s parameters; dataset %s: %d train / %d eval samples; global batch %d",
                     cfg.model.factory or cfg.model.name, f"{count_parameters(model):,}", cfg.data.dataset,
                     len(train_split), len(eval_split), cfg.train.batch_size * cfg.train.grad_accumulation * world.size)
            log.info("%s", dp.describe())

        faults = FaultInjector(cfg.fault, world)  # fault.*: off unless testing recovery
        manager = CheckpointManager(comm, checkpoint_dir(cfg.run.dir, cfg.run.name, cfg.checkpoint.dir),
                                    keep=cfg.checkpoint.keep,
                                    full_every=cfg.checkpoint.full_every, async_save=cfg.checkpoint.async_save,
                                    move_aside=cfg.checkpoint.move_aside, fault=faults.io_fault,
                                    deadlines=monitor.deadlines, timeout_s=cfg.checkpoint.timeout_s)
        state = TrainState(cfg, model, optimizer, sampler, manager)
        result = TrainResult(model, optimizer)
        loader = None
        try:
            if cfg.checkpoint.resume:
                faults.before_resume(manager.directory, comm)
            start_step = state.start(cfg.checkpoint.resume, rank=world.rank)
            if start_step >= cfg.train.steps and world.is_main:
                log.warning("nothing to train: the run resumed at step %d and train.steps is %d. Raise train.steps "
                            "to train on; another run.name or checkpoint.dir starts a new run", start_step,
                            cfg.train.steps)
            loader = BatchLoader(train_split, sampler)  # after resume: it reads ahead from the sampler's position
            result.summary = _loop(cfg, comm, world, dp, optimizer, loader, eval_split, device, metrics, stop,
                                   state, start_step, faults, monitor)
        finally:
            if _may_communicate():
                manager.close()  # a checkpoint still being written is committed before we leave
            if loader is not None:
                loader.close()
            metrics.close()
            dp.close()
        summary = result.summary
        summary.update(world_size=world.size, wall_s=time.perf_counter() - t_start, run_dir=str(run_dir),
                       comm=dp.summary(), monitor=monitor.summary())
        if summary.get("diverged"):
            result.exit_code = ExitCode.DIVERGED  # before a signal: a restart would diverge again
        elif summary.get("stopped_by_signal"):
            result.exit_code = (ExitCode.INTERRUPTED if summary["stopped_by_signal"] == signal.SIGINT
                                else ExitCode.PREEMPTED)
        if world.is_main:
            (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
            if summary["steps"] > summary["start_step"]:
                log.info("%s: %d steps in %s, final loss %.4f%s", "stopped" if summary.get("diverged") else "done",
                         summary["steps"], format_duration(summary["wall_s"]), summary["final_loss"],
                         "".join(f", {k} {v:.4f}" for k, v in summary.get("eval", {}).items()))
        return result
    finally:
        if monitor is not None:
            monitor.stop()
        if _may_communicate():
            if own_plane and plane is not None:
                plane.close()
            comm.Free()


def _may_communicate() -> bool:
    """False while an error raised on this rank alone propagates (inside ``finally``).

    Its peers may be waiting in a collective that will never finish, so
    collective clean-up would hang; the entry point aborts the job instead.
    """
    error = sys.exc_info()[1]
    return error is None or is_agreed(error)


def _loop(cfg: Config, comm: Any, world: World, dp: DataParallel, optimizer: torch.optim.Optimizer,
          loader: BatchLoader, eval_split: Any, device: torch.device, metrics: MetricsWriter,
          stop: StopRequest | None, state: TrainState, start_step: int, faults: FaultInjector,
          monitor: Monitor) -> dict[str, Any]:
    from mpi4py import MPI

    model = dp.model
    total = cfg.train.steps
    global_batch = cfg.train.batch_size * cfg.train.grad_accumulation * world.size
    evaluation: dict[str, float] = {}
    loss_value = float("nan")
    t_loop = t_last = time.perf_counter()
    step = last_step = start_step
    policy = SavePolicy.from_config(cfg)
    stopped_by = 0
    on_nonfinite = cfg.train.nonfinite  # stop | skip | ignore
    skipped_steps, diverged = 0, ""
    model.train()
    while step < total:
        for group_ in optimizer.param_groups:
            group_["lr"] = cfg.optim.lr * lr_factor(step, total, cfg.optim)
        batches = [tuple(t.to(device, non_blocking=True) for t in loader.next())
                   for _ in range(cfg.train.grad_accumulation)]
        loss = dp.step(batches, compute_loss, step=step + 1)  # forward, backward, gradients averaged
        # The averaged gradients are the same on every rank, so a verdict from their norm needs
        # no collective; computing it costs a pass over them, paid only for clipping or skip.
        grad_norm = None
        if cfg.optim.grad_clip > 0:
            grad_norm = nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        elif on_nonfinite == "skip":
            grad_norm = nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        applied, nonfinite = _update(optimizer, loss, grad_norm, on_nonfinite)
        step += 1
        monitor.step(step)  # heartbeats carry it; step times set the stall timeout; memory samples
        faults.at_step(step)  # fault.* injection; a no-op unless configured
        if not applied:
            skipped_steps += 1
            if world.is_main:
                log.warning("step %d: non-finite gradient norm, update skipped (train.nonfinite=skip; %d so far)",
                            step, skipped_steps)

        if step % cfg.run.log_every == 0 or step == total:
            local_loss = loss.item()
            with monitor.collective("loss.allreduce"):
                loss_value = comm.allreduce(local_loss, op=MPI.SUM) / world.size
            now = time.perf_counter()
            rate = (step - last_step) * global_batch / max(now - t_last, 1e-9)
            eta = (now - t_loop) / (step - start_step) * (total - step)
            if world.is_main:
                log.info("step %*d/%d | loss %.4f | lr %.2e | %.0f samples/s | eta %s", len(str(total)), step,
                         total, loss_value, optimizer.param_groups[0]["lr"], rate, format_duration(eta))
            metrics.write(step=step, loss=local_loss, global_loss=loss_value,
                          lr=optimizer.param_groups[0]["lr"], samples_per_s=rate, epoch=loader.epoch)
            t_last, last_step = now, step
        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == total):
            dp.sync_buffers()
            evaluation = evaluate(model, eval_split, comm, batch_size=cfg.train.batch_size,
                                  max_batches=cfg.train.eval_batches, device=device, recorder=monitor.recorder)
            if world.is_main:
                log.info("eval at step %d: loss %.4f, accuracy %.2f%%", step, evaluation["eval_loss"],
                         100 * evaluation["eval_accuracy"])
            metrics.write(step=step, **evaluation)

        # Step boundary: every rank agrees on stopping and saving after this step.
        with monitor.collective("step_boundary"):
            stopped_by, save, nonfinite = policy.agree(comm, step, stop.signum if stop else 0, nonfinite=nonfinite)
        if nonfinite:
            diverged = _nonfinite_message(step, nonfinite)
        elif save:
            dp.sync_buffers()
            finite = True
            if on_nonfinite != "ignore":
                with monitor.collective("state.is_finite"):
                    finite = state.is_finite()
            if finite:
                state.save(step, loader.state_dict())
                policy.saved()
            else:
                diverged = (f"non-finite model or optimizer state after step {step} (an update overflowed, "
                            "or a forward pass left non-finite statistics)")
        if diverged:
            if world.is_main:
                kept = (f"the newest checkpoint, step {state.last_saved_step}, is kept"
                        if state.last_saved_step >= 0 else "no checkpoint was saved")
                log.error("%s: every rank stops after step %d/%d and saves nothing of it (train.nonfinite=%s); "
                          "%s. A restart would diverge again: lower optim.lr or check the data (status %d)",
                          diverged, step, total, on_nonfinite, kept, ExitCode.DIVERGED)
            break
        if stopped_by:
            log.warning("stopping after step %d/%d on %s (checkpoint saved)", step, total,
                        signal.Signals(stopped_by).name)
            break
    if step > start_step and step % cfg.run.log_every and step != total:  # stopped between log lines
        with monitor.collective("loss.allreduce"):
            loss_value = comm.allreduce(loss.item(), op=MPI.SUM) / world.size
    dp.sync_buffers()
    elapsed = time.perf_counter() - t_loop
    return {
        "steps": step,
        "start_step": start_step,
        "final_loss": loss_value,
        "eval": evaluation,
        "samples_per_s": (step - start_step) * global_batch / max(elapsed, 1e-9),
        "stopped_by_signal": stopped_by,
        "diverged": diverged,
        "skipped_steps": skipped_steps,
    }


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


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.train``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    args = parse_command_line(sys.argv[1:] if argv is None else argv)
    rank = comm.Get_rank()
    if args.help:
        if rank == 0:
            print(__doc__.strip() + "\n\nOptions (defaults shown):\n" + describe_options())
        return ExitCode.OK
    stop = StopRequest().install()
    try:
        with shared_errors(comm):  # a config file missing on one node fails everywhere
            cfg = load_config(args.config, args.overrides + ([f"checkpoint.resume={args.resume}"] if args.resume else []))
        if args.print_config:
            if rank == 0:
                print(to_toml(cfg), end="")
            return ExitCode.OK
        return run(cfg, comm, stop=stop).exit_code
    except Exception as exc:  # noqa: BLE001 - reported, then a documented status
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
        stop.restore()
        close_logging()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        # Every rank returns the same status; finalize cleanly so the launcher
        # reports our status rather than an MPI_Abort (python -m mpi4py aborts
        # on any non-zero SystemExit).
        from mpi4py import MPI

        if not MPI.Is_finalized():
            MPI.Finalize()
    sys.exit(code)
