"""Warm standby, the supervisor's side (docs/fault-tolerance.md): when to start one, what makes one stale, how to
tell that its ranks are parked. The ranks' side is ``hpcnet.launch.park``; the process handling is in
``hpcnet.launch.supervisor``.

A cold restart spends most of its seconds starting: the launcher, the interpreters, importing torch and h5py,
and, on a real cluster, all of that from a parallel file system on every node at once. A standby does it while the
current attempt trains: it is the next attempt's own command (same launcher, hosts, arguments, ``--resume auto``)
whose ranks park before MPI initialisation. When the attempt fails, the supervisor releases it (SIGUSR1 to the
launcher, which forwards it to every rank) and starts the next standby. A standby is used only if what it would
run is what a cold restart would run now. The supervisor compares (``fingerprint``, ``fingerprint_changes``) the
command, the environment, the host files (named in the command, ``--hostfile=PATH`` too, or by environment
variables such as ``OMPI_MCA_orte_default_hostfile``, ``SLURM_HOSTFILE``, ``PBS_NODEFILE``), hpcnet's code and the
``--config`` file as they were when the standby started with how they are now; and what the standby's ranks
imported before they parked, as rank 0 recorded it (``imported_manifest``, ``imported_changes``): the file of every
module from outside the standard library and site-packages (the model and dataset factories' modules, hpcnet
itself in a checkout) and the version of every package installed on their ``sys.path`` (torch among them).
"""

import contextlib
import importlib.metadata
import os
import re
import site
import sys
import sysconfig
from pathlib import Path
from typing import Any

import hpcnet
from hpcnet.launch.hosts import MPIRUN_HOSTFILE_OPTIONS

TRIGGER = re.compile(r"^step\s+\d+/\d+ \|")
"""The attempt's first step line (rank 0's log): its start-up, imports, checkpoint load and first steps, is over,
and the standby starts then, so the two do not compete for the CPU (started at the earlier ``gradients:`` line,
the standby's imports slow down the load and first step of the attempt it is made beside)."""
TRIGGER_TIMEOUT_S = 60.0
"""... or this long after the attempt started, whichever comes first."""
PARK_WAIT_S = 60.0
"""At a failure, how long the supervisor waits for a standby's ranks still importing to park before it releases
them (a release before a rank has blocked the signal would end it); past it the standby is discarded."""
HOSTFILE_OPTIONS = (*MPIRUN_HOSTFILE_OPTIONS, "--nodefile")
"""Launcher options that name a host file (mpirun's, srun's ``--nodefile``)."""
HOSTFILE_ENV = re.compile(r"(host|node|machine)_?file$", re.IGNORECASE)
"""Environment variables that name a host file a launcher reads: ``OMPI_MCA_orte_default_hostfile``,
``PRTE_MCA_prte_default_hostfile``, ``HYDRA_HOST_FILE``, ``SLURM_HOSTFILE``, ``PBS_NODEFILE``."""
PARKED = "parked"
"""A standby rank's report that it has parked: ``parked.<rank>`` (``hpcnet.launch.stop.report_rank``)."""
IMPORTED_FILE = "imported.json"
"""What a standby's rank 0 imported before it parked (``imported_manifest``), in the standby's directory."""


def standby_command(command: list[str], launcher: str) -> list[str]:
    """The next attempt's command as a standby runs it: under srun a step that may share the allocation's CPUs
    with the running one (``--overlap``)."""
    if launcher == "srun" and "--overlap" not in command:
        return [command[0], "--overlap", *command[1:]]
    return list(command)


def _file_stat(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size]


def code_stat() -> list[tuple[str, list[int] | None]]:
    """Hpcnet's source files with their modification times and sizes."""
    root = Path(hpcnet.__file__).parent
    return [(str(p.relative_to(root)), _file_stat(p)) for p in sorted(root.rglob("*.py"))]


def hostfile_paths(command: list[str], env: dict[str, str]) -> list[str]:
    """The host files that ``command`` names (``--hostfile PATH`` or ``--hostfile=PATH``), then those that
    environment variables name (``HOSTFILE_ENV``)."""
    paths = []
    for i, arg in enumerate(command):
        for option in HOSTFILE_OPTIONS:
            if arg == option and i + 1 < len(command):
                paths.append(command[i + 1])
            elif arg.startswith(option + "="):
                paths.append(arg.split("=", 1)[1])
    paths += [value for name, value in sorted(env.items()) if value and HOSTFILE_ENV.search(name)]
    return paths


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def fingerprint(command: list[str], env: dict[str, str], config_file: str | None) -> dict[str, Any]:
    """What a standby must share with the attempt it stands in for: command, environment, host files' contents,
    hpcnet's code and the config file (compared by ``fingerprint_changes``)."""
    return {"command": list(command), "env": dict(env),
            "hostfiles": {path: _read(path) for path in hostfile_paths(command, env)},
            "code": dict(code_stat()),
            "config": {config_file: _file_stat(Path(config_file))} if config_file else {}}


def _names(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


_ABSENT = object()


def _changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The keys whose values differ, or that only one of the two has."""
    return sorted(key for key in old.keys() | new.keys() if old.get(key, _ABSENT) != new.get(key, _ABSENT))


def fingerprint_changes(old: dict[str, Any], new: dict[str, Any]) -> str:
    """What differs between two ``fingerprint`` records, in words ('' if nothing): which environment variables
    (names only: values may be secrets), host files, hpcnet files, config file."""
    changes = []
    if old["command"] != new["command"]:
        changes.append("the command changed")
    if names := _changed_keys(old["env"], new["env"]):
        changes.append(f"the environment changed ({_names(names)})")
    if names := _changed_keys(old["hostfiles"], new["hostfiles"]):
        changes.append(f"the host file changed ({_names(names)})")
    if names := _changed_keys(old["code"], new["code"]):
        changes.append(f"hpcnet's code changed ({_names(names)})")
    if names := _changed_keys(old["config"], new["config"]):
        changes.append(f"the config file changed ({_names(names)})")
    return "; ".join(changes)


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
    """What this process imported, for ``imported_changes``: the modules' files outside the standard library and
    site-packages with their modification times and sizes, ``sys.path``, the installed packages' versions."""
    return {"modules": {path: _file_stat(Path(path)) for path in user_module_files()}, "path": list(sys.path),
            "packages": installed_packages(sys.path)}


def imported_changes(recorded: dict[str, Any], packages: Any = None) -> str:
    """What changed since a standby recorded ``recorded`` (``imported_manifest``), in words; '' if nothing.

    ``packages``: reads the versions installed on a ``sys.path`` now (default ``installed_packages``).
    """
    changes = []
    edited = [path for path, stat in recorded["modules"].items() if _file_stat(Path(path)) != stat]
    if edited:
        changes.append(f"code it imported changed ({_names(edited)})")
    before, now = recorded["packages"], (packages or installed_packages)(recorded["path"])
    versions = [f"{name} {before.get(name, 'not installed')} -> {now.get(name, 'removed')}"
                for name in sorted(before.keys() | now.keys()) if before.get(name) != now.get(name)]
    if versions:
        changes.append(f"installed packages changed ({_names(versions)})")
    return "; ".join(changes)


def parked_ranks(directory: Path, kind: str = PARKED) -> tuple[int, int | None]:
    """How many ranks have reported ``kind`` (parked, ready: ``hpcnet.launch.stop.report_rank``) in ``directory``, and
    how many there are (from rank 0's report; None: unknown)."""
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
