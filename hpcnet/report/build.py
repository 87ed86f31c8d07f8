"""``python -m hpcnet.report RUN_DIR [--out DIR]``: read the directory, draw the plots, write report.md.

Exit status 0 when the report was written, 2 when RUN_DIR is not a run or
launch directory, ``--out`` cannot be written, or matplotlib is missing.
"""

import argparse
import sys
from pathlib import Path

from hpcnet.report.read import is_launch_dir, is_run_dir, read_launch, read_run

REPORT_FILE = "report.md"
MISSING_MATPLOTLIB = ("matplotlib is not installed; the report needs it: pip install -e '.[report]' "
                      "(or run scripts/setup.sh)")


class ReportError(ValueError):
    """A RUN_DIR or --out the report cannot use (status 2)."""


def build_report(source: Path, out: Path | None = None) -> Path:
    """Write the plots and report.md of run or launch directory ``source`` into ``out``; return report.md's path.

    Raises:
        ReportError: ``source`` is not a run or launch directory, or ``out`` cannot be written.
        ModuleNotFoundError: matplotlib is missing.
    """
    if not source.is_dir():
        raise ReportError(f"{source}: no such directory" if not source.exists() else f"{source}: not a directory")
    launch = read_launch(source) if is_launch_dir(source) else None
    if launch is None and not is_run_dir(source):
        raise ReportError(f"{source}: not a run directory (no config.toml, metrics.rank<r>.jsonl or summary.json) "
                          "nor a hpcnet.launch directory (no launch.json or attempt-1/)")
    from hpcnet.report import figures  # matplotlib: only once the input is known to be good
    from hpcnet.report.markdown import render

    runs = launch.runs if launch is not None else [("", read_run(source))]
    out = out if out is not None else source / "report"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ReportError(f"--out: cannot create {out}: {exc.strerror or exc}") from None
    plots = [figures.draw_loss(runs, out), figures.draw_throughput(runs, out), figures.draw_step_times(runs, out),
             figures.draw_phases(runs, out), figures.draw_memory(runs, out), figures.draw_busbw(runs, out)]
    attempts = figures.attempt_rows(launch) if launch is not None else []
    if launch is not None:
        plots.insert(0, figures.draw_attempts(launch, out))
    for plot in plots:
        if not plot.file:  # a plot of an earlier report of this run would contradict report.md
            (out / f"{plot.name}.png").unlink(missing_ok=True)
    text = render(source, out, runs, plots, launch, attempts, figures.step_times(runs))
    path = out / REPORT_FILE
    try:
        path.write_text(text + "\n")
    except OSError as exc:
        raise ReportError(f"--out: cannot write {path}: {exc.strerror or exc}") from None
    return path


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.report``."""
    parser = argparse.ArgumentParser(
        prog="python -m hpcnet.report",
        description="Plots and a report.md of a run directory (finished, running or crashed) or of a "
                    "hpcnet.launch directory with its attempts. Needs matplotlib (pip install -e '.[report]').")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory or a launch directory")
    parser.add_argument("--out", type=Path, default=None, help="where to write the report (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        path = build_report(args.run_dir, args.out)
    except ReportError as exc:
        print(f"hpcnet.report: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "matplotlib":
            raise
        print(f"hpcnet.report: error: {MISSING_MATPLOTLIB}", file=sys.stderr)
        return 2
    print(f"hpcnet.report: wrote {path}")
    return 0
