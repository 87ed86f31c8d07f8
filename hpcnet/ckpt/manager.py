"""Checkpoints: sharded, incremental, atomic parallel-HDF5 files, resumable at any world size.

The training loop flattens its state (``flatten_state``, ``rng_state``) and
hands it to a ``CheckpointManager``, which writes one HDF5 file per save with
every rank writing about 1/N of the bytes (layout: ``hpcnet.ckpt_format``;
the collective write and verified read: ``hpcnet.ckpt_io``)::

    manager = CheckpointManager(comm, cfg.checkpoint.dir, keep=cfg.checkpoint.keep,
                                full_every=cfg.checkpoint.full_every, async_save=cfg.checkpoint.async_save)
    loaded = manager.load("auto")             # None: nothing to resume from
    if loaded:
        restore_state(model, optimizer, loaded.tensors, loaded.meta["state"])
        start = loaded.step
    tensors, state_meta = flatten_state(model, optimizer)
    manager.save(step, tensors, {"state": state_meta, "sampler": sampler.state_dict()}, rng_state())
    manager.close()                           # waits for a background write

Deadlines: every save, background write, wait and load runs in a guard of
``deadlines`` (``hpcnet.watchdog``; the monitor's, in training) with the
deadline ``checkpoint.timeout_s``, or when it is 0 ``io_timeout_s``: at least
120 s, 10 x the last save, and the bytes at 10 MiB/s.  A stuck file system
then ends the job with status 75 instead of hanging it.

Threads: with ``async_save`` the write runs in one background thread on a
duplicated communicator.  h5py serialises its calls with one process-wide
lock, held for a whole call (the GIL is released during the I/O), so a data
loader reading HDF5 meanwhile waits at most for one write call (a piece of at
most ``WRITE_PIECE_BYTES`` per rank).  A deadlock would need a thread that
holds that lock while waiting for another rank; only the writer does (inside
collective calls), and the peer writer it waits for needs only its own
process's lock, which serial readers always give back.  So the one rule is:
no other *parallel* (``driver="mpio"``) HDF5 in the same process while a save
is in flight; every method of the manager first finishes the save in flight.
"""

import contextlib
import json
import logging
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import hpcnet
from hpcnet.ckpt.format import (CheckpointInfo, Plan, TensorSpec, check_names_nest, committed_after, make_spec,
                                plan_ownership, resolve_chain, sha256_hex)
from hpcnet.ckpt.store import (IoFault, SaveJob, dtype_name, listing, read_chain, read_info, scan, set_aside,
                               to_storage, write_checkpoint)
from hpcnet.errors import CheckpointCorrupt, UsageError
from hpcnet.fault.watchdog import NULL_DEADLINES, Guard, io_timeout_s
from hpcnet.agree import agree_on_error, agreed, shared_errors
from hpcnet.layout import ASIDE_PREFIX, CKPT_NAME_RE, TMP_SUFFIX

__all__ = ["CheckpointCorrupt", "CheckpointInfo", "CheckpointManager", "Loaded", "flatten_state", "load_checkpoint",
           "restore_state", "rng_state", "set_rng_state"]

log = logging.getLogger("hpcnet.checkpoint")


# --- state <-> tensors + JSON ----------------------------------------------------

def flatten_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Model and optimizer state as named tensors (not copied) and JSON-able meta.

    Tensors are ``model/<state_dict key>`` and ``optim/<param index>/<state
    key>`` (Adam's ``step`` tensors included); the meta holds the optimizer's
    class, its param groups' hyper-parameters and member params, and any
    non-tensor per-param state.
    """
    tensors: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"model state {key!r} is a {type(value).__name__}, not a tensor; it cannot be saved")
        tensors[f"model/{key}"] = value
    state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, per_param in state["state"].items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optim/{index}/{key}"] = value
            else:
                scalars.setdefault(str(index), {})[key] = value
    meta = {"optimizer": type(optimizer).__name__, "param_groups": state["param_groups"], "state_scalars": scalars}
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer {type(optimizer).__name__}: param groups or state are not JSON-able: {exc}") from None
    return tensors, json.loads(json.dumps(meta))


def restore_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, tensors: dict[str, torch.Tensor],
                  meta: dict[str, Any]) -> None:
    """Load what ``flatten_state`` produced back into ``model`` and ``optimizer`` (exact, strict).

    Raises UsageError when the checkpoint does not fit the model or optimizer.
    """
    model_state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    missing, unexpected = set(model.state_dict()) - set(model_state), set(model_state) - set(model.state_dict())
    if missing or unexpected:
        raise UsageError(f"checkpoint does not match the model: missing {sorted(missing)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    model.load_state_dict(model_state)
    if optimizer is None:
        return
    if meta.get("optimizer") != type(optimizer).__name__:
        raise UsageError(f"checkpoint holds {meta.get('optimizer')!r} state, the optimizer is {type(optimizer).__name__}")
    per_param: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        if name.startswith("optim/"):
            _, index, key = name.split("/", 2)
            per_param.setdefault(int(index), {})[key] = value
    for index, values in meta.get("state_scalars", {}).items():
        per_param.setdefault(int(index), {}).update(values)
    groups = meta["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise UsageError(f"checkpoint has {len(groups)} optimizer param groups, the optimizer {len(optimizer.param_groups)}")
    for saved, live in zip(groups, optimizer.param_groups):
        for key, value in saved.items():  # JSON made tuples lists; give them back their type
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
    try:
        optimizer.load_state_dict({"state": per_param, "param_groups": groups})
    except (ValueError, KeyError) as exc:
        raise UsageError(f"checkpoint does not match the optimizer: {exc}") from None


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
        np_tuple = ("MT19937", key, int(np_state["pos"]), int(np_state["has_gauss"]), float(np_state["cached_gaussian"]))
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


# --- loading -------------------------------------------------------------------

@dataclass(slots=True)
class Loaded:
    """A loaded checkpoint: full logical tensors (CPU), the meta, and this rank's rank_state."""

    path: Path
    step: int
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    rank_state: dict[str, Any] | None
    """This rank's saved state; None on ranks at or beyond the saved world size
    (resuming on more ranks): seed those afresh, e.g. from run.seed and rank."""
    saved_world_size: int
    info: CheckpointInfo
    skipped: list[str] = field(default_factory=list)
    """Why checkpoints committed after it were passed over ('auto' only)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds this rank spent reading and verifying, waiting for the others, exchanging."""


@dataclass(slots=True)
class _Choice:
    """What rank 0 found to load (broadcast to every rank)."""

    candidates: list[tuple[CheckpointInfo, list[CheckpointInfo] | None, str]]
    """Newest first: (checkpoint, its chain or None, why it cannot be loaded or '')."""
    explicit: bool
    """One file was asked for: its failure is an error, not a reason to try an older one."""
    folder: str
    infos: list[CheckpointInfo]
    """The folder's committed checkpoints, in commit order."""
    listing: list[tuple[str, int]]
    """File names and sizes of ``infos``, for comparing with what the other ranks see."""
    stale: list[str]


def _choose(which: str, directory: Path | None) -> _Choice:
    """Rank 0: the checkpoints to try for ``which`` ('auto', a directory or a file)."""
    if which == "auto":
        if directory is None:
            raise UsageError("load('auto') needs the checkpoint directory")
        folder, target = directory, None
    else:
        path = Path(which)
        if not which or not path.exists():
            if path.name.endswith(TMP_SUFFIX) or Path(which + TMP_SUFFIX).exists():
                raise UsageError(f"checkpoint {which!r} was never committed (a save that did not finish)")
            raise UsageError(f"checkpoint {which!r} does not exist")
        if path.name.endswith(TMP_SUFFIX):
            raise UsageError(f"checkpoint {which!r} is an uncommitted (half-written) file; it cannot be loaded")
        folder, target = (path, None) if path.is_dir() else (path.parent, path)
    infos, stale = scan(folder)
    if target is None:
        todo = infos[::-1]
    else:
        info = next((i for i in infos if Path(i.path) == target), None) or read_info(target)
        if info.kind == "unreadable":
            raise UsageError(f"checkpoint {str(target)!r} cannot be read: {info.error}")
        todo = [info]
        infos = [*[i for i in infos if i.path != info.path], info] if info not in infos else infos
    candidates = []
    for info in todo:
        if info.kind == "unreadable":
            candidates.append((info, None, str(info.error)))
            continue
        try:
            candidates.append((info, resolve_chain(infos, info), ""))
        except ValueError as exc:
            candidates.append((info, None, str(exc)))
    return _Choice(candidates, target is not None, str(folder), infos, listing(folder), [str(p) for p in stale])


def _check_same_listing(comm: Any, folder: str, expected: list[tuple[str, int]]) -> None:
    """Collective: every rank must see the committed checkpoints rank 0 listed (a shared directory)."""
    with shared_errors(comm):
        mine = listing(Path(folder))
        if mine != expected:
            import socket

            raise UsageError(
                f"checkpoint directory {folder!r}: rank {comm.Get_rank()} on {socket.gethostname()} sees "
                f"{len(mine)} committed checkpoint(s), rank 0 sees {len(expected)} (other names or sizes): "
                "checkpoint.dir must be one directory shared by every node, not a node-local one")


def _load(comm: Any, which: str, directory: Path | None, fault: IoFault | None) -> tuple[Loaded | None, _Choice]:
    choice = None
    with shared_errors(comm):
        if comm.Get_rank() == 0:
            choice = _choose(which, directory)
    choice = comm.bcast(choice, root=0)
    _check_same_listing(comm, choice.folder, choice.listing)
    for tmp in choice.stale:
        log.warning("ignoring uncommitted checkpoint %s (a save that did not finish)", tmp)
    rejected = []
    for info, chain, why in choice.candidates:
        if chain is not None:
            try:
                result = read_chain(comm, [Path(i.path) for i in chain], uids=[i.uid for i in chain], fault=fault)
            except CheckpointCorrupt as exc:  # damage only: an I/O error is not a reason to go back
                why = str(exc).removeprefix(f"{info.path}: ")
            else:
                return Loaded(Path(info.path), result.attrs["step"], result.tensors, result.meta,
                              result.rank_state, result.attrs["world_size"], info,
                              [f"{i.path}: {w}" for i, w in rejected], result.timings), choice
        if choice.explicit:
            raise agreed(CheckpointCorrupt(f"checkpoint {info.path!r} cannot be loaded: {why}"))
        log.warning("skipping checkpoint %s: %s; trying the previous one", info.path, why)
        rejected.append((info, why))
    if rejected:
        lines = "".join(f"\n  {info.name} (step {info.step}): {why}" for info, why in rejected)
        raise agreed(UsageError(
            f"none of the {len(rejected)} committed checkpoint(s) in {choice.folder!r} can be loaded:{lines}\n"
            "Repair or remove them, or start afresh with checkpoint.move_aside=true, which moves them into "
            f"{choice.folder}/{ASIDE_PREFIX}<time>-fresh-run/ (nothing is deleted)"))
    if which != "auto":
        raise agreed(UsageError(f"no loadable checkpoint in {choice.folder!r}: it holds no committed checkpoint"))
    return None, choice


def load_checkpoint(comm: Any, which: str = "auto", directory: str | Path | None = None, *,
                    fault: IoFault | None = None) -> Loaded | None:
    """Collective: load a checkpoint, verified, on every rank of ``comm`` (any world size).

    Args:
        comm: the ranks that load; each gets the full tensors.
        which: 'auto' (the last committed one in ``directory`` that verifies;
            damaged ones are skipped with a warning; None if the directory holds
            no checkpoint, UsageError listing each one if none loads), a
            directory (the same, but UsageError if it holds none), or a
            checkpoint file (CheckpointCorrupt if it fails verification,
            UsageError if it is missing or uncommitted).
        directory: the checkpoint directory, for 'auto'.
        fault: fault injection (``hpcnet.ckpt_io.IoFault``), or None.

    I/O errors are not damage: they are raised (on every rank) as what they
    are, ``OSError`` with its errno.
    """
    return _load(comm, which, None if directory is None else Path(directory), fault)[0]


# --- the manager -----------------------------------------------------------------

@dataclass(slots=True)
class _Previous:
    """What the next increment is a difference to."""

    info: CheckpointInfo
    base: CheckpointInfo
    spec_digest: str
    plan: Plan
    hashes: dict[int, np.ndarray]
    saves_since_full: int


def _versions() -> dict[str, str]:
    import h5py
    from mpi4py import MPI

    return {"hpcnet": hpcnet.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version,
            "mpi": MPI.Get_library_version().splitlines()[0].strip()}


def _dumps(value: Any, what: str) -> bytes:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} is not JSON-serialisable: {exc}") from None


def _check_shared_directory(comm: Any, directory: Path) -> None:
    """Collective: rank 0 creates ``directory``; every rank must see it, and the same one.

    Rank 0 leaves a file with a random name there: a directory that merely
    exists on every node (node-local /tmp) shows up as ranks that cannot see it.
    """
    error = None
    probe = directory / f".hpcnet-probe-{uuid.uuid4().hex}"
    if comm.Get_rank() == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
        except OSError as exc:
            error = UsageError(f"checkpoint.dir: cannot write to checkpoint directory {str(directory)!r}: "
                               f"{exc.strerror or exc}")
    agree_on_error(comm, error)
    probe = Path(comm.bcast(str(probe), root=0))
    try:
        seen = comm.allgather(probe.exists())
    finally:
        if comm.Get_rank() == 0:
            probe.unlink(missing_ok=True)
    blind = [r for r, ok in enumerate(seen) if not ok]
    if blind:
        raise agreed(UsageError(f"checkpoint.dir: {str(directory)!r} on ranks {blind} is not the directory rank 0 "
                                "writes to; use a file system shared by every node"))


class CheckpointManager:
    """Save, list and load the checkpoints of one directory, collectively over ``comm``.

    Every method is collective: call it on every rank of ``comm`` in the same order.

    Args:
        deadlines: where saves, writes, waits and loads are guarded (``Monitor.deadlines``).
        timeout_s: ``checkpoint.timeout_s``: the deadline of each; 0 derives it (``io_timeout_s``).
    """

    def __init__(self, comm: Any, directory: str | Path, *, keep: int = 3, full_every: int = 4,
                 async_save: bool = True, move_aside: bool = False, fault: IoFault | None = None,
                 deadlines: Any = NULL_DEADLINES, timeout_s: float = 0.0) -> None:
        from mpi4py import MPI

        if keep < 1 or full_every < 1:
            raise ValueError("keep and full_every must be at least 1")
        self.comm = comm
        self.directory = Path(directory)
        self.keep = keep
        self.full_every = full_every
        self.move_aside = move_aside
        """Whether a run may start afresh in a directory of another run's checkpoints by moving them aside."""
        self.fault = fault
        _check_shared_directory(comm, self.directory)
        self.deadlines = deadlines
        self.timeout_s = timeout_s
        self._last_save_s: float | None = None
        """Seconds the last save took, from its start to its commit (the next deadline scales with it)."""
        self.async_save = async_save and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if async_save and not self.async_save and comm.Get_rank() == 0:
            log.warning("MPI was initialised without MPI_THREAD_MULTIPLE: checkpoints are saved synchronously")
        self._io_comm = comm.Dup()  # the writer's own: its collectives never mix with the caller's
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._previous: _Previous | None = None
        self._next_seq: int | None = None
        self.last_timings: dict[str, float] = {}
        """Seconds spent: blocking (in save), snapshot, hash, write, commit (after wait)."""

    # -- saving --

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
             rank_state: dict[str, Any]) -> Path:
        """Collective: checkpoint ``tensors`` at ``step``; return the path it will have once committed.

        Blocks until the previous save is done and this rank's share is copied
        to host memory; with ``async_save`` the rest runs in the background
        (``wait()`` to finish it).  Tensors must be equal on every rank (data
        parallel): each rank writes only its share.  ``meta`` (JSON-able, equal on
        all ranks) gets ``meta["checkpoint"]`` added: step, wall time, world
        size, kind and library versions.  ``rank_state`` (JSON-able) is
        per rank.  JSON turns tuples into lists and keys into strings.
        """
        self._check_open()
        t0 = time.perf_counter()
        self.wait()
        timeout_s = self._deadline_s(sum(t.numel() * t.element_size() for t in tensors.values()
                                         if isinstance(t, torch.Tensor)))
        with self.deadlines.guard("checkpoint.save", timeout_s, what=f"checkpoint.save (step {step})"):
            return self._save(step, tensors, meta, rank_state, t0, timeout_s)

    def _save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], rank_state: dict[str, Any],
              t0: float, timeout_s: float) -> Path:
        comm, rank, size = self.comm, self.comm.Get_rank(), self.comm.Get_size()
        created = comm.bcast(time.time(), root=0)
        seq = self._take_seq()
        specs: list[TensorSpec] = []
        with shared_errors(comm):
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"step must be an integer >= 0, got {step!r}")
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
                specs.append(make_spec(name, dtype_name(tensor), tuple(tensor.shape)))
            check_names_nest([s.name for s in specs])
            spec_digest = sha256_hex(_dumps([s.to_json() for s in specs], "tensors"))
            previous = self._previous
            incremental = (previous is not None and previous.spec_digest == spec_digest
                           and step > previous.info.step and previous.saves_since_full + 1 < self.full_every)
            kind = "incremental" if incremental else "full"
            full_meta = dict(meta)
            full_meta["checkpoint"] = {"step": step, "wall_time_unix": created, "world_size": size, "kind": kind,
                                       "versions": _versions()}
            meta_bytes = _dumps(full_meta, "meta")
            rank_bytes = _dumps(rank_state, "rank_state")
        digests = comm.allgather((step, spec_digest, sha256_hex(meta_bytes)))
        if len(set(digests)) > 1:
            odd = [r for r, d in enumerate(digests) if d != digests[0]]
            raise agreed(ValueError(f"checkpoint save: ranks {odd} pass a different step, tensor list or meta "
                                    "than rank 0"))
        plan = previous.plan if incremental else plan_ownership(specs, size)
        t1 = time.perf_counter()
        with shared_errors(comm):
            # A synchronous save returns only when written: nothing can change the
            # tensors meanwhile, so it writes from them directly where it can.
            arrays = {i: self._snapshot(tensors[specs[i].name], specs[i], piece.block_lo, piece.block_hi,
                                        copy=self.async_save) for i, piece in plan.owned(rank)}
        job = SaveJob(directory=self.directory, step=step, kind=kind, uid=comm.bcast(uuid.uuid4().hex, root=0),
                      created_unix=created, specs=specs, plan=plan, arrays=arrays, meta_bytes=meta_bytes,
                      rank_state_bytes=rank_bytes, keep=self.keep, seq=seq, fault=self.fault)
        if incremental:
            job.parent, job.base, job.prev_hashes = previous.info, previous.base, previous.hashes
        since_full = previous.saves_since_full + 1 if incremental else 0
        self.last_timings = {"snapshot_s": time.perf_counter() - t1}
        # Closed by _write, in the writer thread when async.
        guard = self.deadlines.open("checkpoint.write", timeout_s, what=f"checkpoint.write (step {step})")
        try:
            if self.async_save:
                self._thread = threading.Thread(target=self._write_in_background,
                                                args=(job, spec_digest, since_full, t0, timeout_s, guard),
                                                name="hpcnet-checkpoint", daemon=True)
                self._thread.start()
            else:
                self._write(job, spec_digest, since_full, t0, timeout_s, guard)
        except BaseException:
            self.deadlines.close(guard)
            raise
        self.last_timings["blocking_s"] = time.perf_counter() - t0
        return job.path

    def _deadline_s(self, nbytes: int = 0) -> float:
        return io_timeout_s(self.timeout_s, self._last_save_s, nbytes)

    @staticmethod
    def _snapshot(tensor: torch.Tensor, spec: TensorSpec, block_lo: int, block_hi: int, copy: bool) -> np.ndarray:
        """This rank's rows in the storage dtype: a private host copy, or (``copy=False``) a view where possible."""
        source = tensor.detach()
        if spec.shape:
            lo, hi = spec.block_range_rows(block_lo, block_hi)
            source = source[lo:hi]
        if not copy and source.device.type == "cpu" and source.is_contiguous():
            return to_storage(source)
        host = torch.empty(source.shape, dtype=source.dtype, device="cpu")
        host.copy_(source)
        return to_storage(host)

    def _write(self, job: SaveJob, spec_digest: str, since_full: int, started: float, timeout_s: float,
               guard: Guard | None) -> None:
        try:
            self._previous = None  # a failed save must not become the base of an increment
            result = write_checkpoint(self._io_comm, job, deadlines=self.deadlines, timeout_s=timeout_s)
            base = result.info if job.kind == "full" else job.base
            assert base is not None
            self._previous = _Previous(result.info, base, spec_digest, job.plan, result.hashes, since_full)
            self.last_timings.update(result.timings)
            self.last_timings["bytes"] = result.bytes_written
            self._last_save_s = time.perf_counter() - started
        finally:
            self.deadlines.close(guard)

    def _write_in_background(self, *args: Any) -> None:
        try:
            self._write(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on every rank by wait()
            self._error = exc

    def wait(self) -> None:
        """Collective: finish the save in flight; re-raise its error on every rank."""
        if self._thread is None:
            self._agree_on_write()
            return
        with self.deadlines.guard("checkpoint.wait", self._deadline_s(), what="checkpoint.wait (a background write)"):
            self._thread.join()
            self._thread = None
            self._agree_on_write()

    def _agree_on_write(self) -> None:
        error, self._error = self._error, None
        agree_on_error(self.comm, error)

    # -- listing, starting and loading --

    def committed(self) -> list[CheckpointInfo]:
        """Collective: the committed checkpoints in commit order (unreadable ones with kind 'unreadable')."""
        self._check_open()
        infos = None
        with shared_errors(self.comm):
            if self.comm.Get_rank() == 0:
                infos = scan(self.directory)[0]
        return self.comm.bcast(infos, root=0)

    def load(self, which: str = "auto") -> Loaded | None:
        """Collective: load a checkpoint; see ``load_checkpoint``.  Changes nothing on disk.

        Returns None when ``which='auto'`` finds no checkpoint.  ``Loaded.rank_state``
        is None on ranks beyond the saved world size: seed those afresh.  The
        next save after a load is a full checkpoint.
        """
        self._check_open()
        self.wait()
        with self.deadlines.guard("checkpoint.load", self._deadline_s(self._stored_bytes()), what="checkpoint.load"):
            return load_checkpoint(self.comm, which, self.directory, fault=self.fault)

    def start_fresh(self) -> None:
        """Collective: begin a run that does not resume.

        The directory must hold no committed checkpoint: writing a new run's
        saves among another run's would mix them (retention, ``latest`` and
        ``--resume auto`` would pick across both).  With ``move_aside`` the old
        ones are moved into an ``aside-`` folder first; otherwise this raises
        UsageError saying how to go on.  Nothing is ever deleted here.
        """
        self._check_open()
        self.wait()
        self._claim(self._agreed_infos(), "fresh-run")

    def resume(self, which: str) -> Loaded | None:
        """Collective: load the checkpoint to continue from (``'auto'`` or a path) and settle the directory.

        What the continued run abandons is moved aside, never deleted and never
        picked again by a later ``--resume auto``: after a rollback (a path to an
        older checkpoint of this directory), the checkpoints committed after it;
        after ``'auto'`` passed over damaged ones, those.  Resuming from another
        directory's checkpoint needs this directory empty, as ``start_fresh`` does.
        Returns None when ``'auto'`` finds no checkpoint at all.
        """
        self._check_open()
        self.wait()
        with self.deadlines.guard("checkpoint.load", self._deadline_s(self._stored_bytes()), what="checkpoint.load"):
            loaded, choice = _load(self.comm, which, self.directory, self.fault)
        if Path(choice.folder).resolve() != self.directory.resolve():
            self._claim(self._agreed_infos(), f"resumed-from-{Path(choice.folder).name}")
        elif loaded is not None:
            why = f"rollback-to-step-{loaded.step}" if choice.explicit else "skipped-unloadable"
            self._set_aside(committed_after(choice.infos, loaded.info), why, latest=loaded.info.name)
        return loaded

    def _stored_bytes(self) -> int:
        """Collective: the bytes of the committed checkpoints, which a load reads at most (its deadline)."""
        total = 0
        if self.comm.Get_rank() == 0:
            with contextlib.suppress(OSError):
                with os.scandir(self.directory) as entries:
                    total = sum(e.stat().st_size for e in entries if CKPT_NAME_RE.match(e.name) and e.is_file())
        return self.comm.bcast(total, root=0)

    def _agreed_infos(self) -> list[CheckpointInfo]:
        """Collective: the committed checkpoints (rank 0 reads them), once every rank is seen to list the same."""
        found = None
        with shared_errors(self.comm):
            if self.comm.Get_rank() == 0:
                found = (scan(self.directory)[0], listing(self.directory))
        infos, names = self.comm.bcast(found, root=0)
        _check_same_listing(self.comm, str(self.directory), names)
        return infos

    def _claim(self, infos: list[CheckpointInfo], why: str) -> None:
        """Make the directory this run's: refuse, or move the checkpoints of another run aside."""
        if not infos:
            return
        newest = infos[-1]
        if not self.move_aside:
            raise agreed(UsageError(
                f"checkpoint.dir {str(self.directory)!r} already holds {len(infos)} committed checkpoint(s) of "
                f"another run (the last: {newest.name}, step {newest.step}), and this run does not resume. "
                "Continue that run with --resume auto; or start this one elsewhere with another run.name or "
                "checkpoint.dir; or set checkpoint.move_aside=true to move those checkpoints into "
                f"{self.directory}/{ASIDE_PREFIX}<time>-{why}/ first (nothing is deleted)"))
        self._set_aside(infos, why, latest=None)

    def _set_aside(self, infos: list[CheckpointInfo], why: str, latest: str | None) -> None:
        if not infos:
            return
        self._next_seq = None  # counted again from what stays
        folder = None
        with shared_errors(self.comm):
            if self.comm.Get_rank() == 0:
                try:
                    folder = set_aside(self.directory, infos, why, latest)
                except OSError as exc:
                    raise UsageError(f"checkpoint.dir: cannot move checkpoints aside in {str(self.directory)!r}: "
                                     f"{exc.strerror or exc}") from None
        if self.comm.Get_rank() == 0:
            log.warning("moved %d checkpoint(s) (%s) into %s: %s; nothing was deleted", len(infos),
                        ", ".join(i.name for i in infos), folder, why.replace("-", " "))

    def _take_seq(self) -> int:
        """Collective: the next save's place in the commit order."""
        if self._next_seq is None:
            infos = self.committed()
            self._next_seq = max((i.seq for i in infos if i.kind != "unreadable"), default=0) + 1
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        return seq

    def close(self) -> None:
        """Collective: finish the save in flight and free the writer's communicator (idempotent)."""
        if self._io_comm is None:
            return
        try:
            self.wait()
        finally:
            self._io_comm.Free()
            self._io_comm = None

    def _check_open(self) -> None:
        if self._io_comm is None:
            raise RuntimeError("the CheckpointManager is closed")

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

