"""The sharded optimizer (``dist.zero`` 1 to 3): each rank's optimizer holds and updates only the units it owns
(``ShardedOptimizer``; a row range of a parameter is a tensor viewing those rows); at stages 1 and 2 every unit is
then broadcast from its owner in place (``ParamGather``: one ``MPI_Bcast`` per owner), at stage 3 the next forward
gathers the parameters.

The gradient norm is taken unit by unit, as stage 2 must take it from the owners' pieces, so that every stage
clips alike, bit for bit (``unit_grad_norm``); at stages 2 and 3 it is gathered as one float a unit.

In a checkpoint (``state_entries``: the optimizer is a part of the run, ``hpcnet.stateful``) a sharded
optimizer's state has the unsharded optimizer's names (``optim/<index>/<key>``, the index in the full optimizer's
order), except that the row-shaped state of a cut parameter is saved piece by piece,
``optim/<index>/<key>:<lo>-<hi>`` (rows lo to hi, ``hpcnet.ckpt.schema``'s row pieces), each piece by its owner:
nothing is gathered.  ``load_state_dict`` takes the unsharded optimizer's
state, pieces of any cut or whole tensors, and keeps the rows this rank owns, so checkpoints move between
``dist.zero`` settings and world sizes.
"""

from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.ckpt.parts import load_optimizer_state, optimizer_entries, state_by_param, unsaveable_state
from hpcnet.ckpt.schema import ROW_PIECE, piece_name, rows_of, split_pieces
from hpcnet.comm.buckets import dense
from hpcnet.comm.costmodel import OwnerAssignment
from hpcnet.comm.exchange import exchange, pieces
from hpcnet.comm.sharding.layout import ShardLayout, Unit
from hpcnet.errors import UsageError
from hpcnet.optim.build import class_is_elementwise, rebuild_optimizer
from hpcnet.stateful import Entries, Saved, Stateful


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


class ShardedOptimizer(Stateful):
    """A torch optimizer over the units this rank owns, with the full optimizer's interface.

    Args:
        full: the optimizer over every parameter, as ``build_optimizer`` made it (holds no state yet); one like
            it over the owned units' tensors (``rebuild_optimizer``) replaces it.
        assignment: the owners (by unit index in ``layout``).
        layout: the model's trainable parameters, in model order, and their units.
        comm: the ranks' communicator.
        stage: 1, 2 or 3 (2: the gradients of units owned elsewhere are None here, those of owned cut units are
            on the units' tensors; 3: every unit has a tensor of its own (``hpcnet.comm.sharding.params``), its
            gradient is there, and nothing is broadcast after the update: the next forward gathers the
            parameters).
        elementwise: whether ``full``'s update is elementwise (``hpcnet.optim.is_elementwise``): only then may
            ``layout`` cut a parameter into row ranges, each updated apart; a cut layout given to any other
            optimizer (Muon, Adafactor) is refused here, as it would silently change what the optimizer computes.
    """

    def __init__(self, full: torch.optim.Optimizer, assignment: OwnerAssignment, layout: ShardLayout, comm: Any,
                 stage: int, *, elementwise: bool) -> None:
        if full.state:
            raise ValueError("a sharded optimizer starts from an optimizer without state")
        if layout.cut and not (elementwise and class_is_elementwise(type(full)) is not False):
            cut = sorted({u.param for u in layout.units if not u.whole})
            raise ValueError(f"{type(full).__name__} is not elementwise: it must own whole parameters, and the layout "
                             f"cuts parameter(s) {cut[:5]} into row ranges")
        if len(assignment.owner) != len(layout.units):
            raise ValueError(f"the assignment names {len(assignment.owner)} units, the layout has {len(layout.units)}")
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
        self._full = full  # the template rebuild_optimizer makes the inner optimizer like (no state: no memory)
        self.norm_order = norm_order(self.params)
        self.clock: Any = None  # the loop's PhaseClock: the update is 'optimizer', the broadcast 'comm'
        self.gather: ParamGather | None = None
        self._take(assignment, self._hyper)

    def _take(self, assignment: OwnerAssignment, hyper: list[dict[str, Any]]) -> None:
        """Own ``assignment``'s units: a fresh inner optimizer over them (no state) and the broadcast that goes with
        it."""
        self.assignment = assignment
        owner, of_param = assignment.owner, self.layout.of_param
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
        self.inner = rebuild_optimizer(self._full, groups)
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
                tensors[piece_name(f"optim/{index}/{key}", u.lo, u.hi)] = value
            elif u.lo == 0:
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{index}/{key}"] = value
                else:
                    scalars[key] = value
        return tensors, scalars

    def state_entries(self) -> Entries:
        """Every rank's state under checkpoint names (collective; see the module's doc): this rank's tensors, the
        others' as ``meta``-device tensors of their shape and dtype (no memory), each held by its owner; the
        non-tensor values by full index in the meta, as the unsharded optimizer's.  The same names in the same
        order on every rank."""
        mine: dict[str, torch.Tensor] = {}
        mine_scalars: dict[str, dict[str, Any]] = {}
        owned = self.unit_state()
        problem = unsaveable_state(type(self.inner).__name__,
                                   {self.full_index[self.layout.units[k].param]: v for k, v in owned.items()})
        for k, values in owned.items():
            tensors, scalars = self._names(k, values)
            mine.update(tensors)
            if scalars:
                mine_scalars[str(self.full_index[self.layout.units[k].param])] = scalars
        described = {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in mine.items()}
        found: dict[str, tuple[int, str, tuple[int, ...]]] = {}
        scalars_all: dict[str, dict[str, Any]] = {}
        gathered = self.comm.allgather((described, mine_scalars, problem))
        problems = [p for _, _, p in gathered if p]
        if problems:  # an owner's alone: every rank raises it
            raise UsageError(problems[0])
        for rank, (names, scalars, _) in enumerate(gathered):
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
        return optimizer_entries(type(self.inner).__name__, self.full_param_groups(), tensors,
                                 dict(sorted(scalars_all.items(), key=lambda kv: int(kv[0]))), holders)

    def wants(self, name: str) -> bool | None:
        """Whether this rank reads checkpoint tensor ``name``: the state of a parameter it owns a unit of, and of a
        cut one only the pieces that overlap its rows (any checkpoint's cuts); None when ``name`` is not optimizer
        state."""
        parts = name.split("/", 2)
        if len(parts) != 3 or parts[0] != "optim" or not parts[1].isdigit():
            return None
        full = int(parts[1])
        if full >= len(self.full_order):
            return True  # not this optimizer's: the restore names the mismatch
        piece = ROW_PIECE.match(parts[2])
        return self.layout.owns_rows(self.full_order[full], self.assignment.owner, self.rank,
                                     (int(piece["lo"]), int(piece["hi"])) if piece else None)

    def load_entries(self, saved: Saved) -> None:
        """The owned units' state from a checkpoint of any world size or ``dist.zero`` (``load_state_dict``);
        UsageError where it does not fit."""
        load_optimizer_state(self, state_by_param(saved, type(self.inner).__name__), saved)

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

    def reshard(self, assignment: OwnerAssignment) -> int:
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
            if assignment.owner[k] == self.rank:
                kept[k] = values
                continue
            outgoing[assignment.owner[k]][k] = values
            sent += sum(v.numel() * v.element_size() for v in values.values() if isinstance(v, torch.Tensor))
        kept.update(exchange(self.comm, outgoing))
        hyper = [{k: v for k, v in group.items() if k != "params"} for group in self.inner.param_groups]
        self._take(assignment, hyper)
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
        unit_norms({k: tensors[k].grad for k in self.owned if tensors[k].grad is not None}, slots)
        self.comm.Allreduce(MPI.IN_PLACE, slots, op=MPI.SUM)
        return combine(slots, self.layout.units, self.norm_order, self.params)

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


def _name_order(name: str) -> tuple[int, int, str]:
    """Checkpoint names of optimizer state by parameter index, then rows, then key."""
    _, index, key = name.split("/", 2)
    piece = ROW_PIECE.match(key)
    return (int(index), int(piece["lo"]) if piece else -1, piece["key"] if piece else key)


def _unit_values(values: dict[str, Any], u: Unit, what: str) -> dict[str, Any]:
    """Unit ``u``'s share of one parameter's state: rows of the tensors shaped like the parameter (whole tensors
    or pieces), the rest as it is (copied for a cut unit: each unit updates its own step count)."""
    out: dict[str, Any] = {}
    plain, row_pieces = split_pieces(values)
    for key, value in plain.items():
        if u.whole or not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != u.rows:
            out[key] = value.clone() if isinstance(value, torch.Tensor) and not u.whole else value
        else:  # a copy: a view would keep the whole tensor alive
            out[key] = value[u.lo:u.hi].clone()
    for key, parts in row_pieces.items():
        if key in out:
            continue
        out[key] = rows_of(parts, u.lo, u.hi, f"{what} {key}")
    return out


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


def norm_order(params: list[nn.Parameter]) -> list[int]:
    """The order in which ``get_total_norm`` stacks per-parameter norms: grouped by (device, dtype) in order of
    first appearance, parameter order inside a group."""
    keys: dict[tuple[Any, Any], int] = {}
    for p in params:
        keys.setdefault((p.device, p.dtype), len(keys))
    return sorted(range(len(params)), key=lambda i: (keys[(params[i].device, params[i].dtype)], i))


def unit_norms(grads: dict[int, torch.Tensor], slots: np.ndarray) -> None:
    """Write each unit's gradient norm and a present flag into ``slots`` ([norms | flags], one each a unit)."""
    n = len(slots) // 2
    for members in _by_device_and_dtype(grads).values():
        norms = torch._foreach_norm([grads[k] for k in members], 2.0)
        # One copy to the host per group; a float32 (or lower) norm is exact in float64.
        values = torch.stack(norms).to(torch.float64).cpu().numpy()
        for k, value in zip(members, values):
            slots[k], slots[n + k] = value, 1.0


def combine(slots: np.ndarray, units: list[Unit], order: list[int], params: list[torch.Tensor]) -> torch.Tensor:
    """The total norm from per-unit ``slots`` ([norms | flags]), stacked as ``unit_grad_norm`` stacks them."""
    n = len(units)
    norms, present = slots[:n], slots[n:]
    picked = _stacking_order(units, order, {k for k in range(n) if present[k]})
    if not picked:
        return torch.tensor(0.0)
    device = params[0].device
    vector = torch.stack([torch.tensor(norms[k], dtype=params[units[k].param].dtype) for k in picked]).to(device)
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
