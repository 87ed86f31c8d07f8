"""The parts of a run made of torch's own objects (``hpcnet.stateful``): the model's parameters and buffers
(``ModelState``) and an optimizer whose state every rank holds whole (``OptimizerState``); and the optimizer's
meta and checks, which the sharded optimizer (``hpcnet.comm.sharding.optimizer``) shares, so a checkpoint moves
between both.

The model's tensors are ``model/<state dict key>``; an optimizer's are ``optim/<param index>/<state key>``
(Adam's ``step`` tensors included), with its class, its param groups and any non-tensor per-param state in the
meta's ``state``.  A tensor cut into row ranges (``dist.zero``) is saved in row pieces, ``<name>:<lo>-<hi>``
(``hpcnet.ckpt.schema.ROW_PIECE``), each by its holder; a part that holds whole tensors joins them on a load.
"""

import json
from typing import Any

import torch
from torch import nn

from hpcnet.ckpt.schema import ROW_PIECE, join_pieces, rows_of, split_pieces
from hpcnet.errors import UsageError
from hpcnet.stateful import Entries, Saved, Stateful


class ModelState(Stateful):
    """The model's parameters and buffers, in the state dict's order.

    Args:
        model: the model.
        owned: the parameters held by their owners (``dist.zero=3``: ``hpcnet.comm.sharding.params.ShardedParams``),
            a part of its own whose entries (a parameter's ``model/<key>``, a cut one's row pieces) stand where the
            state dict has those keys (its ``keys``); None: every rank holds the whole model.
    """

    def __init__(self, model: nn.Module, owned: Any = None) -> None:
        self.model, self.owned = model, owned

    def state_entries(self) -> Entries:
        entries = Entries()
        held = _by_key(self.owned.state_entries()) if self.owned is not None else {}
        buffers = {name for name, _ in self.model.named_buffers()}
        for key, value in self.model.state_dict().items():
            if key in held:
                entries.add(held[key])
                continue
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"model state {key!r} is a {type(value).__name__}, not a tensor; it cannot be saved")
            entries.tensors[f"model/{key}"] = value
            if key in buffers:
                entries.synced.add(f"model/{key}")  # DataParallel.sync_buffers at the next step's start
        return entries

    def wants(self, name: str) -> bool | None:
        return self.owned.wants(name) if self.owned is not None else None

    def load_entries(self, saved: Saved) -> None:
        """Exact and strict: other names than the model's, or the same names with other shapes, are a UsageError.
        A parameter saved in row pieces is joined; with ``owned`` each rank fills the rows it owns."""
        model_state = {k.removeprefix("model/"): v for k, v in saved.tensors.items() if k.startswith("model/")}
        live = self.model.state_dict()
        if self.owned is not None:
            self.owned.load_entries(saved)
            held = self.owned.keys
            model_state = {k: v for k, v in model_state.items() if ROW_PIECE.match(k) is None and k not in held}
            live = {k: v for k, v in live.items() if k not in held}
        else:
            try:
                model_state = join_pieces(model_state)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        _check_fits(model_state, live, saved.source)
        self.model.load_state_dict(model_state, strict=self.owned is None)  # owned: those parameters are in


def _by_key(entries: Entries) -> dict[str, Entries]:
    """``entries`` of model tensors by their state dict key (a cut parameter's row pieces together)."""
    out: dict[str, Entries] = {}
    for name, tensor in entries.tensors.items():
        piece = ROW_PIECE.match(name)
        key = (piece["key"] if piece else name).removeprefix("model/")
        mine = out.setdefault(key, Entries())
        mine.tensors[name] = tensor
        if name in entries.holders:
            mine.holders[name] = entries.holders[name]
    return out


def _check_fits(model_state: dict[str, torch.Tensor], live: dict[str, Any], source: str) -> None:
    """UsageError, naming ``source``, unless ``model_state`` has the names and shapes of ``live``."""
    missing, unexpected = set(live) - set(model_state), set(model_state) - set(live)
    if missing or unexpected:
        raise UsageError(f"{source} does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    other = [f"{key} is {list(value.shape)} there, {list(live[key].shape)} in the model"
             for key, value in model_state.items() if value.shape != live[key].shape]
    if other:
        raise UsageError(f"{source} does not match the model (was it saved with other model.* options?): "
                         f"{'; '.join(other[:3])}{f'; and {len(other) - 3} more' if len(other) > 3 else ''}")


class OptimizerState(Stateful):
    """A torch optimizer whose state every rank holds whole (``dist.zero=0``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def state_entries(self) -> Entries:
        state = self.optimizer.state_dict()
        problem = unsaveable_state(type(self.optimizer).__name__, state["state"])
        if problem:  # every rank holds the same state: every rank raises alike
            raise UsageError(problem)
        tensors: dict[str, torch.Tensor] = {}
        scalars: dict[str, dict[str, Any]] = {}
        for index, per_param in state["state"].items():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{index}/{key}"] = value
                else:
                    scalars.setdefault(str(index), {})[key] = value
        return optimizer_entries(type(self.optimizer).__name__, state["param_groups"], tensors, scalars)

    def load_entries(self, saved: Saved) -> None:
        per_param = state_by_param(saved, type(self.optimizer).__name__)
        _join_pieces(per_param, [p for group in self.optimizer.param_groups for p in group["params"]], saved.source)
        load_optimizer_state(self.optimizer, per_param, saved)


def unsaveable_state(name: str, state: dict[int, dict[str, Any]]) -> str | None:
    """What makes optimizer ``name``'s ``state`` (by parameter index) unfit for a checkpoint, or None: a tensor
    subclass (torchao's low-bit states are such) would be written as its storage, or refused, by the file's
    writer, not as the optimizer reads it back."""
    for index, values in state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and type(value) not in (torch.Tensor, nn.Parameter):
                return (f"optimizer {name}: state {key!r} of parameter {index} is a {type(value).__name__}, a tensor "
                        f"subclass, which a checkpoint cannot hold as the optimizer reads it back; use an optimizer "
                        f"whose state is plain tensors")
    return None


def optimizer_entries(name: str, groups: list[dict[str, Any]], tensors: dict[str, torch.Tensor],
                      scalars: dict[str, dict[str, Any]], holders: dict[str, int] | None = None) -> Entries:
    """An optimizer's entries: its ``tensors`` (and ``holders``), and in the meta's ``state`` its class ``name``
    (a sharded optimizer's inner one's: checkpoints move between both), its param ``groups`` and the non-tensor
    state by parameter index (``scalars``); ValueError when those are not JSON-able."""
    meta = {"optimizer": name, "param_groups": groups, "state_scalars": scalars}
    try:
        text = json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer {name}: param groups or state are not JSON-able: {exc}") from None
    return Entries(tensors, holders or {}, meta={"state": json.loads(text)})


def state_by_param(saved: Saved, name: str) -> dict[int, dict[str, Any]]:
    """The saved optimizer state's tensors by parameter index and state key (row pieces as they are);
    UsageError when the checkpoint holds another optimizer's state than ``name``'s."""
    saved_name = saved.meta["state"].get("optimizer")
    if saved_name != name:
        raise UsageError(f"{saved.source} holds {saved_name!r} state, the optimizer is {name}")
    return _tensors_by_param(saved.tensors)


def _tensors_by_param(tensors: dict[str, torch.Tensor]) -> dict[int, dict[str, Any]]:
    """The ``optim/<index>/<key>`` tensors of ``tensors`` by parameter index and state key."""
    per_param: dict[int, dict[str, Any]] = {}
    for tensor_name, value in tensors.items():
        if tensor_name.startswith("optim/"):
            _, index, key = tensor_name.split("/", 2)
            per_param.setdefault(int(index), {})[key] = value
    return per_param


def full_optimizer_state(tensors: dict[str, torch.Tensor], meta_state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's optimizer state as the unsharded optimizer's ``state_dict()`` (``python -m hpcnet.ckpt
    export --optimizer``): ``tensors`` with row pieces joined (``hpcnet.ckpt.schema.join_pieces``), the meta's
    ``state`` for the non-tensor values and the param groups."""
    per_param = _tensors_by_param(tensors)
    for index, values in meta_state.get("state_scalars", {}).items():
        per_param.setdefault(int(index), {}).update(values)
    return {"state": dict(sorted(per_param.items())), "param_groups": meta_state["param_groups"]}


def load_optimizer_state(optimizer: Any, per_param: dict[int, dict[str, Any]], saved: Saved) -> None:
    """Load ``per_param`` (``state_by_param``'s), the saved non-tensor state and param groups into ``optimizer``
    (its ``load_state_dict``: a sharded optimizer keeps the rows it owns); UsageError where they do not fit."""
    meta = saved.meta["state"]
    for index, values in meta.get("state_scalars", {}).items():
        per_param.setdefault(int(index), {}).update(values)
    groups = meta["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise UsageError(f"{saved.source} has {len(groups)} optimizer param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for saved_group, live in zip(groups, optimizer.param_groups):
        for key, value in saved_group.items():  # JSON made tuples lists; give them back their type
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                saved_group[key] = tuple(value)
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    except (ValueError, KeyError) as exc:
        raise UsageError(f"{saved.source} does not match the optimizer: {exc}") from None


def _join_pieces(per_param: dict[int, dict[str, Any]], params: list[torch.Tensor], source: str) -> None:
    """Whole tensors from the row pieces of a cut parameter's state (``dist.zero``), in place; UsageError when
    they do not make the parameter's rows."""
    for index, values in per_param.items():
        plain, pieces = split_pieces(values)
        if not pieces:
            continue
        values.clear()
        values.update(plain)
        if index >= len(params):
            raise UsageError(f"{source} holds optimizer state for parameter {index}, the optimizer has "
                             f"{len(params)}")
        rows = params[index].shape[0] if params[index].dim() else 1
        for key, parts in pieces.items():
            try:
                if max(hi for _, hi, _ in parts) != rows:
                    raise ValueError(f"optimizer state {index} {key} has {max(hi for _, hi, _ in parts)} rows, "
                                     f"the parameter {rows}")
                values[key] = rows_of(parts, 0, rows, f"optimizer state {index} {key}")
            except ValueError as exc:
                raise UsageError(f"{source} does not match the optimizer: {exc}") from None
