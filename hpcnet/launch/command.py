"""The command of each attempt: which launcher runs it, where hpcnet.train's arguments start, what is added.

Every attempt runs the user's command with its run and checkpoint directories
pinned, ``--resume auto`` from the second attempt on, the attempt number
in ``HPCNET_ATTEMPT`` (docs/fault-tolerance.md says why) and, for
hpcnet.train, where its ranks report that they handle stop signals in
``HPCNET_READY`` (``hpcnet.launch.stop``) and the supervisor's token in ``HPCNET_LAUNCH_ID`` (with the attempt,
what the checkpoint directory's fence names: ``hpcnet.ckpt.fence``).
"""

import subprocess
from pathlib import Path

from hpcnet.config.load import parse_command_line
from hpcnet.paths import ATTEMPT_ENV, LAUNCH_ID_ENV, READY_ENV

MPIRUN_NAMES = ("mpirun", "mpiexec", "orterun", "prterun")
SIGKILL_TIMEOUT_ENV = "OMPI_MCA_odls_base_sigkill_timeout"


def launcher_kind(command: list[str]) -> str:
    """'mpirun', 'srun' or '' for another launcher (or none)."""
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


def resume_args(train_args: list[str]) -> list[str]:
    """What to append so the run resumes from the newest checkpoint ('' if it already does)."""
    parsed = parse_command_line(train_args)
    resume = parsed.resume
    for item in parsed.overrides:  # --resume wins over checkpoint.resume=..., as in hpcnet.train
        if resume is None and item.startswith("checkpoint.resume="):
            resume = item.split("=", 1)[1]
    return [] if resume == "auto" else ["--resume", "auto"]


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
                    openmpi: bool) -> list[str]:
    """The command of attempt ``attempt``: pinned run/checkpoint directories, --resume auto from attempt 2.

    Args:
        base: the user's command (with hosts already excluded).
        train_start: where hpcnet.train's arguments begin (None: not an hpcnet.train command).
        pinned: ``section.key=value`` overrides appended to hpcnet.train's arguments.
        openmpi: the launcher is Open MPI's mpirun, which exports a variable to
            remote ranks only when told (``-x``).
    """
    command = list(base)
    exported = [ATTEMPT_ENV]
    if train_start is not None:
        train_args = command[train_start:] + pinned
        if attempt > 1:
            train_args += resume_args(train_args)
        command = command[:train_start] + train_args
        exported += [READY_ENV, LAUNCH_ID_ENV]
    if openmpi and launcher_kind(command) == "mpirun":
        command = [command[0], *(arg for name in exported for arg in ("-x", name)), *command[1:]]
    return command
