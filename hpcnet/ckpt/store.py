"""Checkpoint files on disk: the collective parallel-HDF5 write, the verified read, listing.

Writing follows the parallel-HDF5 rules: every rank creates every dataset and
attribute with the same arguments; collective writes only where every rank has
at least one row to write (tensors split across all ranks, the per-rank RNG
table); everything else is written independently by its one owner.  A failed
write does not make a rank leave the sequence of collective calls early: errors
are collected and shared at the end of each phase, so a failure is an error on
every rank, never a hang.

Reading opens committed files with serial h5py (no MPI-IO, no collective, so
nothing can hang), each rank reads and verifies the blocks it owns under a plan
for the *current* world size, and the ranks then exchange the pieces, so every
rank ends with the full logical tensors.
"""

import concurrent.futures
import contextlib
import errno
import json
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcnet.ckpt.format import (DTYPES, FORMAT, FORMAT_VERSION, HASH_NAME, MAX_JSON_BYTES, UID_RE,
                                WRITE_PIECE_BYTES, CheckpointInfo, Plan, TensorSpec, block_hashes, packed_rows, parse_index,
                                plan_ownership, plan_retention, sha256_hex, write_pieces)
from hpcnet.errors import CheckpointCorrupt, RestartableError, errno_of, error_text, os_error
from hpcnet.fault.watchdog import NULL_DEADLINES
from hpcnet.agree import agree_on_error, agreed
from hpcnet.layout import ASIDE_PREFIX, CKPT_NAME_RE, LATEST_NAME, TMP_SUFFIX, checkpoint_name

if TYPE_CHECKING:
    import torch

log = logging.getLogger("hpcnet.checkpoint")

IoFault = Callable[[str, int], None]
"""Fault injection (``hpcnet.faults``): ``fault(phase, step)`` is called where an I/O error can strike
(``"precheck"`` on rank 0 before a save's free-space check, ``"write"`` on every rank while it writes
its data, ``"read"`` on every rank before it opens each file of a load); an OSError it raises fails
the operation as the file system would.  Every rank's writer also calls it at the collective file
create, with ``"arrive"`` before the ranks meet there and ``"create"`` once they met and the create is
announced, just before h5py's create: where a slow or stuck writer is injected."""

PEER_POLL_S = 0.005
"""How often a writer waiting for its peers before a collective file create checks whether they came."""
ANNOUNCE_WAIT_S = 30.0
"""At most this long a writer waits for a heartbeat to announce its collective create: usually one tick, but
an oversubscribed node can starve the monitor thread for seconds, and a create entered unannounced gets its
rank declared dead if it holds the GIL for longer than the heartbeat deadline."""

COLLECTIVE_WRITES = True
"""Write tensors split across ranks with collective MPI-IO (else independently, each rank its rows)."""

# torch dtypes numpy cannot hold: reinterpret their bits as an integer of the same width.
# (torch is imported where used: listing and inspecting checkpoints need no torch.)
_BITS_VIEW = {"bfloat16": ("int16", "<u2"), "bool": ("uint8", "|u1"),
              "float8_e4m3fn": ("uint8", "|u1"), "float8_e5m2": ("uint8", "|u1")}


def dtype_name(tensor: "torch.Tensor") -> str:
    return str(tensor.dtype).removeprefix("torch.")


def to_storage(host: "torch.Tensor") -> np.ndarray:
    """A numpy view, in the storage dtype, of a contiguous CPU tensor."""
    import torch

    name = dtype_name(host)
    if name in _BITS_VIEW:
        view_dtype, storage = _BITS_VIEW[name]
        return host.view(getattr(torch, view_dtype)).numpy().view(storage)
    return host.numpy().view(DTYPES[name][0])


def from_storage(array: np.ndarray, dtype: str) -> "torch.Tensor":
    """The torch tensor (sharing memory) that ``array`` stores for ``dtype``."""
    import torch

    if dtype in _BITS_VIEW:
        view_dtype, _ = _BITS_VIEW[dtype]
        raw = array.view(np.dtype(view_dtype))
        return torch.from_numpy(raw).view(getattr(torch, dtype))
    return torch.from_numpy(array.view(array.dtype.newbyteorder("=")))


# --- writing -----------------------------------------------------------------

@dataclass(slots=True)
class SaveJob:
    """One rank's part of one save, snapshotted to host memory: all the background writer needs."""

    directory: Path
    step: int
    kind: str
    uid: str
    created_unix: float
    specs: list[TensorSpec]
    plan: Plan
    arrays: dict[int, np.ndarray]
    """Tensor index -> this rank's rows of it (storage dtype), for every piece this rank owns."""
    meta_bytes: bytes
    rank_state_bytes: bytes
    keep: int
    seq: int = 0
    """Its place in the directory's commit order."""
    fault: IoFault | None = None
    parent: CheckpointInfo | None = None
    base: CheckpointInfo | None = None
    prev_hashes: dict[int, np.ndarray] | None = None

    @property
    def path(self) -> Path:
        return self.directory / checkpoint_name(self.step)


@dataclass(slots=True)
class SaveResult:
    info: CheckpointInfo
    hashes: dict[int, np.ndarray]
    timings: dict[str, float] = field(default_factory=dict)
    bytes_written: int = 0


def _gather_to_root(comm: Any, local: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
    """Gatherv of uint64/int64 arrays whose per-rank sizes every rank knows; rank 0 gets the concatenation."""
    from mpi4py import MPI

    local = np.ascontiguousarray(local, dtype="<u8")
    if comm.Get_rank() != 0:
        comm.Gatherv(local, None, root=0)
        return None
    out = np.empty(int(counts.sum()), dtype="<u8")
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    comm.Gatherv(local, [out, counts.tolist(), displs.tolist(), MPI.UINT64_T], root=0)
    return out


def _tensor_major(flat: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Reorder rank-major per-(rank, tensor) runs of ``flat`` (counts[rank, tensor]) tensor-major."""
    ends = np.cumsum(counts.reshape(-1))
    starts = ends - counts.reshape(-1)
    size, n = counts.shape
    runs = [flat[starts[r * n + i]:ends[r * n + i]] for i in range(n) for r in range(size)]
    return np.concatenate(runs) if runs else flat[:0]


def check_free_space(directory: Path, needed: int) -> None:
    """Raise OSError(ENOSPC) unless the file system of ``directory`` has ``needed`` bytes free.

    Checked before writing, because running out of space inside the file is
    worse than an error: HDF5 1.10.8 over MPI-IO then fails to close the file
    and the process crashes (SIGSEGV) when the file object is released
    (checked on a full tmpfs).  Quotas (EDQUOT) are invisible to statvfs and
    still fail inside the write.
    """
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({needed / 2**20:.1f} MiB needed, "
                                    f"{free / 2**20:.1f} MiB free)")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(directory: Path, name: str) -> None:
    """Point ``latest`` at ``name`` atomically (for people and scripts; loading scans the directory)."""
    tmp = directory / (LATEST_NAME + TMP_SUFFIX)
    with open(tmp, "w") as handle:
        handle.write(name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, directory / LATEST_NAME)
    _fsync_dir(directory)


def _rows_of_blocks(spec: TensorSpec, blocks: np.ndarray, first_block: int) -> np.ndarray:
    """Row numbers, relative to block ``first_block``, of the rows of (relative) ``blocks``."""
    rows = (blocks[:, None] * spec.block_rows + np.arange(spec.block_rows)[None, :]).reshape(-1)
    return rows[rows < spec.rows - first_block * spec.block_rows]


def _hash_owned(job: SaveJob) -> dict[int, np.ndarray]:
    return {i: block_hashes(array, job.specs[i].block_rows * job.specs[i].row_bytes)
            for i, array in job.arrays.items()}


class _Flusher(threading.Thread):
    """fsyncs a file while its writer hashes: the disk works while the CPU hashes."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="hpcnet-checkpoint-fsync", daemon=True)
        self.path = path
        self.error: OSError | None = None

    def run(self) -> None:
        try:
            _fsync_file(self.path)
        except OSError as exc:
            self.error = exc


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _changed_blocks(comm: Any, job: SaveJob) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """An increment's hashes and changed blocks, before anything is written (collective for errors)."""
    hashes: dict[int, np.ndarray] = {}
    changed: dict[int, np.ndarray] = {}
    error: BaseException | None = None
    try:
        hashes = _hash_owned(job)
        changed = {i: np.flatnonzero(h != job.prev_hashes[i]) for i, h in hashes.items()}  # type: ignore[index]
    except Exception as exc:  # noqa: BLE001 - shared below
        error = exc
    agree_on_error(comm, error)
    return hashes, changed


def _local_counts(job: SaveJob, rank: int, changed: dict[int, np.ndarray]) -> np.ndarray:
    """Per tensor: [blocks (hashes) this rank stores, rows it writes]."""
    local = np.zeros((len(job.specs), 2), dtype=np.int64)
    for i, piece in job.plan.owned(rank):
        spec = job.specs[i]
        if job.kind == "incremental":
            local[i] = len(changed[i]), len(_rows_of_blocks(spec, changed[i], piece.block_lo))
        else:
            lo, hi = spec.block_range_rows(piece.block_lo, piece.block_hi)
            local[i] = piece.block_hi - piece.block_lo, hi - lo
    return local


def _gather_tables(comm: Any, job: SaveJob, counts: np.ndarray, hashes: dict[int, np.ndarray],
                   changed: dict[int, np.ndarray]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Collective: rank 0 gets /hashes (and an increment's /blocks) in file order; others get None."""
    owned = job.plan.owned(comm.Get_rank())
    per_rank = counts[:, :, 0].sum(axis=1)
    empty = np.zeros(0, "<u8")
    if job.kind == "incremental":
        mine = [hashes[i][changed[i]] for i, _ in owned]
    else:  # a rank whose hashing failed still takes part, with zeros
        mine = [hashes[i] if i in hashes else np.zeros(p.block_hi - p.block_lo, "<u8") for i, p in owned]
    all_hashes = _gather_to_root(comm, np.concatenate(mine) if mine else empty, per_rank)
    all_blocks = None
    if job.kind == "incremental":
        numbers = [changed[i] + piece.block_lo for i, piece in owned]
        all_blocks = _gather_to_root(comm, np.concatenate(numbers) if numbers else empty, per_rank)
    if all_hashes is not None:
        all_hashes = _tensor_major(all_hashes, counts[:, :, 0])
        if all_blocks is not None:
            all_blocks = _tensor_major(all_blocks, counts[:, :, 0]).view("<i8")
    return all_hashes, all_blocks


def wait_for_peers(comm: Any) -> None:
    """Collective: return once every rank of ``comm`` got here, polling with the GIL released.

    Called before each collective HDF5 call that holds the GIL (h5py does in
    ``H5Fcreate``/``H5Fopen`` with the MPI-IO driver), so that the wait for a
    slower rank happens here, where the monitor thread keeps beating, and the
    wait inside HDF5 is only the I/O itself.  A non-blocking barrier polled
    with short sleeps, not ``Barrier``: a blocked MPI call busy-polls a core,
    which a slow peer on an oversubscribed node needs.
    """
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(PEER_POLL_S)


def _create_collectively(comm: Any, job: SaveJob, tmp: Path, create: Any, deadlines: Any, timeout_s: float) -> Any:
    """``h5py.File(tmp, "w")`` over MPI-IO, after the ranks met outside HDF5 (see ``wait_for_peers``)."""
    import h5py

    if job.fault is not None:
        job.fault("arrive", job.step)
    # Its own guard, so that a report tells the ranks that wait here from the one they wait for.
    with deadlines.guard("checkpoint.meet", timeout_s, what=f"checkpoint.meet (step {job.step})"):
        wait_for_peers(comm)
    if create is not None:
        # The watchers must know of the create before h5py takes the GIL from the monitor thread.
        create.announced.wait(ANNOUNCE_WAIT_S)
    if job.fault is not None:
        job.fault("create", job.step)
    return h5py.File(tmp, "w", driver="mpio", comm=comm)


def _write_file(comm: Any, job: SaveJob, tmp: Path, counts: np.ndarray, index_bytes: bytes,
                attrs: dict[str, Any], hashes: dict[int, np.ndarray], changed: dict[int, np.ndarray],
                deadlines: Any = NULL_DEADLINES, timeout_s: float = 0.0
                ) -> tuple[int, list[BaseException], dict[int, np.ndarray], dict[str, float]]:
    """Create and fill ``tmp`` (collective); return bytes written, errors, this rank's block hashes, timings.

    Errors are collected, never raised between collective calls.  A full
    checkpoint is hashed after its data are written, while a ``_Flusher``
    thread fsyncs them: hashing during the writes would compete for the CPU
    with MPI's busy-polling in the collective writes (measured: 5x slower
    writes with two ranks on two cores), while during the fsync the CPU idles.

    The create and the structure calls after it hold the GIL (h5py): they run
    in a quiet ``checkpoint.create`` guard of ``deadlines`` (``hpcnet.watchdog``),
    which the heartbeats announce; the data writes and the close release it.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    incremental = job.kind == "incremental"
    owned = job.plan.owned(rank)
    errors: list[BaseException] = []
    written = 0
    width = max(comm.allgather(len(job.rank_state_bytes)))
    rank_row = np.frombuffer(job.rank_state_bytes.ljust(width, b" "), np.uint8)
    rank_hashes = comm.gather(int(block_hashes(rank_row, width)[0]), root=0)
    t_open = time.perf_counter()
    timings: dict[str, float] = {}
    create = deadlines.open("checkpoint.create", timeout_s, what=f"checkpoint.create (step {job.step})",
                            quiet=True)
    try:
        f = _create_collectively(comm, job, tmp, create, deadlines, timeout_s)
    except BaseException:
        deadlines.close(create)
        raise
    try:
        # Structure: the same calls with the same arguments on every rank.
        for key, value in attrs.items():
            f.attrs[key] = value
        n_hashes = int(counts[:, :, 0].sum())
        tables: dict[str, tuple[str, int]] = {"meta": ("u1", len(job.meta_bytes)), "index": ("u1", len(index_bytes)),
                                              "hashes": ("<u8", n_hashes), "rank_state_hashes": ("<u8", size)}
        if incremental:
            tables["blocks"] = ("<i8", n_hashes)
        d_tables = {name: f.create_dataset(name, shape=(n,), dtype=dtype, fill_time="never")
                    for name, (dtype, n) in tables.items()}
        d_rank = f.create_dataset("rank_state", shape=(size, width), dtype="u1", fill_time="never")
        d_tensors: dict[int, Any] = {}
        for i, spec in enumerate(job.specs):
            rows = int(counts[:, i, 1].sum())
            if incremental and rows == 0:
                continue  # nothing changed: no dataset
            shape = (rows, *spec.row_shape) if incremental else spec.shape
            d_tensors[i] = f.create_dataset(f"tensors/{spec.name}", shape=shape, dtype=spec.storage,
                                            fill_time="never")
            if DTYPES[spec.dtype][1]:
                d_tensors[i].attrs["dtype"] = spec.dtype
        deadlines.close(create)
        if job.fault is not None:
            try:
                job.fault("write", job.step)
            except OSError as exc:  # as a failing write would: noted, and the calls go on
                errors.append(exc)
        # Collective writes, where every rank has rows: split tensors of a full
        # checkpoint, in pieces (h5py's lock is held for a whole call), and the rank table.
        for i, spec in enumerate(job.specs):
            if incremental or not job.plan.split[i]:
                continue
            calls = write_pieces(counts[:, i, 1].tolist(), WRITE_PIECE_BYTES // max(1, spec.row_bytes))
            first = int(counts[:rank, i, 1].sum())
            array, d = job.arrays[i], d_tensors[i]
            n = len(array)
            for c in range(calls):
                a, b = c * n // calls, (c + 1) * n // calls
                try:
                    if COLLECTIVE_WRITES:
                        with d.collective:
                            d[first + a:first + b] = array[a:b]
                    else:
                        d[first + a:first + b] = array[a:b]
                    written += array[a:b].nbytes
                except Exception as exc:  # noqa: BLE001 - keep taking part in the calls; shared later
                    errors.append(exc)
        try:
            with d_rank.collective:
                d_rank[rank:rank + 1] = rank_row[None, :]
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        # Independent writes: whole small tensors, packed increments.
        for i, piece in owned:
            spec = job.specs[i]
            if (incremental and counts[rank, i, 1] == 0) or (not incremental and job.plan.split[i]):
                continue
            array, d = job.arrays[i], d_tensors[i]
            try:
                if incremental:
                    data = array[_rows_of_blocks(spec, changed[i], piece.block_lo)] if spec.shape else array[None]
                    first = int(counts[:rank, i, 1].sum())
                    d[first:first + len(data)] = data
                else:
                    data = array
                    d[()] = data
                written += data.nbytes
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
        timings["data_s"] = time.perf_counter() - t_open
        if not incremental:
            t_hash = time.perf_counter()
            flusher = _Flusher(tmp)
            flusher.start()
            try:
                hashes = _hash_owned(job)
            except Exception as exc:  # noqa: BLE001 - _gather_tables sends zeros for it
                errors.append(exc)
            timings["hash_s"] = time.perf_counter() - t_hash
            flusher.join()
            timings["flush_s"] = time.perf_counter() - t_hash
            if flusher.error is not None:
                errors.append(flusher.error)
        all_hashes, all_blocks = _gather_tables(comm, job, counts, hashes, changed)
        if rank == 0:  # rank 0's tables, independently
            data = {"meta": np.frombuffer(job.meta_bytes, np.uint8), "index": np.frombuffer(index_bytes, np.uint8),
                    "hashes": all_hashes, "rank_state_hashes": np.array(rank_hashes, dtype="<u8"),
                    "blocks": all_blocks}
            for name, d in d_tables.items():
                try:
                    if len(data[name]):
                        d[...] = data[name]
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)
    finally:
        deadlines.close(create)
        try:
            f.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    try:
        _fsync_file(tmp)  # each rank flushes its own writes (it matters on parallel file systems)
    except OSError as exc:
        errors.append(exc)
    timings["close_fsync_s"] = time.perf_counter() - t_open - timings["data_s"] - timings.get("flush_s", 0.0)
    return written, errors, hashes, timings


def _write_error(tmp: Path, errors: list[BaseException]) -> OSError | None:
    """One error for a failed write, keeping the errno (ENOSPC, EDQUOT, EIO) that decides the exit status.

    The first error with an errno wins: a full disk often shows first as an
    HDF5 error without one, and the errno tells a full disk (fix it) from an
    I/O error (restart).
    """
    if not errors:
        return None
    first = next((e for e in errors if errno_of(e)), errors[0])
    return os_error(errno_of(first), f"writing checkpoint {str(tmp)!r} failed: {error_text(first)}")


def write_checkpoint(comm: Any, job: SaveJob, *, deadlines: Any = NULL_DEADLINES, timeout_s: float = 0.0
                     ) -> SaveResult:
    """Collective over ``comm``: hash, write, fsync, commit and prune one checkpoint.

    Any failure raises on every rank (agreed), and the temporary file is removed.

    Args:
        deadlines: where the collective create is guarded (``hpcnet.watchdog``), with ``timeout_s``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    incremental = job.kind == "incremental"
    t0 = time.perf_counter()
    hashes: dict[int, np.ndarray] = {}
    changed: dict[int, np.ndarray] = {}
    if incremental:  # what to write depends on the hashes; a full checkpoint hashes while writing
        hashes, changed = _changed_blocks(comm, job)
    counts = np.empty((size, len(job.specs), 2), dtype=np.int64)
    comm.Allgather(_local_counts(job, rank, changed), counts)
    n_hashes = counts[:, :, 0].sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(n_hashes)[:-1]]).astype(np.int64)
    index = [dict(spec.to_json(), hash_offset=int(offsets[i]), n_hashes=int(n_hashes[i]))
             for i, spec in enumerate(job.specs)]
    index_bytes = json.dumps(index, separators=(",", ":")).encode()
    attrs = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": job.kind, "step": job.step, "uid": job.uid,
        "parent": job.parent.name if incremental else "", "parent_uid": job.parent.uid if incremental else "",
        "base": job.base.name if incremental else "", "base_uid": job.base.uid if incremental else "",
        "world_size": size, "hash": HASH_NAME, "created_unix": job.created_unix,
        "index_sha256": sha256_hex(index_bytes), "meta_sha256": sha256_hex(job.meta_bytes), "seq": job.seq,
    }
    tmp = job.path.with_name(job.path.name + TMP_SUFFIX)
    error: BaseException | None = None
    if rank == 0:  # a plain create first: one clear error rather than MPI-IO errors on some ranks
        try:
            if job.fault is not None:
                job.fault("precheck", job.step)
            data_bytes = sum(int(counts[:, i, 1].sum()) * s.row_bytes for i, s in enumerate(job.specs))
            check_free_space(job.directory, data_bytes + len(job.meta_bytes) + len(index_bytes) + (1 << 20))
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        except OSError as exc:
            error = os_error(errno_of(exc), f"cannot create checkpoint file {str(tmp)!r}: {error_text(exc)}")
    agree_on_error(comm, error)
    t1 = time.perf_counter()
    written, errors, hashes, file_timings = _write_file(comm, job, tmp, counts, index_bytes, attrs, hashes, changed,
                                                        deadlines, timeout_s)
    error = _write_error(tmp, errors)
    try:
        agree_on_error(comm, error)
    except BaseException:
        if rank == 0:
            tmp.unlink(missing_ok=True)
        raise
    t2 = time.perf_counter()
    if rank == 0:
        try:
            os.replace(tmp, job.path)
            _fsync_dir(job.directory)
            write_latest(job.directory, job.path.name)
        except OSError as exc:
            error = os_error(errno_of(exc), f"committing checkpoint {str(job.path)!r} failed: {error_text(exc)}")
        else:
            prune(job.directory, job.keep)
    agree_on_error(comm, error)
    info = CheckpointInfo(step=job.step, path=str(job.path), kind=job.kind, uid=job.uid,
                          base=attrs["base"] or None, parent=attrs["parent"] or None, base_uid=attrs["base_uid"],
                          parent_uid=attrs["parent_uid"], world_size=size, seq=job.seq,
                          created_unix=job.created_unix)
    timings = {"prepare_s": t1 - t0, "write_s": t2 - t1, "commit_s": time.perf_counter() - t2, **file_timings}
    return SaveResult(info, hashes, timings, comm.allreduce(written))


def prune(directory: Path, keep: int) -> list[str]:
    """Delete what ``plan_retention`` says and stale temporary files (rank 0 only; never raises)."""
    removed = []
    infos, stale = scan(directory)
    for item in [*plan_retention(infos, keep), *stale]:
        path = Path(item.path) if isinstance(item, CheckpointInfo) else item
        try:
            path.unlink()
            removed.append(path.name)
        except OSError as exc:
            log.warning("could not delete old checkpoint %s: %s", path, exc.strerror or exc)
    if removed:
        log.info("deleted %s", ", ".join(removed))
    return removed


# --- listing -----------------------------------------------------------------

_ATTR_TYPES: dict[str, type] = {
    "format": str, "format_version": int, "kind": str, "step": int, "uid": str, "parent": str,
    "parent_uid": str, "base": str, "base_uid": str, "world_size": int, "hash": str,
    "created_unix": float, "index_sha256": str, "meta_sha256": str,
}


_OPTIONAL_ATTRS: dict[str, tuple[type, Any]] = {"seq": (int, 0)}
"""Attributes that files of older hpcnet versions lack, with the value that stands in for them."""


def _attr(f: Any, key: str, kind: type) -> Any:
    if f.attrs.get_id(key).get_storage_size() > 1024:  # before reading it: a crafted file may hold gigabytes
        raise ValueError(f"attribute {key!r} is too large")
    value = f.attrs[key]
    if kind is str:
        if not isinstance(value, str) or len(value) > 256:
            raise ValueError(f"attribute {key!r} is not a short string")
    elif kind is int:
        if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
            raise ValueError(f"attribute {key!r} is not an integer")
        value = int(value)
    elif not isinstance(value, (float, np.floating)):
        raise ValueError(f"attribute {key!r} is not a number")
    return kind(value)


def read_attrs(f: Any, path: Path) -> dict[str, Any]:
    """The validated root attributes of an open checkpoint; ValueError names what is wrong."""
    out: dict[str, Any] = {}
    for key, kind in _ATTR_TYPES.items():
        if key not in f.attrs:
            raise ValueError(f"attribute {key!r} is missing (not an hpcnet checkpoint?)")
        out[key] = _attr(f, key, kind)
    for key, (kind, default) in _OPTIONAL_ATTRS.items():
        out[key] = _attr(f, key, kind) if key in f.attrs else default
    if out["format"] != FORMAT or out["format_version"] != FORMAT_VERSION:
        raise ValueError(f"format {out['format']!r} version {out['format_version']} is not "
                         f"{FORMAT!r} version {FORMAT_VERSION}")
    if out["kind"] not in ("full", "incremental") or out["hash"] != HASH_NAME:
        raise ValueError(f"unknown kind {out['kind']!r} or hash {out['hash']!r}")
    if (not 0 <= out["step"] < 10**19 or not 1 <= out["world_size"] <= 1 << 24 or not UID_RE.match(out["uid"])
            or not 0 <= out["seq"] < 2**62 or not math.isfinite(out["created_unix"])):
        raise ValueError("step, world_size, uid, seq or created_unix out of range")
    for key in ("parent", "base"):
        if out["kind"] == "incremental" and not (CKPT_NAME_RE.match(out[key]) and UID_RE.match(out[key + "_uid"])):
            raise ValueError(f"attribute {key!r} is not a checkpoint name")
    if not all(len(out[k]) == 64 and all(c in "0123456789abcdef" for c in out[k])
               for k in ("index_sha256", "meta_sha256")):
        raise ValueError("index or meta checksum attribute malformed")
    return out


def open_read(path: Path) -> Any:
    """Open a checkpoint with serial h5py, read-only, no file locks (committed files never change)."""
    import h5py

    return h5py.File(path, "r", locking=False)


def read_info(path: Path) -> CheckpointInfo:
    """The root attributes of one checkpoint file; ``kind='unreadable'`` with ``error`` if it fails."""
    match = CKPT_NAME_RE.match(path.name)
    step = int(match.group(1)) if match else -1
    try:
        with open_read(path) as f:
            a = read_attrs(f, path)
    except Exception as exc:  # noqa: BLE001 - an unreadable file is listed, not fatal
        return CheckpointInfo(step=step, path=str(path), kind="unreadable", error=f"{type(exc).__name__}: {exc}")
    return CheckpointInfo(step=a["step"], path=str(path), kind=a["kind"], base=a["base"] or None,
                          parent=a["parent"] or None, uid=a["uid"], parent_uid=a["parent_uid"],
                          base_uid=a["base_uid"], world_size=a["world_size"], seq=a["seq"],
                          created_unix=a["created_unix"])


def scan(directory: Path) -> tuple[list[CheckpointInfo], list[Path]]:
    """Committed checkpoints in ``directory`` in commit order (oldest first) and uncommitted ``.tmp`` files."""
    committed, stale = [], []
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return [], []
    for entry in entries:
        if CKPT_NAME_RE.match(entry):
            committed.append(read_info(directory / entry))
        elif entry.endswith(TMP_SUFFIX) and CKPT_NAME_RE.match(entry.removesuffix(TMP_SUFFIX)):
            stale.append(directory / entry)
    return sorted(committed, key=lambda i: i.commit_order), stale


def listing(directory: Path) -> list[tuple[str, int]]:
    """Names and sizes of the committed checkpoints in ``directory``, by name (cheap: no file is opened)."""
    try:
        entries = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        if CKPT_NAME_RE.match(entry):
            try:
                out.append((entry, os.stat(directory / entry).st_size))
            except FileNotFoundError:
                continue  # deleted while listing
    return out


def set_aside(directory: Path, infos: list[CheckpointInfo], why: str, latest: str | None) -> Path:
    """Move committed checkpoints into a new ``<directory>/aside-<UTC time>-<why>/`` (rank 0; nothing deleted).

    ``latest`` then names the newest checkpoint left (or is removed when none
    is).  Renames within one directory tree are atomic and copy nothing.
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    folder = directory / f"{ASIDE_PREFIX}{stamp}-{why}"
    suffix = 1
    while folder.exists():
        suffix += 1
        folder = directory / f"{ASIDE_PREFIX}{stamp}-{why}-{suffix}"
    folder.mkdir()
    (folder / "README.txt").write_text(
        f"hpcnet moved these {len(infos)} checkpoint(s) out of {directory} at {stamp} UTC ({why}).\n"
        "They are complete; to continue from one, pass it to --resume (or move it back).\n")
    for info in infos:
        os.rename(info.path, folder / info.name)
    if latest is not None:
        write_latest(directory, latest)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.rename(directory / LATEST_NAME, folder / LATEST_NAME)
    _fsync_dir(folder)
    _fsync_dir(directory)
    return folder


# --- reading -----------------------------------------------------------------

@dataclass(slots=True)
class ReadResult:
    tensors: dict[str, "torch.Tensor"]
    meta: dict[str, Any]
    rank_state: dict[str, Any] | None
    attrs: dict[str, Any]
    timings: dict[str, float] = field(default_factory=dict)


def _check_links(f: Any) -> None:
    """Raise ValueError at the first soft or external link: a checkpoint is one file of hard links.

    An external link would make a read open another file, a soft link read
    another object than the one named.
    """
    import h5py

    found: list[str] = []

    def visit(name: str, link: Any) -> bool | None:
        if not isinstance(link, h5py.HardLink):
            found.append(f"/{name} is {'an external' if isinstance(link, h5py.ExternalLink) else 'a soft'} link")
            return True  # stop the walk
        return None

    f.visititems_links(visit)
    if found:
        raise ValueError(f"{found[0]}, which hpcnet checkpoints never hold")


def _checked(f: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The dataset ``name``, if it is a plain one of this shape and dtype, all of it stored in this file.

    Checked before anything is read or allocated, so a crafted file cannot make
    a reader allocate what the file does not hold: no filters (they would load
    plugins), no external or virtual storage (other files), no chunks, and the
    stored bytes are exactly what the shape declares and lie inside the file.
    """
    import h5py

    d = f.get(name)
    if not isinstance(d, h5py.Dataset):
        raise ValueError("missing or not a dataset")
    if d.shape != shape or d.dtype != dtype:
        raise ValueError(f"has shape {d.shape} and dtype {d.dtype}, expected {shape} and {dtype}")
    plist = d.id.get_create_plist()
    if d.is_virtual or plist.get_nfilters() or plist.get_external_count():
        raise ValueError("uses filters, external or virtual storage, which hpcnet checkpoints never do")
    if plist.get_layout() not in (h5py.h5d.CONTIGUOUS, h5py.h5d.COMPACT):
        raise ValueError("is chunked, which hpcnet checkpoints never are")
    declared = math.prod(shape) * dtype.itemsize
    stored = d.id.get_storage_size()
    if stored != declared:
        raise ValueError(f"declares {declared} bytes but the file stores {stored}")
    offset = d.id.get_offset() if declared and plist.get_layout() == h5py.h5d.CONTIGUOUS else None
    if offset is not None and offset + declared > f.id.get_filesize():
        raise ValueError(f"declares {declared} bytes at offset {offset}, beyond the end of the file")
    return d


def read_json(f: Any, name: str, digest: str, limit: int = MAX_JSON_BYTES) -> Any:
    """Read a uint8 JSON dataset, check its sha256 against ``digest``, parse it with json.loads only."""
    import h5py

    d = f.get(name)
    if not isinstance(d, h5py.Dataset) or d.ndim != 1 or d.dtype != np.uint8 or d.shape[0] > limit:
        raise ValueError("missing, of the wrong type, or too large")
    raw = _checked(f, name, d.shape, np.dtype(np.uint8))[()].tobytes()
    if sha256_hex(raw) != digest:
        raise ValueError("checksum mismatch")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"is not valid JSON ({type(exc).__name__})") from None


def read_header(f: Any, path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Validated root attributes, links and index of an open checkpoint."""
    attrs = read_attrs(f, path)
    _check_links(f)
    try:
        index = parse_index(read_json(f, "index", attrs["index_sha256"]), attrs["kind"])
    except ValueError as exc:
        raise ValueError(f"dataset /index: {exc}") from None
    if attrs["kind"] == "full":
        declared = sum(e["spec"].nbytes for e in index)
        if declared > f.id.get_filesize():
            raise ValueError(f"/index declares {declared} bytes of tensors, but the file has only "
                             f"{f.id.get_filesize()} bytes")
    return attrs, index


def _verify(got: np.ndarray, want: np.ndarray, spec: TensorSpec, blocks: np.ndarray) -> None:
    bad = np.flatnonzero(got != want)
    if len(bad):
        lo, hi = spec.block_range_rows(int(blocks[bad[0]]), int(blocks[bad[0]]) + 1)
        raise ValueError(f"checksum mismatch in {len(bad)} block(s), first at rows {lo}-{hi - 1}")


def _read_owned(f: Any, attrs: dict[str, Any], index: list[dict[str, Any]], owned: list, out: dict[int, np.ndarray],
                file_hashes: np.ndarray, file_blocks: np.ndarray | None) -> None:
    """Read (and verify) this rank's pieces from one file of a chain into ``out``.

    A full file's pieces are hashed by a worker thread while the next is read.
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcnet-checkpoint-verify") as pool:
        checks: list[tuple[str, TensorSpec, np.ndarray, np.ndarray, Any]] = []
        try:
            _read_pieces(f, attrs, index, owned, out, file_hashes, file_blocks, pool, checks)
        finally:
            for dataset, spec, blocks, want, future in checks:
                try:
                    _verify(future.result(), want, spec, blocks)
                except ValueError as exc:
                    raise ValueError(f"dataset {dataset}: {exc}") from None


def _read_pieces(f: Any, attrs: dict[str, Any], index: list[dict[str, Any]], owned: list, out: dict[int, np.ndarray],
                 file_hashes: np.ndarray, file_blocks: np.ndarray | None, pool: Any, checks: list) -> None:
    for i, piece in owned:
        entry = index[i]
        spec: TensorSpec = entry["spec"]
        dataset = f"/tensors/{spec.name}"
        try:
            block_bytes = spec.block_rows * spec.row_bytes
            hashes = file_hashes[entry["hash_offset"]:entry["hash_offset"] + entry["n_hashes"]]
            target = out[i].reshape(spec.rows, *spec.row_shape)
            if attrs["kind"] == "full":
                d = _checked(f, dataset, spec.shape, spec.storage)
                lo, hi = spec.block_range_rows(piece.block_lo, piece.block_hi)
                if spec.shape:
                    d.read_direct(target, np.s_[lo:hi], np.s_[lo:hi])
                else:
                    target[0] = d[()]
                blocks = np.arange(piece.block_lo, piece.block_hi)
                checks.append((dataset, spec, blocks, hashes[blocks],
                               pool.submit(block_hashes, target[lo:hi], block_bytes)))
                continue
            if entry["n_hashes"] == 0:
                continue
            numbers = file_blocks[entry["hash_offset"]:entry["hash_offset"] + entry["n_hashes"]]
            if np.any(numbers < 0) or np.any(numbers >= spec.n_blocks) or np.any(np.diff(numbers) <= 0):
                raise ValueError("/blocks of this tensor are not increasing block numbers")
            a, b = np.searchsorted(numbers, [piece.block_lo, piece.block_hi])
            if a == b:
                continue
            d = _checked(f, dataset, (packed_rows(spec, numbers), *spec.row_shape), spec.storage)
            mine = numbers[a:b]
            packed = d[a * spec.block_rows:a * spec.block_rows + packed_rows(spec, mine)]
            got = np.empty(len(mine), dtype="<u8")
            for k, block in enumerate(mine):
                lo, hi = spec.block_range_rows(int(block), int(block) + 1)
                rows = packed[k * spec.block_rows:k * spec.block_rows + hi - lo]
                got[k] = block_hashes(rows, block_bytes)[0]
                target[lo:hi] = rows
            _verify(got, hashes[a:b], spec, mine)
        except Exception as exc:  # noqa: BLE001 - reported with file and dataset by the caller
            raise ValueError(f"dataset {dataset}: {exc}") from None


def _allgatherv_inplace(comm: Any, buffer: np.ndarray, counts: list[int], displs: list[int]) -> None:
    """Allgatherv of byte ranges of ``buffer`` in place, in units large enough for MPI's int counts."""
    from mpi4py import MPI

    if comm.Get_size() == 1 or not any(counts):
        return
    # Plain bytes where the counts fit an int: Open MPI moves one huge derived
    # element at half the speed (measured here).
    unit = 1 if max(max(counts), max(displs)) < 2**31 else math.gcd(*counts, *displs)
    if max(max(counts), max(displs)) // unit >= 2**31:
        raise ValueError("piece too large for one MPI call")
    datatype = MPI.BYTE if unit == 1 else MPI.BYTE.Create_contiguous(unit).Commit()
    try:
        comm.Allgatherv(MPI.IN_PLACE, [buffer.reshape(-1).view(np.uint8), [c // unit for c in counts],
                                       [d // unit for d in displs], datatype])
    finally:
        if unit != 1:
            datatype.Free()


def _read_failure(path: Path, exc: BaseException) -> BaseException:
    """What a failed read of ``path`` was: damage to the file, an I/O error, or not enough memory.

    Only damage (a checksum, a structure that HDF5 or the checks reject) is
    ``CheckpointCorrupt``, which a resume may skip for an older checkpoint; an
    I/O error keeps its errno (EIO restarts, ENOENT and EACCES are for the
    user to fix) and anything else is raised as what it is.
    """
    if isinstance(exc, (MemoryError, RestartableError, CheckpointCorrupt)):
        return exc
    code = errno_of(exc)
    if isinstance(exc, OSError) and code:
        gone = " (it was listed a moment ago: is another job changing the directory?)" \
            if code == errno.ENOENT else ""
        return os_error(code, f"reading checkpoint {str(path)!r} failed: {error_text(exc)}{gone}")
    if isinstance(exc, (ValueError, KeyError, OSError)) or type(exc) is RuntimeError:
        return CheckpointCorrupt(f"{path}: {exc}")  # our checks, or HDF5 rejecting the structure
    return exc


def _raise_read_failure(path: Path, exc: Exception) -> None:
    failure = _read_failure(path, exc)
    if failure is exc:
        raise exc
    raise failure from exc


def _read_headers(chain: list[Path], uids: list[str] | None, fault: IoFault | None
                  ) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Every file's validated header; the chain must hold one set of tensors and, if given, these uids."""
    headers = []
    for path in chain:
        try:
            if fault is not None:
                fault("read", -1)
            with open_read(path) as f:
                headers.append(read_header(f, path))
        except Exception as exc:  # noqa: BLE001 - classified
            _raise_read_failure(path, exc)
    specs = [e["spec"] for e in headers[-1][1]]
    for path, (attrs, index) in zip(chain, headers):
        if [e["spec"] for e in index] != specs:
            raise CheckpointCorrupt(f"{path}: holds other tensors than {chain[-1].name} (a broken chain)")
    read = [attrs["uid"] for attrs, _ in headers]
    if uids is not None and read != uids:
        changed = [p.name for p, a, b in zip(chain, uids, read) if a != b]
        raise RestartableError(f"checkpoint {', '.join(changed)} was replaced after it was listed "
                               "(is another job writing to the checkpoint directory?)")
    return headers


def _read_rank_state(f: Any, attrs: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """This rank's saved RNG/loader state, None beyond the saved world size."""
    if rank >= attrs["world_size"]:
        return None
    table = f.get("rank_state")
    width = table.shape[1] if table is not None and table.ndim == 2 else -1
    try:
        row = _checked(f, "rank_state", (attrs["world_size"], width), np.dtype(np.uint8))[rank]
        want = _checked(f, "rank_state_hashes", (attrs["world_size"],), np.dtype("<u8"))[rank]
        if block_hashes(row, width)[0] != want:
            raise ValueError(f"checksum mismatch in row {rank}")
        state = json.loads(row.tobytes().decode("utf-8"))
        if not isinstance(state, dict):
            raise ValueError(f"row {rank} is not a JSON object")
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"dataset /rank_state: {exc}") from None
    return state


def _read_local(chain: list[Path], headers: list, plan: Plan, rank: int) -> tuple[dict[int, np.ndarray], ReadResult]:
    """This rank's verified pieces of every tensor (in full-size buffers), the meta and its rank state."""
    specs = [e["spec"] for e in headers[-1][1]]
    owned = plan.owned(rank)
    # Every size was checked against the base file's own size by read_header, so
    # a crafted /index cannot make this allocate what the file does not hold.
    out = {i: np.empty(spec.shape, dtype=spec.storage) for i, spec in enumerate(specs)}
    for path, (attrs, index) in zip(chain, headers):
        try:
            with open_read(path) as f:
                file_hashes = _checked(f, "hashes", (sum(e["n_hashes"] for e in index),), np.dtype("<u8"))[()]
                file_blocks = None
                if attrs["kind"] == "incremental":
                    file_blocks = _checked(f, "blocks", file_hashes.shape, np.dtype("<i8"))[()]
                _read_owned(f, attrs, index, owned, out, file_hashes, file_blocks)
                if path != chain[-1]:
                    continue
                try:
                    meta = read_json(f, "meta", attrs["meta_sha256"])
                except ValueError as exc:
                    raise ValueError(f"dataset /meta: {exc}") from None
                if not isinstance(meta, dict):
                    raise ValueError("dataset /meta: not a JSON object")
                result = ReadResult({}, meta, _read_rank_state(f, attrs, rank), attrs)
        except Exception as exc:  # noqa: BLE001 - classified
            _raise_read_failure(path, exc)
    return out, result


def read_chain(comm: Any, chain: list[Path], *, uids: list[str] | None = None,
               fault: IoFault | None = None) -> ReadResult:
    """Collective: read the chain (full base first, increments after), verify it, return full tensors.

    Args:
        comm: the ranks that read; each verifies its share and all exchange.
        chain: the files, base first.
        uids: the uids the listing gave these files; a file replaced since is an error.
        fault: fault injection (``IoFault``), or None.

    Raises, on every rank alike: ``CheckpointCorrupt`` (a checksum or the
    structure; the message names file and dataset), an ``OSError`` with its
    errno for an I/O error, ``RestartableError`` when a file was replaced after
    it was listed or ranks read different files, or what else went wrong.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    t_start = time.perf_counter()
    error = None
    try:
        headers = _read_headers(chain, uids, fault)
        plan = plan_ownership([e["spec"] for e in headers[-1][1]], size)
        out, result = _read_local(chain, headers, plan, rank)
    except BaseException as exc:  # noqa: BLE001 - shared below, so every rank raises alike
        error = exc
    t_read = time.perf_counter()
    agree_on_error(comm, error)
    # Every rank opened the files itself: they must have read the same ones.
    seen = [(p.name, a["uid"], a["index_sha256"], a["meta_sha256"]) for p, (a, _) in zip(chain, headers)]
    views = comm.allgather(sha256_hex(repr(seen).encode()))
    if len(set(views)) > 1:
        odd = [r for r, v in enumerate(views) if v != views[0]]
        raise agreed(RestartableError(f"ranks {odd} read other files than rank 0 for {chain[-1]} (was a file "
                                      "replaced while loading, or is the directory not shared?)"))
    specs = [e["spec"] for e in headers[-1][1]]
    t_agreed = time.perf_counter()
    t_split = _exchange(comm, plan, specs, out)
    result.tensors = {spec.name: from_storage(out[i], spec.dtype).reshape(spec.shape) for i, spec in enumerate(specs)}
    result.timings = {"read_verify_s": t_read - t_start, "wait_s": t_agreed - t_read,
                      "exchange_s": time.perf_counter() - t_agreed, "exchange_split_s": t_split}
    return result


def _exchange(comm: Any, plan: Plan, specs: list[TensorSpec], out: dict[int, np.ndarray]) -> float:
    """Collective: give every rank the pieces the others read; return the seconds spent on split tensors.

    Each split tensor is exchanged in place; whole small tensors are packed into one buffer.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    small = [i for i in range(len(specs)) if not plan.split[i] and plan.pieces[i]]
    t_split = time.perf_counter()
    for i, spec in enumerate(specs):
        if plan.split[i]:
            ranges = [spec.block_range_rows(p.block_lo, p.block_hi) for p in plan.pieces[i]]
            _allgatherv_inplace(comm, out[i], [(hi - lo) * spec.row_bytes for lo, hi in ranges],
                                [lo * spec.row_bytes for lo, _ in ranges])
    t_split = time.perf_counter() - t_split
    if size > 1 and small:
        by_rank: list[list[int]] = [[] for _ in range(size)]
        for i in small:
            by_rank[plan.pieces[i][0].rank].append(i)
        counts = [sum(specs[i].nbytes for i in ids) for ids in by_rank]
        displs = [sum(counts[:r]) for r in range(size)]
        packed = np.empty(sum(counts), dtype=np.uint8)
        pos = displs[rank]
        for i in by_rank[rank]:
            packed[pos:pos + specs[i].nbytes] = out[i].reshape(-1).view(np.uint8)
            pos += specs[i].nbytes
        _allgatherv_inplace(comm, packed, counts, displs)
        for r, ids in enumerate(by_rank):
            pos = displs[r]
            for i in ids:
                out[i].reshape(-1).view(np.uint8)[:] = packed[pos:pos + specs[i].nbytes]
                pos += specs[i].nbytes
    return t_split
