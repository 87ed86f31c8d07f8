"""Data parallelism: one model replica per rank, gradients averaged every step.

``DataParallel`` chooses the transport (NCCL on GPU, MPI on CPU, gloo on
request; flat or hierarchical from the measured topology), runs a step's
micro-batches with communication only after the last one, and when the
transport fails on any rank it switches every rank to the fallback and redoes
the step from the same batch, parameters and RNG state, so the result equals
a run without the failure.
"""

import contextlib
import datetime
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from hpcnet.comm.reducer import Reducer, broadcast_buffers, broadcast_module
from hpcnet.config import DistConfig
from hpcnet.errors import RestartableError, UsageError
from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.comm.transport import (CommFailure, FaultyTransport, HierarchicalTransport, MpiTransport,
                                   TorchTransport, Transport, cuda_aware_mpi)
from hpcnet.comm.world import World
from hpcnet.agree import agreed, shared_errors

log = logging.getLogger(__name__)

_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class Plan:
    """Which transports to use (pure decision, see ``plan_transport``)."""

    primary: str
    hierarchical: bool
    fallback: str | None

    @property
    def torch_backend(self) -> str | None:
        """The torch.distributed default group the plan needs: 'nccl', 'gloo', or None (MPI only).

        The gloo fallback of a NCCL run is a subgroup created on demand from
        the NCCL default group, so NCCL wins.
        """
        kinds = {self.primary, self.fallback} - {None, "mpi"}
        return "nccl" if "nccl" in kinds else ("gloo" if kinds else None)


def plan_transport(cfg: DistConfig, *, device_type: str, num_nodes: int, min_local_size: int,
                   cuda_aware: bool = False, hierarchical_hint: bool | None = None) -> Plan:
    """Decide the primary backend, flat or hierarchical, and the fallback (pure logic).

    The one place where ``dist.backend = 'auto'`` is resolved: the bootstrap
    and ``DataParallel`` both follow the plan this returns.

    Args:
        cfg: the ``dist`` options.
        device_type: 'cpu' or 'cuda'.
        num_nodes: nodes in the job (virtual nodes count).
        min_local_size: ranks on the node with the fewest.
        cuda_aware: the MPI library can read GPU memory.
        hierarchical_hint: the topology probe's advice, used when
            ``dist.hierarchical`` is 'auto' (None: decide from the layout).
    """
    gpu = device_type == "cuda"
    primary = cfg.backend if cfg.backend != "auto" else ("nccl" if gpu else "mpi")
    if primary == "nccl" and not gpu:
        raise UsageError("dist.backend: 'nccl' needs a GPU device (dist.device is cpu or no GPU is visible)")
    if primary == "mpi" and gpu and not cuda_aware:
        raise UsageError("dist.backend: 'mpi' on GPU tensors needs a CUDA-aware MPI; use 'nccl'")
    compressed = cfg.compression != "none"
    if compressed and primary == "mpi":
        which = "'auto' is mpi on CPU" if cfg.backend == "auto" else "is 'mpi'"
        raise UsageError(f"dist.compression: {cfg.compression} needs the nccl or gloo backend, and dist.backend "
                         f"{which} (MPI has no half-precision sum); set dist.backend=gloo")
    if cfg.hierarchical == "auto":
        hierarchical = (num_nodes > 1 and min_local_size > 1) if hierarchical_hint is None else hierarchical_hint
    else:
        hierarchical = cfg.hierarchical == "on"
    if cfg.fallback == "none":
        fallback = None
    elif cfg.fallback == "auto":
        fallback = "mpi" if primary == "gloo" and (not gpu or cuda_aware) else "gloo"
        if fallback == "mpi" and compressed:
            fallback = None  # the wire format cannot change mid-run, and MPI cannot sum it
    else:
        fallback = cfg.fallback
    if fallback == primary and fallback != "gloo":
        fallback = None  # a fresh gloo group is a real alternative; the same MPI communicator is not
    if fallback == "mpi" and gpu and not cuda_aware:
        raise UsageError("dist.fallback: 'mpi' on GPU tensors needs a CUDA-aware MPI; use 'gloo'")
    if fallback == "mpi" and compressed:
        raise UsageError(f"dist.fallback: 'mpi' cannot carry dist.compression={cfg.compression} "
                         "(MPI has no half-precision sum); use 'gloo' or 'none'")
    return Plan(primary, hierarchical, fallback)


def decide_plan(comm: Any, world: World, cfg: DistConfig, *, device_type: str,
                hierarchical_hint: bool | None = None) -> Plan:
    """Collective: ``plan_transport`` for this job, the same on every rank, or the same error on every rank.

    Ranks that see different devices (a node without GPUs under
    ``dist.device=auto``) would initialise different backends and wait for
    each other forever; that is an error naming them.
    """
    from mpi4py import MPI

    min_local = comm.allreduce(world.local_size, op=MPI.MIN)
    with shared_errors(comm):
        plan = plan_transport(cfg, device_type=device_type, num_nodes=world.num_nodes, min_local_size=min_local,
                              cuda_aware=device_type == "cuda" and cuda_aware_mpi(),
                              hierarchical_hint=hierarchical_hint)
    plans = comm.allgather((device_type, plan))
    odd = [r for r, p in enumerate(plans) if p != plans[0]]
    if odd:
        raise agreed(UsageError(
            f"the ranks chose different transports: rank 0 has a {plans[0][0]} device and {plans[0][1]}, rank "
            f"{odd[0]} a {plans[odd[0]][0]} device and {plans[odd[0]][1]} (ranks {odd} differ); set dist.device"))
    return plan


def build_transport(kind: str, hierarchical: bool, comm: Any, world: World, *,
                    timeout_s: float | None = None) -> Transport:
    """Create a transport over the ranks of ``comm`` (collective).

    ``timeout_s`` (``dist.timeout_s``; None: torch's default) is given to
    every torch.distributed group created here: NCCL enforces it in its own
    watchdog, so nothing waits on a NCCL work with a CPU timeout (see
    ``hpcnet.transport``).
    """
    if hierarchical and world.size > 1:
        return HierarchicalTransport(comm, node_index=world.node_index, local_rank=world.local_rank, kind=kind,
                                     timeout_s=timeout_s)
    if kind == "mpi":
        return MpiTransport(comm)
    import torch.distributed as dist

    if world.size == 1:
        return TorchTransport(None, kind, 1)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    group = dist.group.WORLD if dist.get_backend() == kind else dist.new_group(backend=kind, timeout=timeout)
    return TorchTransport(group, kind, world.size)


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
        raise agreed(UsageError(f"the model differs across ranks: ranks {odd} do not match rank 0"
                         + (f" (rank {comm.Get_rank()}: {diff})" if diff else "")))


class DataParallel:
    """Keep model replicas equal across the ranks of ``comm`` and average their gradients.

    Args:
        model: the replica on this rank (already on its device).
        comm: the MPI communicator of the job (the control plane).
        world: its layout.
        cfg: the ``dist`` options.
        plan: the transport plan (``decide_plan``), decided before the
            torch.distributed group was set up; None decides it here, without
            a topology hint.
        recorder: the flight recorder (``hpcnet.flightrec``) the step's collectives are logged to.
    """

    def __init__(self, model: nn.Module, comm: Any, world: World, cfg: DistConfig, *,
                 device: torch.device, plan: Plan | None = None, recorder: Any = NULL_RECORDER) -> None:
        self.model = model
        self.comm = comm
        self.world = world
        self.cfg = cfg
        self.device = device
        self.plan = plan = plan or decide_plan(comm, world, cfg, device_type=device.type)
        check_same_model(model, comm)
        transport = build_transport(plan.primary, plan.hierarchical, comm, world, timeout_s=cfg.timeout_s)
        if cfg.fail_at_step:
            transport = FaultyTransport(transport, fail=not cfg.fail_ranks or world.rank in cfg.fail_ranks)
        broadcast_module(model, comm)  # replicas start equal even if initialisation differed
        self.reducer = Reducer(
            list(model.named_parameters()), transport, comm,
            bucket_bytes=int(cfg.bucket_mb * 2**20), first_bucket_bytes=int(cfg.first_bucket_mb * 2**20),
            compression=_DTYPES[cfg.compression], find_unused=cfg.find_unused, timeout_s=cfg.timeout_s,
            recorder=recorder)
        self.step_count = 0
        self._has_buffers = any(True for _ in model.buffers())
        # On GPU the buffers go over NCCL, in stream order, without a host round trip.
        self._buffer_group = None
        if device.type == "cuda" and world.size > 1 and plan.torch_backend == "nccl":
            import torch.distributed as dist

            self._buffer_group = dist.group.WORLD

    @property
    def backend(self) -> str:
        return self.reducer.transport.name

    def describe(self) -> str:
        sizes = [b.buffer.numel() * b.buffer.element_size() / 2**20 for b in self.reducer.buckets]
        return (f"gradients: {self.backend} all-reduce{' (hierarchical)' if self.plan.hierarchical else ''}, "
                f"{len(sizes)} bucket(s) of {', '.join(f'{s:.1f}' for s in sizes[:6])}"
                f"{' ...' if len(sizes) > 6 else ''} MiB, compression {self.cfg.compression}, "
                f"fallback {self.plan.fallback or 'none'}")

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
             loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor], *,
             step: int | None = None) -> torch.Tensor:
        """Forward and backward over the micro-batches, then average the gradients.

        ``step`` is the global number of the step being computed (1 for the
        first step of a run, resumed or not, as ``fault.*`` count them); None
        counts on from the previous call.  Returns the mean loss over the
        micro-batches (a tensor on the device).  Raises RestartableError on
        every rank when the transport failed and no fallback is left.
        """
        self.step_count = self.step_count + 1 if step is None else step
        self.sync_buffers()  # replicas start every step bit-identical, as with DDP's broadcast_buffers
        self.reducer.arm_fault(self.step_count == self.cfg.fail_at_step)
        # What the step may change besides gradients: a retry restores them.
        saved = self._snapshot() if self.plan.fallback else None
        while True:
            loss = self._forward_backward(batches, loss_fn)
            try:
                self.reducer.finish()
                return loss
            except CommFailure as exc:
                if self.plan.fallback is None or saved is None:
                    raise agreed(RestartableError(f"step {self.step_count}: {exc}; no fallback left")) from exc
                self.reducer.arm_fault(False)
                fallback = build_transport(self.plan.fallback, False, self.comm, self.world,
                                           timeout_s=self.cfg.timeout_s)
                self.reducer.switch(fallback, str(exc), self.step_count)
                self.plan = Plan(self.plan.fallback, False, None)
                self._buffer_group = None  # the NCCL group may be the part that failed
                self._restore(saved)

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                          loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        self.reducer.zero_grad()
        total = torch.zeros((), device=self.device)
        n = len(batches)
        for k, (inputs, targets) in enumerate(batches):
            # Communicate only after the last micro-batch.
            context = self.reducer.no_sync() if k < n - 1 else contextlib.nullcontext()
            with context:
                loss = loss_fn(self.model, inputs, targets) / n
                loss.backward()
            total += loss.detach()
        return total

    def _snapshot(self) -> dict[str, Any]:
        state = {"cpu_rng": torch.get_rng_state(),
                 "buffers": [b.detach().clone() for b in self.model.buffers()]}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def _restore(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu_rng"])
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
        return {"backend": self.backend, "hierarchical": self.plan.hierarchical, "fallbacks": stats.fallbacks,
                "bytes_reduced": stats.bytes_reduced}

    def close(self) -> None:
        self.reducer.close()
