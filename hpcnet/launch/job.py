"""A supervised job: what its attempts share (``Job``), read from the user's command as hpcnet.train reads its
arguments (``prepare``: the launcher, the launch and checkpoint directories, where the run starts), what each
attempt runs (``attempt_setup``), and the record of them all, ``launch.json`` (``Job.write_launch_json``).
"""

import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hpcnet.config.load import command_line_config, parse_command_line
from hpcnet.errors import ConfigError, ExitCode
from hpcnet.launch.attempt import LAUNCHER_GRACE_S, Attempt
from hpcnet.launch.command import (
    attempt_command,
    is_openmpi,
    launcher_env,
    launcher_kind,
    restart_args,
    train_args_start,
)
from hpcnet.launch.exclusion import ExcludedHosts
from hpcnet.launch.hosts import slurm_allocation
from hpcnet.launch.processes import say
from hpcnet.launch.restarts import committed_checkpoints
from hpcnet.launch.standby import Standbys
from hpcnet.paths import (
    ATTEMPT_ENV,
    LAUNCH_FILE,
    LAUNCH_ID_ENV,
    READY_ENV,
    attempt_dir,
    checkpoint_dir,
    ready_dir,
    run_dir_path,
)


@dataclass(slots=True)
class Job:
    """What the attempts of one supervised command share."""

    command: list[str]
    """The user's command."""
    hosts: ExcludedHosts
    """The hosts left out of the next attempts, and the command without them."""
    openmpi: bool
    train_start: int | None
    """Where hpcnet.train's arguments begin; None when the command does not run hpcnet.train."""
    launch_dir: Path
    checkpoint_dir: Path | None = None
    launcher: str = ""
    config_file: str | None = None
    resume: str = ""
    """The user's ``checkpoint.resume``: where the first attempt starts ('' fresh, 'auto', a checkpoint)."""
    own: bool = True
    """Every checkpoint in the checkpoint directory is this run's: it held none at the start, or an attempt has
    committed since (``hpcnet.launch.command.restart_args``)."""
    launch_id: str = field(default_factory=lambda: secrets.token_hex(8))
    """This supervisor's token: with the attempt number, what the checkpoint directory's fence names."""
    attempts: list[Attempt] = field(default_factory=list)
    launcher_grace_s: float = LAUNCHER_GRACE_S
    start_timeout_s: float = 0.0
    """``--start-timeout-s``: how long the ranks of an attempt may take to start (0: for ever)."""
    max_restarts: int = 3
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0
    exclude_failed_hosts: bool = False
    standbys: Standbys | None = None
    """The warm standby for the next attempt; None when standbys are off."""

    def write_launch_json(self, final: int | None, message: str) -> None:
        """Write ``launch.json``: the command, every attempt's record, the final status (None while it runs) and
        the supervisor's last word."""
        record = {"command": self.command, "launch_dir": str(self.launch_dir),
                  "attempts": [asdict(a) for a in self.attempts], "final_status": final, "message": message}
        path = self.launch_dir / LAUNCH_FILE
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            say(f"cannot write {path}: {exc.strerror or exc}")


def prepare(command: list[str], environ: dict[str, str], kind: str = "") -> "Job | int":
    """The launcher (of ``kind`` if declared: ``--launcher-kind``) and the launch and checkpoint directories of
    ``command``, read as hpcnet.train reads its arguments; a status when its options are bad."""
    kind = launcher_kind(command, kind)
    openmpi = kind == "mpirun" and is_openmpi(command[0])
    start = train_args_start(command)
    parsed = parse_command_line(command[start:]) if start is not None else None
    if parsed is not None and (parsed.help or parsed.print_config or parsed.help_config):  # prints, trains nothing
        start = None
    try:
        cfg = command_line_config(parsed) if parsed is not None and start is not None else None
    except ConfigError as exc:
        say(f"error: {exc}")
        return ExitCode.USAGE_ERROR
    launch_dir = Path.cwd()
    if cfg is not None:
        launch_dir = run_dir_path(cfg.run.dir, cfg.run.name, exact=cfg.run.dir_exact).absolute()
    hosts = ExcludedHosts(command, launcher=kind, allocation=slurm_allocation(environ), launch_dir=launch_dir)
    job = Job(command, hosts, openmpi, start, launch_dir, launcher=kind,
              config_file=parsed.config if parsed is not None else None)
    if cfg is not None:
        job.checkpoint_dir = checkpoint_dir(cfg.run.dir, cfg.run.name, cfg.checkpoint.dir).absolute()
        job.resume, job.own = cfg.checkpoint.resume, not committed_checkpoints(job.checkpoint_dir)
    if job.train_start is None:
        say("the command does not run hpcnet.train: run directories are not pinned, failure.json is not read")
        return job
    try:
        job.launch_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        say(f"error: run.dir: cannot create the launch directory {job.launch_dir}: {exc.strerror or exc}")
        return ExitCode.USAGE_ERROR
    say(f"launch directory {job.launch_dir}; checkpoints in {job.checkpoint_dir}")
    return job


def attempt_setup(job: Job, attempt: int, environ: dict[str, str]) -> tuple[list[str], dict[str, str], str | None]:
    """The command, environment and run directory of attempt ``attempt`` as things stand."""
    run_dir = str(attempt_dir(job.launch_dir, attempt)) if job.train_start is not None else None
    pinned = [f"run.dir={run_dir}", "run.dir_exact=true", f"checkpoint.dir={job.checkpoint_dir}"] if run_dir else []
    cmd = attempt_command(job.hosts.command, attempt, train_start=job.train_start, pinned=pinned, openmpi=job.openmpi,
                          restart=restart_args(job.resume, own=job.own), kind=job.launcher)
    env = {**launcher_env(environ, job.openmpi), ATTEMPT_ENV: str(attempt)}
    if run_dir:
        env[READY_ENV] = str(ready_dir(job.launch_dir, attempt))
        env[LAUNCH_ID_ENV] = job.launch_id
    return cmd, env, run_dir
