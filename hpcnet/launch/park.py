"""The rank side of a warm standby (README: Automatic restart): park before MPI initialisation until released.

``hpcnet.launch`` starts the next attempt's processes while the current one runs, with ``HPCNET_STANDBY`` set
to a directory. Each rank imports what a start needs (torch, torch.optim, h5py, hpcnet, the configured model and
dataset factories: ``hpcnet.train`` does at import), writes ``parked.<rank>`` there (rank 0 also the number of
ranks), and blocks in ``sigwait`` for SIGUSR1: no CPU, only the memory of what it imported. The launcher
(mpirun, srun) forwards the supervisor's SIGUSR1 to every rank, which then initialises MPI and runs as any
attempt does. SIGUSR1 is blocked as soon as the ``hpcnet`` package is imported (``hpcnet/__init__.py``), so a
release that comes before a rank has parked waits for it instead of killing it. A parked rank asks for SIGKILL when its
parent (the launcher's daemon) dies, so none outlives its job.
"""

import contextlib
import ctypes
import importlib
import os
import signal
import time
from pathlib import Path

from hpcnet.layout import STANDBY_ENV

RELEASE_SIGNAL = signal.SIGUSR1
RANK_ENVS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID", "PMI_RANK")
SIZE_ENVS = ("OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS", "PMI_SIZE")


def standby_dir() -> Path | None:
    """Where this process reports that it is parked; None unless it is a standby."""
    value = os.environ.get(STANDBY_ENV, "")
    return Path(value) if value else None


def _env_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _preimport(argv: list[str]) -> None:
    """Import the configured model and dataset factories' modules (best effort: a bad config is reported by the
    run itself, after the release)."""
    with contextlib.suppress(Exception):
        from hpcnet.config_manager import load_config, parse_command_line

        parsed = parse_command_line(argv)
        cfg = load_config(parsed.config, parsed.overrides)
        for spec in (cfg.model.factory, cfg.data.dataset):
            if ":" in spec:
                importlib.import_module(spec.split(":", 1)[0])


def park(argv: list[str]) -> float:
    """Wait for the release (SIGUSR1) if this process is a standby; return the seconds parked (0: not a standby)."""
    directory = standby_dir()
    if directory is None:
        return 0.0
    with contextlib.suppress(OSError, AttributeError):  # Linux: die with the launcher's daemon
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    _preimport(argv)
    rank = _env_int(RANK_ENVS)
    size = _env_int(SIZE_ENVS)
    with contextlib.suppress(OSError):
        directory.mkdir(parents=True, exist_ok=True)
        name = f"parked.{rank if rank is not None else os.getpid()}"
        (directory / name).write_text(f"{size if size is not None else ''} {os.getpid()} {time.time():.3f}\n")
    t0 = time.monotonic()
    signal.sigwait({RELEASE_SIGNAL})
    parked_s = time.monotonic() - t0
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {RELEASE_SIGNAL})
    signal.signal(RELEASE_SIGNAL, signal.SIG_IGN)  # a second release must not end the run
    os.environ.pop(STANDBY_ENV, None)  # children of the run are not standbys
    return parked_s
