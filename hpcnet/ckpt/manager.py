"""The checkpoint manager: save, list and load one directory's checkpoints, collectively (docs/checkpoints.md).

It decides full or incremental saves, snapshots this rank's share of the
tensors, writes it (``hpcnet.ckpt.write``), and settles the directory on a fresh
start or a resume (another run's or abandoned checkpoints are moved aside,
never deleted).  Saves, writes, waits and loads each run in a guard of
``deadlines`` (``hpcnet.fault.watchdog``).

Threads: with ``async_save`` a save's stretches (``hpcnet.ckpt.write``) are
split between two threads.  The collective ones run in the caller's thread:
the first inside ``save``, the others in ``advance``, which the training loop
calls at a step boundary once every rank's background stretch is done (the
boundary's one all-reduce carries that), or in ``wait``.  The local ones
(hashing, writing bytes with pwrite, fsync, rank 0's commit) run in one
background thread, which calls no MPI and opens no parallel HDF5 file, so a
rank never has two threads inside blocking collectives (h5py it uses only for
rank 0's listing of the directory after a commit, short serial reads of
attributes).  Every method of the manager first finishes the save in flight.
"""

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import hpcnet
from hpcnet.agree import agree_on_error, mark_agreed, ranks_differing, shared_errors
from hpcnet.ckpt import direct
from hpcnet.ckpt.fence import own_fence
from hpcnet.ckpt.job import IoFault, SaveJob, SaveResult
from hpcnet.ckpt.listing import listing, scan, set_aside
from hpcnet.ckpt.load import Loaded, load_checkpoint, load_with_choice
from hpcnet.ckpt.schema import (
    BLOCK_BYTES,
    LARGE_BLOCK_BYTES,
    CheckpointInfo,
    PieceAssignment,
    TensorSpec,
    assign_writers,
    check_names_nest,
    committed_after,
    dtype_name,
    make_spec,
    sha256_hex,
    to_storage,
)
from hpcnet.ckpt.sharedfs import check_same_listing, check_shared_directory
from hpcnet.ckpt.write import COLLECTIVE, LOCAL, run_stretches, save_stretches
from hpcnet.errors import UsageError
from hpcnet.fault.watchdog import NULL_DEADLINES, io_timeout_s
from hpcnet.paths import ASIDE_PREFIX, CKPT_NAME_RE

log = logging.getLogger("hpcnet.checkpoint")


@dataclass(slots=True)
class _Previous:
    """What the next increment is a difference to."""

    info: CheckpointInfo
    base: CheckpointInfo
    spec_digest: str
    assignment: PieceAssignment
    hashes: dict[int, np.ndarray]
    saves_since_full: int


@dataclass(eq=False)
class _InFlight:
    """A save being written: its stretches, the background thread of the local one, and what it becomes."""

    job: SaveJob
    stretches: Any
    spec_digest: str
    since_full: int
    timeout_s: float
    thread: threading.Thread | None = None
    error: BaseException | None = None
    """What a local stretch raised unexpectedly (an I/O error is noted by the stretch itself, not raised)."""
    io_s: float = 0.0
    """Seconds its stretches took, waits for step boundaries left out: what the next deadline scales with."""


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


class CheckpointManager:
    """Save, list and load the checkpoints of one directory, collectively over ``comm``.

    Every method is collective: call it on every rank of ``comm`` in the same order.

    Args:
        fault: fault injection (``hpcnet.ckpt.write.IoFault``), or None.
        deadlines: where saves, writes, waits and loads are guarded (``Monitor.deadlines``).
        timeout_s: ``checkpoint.timeout_s``: the deadline of each; 0 derives it (``io_timeout_s``).
        collective_writes: write tensors split across ranks with collective MPI-IO (else
            independently, each rank its rows; ``bench checkpoint`` compares both), where
            ``direct_writes`` does not apply: increments, or ``direct_writes=False``.
        direct_writes: write a full checkpoint's tensor data with pwrite at the datasets' offsets,
            hashed in threads while the disk writes (``hpcnet.ckpt.direct``), not through h5py.
    """

    def __init__(self, comm: Any, directory: str | Path, *, keep: int = 3, full_every: int = 4,
                 async_save: bool = True, move_aside: bool = False, fault: IoFault | None = None,
                 deadlines: Any = NULL_DEADLINES, timeout_s: float = 0.0, collective_writes: bool = True,
                 direct_writes: bool = True) -> None:
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
        self.fence = own_fence()
        """This job's attempt under ``hpcnet.launch``: its commits need it to hold the directory's fence."""
        self.collective_writes = collective_writes
        self.direct_writes = direct_writes
        from hpcnet.world import usable_cores

        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        node_ranks = node.Get_size()
        node.Free()
        self.io_threads = max(1, min(direct.IO_THREADS, len(usable_cores()) // node_ranks))
        """Threads of this rank that write, read and hash: its share of the node's cores, at most IO_THREADS."""
        check_shared_directory(comm, self.directory)
        self.deadlines = deadlines
        self.timeout_s = timeout_s
        self._last_save_s: float | None = None
        """Seconds the last save took, from its start to its commit (the next deadline scales with it)."""
        self.async_save = async_save and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        if async_save and not self.async_save and comm.Get_rank() == 0:
            log.warning("MPI was initialised without MPI_THREAD_MULTIPLE: checkpoints are saved synchronously")
        self._io_comm = comm.Dup()  # the writer's own: its collectives never mix with the caller's
        # mpi4py's first reduction of Python objects on a communicator duplicates it with the GIL held: done here,
        # on every rank at once, so that it never happens inside a save, beside a thread that needs the GIL.
        for warmed in (comm, self._io_comm):
            warmed.allreduce(0)
        self._flight: _InFlight | None = None
        self._previous: _Previous | None = None
        self._next_seq: int | None = None
        self.last_timings: dict[str, float] = {}
        """Seconds spent: blocking (in save), snapshot, hash, write, commit (after wait)."""
        self.on_finished: Callable[[int, dict[str, float]], None] | None = None
        """Called in the training thread with a save's step and timings when it is committed (metrics, TensorBoard)."""

    # -- saving --

    def save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
             rank_state: dict[str, Any], holders: dict[str, int] | None = None) -> Path:
        """Collective: checkpoint ``tensors`` at ``step``; return the path it will have once committed.

        Blocks until the previous save is done and this rank's share is copied
        to host memory; with ``async_save`` the rest runs in the background
        (``wait()`` to finish it).  Tensors must be equal on every rank (data
        parallel): each rank writes only its share.  ``meta`` (JSON-able, equal on
        all ranks) gets ``meta["checkpoint"]`` added: step, wall time, world
        size, kind and library versions.  ``rank_state`` (JSON-able) is
        per rank.  JSON turns tuples into lists and keys into strings.
        ``holders`` (name -> rank, equal on every rank) names tensors that only
        one rank holds (``dist.zero``'s optimizer state): the others pass a
        tensor of the same shape and dtype on the ``meta`` device, and the
        holder writes it whole.
        """
        self._check_open()
        t0 = time.perf_counter()
        self.wait()
        timeout_s = self._deadline_s(sum(t.numel() * t.element_size() for t in tensors.values()
                                         if isinstance(t, torch.Tensor)))
        with self.deadlines.guard("checkpoint.save", timeout_s, what=f"checkpoint.save (step {step})"):
            return self._save(step, tensors, meta, rank_state, t0, timeout_s, holders or {})

    def _save(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any], rank_state: dict[str, Any],
              t0: float, timeout_s: float, holders: dict[str, int]) -> Path:
        comm, rank = self.comm, self.comm.Get_rank()
        created = comm.bcast(time.time(), root=0)
        seq = self._take_seq()
        specs, spec_digest, kind, meta_bytes, rank_bytes = self._describe(step, tensors, meta, rank_state, created,
                                                                          holders)
        odd = ranks_differing(comm, (step, spec_digest, sha256_hex(meta_bytes)))
        if odd:
            raise mark_agreed(ValueError(f"checkpoint save: ranks {odd} pass a different step, tensor list or meta "
                                    "than rank 0"))
        previous = self._previous
        incremental = kind == "incremental"
        fixed = {i: holders[s.name] for i, s in enumerate(specs) if s.name in holders}
        assignment = previous.assignment if incremental else assign_writers(specs, comm.Get_size(), fixed=fixed)
        t1 = time.perf_counter()
        with shared_errors(comm):
            # A synchronous save returns only when written: nothing can change the
            # tensors meanwhile, so it writes from them directly where it can.
            arrays = {i: self._snapshot(tensors[specs[i].name], specs[i], piece.block_lo, piece.block_hi,
                                        copy=self.async_save) for i, piece in assignment.of_rank(rank)}
        job = SaveJob(directory=self.directory, step=step, kind=kind, uid=comm.bcast(uuid.uuid4().hex, root=0),
                      created_unix=created, specs=specs, assignment=assignment, arrays=arrays, meta_bytes=meta_bytes,
                      rank_state_bytes=rank_bytes, keep=self.keep, seq=seq, fault=self.fault,
                      collective_writes=self.collective_writes, direct_writes=self.direct_writes,
                      io_threads=self.io_threads, fence=self.fence)
        if incremental:
            job.parent, job.base, job.prev_hashes = previous.info, previous.base, previous.hashes
        since_full = previous.saves_since_full + 1 if incremental else 0
        self.last_timings = {"snapshot_s": time.perf_counter() - t1}
        self._start_write(job, spec_digest, since_full, t0, timeout_s)
        self.last_timings["blocking_s"] = time.perf_counter() - t0
        return job.path

    def _describe(self, step: int, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                  rank_state: dict[str, Any], created: float, holders: dict[str, int]
                  ) -> tuple[list[TensorSpec], str, str, bytes, bytes]:
        """Collective (for errors): the specs, their digest, the kind of this save, its meta and rank state as JSON."""
        specs: list[TensorSpec] = []
        # Small blocks make increments small; where none will follow, large ones hash faster.
        block_bytes = BLOCK_BYTES if self.full_every > 1 else LARGE_BLOCK_BYTES
        with shared_errors(self.comm):
            if not isinstance(step, int) or step < 0:
                raise ValueError(f"step must be an integer >= 0, got {step!r}")
            for name, tensor in tensors.items():
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
                specs.append(make_spec(name, dtype_name(tensor), tuple(tensor.shape), block_bytes))
            check_names_nest([s.name for s in specs])
            unknown = sorted(set(holders) - {s.name for s in specs})
            if unknown:
                raise ValueError(f"holders names tensors that are not saved: {unknown[:5]}")
            # Who holds what is part of the layout: an increment reuses its parent's assignment.
            spec_digest = sha256_hex(_dumps([[s.to_json() for s in specs], sorted(holders.items())], "tensors"))
            previous = self._previous
            incremental = (previous is not None and previous.spec_digest == spec_digest
                           and step > previous.info.step and previous.saves_since_full + 1 < self.full_every)
            kind = "incremental" if incremental else "full"
            full_meta = dict(meta)
            full_meta["checkpoint"] = {"step": step, "wall_time_unix": created, "world_size": self.comm.Get_size(),
                                       "kind": kind, "versions": _versions()}
            meta_bytes = _dumps(full_meta, "meta")
            rank_bytes = _dumps(rank_state, "rank_state")
        return specs, spec_digest, kind, meta_bytes, rank_bytes

    def _start_write(self, job: SaveJob, spec_digest: str, since_full: int, t0: float, timeout_s: float) -> None:
        """Write ``job``: all of it now when not async; else its first collective stretch now, the rest later."""
        self._previous = None  # a failed save must not become the base of an increment
        flight = _InFlight(job, save_stretches(self._io_comm, job, deadlines=self.deadlines, timeout_s=timeout_s),
                           spec_digest, since_full, timeout_s)
        if not self.async_save:
            with self.deadlines.guard("checkpoint.write", timeout_s, what=f"checkpoint.write (step {job.step})"):
                self._finished(flight, run_stretches(flight.stretches), time.perf_counter() - t0)
            return
        self._flight = flight
        self._collective_stretch(flight)

    def _collective_stretch(self, flight: _InFlight, local_error: bool = False) -> None:
        """Run the save's next collective stretch here (collective), then its local one in the background.

        ``local_error``: first agree on ``flight.error``, what its last local stretch raised on some rank.
        """
        t = time.perf_counter()
        try:
            with self.deadlines.guard("checkpoint.write", flight.timeout_s,
                                      what=f"checkpoint.write (step {flight.job.step})"):
                if local_error:
                    agree_on_error(self._io_comm, flight.error)
                marker = next(flight.stretches)
        except StopIteration as done:
            self._finished(flight, done.value, flight.io_s + time.perf_counter() - t)
            return
        except BaseException:
            self._abandon(flight)
            raise
        assert marker == LOCAL, marker
        flight.io_s += time.perf_counter() - t
        flight.thread = threading.Thread(target=self._local_stretch, args=(flight,), name="hpcnet-checkpoint",
                                         daemon=True)
        flight.thread.start()

    def _local_stretch(self, flight: _InFlight) -> None:
        """The background thread: the save's next local stretch (no MPI, no parallel HDF5), until it wants the ranks."""
        t = time.perf_counter()
        try:
            with self.deadlines.guard("checkpoint.write", flight.timeout_s,
                                      what=f"checkpoint.write (step {flight.job.step})"):
                marker = next(flight.stretches)
            assert marker == COLLECTIVE, marker
        except BaseException as exc:  # noqa: BLE001 - shared by advance() on every rank
            flight.error = exc
        flight.io_s += time.perf_counter() - t

    def _finished(self, flight: _InFlight, result: SaveResult, io_s: float) -> None:
        job = flight.job
        base = result.info if job.kind == "full" else job.base
        assert base is not None
        self._previous = _Previous(result.info, base, flight.spec_digest, job.assignment, result.hashes,
                                   flight.since_full)
        self.last_timings.update(result.timings)
        self.last_timings["bytes"] = result.bytes_written
        self._last_save_s = io_s
        self._flight = None
        if self.on_finished is not None:
            self.on_finished(job.step, {**self.last_timings, "io_s": io_s})

    @property
    def in_flight(self) -> bool:
        """Whether a save is being written (the same on every rank: it changes only in collective calls)."""
        return self._flight is not None

    def busy(self) -> bool:
        """Whether this rank's background stretch of the save in flight is still running (local)."""
        flight = self._flight
        return flight is not None and flight.thread is not None and flight.thread.is_alive()

    def advance(self) -> None:
        """Collective: take the save in flight one collective stretch further, here; call it when no rank is
        ``busy`` (the training loop learns that at its step boundary), or it waits for the background stretch.

        A stretch's failure raises on every rank (agreed), as ``wait`` does.
        """
        flight = self._flight
        if flight is None:
            return
        if flight.thread is not None:
            flight.thread.join()
            flight.thread = None
        self._collective_stretch(flight, local_error=True)

    def _abandon(self, flight: _InFlight) -> None:
        """A save that failed (on every rank, or on this one alone): its stretches are dropped, rank 0 removes
        its file."""
        self._flight = None
        with contextlib.suppress(BaseException):
            flight.stretches.close()
        if self.comm.Get_rank() == 0:
            with contextlib.suppress(OSError):
                flight.job.tmp.unlink(missing_ok=True)

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

    def wait(self) -> None:
        """Collective: finish the save in flight; re-raise its error on every rank."""
        while self._flight is not None:
            flight = self._flight
            if flight.thread is not None:
                with self.deadlines.guard("checkpoint.wait", self._deadline_s(),
                                          what="checkpoint.wait (a background write)"):
                    flight.thread.join()
            self.advance()

    # -- listing, starting and loading --

    def committed(self) -> list[CheckpointInfo]:
        """Collective: the committed checkpoints in commit order (unreadable ones with kind 'unreadable')."""
        self._check_open()
        infos = None
        with shared_errors(self.comm):
            if self.comm.Get_rank() == 0:
                infos = scan(self.directory)[0]
        return self.comm.bcast(infos, root=0)

    def load(self, which: str = "auto", into: dict[str, torch.Tensor] | None = None,
             wanted: Callable[[str], bool] | None = None) -> Loaded | None:
        """Collective: load a checkpoint; see ``load_checkpoint``.  Changes nothing on disk.

        ``into``: tensors to load into in place where they fit (name, CPU, contiguous, shape, dtype), as
        torch.distributed.checkpoint does; the loaded tensors then share their memory.  ``wanted``: the
        tensors this rank takes, by name (None: all).

        Returns None when ``which='auto'`` finds no checkpoint.  ``Loaded.rank_state``
        is None on ranks beyond the saved world size: seed those afresh.  The
        next save after a load is a full checkpoint.
        """
        self._check_open()
        self.wait()
        with self.deadlines.guard("checkpoint.load", self._deadline_s(self._stored_bytes()), what="checkpoint.load"):
            return load_checkpoint(self.comm, which, self.directory, fault=self.fault, into=into,
                                   io_threads=self.io_threads, wanted=wanted)

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

    def resume(self, which: str, wanted: Callable[[str], bool] | None = None,
               into: dict[str, torch.Tensor] | None = None,
               wanted_from_meta: Callable[[dict[str, Any]], Callable[[str], bool] | None] | None = None
               ) -> Loaded | None:
        """Collective: load the checkpoint to continue from (``'auto'`` or a path) and settle the directory.

        What the continued run abandons is moved aside, never deleted and never
        picked again by a later ``--resume auto``: after a rollback (a path to an
        older checkpoint of this directory), the checkpoints committed after it;
        after ``'auto'`` passed over damaged ones, those.  Resuming from another
        directory's checkpoint needs this directory empty, as ``start_fresh`` does.
        Returns None when ``'auto'`` finds no checkpoint at all.  ``wanted``, ``into``: as for ``load`` (a
        checkpoint that fails verification may have overwritten some of ``into`` before the next is tried);
        ``wanted_from_meta``: as for ``hpcnet.ckpt.read.read_chain``.
        """
        self._check_open()
        self.wait()
        with self.deadlines.guard("checkpoint.load", self._deadline_s(self._stored_bytes()), what="checkpoint.load"):
            loaded, choice = load_with_choice(self.comm, which, self.directory, self.fault,
                                              into=into, io_threads=self.io_threads, wanted=wanted,
                                              wanted_from_meta=wanted_from_meta)
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
        check_same_listing(self.comm, str(self.directory), names)
        return infos

    def _claim(self, infos: list[CheckpointInfo], why: str) -> None:
        """Make the directory this run's: refuse, or move the checkpoints of another run aside."""
        if not infos:
            return
        newest = infos[-1]
        if not self.move_aside:
            raise mark_agreed(UsageError(
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
