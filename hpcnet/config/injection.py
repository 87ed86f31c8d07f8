"""The ``fault`` section: how a lost rank is recovered (``hpcnet.fault.ulfm`` resolves it), and failures injected on
purpose, to test recovery (``hpcnet.fault.inject`` injects them)."""

import math
from dataclasses import dataclass

from hpcnet.config.durations import check_durations
from hpcnet.errors import ConfigError

RECOVERY_MODES = ("auto", "shrink", "restart")
"""The values of ``fault.recovery``."""
GROW_MODES = ("spawn", "off")
"""The values of ``fault.grow``."""


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    """The ``fault`` section: the recovery mode, and fault injection for testing recovery."""

    recovery: str = "auto"
    """What the job does when a rank dies: 'shrink' goes on without it, in the same job (needs ULFM: Open MPI >= 5
    started with mpirun --with-ft ulfm, scripts/ftmpirun); 'restart' ends the job, for hpcnet.launch to restart
    from the newest checkpoint; 'auto' shrinks where ULFM is active and restarts elsewhere."""
    grow: str = "off"
    """After a shrink: 'spawn' starts replacements for the lost ranks (MPI_Comm_spawn, on free slots of the job's
    allocation) and the job grows back to its first size at the step boundary after they are ready, their state
    taken from the ranks; 'off' goes on at the shrunk size."""
    grow_retry_s: float = 30.0
    """Seconds between tries to start replacements where none could be started (no free slot yet)."""
    replicas: int = 0
    """With fault.recovery=shrink (or auto under ULFM) at dist.zero 1 to 3: 1 keeps a copy of each rank's state in
    another rank's host memory (on another host where there is one), taken at every step's end, so that the survivors
    of a lost rank go on from the last step with nothing read from disk (docs/fault-tolerance.md, "Mirrors"); 0 = none
    (the survivors read the newest checkpoint)."""
    grow_after_steps: int = 0
    """Fault injection, with fault.grow=spawn: the survivors wait for the replacements (up to 300 s) at the boundary
    this many steps after they started them (at the first boundary after a shrink), and grow back there (a join at
    a known step); 0 = at the first boundary after the replacements are ready."""
    kill_at_step: int = 0
    """Fault injection: SIGKILL the chosen rank when it reaches this step (0 = never)."""
    kill_every_steps: int = 0
    """Fault injection, with fault.kill_at_step: kill the chosen rank of the job as it is then again every this many
    steps (a series of losses for fault.recovery=shrink; each step's kill happens once in a job, also where a
    survivor computes the step again); 0 = once."""
    hang_at_step: int = 0
    """Fault injection: the chosen rank stops (SIGSTOP) at this step."""
    sleep_at_step: int = 0
    """Fault injection: the chosen rank sleeps fault.sleep_s at this step (a hang that ends)."""
    sleep_s: float = 0.0
    """Seconds for fault.sleep_at_step."""
    slow_s: float = 0.0
    """Fault injection: the chosen rank sleeps this long in every step (a straggler)."""
    slow_per_sample_s: float = 0.0
    """Fault injection: the chosen rank's forward sleeps this long per sample of its micro-batch (a slower device: what
    data.balance=auto can even out)."""
    corrupt_checkpoint: bool = False
    """Fault injection: corrupt the newest committed checkpoint before resuming."""
    fill_disk_at_step: int = 0
    """Fault injection: checkpoint writes from this step on fail with ENOSPC (a full file system)."""
    write_error: str = ""
    """Fault injection: the chosen rank's checkpoint writes fail inside the write with 'ENOSPC', 'EDQUOT' or 'EIO';
    'fill' fills the checkpoint file system for real (a file fill-disk.fault in checkpoint.dir, left there) in the save,
    before its space is allocated, so that even the file's close cannot write."""
    write_error_at_step: int = 1
    """The first step whose save fault.write_error hits."""
    slow_save_s: float = 0.0
    """Fault injection: the chosen rank's checkpoint save sleeps this long before every collective file create (a slow
    peer)."""
    stuck_save_at_step: int = 0
    """Fault injection: in the save of this step, the chosen rank's save blocks for good (GIL released, as in a stuck
    write)."""
    stuck_fs_at_step: int = 0
    """Fault injection: in the save of this step, every rank's save blocks for good in the file's structure calls,
    holding the GIL (a stuck file system)."""
    hang_at_startup: str = ""
    """Fault injection: the chosen rank blocks for good just before this start-up phase ('probe', 'rendezvous' or
    'groups'; see dist.startup_timeout_s), so the others wait there for it; empty = never."""
    rank: int = -1
    """The rank the fault hits; -1 = the last rank."""
    only_attempt: int = 0
    """Inject only in this attempt of hpcnet.launch (1 = the first), in its first world (before any shrink:
    fault.recovery); 0 = every attempt and world."""

    def __post_init__(self) -> None:
        if self.recovery not in RECOVERY_MODES:
            raise ConfigError(f"fault.recovery: {self.recovery!r} is not one of "
                              f"{', '.join(map(repr, RECOVERY_MODES))}")
        if self.grow not in GROW_MODES:
            raise ConfigError(f"fault.grow: {self.grow!r} is not one of {', '.join(map(repr, GROW_MODES))}")
        if self.replicas not in (0, 1):
            raise ConfigError(f"fault.replicas must be 0 or 1 (one mirror of each rank's state), got {self.replicas}")
        if self.replicas and self.recovery == "restart":
            raise ConfigError("fault.replicas=1 needs fault.recovery=shrink or auto: with fault.recovery=restart a "
                              "lost rank ends the job and the mirrors in memory go with it")
        if not (math.isfinite(self.grow_retry_s) and self.grow_retry_s > 0):
            raise ConfigError(f"fault.grow_retry_s must be a number of seconds > 0, got {self.grow_retry_s}")
        if self.write_error not in ("", "ENOSPC", "EDQUOT", "EIO", "fill"):
            raise ConfigError(f"fault.write_error: {self.write_error!r} is not one of 'ENOSPC', 'EDQUOT', 'EIO', "
                              "'fill'")
        if self.hang_at_startup not in ("", "probe", "rendezvous", "groups"):
            raise ConfigError(f"fault.hang_at_startup: {self.hang_at_startup!r} is not one of 'probe', 'rendezvous', "
                              "'groups'")
        for name in ("grow_after_steps", "kill_at_step", "kill_every_steps", "hang_at_step", "sleep_at_step",
                     "fill_disk_at_step", "only_attempt", "write_error_at_step", "stuck_save_at_step",
                     "stuck_fs_at_step"):
            if getattr(self, name) < 0:
                raise ConfigError(f"fault.{name} must be >= 0, got {getattr(self, name)}")
        if self.sleep_s < 0 or self.slow_s < 0:
            raise ConfigError("fault.sleep_s and fault.slow_s must be >= 0")
        if not (math.isfinite(self.slow_per_sample_s) and self.slow_per_sample_s >= 0):
            raise ConfigError(f"fault.slow_per_sample_s must be a number of seconds >= 0, "
                              f"got {self.slow_per_sample_s}")
        if not (math.isfinite(self.slow_save_s) and self.slow_save_s >= 0):
            raise ConfigError(f"fault.slow_save_s must be a number of seconds >= 0, got {self.slow_save_s}")
        check_durations(self, "fault")
