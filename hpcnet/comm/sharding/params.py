"""``dist.zero=3``: the parameters are sharded too (docs/memory.md).

Each rank keeps, between uses, only the units of the parameters it owns (``hpcnet.comm.sharding.layout``: the
same units and owners as stages 1 and 2, cut rows included), in tensors of their own: the optimizer updates them
and the reducer hands their gradients to them, as at stage 2.  The model's parameters keep their shapes, but
their memory exists only while a *group* that holds them is gathered:

- **Groups**: one per block (``model.blocks``, ``hpcnet.models.blocks``: a transformer layer, a ResNet block),
  holding the block's trainable parameters, and the *root* group, holding the rest (embeddings, a final norm, an
  output layer, a parameter shared between blocks).  A group's parameters are views of one flat byte buffer; its
  storage is resized to nothing when the group is released and back when it is gathered, so the views (and the
  tensors autograd saved for backward, which are such views) stay valid across a release.
- **Gathers** are rounds of all ranks (``hpcnet.comm.sharding.rounds``; the transport layer moves the units): a
  rank may want any group at any point, and
  ranks that take different paths (a block skipped or run twice, a parameter read by the loss, fewer
  evaluation batches) never wait for a gather another rank would not start.  A step's forwards and backwards,
  and an evaluation's forwards, run inside ``in_use``, which ends with every rank settling: serving the others'
  gathers until all have finished.
- **When** (the schedule, for speed and memory): the root group before the model's forward, kept until its
  gradients are in; a block's group before the block's forward, with the next block's gather started behind it
  (prefetch, depth 1), and released after the block's forward; gathered again when the gradient of the block's
  output arrives in backward (before the block's backward, or its recomputation under activation
  checkpointing), with the previous block's gather started behind it, and released once the gradient of every
  parameter of the group has been handed to the reducer.  Whatever is still held after a backward is released
  then (``after_backward``).  A forward without gradients, when no backward is pending, releases the root after
  it (evaluation).
- **Whatever the schedule misses is gathered on use**, so user code that works at stage 0 works here: the
  parameters are ``ShardedParameter``, which gathers its group when an operation reads it while released (a
  loss that adds an L2 term or logs a weight norm, a model that uses a block's weight outside the block) and
  keeps the group until the backward is done; and autograd's saved tensors are packed with their group
  (``saved_tensors_hooks``), so a backward that needs a released group gathers it, whatever container the
  forward returned its outputs in.  Between steps a read that would need a gather is an error that names the
  parameter (a rank alone cannot gather); its shape and aliases (``state_dict``) stay available.
- **Gradients**: reduce-scattered bucket by bucket from the backward hooks, exactly as at stage 2
  (``hpcnet.comm.sharding.placement.ShardedGradients``): the sums land on the owners' unit tensors.  The
  optimizer step updates the owned units; nothing is broadcast after it: the next forward gathers the new values.

In a checkpoint the parameters keep their names, ``model/<key>``, each saved by the rank that owns it; a parameter
cut into row ranges is saved in row pieces, ``model/<key>:<lo>-<hi>``, each by its owner, as its optimizer state
is (``hpcnet.ckpt.schema.ROW_PIECE``): nothing is gathered to save, and a reader joins the pieces
(``hpcnet.ckpt.schema.join_pieces``), so a stage-3 checkpoint resumes at any stage and world size and the others
resume at stage 3.
"""

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from hpcnet.ckpt.schema import ROW_PIECE, piece_name, rows_of, split_pieces
from hpcnet.comm.sharding.layout import ShardLayout
from hpcnet.comm.sharding.rounds import Rounds
from hpcnet.comm.transport import GatherGroup, build_group_gather
from hpcnet.errors import UsageError
from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.stateful import Entries, Saved, Stateful

log = logging.getLogger(__name__)

ALIGN = 64
"""Each parameter's place in a group's flat buffer starts at a multiple of this many bytes."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _tensor_functions(getters: str, setters: str, methods: str, functions: str = "") -> frozenset:
    """The functions ``__torch_function__`` receives for these properties, methods and ``torch`` functions (those
    of this torch)."""
    def of(name: str, where: Any = torch.Tensor) -> Any:
        return getattr(where, name, None)
    return frozenset([of(name).__get__ for name in getters.split() if of(name) is not None]
                     + [of(name).__set__ for name in setters.split() if of(name) is not None]
                     + [of(name) for name in methods.split() if of(name) is not None]
                     + [of(name, torch) for name in functions.split() if of(name, torch) is not None])


METADATA = _tensor_functions(
    "shape dtype device requires_grad grad grad_fn is_leaf ndim layout is_cuda is_cpu is_meta is_sparse "
    "is_quantized is_nested names _version _base output_nr itemsize nbytes",
    "data grad requires_grad",
    "size dim numel nelement stride storage_offset element_size is_contiguous is_floating_point is_complex "
    "data_ptr untyped_storage get_device register_hook register_post_accumulate_grad_hook requires_grad_ "
    "retain_grad _is_view new_empty new_zeros new_ones new_full",
    "empty_like zeros_like ones_like full_like")
"""What a ``ShardedParameter`` answers without its values (no gather)."""
ALIASES = _tensor_functions("data", "", "detach view view_as as_strided")
"""What only aliases a parameter's memory: between steps these give the alias without a gather (``state_dict``
takes ``detach()``), where reading the values would need one."""


class ShardedParameter(nn.Parameter):
    """A stage-3 parameter: an operation that reads it while its group is released gathers the group first
    (``ShardedParams.on_read``); results are plain tensors."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in METADATA:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, ShardedParameter):
                    arg._hpcnet_sharded.on_read(arg, func)
                elif isinstance(arg, (list, tuple)):
                    for item in arg:
                        if isinstance(item, ShardedParameter):
                            item._hpcnet_sharded.on_read(item, func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


@dataclass(eq=False)
class Group:
    """One gathering unit: a block's trainable parameters, or the root's."""

    index: int
    name: str
    params: list[int]  # trainable parameter indices, in model order
    offsets: dict[int, int]  # each parameter's byte offset in ``flat``
    nbytes: int
    flat: torch.Tensor  # uint8; its storage is empty while the group is released
    units: list[int]  # the units of its parameters
    gathered: bool = False
    pending: Any = None  # a round in flight (``Rounds.start``)
    arrived: int = 0  # gradients handed over in this backward
    active: int = 0  # forwards of the group's module in progress
    pinned: bool = False  # read outside its forward: held until the backward is done


class _Saved:
    """A tensor autograd saved that lives in a group's memory (``ShardedParams._pack``)."""

    __slots__ = ("group", "tensor")

    def __init__(self, group: Group, tensor: torch.Tensor) -> None:
        self.group, self.tensor = group, tensor


class ShardedParams(Stateful):
    """Stage 3's parameters (see the module's doc).

    Args:
        model: the model (its parameters replicated and equal on every rank, as ``broadcast_module`` left them).
        layout: the units of the trainable parameters (its ``tensors`` are replaced by tensors of their own).
        owner: the owner rank of each unit.
        comm: the ranks' communicator (the gathers duplicate it: they have their own message space).
        blocks: the model's blocks (``find_blocks``); empty: one group, the whole model.
        device: where the parameters live.
        collective: 'mpi' (CPU parameters) or 'torch' (``torch.distributed``: CUDA, or gloo).
        recorder: the flight recorder (``hpcnet.fault.flightrec``) each gather round is logged to.
    """

    def __init__(self, model: nn.Module, layout: ShardLayout, owner: list[int], comm: Any,
                 blocks: list[tuple[str, nn.Module]], *, device: torch.device, collective: str = "mpi",
                 recorder: Any = NULL_RECORDER) -> None:
        self.model, self.layout, self.owner = model, layout, list(owner)
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
        self._own_units()
        self.views: list[torch.Tensor] = []  # each parameter's place in its group's buffer, a plain tensor
        self._by_storage: dict[int, Group] = {}  # the gathered groups by their memory's address (``_pack``)
        self._using = False  # inside ``in_use``
        self._grad_forward = False  # a forward with gradients ran since the last backward
        gather = build_group_gather(collective, comm, self._bind(), self.layout.tensors, self.owner)
        self.rounds = Rounds(comm, gather, recorder=recorder)
        self._classes = [type(p) for p in self.params]
        for i, p in enumerate(self.params):
            p.__class__ = ShardedParameter
            p._hpcnet_sharded = self
            p._hpcnet_index = i
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
            units = [k for i in params for k in self.layout.of_param[i]]
            groups.append(Group(g, name, params, offsets, at, flat, units))
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

    def _bind(self) -> list[GatherGroup]:
        """Make each parameter a view of its group's flat buffer, then release every group; returns the groups as
        the gathers move them (their units' places are views made while the buffers have their memory)."""
        views: list[Any] = [None] * len(self.params)
        self.views = views  # filled group by group: ``_gather_group`` reads it
        gathered = []
        with torch.no_grad():
            for g in self.groups:
                for i in g.params:
                    p = self.params[i]
                    nbytes = p.numel() * p.element_size()
                    region = g.flat[g.offsets[i]:g.offsets[i] + nbytes].view(p.dtype)
                    p.data = views[i] = region.as_strided(p.shape, p.stride()) if p.dim() else region.view(())
                gathered.append(self._gather_group(g))
                self._release(g)
        return gathered

    def _gather_group(self, g: Group) -> GatherGroup:
        """Group ``g`` as the gathers move it: each unit's byte offset in the flat buffer and its place there."""
        offsets = []
        for k in g.units:
            u = self.layout.units[k]
            p = self.params[u.param]
            offsets.append(g.offsets[u.param] + u.lo * (p.numel() * p.element_size() // max(1, u.rows)))
        return GatherGroup(g.index, g.flat, list(g.units), offsets, [self._region(g, k) for k in g.units])

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

    # -- a step's use ---------------------------------------------------------------------
    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Forwards and backwards (a step's micro-batches, an evaluation's batches) may run inside; at the end
        every group is released and every rank settles (collective, ``Rounds.settle``).  An exception raised
        inside leaves without settling: a rank that failed alone does not wait for the others (the entry point
        ends the job)."""
        if self._using:
            raise RuntimeError("dist.zero=3: in_use is not reentrant")
        self._using, self._grad_forward = True, False
        for g in self.groups:
            g.arrived = g.active = 0  # (a forward that raised left its count)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        except BaseException:
            self._using = False
            self._release_idle()
            raise
        self._using = False
        self.release_all()
        self.rounds.settle()

    def after_backward(self) -> None:
        """After a backward: release what is still held (a group some of whose parameters got no gradient, a
        prefetch no block used, a group the loss read)."""
        self.release_all()
        self._grad_forward = False
        for g in self.groups:
            g.arrived = 0

    def on_read(self, p: nn.Parameter, func: Any) -> None:
        """An operation ``func`` reads parameter ``p`` (``ShardedParameter``): outside the forward of its group,
        inside ``in_use``, its group is gathered and kept until the backward is done.  In backward (a block's
        recomputation under activation checkpointing, which runs its forward without the module's hooks) the group
        is gathered only: it goes once its gradients are in, as the schedule has it."""
        g = self.groups[self.group_of[p._hpcnet_index]]
        if g.active:
            return
        if self._using:
            g.pinned = g.pinned or not _in_backward()
            self._need(g)
        elif not (g.gathered or func in ALIASES):
            raise RuntimeError(f"dist.zero=3: parameter {self._name(p._hpcnet_index)} was read between steps, "
                               "where each rank holds only the units it owns; read parameters inside the model's "
                               "forward or the loss (model.loss), or after training (the run's result, an "
                               "export)")

    def _name(self, i: int) -> str:
        return next(key for key, j in self.keys.items() if j == i)

    # -- the hooks ----------------------------------------------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        root = self.groups[0]
        root.active += 1
        if _in_backward():
            return
        if not (torch.is_grad_enabled() or self._grad_forward):
            self._release_idle(pins=True)  # a new evaluation batch: what the last one read is done with
        self._need(root)
        self._prefetch(1)

    def _root_post_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        root = self.groups[0]
        root.active -= 1
        if _in_backward():
            return
        if torch.is_grad_enabled():
            self._grad_forward = True  # its backward needs the root: kept until after_backward
        elif not self._grad_forward:
            self._release_idle()  # evaluation: nothing will come back for the parameters

    def _pre_forward(self, g: Group) -> None:
        g.active += 1
        self._need(g)
        if not _in_backward():
            self._prefetch(g.index + 1)

    def _post_forward(self, g: Group, out: Any) -> None:
        g.active -= 1
        if _in_backward():
            return  # a recomputation inside backward: the backward uses the group next
        if torch.is_grad_enabled():
            # Gathered again when the output's gradient arrives, with the block before it behind; a backward that
            # comes another way (an output these hooks do not find) gathers it on use (``_unpack``).
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, g=g: self._before_backward(g))
        if not (g.active or g.pinned):
            self._release(g)

    def _before_backward(self, g: Group) -> None:
        self._need(g)
        self._prefetch(g.index - 1)

    def _arrived(self, i: int) -> None:
        g = self.groups[self.group_of[i]]
        g.arrived += 1
        if g.arrived >= len(g.params) and g.gathered and not (g.active or g.pinned):
            self._release(g)

    def _pack(self, t: torch.Tensor) -> Any:
        """Autograd saves ``t``: with its group when it lives in a group's memory (detached: a saved output
        holding its own graph would be a reference cycle)."""
        g = self._by_storage.get(t.untyped_storage().data_ptr())
        return t.detach() if g is None else _Saved(g, t.detach())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if type(saved) is not _Saved:
            return saved
        g = saved.group
        if not g.gathered:
            self._need(g)
            self._prefetch(g.index - 1)
        return saved.tensor

    # -- gather and release ----------------------------------------------------------------
    def _need(self, g: Group) -> None:
        """Group ``g`` gathered: its round waited for, or started and waited for."""
        if not self._using:
            raise RuntimeError(f"dist.zero=3: the model ran outside a step (group {g.name!r} needed a gather, "
                               "which every rank must take part in)")
        self.need(g)

    def need(self, g: Group) -> None:
        """Group ``g`` gathered (a round of every rank: ``hpcnet.comm.sharding.rounds``)."""
        if g.gathered:
            return
        if g.pending is None:
            self._start(g)
        pending, g.pending = g.pending, None
        self.rounds.wait(pending)
        g.gathered = True

    def _prefetch(self, index: int) -> None:
        if 1 <= index < len(self.groups):
            g = self.groups[index]
            if not g.gathered and g.pending is None and g.params:
                self._start(g)

    def _start(self, g: Group) -> None:
        g.flat.untyped_storage().resize_(g.nbytes)
        if g.nbytes:
            self._by_storage[g.flat.untyped_storage().data_ptr()] = g
        g.pending = self.rounds.start(g)
        g.gathered = g.pending is None  # one rank: its own units, copied

    def _region(self, g: Group, k: int) -> torch.Tensor:
        """Unit ``k``'s place in ``g``'s flat buffer, shaped as its tensor."""
        u = self.layout.units[k]
        view = self.views[u.param]
        return view if u.whole else view[u.lo:u.hi]

    def _release(self, g: Group) -> None:
        if g.pending is not None:
            pending, g.pending = g.pending, None
            self.rounds.wait(pending)
        if g.nbytes and g.flat.untyped_storage().nbytes():
            self._by_storage.pop(g.flat.untyped_storage().data_ptr(), None)
        g.flat.untyped_storage().resize_(0)
        g.gathered = g.pinned = False

    def _release_idle(self, pins: bool = False) -> None:
        """Release every group not in a forward (nor pinned, unless ``pins``) and with no round in flight (its
        buffer is being written)."""
        for g in self.groups:
            held = (g.gathered or g.pending is not None) and not g.active and (pins or not g.pinned)
            if held and (g.pending is None or self._using):
                self._release(g)

    def release_all(self) -> None:
        for g in self.groups:
            if g.gathered or g.pending is not None:
                self._release(g)

    def gather_all(self) -> None:
        """Every group gathered (collective: every rank calls it, between steps): the whole model, as the
        other stages hold it, until ``release_all``."""
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
        self.rounds.set_owner(owner)
        self.release_all()

    # -- checkpoints (``hpcnet.stateful``: the model's part holds this one, ``ModelState``) ------------------
    def state_entries(self) -> Entries:
        """The parameters' entries by their owners (see the module's doc): for each state-dict key and unit, this
        rank's tensor as it is, the others' as a ``meta`` tensor of its shape, held by the unit's owner."""
        entries = Entries()
        for key, i in self.keys.items():
            for k in self.layout.of_param[i]:
                u, t = self.layout.units[k], self.layout.tensors[k]
                name = f"model/{key}" if u.whole else piece_name(f"model/{key}", u.lo, u.hi)
                mine = self.owner[k] == self.rank
                entries.tensors[name] = t.detach() if mine else torch.empty(t.shape, dtype=t.dtype, device="meta")
                entries.holders[name] = self.owner[k]
        return entries

    def wants(self, name: str) -> bool | None:
        """Whether this rank reads checkpoint tensor ``name``: of a parameter's, those over the rows it owns (any
        checkpoint's cuts); None when ``name`` is not a parameter's."""
        if not name.startswith("model/"):
            return None
        key = name[len("model/"):]
        piece = ROW_PIECE.match(key)
        base = piece["key"] if piece else key
        if base not in self.keys:
            return None
        return self.layout.owns_rows(self.keys[base], self.owner, self.rank,
                                     (int(piece["lo"]), int(piece["hi"])) if piece else None)

    def load_entries(self, saved: Saved) -> None:
        """Fill the owned units from the checkpoint's parameters, whole or in row pieces (those ``wants`` chose:
        the owned rows).  UsageError naming the tensor when the checkpoint lacks an owned parameter's rows or its
        shape differs."""
        model_state = {k.removeprefix("model/"): v for k, v in saved.tensors.items() if k.startswith("model/")}
        plain, parts = split_pieces(model_state)
        first: dict[int, str] = {}
        for key, i in self.keys.items():
            if key in plain or key in parts:
                first.setdefault(i, key)
        try:
            with torch.no_grad():
                for i, p in enumerate(self.params):
                    owned = [k for k in self.layout.of_param[i] if self.owner[k] == self.rank]
                    if owned:
                        self._load_units(owned, p, first.get(i), plain, parts, i, saved.source)
        except ValueError as exc:
            raise UsageError(str(exc)) from None

    def _load_units(self, owned: list[int], p: torch.Tensor, key: str | None, plain: dict[str, torch.Tensor],
                    parts: dict[str, list[tuple[int, int, torch.Tensor]]], i: int, source: str) -> None:
        """Parameter ``i``'s ``owned`` units from the checkpoint's tensor ``key`` (whole in ``plain`` or in row
        pieces in ``parts``); ValueError where it does not fit."""
        if key is None:
            name = next(k for k, j in self.keys.items() if j == i)
            raise ValueError(f"{source} does not match the model: missing model/{name}")
        for k in owned:
            u, t = self.layout.units[k], self.layout.tensors[k]
            if key in plain:
                value = plain[key]
                if tuple(value.shape) != tuple(p.shape):
                    raise ValueError(f"{source} does not match the model (was it saved with other model.* "
                                     f"options?): {key} is {list(value.shape)} there, {list(p.shape)} in the model")
                value = value if u.whole else value[u.lo:u.hi]
            else:
                value = rows_of(parts[key], u.lo, u.hi, f"{source}: model/{key}")
                if tuple(value.shape) != tuple(t.shape):
                    raise ValueError(f"{source} does not match the model: the rows of {key} are "
                                     f"{list(value.shape[1:])} there, {list(t.shape[1:])} in the model")
            if value.data_ptr() != t.data_ptr():
                t.copy_(value)

    def unshard(self) -> None:
        """Give every parameter its whole value in memory of its own again (collective), group by group (the
        whole model, plus one group's buffer, at the peak): the model as the other stages leave it, for what
        comes after training (the run's result, an export)."""
        with torch.no_grad():
            for g in self.groups:
                self.need(g)
                for i in g.params:
                    self.params[i].data = self.views[i].clone()
                self._release(g)

    def close(self, collective: bool = True) -> None:
        """Remove the hooks; ``collective`` (every rank closes): first ``unshard`` the model, whose parameters
        are then plain again.  Otherwise (an error on this rank alone) the parameters stay without memory, and
        reading one is an error that says so (``on_read``)."""
        if collective:
            self.unshard()
            for p, cls in zip(self.params, self._classes):
                p.__class__ = cls
                del p._hpcnet_sharded, p._hpcnet_index
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for g in self.groups:
            g.pending = None  # (unshard waited for every round; alone, a wait could wait forever)
        self.rounds.close(collective)

    def describe(self) -> str:
        blocks = len(self.groups) - 1
        root = self.groups[0].nbytes
        largest = max((g.nbytes for g in self.groups[1:]), default=0)
        return (f"dist.zero=3: parameters gathered per group: the root ({root / 2**20:.2f} MiB) and {blocks} "
                f"block(s) (largest {largest / 2**20:.2f} MiB), prefetch depth 1, in rounds over "
                f"{'MPI_Ialltoallw' if self.collective == 'mpi' else 'torch.distributed'}")


def _tensors(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor)]
