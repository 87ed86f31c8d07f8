"""Stop signals in a rank of ``hpcnet.train``, from its first line to its exit (docs/fault-tolerance.md).

SIGTERM and SIGUSR2 (preemption, ``scancel``, ``hpcnet.launch`` passing on its own) and SIGINT (Ctrl-C) ask the
run to save and stop at the next step boundary.  Their default action ends the process, so a signal that comes
before the handler is installed or after it is removed kills the rank (status 140, 143) instead: the job is not
requeued and the steps since the last checkpoint are lost.  So ``python -m hpcnet.train`` installs
``StopRequest`` as its first statement, before it imports torch (seconds), keeps it until its status is decided
and ignores the signals from then to the exit (``StopRequest.ignore``): a stop that comes during start-up, a resume
or a standby's parking takes effect at the first step boundary, and one that comes after the last step changes
nothing (the run finished: status 0).

What no Python code can cover is the interpreter's own start before that first statement, and, under a
launcher, the launcher's start and the time before it has started every rank.  ``hpcnet.launch`` therefore
passes a stop signal on to the job only once every rank has said that its handler is installed: each rank
writes ``ready.<rank>`` into the directory named by ``HPCNET_READY`` right after installing it
(``hpcnet.launch.forward``).  Stdlib only: it runs before anything heavy is imported.

The reports (``report_rank``: ready, a standby's parked) are counted by the supervisor (``reported_ranks``) and
cleared when the processes that wrote them are gone (``clear_reports``).
"""

import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from hpcnet.paths import READY_ENV

RANK_ENVS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "PMI_RANK")
"""Where launchers put a rank's number before MPI is initialised."""
SIZE_ENVS = ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE")
"""... and the number of ranks."""
NODE_ENVS = ("SLURMD_NODENAME",)
"""... and the scheduler's name for the node (what its node list and ``srun --exclude`` use)."""
SUPERVISOR_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT, signal.SIGHUP)
"""What ``hpcnet.launch`` passes on to the job (and blocks from its first line until it handles them)."""
READY = "ready"
"""The name of a rank's report that its stop handler is installed: ``ready.<rank>``."""


class StopRequest:
    """Remember a SIGINT/SIGTERM/SIGUSR2 so the loop can stop at a step boundary.

    The signal handler only sets a flag; the ranks agree on it once per step,
    so all of them stop after the same step even when only one was signalled.
    A second SIGINT raises ``KeyboardInterrupt`` (stop now).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopRequest":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def ignore(self) -> None:
        """Ignore the stop signals from now to the exit: the run's status is decided, and as the interpreter shuts
        down Python puts back their default action, which would kill the process."""
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        """The handlers from before ``install`` (for a caller that runs training inside its own process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def env_int(names: tuple[str, ...]) -> int | None:
    """The first of the environment variables ``names`` that holds a number, or None."""
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def report_rank(directory: Path, kind: str) -> None:
    """Write ``<kind>.<rank>`` into ``directory``: "<number of ranks> <pid> <time> <host> <addresses> <node>" (the
    number, on rank 0 at least, tells the reader how many reports to expect; the host, its IPv4 addresses and the
    scheduler's name for it tell the supervisor which ranks a lost host ran and which entry of the launcher's host
    list it is, ``hpcnet.launch.hosts.entries_naming``; '-' for none); best effort, a report that cannot be written
    only makes its reader wait longer. A process that no launcher numbered is a job of one."""
    rank, size = env_int(RANK_ENVS), env_int(SIZE_ENVS)
    if rank is None and size is None:
        rank, size = 0, 1
    node = next((os.environ[name] for name in NODE_ENVS if os.environ.get(name, "").strip()), "-")
    # Imported here, once the stop handler is installed: the module is imported before it, as the first thing.
    from hpcnet.comm.netif import interfaces

    try:
        addresses = ",".join(i.address for i in interfaces()) or "-"
    except OSError:  # no /sys/class/net to read: the host is still named
        addresses = "-"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        name = f"{kind}.{rank if rank is not None else os.getpid()}"
        (directory / name).write_text(f"{size if size is not None else ''} {os.getpid()} {time.time():.3f} "
                                     f"{socket.gethostname()} {addresses} {node.split()[0]}\n")
    except OSError:
        pass


def reported_ranks(directory: Path, kind: str) -> tuple[int, int | None]:
    """How many ranks have reported ``kind`` (``report_rank``) in ``directory``, and how many there are (from rank
    0's report; None: unknown)."""
    try:
        names = [p.name for p in directory.glob(f"{kind}.*")]
    except OSError:
        return 0, None
    size = None
    try:
        first = (directory / f"{kind}.0").read_text().split()
        size = int(first[0]) if first and first[0].isdigit() else None
    except (OSError, IndexError):
        pass
    return len(names), size


def clear_reports(directory: Path, *patterns: str) -> None:
    """Remove the files of ``directory`` that match ``patterns`` (reports of processes that are gone)."""
    for pattern in patterns:
        with contextlib.suppress(OSError):
            for old in directory.glob(pattern):
                old.unlink(missing_ok=True)


def hold_stop_signals() -> StopRequest:
    """Install the stop handler for the life of this process and report it (``HPCNET_READY``); the first thing
    ``python -m hpcnet.train`` does."""
    stop = StopRequest().install()
    directory = os.environ.get(READY_ENV, "")
    if directory:
        report_rank(Path(directory), READY)
    return stop
