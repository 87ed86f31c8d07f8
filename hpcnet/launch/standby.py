"""Warm standby, the supervisor's side (README: Automatic restart): when to start one, what makes one stale, how to
tell that its ranks are parked. The ranks' side is ``hpcnet.launch.park``; the process handling is in
``hpcnet.launch.supervisor``.

A cold restart spends most of its seconds starting: the launcher, the interpreters, importing torch and h5py,
and, on a real cluster, all of that from a parallel file system on every node at once. A standby does it while the
current attempt trains: it is the next attempt's own command (same launcher, hosts, arguments, ``--resume auto``)
whose ranks park before MPI initialisation. When the attempt fails, the supervisor releases it (SIGUSR1 to the
launcher, which forwards it to every rank) and starts the next standby. A standby is used only if what it would
run is what a cold restart would run now: the fingerprint covers the command, the environment, the host file,
hpcnet's code and the ``--config`` file.
"""

import hashlib
import json
import re
from pathlib import Path

import hpcnet

TRIGGER = re.compile(r"^step\s+\d+/\d+ \|")
"""The attempt's first step line (rank 0's log): its start-up, imports, checkpoint load and first steps, is over,
and the standby starts then, so the two do not compete for the CPU (measured here: started at the earlier
``gradients:`` line, the standby's imports doubled the load and first step of the attempt it was made beside)."""
TRIGGER_TIMEOUT_S = 60.0
"""... or this long after the attempt started, whichever comes first."""
PARK_WAIT_S = 60.0
"""At a failure, how long the supervisor waits for a standby's ranks still importing to park before it releases
them (a release before a rank has blocked the signal would end it); past it the standby is discarded."""
HOSTFILE_OPTIONS = ("--hostfile", "-hostfile", "--machinefile", "-machinefile", "--default-hostfile")


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
    """hpcnet's source files with their modification times and sizes."""
    root = Path(hpcnet.__file__).parent
    return [(str(p.relative_to(root)), _file_stat(p)) for p in sorted(root.rglob("*.py"))]


def fingerprint(command: list[str], env: dict[str, str], config_file: str | None) -> str:
    """What a standby must share with the attempt it stands in for: command, environment, host file contents,
    hpcnet's code and the config file."""
    hostfiles = []
    for i, arg in enumerate(command[:-1]):
        if arg in HOSTFILE_OPTIONS:
            try:
                hostfiles.append(Path(command[i + 1]).read_text())
            except OSError:
                hostfiles.append(None)
    record = {"command": command, "env": sorted(env.items()), "hostfiles": hostfiles, "code": code_stat(),
              "config": [config_file, _file_stat(Path(config_file)) if config_file else None]}
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def parked_ranks(directory: Path) -> tuple[int, int | None]:
    """How many ranks have parked in ``directory``, and how many there are (from rank 0's report; None: unknown)."""
    try:
        names = [p.name for p in directory.glob("parked.*")]
    except OSError:
        return 0, None
    size = None
    try:
        first = (directory / "parked.0").read_text().split()
        size = int(first[0]) if first and first[0].isdigit() else None
    except (OSError, IndexError):
        pass
    return len(names), size
