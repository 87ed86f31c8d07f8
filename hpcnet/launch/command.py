"""The command of each attempt: which launcher runs it, where hpcnet.train's arguments start, what is added.

Every attempt runs the user's command with its run and checkpoint directories
pinned, ``--resume auto`` from the second attempt on (``restart_args``), the attempt number
in ``HPCNET_ATTEMPT`` (docs/fault-tolerance.md says why) and, for
hpcnet.train, where its ranks report that they handle stop signals in
``HPCNET_READY`` (``hpcnet.launch.stop``) and the supervisor's token in ``HPCNET_LAUNCH_ID`` (with the attempt,
what the checkpoint directory's fence names: ``hpcnet.ckpt.fence``).
"""

import subprocess
from collections.abc import Sequence
from pathlib import Path

from hpcnet.config.load import override
from hpcnet.paths import ATTEMPT_ENV, LAUNCH_ID_ENV, READY_ENV

MPIRUN_NAMES = ("mpirun", "mpiexec", "orterun", "prterun")
LAUNCHER_KINDS = ("mpirun", "srun")
"""What ``--launcher-kind`` may declare: the options the launcher takes (``-np``, ``--host``, ``--hostfile`` as Open
MPI's mpirun; ``-n``, ``-N``, ``--exclude``, ``-w`` as SLURM's srun), which the supervisor rewrites."""
SIGKILL_TIMEOUT_ENV = "OMPI_MCA_odls_base_sigkill_timeout"


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
