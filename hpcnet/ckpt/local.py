"""The local writes of a checkpoint file that ``hpcnet.ckpt.collective`` created: no MPI, no HDF5.

Each rank writes its pieces and its row of ``/rank_state`` with ``pwrite`` at
the datasets' offsets (``Offsets``), hashes them in threads while the disk
writes (``hpcnet.ckpt.direct``) and fsyncs them (``write_local``); rank 0 the
index, meta and checksums (``write_tables``).  An increment's hashes and changed
blocks are found before the create (``changed_blocks``, ``local_counts``).  This
is what a background thread runs while training goes on: it never enters MPI
(``hpcnet.ckpt.write``).  A rank's failed writes are noted in a list, not
raised, and shared at the next collective stretch.
"""

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hpcnet.ckpt import direct
from hpcnet.ckpt.durable import fsync_path
from hpcnet.ckpt.job import SaveJob
from hpcnet.ckpt.schema import TensorSpec


@dataclass(slots=True)
class Offsets:
    """Where the datasets of a created checkpoint file lie: what the writes after ``collective.create_file`` need
    (a save whose file could not be allocated has none: nothing is written)."""

    tensors: dict[int, int] = field(default_factory=dict)
    """Tensor index -> byte offset of its dataset (the tensors this rank writes; ``direct_writes``)."""
    rank_state: int | None = None
    """Byte offset of ``/rank_state`` (``direct_writes``)."""
    tables: dict[str, int] = field(default_factory=dict)
    """Rank 0: table name -> byte offset (empty tables have no storage and none)."""
    written: int = 0
    """Bytes this rank wrote through h5py while the file was open (``direct_writes`` off)."""
    usable: bool = False
    """Whether the file's space was allocated, or could not be allocated ahead (``collective._reserve``): the
    writes go on."""


def rows_of_blocks(spec: TensorSpec, blocks: np.ndarray, first_block: int) -> np.ndarray:
    """Row numbers, relative to block ``first_block``, of the rows of (relative) ``blocks``."""
    rows = (blocks[:, None] * spec.block_rows + np.arange(spec.block_rows)[None, :]).reshape(-1)
    return rows[rows < spec.rows - first_block * spec.block_rows]


def local_counts(job: SaveJob, rank: int, changed: dict[int, np.ndarray]) -> np.ndarray:
    """Per tensor: [blocks (hashes) this rank stores, rows it writes]."""
    local = np.zeros((len(job.specs), 2), dtype=np.int64)
    for i, piece in job.assignment.of_rank(rank):
        spec = job.specs[i]
        if job.kind == "incremental":
            local[i] = len(changed[i]), len(rows_of_blocks(spec, changed[i], piece.block_lo))
        else:
            lo, hi = spec.block_range_rows(piece.block_lo, piece.block_hi)
            local[i] = piece.block_hi - piece.block_lo, hi - lo
    return local


def changed_blocks(job: SaveJob, errors: list[BaseException]) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
    """An increment's hashes and changed blocks, before anything is written (local; errors appended)."""
    try:
        hashes = _hash_owned(job)
        return hashes, {i: np.flatnonzero(h != job.prev_hashes[i]) for i, h in hashes.items()}  # type: ignore[index]
    except Exception as exc:  # noqa: BLE001 - shared by the next collective stretch
        errors.append(exc)
        return {}, {}


def _hash_owned(job: SaveJob) -> dict[int, np.ndarray]:
    """This rank's block hashes of every piece it owns, computed in threads (``hpcnet.ckpt.direct``)."""
    with direct.pool(job.io_threads) as pool:
        futures = {i: direct.submit_hash(pool, array, job.specs[i].block_rows * job.specs[i].row_bytes)
                   for i, array in job.arrays.items()}
        return {i: direct.collect(f) for i, f in futures.items()}


def write_local(job: SaveJob, rank: int, tmp: Path, offsets: Offsets, counts: np.ndarray,
                changed: dict[int, np.ndarray], rank_row: np.ndarray, errors: list[BaseException],
                timings: dict[str, float]) -> tuple[int, dict[int, np.ndarray]]:
    """This rank's bytes of a created file, fsync'd; no MPI, no HDF5 (what a background thread may run).

    ``direct_writes``: this rank's pieces (a full checkpoint's, hashed in threads while the disk writes;
    an increment's changed rows, hashed before) and its row of ``/rank_state`` with pwrite at their offsets
    (``hpcnet.ckpt.direct``).  Otherwise h5py wrote them already: a full checkpoint is hashed while a
    ``_Flusher`` fsyncs it (hashing during h5py's collective writes would compete for the CPU with MPI's
    busy-polling, while during the fsync the CPU idles).  Returns the bytes written and, for a full
    checkpoint, the block hashes of every piece written (a piece that failed has none: ``collective.gather_tables``
    sends zeros for it).  Errors are appended to ``errors``.
    """
    t0 = time.perf_counter()
    hashes: dict[int, np.ndarray] = {}
    written = 0
    if not offsets.usable:
        return written, hashes  # the space could not be allocated (every rank has the error): nothing to write
    if not job.direct_writes:
        if job.kind == "full":
            hashes = _hash_while_flushing(job, tmp, errors, timings)
        else:
            _fsync_noted(tmp, errors)
        timings["data_s"] = time.perf_counter() - t0
        return written, hashes
    if job.fault is not None:
        try:
            job.fault("write", job.step)
        except OSError as exc:  # as a failing write would: noted, and the writes go on
            errors.append(exc)
    if offsets.rank_state is None:
        return 0, hashes  # its offset failed here (noted): nothing to write into
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
    except OSError as exc:
        errors.append(exc)
        return 0, hashes
    try:
        pieces = _local_pieces(job, rank, offsets, counts, changed)
        with direct.pool(job.io_threads) as pool:
            futures = {i: direct.submit_write(pool, fd, data, offset, block_bytes, hashed=job.kind == "full")
                       for i, data, offset, block_bytes in pieces}
            futures[-1] = direct.submit_write(pool, fd, rank_row, offsets.rank_state + rank * len(rank_row),
                                              len(rank_row), hashed=False)
            sizes = {i: data.nbytes for i, data, _, _ in pieces}
            for i, chunks in futures.items():
                try:
                    piece_hashes = direct.collect(chunks)
                except Exception as exc:  # noqa: BLE001 - shared later
                    errors.append(exc)
                    continue
                if i >= 0:
                    written += sizes[i]
                    if job.kind == "full":
                        hashes[i] = piece_hashes
        timings["data_s"] = timings["hash_s"] = time.perf_counter() - t0
        os.fsync(fd)  # each rank flushes its own writes (it matters on parallel file systems)
    except OSError as exc:
        errors.append(exc)
    finally:
        os.close(fd)
    timings["close_fsync_s"] = time.perf_counter() - t0 - timings.get("data_s", 0.0)
    return written, hashes


def _local_pieces(job: SaveJob, rank: int, offsets: Offsets, counts: np.ndarray,
                  changed: dict[int, np.ndarray]) -> list[tuple[int, np.ndarray, int, int]]:
    """(tensor index, bytes to write, file offset, hash block bytes) of each piece this rank writes."""
    out = []
    for i, piece in job.assignment.of_rank(rank):
        if i not in offsets.tensors:
            continue  # no storage: nothing of it changed, or its offset failed (noted)
        spec, array = job.specs[i], job.arrays[i]
        block_bytes = spec.block_rows * spec.row_bytes
        if job.kind == "incremental":
            if counts[rank, i, 1] == 0:
                continue
            data = array[rows_of_blocks(spec, changed[i], piece.block_lo)] if spec.shape else array[None]
            first = int(counts[:rank, i, 1].sum())
        else:
            data = array
            first = spec.block_range_rows(piece.block_lo, piece.block_hi)[0]
        out.append((i, data, offsets.tensors[i] + first * spec.row_bytes, block_bytes))
    return out


def _hash_while_flushing(job: SaveJob, tmp: Path, errors: list[BaseException],
                         timings: dict[str, float]) -> dict[int, np.ndarray]:
    """A full checkpoint's block hashes, computed while a ``_Flusher`` fsyncs the data just written."""
    hashes: dict[int, np.ndarray] = {}
    t_hash = time.perf_counter()
    flusher = _Flusher(tmp)
    flusher.start()
    try:
        hashes = _hash_owned(job)
    except Exception as exc:  # noqa: BLE001 - collective.gather_tables sends zeros for it
        errors.append(exc)
    timings["hash_s"] = time.perf_counter() - t_hash
    flusher.join()
    timings["flush_s"] = time.perf_counter() - t_hash
    if flusher.error is not None:
        errors.append(flusher.error)
    return hashes


class _Flusher(threading.Thread):
    """fsyncs a file while its writer hashes: the disk works while the CPU hashes."""

    def __init__(self, path: Path) -> None:
        super().__init__(name="hpcnet-checkpoint-fsync", daemon=True)
        self.path = path
        self.error: OSError | None = None

    def run(self) -> None:
        try:
            fsync_path(self.path)
        except OSError as exc:
            self.error = exc


def _fsync_noted(path: Path, errors: list[BaseException]) -> None:
    try:
        fsync_path(path)
    except OSError as exc:
        errors.append(exc)


def write_tables(tmp: Path, offsets: Offsets, tables: dict[str, np.ndarray | None]) -> None:
    """Rank 0: the tables (meta, index, hashes, blocks, rank hashes) with pwrite at their offsets, fsync'd.

    No MPI, no HDF5.  Raises OSError.
    """
    fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        for name, offset in offsets.tables.items():
            data = tables.get(name)
            if data is None or not len(data):
                continue
            direct.pwrite_all(fd, memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
