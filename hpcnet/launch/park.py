"""The rank side of a warm standby (docs/fault-tolerance.md): park before MPI initialisation until released.

``hpcnet.launch`` starts the next attempt's processes while the current one runs, with ``HPCNET_STANDBY`` set
to a directory. Each rank imports what a start needs (torch, torch.optim, h5py, hpcnet, the configured model and
dataset factories: ``hpcnet.train`` does at import), writes ``parked.<rank>`` there (rank 0 also the number of
ranks), and blocks in ``sigwait`` for SIGUSR1: no CPU, only the memory of what it imported. The launcher
(mpirun, srun) forwards the supervisor's SIGUSR1 to every rank, which then initialises MPI and runs as any
attempt does. SIGUSR1 is blocked as soon as the ``hpcnet`` package is imported (``hpcnet/__init__.py``), so a
release that comes before a rank has parked waits for it instead of killing it. A standby rank asks for SIGKILL when its
parent (the launcher or its daemon) dies, as soon as ``hpcnet`` is imported; while parked it also wakes every
``WATCH_S`` seconds (microseconds of CPU) and leaves when its parent changed (it died before the request took
effect) or, on the supervisor's host, the supervisor is gone: no parked process outlives its job. Before it parks,
rank 0 writes ``imported.json``: the files of the modules it imported from outside the standard library and
site-packages, and the installed packages' versions, so the supervisor can tell whether what it would run is still
what a cold start would run (``hpcnet.launch.standby.imported_changes``).
"""

import contextlib
import importlib
import importlib.metadata
import json
import os
import signal
import site
import socket
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import hpcnet
from hpcnet.launch.stop import RANK_ENVS, env_int, report_rank
from hpcnet.paths import STANDBY_ENV, STANDBY_OWNER_ENV

RELEASE_SIGNAL = signal.SIGUSR1
WATCH_S = 2.0
ORPHAN_EXIT = 3
PARKED = "parked"
"""A standby rank's report that it has parked: ``parked.<rank>`` (``hpcnet.launch.stop.report_rank``)."""
IMPORTED_FILE = "imported.json"
"""What a standby's rank 0 imported before it parked (``imported_manifest``), in the standby's directory."""


def file_stat(path: Path) -> list[int] | None:
    """A file's modification time and size, what tells an edit (None: it cannot be read)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def _library_dirs() -> tuple[str, ...]:
    """The standard library's and site-packages' directories, each ending in a separator."""
    paths = sysconfig.get_paths()
    dirs = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    return tuple(sorted({os.path.join(os.path.realpath(d), "") for d in dirs if d}))


def user_module_files(modules: dict[str, Any] | None = None) -> list[str]:
    """The files of the imported ``modules`` (default ``sys.modules``) that lie outside the standard library and
    site-packages: the code that a package upgrade does not change and an edit does."""
    libraries = _library_dirs()
    files = set()
    for module in list((sys.modules if modules is None else modules).values()):
        name = getattr(module, "__file__", None)
        if isinstance(name, str) and name:
            path = os.path.realpath(name)
            if not path.startswith(libraries):
                files.add(path)
    return sorted(files)


def installed_packages(path: list[str]) -> dict[str, str]:
    """Name -> version of every package installed on ``path`` (a ``sys.path``); the first of a name wins, as it
    does for imports."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=list(path)):
        name = (dist.metadata["Name"] or "").lower()
        if name and name not in found:
            found[name] = dist.version
    return found


def imported_manifest() -> dict[str, Any]:
    """What this process imported, for ``hpcnet.launch.standby.imported_changes``: the modules' files outside the
    standard library and site-packages with their modification times and sizes, ``sys.path``, the installed
    packages' versions."""
    return {"modules": {path: file_stat(Path(path)) for path in user_module_files()}, "path": list(sys.path),
            "packages": installed_packages(sys.path)}


def standby_dir() -> Path | None:
    """Where this process reports that it is parked; None unless it is a standby."""
    value = os.environ.get(STANDBY_ENV, "")
    return Path(value) if value else None


def preimport(argv: list[str]) -> None:
    """Import what training imports at its start (``hpcnet.config.importing.import_for_training``) and the configured
    model and dataset factories' modules (best effort: a bad config is reported by the run itself, after the
    release)."""
    with contextlib.suppress(Exception):
        from hpcnet.config.importing import import_for_training

        import_for_training()
    with contextlib.suppress(Exception):
        from hpcnet.config.load import load_config, parse_command_line

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
    preimport(argv)
    if env_int(RANK_ENVS) in (0, None):  # before its parked report: the supervisor reads it once all have parked
        with contextlib.suppress(OSError):
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f"{IMPORTED_FILE}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(imported_manifest()) + "\n")
            os.replace(tmp, directory / IMPORTED_FILE)
    report_rank(directory, PARKED)
    t0 = time.monotonic()
    while signal.sigtimedwait({RELEASE_SIGNAL}, WATCH_S) is None:
        if orphaned(hpcnet._STANDBY_PARENT, os.environ.get(STANDBY_OWNER_ENV, "")):
            os._exit(ORPHAN_EXIT)
    parked_s = time.monotonic() - t0
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {RELEASE_SIGNAL})
    signal.signal(RELEASE_SIGNAL, signal.SIG_IGN)  # a second release must not end the run
    os.environ.pop(STANDBY_ENV, None)  # children of the run are not standbys
    return parked_s


def orphaned(parent: int, owner: str) -> bool:
    """Whether a parked process's job is gone: its parent is no longer ``parent`` (the pid it had when ``hpcnet``
    was imported), or ``owner`` ("host pid", the supervisor) names this host and no such process lives."""
    if parent and os.getppid() != parent:
        return True
    host, _, pid = owner.partition(" ")
    if pid.isdigit() and host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
    return False
