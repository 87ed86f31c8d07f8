"""ZeRO-style sharded data parallelism (``dist.zero``): each parameter's optimizer state, and at stage 2 its
averaged gradient, lives on one owner rank only (docs/memory.md).

- **What is owned** (``ShardLayout``): the units of ownership are the trainable parameters, except that a
  parameter larger than a quarter of a rank's even share is cut into row ranges (``split_units``), so one huge
  matrix is spread over several owners as a flat buffer would be; every unit is a contiguous range of memory.
- **Who owns what** (``plan_shards``): every unit gets one owner rank from the cost model
  (``hpcnet.comm.costmodel.assign_shards``): ``dist.plan=uniform`` balances bytes over ranks taken as
  equally fast; ``auto`` also weighs each rank's measured speed (a timed matmul at start-up, the slowest
  rank's median, so ranks of unequal speed own less) and the measured link. Every rank computes the same plan
  from the same gathered inputs; rank 0 writes it to ``plan.json``.
- **Stage 1**: gradients are all-reduced as at stage 0; each rank's optimizer holds and updates only the
  units it owns (``ShardedOptimizer``; a row range of a parameter is a tensor viewing those rows), then every
  unit is broadcast from its owner in place (``ParamGather``: one ``MPI_Bcast`` per owner).
- **Stage 2**: the reducer reduce-scatters each bucket so each rank receives only the sums it owns
  (``Reducer(owners=...)``, which then places the sums with ``Sharded``); the buckets are dropped after the
  step, so between steps a rank holds 1/N of the gradients, and from the next step's start until its buckets
  go out not even those. The global gradient norm for clipping is gathered as one float per unit.

In a checkpoint (``checkpoint_state``) a sharded optimizer's state has the unsharded optimizer's names
(``optim/<index>/<key>``, the index in the full optimizer's order), except that the row-shaped state of a cut
parameter is saved piece by piece, ``optim/<index>/<key>:<lo>-<hi>`` (rows lo to hi), each piece by its owner:
nothing is gathered.  ``load_state_dict`` takes the unsharded optimizer's state, pieces of any cut or whole
tensors, and keeps the rows this rank owns, so checkpoints move between ``dist.zero`` settings and world sizes.
"""

import inspect
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.ckpt.schema import ROW_PIECE
from hpcnet.comm.buckets import Bucket, dense, grad_view
from hpcnet.comm.costmodel import LinkCost, ShardPlan, assign_shards, measured_speeds
from hpcnet.comm.exchange import exchange, pieces
from hpcnet.comm.transport import Transport

UPDATE_S_PER_BYTE = 1.0 / 2e9
"""Modelled optimizer update time per parameter byte on the fastest rank: an elementwise update reads and writes
a few tensors of the parameter's size at a few GB/s; only the ratio to the link cost matters to the plan."""
SPEED_PROBE_ROUNDS = 5
DEFAULT_LINK = LinkCost(latency_s=10e-6, bandwidth_Bps=5e9)
"""The link the plan assumes without a probe (dist.probe=false)."""
UNITS_PER_RANK = 4
"""A parameter larger than 1/UNITS_PER_RANK of a rank's even share of the parameter bytes is cut into row ranges
no larger than that: with equal speeds the greedy plan then gives no rank more than about (1 + 1/UNITS_PER_RANK)
times the even share, however the bytes are spread over the parameters, while a model of many ordinary layers
keeps its parameters whole (one optimizer tensor each)."""
MIN_UNIT_BYTES = 4096
"""No parameter is cut into pieces smaller than this."""
PIECE = ROW_PIECE
"""A checkpoint's name for rows lo to hi of a cut parameter's state: ``optim/<index>/<key>:<lo>-<hi>``."""


@dataclass(frozen=True, slots=True)
class Unit:
    """What one owner owns: rows ``lo`` to ``hi`` of parameter ``param``, which has ``rows`` rows (dim 0)."""

    param: int
    lo: int
    hi: int
    rows: int

    @property
    def whole(self) -> bool:
        return self.lo == 0 and self.hi == self.rows


def split_units(params: list[torch.Tensor], world_size: int, *, per_rank: int = UNITS_PER_RANK,
                min_bytes: int = MIN_UNIT_BYTES) -> list[Unit]:
    """The units of ownership of ``params`` at ``world_size`` ranks, in parameter order (pure, deterministic).

    A parameter of more than ``max(min_bytes, total bytes / (world_size * per_rank))`` bytes with at least two
    rows, contiguous in memory, is cut along dim 0 into that many near-equal row ranges as keep each under the
    cap; every other parameter is one unit.  One rank: no cuts.
    """
    sizes = [p.numel() * p.element_size() for p in params]
    cap = max(min_bytes, sum(sizes) // max(1, world_size * per_rank))
    units: list[Unit] = []
    for i, (p, size) in enumerate(zip(params, sizes)):
        rows = p.shape[0] if p.dim() else 1
        if world_size > 1 and size > cap and rows >= 2 and p.is_contiguous():
            m = min(rows, -(-size // cap))
            cuts = [r * rows // m for r in range(m + 1)]
            units.extend(Unit(i, cuts[r], cuts[r + 1], rows) for r in range(m))
        else:
            units.append(Unit(i, 0, rows, rows))
    return units


class ShardLayout:
    """The units of ownership of a model's trainable ``params`` (``split_units``) and the tensor each unit is
    updated through: the parameter itself when whole, else a leaf tensor viewing its rows (same memory, so an
    update of the view is an update of the parameter, and a broadcast into it fills those rows)."""

    def __init__(self, params: list[nn.Parameter], world_size: int, units: list[Unit] | None = None) -> None:
        self.params = params
        self.units = split_units(params, world_size) if units is None else units
        self.tensors: list[torch.Tensor] = [
            params[u.param] if u.whole else nn.Parameter(params[u.param].detach()[u.lo:u.hi])
            for u in self.units]
        self.sizes = [t.numel() * t.element_size() for t in self.tensors]
        self.of_param: list[list[int]] = [[] for _ in params]
        for k, u in enumerate(self.units):
            self.of_param[u.param].append(k)

    def is_split(self, param: int) -> bool:
        return len(self.of_param[param]) > 1

    def to_json(self) -> list[list[int]]:
        """[param, lo, hi] per unit (a checkpoint's meta and plan.json)."""
        return [[u.param, u.lo, u.hi] for u in self.units]

    def label(self, k: int, names: list[str]) -> str:
        """Unit ``k`` by name: the parameter's, with its rows when cut."""
        u = self.units[k]
        return names[u.param] if u.whole else f"{names[u.param]}[{u.lo}:{u.hi}]"


def measure_speed(rounds: int = SPEED_PROBE_ROUNDS, size: int = 192, device: torch.device | None = None) -> float:
    """Seconds for one ``size``-square float32 matmul on ``device`` (default this rank's CPU), median of
    ``rounds`` (milliseconds on a CPU; on a GPU each timed matmul is synchronised, so call it at a boundary)."""
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


def plan_shards(params: list[torch.Tensor], comm: Any, *, mode: str, link: LinkCost | None = None,
                speeds: list[float] | None = None, device: torch.device | None = None
                ) -> tuple[ShardPlan, list[float]]:
    """Owner ranks for the units ``params`` (a ``ShardLayout``'s tensors, or whole parameters) (collective when
    ``mode='auto'`` and ``speeds`` is None: gathers speeds).

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
    their own addresses (``hindexed`` from ``MPI_BOTTOM``, a parameter of 2 GiB or more in blocks below MPI's
    int limit), so nothing is staged through a buffer of the parameters' size: a full-size staging buffer would
    cost as much memory as the optimizer state stage 1 saves.
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
                if not p.is_contiguous() and not dense(p):
                    raise ValueError("a sharded parameter must be dense in memory")
            # A block length is a C int: a tensor of 2 GiB or more is listed in pieces.
            blocks = [(p.data_ptr() + lo, hi - lo) for p in mine for lo, hi in pieces(p.numel() * p.element_size())]
            dtype = MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit()
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
    """A torch optimizer over the units this rank owns, with the full optimizer's interface.

    Args:
        full: the optimizer over every parameter, as ``build_optimizer`` made it (holds no state yet); an
            optimizer of its class over the owned units' tensors replaces it.  Its update must be elementwise
            (SGD, Adam, AdamW, ...): a cut parameter's rows are updated apart.
        plan: the owners (by unit index in ``layout``).
        layout: the model's trainable parameters, in model order, and their units.
        comm: the ranks' communicator.
        stage: 1, 2 or 3 (2: the gradients of units owned elsewhere are None here, those of owned cut units are
            on the units' tensors; 3: every unit has a tensor of its own (``hpcnet.comm.zero3``), its gradient is
            there, and nothing is broadcast after the update: the next forward gathers the parameters).
    """

    def __init__(self, full: torch.optim.Optimizer, plan: ShardPlan, layout: ShardLayout, comm: Any,
                 stage: int) -> None:
        if full.state:
            raise ValueError("a sharded optimizer starts from an optimizer without state")
        if len(plan.owner) != len(layout.units):
            raise ValueError(f"the plan names {len(plan.owner)} units, the layout has {len(layout.units)}")
        self.stage, self.comm, self.layout = stage, comm, layout
        self.rank = comm.Get_rank()
        self.params = layout.params
        index_of = {id(p): i for i, p in enumerate(self.params)}
        # The full optimizer's order of parameters (its state_dict indices): group by group.
        self.full_order: list[int] = []
        self.group_sizes: list[int] = []
        self._hyper: list[dict[str, Any]] = []
        for group in full.param_groups:
            members = [index_of[id(p)] for p in group["params"]]
            self.full_order.extend(members)
            self.group_sizes.append(len(members))
            self._hyper.append({k: v for k, v in group.items() if k != "params"})
        self.full_index = {i: k for k, i in enumerate(self.full_order)}
        accepted = inspect.signature(type(full).__init__).parameters
        self._options = {k: v for k, v in full.defaults.items() if k in accepted}
        self._cls = type(full)
        self.norm_order = norm_order(self.params)
        self.clock: Any = None  # the loop's PhaseClock: the update is 'optimizer', the broadcast 'comm'
        self.gather: ParamGather | None = None
        self._take(plan, self._hyper)

    def _take(self, plan: ShardPlan, hyper: list[dict[str, Any]]) -> None:
        """Own ``plan``'s units: a fresh inner optimizer over them (no state) and the broadcast that goes with it."""
        self.plan = plan
        owner, of_param = plan.owner, self.layout.of_param
        groups = []
        self.owned: list[int] = []  # the owned units, in the inner optimizer's order
        start = 0
        for n, group_hyper in zip(self.group_sizes, hyper):
            members = self.full_order[start:start + n]
            start += n
            mine = [u for i in members for u in of_param[i] if owner[u] == self.rank]
            self.owned.extend(mine)
            groups.append({**group_hyper, "params": [self.layout.tensors[u] for u in mine]})
        # The owned units whose gradient is on the unit's tensor, not its parameter's .grad.
        self._own_grads = [u for u in self.owned if self.stage == 3 or not self.layout.units[u].whole]
        self.inner = self._cls(groups, **self._options)
        if self.gather is not None:
            self.gather.close()
        self.gather = ParamGather(self.layout.tensors, owner, self.comm) if self.stage < 3 else None

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
        """Update the owned units, then all-gather every unit from its owner (collective)."""
        if self.stage < 2:  # every rank has every gradient: a cut unit's is rows of its parameter's
            for k in self._own_grads:
                u = self.layout.units[k]
                grad = self.params[u.param].grad
                self.layout.tensors[k].grad = None if grad is None else grad[u.lo:u.hi]
        self.inner.step()
        if self.clock is not None:
            self.clock.mark("optimizer")
        if self.gather is not None:
            self.gather.run()
            if self.clock is not None:
                self.clock.mark("comm")

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for k in self._own_grads:
            self.layout.tensors[k].grad = None

    # -- state --------------------------------------------------------------------------
    def unit_state(self) -> dict[int, dict[str, Any]]:
        """The owned state by unit index (the inner optimizer's tensors, not copied)."""
        inner = self.inner.state_dict()["state"]
        return {self.owned[local]: values for local, values in inner.items()}

    def full_param_groups(self) -> list[dict[str, Any]]:
        """The param groups in the full optimizer's layout: hyperparameters, and every index of every group."""
        groups, start = [], 0
        for group, n in zip(self.inner.param_groups, self.group_sizes):
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        return groups

    def _names(self, k: int, values: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Unit ``k``'s state under checkpoint names, and its non-tensor values (those of a cut parameter's first
        unit only; so is a tensor not shaped like the rows, Adam's step count: the units share it)."""
        u = self.layout.units[k]
        index = self.full_index[u.param]
        shape = tuple(self.layout.tensors[k].shape)
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and not u.whole and tuple(value.shape) == shape:
                tensors[f"optim/{index}/{key}:{u.lo}-{u.hi}"] = value
            elif u.lo == 0:
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{index}/{key}"] = value
                else:
                    scalars[key] = value
        return tensors, scalars

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]], dict[str, int]]:
        """Every rank's state under checkpoint names (collective; see the module's doc): this rank's tensors, the
        others' as ``meta``-device tensors of their shape and dtype (no memory); the non-tensor values by full
        index; and who holds each name.  The same names in the same order on every rank."""
        mine: dict[str, torch.Tensor] = {}
        mine_scalars: dict[str, dict[str, Any]] = {}
        for k, values in self.unit_state().items():
            tensors, scalars = self._names(k, values)
            mine.update(tensors)
            if scalars:
                mine_scalars[str(self.full_index[self.layout.units[k].param])] = scalars
        described = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in mine.items()}
        found: dict[str, tuple[int, str, tuple[int, ...]]] = {}
        scalars_all: dict[str, dict[str, Any]] = {}
        for rank, (names, scalars) in enumerate(self.comm.allgather((described, mine_scalars))):
            for name, (dtype, shape) in names.items():
                found[name] = (rank, dtype, shape)
            for index, values in scalars.items():
                scalars_all.setdefault(index, {}).update(values)
        tensors: dict[str, torch.Tensor] = {}
        holders: dict[str, int] = {}
        for name in sorted(found, key=_name_order):
            rank, dtype, shape = found[name]
            tensors[name] = (mine[name] if rank == self.rank
                             else torch.empty(shape, dtype=getattr(torch, dtype), device="meta"))
            holders[name] = rank
        return tensors, dict(sorted(scalars_all.items(), key=lambda kv: int(kv[0]))), holders

    def wants(self, name: str) -> bool:
        """Whether a checkpoint tensor named ``name`` holds state this rank restores: the state of a parameter it
        owns a unit of, and of a cut one only the pieces that overlap its rows (any checkpoint's cuts)."""
        parts = name.split("/", 2)
        if len(parts) != 3 or parts[0] != "optim" or not parts[1].isdigit():
            return True
        full = int(parts[1])
        if full >= len(self.full_order):
            return True  # not this optimizer's: the restore names the mismatch
        piece = PIECE.match(parts[2])
        for k in self.layout.of_param[self.full_order[full]]:
            if self.plan.owner[k] != self.rank:
                continue
            u = self.layout.units[k]
            if piece is None or (int(piece["lo"]) < u.hi and u.lo < int(piece["hi"])):
                return True
        return False

    def load_state_dict(self, full_state: dict[str, Any]) -> None:
        """Take the owned units' state from a full optimizer state dict (any world size or ``dist.zero`` saved it):
        state by full index, where a tensor may also come in row pieces (``"exp_avg:0-512"``); only the pieces
        that hold the owned rows need be there."""
        groups = full_state["param_groups"]
        if [len(g["params"]) for g in groups] != self.group_sizes:
            raise ValueError(f"param groups of {[len(g['params']) for g in groups]} parameters, the optimizer "
                             f"has {self.group_sizes}")
        state = full_state["state"]
        local_state: dict[int, dict[str, Any]] = {}
        for local, k in enumerate(self.owned):
            u = self.layout.units[k]
            values = state.get(self.full_index[u.param])
            if values is not None:
                local_state[local] = _unit_values(values, u, f"optimizer state {self.full_index[u.param]}")
        hyper = [{key: v for key, v in group.items() if key != "params"} for group in groups]
        self.inner.load_state_dict({"state": local_state, "param_groups": self._local_groups(hyper)})

    def _local_groups(self, hyper: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The inner optimizer's param groups for a state dict: ``hyper`` with the local indices of each group's
        owned units (``_take`` lists them group by group)."""
        out, local = [], 0
        for g, group in enumerate(hyper):
            start = sum(self.group_sizes[:g])
            units = {u for i in self.full_order[start:start + self.group_sizes[g]] for u in self.layout.of_param[i]}
            count = sum(1 for k in self.owned if k in units)
            out.append({**group, "params": list(range(local, local + count))})
            local += count
        return out

    def reshard(self, plan: ShardPlan) -> int:
        """Move to new owners between steps (collective): each unit's state goes from its old owner to its new
        one, and an optimizer over the newly owned units takes over with the same hyperparameters.

        The moved state travels as raw bytes, in messages below MPI's count limit, after a small pickled
        description (``hpcnet.comm.exchange``): the state of a large model may exceed 2 GiB per rank, and
        arrives bit for bit as it left.  Returns the bytes this rank sent.
        """
        current = self.unit_state()
        outgoing: list[dict[int, Any]] = [{} for _ in range(self.comm.Get_size())]
        kept: dict[int, Any] = {}
        sent = 0
        for k, values in current.items():
            if plan.owner[k] == self.rank:
                kept[k] = values
                continue
            outgoing[plan.owner[k]][k] = values
            sent += sum(v.numel() * v.element_size() for v in values.values() if isinstance(v, torch.Tensor))
        kept.update(exchange(self.comm, outgoing))
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.inner.param_groups]
        self._take(plan, hyper)
        self.inner.load_state_dict({"state": {local: kept[k] for local, k in enumerate(self.owned) if k in kept},
                                    "param_groups": self._local_groups(hyper)})
        return sent

    # -- gradient norm and clipping with sharded gradients -----------------------------
    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of every parameter's averaged gradient (``unit_grad_norm``; collective at stage 2: one float
        a unit is gathered, then every rank combines the same vector in the same order, so the bits equal those
        of stage 0 and 1, which take the same norms of the same rows)."""
        if self.stage < 2:
            return unit_grad_norm(self.params, self.layout.units, self.norm_order)
        from mpi4py import MPI

        tensors = self.layout.tensors
        n = len(tensors)
        # [norms | present flags]: one owner a slot, so the sum adds zeros to each: exact, in one exchange.
        slots = np.zeros(2 * n, dtype=np.float64)
        _unit_norms({k: tensors[k].grad for k in self.owned if tensors[k].grad is not None}, slots)
        self.comm.Allreduce(MPI.IN_PLACE, slots, op=MPI.SUM)
        return _combine(slots, self.layout.units, self.norm_order, self.params)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every parameter, with gradients sharded (collective at stage 2)."""
        total = self.grad_norm()
        if self.stage < 2:
            grads = [p for p in self.params if p.grad is not None]
        else:
            grads = [self.layout.tensors[k] for k in self.owned if self.layout.tensors[k].grad is not None]
        if grads:
            nn.utils.clip_grads_with_norm_(grads, max_norm, total)
        return total

    def close(self) -> None:
        if self.gather is not None:
            self.gather.close()


@dataclass(eq=False)
class BucketShard:
    """Stage 2's state of one reducer bucket (``Bucket.shard``)."""

    grouped: bool  # laid out owner by owner (reduce-scatter), else in dist.zero=0's order
    counts: list[int] = field(default_factory=list)  # elements each rank owns, in rank order
    owner_of: list[int] = field(default_factory=list)  # each entry's owner rank
    owned: torch.Tensor | None = None  # this rank's sums, from its collective to the next zero_grad
    owned_views: list[torch.Tensor | None] = field(default_factory=list)  # its entries' gradients in ``owned``
    scattered: bool = False  # the transport reduce-scattered into ``owned``


class Sharded:
    """Stage 2's placement of the reducer's sums (``hpcnet.comm.buckets.Placement``): each bucket is laid out
    owner by owner and reduce-scattered (or all-reduced, where the transport has no reduce-scatter, and its owned
    part kept); after the reducer's ``finish`` a unit's tensor has a ``.grad`` on its owner only, and the
    buckets are dropped until the next backward (unless they live in the transport's memory, shm's window), so
    between steps a rank holds its own sums only; and those are dropped by the next ``zero_grad`` and made again
    bucket by bucket as the sums go out.

    Args:
        owners: the owner rank of each unit (``units``; without them, of each trainable parameter).
        units: the units of ownership and their tensors (``ShardLayout``), or None: every parameter whole.
        n_params: the number of trainable parameters.
        rank: this rank.
        world_size: the number of ranks.
    """

    def __init__(self, owners: list[int], units: ShardLayout | None, *, n_params: int, rank: int,
                 world_size: int) -> None:
        self.units = units
        self.n_units = n_params if units is None else len(units.units)
        self.rank, self.world_size = rank, world_size
        self.set_owners(owners)

    def set_owners(self, owners: list[int]) -> None:
        if len(owners) != self.n_units:
            raise ValueError(f"owners names {len(owners)} units, the model has {self.n_units}")
        self.owners = owners

    def set_transport(self, transport: Transport) -> None:
        self.transport = transport
        self.reduce_scatter = getattr(transport, "start_reduce_scatter", None)
        # Buckets outside the transport's memory (not shm's window) are dropped between steps.
        self.drops_buckets = self.releases_early = self.adopts = getattr(transport, "allocate", None) is None

    def entries(self, i: int, p: nn.Parameter) -> list[tuple[int, torch.Tensor, tuple[int, int] | None]]:
        if self.units is None:
            return [(i, p, None)]
        units = self.units
        return [(k, units.tensors[k], None if units.units[k].whole else (units.units[k].lo, units.units[k].hi))
                for k in units.of_param[i]]

    def order(self, entries: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        if self.reduce_scatter is None:
            # An all-reduce sums each element in an order that depends on its place in the bucket: the layout
            # stays dist.zero=0's, and the same place gives the same bits.
            return entries
        # Owner by owner, so each rank's sums are one contiguous piece to reduce-scatter.
        return sorted(entries, key=lambda entry: self.owners[entry[1]])

    def attach(self, bucket: Bucket) -> None:
        bucket.shard = BucketShard(grouped=self.reduce_scatter is not None)  # as ``order`` laid it out
        self.assign(bucket)

    def assign(self, bucket: Bucket) -> None:
        shard = bucket.shard
        shard.owner_of = [self.owners[k] for k in bucket.entry_unit]
        shard.counts = [0] * self.world_size
        for t, owner in zip(bucket.entry_tensor, shard.owner_of):
            shard.counts[owner] += t.numel()
        shard.owned, shard.owned_views = None, []  # made when its collective starts (_ensure_owned)

    def start(self, bucket: Bucket, wire: torch.Tensor | None) -> Any:
        shard = bucket.shard
        shard.scattered = wire is None and shard.grouped and self.reduce_scatter is not None
        if shard.scattered:
            self._ensure_owned(bucket)
            return self.reduce_scatter(bucket.buffer, shard.counts, shard.owned)
        return self.transport.start(bucket.buffer if wire is None else wire, bucket.index)

    def release(self, bucket: Bucket) -> None:
        """The owned gradients kept in ``owned``, the others None; a dropped bucket's buffer freed."""
        shard = bucket.shard
        self._ensure_owned(bucket)
        if shard.grouped and not shard.scattered:  # all-reduced (a compressed wire): one piece to keep
            lo = sum(shard.counts[:self.rank])
            shard.owned.copy_(bucket.buffer[lo:lo + shard.counts[self.rank]])
        for e, (t, view) in enumerate(zip(bucket.entry_tensor, shard.owned_views)):
            if view is not None and not shard.grouped:
                view.copy_(bucket.views[e])
            t.grad = view
        if self.drops_buckets:
            bucket.buffer = bucket.buffer.new_empty(0)
            bucket.views = []

    def zero_grad(self, bucket: Bucket) -> None:
        bucket.shard.owned, bucket.shard.owned_views = None, []

    def tensors(self, bucket: Bucket) -> list[torch.Tensor]:
        owned = bucket.shard.owned
        return [bucket.buffer] if owned is None else [bucket.buffer, owned]

    def _ensure_owned(self, bucket: Bucket) -> None:
        """This rank's sums of the bucket, its parameters' in bucket order, and their gradient views, made when
        the bucket's collective starts.  ``zero_grad`` drops them, so during the next forward and the early
        backward, when the activations are all alive, the last step's gradient shard is not: its peak is lower
        by up to the shard."""
        shard = bucket.shard
        if shard.owned is not None:
            return
        like = bucket.params[0]
        shard.owned = torch.empty(shard.counts[self.rank], dtype=like.dtype, device=like.device)
        shard.owned_views = []
        at = 0
        for e, t in enumerate(bucket.entry_tensor):
            if shard.owner_of[e] != self.rank:
                shard.owned_views.append(None)
                continue
            shard.owned_views.append(grad_view(shard.owned[at:at + t.numel()], t))
            at += t.numel()


@torch.no_grad()
def unit_grad_norm(params: list[torch.Tensor], units: list[Unit], order: list[int]) -> torch.Tensor:
    """The 2-norm of ``params``' gradients taken unit by unit, as ``dist.zero=2`` takes it from the owners'
    pieces: each unit's norm (``torch._foreach_norm``), then the norm of those, stacked by (device, dtype) group
    in parameter order (``order``: ``norm_order``) as ``torch.nn.utils.get_total_norm`` stacks per-parameter
    norms.  Without cut parameters it is ``get_total_norm``'s result, bit for bit; with them, equal to rounding.
    On the device, with no copy to the host (stage 2's trip through float64 is exact both ways, so the bits
    agree)."""
    grads: dict[int, torch.Tensor] = {}
    for k, u in enumerate(units):
        grad = params[u.param].grad
        if grad is not None:
            grads[k] = grad if u.whole else grad[u.lo:u.hi]
    if not grads:
        return torch.tensor(0.0)
    norms: dict[int, torch.Tensor] = {}
    for members in _by_device_and_dtype(grads).values():
        norms.update(zip(members, torch._foreach_norm([grads[k] for k in members], 2.0)))
    device = params[0].device
    vector = torch.stack([norms[k].to(device) for k in _stacking_order(units, order, norms)])
    return torch.linalg.vector_norm(vector, 2.0)


def _by_device_and_dtype(grads: dict[int, torch.Tensor]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for k, grad in grads.items():
        groups.setdefault((grad.device, grad.dtype), []).append(k)
    return groups


def _stacking_order(units: list[Unit], order: list[int], present: Any) -> list[int]:
    """The units with a norm (``k in present``), by parameter in ``order``, rows in order within one."""
    of_param: dict[int, list[int]] = {}
    for k, u in enumerate(units):
        of_param.setdefault(u.param, []).append(k)
    return [k for i in order for k in of_param.get(i, []) if k in present]


def _unit_norms(grads: dict[int, torch.Tensor], slots: np.ndarray) -> None:
    """Write each unit's gradient norm and a present flag into ``slots`` ([norms | flags], one each a unit)."""
    n = len(slots) // 2
    for members in _by_device_and_dtype(grads).values():
        norms = torch._foreach_norm([grads[k] for k in members], 2.0)
        # One copy to the host per group; a float32 (or lower) norm is exact in float64.
        values = torch.stack(norms).to(torch.float64).cpu().numpy()
        for k, value in zip(members, values):
            slots[k], slots[n + k] = value, 1.0


def _combine(slots: np.ndarray, units: list[Unit], order: list[int], params: list[torch.Tensor]) -> torch.Tensor:
    """The total norm from per-unit ``slots`` ([norms | flags]), stacked as ``unit_grad_norm`` stacks them."""
    n = len(units)
    norms, present = slots[:n], slots[n:]
    picked = _stacking_order(units, order, {k for k in range(n) if present[k]})
    if not picked:
        return torch.tensor(0.0)
    device = params[0].device
    vector = torch.stack([torch.tensor(norms[k], dtype=params[units[k].param].dtype) for k in picked]).to(device)
    return torch.linalg.vector_norm(vector, 2.0)


def _name_order(name: str) -> tuple[int, int, str]:
    """Checkpoint names of optimizer state by parameter index, then rows, then key."""
    _, index, key = name.split("/", 2)
    piece = PIECE.match(key)
    return (int(index), int(piece["lo"]) if piece else -1, piece["key"] if piece else key)


def _unit_values(values: dict[str, Any], u: Unit, what: str) -> dict[str, Any]:
    """Unit ``u``'s share of one parameter's state: rows of the tensors shaped like the parameter (whole tensors
    or pieces), the rest as it is (copied for a cut unit: each unit updates its own step count)."""
    out: dict[str, Any] = {}
    plain, pieces = split_pieces(values)
    for key, value in plain.items():
        if u.whole or not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != u.rows:
            out[key] = value.clone() if isinstance(value, torch.Tensor) and not u.whole else value
        else:  # a copy: a view would keep the whole tensor alive
            out[key] = value[u.lo:u.hi].clone()
    for key, parts in pieces.items():
        if key in out:
            continue
        out[key] = rows_of(parts, u.lo, u.hi, f"{what} {key}")
    return out


def split_pieces(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[tuple[int, int, Any]]]]:
    """``values`` by name (or state key) into those that are not row pieces, and the pieces of each base name:
    ``"<name>:<lo>-<hi>"`` -> ``{"<name>": [(lo, hi, value), ...]}``."""
    plain: dict[str, Any] = {}
    pieces: dict[str, list[tuple[int, int, Any]]] = {}
    for key, value in values.items():
        piece = PIECE.match(key)
        if piece is None:
            plain[key] = value
        else:
            pieces.setdefault(piece["key"], []).append((int(piece["lo"]), int(piece["hi"]), value))
    return plain, pieces


def rows_of(parts: list[tuple[int, int, torch.Tensor]], lo: int, hi: int, what: str) -> torch.Tensor:
    """Rows ``lo`` to ``hi`` made of row pieces ``(lo, hi, tensor)``; ValueError naming ``what`` when they do not
    cover them."""
    chunks, at = [], lo
    for p_lo, p_hi, tensor in sorted(parts, key=lambda part: part[0]):
        if p_hi <= at or p_lo >= hi:
            continue
        if p_lo > at:
            break
        chunks.append(tensor[at - p_lo:min(hi, p_hi) - p_lo])
        at = min(hi, p_hi)
        if at == hi:
            break
    if at != hi:
        raise ValueError(f"{what}: rows {at} to {hi} are in none of the checkpoint's pieces")
    return chunks[0].clone() if len(chunks) == 1 else torch.cat(chunks)


def norm_order(params: list[nn.Parameter]) -> list[int]:
    """The order in which ``get_total_norm`` stacks per-parameter norms: grouped by (device, dtype) in order of
    first appearance, parameter order inside a group."""
    keys: dict[tuple[Any, Any], int] = {}
    for p in params:
        keys.setdefault((p.device, p.dtype), len(keys))
    return sorted(range(len(params)), key=lambda i: (keys[(params[i].device, params[i].dtype)], i))
