"""The collective part of a checkpoint file's save: its create over MPI-IO, and what the ranks exchange around it.

Every rank creates every dataset and attribute with the same arguments
(``create_file``, collective, over MPI-IO), rank 0 allocates the file's space
(``_reserve``), the ranks note where the datasets lie, and the file is closed
again: the datasets are contiguous and allocated at create, so their bytes are
written afterwards with ``pwrite`` at their offsets, by code that calls neither
MPI nor HDF5 (``hpcnet.ckpt.local``).  That split is what lets a save go on in
a background thread while training runs: the thread never enters MPI, so a rank
never has two threads inside blocking collectives at once
(``hpcnet.ckpt.write``), and a full disk fails a ``pwrite`` with its errno
instead of an HDF5 write inside an open MPI-IO file.  Here too: the file's
layout (``file_layout``, ``file_bytes``) and the tables the ranks gather
(``rank_table``, ``gather_tables``).

With ``job.direct_writes`` off (a benchmark's comparison) the tensors are
written through h5py instead, collectively where every rank has rows, while
the file is open.  A failed write never makes a rank leave the sequence of
collective calls early: errors are collected and returned, and
``hpcnet.ckpt.write`` shares them.
"""

import contextlib
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from hpcnet.ckpt import direct, h5nogil
from hpcnet.ckpt.job import SaveJob
from hpcnet.ckpt.local import Offsets, rows_of_blocks
from hpcnet.ckpt.schema import DTYPES, WRITE_PIECE_BYTES, block_hashes, write_pieces
from hpcnet.errors import errno_of, error_text, os_error
from hpcnet.fault.watchdog import NULL_DEADLINES
from hpcnet.world import wait_sleeping

log = logging.getLogger("hpcnet.checkpoint")

PEER_POLL_S = 0.005
"""How often a writer waiting for its peers before a collective file create checks whether they came."""
ANNOUNCE_WAIT_S = 30.0
"""At most this long a writer waits for a heartbeat to announce its structure calls (the quiet guard): usually
at once (the monitor thread is woken for it), but an oversubscribed node can starve that thread for seconds,
and structure calls entered unannounced get their rank declared dead if they hold the GIL for longer than the
heartbeat deadline."""


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


def gather_tables(comm: Any, job: SaveJob, counts: np.ndarray, hashes: dict[int, np.ndarray],
                   changed: dict[int, np.ndarray]) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Collective: rank 0 gets /hashes (and an increment's /blocks) in file order; others get None."""
    owned = job.assignment.of_rank(comm.Get_rank())
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

    Called before the collective file create, so that the wait for a slower
    rank happens here, sleeping, and the wait inside HDF5 is only the I/O
    itself.  A non-blocking barrier polled with short sleeps, not ``Barrier``
    (nor the create's own ``MPI_File_open``): a blocked MPI call busy-polls a
    core, which a slow peer on an oversubscribed node needs.
    """
    wait_sleeping(comm.Ibarrier(), PEER_POLL_S)


def _create_collectively(comm: Any, job: SaveJob, tmp: Path, deadlines: Any, timeout_s: float) -> Any:
    """``h5py.File(tmp, "w")`` over MPI-IO, after the ranks met outside HDF5 (see ``wait_for_peers``), its create
    made with the GIL released (``hpcnet.ckpt.h5nogil``): this rank's monitor beats while the create waits."""
    if job.fault is not None:
        job.fault("arrive", job.step)
    # Its own guard, so that a report tells the ranks that wait here from the one they wait for.
    with deadlines.guard("checkpoint.meet", timeout_s, what=f"checkpoint.meet (step {job.step})"):
        wait_for_peers(comm)
    return h5nogil.create_file(tmp, comm, alignment_threshold=direct.ALIGN_BYTES,
                               alignment_interval=direct.ALIGN_BYTES)


def create_file(comm: Any, job: SaveJob, tmp: Path, datasets: dict[str, tuple[tuple[int, ...], np.dtype]],
                attrs: dict[str, Any], counts: np.ndarray, changed: dict[int, np.ndarray], rank_row: np.ndarray,
                errors: list[BaseException], deadlines: Any = NULL_DEADLINES, timeout_s: float = 0.0) -> Offsets:
    """Collective: create ``tmp`` over MPI-IO with every dataset (``file_layout``), allocate its space
    (``_reserve``), note where the datasets lie, and close it.

    With ``job.direct_writes`` off the tensors and ``/rank_state`` are written through h5py here, while the
    file is open.  Errors after the create are appended to ``errors``, never raised between collective calls.

    The create runs in a ``checkpoint.create`` guard of ``deadlines`` (``hpcnet.fault.watchdog``), with the GIL
    released; the structure calls after it hold the GIL (h5py) but wait for no peer: they run in a quiet
    ``checkpoint.structure`` guard, which the heartbeats announce before the first call, so that watchers allow
    the silence of a rank whose monitor cannot beat meanwhile.  A quiet guard hides a partition from the watchers
    until its deadline, so it covers only calls that wait for nobody.
    """
    rank = comm.Get_rank()
    offsets = Offsets()
    with deadlines.guard("checkpoint.create", timeout_s, what=f"checkpoint.create (step {job.step})"):
        f = _create_collectively(comm, job, tmp, deadlines, timeout_s)
    created: tuple = ()
    structure = deadlines.open("checkpoint.structure", timeout_s, what=f"checkpoint.structure (step {job.step})",
                               quiet=True)
    try:
        # The watchers must know of the quiet guard before h5py takes the GIL from the monitor thread.
        if structure is not None:  # None: no monitor (``NULL_DEADLINES``), nobody to tell
            structure.announced.wait(ANNOUNCE_WAIT_S)
        if job.fault is not None:
            job.fault("structure", job.step)
        d_tables, d_rank, d_tensors = created = _create_datasets(f, job, datasets, attrs)
        deadlines.close(structure)
        reserved = _reserve(comm, job, tmp, f, [*d_tables.values(), d_rank, *d_tensors.values()], errors)
        if reserved == "failed":  # agreed: nothing is written
            return offsets
        offsets.usable = True
        if job.direct_writes:
            offsets.rank_state = _offset(d_rank, errors)
            offsets.tensors = {i: offset for i, _ in job.assignment.of_rank(rank) if i in d_tensors
                               if (offset := _offset(d_tensors[i], errors)) is not None}
        else:
            offsets.written = _write_data(job, rank, d_tensors, d_rank, rank_row, counts, changed, errors)
            _abandon(comm, tmp, errors)
        if rank == 0:
            offsets.tables = {name: offset for name, d in d_tables.items() if d.shape[0]
                              if (offset := _offset(d, errors)) is not None}
    finally:
        deadlines.close(structure)
        try:
            f.close()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            # HDF5 leaves a file whose close failed half torn down: releasing any
            # of its objects, or HDF5's own teardown at exit, crashes (SIGSEGV).
            _UNCLOSED.append((f, created))
            log.error("cannot close %s (%s): it stays open, and this process must end without HDF5's teardown",
                      tmp, exc)
    return offsets


def _offset(dataset: Any, errors: list[BaseException]) -> int | None:
    """The byte offset of a contiguous dataset's storage (MPI-IO allocates it at create), or None, noted."""
    try:
        offset = dataset.id.get_offset()
        if offset is None:
            raise OSError(f"dataset {dataset.name} has no contiguous storage to write into")
        return offset
    except Exception as exc:  # noqa: BLE001 - shared later
        errors.append(exc)
        return None


_UNCLOSED: list[tuple[Any, tuple]] = []
"""Files (and their datasets) whose HDF5 close failed: held for the life of the process, never released."""


def unclosed_files() -> int:
    """How many checkpoint files this process could not close: if any, it must end without HDF5's and MPI's
    teardown (``os._exit``), which would crash in them."""
    return len(_UNCLOSED)


def _reserve(comm: Any, job: SaveJob, tmp: Path, f: Any, datasets: list[Any], errors: list[BaseException]
             ) -> str:
    """Collective, once the structure is created and before anything is written: rank 0 allocates every
    block of the file, so that no write, and no close, can run out of space.

    A full disk or quota then fails here, with its errno, on every rank alike,
    before any data are written; and a disk that fills meanwhile cannot fail
    the writes.  Should the file not fit, rank 0 still allocates what lies
    between the datasets (HDF5's structures, a few KiB per dataset), which the
    close must write: an HDF5 close that cannot write leaves the library half
    torn down (see ``_abandon``).  Returns ``"reserved"``, ``"unsupported"``
    (the file system cannot allocate ahead: the writes go on, and may still
    fail inside) or ``"failed"`` (every rank then has the error in ``errors``).
    """
    outcome: tuple[str, int | None, str] = ("reserved", None, "")
    if comm.Get_rank() == 0:
        try:
            outcome = _allocate_file(job, tmp, f, datasets)
        except Exception as exc:  # noqa: BLE001 - shared below
            outcome = ("failed", errno_of(exc), f"cannot allocate its space: {error_text(exc)}")
    status, code, text = comm.bcast(outcome, root=0)
    if status == "failed":
        errors.append(os_error(code, text))
    return status


def _allocate_file(job: SaveJob, tmp: Path, f: Any, datasets: list[Any]) -> tuple[str, int | None, str]:
    """Rank 0's part of ``_reserve``: its outcome, errno and message."""
    eoa = f.id.get_filesize()
    stored = sorted((d.id.get_offset(), d.id.get_storage_size()) for d in datasets if d.id.get_offset() is not None)
    fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        if job.fault is not None:
            job.fault("reserve", job.step)
        return ("reserved" if direct.allocate(fd, 0, eoa) else "unsupported", None, "")
    except OSError as exc:
        with contextlib.suppress(OSError):  # room for the close at least: see _abandon
            start = 0
            for offset, size in [*stored, (eoa, 0)]:
                direct.allocate(fd, start, offset - start)
                start = max(start, offset + size)
        return ("failed", exc.errno, f"allocating its {eoa / 2**20:.1f} MiB failed: {error_text(exc)}")
    finally:
        os.close(fd)


PROBE_BYTES = 1 << 20
"""What ``_abandon`` writes past a failed file's end to ask the file system why the write failed."""


def _abandon(comm: Any, tmp: Path, errors: list[BaseException]) -> None:
    """Collective, before the close of a file written through h5py (``direct_writes`` off): if a write failed on
    any rank, learn its errno and free the file's space.  (With ``direct_writes`` the file is closed before
    anything is written into it.)

    HDF5 1.10 over MPI-IO cannot abandon a file: its close still flushes what
    it holds, and a close whose flush fails (a full disk or quota) leaves the
    library half torn down, so that the next touch of the file, or of its
    objects by the garbage collector, crashes (SIGSEGV).  ``_reserve``
    prevents that where the file system allocates ahead; elsewhere, once
    every rank knows that some write failed, and none writes any more, rank
    0 truncates the worthless file to nothing: its space is
    free again and the close has room for its few metadata writes.

    HDF5 and MPI-IO drop the errno of a failed write ("Can't write data (file
    write failed)"), which decides the exit status (a full disk or quota is
    not restarted).  When no rank's error kept one, rank 0 asks the file
    system first, with a write of ``PROBE_BYTES`` past the file's end: a
    full disk or quota answers ENOSPC or EDQUOT.  Every rank whose errors
    have no errno adds that one.
    """
    own = next((errno_of(e) for e in errors if errno_of(e)), None)
    reports = comm.allgather((bool(errors), own))
    if not any(failed for failed, _ in reports):
        return
    code = next((c for _, c in reports if c), None)
    if comm.Get_rank() == 0:
        if code is None:
            code = _probe_errno(tmp)
        try:
            os.truncate(tmp, 0)
        except OSError as exc:
            errors.append(exc)
    code = comm.bcast(code, root=0)
    if code and own is None:
        text = f"{error_text(errors[0])}: " if errors else "the write failed on another rank: "
        errors.insert(0, os_error(code, text + os.strerror(code)))


def _probe_errno(tmp: Path) -> int | None:
    """The errno of a write of ``PROBE_BYTES`` past the end of ``tmp``, where no block is allocated yet (None if
    it succeeds)."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError as exc:
        return exc.errno
    try:
        direct.pwrite_all(fd, memoryview(bytes(PROBE_BYTES)), -(-os.fstat(fd).st_size // PROBE_BYTES) * PROBE_BYTES)
    except OSError as exc:
        return exc.errno
    finally:
        os.close(fd)
    return None


def rank_table(comm: Any, job: SaveJob) -> tuple[np.ndarray, list[int] | None]:
    """Collective: this rank's row of /rank_state (padded to the widest rank's), and on rank 0 every row's hash."""
    width = max(comm.allgather(len(job.rank_state_bytes)))
    rank_row = np.frombuffer(job.rank_state_bytes.ljust(width, b" "), np.uint8)
    return rank_row, comm.gather(int(block_hashes(rank_row, width)[0]), root=0)


METADATA_BYTES = 1 << 20
"""Room for HDF5's own structures (superblock, object headers, the heap of names) besides the datasets."""
METADATA_BYTES_PER_DATASET = 4096
"""And per dataset: its object header, its link and its attributes."""


def file_layout(job: SaveJob, size: int, counts: np.ndarray, index_bytes: int, width: int
                ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Every dataset of one checkpoint file, in the order it is created: path -> (shape, storage dtype) (pure).

    The one description of the file: ``_create_datasets`` creates exactly
    these, and the free-space check before a save (``file_bytes``) counts them.
    ``width`` is the widest rank's /rank_state row (``rank_table``).
    """
    n_hashes = int(counts[:, :, 0].sum())
    u1, u8 = np.dtype("u1"), np.dtype("<u8")
    layout = {"meta": ((len(job.meta_bytes),), u1), "index": ((index_bytes,), u1), "hashes": ((n_hashes,), u8),
              "rank_state_hashes": ((size,), u8)}
    if job.kind == "incremental":
        layout["blocks"] = ((n_hashes,), np.dtype("<i8"))
    layout["rank_state"] = ((size, width), u1)
    for i, spec in enumerate(job.specs):
        rows = int(counts[:, i, 1].sum())
        if job.kind == "incremental" and rows == 0:
            continue  # nothing changed: no dataset
        shape = (rows, *spec.row_shape) if job.kind == "incremental" else spec.shape
        layout[f"tensors/{spec.name}"] = (shape, spec.storage)
    return layout


def file_bytes(layout: dict[str, tuple[tuple[int, ...], np.dtype]]) -> int:
    """The bytes a file of ``layout`` takes at most on disk: every dataset, and HDF5's own structures."""
    data = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())
    return data + METADATA_BYTES + METADATA_BYTES_PER_DATASET * len(layout)


def _create_datasets(f: Any, job: SaveJob, layout: dict[str, tuple[tuple[int, ...], np.dtype]],
                     attrs: dict[str, Any]) -> tuple[dict[str, Any], Any, dict[int, Any]]:
    """The file's structure: the same calls with the same arguments on every rank (collective)."""
    for key, value in attrs.items():
        f.attrs[key] = value
    tensors = {f"tensors/{spec.name}": i for i, spec in enumerate(job.specs)}
    d_tables: dict[str, Any] = {}
    d_rank = None
    d_tensors: dict[int, Any] = {}
    for name, (shape, dtype) in layout.items():
        d = f.create_dataset(name, shape=shape, dtype=dtype, fill_time="never")
        if name in tensors:
            i = tensors[name]
            d_tensors[i] = d
            if DTYPES[job.specs[i].dtype][1]:
                d.attrs["dtype"] = job.specs[i].dtype
        elif name == "rank_state":
            d_rank = d
        else:
            d_tables[name] = d
    return d_tables, d_rank, d_tensors


def _write_data(job: SaveJob, rank: int, d_tensors: dict[int, Any], d_rank: Any, rank_row: np.ndarray,
                counts: np.ndarray, changed: dict[int, np.ndarray], errors: list[BaseException]) -> int:
    """Collective: the tensors and the rank table; return the bytes this rank wrote (errors noted, not raised)."""
    if job.fault is not None:
        try:
            job.fault("write", job.step)
        except OSError as exc:  # as a failing write would: noted, and the calls go on
            errors.append(exc)
    written = _write_split(job, rank, d_tensors, counts, errors)
    try:
        with d_rank.collective:
            d_rank[rank:rank + 1] = rank_row[None, :]
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)
    return written + _write_independent(job, rank, d_tensors, counts, changed, errors)


def _write_split(job: SaveJob, rank: int, d_tensors: dict[int, Any], counts: np.ndarray,
                 errors: list[BaseException]) -> int:
    """Collective: a full checkpoint's split tensors, in pieces (h5py's lock is held for a whole call)."""
    written = 0
    for i, spec in enumerate(job.specs):
        if job.kind == "incremental" or not job.assignment.split[i]:
            continue
        calls = write_pieces(counts[:, i, 1].tolist(), WRITE_PIECE_BYTES // max(1, spec.row_bytes))
        first = int(counts[:rank, i, 1].sum())
        array, d = job.arrays[i], d_tensors[i]
        n = len(array)
        for c in range(calls):
            a, b = c * n // calls, (c + 1) * n // calls
            try:
                if job.collective_writes:
                    with d.collective:
                        d[first + a:first + b] = array[a:b]
                else:
                    d[first + a:first + b] = array[a:b]
                written += array[a:b].nbytes
            except Exception as exc:  # noqa: BLE001 - keep taking part in the calls; shared later
                errors.append(exc)
    return written


def _write_independent(job: SaveJob, rank: int, d_tensors: dict[int, Any], counts: np.ndarray,
                       changed: dict[int, np.ndarray], errors: list[BaseException]) -> int:
    """This rank's whole small tensors, or its packed rows of an increment, written independently."""
    incremental = job.kind == "incremental"
    written = 0
    for i, piece in job.assignment.of_rank(rank):
        spec = job.specs[i]
        if (incremental and counts[rank, i, 1] == 0) or (not incremental and job.assignment.split[i]):
            continue
        array, d = job.arrays[i], d_tensors[i]
        try:
            if incremental:
                data = array[rows_of_blocks(spec, changed[i], piece.block_lo)] if spec.shape else array[None]
                first = int(counts[:rank, i, 1].sum())
                d[first:first + len(data)] = data
            else:
                data = array
                d[()] = data
            written += data.nbytes
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    return written

