"""Data parallelism: one model replica per rank, gradients averaged every step.

``DataParallel`` runs a step's micro-batches with communication only after the last one, and when the transport
fails on any rank it switches every rank to the fallback and redoes the step from the same batch, parameters and
RNG state, so the result equals a run without the failure.  It holds the step's parts, each built from what it
needs: the transport of the route (``hpcnet.comm.route``) on the path the forecast chose (``hpcnet.comm.forecast``),
replicas made equal (``hpcnet.comm.replicas``), what each rank owns and how the stage places the sums
(``hpcnet.comm.sharding``), and the buckets (``hpcnet.comm.reducer``).
"""

import contextlib
import logging
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcnet.agree import mark_agreed
from hpcnet.comm.buckets import bucket_bytes
from hpcnet.comm.costmodel import LinkCost, OwnerAssignment, PathChoice
from hpcnet.comm.forecast import FORECAST_CHECK_STEP, check_forecast, choose_hierarchical, forecast_comm
from hpcnet.comm.quantize import ErrorFeedback
from hpcnet.comm.reducer import LateGradient, Reducer
from hpcnet.comm.replicas import broadcast_buffers, broadcast_module, check_same_model
from hpcnet.comm.route import HALF_PRECISIONS, Route, mpi_progress
from hpcnet.comm.sharding.layout import ShardLayout, split_units
from hpcnet.comm.sharding.optimizer import ShardedOptimizer, norm_order, unit_grad_norm
from hpcnet.comm.sharding.owners import Owners
from hpcnet.comm.sharding.params import ShardedParams
from hpcnet.comm.sharding.placement import Placement, ReplicatedGradients, ShardedGradients
from hpcnet.comm.transport import CommFailure, FaultyTransport, Transport, build_transport
from hpcnet.comm.transport.hierarchical import PIPELINE_CHUNK_BYTES
from hpcnet.config import DistConfig
from hpcnet.errors import RestartableError, UsageError
from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.observe.phases import PhaseClock
from hpcnet.world import World, cores_per_rank

log = logging.getLogger(__name__)

_DTYPES = {"auto": None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


class DataParallel:
    """Keep model replicas equal across the ranks of ``comm`` and average their gradients.

    Args:
        model: the replica on this rank (already on its device).
        comm: the MPI communicator of the job (the control plane).
        world: its layout.
        cfg: the ``dist`` options.
        route: the gradients' route (``hpcnet.comm.route.agree_route``), agreed on
            before the torch.distributed group was set up.
        recorder: the flight recorder (``hpcnet.fault.flightrec``) the step's collectives are logged to.
        link: the probed link (the inter-node one where there are nodes): ``dist.bucket_mb=auto``, the owners,
            the path and the communication forecast (``hpcnet.comm.forecast``); None: not probed.
        intra_link: the probed intra-node link where there are nodes (the hierarchical forecast's inner phases).
        blocks: ``dist.zero=3``: the model's blocks (``hpcnet.models.blocks.find_blocks``), each gathered apart
            (``hpcnet.comm.sharding.params``); None or empty: the whole model is one group.
        elementwise: whether the optimizer's update is elementwise (``hpcnet.optim.is_elementwise``); if not,
            every unit of ownership is a whole parameter, at every stage (``hpcnet.comm.sharding.layout``).
    """

    def __init__(self, model: nn.Module, comm: Any, world: World, cfg: DistConfig, *,
                 device: torch.device, route: Route, recorder: Any = NULL_RECORDER,
                 link: LinkCost | None = None, intra_link: LinkCost | None = None,
                 blocks: list[tuple[str, nn.Module]] | None = None, elementwise: bool = True) -> None:
        self.model, self.comm, self.world, self.cfg, self.device, self.link = model, comm, world, cfg, device, link
        self.elementwise = elementwise
        check_same_model(model, comm)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        total = sum(p.numel() * p.element_size() for p in self.params)
        self.route, self.path = choose_hierarchical(route, cfg, comm, world, total, inter=link, intra=intra_link)
        self.progress = mpi_progress(cfg.progress, cores_per_rank(world))
        # int8's residuals: kept here, a part of the run that checkpoints hold (hpcnet.stateful)
        self.feedback = ErrorFeedback(comm, in_checkpoints=cfg.compression == "int8")
        transport = _transport(self.route, self.path, cfg, comm, world, progress=self.progress, feedback=self.feedback)
        broadcast_module(model, comm)  # replicas start equal even if initialisation differed
        self.owners = Owners(ShardLayout(self.params, world.size, cut=elementwise), comm, world, cfg, link=link,
                             device=device, names=[name for name, _ in named]) if cfg.zero else None
        self.sharded_params = (_stage3_params(model, self.owners, comm, world, blocks or [], device=device,
                                              recorder=recorder) if cfg.zero == 3 else None)
        self.optimizer: ShardedOptimizer | None = None
        self.reducer = Reducer(
            list(model.named_parameters()), transport, comm, bucket_bytes=bucket_bytes(cfg, world, total, link),
            first_bucket_bytes=int(cfg.first_bucket_mb * 2**20),
            compression=_DTYPES[cfg.compression] if cfg.compression in HALF_PRECISIONS else None,
            find_unused=cfg.find_unused, timeout_s=cfg.timeout_s, recorder=recorder,
            placement=_placement(cfg, self.owners, world))
        if self.sharded_params is not None:
            self.sharded_params.rounds.pace(self.reducer)
        if cfg.compression == "int8" and world.num_nodes == 1 and world.is_main and world.size > 1:
            log.info("dist.compression=int8 compresses only between nodes, and this job has one: the sums are exact")
        self.forecast = (forecast_comm(total, cfg, world, hierarchical=self.route.hierarchical, inter=link,
                                       intra=intra_link, chunk_bytes=transport.chunk_bytes)
                         if link is not None and world.size > 1 else None)
        # Where dist.zero=2 would cut a parameter at this world size, every stage takes the norm unit by unit.
        units = (self.owners.layout.units if self.owners is not None
                 else split_units(self.params, world.size, cut=elementwise))
        self._norm_units = units if any(not u.whole for u in units) else None
        self._norm_order = norm_order(self.params)
        self.step_count = 0
        self.compute_timer: Any = None  # data.balance: times each forward and backward (hpcnet.data.balance)
        self.clock = PhaseClock()  # the loop's (hpcnet.observe.phases); marks are no-ops until it starts a step
        self.share = 1.0 / world.size
        self._has_buffers = any(True for _ in model.buffers())
        self._buffer_group = _buffer_group(device, world, self.route)

    @property
    def layout(self) -> ShardLayout | None:
        """The units of ownership (``dist.zero`` > 0), or None."""
        return self.owners.layout if self.owners is not None else None

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, run_dir: Path | None = None) -> Any:
        """With ``dist.zero`` > 0: ``optimizer`` (over every parameter, no state yet) sharded by the owners, which
        rank 0 logs and writes to ``owners.json`` in ``run_dir`` (``Owners.start``); else ``optimizer`` itself."""
        if self.owners is None:
            return optimizer
        owners = self.owners
        self.optimizer = ShardedOptimizer(optimizer, owners.assignment, owners.layout, self.comm, self.cfg.zero,
                                          elementwise=self.elementwise)
        self.optimizer.clock = self.clock
        owners.start(run_dir, self.move_owners)
        return self.optimizer

    def move_owners(self, assignment: OwnerAssignment) -> int:
        """Move what is owned to ``assignment``'s owners (collective): stage 3's parameters, the optimizer state and,
        from stage 2 on, the buckets' layout; returns the bytes of state moved by all ranks together."""
        assert self.optimizer is not None
        if self.sharded_params is not None:
            self.sharded_params.reown(assignment.owner)
        sent = self.optimizer.reshard(assignment)
        if self.cfg.zero >= 2:
            self.reducer.reassign(assignment.owner)
        return self.comm.allreduce(sent)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the model (collective with ``dist.zero`` 2 and 3)."""
        if self.optimizer is not None and self.cfg.zero >= 2:
            return self.optimizer.clip_grad_norm_(max_norm)
        total = self.grad_norm()
        grads = [p for p in self.params if p.grad is not None]
        if grads:
            nn.utils.clip_grads_with_norm_(grads, max_norm, total)
        return total

    def grad_norm(self) -> torch.Tensor:
        """The total gradient 2-norm (collective with ``dist.zero`` 2 and 3).  Where ``dist.zero=2`` would cut a
        parameter at this world size, every stage takes the norm unit by unit as it does
        (``sharding.optimizer.unit_grad_norm``), so the stages clip alike, bit for bit; otherwise it is
        ``torch.nn.utils.get_total_norm``'s."""
        if self.optimizer is not None and self.cfg.zero >= 2:
            return self.optimizer.grad_norm()
        if self._norm_units is not None:
            return unit_grad_norm(self.params, self._norm_units, self._norm_order)
        return nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])

    @property
    def backend(self) -> str:
        return self.reducer.transport.name

    def describe(self) -> str:
        sizes = [b.nbytes / 2**20 for b in self.reducer.buckets]
        progress = f" ({self.progress})" if "mpi" in self.backend else ""
        return (f"gradients: {self.backend} all-reduce{' (hierarchical)' if self.route.hierarchical else ''}"
                f"{progress}, "
                f"{len(sizes)} bucket(s) of {', '.join(f'{s:.1f}' for s in sizes[:6])}"
                f"{' ...' if len(sizes) > 6 else ''} MiB, compression "
                f"{'none (auto)' if self.cfg.compression == 'auto' else self.cfg.compression}, "
                f"fallback {self.route.fallback or 'none'}")

    def measured_comm_s(self) -> float | None:
        """The median of this rank's all-reduce times (``ReducerStats.comm_s``) after the first step, or None."""
        spans = self.reducer.stats.comm_s[1:]
        return statistics.median(spans) if spans else None

    def after_step(self, step: int) -> None:
        """Called by every rank after each optimizer step: at ``FORECAST_CHECK_STEP`` rank 0 logs the measured
        all-reduce time beside the forecast; with a sharded optimizer the owners may move
        (``Owners.after_step``: every ``dist.reassign_every`` steps with ``dist.owners=auto``, collective)."""
        if step == FORECAST_CHECK_STEP:
            check_forecast(self.forecast, self.measured_comm_s(), self.world)
        if self.owners is not None and self.optimizer is not None:
            self.owners.after_step(step, self.reducer.recorder, self.move_owners)

    def step(self, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor], *,
             step: int | None = None) -> torch.Tensor:
        """Forward and backward over the micro-batches, ``loss_fn(model, batch)`` the mean loss of each (an
        ``hpcnet.objective.Objective``), then average the gradients.

        ``step`` is the global number of the step being computed (1 for the
        first step of a run, resumed or not, as ``fault.*`` count them); None
        counts on from the previous call.  Returns the mean loss over the
        micro-batches (a tensor on the device).  Raises RestartableError on
        every rank when the transport failed and no fallback is left.

        A parameter's gradient that arrives again after its bucket went out
        (reentrant activation checkpointing of a shared layer, in the first
        step that shows it: ``LateGradient``) voids the step's gradients: every
        rank redoes the step once from the same batch, RNG state and buffers,
        and the reducer then waits for every arrival.  Where the step cannot be
        redone (no snapshot: the count grew after steps without repeated
        arrivals; or it grew again on the same batch) every rank raises a
        UsageError naming the parameters: the model's structure, not the
        machine, is what a rerun would meet again.
        """
        self.step_count = self.step_count + 1 if step is None else step
        self.sync_buffers()  # replicas start every step bit-identical, as with DDP's broadcast_buffers
        self.clock.mark("comm")
        self.reducer.arm_fault(self.step_count == self.cfg.fail_at_step)
        # What the step may change besides gradients: a retry restores them.
        saved = self._snapshot() if self.route.fallback or self.reducer.may_redo else None
        redone = False
        while True:
            loss = self._forward_backward(batches, loss_fn)
            try:
                self.reducer.finish()
                self.clock.mark("comm")  # what backward did not hide
                return loss
            except LateGradient as exc:
                if saved is None or redone:
                    raise mark_agreed(UsageError(
                        f"step {self.step_count}: {exc}; the step cannot be redone ("
                        + ("the count differs between two passes over the same batch" if redone else
                           "it first grew after steps without repeated arrivals")
                        + "): use torch.utils.checkpoint.checkpoint(..., use_reentrant=False), whose recomputed "
                        "uses add up in one backward")) from exc
                if self.world.is_main:
                    log.info("step %d: redone: %s", self.step_count, exc)
                redone = True
                self._restore(saved)
            except CommFailure as exc:
                if self.route.fallback is None or saved is None:
                    raise mark_agreed(RestartableError(f"step {self.step_count}: {exc}; no fallback left")) from exc
                self.reducer.arm_fault(False)
                fallback = build_transport(self.route.fallback, False, self.comm, self.world,
                                           timeout_s=self.cfg.timeout_s, progress=self.progress)
                self.reducer.switch(fallback, str(exc), self.step_count)
                self.route = Route(self.route.fallback, False, None)
                self.feedback.clear()  # the fallback sums exactly: int8's residuals have nothing left to carry
                self._buffer_group = None  # the NCCL group may be the part that failed
                self._restore(saved)

    def set_share(self, share: float) -> None:
        """This rank's fraction of the global batch (``data.balance``): its gradients are weighted by it."""
        self.reducer.set_share(share)
        self.share = share

    def _forward_backward(self, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor]
                          ) -> torch.Tensor:
        if self.compute_timer is not None:
            self.compute_timer.start()
        loss = self._forward_backward_untimed(batches, loss_fn)
        if self.compute_timer is not None:
            self.compute_timer.stop()
        return loss

    def _forward_backward_untimed(self, batches: list[Any], loss_fn: Callable[[nn.Module, Any], torch.Tensor]
                                  ) -> torch.Tensor:
        self.reducer.zero_grad()
        total = torch.zeros((), device=self.device)
        n = len(batches)
        with self.params_in_use():
            for k, batch in enumerate(batches):
                # Communicate only after the last micro-batch.
                context = self.reducer.no_sync() if k < n - 1 else contextlib.nullcontext()
                with context:
                    loss = loss_fn(self.model, batch) / n
                    self.clock.mark("forward")
                    loss.backward()
                    if self.sharded_params is not None:
                        self.sharded_params.after_backward()
                    self.clock.mark("backward")
                total += loss.detach()
        return total

    def params_in_use(self) -> contextlib.AbstractContextManager:
        """Where the model's forwards and backwards run (collective at its end with ``dist.zero=3``: the ranks
        settle their gathers, ``ShardedParams.in_use``; nothing otherwise)."""
        return self.sharded_params.in_use() if self.sharded_params is not None else contextlib.nullcontext()

    def _snapshot(self) -> dict[str, Any]:
        state = {"cpu_rng": torch.get_rng_state(),
                 "buffers": [b.detach().clone() for b in self.model.buffers()]}
        if self.reducer.may_redo and self.feedback.residuals:
            state["feedback"] = {name: r.clone() for name, r in self.feedback.state().items()}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu_rng"])
        if "feedback" in state:
            self.feedback.load(state["feedback"])
        if "cuda_rng" in state:
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        with torch.no_grad():
            for buf, saved in zip(self.model.buffers(), state["buffers"]):
                buf.copy_(saved)

    def sync_buffers(self) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics); collective."""
        if self._has_buffers:
            with self.reducer.recorder.op("broadcast.buffers"):
                broadcast_buffers(self.model, self.comm, group=self._buffer_group)

    @contextlib.contextmanager
    def no_sync(self):
        with self.reducer.no_sync():
            yield

    def summary(self) -> dict[str, Any]:
        stats = self.reducer.stats
        out = {"backend": self.backend, "hierarchical": self.route.hierarchical, "fallbacks": stats.fallbacks,
               "bytes_reduced": stats.bytes_reduced, "zero": self.cfg.zero}
        measured = self.measured_comm_s()
        if measured is not None:
            out["allreduce_ms"] = measured * 1e3
        if self.forecast is not None:
            out["forecast"] = {"path": self.forecast.path, "wire": self.forecast.wire,
                               "host_bytes": self.forecast.host_bytes, "allreduce_ms": self.forecast.seconds * 1e3}
        if self.path is not None:  # dist.hierarchical=auto's choice from the probe
            out["path"] = {"hierarchical": self.path.hierarchical, "chunk_bytes": self.path.chunk_bytes,
                           "flat_ms": self.path.flat.seconds * 1e3, "hierarchical_ms": self.path.nested.seconds * 1e3}
        if self.owners is not None:
            out["owned_bytes"] = self.owners.assignment.rank_bytes
            out["reassignments"] = self.owners.reassignments
        return out

    def close(self, collective: bool = True) -> None:
        """``collective=False`` while an error raised on this rank alone propagates (``Reducer.close``)."""
        self.reducer.close(collective)
        if self.optimizer is not None and collective:
            self.optimizer.close()
        if self.sharded_params is not None:
            self.sharded_params.close(collective)


def _transport(route: Route, path: PathChoice | None, cfg: DistConfig, comm: Any, world: World, *, progress: str,
               feedback: ErrorFeedback) -> Transport:
    """The route's transport on ``path`` (collective), made to fail at ``dist.fail_at_step`` on the chosen ranks."""
    transport = build_transport(route.primary, route.hierarchical, comm, world, timeout_s=cfg.timeout_s,
                                progress=progress, inter_node=route.inter_node, wire=_DTYPES[cfg.compression],
                                feedback=feedback,
                                chunk_bytes=PIPELINE_CHUNK_BYTES if path is None else path.chunk_bytes)
    if cfg.fail_at_step:
        transport = FaultyTransport(transport, fail=not cfg.fail_ranks or world.rank in cfg.fail_ranks)
    return transport


def _stage3_params(model: nn.Module, owners: Any, comm: Any, world: World, blocks: list[tuple[str, nn.Module]], *,
                   device: torch.device, recorder: Any) -> ShardedParams:
    """``dist.zero=3``'s parameters, sharded by ``owners`` (collective; the replicas must be equal), which rank 0
    describes."""
    sharded = ShardedParams(model, owners.layout, owners.owner, comm, blocks, device=device,
                            collective="mpi" if device.type == "cpu" else "torch", recorder=recorder)
    if world.is_main:
        log.info("%s", sharded.describe())
    return sharded


def _placement(cfg: DistConfig, owners: Owners | None, world: World) -> Placement:
    """Where the sums go: every rank keeps all (stages 0 and 1), or each its own units' (2 and 3)."""
    if cfg.zero < 2 or owners is None:
        return ReplicatedGradients()
    return ShardedGradients(owners.owner, owners.layout, n_params=len(owners.layout.params), rank=world.rank,
                            world_size=world.size)


def _buffer_group(device: torch.device, world: World, route: Route) -> Any:
    """The NCCL group buffers are broadcast over on GPU (in stream order, without a host round trip), or None:
    MPI."""
    if device.type == "cuda" and world.size > 1 and route.torch_backend == "nccl":
        import torch.distributed as dist

        return dist.group.WORLD
    return None
