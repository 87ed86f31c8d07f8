"""What a training run saves and restores: model and optimizer state as named tensors, RNG, data position.

``flatten_state`` / ``restore_state`` and ``rng_state`` / ``set_rng_state``
turn the live objects into what a ``CheckpointManager`` stores and back;
``TrainState`` ties them to one run.  When to save is ``hpcnet.ckpt.schedule``'s.
"""

import json
import logging
import random
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.agree import shared_errors
from hpcnet.ckpt.load import Loaded
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.ckpt.schema import FEEDBACK_PREFIX, rows_of, split_pieces
from hpcnet.ckpt.schema import ROW_PIECE as PIECE
from hpcnet.config import Config
from hpcnet.config.load import to_dict
from hpcnet.errors import UsageError

log = logging.getLogger(__name__)


# --- state <-> tensors + JSON ----------------------------------------------------

def flatten_state(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: Any = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Model and optimizer state as named tensors (not copied) and JSON-able meta.

    Tensors are ``model/<state_dict key>`` and ``optim/<param index>/<state
    key>`` (Adam's ``step`` tensors included); the meta holds the optimizer's
    class, its param groups' hyper-parameters and member params, and any
    non-tensor per-param state.  A sharded optimizer (``dist.zero``) gives the
    same meta and names as the unsharded one would (collective), except that
    the state of a parameter cut into row ranges comes in pieces,
    ``optim/<index>/<key>:<lo>-<hi>``: its own entries, and the others' as
    ``meta``-device tensors (``flatten_with_holders`` says who holds them).  With sharded parameters
    (``sharded``: ``dist.zero=3``'s ``hpcnet.comm.sharding.params.ShardedParams``) the parameters come from their
    owners too, a cut one in row pieces, ``model/<key>:<lo>-<hi>``.
    """
    tensors, meta, _ = flatten_with_holders(model, optimizer, sharded)
    return tensors, meta


def flatten_with_holders(model: nn.Module, optimizer: torch.optim.Optimizer, sharded: Any = None
                         ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, int]]:
    """``flatten_state``, and of its tensors those one rank alone holds (a sharded optimizer's state, sharded
    parameters) -> that rank; empty when every rank holds everything."""
    tensors: dict[str, torch.Tensor] = {}
    holders: dict[str, int] = {}
    for key, value in model.state_dict().items():
        if sharded is not None and key in sharded.keys:  # the parameter from its owners, where the state dict has it
            for name, tensor, holder in sharded.checkpoint_entries(key):
                tensors[name] = tensor
                holders[name] = holder
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"model state {key!r} is a {type(value).__name__}, not a tensor; it cannot be saved")
        tensors[f"model/{key}"] = value
    scalars: dict[str, dict[str, Any]] = {}
    if hasattr(optimizer, "checkpoint_state"):
        optim_tensors, scalars, optim_holders = optimizer.checkpoint_state()
        tensors.update(optim_tensors)
        holders.update(optim_holders)
        groups = optimizer.full_param_groups()
    else:
        state = optimizer.state_dict()
        for index, per_param in state["state"].items():
            for key, value in per_param.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{index}/{key}"] = value
                else:
                    scalars.setdefault(str(index), {})[key] = value
        groups = state["param_groups"]
    meta = {"optimizer": optimizer_name(optimizer), "param_groups": groups, "state_scalars": scalars}
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer {type(optimizer).__name__}: param groups or state are not JSON-able: "
                         f"{exc}") from None
    return tensors, json.loads(json.dumps(meta)), holders


def optimizer_name(optimizer: Any) -> str:
    """The optimizer's class name; a sharded optimizer's is its inner one's (checkpoints move between both)."""
    return type(getattr(optimizer, "inner", optimizer)).__name__


def state_wanted(optimizer: Any) -> Callable[[str], bool] | None:
    """Which of ``flatten_state``'s tensors this rank restores: with a sharded optimizer (``dist.zero``), the
    model's and the state of what it owns (of a cut parameter, the pieces over its rows), so a resume never
    holds the others' shards; None (all) otherwise."""
    return getattr(optimizer, "wants", None)


def restore_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any], source: str = "checkpoint", sharded: Any = None) -> None:
    """Load what ``flatten_state`` produced back into ``model`` and ``optimizer`` (exact, strict).

    Raises UsageError, its message starting with ``source`` (the checkpoint, by
    name), when the checkpoint does not fit the model or optimizer: other
    names, or the same names with other shapes.  A parameter saved in row pieces (``dist.zero=3``) is joined;
    with sharded parameters (``sharded``) each rank fills the rows it owns.
    """
    model_state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    live = model.state_dict()
    try:
        if sharded is not None:
            model_state = sharded.load(model_state, source)
            live = {key: value for key, value in live.items() if key not in sharded.keys}
        else:
            model_state = join_pieces(model_state)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    missing, unexpected = set(live) - set(model_state), set(model_state) - set(live)
    if missing or unexpected:
        raise UsageError(f"{source} does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    other = [f"{key} is {list(value.shape)} there, {list(live[key].shape)} in the model"
             for key, value in model_state.items() if value.shape != live[key].shape]
    if other:
        raise UsageError(f"{source} does not match the model (was it saved with other model.* options?): "
                         f"{'; '.join(other[:3])}{f'; and {len(other) - 3} more' if len(other) > 3 else ''}")
    model.load_state_dict(model_state, strict=sharded is None)  # sharded: the parameters are in already
    if optimizer is None:
        return
    if meta.get("optimizer") != optimizer_name(optimizer):
        raise UsageError(f"{source} holds {meta.get('optimizer')!r} state, the optimizer is "
                         f"{optimizer_name(optimizer)}")
    per_param: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            per_param.setdefault(int(index), {})[key] = value
    if not hasattr(optimizer, "checkpoint_state"):  # a sharded optimizer takes the pieces it needs itself
        _join_pieces(per_param, [p for group in optimizer.param_groups for p in group["params"]], source)
    for index, values in meta.get("state_scalars", {}).items():
        per_param.setdefault(int(index), {}).update(values)
    groups = meta["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise UsageError(f"{source} has {len(groups)} optimizer param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for saved, live in zip(groups, optimizer.param_groups):
        for key, value in saved.items():  # JSON made tuples lists; give them back their type
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    except (ValueError, KeyError) as exc:
        raise UsageError(f"{source} does not match the optimizer: {exc}") from None


def join_pieces(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (a loaded checkpoint's) with the row pieces of each cut parameter's optimizer state
    (``optim/<index>/<key>:<lo>-<hi>``, ``dist.zero``) and of each cut parameter (``model/<key>:<lo>-<hi>``,
    ``dist.zero=3``) joined into one tensor under the unsharded name: the names and values an unsharded run
    saves, each joined tensor where its first piece was (a state dict keeps its order).  ValueError when a tensor's
    pieces leave rows out."""
    _, pieces = split_pieces(tensors)
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        piece = PIECE.match(name)
        if piece is None:
            out[name] = value
        elif piece["key"] not in out:
            parts = pieces[piece["key"]]
            out[piece["key"]] = rows_of(parts, 0, max(hi for _, hi, _ in parts), piece["key"])
    return out


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


def rng_state() -> dict[str, Any]:
    """This rank's torch (CPU and CUDA), numpy and ``random`` generator states, as JSON-able values."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        "numpy": {"name": name, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def _hex_bytes(value: Any, length: int, what: str) -> torch.Tensor:
    if not isinstance(value, str) or len(value) != 2 * length:
        raise ValueError(f"RNG state {what}: expected {length} bytes of hex")
    return torch.frombuffer(bytearray(bytes.fromhex(value)), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned; ValueError if the values are not of the expected form."""
    try:
        torch_state = _hex_bytes(state["torch"], torch.get_rng_state().numel(), "torch")
        np_state = state["numpy"]
        key = np.array(np_state["key"], dtype=np.uint32)
        if np_state["name"] != "MT19937" or key.shape != (624,):
            raise ValueError("RNG state numpy: not an MT19937 state")
        py_state = state["python"]
        internal = tuple(int(v) for v in py_state["internal"])
        if py_state["version"] != 3 or len(internal) != 625:
            raise ValueError("RNG state python: not a version-3 state")
        gauss = py_state["gauss_next"]
        if gauss is not None and not isinstance(gauss, float):
            raise ValueError("RNG state python: bad gauss_next")
        np_tuple = ("MT19937", key, int(np_state["pos"]), int(np_state["has_gauss"]),
                    float(np_state["cached_gaussian"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"RNG state is malformed: {exc!r}") from None
    torch.set_rng_state(torch_state)
    np.random.set_state(np_tuple)
    random.setstate((3, internal, gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        length = torch.cuda.get_rng_state().numel()
        if isinstance(cuda, list) and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_hex_bytes(s, length, "cuda") for s in cuda])


class TrainState:
    """The pieces of a run that a checkpoint holds: model, optimizer, data position, RNG."""

    def __init__(self, cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer, sampler: Any,
                 manager: CheckpointManager, shards: Any = None) -> None:
        self.cfg, self.model, self.optimizer, self.sampler, self.manager = cfg, model, optimizer, sampler, manager
        self.shards = shards
        """Who owns which parameter (``DataParallel``: ``plan_state``/``restore_plan``), or None: saved in the
        meta, so a resume goes on with the owners in force."""
        self.last_saved_step = -1

    @property
    def sharded(self) -> Any:
        """``dist.zero=3``'s sharded parameters (``hpcnet.comm.sharding.params.ShardedParams``), or None."""
        return getattr(self.shards, "sharded_params", None)

    def save(self, step: int, loader_state: dict[str, Any]) -> Path:
        """Collective: checkpoint the state after ``step`` (blocks only for the snapshot when async)."""
        tensors, state_meta, holders = flatten_with_holders(self.model, self.optimizer, self.sharded)
        if self.shards is not None:  # int8's residuals (dist.compression=int8), each held by its rank
            residuals, residual_holders = self.shards.feedback_state()
            tensors.update(residuals)
            holders.update(residual_holders)
        meta = {"state": state_meta, "sampler": loader_state, "config": to_dict(self.cfg), "step": step}
        plan = self.shards.plan_state() if self.shards is not None else None
        if plan is not None:
            meta["shards"] = plan
        path = self.manager.save(step, tensors, meta, rng_state(), holders=holders)
        self.last_saved_step = step
        timings = self.manager.last_timings
        log.info("checkpoint at step %d: %s (%s, blocked %.3f s)", step, path.name,
                 "writing in the background" if self.manager.async_save else "written",
                 timings.get("blocking_s", 0.0))
        return path

    def is_finite(self) -> bool:
        """Collective: whether the model and optimizer state hold only finite numbers on every rank.

        A pass over the whole state, so it runs before saves only: the per-step
        checks see the loss and the gradient norm, not an update that overflowed
        (a finite gradient times a huge learning rate) or statistics a forward
        pass left non-finite.
        """
        from mpi4py import MPI

        tensors, _ = flatten_state(self.model, self.optimizer, self.sharded)
        checks: dict[torch.device, list[torch.Tensor]] = {}
        for tensor in tensors.values():
            if tensor.is_meta:
                continue  # held by another rank (dist.zero), which checks it
            if tensor.is_floating_point() or tensor.is_complex():
                checks.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
        # One device-to-host copy per device (Adam keeps its step counters on the CPU).
        finite = all(bool(torch.stack(flags).all()) for flags in checks.values())
        return bool(self.manager.comm.allreduce(int(finite), op=MPI.MIN))

    def start(self, which: str, *, rank: int, otherwise: str = "") -> int:
        """Collective: begin the run, fresh (``''``) or from a checkpoint (``'auto'`` or a path).

        Returns the step to continue from.  A fresh run needs a checkpoint
        directory of its own (see ``CheckpointManager.start_fresh``).  ``otherwise``
        (``checkpoint.resume_else``): where ``'auto'`` starts while the directory holds no
        committed checkpoint ('' fresh): a restart of a run that began from another
        run's checkpoint goes back to it until it has committed one of its own.
        """
        if not which:
            self.manager.start_fresh()
            return 0
        log.info("resume: reading the %s checkpoint of %s", "newest committed" if which == "auto" else "given",
                 which if which != "auto" else self.manager.directory)
        t0 = time.perf_counter()
        # Read straight into the model's own tensors where they fit (CPU): a resume then holds no second copy of
        # the model, and with a sharded optimizer no other rank's state either, so it fits wherever a step does.
        sharded = self.sharded
        into = {f"model/{key}": value for key, value in self.model.state_dict().items()
                if sharded is None or key not in sharded.keys}
        if sharded is not None:  # the owned units, where a unit is a whole parameter
            into.update(sharded.into())
        loaded = self.manager.resume(which, into=into, wanted_from_meta=self._plan_from)
        if loaded is None and otherwise:
            log.info("no checkpoint in %s yet: resuming from %s (checkpoint.resume_else)", self.manager.directory,
                     otherwise)
            loaded = self.manager.resume(otherwise, into=into, wanted_from_meta=self._plan_from)
        if loaded is None:
            log.info("no checkpoint in %s yet: starting from step 0", self.manager.directory)
            return 0
        self._restore(loaded, rank)
        log.info("resume: checkpoint read and restored in %.2f s", time.perf_counter() - t0)
        return loaded.step

    def _plan_from(self, meta: dict[str, Any]) -> Callable[[str], bool] | None:
        """Collective, before the load reads a tensor: take the owners the checkpoint was saved under (while the
        optimizer holds no state, nothing moves), then what this rank restores under them."""
        if self.shards is not None:
            self.shards.restore_plan(meta.get("shards"))
        wanted = state_wanted(self.optimizer)
        if self.shards is None:
            return wanted
        shards, sharded = self.shards, self.sharded

        def wants(name: str) -> bool:  # of int8's residuals, this rank's own only; of the parameters at
            if name.startswith(FEEDBACK_PREFIX):  # dist.zero=3, the owned rows only
                return shards.wants_feedback(name)
            if sharded is not None:
                param = sharded.wants(name)
                if param is not None:
                    return param
            return wanted is None or wanted(name)
        return wants

    def _restore(self, loaded: Loaded, rank: int) -> None:
        # Everything here may fail on some ranks only (each restores its own
        # RNG state), so the outcome is shared before the next collective.
        with shared_errors(self.manager.comm):
            restore_state(self.model, self.optimizer, loaded.tensors, loaded.meta["state"],
                          source=f"checkpoint {str(loaded.path)!r}", sharded=self.sharded)
            # Any world size and batch size continue from the saved sample position;
            # a malformed state or a shrunk dataset is a clear ValueError.
            self.sampler.load_state_dict(loaded.meta["sampler"])
            if self.shards is not None:
                self.shards.load_feedback(loaded.tensors, loaded.saved_world_size)
            if loaded.rank_state is not None:
                set_rng_state(loaded.rank_state)
            else:
                # More ranks than were saved: a fresh, distinct, reproducible seed.
                torch.manual_seed(zlib.crc32(f"{self.cfg.run.seed}/{rank}/{loaded.step}".encode()))
        self.last_saved_step = loaded.step
        log.info("resumed from %s at step %d (saved by %d rank(s)%s)", loaded.path, loaded.step,
                 loaded.saved_world_size,
                 f"; skipped {len(loaded.skipped)} unusable newer checkpoint(s)" if loaded.skipped else "")
