"""The memory planner's predicted peak against the measured one, rung by rung of bench memory's transformer ladder.

Launch:
    mpirun -np 4 python -m mpi4py -m hpcnet.bench planner [--rungs 2,4,6,8] [--json out.json]

For every rung (``hpcnet.bench.memory_capacity.ladder_options``: width 64k, k blocks, the ladder's vocabulary, sequence
and batch) rank 0 measures one step of the plain model (``hpcnet.plan.measure``) and predicts each rank's peak
at every ``dist.zero`` stage with and without activation checkpointing (``hpcnet.plan.peaks.predict``); then every
rank trains the rung with hpcnet at each of those choices for ``--steps`` steps and measures its peak as
``bench memory`` does (resident memory above the settled memory before the model was built, the high-water
mark reset there; the largest rank's).  Printed: predicted, measured and their ratio for every trial, and the
range of the errors.
"""

import argparse
import sys
import time
from typing import Any

import torch

from hpcnet.bench.common import describe_environment, environment, load_average, table, write_json

CHOICES = [(0, "off"), (1, "off"), (2, "off"), (3, "off"), (0, "blocks"), (2, "blocks"), (3, "blocks")]


def _train_peak(rung: int, stage: int, checkpointing: str, comm: Any, world: Any, steps: int) -> int:
    """Collective: the largest rank's measured peak of ``steps`` AdamW steps of rung ``rung`` with hpcnet."""
    from mpi4py import MPI

    from hpcnet.bench.memory_capacity import CAP_BATCH, CAP_SEQ, CAP_VOCAB, ladder_options
    from hpcnet.bench.memory_contenders import _batches
    from hpcnet.comm.dataparallel import DataParallel
    from hpcnet.comm.route import agree_route
    from hpcnet.config import DistConfig, OptimConfig
    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model
    from hpcnet.models.blocks import checkpoint_blocks, find_blocks
    from hpcnet.objective import compute_loss
    from hpcnet.optim import build_optimizer
    from hpcnet.plan.measure import reset_peak, settled_kib, status_kib

    batches = _batches("tokens", (CAP_SEQ,), CAP_VOCAB, CAP_BATCH, world.rank)
    before = settled_kib()
    comm.Barrier()
    reset_peak()
    torch.manual_seed(0)
    model = build_model("transformer", DatasetInfo("tokens", (CAP_SEQ,), CAP_VOCAB), ladder_options(rung))
    if checkpointing == "blocks":
        checkpoint_blocks(find_blocks(model))
    cfg = DistConfig(zero=stage, owners="uniform")
    dp = DataParallel(model, comm, world, cfg, device=torch.device("cpu"),
                      route=agree_route(comm, world, cfg, device_type="cpu"),
                      blocks=find_blocks(model) if stage == 3 else None)
    optimizer = dp.shard_optimizer(build_optimizer(model, OptimConfig(name="adamw", lr=1e-3)))
    for step in range(steps):  # as bench memory's contenders step: clipped at norm 1
        dp.step([batches[step % len(batches)]], compute_loss)
        dp.clip_grad_norm_(1.0)
        optimizer.step()
    peak = status_kib("VmHWM") - before
    dp.close()
    del dp, optimizer, model
    return comm.allreduce(peak, op=MPI.MAX) * 1024


def _predict(rung: int, ranks: int) -> dict[tuple[int, str], Any]:
    """Rank 0: the planner's predictions for rung ``rung`` at ``ranks`` ranks."""
    from hpcnet.bench.memory_capacity import CAP_BATCH, CAP_SEQ, CAP_VOCAB, ladder_options
    from hpcnet.bench.memory_contenders import _batches
    from hpcnet.config import OptimConfig
    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model
    from hpcnet.objective import compute_loss
    from hpcnet.optim import build_optimizer
    from hpcnet.plan.measure import measure_model
    from hpcnet.plan.peaks import predict

    torch.manual_seed(0)
    model = build_model("transformer", DatasetInfo("tokens", (CAP_SEQ,), CAP_VOCAB), ladder_options(rung))
    batch = _batches("tokens", (CAP_SEQ,), CAP_VOCAB, CAP_BATCH, 0)[0]
    memory = measure_model(model, lambda m: build_optimizer(m, OptimConfig(name="adamw", lr=1e-3)), compute_loss,
                           batch)
    return {(s, c): predict(memory, ranks=ranks, stage=s, checkpointing=c) for s, c in CHOICES}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.bench planner``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.bench.memory_capacity import rung_parameters
    from hpcnet.bench.memory_measure import _fixed_mmap_threshold
    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.world import cpu_threads, discover

    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench planner", description=__doc__.splitlines()[0])
    parser.add_argument("--rungs", default="2,4,6,8", help="ladder rungs, comma-separated (default 2,4,6,8)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per trial (default 3)")
    parser.add_argument("--json", default="", help="also write the results to this file (rank 0)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        rungs = [int(r) for r in args.rungs.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--rungs: {args.rungs!r} is not a list of integers")
    if not rungs or min(rungs) < 1 or args.steps < 2:
        parser.error("--rungs must name rungs >= 1 and --steps be at least 2")
    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    torch.set_num_threads(cpu_threads(world))
    _fixed_mmap_threshold()
    env = environment(comm)
    if world.rank == 0:
        print(describe_environment(env), flush=True)
    plane = init_data_plane(comm, world, backend="gloo", device=torch.device("cpu"), timeout_s=120)
    rows, results, errors = [], [], []
    try:
        _train_peak(1, 2, "off", comm, world, 2)  # what the first use of autograd, gloo and MPI keeps for good
        _train_peak(1, 0, "off", comm, world, 2)
        for rung in rungs:
            t0 = time.perf_counter()
            predicted = _predict(rung, world.size) if world.rank == 0 else None
            for stage, checkpointing in CHOICES:
                measured = _train_peak(rung, stage, checkpointing, comm, world, args.steps)
                if world.rank == 0:
                    p = predicted[(stage, checkpointing)]
                    error = p.peak / measured - 1
                    errors.append(error)
                    results.append({"rung": rung, "parameters": rung_parameters(rung), "stage": stage,
                                    "activation_checkpointing": checkpointing, "predicted_bytes": p.peak,
                                    "measured_bytes": measured, "error": error, "phase": p.phase})
                    rows.append([str(rung), f"{rung_parameters(rung) / 1e6:.1f} M", str(stage), checkpointing,
                                 f"{p.peak / 1e6:.1f}", f"{measured / 1e6:.1f}", f"{100 * error:+.1f}%", p.phase])
            if world.rank == 0:
                print(f"  rung {rung}: {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        plane.close()
    if world.rank == 0:
        print(table(["rung", "params", "dist.zero", "checkpointing", "predicted MB", "measured MB", "error",
                     "peak in"], rows))
        print(f"errors {100 * min(errors):+.1f}% to {100 * max(errors):+.1f}% over {len(errors)} trials; "
              f"{sum(abs(e) <= 0.10 for e in errors)} within 10%; load at end "
              f"{', '.join(f'{x:.2f}' for x in load_average())}")
        if args.json:
            write_json(args.json, {"benchmark": "planner", "environment": env, "results": results})
    comm.Free()
    return 0
