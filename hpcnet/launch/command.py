"""A launcher's command line, read and rewritten in one place: which launcher it is, where its own options end and
the program starts, its options (the rank count, the host list), and what each attempt adds.

Every attempt runs the user's command with its run and checkpoint directories
pinned, ``--resume auto`` from the second attempt on (``restart_args``), the attempt number
in ``HPCNET_ATTEMPT`` (docs/fault-tolerance.md says why) and, for
hpcnet.train, where its ranks report that they handle stop signals in
``HPCNET_READY`` (``hpcnet.launch.stop``) and the supervisor's token in ``HPCNET_LAUNCH_ID`` (with the attempt,
what the checkpoint directory's fence names: ``hpcnet.ckpt.fence``).

A launcher's option is looked up among its own options only (``launcher_options``: after its name and before the
program), so an ``-np`` or ``--host`` of the program's is never taken for the launcher's.  Pure but ``is_openmpi``.
"""

import re
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from hpcnet.config.load import override
from hpcnet.paths import ATTEMPT_ENV, LAUNCH_ID_ENV, READY_ENV

MPIRUN_NAMES = ("mpirun", "mpiexec", "orterun", "prterun", "ftmpirun")
"""Launchers that take Open MPI's mpirun options (``scripts/ftmpirun`` runs Open MPI 5's with fault tolerance)."""
LAUNCHER_KINDS = ("mpirun", "srun")
"""What ``--launcher-kind`` may declare: the options the launcher takes (``-np``, ``--host``, ``--hostfile`` as Open
MPI's mpirun; ``-n``, ``-N``, ``--exclude``, ``-w`` as SLURM's srun), which the supervisor rewrites."""
SIGKILL_TIMEOUT_ENV = "OMPI_MCA_odls_base_sigkill_timeout"
MPIRUN_NP = ("-np", "--np", "-n", "--n", "-c")
MPIRUN_HOSTS = ("--host", "-host", "-H", "--H")
MPIRUN_HOSTFILES = ("--hostfile", "-hostfile", "--machinefile", "-machinefile", "--default-hostfile")
MPIRUN_PLACEMENT = (*MPIRUN_NP, *MPIRUN_HOSTS, *MPIRUN_HOSTFILES, "--map-by", "-map-by", "--rank-by", "-rank-by",
                    "-npernode", "--npernode", "-N", "-npersocket", "--npersocket", "--ppr")
"""mpirun options (each with a value) that place the job's ranks: a probe of one host leaves them out."""
SRUN_NTASKS = ("--ntasks", "-n")
SRUN_NODES = ("--nodes", "-N")
SRUN_EXCLUDE = ("--exclude", "-x")
_PROGRAM = re.compile(r"^(python[\d.]*|hpcnet-train)$")


class CommandError(ValueError):
    """A launcher command that cannot be read or run as asked (a message for the user, naming the option or host)."""


def launcher_kind(command: list[str], declared: str = "") -> str:
    """'mpirun', 'srun' or '' for another launcher (or none): ``declared`` (``--launcher-kind``, for a site's
    wrapper), else by the launcher's name."""
    if declared:
        return declared
    name = Path(command[0]).name if command else ""
    if name in MPIRUN_NAMES:
        return "mpirun"
    return "srun" if name == "srun" else ""


def is_openmpi(launcher: str) -> bool:
    """Whether ``launcher --version`` says Open MPI."""
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out.stdout + out.stderr or "OpenRTE" in out.stdout + out.stderr


def train_args_start(command: list[str]) -> int | None:
    """Index of the first argument of hpcnet.train in ``command``, or None if it does not run hpcnet.train."""
    for i, arg in enumerate(command):
        if arg == "hpcnet.train" and i > 0 and command[i - 1] == "-m":
            return i + 1
        if Path(arg).name == "hpcnet-train" or arg.endswith("hpcnet/train.py"):
            return i + 1
    return None


def program_index(command: list[str]) -> int | None:
    """Where the program starts in a launcher command (the first python, or hpcnet-train); None if not found."""
    for i, arg in enumerate(command[1:], start=1):
        if _PROGRAM.match(Path(arg).name) or arg.endswith("hpcnet/train.py"):
            return i
    return None


def launcher_end(command: list[str]) -> int:
    """Where the launcher's own options end: the program's start, else the end of the command."""
    found = program_index(command)
    return len(command) if found is None else found


def launcher_options(command: list[str], names: tuple[str, ...]) -> Iterator[tuple[int, int, str]]:
    """(index of the option, index of its value, value) of each of the launcher's options ``names``, as ``-o v``
    or (long options) ``--opt=v``."""
    end = launcher_end(command)
    for i in range(1, end):
        arg = command[i]
        for name in names:
            if arg == name and i + 1 < end:
                yield i, i + 1, command[i + 1]
                break
            if arg.startswith(name + "=") and name.startswith("--"):
                yield i, i, arg.split("=", 1)[1]
                break


def find_option(command: list[str], names: tuple[str, ...]) -> tuple[int, int, str] | None:
    """The first of the launcher's options ``names`` (``launcher_options``); None when it has none."""
    return next(launcher_options(command, names), None)


def set_option(command: list[str], where: tuple[int, int, str], value: str) -> list[str]:
    """``command`` with the option ``where`` (``find_option``) set to ``value``, in the form it was written."""
    i, j, _ = where
    out = list(command)
    out[j] = value if i != j else f"{command[i].split('=', 1)[0]}={value}"
    return out


def ranks_of(command: list[str], kind: str = "") -> int | None:
    """The number of ranks a launcher command asks for (mpirun ``-np``, srun ``-n``); None when it names none.
    ``kind``, here and below: the launcher's kind as declared (``launcher_kind``)."""
    kind = launcher_kind(command, kind)
    names = MPIRUN_NP if kind == "mpirun" else SRUN_NTASKS if kind == "srun" else ()
    found = find_option(command, names) if names else None
    if found is None:
        return None
    if not found[2].isdigit():
        raise CommandError(f"cannot read the number of ranks {command[found[0]]} {found[2]!r}")
    return int(found[2])


def set_ranks(command: list[str], ranks: int, nodes: int | None = None, kind: str = "") -> list[str]:
    """``command`` with ``ranks`` ranks: mpirun's ``-np`` or srun's ``-n`` rewritten (added when absent); srun's
    ``-N`` lowered to ``nodes`` when it asks for more."""
    kind = launcher_kind(command, kind)
    found = find_option(command, MPIRUN_NP if kind == "mpirun" else SRUN_NTASKS)
    if found is None:
        out = [command[0], "-np" if kind == "mpirun" else "-n", str(ranks), *command[1:]]
    else:
        out = set_option(command, found, str(ranks))
    if kind == "srun" and nodes is not None:
        node_opt = find_option(out, SRUN_NODES)
        if node_opt is not None and node_opt[2].isdigit() and int(node_opt[2]) > nodes:
            out = set_option(out, node_opt, str(nodes))
    return out


def parse_host_list(text: str) -> list[tuple[str, int]]:
    """The value of mpirun's ``--host`` as (host, slots): ``a:2,b`` is a with 2 slots, b 1; a repeated host adds up."""
    slots: dict[str, int] = {}
    for entry in (e for e in text.split(",") if e):
        host, _, count = entry.partition(":")
        if count and not count.isdigit():
            raise CommandError(f"cannot read the slots of {entry!r} in --host {text}")
        slots[host] = slots.get(host, 0) + (int(count) if count else 1)
    return list(slots.items())


def parse_hostfile(text: str) -> list[tuple[str, int]]:
    """An Open MPI hostfile as (host, slots): ``host slots=N`` (``host`` alone: 1 slot); comments skipped."""
    slots: dict[str, int] = {}
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        count = 1
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key in ("slots", "count", "cpu"):
                if not value.isdigit():
                    raise CommandError(f"cannot read the slots in the hostfile line {line.strip()!r}")
                count = int(value)
        slots[words[0]] = slots.get(words[0], 0) + count
    return list(slots.items())


def restart_args(resume: str, *, own: bool) -> list[str]:
    """What a restart appends to hpcnet.train's arguments so that it continues the run (pure).

    A restart resumes from the newest checkpoint of the run's own directory
    (``--resume auto``); until there is one, from where the first attempt started
    (``checkpoint.resume_else``: another run's checkpoint, or nothing: fresh).

    Args:
        resume: the user's ``checkpoint.resume`` as hpcnet.train resolves it (``--resume``, an override, the
            ``--config`` file): '' (fresh), 'auto' (then the user's own arguments already say it all) or a path.
        own: whether every checkpoint in the checkpoint directory is this run's (it held none when the
            supervisor started, or an attempt has committed since).  If not, the restart starts as the first
            attempt did: its refusal of a directory that holds another run's checkpoints (or its
            ``checkpoint.move_aside``) then still applies, where ``auto`` would resume that other run.
    """
    if resume == "auto" or not own:
        return []
    return ["--resume", "auto", *([override("checkpoint.resume_else", resume)] if resume else [])]


def restart_from(resume: str, *, own: bool) -> str:
    """Where a restart starts, in words (``restart_args``)."""
    if not own and resume != "auto":
        return "as the first attempt did (the checkpoint directory held checkpoints before it started)"
    return "from the newest checkpoint" + (f", else from {resume}" if resume not in ("", "auto") else "")


def launcher_env(environ: dict[str, str], openmpi: bool) -> dict[str, str]:
    """The launcher's environment: for Open MPI, no grace period when it ends a failed job.

    When a rank dies (or the monitor calls MPI_Abort), mpirun sends the other
    ranks SIGTERM and, ``odls_base_sigkill_timeout`` (1 s) later, SIGKILL.
    hpcnet's ranks cannot use that second: they are blocked in a collective
    with the dead rank, and a checkpoint in flight needs it too; with 0,
    mpirun exits as soon as the ranks are gone.  A value the user set is kept.
    """
    env = dict(environ)
    if openmpi:
        env.setdefault(SIGKILL_TIMEOUT_ENV, "0")
    return env


def attempt_command(base: list[str], attempt: int, *, train_start: int | None, pinned: list[str],
                    openmpi: bool, restart: Sequence[str] = (), kind: str = "") -> list[str]:
    """The command of attempt ``attempt``: pinned run/checkpoint directories, ``restart`` from attempt 2.

    Args:
        base: the user's command (with hosts already excluded).
        train_start: where hpcnet.train's arguments begin (None: not an hpcnet.train command).
        pinned: ``section.key=value`` overrides appended to hpcnet.train's arguments.
        openmpi: the launcher is Open MPI's mpirun, which exports a variable to
            remote ranks only when told (``-x``).
        restart: what a restart appends to hpcnet.train's arguments (``restart_args``).
        kind: the launcher's kind as declared (``launcher_kind``).
    """
    command = list(base)
    exported = [ATTEMPT_ENV]
    if train_start is not None:
        train_args = command[train_start:] + pinned
        if attempt > 1:
            train_args += list(restart)
        command = command[:train_start] + train_args
        exported += [READY_ENV, LAUNCH_ID_ENV]
    if openmpi and launcher_kind(command, kind) == "mpirun":
        command = [command[0], *(arg for name in exported for arg in ("-x", name)), *command[1:]]
    return command
