"""Data parallelism: one model replica per rank, gradients averaged every step.

``DataParallel`` follows the transport plan (``hpcnet.comm.plan``), runs a step's
micro-batches with communication only after the last one, and when the
transport fails on any rank it switches every rank to the fallback and redoes
the step from the same batch, parameters and RNG state, so the result equals
a run without the failure.
"""

import contextlib
import dataclasses
import json
import logging
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcnet.agree import mark_agreed
from hpcnet.comm.costmodel import (
    CommForecast,
    LinkCost,
    PathChoice,
    ShardPlan,
    auto_bucket_bytes,
    bucket_share,
    choose_path,
    forecast_allreduce,
    measured_speeds,
    plan_time_s,
    stage2_bucket_cap,
)
from hpcnet.comm.plan import HALF_PRECISIONS, Plan, mpi_progress
from hpcnet.comm.quantize import ErrorFeedback
from hpcnet.comm.reducer import LateGradient, Reducer, broadcast_buffers, broadcast_module
from hpcnet.comm.transport import CommFailure, FaultyTransport, build_transport
from hpcnet.comm.transport.hierarchical import PIPELINE_CHUNK_BYTES
from hpcnet.comm.world import World, cores_per_rank
from hpcnet.comm.zero import (
    DEFAULT_LINK,
    UPDATE_S_PER_BYTE,
    ShardedOptimizer,
    ShardLayout,
    measure_speed,
    norm_order,
    plan_shards,
    split_units,
    unit_grad_norm,
)
from hpcnet.comm.zero3 import ShardedParams
from hpcnet.config import DistConfig
from hpcnet.errors import RestartableError, UsageError
from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.observe.phases import PhaseClock
from hpcnet.observe.runlog import OptionalFile
from hpcnet.paths import PLAN_FILE

log = logging.getLogger(__name__)

REPLAN_DRIFT = 0.25
"""dist.replan_every: a re-plan is considered only when some rank's relative speed moved by more than this fraction
since the plan was made (the probe's noise on a shared node stays below it)."""
REPLAN_GAIN = 0.10
"""... and taken only when the modelled step drops by more than this fraction (moving optimizer state costs a pass
over it)."""
FORECAST_CHECK_STEP = 20
"""The step at which rank 0 logs the measured all-reduce time beside the forecast (``after_step``)."""
AUTO_FALLBACK_MB = 25
"""dist.bucket_mb=auto without a probed link: DDP's default."""
_DTYPES = {"auto": None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}
FEEDBACK_PREFIX = "feedback/"
"""Checkpoint names of int8's residuals: ``feedback/<rank>/<bucket>/<chunk>/<worker|server>``, each held by its rank."""


def check_same_model(model: nn.Module, comm: Any) -> None:
    """Raise on every rank unless all ranks hold the same parameter names, shapes and dtypes (collective).

    Mismatched replicas would otherwise pair unrelated buffers in the
    collectives, or wait forever for a bucket another rank does not have.
    """
    import hashlib

    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    digest = hashlib.sha256(repr(layout).encode()).hexdigest()
    digests = comm.allgather(digest)
    if len(set(digests)) > 1:
        first = comm.bcast(layout, root=0)
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        diff = next((f"{a} vs {b}" for a, b in zip(first, layout) if a != b), None)
        if diff is None and len(first) != len(layout):
            diff = f"{len(first)} tensors on rank 0, {len(layout)} here"
        raise mark_agreed(UsageError(f"the model differs across ranks: ranks {odd} do not match rank 0"
                         + (f" (rank {comm.Get_rank()}: {diff})" if diff else "")))


class DataParallel:
    """Keep model replicas equal across the ranks of ``comm`` and average their gradients.

    Args:
        model: the replica on this rank (already on its device).
        comm: the MPI communicator of the job (the control plane).
        world: its layout.
        cfg: the ``dist`` options.
        plan: the transport plan (``hpcnet.comm.plan.decide_plan``), decided
            before the torch.distributed group was set up.
        recorder: the flight recorder (``hpcnet.fault.flightrec``) the step's collectives are logged to.
        link: the probed link (the inter-node one where there are nodes): ``dist.bucket_mb=auto``, the shard
            plan, and the communication forecast (``_forecast``); None: not probed.
        intra_link: the probed intra-node link where there are nodes (the hierarchical forecast's inner phases).
        blocks: ``dist.zero=3``: the model's blocks (``hpcnet.models.blocks.find_blocks``), each gathered apart
            (``hpcnet.comm.zero3``); None or empty: the whole model is one group.
    """

    def __init__(self, model: nn.Module, comm: Any, world: World, cfg: DistConfig, *,
                 device: torch.device, plan: Plan, recorder: Any = NULL_RECORDER,
                 link: LinkCost | None = None, intra_link: LinkCost | None = None,
                 blocks: list[tuple[str, nn.Module]] | None = None) -> None:
        self.model = model
        self.comm = comm
        self.world = world
        self.cfg = cfg
        self.device = device
        check_same_model(model, comm)
        self.path: PathChoice | None = None
        if link is not None and cfg.hierarchical == "auto" and plan.hierarchical and world.num_nodes > 1 \
                and cfg.compression in ("none", "auto"):
            plan = self._choose_path(plan, model, link, intra_link)
        self.plan = plan
        self.progress = mpi_progress(cfg.progress, cores_per_rank(world))
        self.feedback = ErrorFeedback()  # int8's residuals: kept here, so a checkpoint holds them
        transport = build_transport(plan.primary, plan.hierarchical, comm, world, timeout_s=cfg.timeout_s,
                                    progress=self.progress, inter_node=plan.inter_node,
                                    wire=_DTYPES[cfg.compression], feedback=self.feedback,
                                    chunk_bytes=PIPELINE_CHUNK_BYTES if self.path is None else self.path.chunk_bytes)
        if cfg.fail_at_step:
            transport = FaultyTransport(transport, fail=not cfg.fail_ranks or world.rank in cfg.fail_ranks)
        broadcast_module(model, comm)  # replicas start equal even if initialisation differed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.link = link
        self.shards: ShardPlan | None = None
        self.speeds: list[float] = []
        self.layout: ShardLayout | None = None
        if cfg.zero:
            self.layout = ShardLayout(self.params, world.size)
            self.shards, self.speeds = plan_shards(self.layout.tensors, comm, mode=cfg.plan, link=link,
                                                   device=device)
        self.sharded_params: ShardedParams | None = None
        if cfg.zero == 3:
            assert self.layout is not None and self.shards is not None
            self.sharded_params = ShardedParams(
                model, self.layout, self.shards.owner, comm, blocks or [], device=device,
                collective="mpi" if device.type == "cpu" else "torch")
            if world.is_main:
                log.info("%s", self.sharded_params.describe())
        units = self.layout.units if self.layout is not None else split_units(self.params, world.size)
        self._norm_units = units if any(not u.whole for u in units) else None
        self._norm_order = norm_order(self.params)
        self.optimizer: ShardedOptimizer | None = None
        self._plan_file: OptionalFile | None = None
        self._replanning = False
        self.replans = 0
        self.reducer = Reducer(
            list(model.named_parameters()), transport, comm,
            bucket_bytes=self.bucket_bytes(), first_bucket_bytes=int(cfg.first_bucket_mb * 2**20),
            compression=_DTYPES[cfg.compression] if cfg.compression in HALF_PRECISIONS else None,
            find_unused=cfg.find_unused, timeout_s=cfg.timeout_s,
            recorder=recorder, owners=self.shards.owner if cfg.zero >= 2 else None,
            units=self.layout if cfg.zero >= 2 else None)
        if self.sharded_params is not None:
            self.reducer.pace()
            self.sharded_params.rounds.paced = self.reducer
        if cfg.compression == "int8" and world.num_nodes == 1 and world.is_main and world.size > 1:
            log.info("dist.compression=int8 compresses only between nodes, and this job has one: the sums are exact")
        self.forecast: CommForecast | None = None
        if link is not None and world.size > 1:
            self.forecast = self._forecast(link, intra_link)
        self.step_count = 0
        self.compute_timer: Any = None  # data.balance: times each forward and backward (hpcnet.data.balance)
        self.clock = PhaseClock()  # the loop's (hpcnet.observe.phases); marks are no-ops until it starts a step
        self.share = 1.0 / world.size
        self._has_buffers = any(True for _ in model.buffers())
        # On GPU the buffers go over NCCL, in stream order, without a host round trip.
        self._buffer_group = None
        if device.type == "cuda" and world.size > 1 and plan.torch_backend == "nccl":
            import torch.distributed as dist

            self._buffer_group = dist.group.WORLD

    def _choose_path(self, plan: Plan, model: nn.Module, inter: LinkCost, intra: LinkCost | None) -> Plan:
        """``dist.hierarchical=auto`` where the layout allows both paths and the sums are exact: the flat or the
        hierarchical all-reduce and its chunk, whichever the forecast from the probed links says is faster
        (``costmodel.choose_path``); rank 0's choice, so every rank builds the same transport (collective)."""
        total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        world = self.world
        choice = choose_path(total, nodes=world.num_nodes, local=world.size // world.num_nodes, inter=inter,
                             intra=intra) if world.is_main else None
        self.path = choice = self.comm.bcast(choice, root=0)
        if world.is_main:
            log.info("dist.hierarchical=auto: %s", choice.describe())
        return plan if choice.hierarchical else dataclasses.replace(plan, hierarchical=False, inter_node=None)

    def bucket_bytes(self) -> int:
        """``dist.bucket_mb`` in bytes; 'auto' from the probed link (``costmodel.auto_bucket_bytes``); at
        ``dist.zero=2`` at most ``costmodel.stage2_bucket_cap`` (the buckets in flight stay small beside the
        gradient shard a rank keeps)."""
        total = sum(p.numel() * p.element_size() for p in self.params)
        if self.cfg.bucket_mb != "auto":
            chosen = int(float(self.cfg.bucket_mb) * 2**20)
        elif self.link is None:
            if self.world.is_main and self.world.size > 1:
                log.info("dist.bucket_mb=auto: no probed link (dist.probe=false), buckets of %d MiB",
                         AUTO_FALLBACK_MB)
            chosen = AUTO_FALLBACK_MB * 2**20
        else:
            chosen = auto_bucket_bytes(self.link, total, self.world.size)
            if self.world.is_main:
                log.info("dist.bucket_mb=auto: %.2f MiB buckets (link %.1f us, %.2f GB/s; %.1f MiB of gradients)",
                         chosen / 2**20, self.link.latency_s * 1e6, self.link.bandwidth_Bps / 1e9, total / 2**20)
        if self.cfg.zero >= 2 and self.world.size > 1:
            share = bucket_share(self.cfg.zero)
            cap = stage2_bucket_cap(total, self.world.size, share=share)
            if chosen > cap:
                if self.world.is_main:
                    log.info("dist.zero=%d: buckets of %.2f MiB, not %.2f (at most 1/%d of a rank's %.1f MiB "
                             "gradient shard)", self.cfg.zero, cap / 2**20, chosen / 2**20,
                             round(1 / share),
                             total / self.world.size / 2**20)
                chosen = cap
        return chosen

    def shard_optimizer(self, optimizer: torch.optim.Optimizer, run_dir: Path | None = None) -> Any:
        """With ``dist.zero`` > 0: ``optimizer`` (over every parameter, no state yet) sharded by the plan, which
        rank 0 logs and writes to ``plan.json`` in ``run_dir``; else ``optimizer`` itself."""
        if not self.cfg.zero:
            return optimizer
        assert self.shards is not None and self.layout is not None
        self.optimizer = ShardedOptimizer(optimizer, self.shards, self.layout, self.comm, self.cfg.zero)
        self.optimizer.clock = self.clock
        self._plan_file = OptionalFile(run_dir / PLAN_FILE) if run_dir is not None and self.world.is_main else None
        # At stage 3 new owners would gather the whole model on every rank: the start-up plan stays.
        self._replanning = (self.cfg.plan == "auto" and self.cfg.replan_every > 0 and self.world.size > 1
                            and self.cfg.zero < 3)
        if self.world.is_main:
            log.info("%s", self.describe_shards())
        self._write_plan()
        return self.optimizer

    def _write_plan(self) -> None:
        """Rank 0 (re)writes plan.json; best effort (``OptionalFile``): the other ranks do not wait for it."""
        if self._plan_file is not None:
            self._plan_file.write_text(json.dumps(self.plan_record(), indent=1) + "\n")

    def _forecast(self, inter: LinkCost, intra: LinkCost | None) -> CommForecast:
        """The cost model's prediction of a step's all-reduce on the path the plan chose (``forecast_allreduce``),
        logged by rank 0 with what the other paths and wire formats would send and take, so a user sees what
        lossy compression would save before opting in (``dist.compression=auto`` never chooses it)."""
        total = sum(p.numel() * p.element_size() for p in self.params)
        world = self.world
        local = world.size // world.num_nodes
        wire = "fp32" if self.cfg.compression in ("auto", "none") or world.num_nodes == 1 else self.cfg.compression
        chunk = getattr(self.reducer.transport, "chunk_bytes", 4 << 20)

        def model(hierarchical: bool, wire: str) -> CommForecast:
            return forecast_allreduce(total, nodes=world.num_nodes, local=local, hierarchical=hierarchical,
                                      inter=inter, intra=intra, wire=wire, chunk_bytes=chunk)
        chosen = model(self.plan.hierarchical, wire)
        if world.is_main:
            text = (f"{chosen.path} {chosen.wire}: {chosen.seconds * 1e3:.1f} ms a step"
                    + (f", {chosen.host_bytes / 2**20:.1f} MiB out of each host" if world.num_nodes > 1 else ""))
            if world.num_nodes > 1:
                others = [model(h, w) for h, w in [(False, "fp32"), (True, "fp32"), (True, "bf16"), (True, "int8")]
                          if (h, w) != (self.plan.hierarchical, wire)]
                text += "; " + ", ".join(f"{f.path} {f.wire} {f.seconds * 1e3:.1f} ms, {f.host_bytes / 2**20:.1f} "
                                         "MiB" for f in others)
                if self.cfg.compression == "auto":
                    text += " (bf16 and int8 are lossy: opt in with dist.compression)"
            links = f"{'inter-node ' if world.num_nodes > 1 else ''}link {inter.latency_s * 1e6:.1f} us, " \
                    f"{inter.bandwidth_Bps * 8 / 1e9:.2f} Gbit/s"
            if intra is not None and world.num_nodes > 1:
                links += f"; intra-node {intra.latency_s * 1e6:.1f} us, {intra.bandwidth_Bps * 8 / 1e9:.2f} Gbit/s"
            log.info("communication forecast (%s): %s", links, text)
        return chosen

    def measured_comm_s(self) -> float | None:
        """The median of this rank's all-reduce times (``ReducerStats.comm_s``) after the first step, or None."""
        spans = self.reducer.stats.comm_s[1:]
        return statistics.median(spans) if spans else None

    def after_step(self, step: int) -> None:
        """Called by every rank after each optimizer step: at ``FORECAST_CHECK_STEP`` rank 0 logs the measured
        all-reduce time beside the forecast; every ``dist.replan_every`` steps, with ``dist.plan=auto``, the
        ranks probe their speed again and agree whether it calls for new owners (collective)."""
        if step == FORECAST_CHECK_STEP and self.forecast is not None and self.world.is_main:
            measured = self.measured_comm_s()
            if measured is not None:
                log.info("communication: forecast %.1f ms a step, measured %.1f ms (median since step 2: first "
                         "bucket sent to every sum in; what backward hides of it is in the trace's phases)",
                         self.forecast.seconds * 1e3, measured * 1e3)
        if not self._replanning or step % self.cfg.replan_every:
            return
        # The start-up probe again, the same work on every rank: a rank's own update time would not do, as it
        # grows with what the rank owns, and a rank given less would look slower and be given less again.
        seconds = measure_speed(device=self.device)
        with self.reducer.recorder.op("replan.allgather"):
            gathered = self.comm.allgather(seconds)
        self.replan(step, measured_speeds(gathered))

    def replan(self, step: int, speeds: list[float]) -> bool:
        """New owners when the ranks' relative ``speeds`` drifted by more than ``REPLAN_DRIFT`` from those the plan
        in force was made with and the cost model gives a step more than ``REPLAN_GAIN`` shorter (collective;
        the same decision on every rank from the same gathered figures). Returns whether the owners changed."""
        if self.shards is None or self.optimizer is None:
            return False
        if max(abs(new / old - 1) for new, old in zip(speeds, self.speeds)) <= REPLAN_DRIFT:
            return False
        assert self.layout is not None
        link = self.link or DEFAULT_LINK
        now = max(plan_time_s(self.layout.sizes, self.shards.owner, speeds, compute_s_per_byte=UPDATE_S_PER_BYTE,
                              link=link))
        candidate, _ = plan_shards(self.layout.tensors, self.comm, mode="auto", link=self.link, speeds=speeds)
        if candidate.owner == self.shards.owner or candidate.max_time_s >= (1 - REPLAN_GAIN) * now:
            return False
        moved = self._adopt(candidate, speeds)
        self.replans += 1
        if self.world.is_main:
            log.info("dist.plan: new owners after step %d (measured update speeds %s; modelled step %.3f -> %.3f "
                     "ms; %.1f MiB of optimizer state moved): %s", step,
                     ", ".join(f"{x:.2f}" for x in speeds[:8]), 1e3 * now, 1e3 * candidate.max_time_s,
                     moved / 2**20, self.describe_shards())
        self._write_plan()
        return True

    def _adopt(self, plan: ShardPlan, speeds: list[float]) -> int:
        """Move to ``plan``'s owners (collective): the optimizer state and, at stage 2, the buckets' layout;
        returns the bytes of state moved by all ranks together."""
        assert self.optimizer is not None
        if self.sharded_params is not None:
            self.sharded_params.reown(plan.owner)
        sent = self.optimizer.reshard(plan)
        if self.cfg.zero >= 2:
            self.reducer.reassign(plan.owner)
        self.shards, self.speeds = plan, speeds
        return self.comm.allreduce(sent)

    def plan_state(self) -> dict[str, Any] | None:
        """The owners in force and the speeds they were planned with, for a checkpoint's meta (None at
        ``dist.zero=0``): a resume at the same world size goes on with them (``restore_plan``)."""
        if self.shards is None or self.layout is None:
            return None
        return {"world_size": self.world.size, "owner": list(self.shards.owner), "speeds": list(self.speeds),
                "bytes": list(self.layout.sizes), "units": self.layout.to_json()}

    def feedback_state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """int8's residuals for a checkpoint (collective): every rank's names (``FEEDBACK_PREFIX``), its own
        residuals as tensors and the others' as ``meta`` tensors of their shapes, and who holds each; nothing (and
        no collective) without ``dist.compression=int8``, the same on every rank."""
        if self.cfg.compression != "int8":
            return {}, {}
        residuals = self.feedback.state()
        mine = [(name, r.numel()) for name, r in residuals.items()]
        tensors: dict[str, torch.Tensor] = {}
        holders: dict[str, int] = {}
        for rank, names in enumerate(self.comm.allgather(mine)):
            for name, numel in names:
                key = f"{FEEDBACK_PREFIX}{rank}/{name}"
                holders[key] = rank
                tensors[key] = (residuals[name] if rank == self.world.rank
                                else torch.empty(numel, device="meta"))
        return tensors, holders

    def wants_feedback(self, name: str) -> bool:
        """Whether a checkpoint's tensor of ``FEEDBACK_PREFIX`` is this rank's to read (its own residuals)."""
        return name.startswith(f"{FEEDBACK_PREFIX}{self.world.rank}/")

    def load_feedback(self, tensors: dict[str, torch.Tensor], saved_world_size: int) -> None:
        """int8's residuals from a checkpoint's tensors: this rank's, when saved at the same world size (the same
        buckets and shards); otherwise they start from zero (a step's quantization error, dropped once)."""
        if self.cfg.compression != "int8":
            self.feedback.clear()
            return
        prefix = f"{FEEDBACK_PREFIX}{self.world.rank}/"
        mine = {name[len(prefix):]: value for name, value in tensors.items() if name.startswith(prefix)}
        if saved_world_size != self.world.size:
            self.feedback.clear()
            if self.world.is_main and mine:
                log.info("resume: int8's error-feedback residuals were saved by %d ranks, this run has %d: they "
                         "start from zero", saved_world_size, self.world.size)
            return
        self.feedback.load(mine)

    def restore_plan(self, saved: Any) -> bool:
        """Go on with the owners a checkpoint was saved under (collective; every rank has the same meta).

        ``dist.plan=auto`` plans from speeds measured at start-up, which differ
        from one start to the next; at stage 2 the owners decide how each bucket
        is reduce-scattered, and with more than 2 ranks MPI then adds the same
        numbers in another order.  Keeping the saved owners makes a resume at the
        same world size bit-identical to the run that was not interrupted.  Only
        a checkpoint of the same world size and parameter sizes is followed;
        otherwise the fresh plan stays.  Returns whether the owners changed.
        """
        if self.shards is None or self.optimizer is None or self.layout is None or not isinstance(saved, dict):
            return False
        sizes = self.layout.sizes
        owner, speeds = saved.get("owner"), saved.get("speeds")
        if (saved.get("world_size") != self.world.size or saved.get("bytes") != sizes
                or saved.get("units", self.layout.to_json()) != self.layout.to_json()
                or not isinstance(owner, list) or len(owner) != len(sizes)
                or not all(isinstance(o, int) and 0 <= o < self.world.size for o in owner)
                or not isinstance(speeds, list) or len(speeds) != self.world.size
                or not all(isinstance(x, (int, float)) and 0 < x <= 1 for x in speeds)):
            return False
        speeds = [float(x) for x in speeds]
        if owner == self.shards.owner:
            self.speeds = speeds
            return False
        times = plan_time_s(sizes, owner, speeds, compute_s_per_byte=UPDATE_S_PER_BYTE,
                            link=self.link or DEFAULT_LINK)
        rank_bytes = [0] * self.world.size
        for size, rank in zip(sizes, owner):
            rank_bytes[rank] += size
        moved = self._adopt(ShardPlan(owner, rank_bytes, times), speeds)
        if self.world.is_main:
            log.info("dist.plan: resumed with the checkpoint's owners (%.1f MiB of optimizer state moved): %s",
                     moved / 2**20, self.describe_shards())
        self._write_plan()
        return True

    def plan_record(self) -> dict[str, Any]:
        """What plan.json holds: the stage, the mode, the inputs the cost model used and its assignment."""
        assert self.shards is not None and self.layout is not None
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        units = []
        for unit, size, owner in zip(self.layout.units, self.layout.sizes, self.shards.owner):
            entry = {"name": names[unit.param], "bytes": size, "owner": owner}
            if not unit.whole:
                entry["rows"] = [unit.lo, unit.hi]
            units.append(entry)
        return {"zero": self.cfg.zero, "plan": self.cfg.plan, "world_size": self.world.size,
                "speeds": self.speeds,
                "link": ({"latency_us": self.link.latency_s * 1e6, "bandwidth_GBps": self.link.bandwidth_Bps / 1e9}
                         if self.link else None),
                "units": units, "cut": sorted({names[u.param] for u in self.layout.units if not u.whole}),
                **self.shards.to_json()}

    def describe_shards(self) -> str:
        assert self.shards is not None
        mib = [b / 2**20 for b in self.shards.rank_bytes]
        return (f"dist.zero={self.cfg.zero} (plan {self.cfg.plan}): parameters owned per rank "
                f"{', '.join(f'{m:.2f}' for m in mib[:8])}{' ...' if len(mib) > 8 else ''} MiB, "
                f"modelled imbalance {self.shards.imbalance:.3f}; speeds "
                f"{', '.join(f'{s:.2f}' for s in self.speeds[:8])}{' ...' if len(self.speeds) > 8 else ''}")

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
        parameter at this world size, every stage takes the norm unit by unit as it does (``zero.unit_grad_norm``),
        so the stages clip alike, bit for bit; otherwise it is ``torch.nn.utils.get_total_norm``'s."""
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
        return (f"gradients: {self.backend} all-reduce{' (hierarchical)' if self.plan.hierarchical else ''}"
                f"{progress}, "
                f"{len(sizes)} bucket(s) of {', '.join(f'{s:.1f}' for s in sizes[:6])}"
                f"{' ...' if len(sizes) > 6 else ''} MiB, compression "
                f"{'none (auto)' if self.cfg.compression == 'auto' else self.cfg.compression}, "
                f"fallback {self.plan.fallback or 'none'}")

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
        saved = self._snapshot() if self.plan.fallback or self.reducer.may_redo else None
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
                if self.plan.fallback is None or saved is None:
                    raise mark_agreed(RestartableError(f"step {self.step_count}: {exc}; no fallback left")) from exc
                self.reducer.arm_fault(False)
                fallback = build_transport(self.plan.fallback, False, self.comm, self.world,
                                           timeout_s=self.cfg.timeout_s, progress=self.progress)
                self.reducer.switch(fallback, str(exc), self.step_count)
                self.plan = Plan(self.plan.fallback, False, None)
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
        out = {"backend": self.backend, "hierarchical": self.plan.hierarchical, "fallbacks": stats.fallbacks,
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
        if self.shards is not None:
            out["owned_bytes"] = self.shards.rank_bytes
            out["replans"] = self.replans
        return out

    def close(self, collective: bool = True) -> None:
        """``collective=False`` while an error raised on this rank alone propagates (``Reducer.close``)."""
        self.reducer.close(collective)
        if self.optimizer is not None and collective:
            self.optimizer.close()
        if self.sharded_params is not None:
            self.sharded_params.close(collective)
