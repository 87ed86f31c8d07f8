"""Where a run's files go and what they are called, the environment variables hpcnet reads, and what kind of file
a path a user gives is (``file_kind``).

The one home of the names that the trainer, the checkpoint store, the monitor
and the restart supervisor must agree on (docs/outputs.md and docs/checkpoints.md
describe what the files hold).  Torch-free and dependency-free: ``hpcnet.launch``
imports it.
"""

import os
import re
import stat
import time
from pathlib import Path

ATTEMPT_ENV = "HPCNET_ATTEMPT"
"""Set by ``hpcnet.launch`` for every attempt: 1, 2, ... (absent: 1)."""
LAUNCH_ID_ENV = "HPCNET_LAUNCH_ID"
"""Set by ``hpcnet.launch`` for every attempt: a random token of the supervisor's run, the same for all its attempts;
with ``ATTEMPT_ENV`` it names who may commit checkpoints (``FENCE_NAME``)."""
STANDBY_ENV = "HPCNET_STANDBY"  # also read in hpcnet/__init__.py, which may import nothing
STANDBY_OWNER_ENV = "HPCNET_STANDBY_OWNER"  # "host pid" of the supervisor that started a standby
"""Set by ``hpcnet.launch`` on a warm standby attempt: the directory where its ranks report that they are parked.
Such a rank imports everything, then waits for SIGUSR1 before MPI initialisation (``hpcnet.launch.park``)."""
READY_ENV = "HPCNET_READY"
"""Set by ``hpcnet.launch`` for every attempt of ``hpcnet.train``: the directory where each rank reports that its
stop-signal handler is installed (``hpcnet.launch.stop``); the supervisor passes a stop signal on only after that."""
RANKS_PER_NODE_ENV = "HPCNET_RANKS_PER_NODE"
"""Splits one machine into virtual nodes of this many ranks each, so multi-node code paths run on one host."""

CONFIG_FILE = "config.toml"
"""The resolved config, in the run directory."""
SUMMARY_FILE = "summary.json"
"""The run's summary (steps, losses, rates, step_stats), written by rank 0 at the end."""
FAILURE_FILE = "failure.json"
"""The monitor's report of a failure it detected; the supervisor reads it after an attempt."""
FAILURE_LOCK = ".failure.json.lock"
"""Held (``flock``) by a rank while it merges its report into ``failure.json``: two watchers that declare at once
would otherwise each read the file before the other wrote it, and the last write would drop the first's ranks."""
OWNERS_FILE = "owners.json"
"""With dist.zero > 0: who owns which parameter, the measured speeds and link the cost model used."""
TRACE_FILE = "trace.json"
"""The merged Chrome trace of ``train.trace_steps``, in the run directory."""
TENSORBOARD_DIR = "tensorboard"
"""With ``run.tensorboard``: rank 0's TensorBoard event files, a folder of the run directory (one file a run in it:
a resumed run adds its own)."""
LAUNCH_FILE = "launch.json"
"""The supervisor's record of every attempt, in the launch directory."""


def rank_log(rank: int) -> str:
    return f"rank{rank}.log"


def metrics_file(rank: int) -> str:
    return f"metrics.rank{rank}.jsonl"


def stall_dump(rank: int) -> str:
    """A rank's stacks and flight recorder, written when a stall, desync or deadline is reported."""
    return f"stall.rank{rank}.txt"


def run_dir_path(parent: str | Path, name: str, *, exact: bool) -> Path:
    """The run directory ``run.dir``/``run.name`` give: ``<run.dir>/<run.name>-<UTC time>``, or ``run.dir`` itself.

    A timestamped directory that exists already (two runs started in the same
    second) gets a suffix.  Nothing is created.
    """
    if exact:
        return Path(parent)
    path = Path(parent) / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    if path.exists():
        path = path.with_name(path.name + f"-{time.monotonic_ns() % 10**6:06d}")
    return path


def attempt_dir(launch_dir: Path, attempt: int) -> Path:
    """The run directory of attempt ``attempt`` (1, 2, ...) under ``hpcnet.launch``."""
    return launch_dir / f"attempt-{attempt}"


def ready_dir(launch_dir: Path, attempt: int) -> Path:
    """Where the ranks of attempt ``attempt`` report that they handle stop signals (``READY_ENV``)."""
    return launch_dir / f"ready-{attempt}"


def checkpoint_dir(run_dir: str, run_name: str, checkpoint_dir: str) -> Path:
    """``checkpoint.dir``, or ``<run.dir>/<run.name>.ckpt`` (shared by every run of that name)."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / f"{run_name}.ckpt"


CKPT_NAME_RE = re.compile(r"^ckpt-(\d{10,19})\.h5$")
"""A committed checkpoint file; group 1 is its step."""
TMP_SUFFIX = ".tmp"
"""Ends the name of a checkpoint (or ``latest``) while it is written; committing is the rename to its name."""
CKPT_TMP_RE = re.compile(r"^(ckpt-\d{10,19}\.h5)(\.[0-9a-f]{1,64})?\.tmp$")
"""An uncommitted checkpoint (``checkpoint_tmp_name``, or ``ckpt-<step>.h5.tmp`` as earlier versions named it);
group 1 is the name it would have been committed under."""
LATEST_NAME = "latest"
"""A text file naming the newest committed checkpoint."""
FENCE_NAME = "fence"
"""In the checkpoint directory: the attempt (and the supervisor's run) that alone may commit checkpoints there,
written by ``hpcnet.launch`` before it starts each attempt (``hpcnet.ckpt.fence``)."""
ASIDE_PREFIX = "aside-"
"""Checkpoints that a run set aside (never deleted) go to ``<dir>/aside-<UTC time>-<why>/``."""


def checkpoint_name(step: int) -> str:
    """The committed file name of the checkpoint of ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"ckpt-{step:010d}.h5"


def checkpoint_tmp_name(step: int, token: str) -> str:
    """The name the checkpoint of ``step`` is written under until its commit: ``ckpt-<step>.h5.<token>.tmp``.

    ``token`` (hex) is the save's own (its uid): in a directory others can write
    to, a link planted at a name known in advance would redirect the write.
    """
    return f"{checkpoint_name(step)}.{token}{TMP_SUFFIX}"


_SPECIAL_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                  (stat.S_ISBLK, "block device"))


def file_kind(path: str | os.PathLike[str]) -> str:
    """What ``path`` names, following links: 'file' (a regular one), 'directory', 'missing', or a special file's
    kind ('FIFO', 'socket', 'character device', 'block device').

    Every reader of a path a user gives asks this before opening it: opening a
    FIFO waits for a writer and a device may never end, while ``stat`` waits
    for neither.  A writer asks it too, so that it never replaces a device or a
    FIFO with a file.
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "missing"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "directory"
    return next((kind for test, kind in _SPECIAL_KINDS if test(mode)), "special file")
