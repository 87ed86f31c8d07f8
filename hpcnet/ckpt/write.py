"""One save on disk, in stretches: collective ones (free space, the file's create, agreements, the commit's
verdict) and local ones (hashing, writing bytes, fsync, rank 0's commit), which call no MPI and open no
parallel HDF5 file.

``save_stretches`` is a generator that yields ``LOCAL`` before each local stretch and ``COLLECTIVE`` before
each collective one, so whoever drives it decides which thread runs what: ``hpcnet.ckpt.manager`` runs the
collective stretches in the training thread, at a step boundary where every rank's local stretch is done,
and the local ones in a background thread.  A rank then never has two threads inside blocking MPI
collectives at once, on any communicator: an oversubscribed job (more ranks than cores) with Open MPI 4.1
was seen to stop in that state (the writer's first ``Allgather`` on every rank, rank 0's training thread in a
``Bcast`` it was the root of), and MPI_THREAD_MULTIPLE progress between threads is where MPI libraries differ
most.
``write_checkpoint`` runs every stretch in the calling thread.

A checkpoint is written as ``ckpt-<step>.h5.<token>.tmp`` and committed by a rename
on rank 0 once every rank's write succeeded (and, under ``hpcnet.launch``, while its attempt holds the directory's
fence: ``hpcnet.ckpt.fence``); every error is shared
(``hpcnet.agree``), so a save fails on every rank alike and leaves no
half-written file under a committed name (docs/checkpoints.md).
"""

import errno
import json
import logging
import os
import shutil
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np

from hpcnet.agree import agree_on_error
from hpcnet.ckpt.collective import create_file, file_bytes, file_layout, gather_tables, rank_table
from hpcnet.ckpt.durable import fsync_path
from hpcnet.ckpt.fence import refusal
from hpcnet.ckpt.job import SaveJob, SaveResult
from hpcnet.ckpt.listing import scan, write_latest
from hpcnet.ckpt.local import Offsets, changed_blocks, local_counts, write_local, write_tables
from hpcnet.ckpt.schema import (
    FORMAT,
    FORMAT_VERSION,
    HASH_NAME,
    CheckpointInfo,
    TensorSpec,
    checkpoints_to_prune,
    sha256_hex,
)
from hpcnet.errors import errno_of, error_text, os_error
from hpcnet.fault.watchdog import NULL_DEADLINES

log = logging.getLogger("hpcnet.checkpoint")

def check_free_space(directory: Path, needed: int) -> None:
    """Raise OSError(ENOSPC) unless the file system of ``directory`` has ``needed`` bytes free.

    Checked before writing, with ``needed`` counted from the file's layout
    (``hpcnet.ckpt.collective.file_bytes``: every dataset), so that a save
    that cannot fit fails here, with one clear message, rather than inside
    HDF5.  Quotas (EDQUOT), and a disk that fills meanwhile, are invisible
    here: the allocation of the file's space before any write catches them
    (``hpcnet.ckpt.collective._reserve``).
    """
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({needed / 2**20:.1f} MiB needed, "
                                    f"{free / 2**20:.1f} MiB free)")


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


LOCAL = "local"
"""``save_stretches`` yields it before a stretch that calls no MPI and opens no parallel HDF5 file (any thread may
run it)."""
COLLECTIVE = "collective"
"""``save_stretches`` yields it before a stretch of collective calls (every rank runs it, in one thread)."""


def write_checkpoint(comm: Any, job: SaveJob, *, deadlines: Any = NULL_DEADLINES, timeout_s: float = 0.0
                     ) -> SaveResult:
    """Collective over ``comm``: hash, write, fsync, commit and prune one checkpoint, in this thread.

    Any failure raises on every rank (agreed), and the temporary file is removed.
    """
    return run_stretches(save_stretches(comm, job, deadlines=deadlines, timeout_s=timeout_s))


def run_stretches(stretches: Generator[str, None, SaveResult]) -> SaveResult:
    """Every stretch of ``save_stretches`` in the calling thread; its result."""
    try:
        while True:
            next(stretches)
    except StopIteration as done:
        return done.value


def save_stretches(comm: Any, job: SaveJob, *, deadlines: Any = NULL_DEADLINES, timeout_s: float = 0.0
                   ) -> Generator[str, None, SaveResult]:
    """One save as alternating stretches (see the module's docstring); returns its ``SaveResult``.

    The first stretch, before the first ``yield``, is collective.  A local stretch never raises for an I/O
    error: errors are noted and the next collective stretch shares them, so a save fails on every rank alike
    (and rank 0 removes the temporary file).

    Args:
        deadlines: where the collective create is guarded (``hpcnet.fault.watchdog``), with ``timeout_s``.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    tmp = job.tmp
    timings: dict[str, float] = {}
    errors: list[BaseException] = []
    hashes: dict[int, np.ndarray] = {}
    changed: dict[int, np.ndarray] = {}
    if job.kind == "incremental":  # what to write depends on the hashes; a full checkpoint hashes while writing
        yield LOCAL
        t = time.perf_counter()
        hashes, changed = changed_blocks(job, errors)
        timings["hash_s"] = time.perf_counter() - t
        yield COLLECTIVE
        agree_on_error(comm, errors[0] if errors else None)
    t = time.perf_counter()
    counts = np.empty((size, len(job.specs), 2), dtype=np.int64)
    comm.Allgather(local_counts(job, rank, changed), counts)
    index_bytes = _index_bytes(job.specs, counts)
    attrs = _root_attrs(job, size, index_bytes)
    rank_row, rank_hashes = rank_table(comm, job)
    datasets = file_layout(job, size, counts, len(index_bytes), len(rank_row))
    _create_plain(comm, job, tmp, file_bytes(datasets))
    offsets = create_file(comm, job, tmp, datasets, attrs, counts, changed, rank_row, errors, deadlines, timeout_s)
    timings["create_s"] = time.perf_counter() - t
    yield LOCAL
    written, written_hashes = write_local(job, rank, tmp, offsets, counts, changed, rank_row, errors, timings)
    if job.kind == "full":
        hashes = written_hashes
    yield COLLECTIVE
    t = time.perf_counter()
    try:
        agree_on_error(comm, _write_error(tmp, errors))
    except BaseException:
        if rank == 0:
            tmp.unlink(missing_ok=True)
        raise
    all_hashes, all_blocks = gather_tables(comm, job, counts, hashes, changed)
    written = comm.allreduce(written + offsets.written)
    timings["gather_s"] = time.perf_counter() - t
    yield LOCAL
    t = time.perf_counter()
    error = _finish_file(job, tmp, offsets, index_bytes, rank_hashes, all_hashes, all_blocks) if rank == 0 else None
    timings["commit_s"] = time.perf_counter() - t
    yield COLLECTIVE
    agree_on_error(comm, error)
    info = CheckpointInfo(step=job.step, path=str(job.path), kind=job.kind, uid=job.uid,
                          base=attrs["base"] or None, parent=attrs["parent"] or None, base_uid=attrs["base_uid"],
                          parent_uid=attrs["parent_uid"], world_size=size, seq=job.seq,
                          created_unix=job.created_unix)
    return SaveResult(info, hashes, timings, written)


def _finish_file(job: SaveJob, tmp: Path, offsets: Offsets, index_bytes: bytes, rank_hashes: list[int] | None,
                 all_hashes: np.ndarray | None, all_blocks: np.ndarray | None) -> OSError | None:
    """Rank 0, local: the tables written and fsync'd, then the commit (rename, ``latest``, prune); the error, if
    any (and then ``tmp`` is removed).  A stale attempt (``job.fence`` no longer holds the directory's fence,
    ``hpcnet.ckpt.fence``) commits nothing: no rename, no ``latest``, no prune; ESTALE."""
    try:
        write_tables(tmp, offsets, {"meta": np.frombuffer(job.meta_bytes, np.uint8),
                                   "index": np.frombuffer(index_bytes, np.uint8), "hashes": all_hashes,
                                   "rank_state_hashes": np.array(rank_hashes, dtype="<u8"),
                                   "blocks": all_blocks})
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return os_error(errno_of(exc), f"writing checkpoint {str(tmp)!r} failed: {error_text(exc)}")
    refused = refusal(job.directory, job.fence)  # right before the rename: nothing of a stale attempt is committed
    if refused:
        tmp.unlink(missing_ok=True)
        return os_error(errno.ESTALE, f"committing checkpoint {str(job.path)!r} refused: {refused}")
    try:
        os.replace(tmp, job.path)
        fsync_path(job.directory)
        write_latest(job.directory, job.path.name)
    except OSError as exc:
        return os_error(errno_of(exc), f"committing checkpoint {str(job.path)!r} failed: {error_text(exc)}")
    prune(job.directory, job.keep)
    return None


def _index_bytes(specs: list[TensorSpec], counts: np.ndarray) -> bytes:
    """The /index table: every tensor's spec and where its hashes lie in /hashes."""
    n_hashes = counts[:, :, 0].sum(axis=0)
    offsets = np.concatenate([[0], np.cumsum(n_hashes)[:-1]]).astype(np.int64)
    index = [dict(spec.to_json(), hash_offset=int(offsets[i]), n_hashes=int(n_hashes[i]))
             for i, spec in enumerate(specs)]
    return json.dumps(index, separators=(",", ":")).encode()


def _root_attrs(job: SaveJob, size: int, index_bytes: bytes) -> dict[str, Any]:
    incremental = job.kind == "incremental"
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": job.kind, "step": job.step, "uid": job.uid,
        "parent": job.parent.name if incremental else "", "parent_uid": job.parent.uid if incremental else "",
        "base": job.base.name if incremental else "", "base_uid": job.base.uid if incremental else "",
        "world_size": size, "hash": HASH_NAME, "created_unix": job.created_unix,
        "index_sha256": sha256_hex(index_bytes), "meta_sha256": sha256_hex(job.meta_bytes), "seq": job.seq,
    }


def _create_plain(comm: Any, job: SaveJob, tmp: Path, needed: int) -> None:
    """Collective: rank 0 checks the free space and creates ``tmp`` plainly, before the collective create.

    One clear error rather than MPI-IO errors on some ranks.  Created
    exclusively and never through a link: in a directory others can write
    to, a link at the name would make the create truncate the file it names.
    """
    error: BaseException | None = None
    if comm.Get_rank() == 0:
        try:
            if job.fault is not None:
                job.fault("precheck", job.step)
            check_free_space(job.directory, needed)
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        except OSError as exc:
            error = os_error(errno_of(exc), f"cannot create checkpoint file {str(tmp)!r}: {error_text(exc)}")
    agree_on_error(comm, error)


def prune(directory: Path, keep: int) -> list[str]:
    """Delete what ``checkpoints_to_prune`` says and stale temporary files (rank 0 only; never raises)."""
    removed = []
    infos, stale = scan(directory)
    for item in [*checkpoints_to_prune(infos, keep), *stale]:
        path = Path(item.path) if isinstance(item, CheckpointInfo) else item
        try:
            path.unlink()
            removed.append(path.name)
        except OSError as exc:
            log.warning("could not delete old checkpoint %s: %s", path, exc.strerror or exc)
    if removed:
        log.info("deleted %s", ", ".join(removed))
    return removed
