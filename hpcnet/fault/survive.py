"""Live recovery's MPI side (ULFM, ``fault.recovery=shrink``): which errors mean that a peer process died, every
communicator of the job revoked at once, and the survivors' communicator.

Under a fault-tolerant MPI (Open MPI 5 started with ``mpirun --with-ft ulfm``) an operation that involves a dead
process fails with ``MPI_ERR_PROC_FAILED`` instead of ending the job, but only where it involves that process: a
survivor may finish a collective that another could not, and go on to wait in the next one.  So the first rank
that sees a failure revokes every communicator the job made from its own (``MPI_Comm_revoke`` reaches every member
and makes all their pending and later operations on it fail with ``MPI_ERR_REVOKED``), wherever each survivor is
waiting (the training thread, a transport's worker, the monitor), and all of them meet in ``MPI_Comm_shrink``,
which agrees on the survivors.  The communicators are registered where they are made (``track``).
"""

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
_TRACKED: list[Any] = []
_SHRUNK = threading.Event()


def survived_a_loss() -> bool:
    """Whether this process went on after peers were lost (``shrink``): its MPI_Finalize would wait for them.

    Open MPI 5.0's MPI_Finalize fences with every process of the job, the dead ones included, and may wait for
    good (open-mpi/ompi#11404); a process that has shrunk leaves without it (``hpcnet.train``'s entry point)."""
    return _SHRUNK.is_set()


def track(comm: Any) -> Any:
    """Register a communicator the job made (a duplicate or split of its own) for ``revoke_all``; returns it."""
    from mpi4py import MPI

    with _LOCK:
        _TRACKED[:] = [c for c in _TRACKED if c != MPI.COMM_NULL]  # freed ones (mpi4py nulls a freed handle)
        _TRACKED.append(comm)
    return comm


def revoke_all() -> int:
    """Revoke every registered communicator (any thread; an MPI without ULFM: nothing); how many were revoked."""
    from mpi4py import MPI

    if not hasattr(MPI.Comm, "Revoke"):
        return 0
    with _LOCK:
        comms = [c for c in _TRACKED if c != MPI.COMM_NULL]
    revoked = 0
    for comm in comms:
        try:
            if not comm.Is_revoked():
                comm.Revoke()
                revoked += 1
        except MPI.Exception:
            continue
    return revoked


def _mpi_error_class(exc: BaseException) -> int | None:
    from mpi4py import MPI

    seen: set[int] = set()
    error: BaseException | None = exc
    while error is not None and id(error) not in seen:  # the MPI error may be the cause of a transport's error
        seen.add(id(error))
        if isinstance(error, MPI.Exception):
            return int(error.Get_error_class())
        error = error.__cause__ or error.__context__
    return None


def is_process_failure(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) is an MPI process failure or a revoked communicator."""
    from mpi4py import MPI

    classes = {getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
               if hasattr(MPI, name)}
    return _mpi_error_class(exc) in classes


def peers_lost(comm: Any, wait_s: float = 1.0) -> bool:
    """Whether this process knows of a failed peer in ``comm`` (``MPI_Comm_get_failed``), waiting up to ``wait_s``
    for its failure detector: an error that is not an MPI process failure may still come from one (a collective
    that completed here with a dead peer's part missing: garbage sizes, a MemoryError)."""
    from mpi4py import MPI

    if not hasattr(comm, "Get_failed"):
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            group = comm.Get_failed()
            failed = group.Get_size()
            group.Free()
        except MPI.Exception:
            return False  # no ULFM here
        if failed or time.monotonic() >= deadline:
            return bool(failed)
        time.sleep(0.02)


def passing_notice(comm: Any, exc: BaseException) -> bool:
    """Whether ``exc``, raised by an any-source operation on ``comm``, is a notice of a failure that lost no member
    of ``comm`` (``MPI_ERR_PROC_FAILED_PENDING``; seen under Open MPI 5.0 once a job that had shrunk spawned
    replacements): then the failures are acknowledged (``MPI_Comm_ack_failed``) and the operation, still pending,
    goes on."""
    from mpi4py import MPI

    if _mpi_error_class(exc) != getattr(MPI, "ERR_PROC_FAILED_PENDING", None) or peers_lost(comm, wait_s=0.0):
        return False
    comm.Ack_failed()
    return True


@dataclass(frozen=True, slots=True)
class Shrunk:
    """The survivors' communicator and who was lost."""

    comm: Any
    lost: tuple[int, ...]
    """The lost ranks, numbered as in the communicator that was shrunk."""
    shrink_s: float


def shrink(comm: Any) -> Shrunk:
    """Every survivor, once every communicator is revoked: the survivors' communicator (``MPI_Comm_shrink``,
    fault-tolerant and collective over the survivors) and the lost ranks, the same on every survivor."""
    from mpi4py import MPI

    t0 = time.perf_counter()
    revoke_all()
    survivors = comm.Shrink()
    _SHRUNK.set()
    old, new = comm.Get_group(), survivors.Get_group()
    gone = MPI.Group.Difference(old, new)
    lost = tuple(MPI.Group.Translate_ranks(gone, list(range(gone.Get_size())), old))
    for group in (old, new, gone):
        group.Free()
    with _LOCK:
        _TRACKED.clear()  # the old ones stay revoked; whoever holds one frees it without communicating
    return Shrunk(track(survivors), lost, time.perf_counter() - t0)
