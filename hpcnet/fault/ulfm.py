"""Whether the running MPI can survive the loss of a rank (ULFM), whether this job was started so that it does, and
what ``fault.recovery`` resolves to.

ULFM (User-Level Failure Mitigation) is part of Open MPI from 5.0, but off unless the job is started with
``mpirun --with-ft ulfm`` (``scripts/ftmpirun``).  mpi4py offers ``Comm.Shrink`` and ``Comm.Agree`` under any MPI
(emulated where the library lacks them: under Open MPI 4.1 a ``Shrink`` is a duplicate), so neither the method nor a
call of it tells.  What does, read in the MPI library of this process (no MPI call):

- **available**: the library is Open MPI >= 5 and exports ULFM's calls (``MPIX_Comm_revoke``, ``MPIX_Comm_shrink``,
  ``MPIX_Comm_agree``), which one built ``--without-ft`` lacks.  MPICH's ULFM is not supported (untested);
- **active**: the library's own switch, ``ompi_ftmpi_enabled``, which ``--with-ft ulfm`` turns on (through the MCA
  variable ``mpi_ft_enable``).  The runtime's half (prterun keeping the job alive when a rank dies) cannot be seen
  from a rank: PRRTE publishes no job attribute for it.  So ``--mca mpi_ft_enable 1`` without ``--with-ft ulfm``
  reads as active, and its first lost rank still ends the job: the restart path then takes over.

``detect`` agrees on the answer over the job's communicator, so every rank takes the same recovery mode.
``python -m mpi4py -m hpcnet.fault.ulfm`` under a launcher prints what it finds.
"""

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from hpcnet.agree import mark_agreed
from hpcnet.config.injection import RECOVERY_MODES
from hpcnet.errors import ConfigError

ULFM_CALLS = ("MPIX_Comm_revoke", "MPIX_Comm_shrink", "MPIX_Comm_agree")
"""What live recovery calls (through mpi4py's Revoke, Shrink, Agree): a library that exports them implements ULFM."""
LIBMPI_NAMES = ("libmpi.so.40", "libmpi.so.12", "libmpi.so")
"""The MPI library's names as a process loads it (Open MPI's soname, MPICH's, the unversioned link)."""
FT_ENABLE_ENV = "OMPI_MCA_mpi_ft_enable"
"""Open MPI's fault-tolerance switch as ``mpirun --with-ft ulfm`` hands it to the ranks."""
LAUNCH_HINT = "scripts/ftmpirun (Open MPI 5's mpirun --with-ft ulfm; docs/fault-tolerance.md#a-fault-tolerant-mpi)"
"""The command that starts a job with fault tolerance on."""


@dataclass(frozen=True, slots=True)
class FaultTolerance:
    """What the job's MPI offers against a lost rank; ``detect`` makes it the same on every rank."""

    available: bool
    """The MPI library implements ULFM (Open MPI >= 5 built with fault tolerance)."""
    active: bool
    """And this job was started with it on (``mpirun --with-ft ulfm``): survivors can shrink and go on."""
    library: str
    """The MPI library, e.g. 'Open MPI 5.0.11'."""
    why: str = ""
    """Why it is not active ('' when it is)."""

    def describe(self) -> str:
        """One line for the log, e.g. 'ULFM active (Open MPI 5.0.11)'."""
        if self.active:
            return f"ULFM active ({self.library})"
        return f"no ULFM: {self.why}"


def recovery_mode(option: str, ft: FaultTolerance) -> str:
    """What ``fault.recovery`` (``option``) means under ``ft``: 'shrink' or 'restart'.

    'auto' shrinks where ULFM is active and restarts elsewhere.  'shrink' without active ULFM is a ``ConfigError``
    (status 2) naming what is missing and the command to use; marked agreed, since ``ft`` from ``detect`` is the
    same on every rank, which all raise it alike.
    """
    assert option in RECOVERY_MODES, option  # the config's check refuses any other
    if option == "auto":
        return "shrink" if ft.active else "restart"
    if option == "shrink" and not ft.active:
        raise mark_agreed(ConfigError(f"fault.recovery=shrink needs an MPI that survives a lost rank, and {ft.why}: "
                                      f"launch with {LAUNCH_HINT}, or set fault.recovery=restart"))
    return option


def detect(comm: Any) -> FaultTolerance:
    """Collective over ``comm``: what this job's MPI offers against a lost rank, the same on every rank."""
    from mpi4py import MPI

    mine = local_fault_tolerance()
    views = comm.allgather((mine.available, mine.active, mine.library, mine.why, MPI.Get_processor_name()))
    return agree(views)


def agree(views: list[tuple[bool, bool, str, str, str]]) -> FaultTolerance:
    """One answer from every rank's (available, active, library, why, host), rank by rank (pure): active only
    where every rank is; else why, naming the first rank that is not when the ranks differ."""
    available, active = all(v[0] for v in views), all(v[1] for v in views)
    library = views[0][2]
    if active:
        return FaultTolerance(True, True, library)
    lacking = next(rank for rank, v in enumerate(views) if not v[1])
    why = views[lacking][3]
    if any(v[:3] != views[0][:3] for v in views):
        why = f"rank {lacking} on {views[lacking][4]}: {why}"
    return FaultTolerance(available, False, library, why)


def local_fault_tolerance() -> FaultTolerance:
    """What the MPI library loaded in this process offers (no communication; MPI initialised)."""
    from mpi4py import MPI

    vendor, version = MPI.get_vendor()
    library = f"{vendor} {'.'.join(map(str, version))}"
    if vendor != "Open MPI":
        return FaultTolerance(False, False, library, f"hpcnet supports Open MPI's ULFM only (>= 5), not {library}'s")
    if version < (5,):
        return FaultTolerance(False, False, library, f"{library} has no ULFM (Open MPI >= 5 has)")
    lib = _loaded_libmpi()
    if lib is None or not all(hasattr(lib, name) for name in ULFM_CALLS):
        return FaultTolerance(False, False, library, f"{library} was built without fault tolerance "
                                                     "(ompi_info: 'FT MPI support: no')")
    if not _ft_enabled(lib):
        return FaultTolerance(True, False, library, "the job was not started with fault tolerance on "
                                                    "(mpirun --with-ft ulfm)")
    return FaultTolerance(True, True, library)


def _loaded_libmpi() -> ctypes.CDLL | None:
    """The MPI library already loaded in this process, by one of ``LIBMPI_NAMES``; None when none is."""
    for name in LIBMPI_NAMES:
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
    return None


def _ft_enabled(lib: ctypes.CDLL) -> bool:
    """Open MPI's switch of its fault tolerance in this process (``mpi_ft_enable``, set by ``--with-ft ulfm``)."""
    try:
        return bool(ctypes.c_bool.in_dll(lib, "ompi_ftmpi_enabled").value)
    except ValueError:  # a build that names it otherwise: the variable the launcher sets
        return os.environ.get(FT_ENABLE_ENV, "").lower() in ("1", "true", "yes", "enabled")


def main() -> int:
    """``python -m mpi4py -m hpcnet.fault.ulfm``: what the job's MPI offers, printed by rank 0."""
    from mpi4py import MPI

    ft = detect(MPI.COMM_WORLD)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"{ft.describe()}; fault.recovery=auto means {recovery_mode('auto', ft)} "
              f"({MPI.COMM_WORLD.Get_size()} rank(s))", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
