"""Final eval loss of each gradient compression path (bf16, fp16, int8) against exact fp32, same job, seed and data.

Launch (lossy compression applies only between nodes: several hosts, or virtual nodes on one):
    HPCNET_RANKS_PER_NODE=2 mpirun --oversubscribe -np 4 python -m mpi4py -m hpcnet.bench converge \\
        [--steps 1000] [--jobs default,transformer] [--paths none,bf16,int8] [--json out.json]

Each job (``default``: hpcnet.train's default job, resnet_tiny on the
synthetic image set; ``transformer``: the small language model on the
synthetic token set) trains once per ``dist.compression`` path with
``hpcnet.train.run`` in this process: the same seed, the same dataset file
(generated once, on rank 0, into the work directory), the same steps, with
evaluation every ``--eval-every`` steps and at the end.  ``none`` (exact fp32)
is the baseline: a lossy path's final eval loss is compared with its, as
lossy/fp32 - 1, against the 1% target.  Within a node the sums stay exact; the
inter-node phase of the hierarchical all-reduce carries the compressed
gradients, so on one node there is nothing to compare and the benchmark
refuses to start.

The runs go one after another, not in alternating rounds: what is measured is
where training ends, not how fast; the steps/s column is one run's figure at
the load of its minutes, to read beside the load printed at the start and end.
"""

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcnet.bench.common import describe_environment, environment, load_average, table, write_json


@dataclass(frozen=True, slots=True)
class Job:
    """A training job of the benchmark: the built-in synthetic dataset it trains on and its overrides."""

    dataset: str
    overrides: tuple[str, ...]
    about: str


JOBS: dict[str, Job] = {
    # hpcnet.train's defaults otherwise: batch 32/rank, SGD lr 0.05 with momentum, cosine decay, clip 1.0.
    "default": Job("synthetic-images", ("model.name=resnet_tiny",), "resnet_tiny on synthetic-images"),
    "transformer": Job("synthetic-tokens", ("model.name=transformer",), "transformer on synthetic-tokens"),
}
DEFAULT_JOBS = "default"

PATHS: dict[str, tuple[str, ...]] = {
    "none": ("dist.compression=none",),
    # On CPU, bf16/fp16 cross the nodes over gloo only: dist.inter_node=auto picks it on small machines, not always.
    "bf16": ("dist.compression=bf16", "dist.inter_node=gloo"),
    "fp16": ("dist.compression=fp16", "dist.inter_node=gloo"),
    "int8": ("dist.compression=int8",),  # sets up its gloo groups between the nodes itself
}
"""``--paths``: ``dist.compression`` values and what each needs; ``none`` is the exact fp32 baseline."""
BASELINE = "none"
DEFAULT_PATHS = "none,bf16,int8"
TARGET_PCT = 1.0
"""The target: a lossy path's final eval loss at most this many percent above fp32's."""

ONE_NODE = ("python -m hpcnet.bench converge: the ranks form one node, so nothing is compressed (lossy compression "
            "applies only between nodes; within a node the sums stay exact) and the paths cannot differ. Set "
            "HPCNET_RANKS_PER_NODE for virtual nodes on one machine (HPCNET_RANKS_PER_NODE=2 with 4 ranks: 2 "
            "nodes of 2) or run on several hosts.")


# ---------------------------------------------------------------------------
# pure logic (tested on one process)


def parse_choices(text: str, known: dict[str, Any], option: str) -> list[str]:
    """The comma-separated names of ``text``, each one of ``known``, in order, without repeats."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"{option}: unknown {', '.join(unknown) or '(none given)'}; choose among "
                         f"{', '.join(known)}")
    return names


def default_eval_every(steps: int) -> int:
    """Ten evaluations along a run (and one at its end)."""
    return max(1, steps // 10)


def run_overrides(job: str, path: str, *, dataset: Path, work_dir: Path, steps: int, eval_every: int, seed: int,
                  extra: list[str]) -> list[str]:
    """The dotted options of one run: the job's, the path's, then ``extra`` (``--set``, which wins).

    Its own run and checkpoint directories under ``work_dir``; no checkpoints (nothing resumes), no trace."""
    name = f"{job}-{path}"
    return [
        *JOBS[job].overrides, f"data.dataset={dataset}", f"run.name={name}",
        f"run.dir={work_dir / 'runs' / name}", "run.dir_exact=true", f"checkpoint.dir={work_dir / 'ckpt' / name}",
        "checkpoint.every_steps=0", "checkpoint.every_s=0", "checkpoint.at_end=false", "train.trace_steps=",
        f"train.steps={steps}", f"train.eval_every={eval_every}", f"run.seed={seed}",
        *PATHS[path], *extra,
    ]


def eval_curve(metrics_path: Path) -> list[tuple[int, float]]:
    """``(step, eval loss)`` of every evaluation in a run's metrics JSON-lines file; none if it is missing."""
    curve = []
    if not metrics_path.is_file():
        return curve
    for line in metrics_path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "eval_loss" in record:
            curve.append((int(record["step"]), float(record["eval_loss"])))
    return curve


def vs_baseline(loss: float | None, baseline: float | None) -> float | None:
    """A loss over the baseline's, minus 1, in percent; None when either is missing or not finite."""
    if loss is None or baseline is None or not math.isfinite(loss) or not math.isfinite(baseline) or baseline == 0:
        return None
    return 100 * (loss / baseline - 1)


def verdict(ratio_pct: float | None, target_pct: float) -> str:
    """'yes' when the loss is at most ``target_pct`` above fp32's ('yes, lower' when more than that below it),
    'no' above, '?' without a figure."""
    if ratio_pct is None:
        return "?"
    if ratio_pct > target_pct:
        return "no"
    return "yes, lower" if ratio_pct < -target_pct else "yes"


def compare(runs: list[dict[str, Any]], target_pct: float) -> None:
    """Add to every run its eval loss against the baseline's (``ratio_pct``, ``within_target``), at the end and
    at each evaluation both made (``curve_ratio_pct``)."""
    base = next(r for r in runs if r["path"] == BASELINE)
    base_curve = dict(base["eval_curve"])
    for r in runs:
        r["ratio_pct"] = vs_baseline(r["eval_loss"], base["eval_loss"])
        r["within_target"] = (None if r["ratio_pct"] is None or r is base
                              else bool(r["ratio_pct"] <= target_pct))
        r["curve_ratio_pct"] = [[step, vs_baseline(loss, base_curve.get(step))] for step, loss in r["eval_curve"]]


def _float(value: Any) -> float | None:
    """A figure as a Python float for JSON (the loop's may be numpy scalars); None stays None."""
    return None if value is None else float(value)


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, spec)


def format_job(res: dict[str, Any], target_pct: float) -> str:
    """A job's tables: the paths at the end of training, then the eval loss along the way."""
    runs = res["runs"]
    lines = [f"{res['job']}: {res['about']}, {res['parameters']:,} parameters, batch {res['batch_per_rank']}/rank "
             f"({res['global_batch']} global), {res['steps']} steps, eval every {res['eval_every']}, seed "
             f"{res['seed']}"]
    rows = []
    for r in runs:
        ratio = "-" if r["path"] == BASELINE or r["ratio_pct"] is None else f"{r['ratio_pct']:+.2f}%"
        within = "-" if r["path"] == BASELINE else verdict(r["ratio_pct"], target_pct)
        state = "" if r["exit_code"] == 0 else f" (exit {r['exit_code']}{', diverged' if r['diverged'] else ''})"
        rows.append([r["path"] + state, _number(r["eval_loss"], ".4f"), ratio, within,
                     _number(r["eval_accuracy"], ".4f"), _number(r["final_train_loss"], ".4f"),
                     _number(r["steps_per_s"], ".2f"), f"{r['wall_s']:.0f}", r["transport"]])
    lines.append(table(["path", "eval loss", "vs fp32", f"within {target_pct:g}%", "eval acc", "train loss",
                        "steps/s", "wall s", "transport"], rows))
    steps = sorted({step for r in runs for step, _ in r["eval_curve"]})
    if len(steps) > 1:
        by_path = {r["path"]: (dict(r["eval_curve"]), dict(r["curve_ratio_pct"])) for r in runs}
        curve_rows = []
        for step in steps:
            row = [str(step)]
            for r in runs:
                losses, ratios = by_path[r["path"]]
                cell = _number(losses.get(step), ".4f")
                if r["path"] != BASELINE and ratios.get(step) is not None:
                    cell += f" ({ratios[step]:+.2f}%)"
                row.append(cell)
            curve_rows.append(row)
        lines.append("")
        lines.append(table(["step", *[f"eval loss {r['path']}" for r in runs]], curve_rows))
    lines.append(f"vs fp32: eval loss / {BASELINE}'s - 1; within: at most {target_pct:g}% above fp32's ('yes, "
                 f"lower': more than that below); steps/s: the run's training steps over its loop time (runs one "
                 f"after another, not alternated); transport: the run's all-reduce (summary comm.backend)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# collective


def open_work_dir(comm: Any, requested: str) -> tuple[Path, bool]:
    """The work directory on every rank (collective): ``requested``, or a new temporary one; and whether this
    benchmark made it (then it removes it at the end unless ``--keep``)."""
    from hpcnet.agree import shared_errors

    made, path = False, ""
    with shared_errors(comm):  # a directory rank 0 cannot make stops every rank alike
        if comm.Get_rank() == 0:
            if requested:
                target = Path(requested).resolve()
                made = not target.exists()
                target.mkdir(parents=True, exist_ok=True)
                path = str(target)
            else:
                path, made = tempfile.mkdtemp(prefix="hpcnet-converge-"), True
    path, made = comm.bcast((path, made), root=0)
    return Path(path), made


def prepare_data(comm: Any, data_dir: Path, jobs: list[str]) -> dict[str, Path]:
    """The dataset file of every job's built-in dataset, generated once on rank 0 into ``data_dir`` (collective;
    the agreement inside is the barrier). Runs get the file's path, so every run, whatever its seed, trains and
    evaluates on the same data."""
    from hpcnet.data.synthetic import ensure_synthetic

    files: dict[str, Path] = {}
    for name in dict.fromkeys(JOBS[job].dataset for job in jobs):
        files[name] = ensure_synthetic(name, data_dir, comm=comm, seed=0)
    return files


def train_path(job: str, path: str, comm: Any, plane: Any, overrides: list[str]) -> dict[str, Any]:
    """Train one job on one compression path (collective); its record (the metrics read on rank 0)."""
    from hpcnet.config.load import load_config
    from hpcnet.models import count_parameters
    from hpcnet.paths import metrics_file
    from hpcnet.train import run

    cfg = load_config(overrides=overrides)
    t0 = time.perf_counter()
    result = run(cfg, comm, plane=plane)
    wall_s = time.perf_counter() - t0
    summary = result.summary
    evaluation = summary.get("eval") or {}
    global_batch = cfg.train.batch_size * cfg.train.grad_accumulation * comm.Get_size()
    comm_summary = summary.get("comm") or {}
    curve = eval_curve(Path(summary["run_dir"]) / metrics_file(0)) if comm.Get_rank() == 0 else []
    return {
        "job": job, "path": path, "compression": cfg.dist.compression, "inter_node": cfg.dist.inter_node,
        "eval_loss": _float(evaluation.get("eval_loss")), "eval_accuracy": _float(evaluation.get("eval_accuracy")),
        "final_train_loss": _float(summary.get("final_loss")), "steps": summary.get("steps"),
        "steps_per_s": _float(summary["samples_per_s"] / global_batch) if summary.get("samples_per_s") else None,
        "samples_per_s": _float(summary.get("samples_per_s")), "wall_s": wall_s,
        "transport": comm_summary.get("backend", "?"), "hierarchical": comm_summary.get("hierarchical"),
        "bytes_reduced": comm_summary.get("bytes_reduced"), "fallbacks": comm_summary.get("fallbacks"),
        "exit_code": int(result.exit_code), "diverged": summary.get("diverged") or "",
        "run_dir": summary.get("run_dir"), "eval_curve": curve,
        "parameters": count_parameters(result.model), "batch_per_rank": cfg.train.batch_size,
        "global_batch": global_batch,
    }


def bench_job(job: str, comm: Any, plane: Any, args: argparse.Namespace, work_dir: Path,
              datasets: dict[str, Path]) -> dict[str, Any]:
    """Every path of ``--paths`` on one job, the baseline first (collective)."""
    runs = []
    for path in args.path_list:
        overrides = run_overrides(job, path, dataset=datasets[JOBS[job].dataset], work_dir=work_dir,
                                  steps=args.steps, eval_every=args.eval_every, seed=args.seed, extra=args.set)
        runs.append(train_path(job, path, comm, plane, overrides))
        if comm.Get_rank() == 0:
            r = runs[-1]
            print(f"  {job} {path}: eval loss {_number(r['eval_loss'], '.4f')}, {r['wall_s']:.0f} s, "
                  f"{r['transport']}", flush=True)
    compare(runs, args.target_pct)
    first = runs[0]
    return {"job": job, "about": JOBS[job].about, "steps": args.steps, "eval_every": args.eval_every,
            "seed": args.seed, "parameters": first["parameters"], "batch_per_rank": first["batch_per_rank"],
            "global_batch": first["global_batch"], "runs": runs}


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench converge",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="training steps of every run (default 1000)")
    parser.add_argument("--jobs", default=DEFAULT_JOBS,
                        help=f"comma-separated jobs among {', '.join(JOBS)} (default {DEFAULT_JOBS})")
    parser.add_argument("--paths", default=DEFAULT_PATHS,
                        help=f"comma-separated dist.compression paths among {', '.join(PATHS)}; {BASELINE} (exact "
                             f"fp32, the baseline) is needed and runs first (default {DEFAULT_PATHS})")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="evaluate every this many steps, and at the end (default: steps/10)")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of every run (default 0)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="an hpcnet option for every run of every job, after the benchmark's own (e.g. "
                             "train.batch_size=8; repeatable)")
    parser.add_argument("--target-pct", type=float, default=TARGET_PCT,
                        help=f"the target: a lossy path's final eval loss at most this many percent above fp32's "
                             f"(default {TARGET_PCT:g})")
    parser.add_argument("--work-dir", default="",
                        help="where the datasets, run and checkpoint directories go; it must be visible to every "
                             "rank (several hosts: a shared file system). Default: a new temporary directory. "
                             "One this benchmark makes is removed at the end unless --keep")
    parser.add_argument("--keep", action="store_true", help="keep the work directory the benchmark made")
    parser.add_argument("--json", default="", help="also write the results to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.eval_every < 0:
        parser.error("--eval-every must be at least 1 (0: steps/10)")
    args.eval_every = args.eval_every or default_eval_every(args.steps)
    if not 0 <= args.target_pct < float("inf"):  # NaN too
        parser.error("--target-pct must be a number >= 0")
    try:
        args.job_list = parse_choices(args.jobs, JOBS, "--jobs")
        args.path_list = parse_choices(args.paths, PATHS, "--paths")
    except ValueError as exc:
        parser.error(str(exc))
    if BASELINE not in args.path_list:
        parser.error(f"--paths must include {BASELINE}: the exact fp32 run the lossy paths are compared with")
    args.path_list = [BASELINE, *(p for p in args.path_list if p != BASELINE)]
    from hpcnet.config.load import load_config
    from hpcnet.errors import UsageError

    for job in args.job_list:  # every option checked before any rank starts anything
        for path in args.path_list:
            try:
                load_config(overrides=run_overrides(job, path, dataset=Path("check.h5"), work_dir=Path("check"),
                                                    steps=args.steps, eval_every=args.eval_every, seed=args.seed,
                                                    extra=args.set))
            except UsageError as exc:
                parser.error(f"{'--set: ' if args.set else ''}{exc} (job {job}, path {path})")
    return args


def close_work_dir(comm: Any, work_dir: Path, made: bool, keep: bool) -> None:
    """Remove the work directory this benchmark made unless ``keep``, once every rank is done with it
    (collective); else say where it is."""
    comm.Barrier()
    if comm.Get_rank() == 0:
        if made and not keep:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            print(f"work directory kept: {work_dir}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.bench converge``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.agree import is_agreed, shared_errors
    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.errors import UsageError
    from hpcnet.observe.runlog import strict_json
    from hpcnet.world import choose_device, discover

    args = _parse_args(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD.Dup()
    try:
        world = discover(comm)
        if world.num_nodes < 2:  # the same layout on every rank: every rank stops here
            if world.is_main:
                print(ONE_NODE, file=sys.stderr)
            return 2
        with shared_errors(comm):
            device = choose_device(world)
        env = environment(comm)
        env["nodes"] = world.num_nodes
        if world.is_main:
            print(describe_environment(env), flush=True)
            print(f"{world.num_nodes} nodes of {world.local_size} rank(s); jobs {', '.join(args.job_list)}; paths "
                  f"{', '.join(args.path_list)}; {args.steps} steps each (training logs on stderr)", flush=True)
        work_dir, made = open_work_dir(comm, args.work_dir)
        results = []
        try:
            datasets = prepare_data(comm, work_dir / "data", args.job_list)
            plane = init_data_plane(comm, world, backend="nccl" if device.type == "cuda" else "gloo", device=device,
                                    timeout_s=600.0)
            try:
                for job in args.job_list:
                    t0 = time.perf_counter()
                    res = bench_job(job, comm, plane, args, work_dir, datasets)
                    res["wall_s"] = time.perf_counter() - t0
                    results.append(res)
                    if world.is_main:
                        print()
                        print(format_job(res, args.target_pct), flush=True)
            finally:
                plane.close()
        except UsageError as exc:
            if not is_agreed(exc):  # one rank's own error: python -m mpi4py aborts the job
                raise
            # What only a run finds out (a model option the job's model lacks) is the same error on every rank.
            if world.is_main:
                print(f"python -m hpcnet.bench converge: {exc}", file=sys.stderr)
            close_work_dir(comm, work_dir, made, args.keep)
            return 2
        env["load_average_end"] = load_average()
        if world.is_main:
            print(f"\nload average at end: {', '.join(f'{x:.2f}' for x in env['load_average_end'])}", flush=True)
            if args.json:
                # A diverged run's NaN loss as null: JSON strict readers take.
                write_json(args.json, strict_json({
                    "benchmark": "converge", "environment": env, "work_dir": str(work_dir),
                    "kept": not made or args.keep, "target_pct": args.target_pct, "paths": args.path_list,
                    "set": args.set, "results": results}))
        close_work_dir(comm, work_dir, made, args.keep)
        return 0
    finally:
        comm.Free()
