"""``dist.zero=3``: the parameters are sharded too (docs/memory.md).

Each rank keeps, between uses, only the units of the parameters it owns (``hpcnet.comm.zero.ShardLayout``: the
same units and owners as stages 1 and 2, cut rows included), in tensors of their own: the optimizer updates them
and the reducer hands their gradients to them, as at stage 2.  The model's parameters keep their shapes, but
their memory exists only while a *group* that holds them is in use:

- **Groups**: one per block (``model.blocks``, ``hpcnet.models.blocks``: a transformer layer, a ResNet block),
  holding the block's trainable parameters, and the *root* group, holding the rest (embeddings, a final norm, an
  output layer, a parameter shared between blocks).  A group's parameters are views of one flat byte buffer; its
  storage is resized to nothing when the group is released and back when it is gathered, so the views (and the
  tensors autograd saved for backward, which are such views) stay valid across a release.
- **Gather**: on the CPU one ``MPI_Ialltoallw`` a group: each rank sends its owned units from where they are
  (an ``hindexed`` datatype of their addresses) and receives each rank's units straight into their places in the
  flat buffer (a datatype per sending rank), so nothing is staged; elsewhere (CUDA) one
  ``torch.distributed.broadcast`` a unit from its owner, in stream order.
- **When**: the root group before the model's forward, kept until its gradients are in; a block's group before
  the block's forward, with the next block's gather started behind it (prefetch, depth 1), and released after
  the block's forward; gathered again when the gradient of the block's output arrives in backward (before the
  block's backward, or its recomputation under activation checkpointing), with the previous block's gather
  started behind it, and released once the gradient of every parameter of the group has been handed to the
  reducer.  Whatever is still held after a backward is released then (``after_backward``).  Evaluation and any
  forward without gradients release each group after its forward.
- **Gradients**: reduce-scattered bucket by bucket from the backward hooks, exactly as at stage 2
  (``hpcnet.comm.zero.Sharded``): the sums land on the owners' unit tensors.  The optimizer step updates the
  owned units; nothing is broadcast after it: the next forward gathers the new values.

In a checkpoint the parameters keep their names, ``model/<key>``, each saved by the rank that owns it; a parameter
cut into row ranges is saved in row pieces, ``model/<key>:<lo>-<hi>``, each by its owner, as its optimizer state
is (``hpcnet.ckpt.schema.ROW_PIECE``): nothing is gathered to save, and a reader joins the pieces
(``hpcnet.ckpt.state.join_pieces``), so a stage-3 checkpoint resumes at any stage and world size and the others
resume at stage 3.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hpcnet.comm.exchange import pieces
from hpcnet.comm.zero import PIECE, ShardLayout, rows_of, split_pieces

log = logging.getLogger(__name__)

ALIGN = 64
"""Each parameter's place in a group's flat buffer starts at a multiple of this many bytes."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(eq=False)
class Group:
    """One gathering unit: a block's trainable parameters, or the root's."""

    index: int
    name: str
    params: list[int]  # trainable parameter indices, in model order
    offsets: dict[int, int]  # each parameter's byte offset in ``flat``
    nbytes: int
    flat: torch.Tensor  # uint8; its storage is empty while the group is released
    units: list[int] = field(default_factory=list)  # the units of its parameters
    gathered: bool = False
    pending: Any = None  # an in-flight gather (an MPI request, or torch.distributed works)
    arrived: int = 0  # gradients handed over in this backward
    send: Any = None  # (key, datatype): this rank's owned units as one datatype
    recv: Any = None  # (owners, datatypes): each rank's units in ``flat``


class ShardedParams:
    """Stage 3's parameters (see the module's doc).

    Args:
        model: the model (its parameters replicated and equal on every rank, as ``broadcast_module`` left them).
        layout: the units of the trainable parameters (its ``tensors`` are replaced by tensors of their own).
        owner: the owner rank of each unit.
        comm: the ranks' communicator (duplicated: the gathers have their own message space).
        blocks: the model's blocks (``find_blocks``); empty: one group, the whole model.
        device: where the parameters live.
        collective: 'mpi' (CPU parameters) or 'torch' (``torch.distributed`` broadcasts: CUDA, or gloo).
    """

    def __init__(self, model: nn.Module, layout: ShardLayout, owner: list[int], comm: Any,
                 blocks: list[tuple[str, nn.Module]], *, device: torch.device, collective: str = "mpi") -> None:
        if collective not in ("mpi", "torch"):
            raise ValueError(f"collective {collective!r} is not 'mpi' or 'torch'")
        self.model, self.layout, self.owner = model, layout, list(owner)
        self.comm = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device, self.collective = device, collective
        self.params = layout.params
        index_of = {id(p): i for i, p in enumerate(self.params)}
        # Every name a trainable parameter goes by in the state dict (a tied one has several).
        self.keys: dict[str, int] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in index_of:
                self.keys[name] = index_of[id(p)]
        self.groups = self._make_groups(model, blocks, index_of)
        self.group_of = [0] * len(self.params)
        for g in self.groups:
            for i in g.params:
                self.group_of[i] = g.index
        for g in self.groups:
            g.units = [k for i in g.params for k in layout.of_param[i]]
        self._own_units()
        self._bind()
        self._hooks: list[Any] = []
        self._install(model, blocks)

    # -- set-up ---------------------------------------------------------------------
    def _make_groups(self, model: nn.Module, blocks: list[tuple[str, nn.Module]],
                     index_of: dict[int, int]) -> list[Group]:
        """The root group (index 0) and one a block: a parameter belongs to a block when every module that
        registers it is inside that block."""
        holders: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            for p in module._parameters.values():
                if p is not None and id(p) in index_of:
                    holders.setdefault(id(p), []).append(name)
        members: list[list[int]] = [[] for _ in range(len(blocks) + 1)]
        for i, p in enumerate(self.params):
            where = holders.get(id(p), [""])
            home = 0
            for b, (path, _) in enumerate(blocks):
                if all(h == path or h.startswith(path + ".") for h in where):
                    home = b + 1
                    break
            members[home].append(i)
        groups = []
        names = ["root"] + [path for path, _ in blocks]
        for g, (name, params) in enumerate(zip(names, members)):
            offsets, at = {}, 0
            for i in params:
                offsets[i] = at
                at += -(-self.params[i].numel() * self.params[i].element_size() // ALIGN) * ALIGN
            flat = torch.empty(at, dtype=torch.uint8, device=self.device)
            groups.append(Group(g, name, params, offsets, at, flat))
        return groups

    def _own_units(self) -> None:
        """Each unit a tensor of its own (the layout's views of the parameters are replaced): the owner's holds
        the unit's values, the others' have no memory (their shape only: the reducer lays buckets out by it)."""
        tensors = []
        for k, view in enumerate(self.layout.tensors):
            t = nn.Parameter(view.detach().clone(), requires_grad=view.requires_grad)
            if self.owner[k] != self.rank:
                t.data.untyped_storage().resize_(0)
            tensors.append(t)
        self.layout.tensors = tensors

    def _bind(self) -> None:
        """Make each parameter a view of its group's flat buffer, then release every group."""
        with torch.no_grad():
            for g in self.groups:
                for i in g.params:
                    p = self.params[i]
                    nbytes = p.numel() * p.element_size()
                    region = g.flat[g.offsets[i]:g.offsets[i] + nbytes].view(p.dtype)
                    p.data = region.as_strided(p.shape, p.stride()) if p.dim() else region.view(())
                self._release(g)

    def _install(self, model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> None:
        self._hooks.append(model.register_forward_pre_hook(self._root_pre_forward))
        self._hooks.append(model.register_forward_hook(self._root_post_forward))
        for b, (_, module) in enumerate(blocks):
            g = self.groups[b + 1]
            if not g.params:
                continue
            self._hooks.append(module.register_forward_pre_hook(lambda m, a, g=g: self._pre_forward(g)))
            self._hooks.append(module.register_forward_hook(lambda m, a, out, g=g: self._post_forward(g, out)))
        for i, p in enumerate(self.params):
            # Beside the reducer's hook, in either order: the release frees the parameter's memory, never the
            # gradient autograd hands over.
            self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, i=i: self._arrived(i)))

    # -- the hooks ----------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if _in_backward():
            return
        for g in self.groups:
            g.arrived = 0
        self.need(self.groups[0])
        self._prefetch(1)

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        if _in_backward():
            return
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in _tensors(out))):
            self.release_all()  # evaluation: nothing will come back for the parameters

    def _pre_forward(self, g: Group) -> None:
        self.need(g)
        if not _in_backward():
            self._prefetch(g.index + 1)

    def _post_forward(self, g: Group, out: Any) -> None:
        if _in_backward():
            return  # a recomputation inside backward: the backward uses the group next
        outputs = [t for t in _tensors(out) if t.requires_grad]
        if torch.is_grad_enabled() and outputs:
            g.arrived = 0
            for t in outputs:
                t.register_hook(lambda grad, g=g: self._before_backward(g))
        self._release(g)

    def _before_backward(self, g: Group) -> None:
        self.need(g)
        self._prefetch(g.index - 1)

    def _arrived(self, i: int) -> None:
        g = self.groups[self.group_of[i]]
        g.arrived += 1
        if g.arrived >= len(g.params) and g.gathered:
            self._release(g)

    # -- gather and release ----------------------------------------------------------------
    def need(self, g: Group) -> None:
        """Group ``g`` gathered: its gather waited for, or started and waited for (collective)."""
        if g.gathered:
            return
        if g.pending is None:
            self._start(g)
        self._finish(g)

    def _prefetch(self, index: int) -> None:
        if 1 <= index < len(self.groups):
            g = self.groups[index]
            if not g.gathered and g.pending is None and g.params:
                self._start(g)

    def _start(self, g: Group) -> None:
        g.flat.untyped_storage().resize_(g.nbytes)
        if self.size == 1 or not g.params:
            self._copy_own(g)
            g.pending = ()
            return
        if self.collective == "torch":
            g.pending = self._start_torch(g)
            return
        from mpi4py import MPI

        send = self._send_type(g)
        recv = self._recv_types(g)
        counts = [1 if send is not None else 0] * self.size
        recv_counts = [1 if t is not None else 0 for t in recv]
        g.pending = self.comm.Ialltoallw(
            [MPI.BOTTOM, counts, [0] * self.size, [send or MPI.BYTE] * self.size],
            # Not ``flat.numpy()``: a storage once seen by numpy can no longer be resized.
            [MPI.buffer.fromaddress(g.flat.data_ptr(), g.nbytes), recv_counts, [0] * self.size,
             [t or MPI.BYTE for t in recv]])

    def _finish(self, g: Group) -> None:
        pending, g.pending = g.pending, None
        if pending is not None and not isinstance(pending, tuple):
            pending.Wait()
        elif isinstance(pending, tuple):
            for work in pending:
                work.wait()
        g.gathered = True

    def _copy_own(self, g: Group) -> None:
        with torch.no_grad():
            for k in g.units:
                if self.owner[k] == self.rank:
                    self._region(g, k).copy_(self.layout.tensors[k])

    def _region(self, g: Group, k: int) -> torch.Tensor:
        """Unit ``k``'s place in ``g``'s flat buffer, shaped as its tensor."""
        u = self.layout.units[k]
        p = self.params[u.param]
        if u.whole:
            return p.data
        return p.data[u.lo:u.hi]

    def _start_torch(self, g: Group) -> tuple[Any, ...]:
        import torch.distributed as dist

        works = []
        with torch.no_grad():
            for k in g.units:
                region = self._region(g, k)
                if self.owner[k] == self.rank:
                    region.copy_(self.layout.tensors[k])
                works.append(dist.broadcast(region, src=self.owner[k], async_op=True))
        return tuple(works)

    def _send_type(self, g: Group) -> Any:
        """This rank's owned units of ``g`` at their own addresses (None: it owns none); remade when a tensor
        moved (a resume writes into them in place, so they rarely do)."""
        from mpi4py import MPI

        mine = [self.layout.tensors[k] for k in g.units if self.owner[k] == self.rank]
        key = tuple((t.data_ptr(), t.numel() * t.element_size()) for t in mine)
        if g.send is not None and g.send[0] == key:
            return g.send[1]
        if g.send is not None and g.send[1] is not None:
            g.send[1].Free()
        dtype = None
        if mine:
            blocks = [(addr + lo, hi - lo) for addr, n in key for lo, hi in pieces(n)]
            dtype = MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit()
        g.send = (key, dtype)
        return dtype

    def _recv_types(self, g: Group) -> list[Any]:
        """Each rank's units of ``g`` at their places relative to the flat buffer (None: it owns none there)."""
        from mpi4py import MPI

        owners = [self.owner[k] for k in g.units]
        if g.recv is not None and g.recv[0] == owners:
            return g.recv[1]
        if g.recv is not None:
            for t in g.recv[1]:
                if t is not None:
                    t.Free()
        per_rank: list[list[tuple[int, int]]] = [[] for _ in range(self.size)]
        for k in g.units:
            u = self.layout.units[k]
            p = self.params[u.param]
            row = p.numel() * p.element_size() // max(1, u.rows)
            start = g.offsets[u.param] + u.lo * row
            for lo, hi in pieces((u.hi - u.lo) * row):
                per_rank[self.owner[k]].append((start + lo, hi - lo))
        types = [MPI.BYTE.Create_hindexed([n for _, n in blocks], [a for a, _ in blocks]).Commit() if blocks
                 else None for blocks in per_rank]
        g.recv = (owners, types)
        return types

    def _release(self, g: Group) -> None:
        if g.pending is not None:
            self._finish(g)
        g.flat.untyped_storage().resize_(0)
        g.gathered = False

    def release_all(self) -> None:
        for g in self.groups:
            if g.gathered or g.pending is not None:
                self._release(g)

    def after_backward(self) -> None:
        """After a backward: release what is still held (a group some of whose parameters got no gradient, a
        prefetch no block used)."""
        self.release_all()

    def gather_all(self) -> None:
        """Every group gathered (collective): the whole model, as the other stages hold it."""
        for g in self.groups:
            self.need(g)

    # -- owners ---------------------------------------------------------------------
    def reown(self, owner: list[int]) -> None:
        """Move to new owners (collective): every group gathered from the old ones, each rank keeps the units
        it now owns, the rest released.  The unit tensors stay the same objects (the optimizer and the reducer
        keep theirs)."""
        if owner == self.owner:
            return
        self.gather_all()
        with torch.no_grad():
            for k, t in enumerate(self.layout.tensors):
                g = self.groups[self.group_of[self.layout.units[k].param]]
                if owner[k] == self.rank:
                    if t.untyped_storage().nbytes() == 0:
                        t.data.untyped_storage().resize_(t.numel() * t.element_size())
                    t.data.copy_(self._region(g, k))
                elif self.owner[k] == self.rank:
                    t.data.untyped_storage().resize_(0)
        self.owner = list(owner)
        self.release_all()

    # -- checkpoints ------------------------------------------------------------------------
    def _key_units(self, key: str) -> list[int]:
        return self.layout.of_param[self.keys[key]]

    def checkpoint_entries(self, key: str) -> list[tuple[str, torch.Tensor, int]]:
        """State-dict entry ``key`` (a parameter's) under checkpoint names, by its owners (see the module's doc):
        (name, tensor, holder) for each unit, this rank's tensor as it is, the others' as a ``meta`` tensor of its
        shape."""
        entries = []
        for k in self._key_units(key):
            u, t = self.layout.units[k], self.layout.tensors[k]
            name = f"model/{key}" if u.whole else f"model/{key}:{u.lo}-{u.hi}"
            mine = self.owner[k] == self.rank
            entries.append((name, t.detach() if mine else torch.empty(t.shape, dtype=t.dtype, device="meta"),
                            self.owner[k]))
        return entries

    def wants(self, name: str) -> bool | None:
        """Whether this rank reads checkpoint tensor ``name``: of a parameter's, those over the rows it owns (any
        checkpoint's cuts); None when ``name`` is not a parameter's."""
        if not name.startswith("model/"):
            return None
        key = name[len("model/"):]
        piece = PIECE.match(key)
        base = piece["key"] if piece else key
        if base not in self.keys:
            return None
        for k in self._key_units(base):
            if self.owner[k] != self.rank:
                continue
            u = self.layout.units[k]
            if piece is None or (int(piece["lo"]) < u.hi and u.lo < int(piece["hi"])):
                return True
        return False

    def into(self) -> dict[str, torch.Tensor]:
        """Where a resume may read parameters straight into: the owned whole units."""
        out = {}
        for key, i in self.keys.items():
            units = self.layout.of_param[i]
            if len(units) == 1 and self.owner[units[0]] == self.rank:
                out[f"model/{key}"] = self.layout.tensors[units[0]].data
        return out

    def load(self, model_state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
        """Fill the owned units from a checkpoint's model tensors, whole or in row pieces (those ``wants`` chose:
        the owned rows); returns the rest (buffers, frozen parameters) for the model's ``load_state_dict``.
        ValueError naming the tensor when the checkpoint lacks an owned parameter's rows or its shape differs."""
        plain, parts = split_pieces(model_state)
        first: dict[int, str] = {}
        for key, i in self.keys.items():
            if key in plain or key in parts:
                first.setdefault(i, key)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                owned = [k for k in self.layout.of_param[i] if self.owner[k] == self.rank]
                if not owned:
                    continue
                key = first.get(i)
                if key is None:
                    name = next(k for k, j in self.keys.items() if j == i)
                    raise ValueError(f"{source} does not match the model: missing model/{name}")
                for k in owned:
                    u, t = self.layout.units[k], self.layout.tensors[k]
                    if key in plain:
                        value = plain[key]
                        if tuple(value.shape) != tuple(p.shape):
                            raise ValueError(f"{source} does not match the model (was it saved with other model.* "
                                             f"options?): {key} is {list(value.shape)} there, {list(p.shape)} in "
                                             "the model")
                        value = value if u.whole else value[u.lo:u.hi]
                    else:
                        value = rows_of(parts[key], u.lo, u.hi, f"{source}: model/{key}")
                        if tuple(value.shape) != tuple(t.shape):
                            raise ValueError(f"{source} does not match the model: the rows of {key} are "
                                             f"{list(value.shape[1:])} there, {list(t.shape[1:])} in the model")
                    if value.data_ptr() != t.data_ptr():
                        t.copy_(value)
        return {key: value for key, value in plain.items() if key not in self.keys}

    def unshard(self) -> None:
        """Give every parameter its whole value in memory of its own again (collective), group by group (the
        whole model, plus one group's buffer, at the peak): the model as the other stages leave it, for what
        comes after training (the run's result, an export)."""
        with torch.no_grad():
            for g in self.groups:
                self.need(g)
                for i in g.params:
                    p = self.params[i]
                    p.data = p.data.clone()
                self._release(g)

    def close(self, collective: bool = True) -> None:
        """Remove the hooks; ``collective`` (every rank closes): first ``unshard`` the model.  Otherwise (an error
        on this rank alone) the parameters stay without memory."""
        if collective:
            self.unshard()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for g in self.groups:
            if collective and g.pending is not None and not isinstance(g.pending, tuple):
                g.pending.Wait()  # (unshard waited for every gather; alone, a wait could wait forever)
            g.pending = None
            for t in ([g.send[1]] if g.send else []) + (list(g.recv[1]) if g.recv else []):
                if t is not None:
                    t.Free()
            g.send = g.recv = None
        if self.comm is not None and collective:
            self.comm.Free()
            self.comm = None

    def describe(self) -> str:
        blocks = len(self.groups) - 1
        root = self.groups[0].nbytes
        largest = max((g.nbytes for g in self.groups[1:]), default=0)
        return (f"dist.zero=3: parameters gathered per group: the root ({root / 2**20:.2f} MiB) and {blocks} "
                f"block(s) (largest {largest / 2**20:.2f} MiB), prefetch depth 1, over "
                f"{'MPI_Ialltoallw' if self.collective == 'mpi' else 'torch.distributed broadcasts'}")


def _tensors(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
