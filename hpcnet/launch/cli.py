"""The command line of ``python -m hpcnet.launch [options] -- LAUNCHER ...``: its options, checked before anything
runs (a bad one is one line and status 2), then ``hpcnet.launch.supervisor.supervise``."""

import argparse
import sys

from hpcnet.config import MAX_DURATION_S
from hpcnet.launch.attempt import LAUNCHER_GRACE_S, START_TIMEOUT_S
from hpcnet.launch.command import LAUNCHER_KINDS
from hpcnet.launch.elastic import PROBE_EVERY_S, PROBE_TIMEOUT_S, ElasticError, check_template
from hpcnet.launch.supervisor import supervise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hpcnet.launch",
        description="Run an hpcnet job; on a restartable failure run it again with --resume auto.",
        epilog="example: python -m hpcnet.launch --max-restarts 3 -- mpirun -np 4 python -m mpi4py -m "
               "hpcnet.train run.name=x checkpoint.every_steps=100")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts after the first attempt (default 3)")
    parser.add_argument("--backoff-s", type=float, default=1.0,
                        help="wait before the first restart, doubled for each further one (default 1)")
    parser.add_argument("--max-backoff-s", type=float, default=60.0, help="longest wait (default 60)")
    parser.add_argument("--exclude-failed-hosts", action="store_true",
                        help="leave a host that a failure is pinned to out of the next attempts (mpirun, srun)")
    parser.add_argument("--min-ranks", type=int, default=None, metavar="N",
                        help="with --exclude-failed-hosts: when the hosts left hold fewer slots than the command's "
                             "ranks, run on them with fewer ranks (at least N; else give up), and go back to the "
                             "full size once an excluded host answers again (elastic shrink and grow)")
    parser.add_argument("--launcher-kind", choices=LAUNCHER_KINDS, default="",
                        help="the options the launcher takes, for a site's wrapper of mpirun or srun that "
                             "--exclude-failed-hosts, --min-ranks and the standby rewrite (default: by its name: "
                             "mpirun, mpiexec, orterun, prterun, srun)")
    parser.add_argument("--probe-command", default=None, metavar="CMD",
                        help="how to ask whether a host answers (with --min-ranks, and to tell which side of a "
                             "partition was lost): a command line with {host}, status 0 when it does (default: "
                             "the launcher's own: mpirun <its options> --host {host}:1 -np 1 true; srun -w {host} "
                             "-N1 -n1 true)")
    parser.add_argument("--probe-every-s", type=float, default=PROBE_EVERY_S,
                        help="how often an excluded host is probed (default %(default)g)")
    parser.add_argument("--probe-timeout-s", type=float, default=PROBE_TIMEOUT_S,
                        help="how long one probe may take before the host counts as unreachable "
                             "(default %(default)g)")
    parser.add_argument("--standby", choices=("auto", "on", "off"), default="auto",
                        help="warm standby: start the next attempt ahead, parked before MPI starts, and release it "
                             "at a failure (auto: with mpirun or srun; default auto)")
    parser.add_argument("--launcher-grace-s", type=float, default=LAUNCHER_GRACE_S,
                        help="once the job declared a failure (failure.json, MPI_Abort), how long the launcher may "
                             "take to exit before it and its processes are killed (default %(default)g)")
    parser.add_argument("--start-timeout-s", type=float, default=START_TIMEOUT_S,
                        help="how long the ranks of an attempt may take to start (each reports ready as the first "
                             "thing hpcnet.train does) before the launcher and its processes are killed and the "
                             "attempt counts as a restartable failure; 0: no limit (default %(default)g)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the launcher command")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse options that cannot hold (``parser.error``: one line, status 2)."""
    if args.max_restarts < 0:
        parser.error("--max-restarts must be >= 0")
    for flag, seconds in (("--backoff-s", args.backoff_s), ("--max-backoff-s", args.max_backoff_s),
                          ("--launcher-grace-s", args.launcher_grace_s), ("--start-timeout-s", args.start_timeout_s)):
        if not 0 <= seconds <= MAX_DURATION_S:  # nan too; a longer wait overflows the clock it waits on
            parser.error(f"{flag} must be a number of seconds in [0, {MAX_DURATION_S}] (30 days), got {seconds:g}")
    for flag, seconds in (("--probe-every-s", args.probe_every_s), ("--probe-timeout-s", args.probe_timeout_s)):
        if not 0 < seconds <= MAX_DURATION_S:
            parser.error(f"{flag} must be a number of seconds in (0, {MAX_DURATION_S}], got {seconds:g}")
    if args.min_ranks is not None:
        if args.min_ranks < 1:
            parser.error(f"--min-ranks must be at least 1, got {args.min_ranks}")
        if not args.exclude_failed_hosts:
            parser.error("--min-ranks needs --exclude-failed-hosts (it runs on the hosts left after excluding one)")
    if args.probe_command is not None:
        try:
            check_template(args.probe_command)
        except ElasticError as exc:
            parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.launch``."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: python -m hpcnet.launch [options] -- mpirun ... python -m mpi4py -m hpcnet.train ...")
    _check(parser, args)
    return supervise(command, max_restarts=args.max_restarts, backoff_base_s=args.backoff_s,
                     backoff_cap_s=args.max_backoff_s, exclude_failed_hosts=args.exclude_failed_hosts,
                     standby=args.standby, launcher_grace_s=args.launcher_grace_s, keep_signal_handlers=True,
                     min_ranks=args.min_ranks, probe_template=args.probe_command, probe_every_s=args.probe_every_s,
                     probe_timeout_s=args.probe_timeout_s, start_timeout_s=args.start_timeout_s,
                     launcher=args.launcher_kind)
