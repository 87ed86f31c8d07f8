"""ZeRO-style sharded data parallelism (``dist.zero``): each parameter's optimizer state, and at stage 2 its
averaged gradient, lives on one owner rank only (README: Memory: sharded data parallelism).

- **Who owns what** (``plan_shards``): every trainable parameter, whole, gets one owner rank from the cost
  model (``hpcnet.comm.costmodel.assign_shards``): ``dist.plan=uniform`` balances bytes over ranks taken as
  equally fast; ``auto`` also weighs each rank's measured speed (a timed matmul at start-up, the slowest
  rank's median, so ranks of unequal speed own less) and the measured link. Every rank computes the same plan
  from the same gathered inputs; rank 0 writes it to ``plan.json``.
- **Stage 1**: gradients are all-reduced as at stage 0; each rank's optimizer holds and updates only the
  parameters it owns (``ShardedOptimizer``), then every parameter is broadcast from its owner in place
  (``ParamGather``: one ``MPI_Bcast`` per owner).
- **Stage 2**: the reducer reduce-scatters each bucket so each rank receives only the sums it owns
  (``Reducer(owners=...)``); the buckets are dropped after the step, so between steps a rank holds 1/N of
  the gradients, and from the next step's start until its buckets go out not even those. The global gradient norm for clipping is gathered as one float per parameter.

A sharded optimizer's ``state_dict`` has the layout of the unsharded optimizer's (state keyed by the global
parameter index, every param group with every index), holding the owned entries only; ``load_state_dict``
takes a full one and keeps the owned entries, so checkpoints move between ``dist.zero`` settings and world
sizes unchanged.
"""

import inspect
import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.comm.costmodel import LinkCost, ShardPlan, assign_shards, measured_speeds
from hpcnet.comm.reducer import _dense

UPDATE_S_PER_BYTE = 1.0 / 2e9
"""Modelled optimizer update time per parameter byte on the fastest rank: an elementwise update reads and writes
a few tensors of the parameter's size at a few GB/s; only the ratio to the link cost matters to the plan."""
SPEED_PROBE_ROUNDS = 5
DEFAULT_LINK = LinkCost(latency_s=10e-6, bandwidth_Bps=5e9)
"""The link the plan assumes without a probe (dist.probe=false)."""


def measure_speed(rounds: int = SPEED_PROBE_ROUNDS, size: int = 192, device: torch.device | None = None) -> float:
    """Seconds for one ``size``-square float32 matmul on ``device`` (default this rank's CPU), median of
    ``rounds`` (about 10 ms on a CPU; on a GPU each timed matmul is synchronised, so call it at a boundary)."""
    device = device or torch.device("cpu")
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, a)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def plan_shards(params: list[nn.Parameter], comm: Any, *, mode: str, link: LinkCost | None = None,
                speeds: list[float] | None = None, device: torch.device | None = None
                ) -> tuple[ShardPlan, list[float]]:
    """Owner ranks for ``params`` (collective when ``mode='auto'`` and ``speeds`` is None: gathers speeds).

    Returns the plan and the relative rank speeds it used (1.0 = the fastest).
    """
    size = comm.Get_size()
    if speeds is None:
        if mode == "auto" and size > 1:
            speeds = measured_speeds(comm.allgather(measure_speed(device=device)))
        else:
            speeds = [1.0] * size
    if len(speeds) != size:
        raise ValueError(f"speeds has {len(speeds)} entries for {size} ranks")
    sizes = [p.numel() * p.element_size() for p in params]
    plan = assign_shards(sizes, speeds, compute_s_per_byte=UPDATE_S_PER_BYTE,
                         link=link or DEFAULT_LINK)
    return plan, speeds


class ParamGather:
    """Give every rank every parameter after each owner updated its own (collective).

    CPU parameters: one ``MPI_Bcast`` per owner rank of an MPI datatype that lists that rank's parameters at
    their own addresses (``hindexed`` from ``MPI_BOTTOM``), so nothing is staged through a buffer of the
    parameters' size: a full-size staging buffer would cost as much memory as the optimizer state stage 1 saves.
    CUDA parameters: ``torch.distributed.broadcast`` of each from its owner (NCCL, in stream order).
    """

    def __init__(self, params: list[nn.Parameter], owner: list[int], comm: Any) -> None:
        from mpi4py import MPI

        self.comm = comm.Dup()  # its own message space
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.params, self.owner = params, owner
        self.types: list[Any] = []  # per owner rank: its CPU parameters as one datatype (None: it owns none)
        for root in range(self.size):
            mine = [p for i, p in enumerate(params) if owner[i] == root and p.device.type == "cpu"]
            if not mine:
                self.types.append(None)
                continue
            for p in mine:
                if not p.is_contiguous() and not _dense(p):
                    raise ValueError("a sharded parameter must be dense in memory")
            dtype = MPI.BYTE.Create_hindexed([p.numel() * p.element_size() for p in mine],
                                             [p.data_ptr() for p in mine]).Commit()
            self.types.append(dtype)
        self.devices = [i for i, p in enumerate(params) if p.device.type != "cpu"]

    def run(self) -> None:
        from mpi4py import MPI

        if self.size == 1:
            return
        with torch.no_grad():
            for root, dtype in enumerate(self.types):
                if dtype is not None:
                    self.comm.Bcast([MPI.BOTTOM, 1, dtype], root=root)
            if self.devices:
                import torch.distributed as dist

                for i in self.devices:
                    dist.broadcast(self.params[i].data, src=self.owner[i])

    def close(self) -> None:
        for dtype in self.types:
            if dtype is not None:
                dtype.Free()
        self.types = []
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


class ShardedOptimizer:
    """A torch optimizer over the parameters this rank owns, with the full optimizer's interface and state layout.

    Args:
        full: the optimizer over every parameter, as ``build_optimizer`` made it (holds no state yet); an
            optimizer of its class over the owned parameters replaces it.
        plan: the owners (by index in ``params``).
        params: the model's trainable parameters, in model order (``plan``'s indices).
        comm: the ranks' communicator.
        stage: 1 or 2 (2: the gradients of parameters owned elsewhere are None here).
    """

    def __init__(self, full: torch.optim.Optimizer, plan: ShardPlan, params: list[nn.Parameter], comm: Any,
                 stage: int) -> None:
        if full.state:
            raise ValueError("a sharded optimizer starts from an optimizer without state")
        self.plan, self.stage, self.comm = plan, stage, comm
        self.rank = comm.Get_rank()
        self.params = params
        index_of = {id(p): i for i, p in enumerate(params)}
        # The full optimizer's order of parameters (its state_dict indices): group by group.
        self.full_order: list[int] = []
        self.group_sizes: list[int] = []
        groups = []
        for group in full.param_groups:
            members = [index_of[id(p)] for p in group["params"]]
            self.full_order.extend(members)
            self.group_sizes.append(len(members))
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [params[i] for i in members if plan.owner[i] == self.rank]})
        self.owned_full = [k for k, i in enumerate(self.full_order) if plan.owner[i] == self.rank]
        """Full-optimizer indices of the owned parameters, in the inner optimizer's order."""
        accepted = inspect.signature(type(full).__init__).parameters
        self._options = {k: v for k, v in full.defaults.items() if k in accepted}
        self.inner = type(full)(groups, **self._options)
        self.gather = ParamGather(params, plan.owner, comm)
        self._norm_order = _norm_order(params)
        self.clock: Any = None  # the loop's PhaseClock: the update is 'optimizer', the broadcast 'comm'

    # -- the optimizer interface the loop uses --------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @property
    def state(self) -> Any:
        return self.inner.state

    def step(self) -> None:
        """Update the owned parameters, then all-gather every parameter from its owner (collective)."""
        self.inner.step()
        if self.clock is not None:
            self.clock.mark("optimizer")
        self.gather.run()
        if self.clock is not None:
            self.clock.mark("comm")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    # -- state in the full optimizer's layout -------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The owned state under the full optimizer's indices; every group lists every index."""
        inner = self.inner.state_dict()
        state = {self.owned_full[local]: value for local, value in inner["state"].items()}
        groups, start = [], 0
        for group, n in zip(inner["param_groups"], self.group_sizes):
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, full_state: dict[str, Any]) -> None:
        """Keep the owned entries of a full optimizer state dict (any world size or ``dist.zero`` saved it)."""
        groups = full_state["param_groups"]
        if [len(g["params"]) for g in groups] != self.group_sizes:
            raise ValueError(f"param groups of {[len(g['params']) for g in groups]} parameters, the optimizer "
                             f"has {self.group_sizes}")
        state = full_state["state"]
        local_state = {local: state[k] for local, k in enumerate(self.owned_full) if k in state}
        owned = set(self.owned_full)
        local_groups, local = [], 0
        for group in groups:
            mine = [k for k in group["params"] if k in owned]
            local_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": list(range(local, local + len(mine)))})
            local += len(mine)
        self.inner.load_state_dict({"state": local_state, "param_groups": local_groups})

    def reshard(self, plan: ShardPlan) -> int:
        """Move to new owners between steps (collective): each parameter's state goes from its old owner to its
        new one, and an optimizer over the newly owned parameters takes over with the same hyperparameters.

        The moved state travels as pickled CPU tensors (``alltoall``): a re-plan is rare, and every rank
        learns what it receives without a size exchange. Returns the bytes this rank sent.
        """
        full = self.state_dict()
        outgoing: list[dict[int, Any]] = [{} for _ in range(self.comm.Get_size())]
        kept: dict[int, Any] = {}
        sent = 0
        for k, values in full["state"].items():
            new_owner = plan.owner[self.full_order[k]]
            if new_owner == self.rank:
                kept[k] = values
                continue
            outgoing[new_owner][k] = {key: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                                      for key, v in values.items()}
            sent += sum(v.numel() * v.element_size() for v in values.values() if isinstance(v, torch.Tensor))
        for part in self.comm.alltoall(outgoing):
            kept.update(part)
        groups, start = [], 0
        for group, n in zip(self.inner.param_groups, self.group_sizes):
            members = self.full_order[start:start + n]
            start += n
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": [self.params[i] for i in members if plan.owner[i] == self.rank]})
        self.plan = plan
        self.owned_full = [k for k, i in enumerate(self.full_order) if plan.owner[i] == self.rank]
        self.inner = type(self.inner)(groups, **self._options)
        self.load_state_dict({"state": kept, "param_groups": full["param_groups"]})
        self.gather.close()
        self.gather = ParamGather(self.params, plan.owner, self.comm)
        return sent

    def state_owners(self) -> dict[int, int]:
        """Full-optimizer index -> owner rank."""
        return {k: self.plan.owner[i] for k, i in enumerate(self.full_order)}

    def gather_state_specs(self) -> dict[int, dict[str, Any]]:
        """Every rank's owned state, described (collective): index -> key -> ('tensor', dtype, shape) or a value.

        A checkpoint names every tensor on every rank; this is how a rank learns the shapes of state it does
        not hold.
        """
        mine: dict[int, dict[str, Any]] = {}
        for k, values in self.state_dict()["state"].items():
            mine[k] = {key: (("tensor", str(v.dtype).removeprefix("torch."), tuple(v.shape))
                             if isinstance(v, torch.Tensor) else ("value", v)) for key, v in values.items()}
        every: dict[int, dict[str, Any]] = {}
        for part in self.comm.allgather(mine):
            every.update(part)
        return dict(sorted(every.items()))

    # -- gradient norm and clipping with sharded gradients -----------------------------
    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of every parameter's averaged gradient, as ``torch.nn.utils.get_total_norm`` computes it
        over the full model (collective at stage 2: one float a parameter is gathered, then every rank
        reduces the same vector in the same order, so the bits equal stage 0's)."""
        if self.stage < 2:
            return nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        from mpi4py import MPI

        n = len(self.params)
        mine = [i for i in range(n) if self.plan.owner[i] == self.rank and self.params[i].grad is not None]
        # [norms | present flags]: one owner a slot, so the sum adds zeros to each: exact, in one exchange.
        slots = np.zeros(2 * n, dtype=np.float64)
        if mine:
            for i, norm in zip(mine, torch._foreach_norm([self.params[i].grad for i in mine], 2.0)):
                slots[i], slots[n + i] = float(norm), 1.0  # a float32 norm is exact in float64
        self.comm.Allreduce(MPI.IN_PLACE, slots, op=MPI.SUM)
        norms, present = slots[:n], slots[n:]
        device = self.params[0].device
        picked = [i for i in self._norm_order if present[i]]
        if not picked:
            return torch.tensor(0.0)
        dtypes = {i: self.params[i].dtype for i in picked}
        vector = torch.stack([torch.tensor(norms[i], dtype=dtypes[i]) for i in picked]).to(device)
        return torch.linalg.vector_norm(vector, 2.0)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter, with gradients sharded (collective at stage 2)."""
        total = self.grad_norm()
        grads = [p for p in self.params if p.grad is not None]
        if grads:
            nn.utils.clip_grads_with_norm_(grads, max_norm, total)
        return total

    def close(self) -> None:
        self.gather.close()


def _norm_order(params: list[nn.Parameter]) -> list[int]:
    """The order in which ``get_total_norm`` stacks per-parameter norms: grouped by (device, dtype) in order of
    first appearance, parameter order inside a group."""
    keys: dict[tuple[Any, Any], int] = {}
    for p in params:
        keys.setdefault((p.device, p.dtype), len(keys))
    return sorted(range(len(params)), key=lambda i: (keys[(params[i].device, params[i].dtype)], i))
