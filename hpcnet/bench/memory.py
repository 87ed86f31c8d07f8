"""Memory per rank, step time and capacity of hpcnet's dist.zero=0/1/2/3 against DDP, DDP+ZeroRedundancyOptimizer
and FSDP2, with and without activation checkpointing.

Launch:
    mpirun -np 4 python -m mpi4py -m hpcnet.bench memory [--models transformer] [--cap-gb 0.5] [--json out.json]

The contenders are the entries of ``CONTENDERS``. Those
marked ``+ac`` recompute each block's activations in backward with ``hpcnet.models.blocks.checkpoint_blocks``
(non-reentrant ``torch.utils.checkpoint``), applied to the model before DDP, ``fully_shard`` or hpcnet wrap it,
so every contender checkpoints the same way. Every contender trains its own copy of one model (same weights,
same AdamW or SGD settings, same synthetic batches, gradient clipping at norm 1) in the same processes:

- **Memory**: the contenders are built one after the other and each runs ``--steps`` steps while the ones built
  before it sit idle. Every rank measures its resident memory (``/proc/self/status``) above what it held
  before the contender was built: ``held`` after the steps (parameters, gradients, optimizer state,
  communication buffers) and ``peak`` during them (the high-water mark, reset with ``/proc/self/clear_refs``;
  it adds activations and transient buffers). For hpcnet the tensors are counted as well (exact, where
  resident memory is approximate).
- **Step time**: then ``--rounds`` rounds, each contender ``--round-steps`` steps a round, the order rotated
  every round so none always runs first or after the same neighbour (this machine is shared and noisy). A
  step is timed from a barrier to its end on every rank; the slowest rank's time counts. Ratios to DDP, FSDP2
  and hpcnet ``dist.zero=0`` are taken round by round (the same minute of load on both sides), then their
  median and range.
- **Weights**: after the steps every contender's full weights (FSDP2's gathered) are compared with hpcnet
  ``dist.zero=0``'s, and each checkpointing contender's with its twin's without.
- **Capacity** (``--cap-gb``): the largest transformer of a ladder (rung k: width 64k, k blocks, k heads) that
  each of ``--cap-contenders`` trains with every rank's peak under the cap, where the peak is measured as
  above (what training adds to the process, the analogue of ``max_memory_allocated`` on a GPU). The same
  search for all: a first rung (from the bytes per parameter measured on the table's transformer, or, for a
  checkpointing contender, the rung above its twin's answer), one rung at a time to the largest that fits,
  then that width with more blocks. Every answer is bracketed by measured sizes (the largest that fit, the
  next that did not).
- **On FSDP2's largest model**: memory and step time of ``--cap-time`` as above (``--cap-rounds`` rotated
  rounds, ratios to FSDP2 round by round) on the largest size FSDP2 fitted, without the cap.

This module runs the table on each model and the command line; the contenders are ``memory_contenders``'s, the
measurement ``memory_measure``'s, the capacity search ``memory_capacity``'s and the printed tables
``memory_report``'s.
"""

import argparse
import copy
import sys
import time
from typing import Any

import torch

from hpcnet.bench.common import describe_environment, environment, load_average, summarize, write_json
from hpcnet.bench.memory_capacity import bench_capacity, bench_fsdp2_model
from hpcnet.bench.memory_contenders import (
    CAP_CONTENDERS,
    CAP_TIMED,
    CONTENDERS,
    REFERENCES,
    TIME_PEERS,
    _batches,
    _build,
    refusal,
)
from hpcnet.bench.memory_measure import _fixed_mmap_threshold, measure, paired_ratios
from hpcnet.bench.memory_report import report, report_capacity, report_fsdp2_model
from hpcnet.config.optimizers import OPTIMIZERS

MODELS = {
    # GPT-style, 8 blocks of width 512, vocabulary 8192 (tied): 29.4 M parameters (112 MiB), in 100 tensors.
    "transformer": ("transformer", {"d_model": 512, "n_layers": 8, "n_heads": 8}, "tokens", (64,), 8192, 4),
    # 29.4 M parameters in 6 tensors, two of them 43% and 57% of the bytes: whole tensors cannot be balanced.
    "mlp-4096": ("mlp", {"hidden": [4096, 4096]}, "image", (3, 32, 32), 10, 8),
    # A seconds-long smoke test.
    "mlp-small": ("mlp", {"hidden": [256, 256]}, "image", (3, 32, 32), 10, 8),
}



def bench_model(key: str, comm: Any, world: Any, args: argparse.Namespace) -> dict[str, Any]:
    from mpi4py import MPI

    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    model_name, options, kind, shape, classes, batch = MODELS[key]
    torch.manual_seed(0)
    base = build_model(model_name, DatasetInfo(kind, shape, classes), options)
    batches = _batches(kind, shape, classes, batch, world.rank)
    n_params = sum(p.numel() for p in base.parameters())
    # One unmeasured step of each kind first: what the first use of autograd, gloo, MPI, FSDP2 and checkpointing
    # allocates for good would otherwise be charged to the first contender of the kind.
    names = list(args.contenders)
    for name in (n for n in ("ddp", "fsdp2", "hpcnet-zero2", "hpcnet-zero2+ac", "hpcnet-zero3") if n in names):
        warm = _build(name, copy.deepcopy(base), comm, world, args.optim)
        warm.step(batches)
        warm.close()
        del warm
    memory, per_round, slowest, alive = measure(names, lambda: copy.deepcopy(base), batches, comm, world, args,
                                                steps=args.steps, rounds=args.rounds, round_steps=args.round_steps)
    # Every contender took the same steps on the same batches: their weights agree (hpcnet's stages bit for bit
    # up to 2 ranks; the others sum gradients in other orders; checkpointing changes no bit).
    weights = {name: alive[name].full_weights() for name in names}
    diffs = {name: float((weights[name] - weights["hpcnet-zero0"]).abs().max()) for name in names}
    ac_diffs = {name: float((weights[name] - weights[spec.plain]).abs().max())
                for name, spec in CONTENDERS.items() if spec.plain and name in names and spec.plain in names}
    worst = comm.allreduce(max(diffs.values()), op=MPI.MAX)
    ac_worst = comm.allreduce(max(ac_diffs.values(), default=0.0), op=MPI.MAX)
    del weights
    for name in names:
        alive.pop(name).close()
    if world.rank != 0:
        return {}
    timing = {name: {"step_s": slowest[i].reshape(-1).tolist(), "step_s_rounds": per_round[name],
                     "step_s_summary": summarize(slowest[i].reshape(-1).tolist())}
              for i, name in enumerate(names)}
    ratios = {peer: {name: paired_ratios(per_round[name], per_round[peer]) for name in names}
              for peer in TIME_PEERS if peer in names}
    return {"model": key, "parameters": n_params, "optimizer": args.optim, "memory": memory, "timing": timing,
            "time_ratios": ratios, "max_weight_difference": worst, "differences": diffs,
            "max_checkpointing_difference": ac_worst, "checkpointing_differences": ac_diffs,
            "targets": targets(memory, ratios, world.size)}


def targets(memory: dict[str, Any], ratios: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """The targets stated at 4 ranks (issue 12's for dist.zero=2, issue 31's held memory for dist.zero=3), each
    with its measured figure; those whose contenders did not run are left out."""
    peak = {name: max(r["peak_mib"]) for name, r in memory.items()}
    held = {name: max(r["held_mib"]) for name, r in memory.items()}

    def time_ratio(name: str, peer: str) -> float | None:
        return ratios[peer][name]["median"] if peer in ratios and name in ratios[peer] else None

    def over(of: dict[str, float], name: str, peer: str) -> float | None:
        return of[name] / of[peer] if name in of and peer in of else None
    rows = [("hpcnet-zero3 held between steps / FSDP2's (issue 31)", over(held, "hpcnet-zero3", "fsdp2"), 1.05),
            ("hpcnet-zero2 peak / DDP's (issue 12)", over(peak, "hpcnet-zero2", "ddp"), 0.5),
            ("hpcnet-zero2 peak / DDP+ZeroRedundancyOptimizer's (issue 12)",
             over(peak, "hpcnet-zero2", "ddp+torch-zero1"), 0.8),
            ("hpcnet-zero2 step time / FSDP2's, median of rounds (issue 12)", time_ratio("hpcnet-zero2", "fsdp2"), 1.0),
            ("hpcnet-zero2 step time / hpcnet zero 0's, median of rounds (issue 12)",
             time_ratio("hpcnet-zero2", "hpcnet-zero0"), 1.1)]
    return [{"what": what, "value": float(value), "at_most": bound, "met": bool(value <= bound), "ranks": world_size}
            for what, value, bound in rows if value is not None]


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m hpcnet.bench memory``."""
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,mlp-4096",
                        help=f"comma-separated among {', '.join(MODELS)} (default transformer,mlp-4096)")
    parser.add_argument("--optim", default="adamw", choices=sorted(OPTIMIZERS),
                        help="every contender's optimizer, as optim.name names it (default adamw); a contender that "
                             "cannot train with it is left out of the defaults, with the reason")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated contenders of the --models tables, among {', '.join(CONTENDERS)} "
                             f"(default all; {' and '.join(REFERENCES)} always, the references)")
    parser.add_argument("--steps", type=int, default=3,
                        help="steps per contender for the memory figures, also the timing's warm-up (default 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds on each --models model (default 3: with 9 contenders, each in 3 positions)")
    parser.add_argument("--round-steps", type=int, default=1, help="timed steps per contender a round (default 1)")
    parser.add_argument("--cap-gb", type=float, default=0.5,
                        help="per-rank cap in GB (1e9 bytes) on the peak that training adds, for the largest "
                             "transformer each of --cap-contenders trains under it; 0 skips (default 0.5)")
    parser.add_argument("--cap-contenders", default=",".join(CAP_CONTENDERS),
                        help=f"comma-separated contenders of the capacity search, in order (default "
                             f"{','.join(CAP_CONTENDERS)}; any of {', '.join(CONTENDERS)})")
    parser.add_argument("--cap-steps", type=int, default=2,
                        help="steps per capacity trial, also the warm-up on FSDP2's largest model (default 2)")
    parser.add_argument("--cap-time", default=",".join(CAP_TIMED),
                        help=f"comma-separated contenders timed on FSDP2's largest model (needs fsdp2 in "
                             f"--cap-contenders); empty skips (default {','.join(CAP_TIMED)})")
    parser.add_argument("--cap-rounds", type=int, default=2,
                        help="timed rounds on FSDP2's largest model, 1 step each per contender (default 2)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file (rank 0)")
    return parser


def _checked(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """``args`` checked, with ``model_list`` and the contender options as tuples; ``parser.error`` (status 2)
    on a bad one."""
    args.model_list = models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or (not models and args.cap_gb <= 0):
        parser.error(f"--models: unknown {unknown or args.models!r}; choose among {', '.join(MODELS)}")
    args.left_out = {}
    for option, default in (("contenders", ",".join(CONTENDERS)), ("cap_contenders", ",".join(CAP_CONTENDERS)),
                            ("cap_time", ",".join(CAP_TIMED))):
        flag = f"--{option.replace('_', '-')}"
        names = [n.strip() for n in getattr(args, option).split(",") if n.strip()]
        if [n for n in names if n not in CONTENDERS] or len(set(names)) < len(names):
            parser.error(f"{flag}: {getattr(args, option)!r} must name distinct contenders among "
                         f"{', '.join(CONTENDERS)}")
        refused = [n for n in names if refusal(n, args.optim)]
        if refused and getattr(args, option) != default:
            parser.error(f"{flag}: {refused[0]} cannot train with --optim {args.optim}: "
                         f"{refusal(refused[0], args.optim)}")
        args.left_out.update({n: refusal(n, args.optim) for n in refused})
        setattr(args, option, tuple(n for n in names if n not in refused))
    missing = [n for n in REFERENCES if n not in args.contenders]
    if missing and args.model_list:
        parser.error(f"--contenders: {', '.join(missing)} must be among them (the tables' references)")
    if args.cap_gb > 0 and not args.cap_contenders:
        parser.error("--cap-contenders is empty: name at least one, or skip the search with --cap-gb 0")
    for option in ("steps", "rounds", "round_steps", "cap_steps", "cap_rounds"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.cap_gb < 0:
        parser.error("--cap-gb must be 0 (skip) or more")
    return args


def _run(comm: Any, world: Any, args: argparse.Namespace, started: float
         ) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Every ``--models`` model's table, then the capacity search and FSDP2's largest model (collective); rank 0
    prints each as it ends.  Returns rank 0's records (empty elsewhere) and the capacity search's."""
    outs = []
    capacity = None
    if world.rank == 0:
        for name, why in args.left_out.items():
            print(f"{name} left out with --optim {args.optim}: {why}", flush=True)
    measured: dict[str, float] = {}
    for key in args.model_list:
        out = bench_model(key, comm, world, args)
        if world.rank == 0:
            out["seconds"] = time.perf_counter() - started
            outs.append(out)
            print(report(out, args), flush=True)
            if key == "transformer":
                measured = {n: max(out["memory"][n]["peak_mib"]) * 2**20 / out["parameters"]
                            for n in args.cap_contenders if n in out["memory"]}
    if args.cap_gb > 0:
        capacity = bench_capacity(comm, world, args, comm.bcast(measured, root=0))
        if world.rank == 0:
            print(report_capacity(capacity), flush=True)
        at_fsdp2 = bench_fsdp2_model(comm, world, args, capacity)
        if world.rank == 0 and at_fsdp2:
            capacity["fsdp2_model"] = at_fsdp2
            print(report_fsdp2_model(at_fsdp2, args.cap_gb), flush=True)
    return outs, capacity


def main(argv: list[str] | None = None) -> int:
    """``python -m hpcnet.bench memory``: the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.world import discover

    parser = _parser()
    args = _checked(parser, parser.parse_args(argv))
    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    if world.size < 2:
        parser.error("run it with at least 2 ranks (mpirun -np 2 ...): memory is saved by sharding over ranks")
    torch.set_num_threads(1)
    _fixed_mmap_threshold()
    plane = init_data_plane(comm, world, backend="gloo", device=torch.device("cpu"), timeout_s=300)
    env = environment(comm)
    started = time.perf_counter()
    try:
        outs, capacity = _run(comm, world, args, started)
    finally:
        plane.close()
    if world.rank == 0:
        print(describe_environment(env))
        print(f"load average at end: {', '.join(f'{x:.2f}' for x in load_average())}; "
              f"{time.perf_counter() - started:.0f} s")
        if args.json:
            write_json(args.json, {"benchmark": "memory", "environment": env, "models": outs,
                                   "capacity": capacity})
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
