"""Training samples/s of hpcnet's data-parallel step against torch DistributedDataParallel, same run.

Launch:
    mpirun -np 2 python -m mpi4py -m hpcnet.bench train [--models mlp,resnet18] [--json out.json]

Both contenders train their own copy of the same model (same initial weights,
optimizer, gradient clipping) on the same synthetic batches, already in
memory, so no data loading is timed.  hpcnet runs ``DataParallel.step`` with
the default configuration (``auto`` backend: MPI on CPU, NCCL on GPU); DDP
runs with its defaults on the torch.distributed group (gloo on CPU, NCCL on
GPU).  After a warm-up, blocks of steps alternate between the contenders for
several rounds, so a load change on a shared machine hits both alike;
figures are medians over the rounds.  A third contender without any
communication (``local``) shows the compute floor.  A last, instrumented
block splits the step time and measures how much of hpcnet's communication
hides behind the backward pass.

Across hosts, one rank a host (local rank 0) reads its host's interface
counters (``/sys/class/net/<if>/statistics``, loopback left out) before and
after each timed block: the bytes a step sends out of a host and receives,
per contender, set against the link floor, the time an exact hierarchical
all-reduce needs to send the gradient out of each host once at the link's
rate: ``--link-gbit``, else the rate the topology probe measures between the
hosts (``hpcnet.comm.topology``, once before the models), never the
interfaces' nominal speed (a tc limit or a slower switch port does not show
there), which the line above each table gives beside it.

This module runs the warm-up, the timed rounds and the instrumented block, and the command line; the models and
contenders are ``train_contenders``'s, the link figures ``train_link``'s, a model's record and table
``train_report``'s.
"""

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from hpcnet.bench.common import (
    counter_delta,
    describe_environment,
    environment,
    load_average,
    max_over_ranks,
    net_counters,
    write_json,
)
from hpcnet.bench.stepsplit import profile_block, sync_device
from hpcnet.bench.train_contenders import (
    DDP_HOOKS,
    DEFAULT_MODELS,
    POWERSGD_RANK,
    SPECS,
    Contender,
    ModelSpec,
    make_contenders,
    synthetic_batches,
)
from hpcnet.bench.train_link import gather_link, probe_link_gbit
from hpcnet.bench.train_report import _model_result, format_model
from hpcnet.config import PRECISIONS
from hpcnet.models.device import BatchMover, device_settings


def run_block(contender: Contender, batches: list[tuple[torch.Tensor, torch.Tensor]], first: int, steps: int,
              comm: Any, device: torch.device) -> float:
    """Seconds for ``steps`` steps from batch number ``first``, slowest rank (collective)."""
    comm.Barrier()
    t0 = time.perf_counter()
    loss = None
    for i in range(first, first + steps):
        loss = contender.step(*batches[i % len(batches)])
    if loss is not None:
        loss.item()  # the step is finished (GPU: its kernels too)
    sync_device(device)
    return max_over_ranks(comm, time.perf_counter() - t0)


def bench_model(name: str, spec: ModelSpec, comm: Any, world: Any, args: argparse.Namespace,
                device: torch.device, measured_gbit: float | None = None) -> dict[str, Any]:
    """Warm-up, alternating timed rounds and an instrumented block for the model ``SPECS[name]`` (collective);
    ``measured_gbit``: the probe's link rate for the floor (``probe_link_gbit``)."""
    from mpi4py import MPI

    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    batch_size = args.batch_size or spec.batch_size
    torch.manual_seed(0)  # make_contenders' default seed
    base = build_model(spec.model, DatasetInfo("image", spec.input_shape, spec.num_classes), spec.options)
    settings = device_settings(args.cuda_cfg, device, base)  # what training would use on this device
    contenders = make_contenders(spec, comm, world, device=device, local=not args.no_local, dist_cfg=args.dist_cfg,
                                 precision=args.precision, settings=settings, base=base, ddp_hooks=args.hook_list)
    mover = BatchMover(device, settings)
    batches = [mover(batch) for batch in synthetic_batches(spec, batch_size, args.distinct_batches, world.rank,
                                                           device)]
    try:
        position = {c.name: 0 for c in contenders}  # every contender walks the same batch sequence

        def block(c: Contender, steps: int) -> float:
            seconds = run_block(c, batches, position[c.name], steps, comm, device)
            position[c.name] += steps
            return seconds

        reads_link = world.local_rank == 0  # one reader a host
        link_per_step: dict[str, list[tuple[float, float]]] = {c.name: [] for c in contenders}

        def timed_block(c: Contender, steps: int) -> float:
            # Read before the block's barrier and after its closing collective: every rank has finished then, so
            # every byte of the block has left its host (and arrived).
            before = net_counters() if reads_link else {}
            seconds = block(c, steps)
            if before:
                sent, received = counter_delta(before, net_counters())
                link_per_step[c.name].append((sent / steps, received / steps))
            return seconds

        for c in contenders:
            block(c, args.warmup)
        seconds = _alternate(contenders, timed_block, args.rounds, args.steps)
        profiles = {}
        if args.profile_steps:
            for c in contenders:
                profiles[c.name] = profile_block(c, batches, position[c.name], args.profile_steps, comm, device)
                position[c.name] += args.profile_steps
        link = gather_link(comm, link_per_step if reads_link else None)
    finally:
        for c in contenders:
            if c.dp is not None:
                c.dp.close()  # dist.zero=3: the parameters whole again
    # Same start, same data, same number of steps: hpcnet and DDP should hold
    # (nearly) the same weights; a large difference means they did not train alike.
    diff = max((a - b).abs().max().item() for a, b in zip(contenders[0].model.parameters(),
                                                             contenders[1].model.parameters()))
    diff = comm.allreduce(diff, op=MPI.MAX)
    result = _model_result(name, spec, contenders, seconds, profiles, diff, batch_size, world.size, args, link,
                           measured_gbit)
    result["device_settings"] = settings.describe()
    return result


def _alternate(contenders: list[Contender], block: Callable[[Contender, int], float], rounds: int,
               steps: int) -> dict[str, list[float]]:
    """Collective: ``rounds`` of one block of ``steps`` per contender; seconds per block, per contender."""
    seconds: dict[str, list[float]] = {c.name: [] for c in contenders}
    for r in range(rounds):
        # Rotate who goes first, so no contender always runs right after the same one.
        shift = r % len(contenders)
        for c in contenders[shift:] + contenders[:shift]:
            seconds[c.name].append(block(c, steps))
    return seconds


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench train", description=__doc__.strip().splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS,
                        help=f"comma-separated models among {', '.join(SPECS)} (default {DEFAULT_MODELS})")
    parser.add_argument("--steps", type=int, default=5, help="steps per contender per round (default 5)")
    parser.add_argument("--rounds", type=int, default=10, help="alternating rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per contender (default 3)")
    parser.add_argument("--batch-size", type=int, default=0, help="per-rank batch size (default: per model)")
    parser.add_argument("--distinct-batches", type=int, default=4, help="synthetic batches cycled (default 4)")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="steps of the instrumented block that splits the step time (default 5; 0 = none)")
    parser.add_argument("--dist", action="append", default=[], metavar="OPTION=VALUE",
                        help="a dist option of hpcnet's contender (e.g. progress=thread; repeatable; default: "
                             "hpcnet's defaults, as training uses)")
    parser.add_argument("--cuda", action="append", default=[], metavar="OPTION=VALUE",
                        help="a cuda option for every contender (e.g. channels_last=off; repeatable; default: "
                             "hpcnet's defaults, on for a CUDA device)")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="train.precision of every contender's forward (default fp32)")
    parser.add_argument("--ddp-hooks", default="", metavar="HOOK,...",
                        help=f"also DDP with these communication hooks, each a contender: {', '.join(DDP_HOOKS)} "
                             f"(PowerSGD at rank {POWERSGD_RANK}; default none)")
    parser.add_argument("--no-local", action="store_true", help="leave out the no-communication baseline")
    parser.add_argument("--link-gbit", type=float, default=None, metavar="G",
                        help="the rate of each host's link in Gbit/s, for the link floor (default: the slowest "
                             "host's link as the topology probe measures it, on more than one host; the interfaces' "
                             "nominal /sys/class/net/<if>/speed is shown beside it, never used: a tc rate limit "
                             "does not show there)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    for name in ("steps", "rounds", "distinct_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.profile_steps < 0 or args.batch_size < 0:
        parser.error("--warmup, --profile-steps and --batch-size must be >= 0")
    if args.link_gbit is not None and not 0 < args.link_gbit < float("inf"):  # NaN too
        parser.error("--link-gbit must be a positive number of Gbit/s")
    from hpcnet.config.load import load_config
    from hpcnet.errors import UsageError

    try:
        args.dist_cfg = load_config(overrides=[f"dist.{o}" for o in args.dist]).dist
    except UsageError as exc:
        parser.error(f"--dist: {exc}")
    try:
        args.cuda_cfg = load_config(overrides=[f"cuda.{o}" for o in args.cuda]).cuda
    except UsageError as exc:
        parser.error(f"--cuda: {exc}")
    args.hook_list = tuple(h.strip() for h in args.ddp_hooks.split(",") if h.strip())
    odd = [h for h in args.hook_list if h not in DDP_HOOKS]
    if odd:
        parser.error(f"--ddp-hooks: unknown hook(s) {', '.join(odd)}; choose among {', '.join(DDP_HOOKS)}")
    args.model_list = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.model_list if m not in SPECS]
    if unknown or not args.model_list:
        parser.error(f"unknown model(s) {', '.join(unknown) or '(none given)'}; choose among {', '.join(SPECS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.bench train``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.agree import shared_errors
    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.world import choose_device, cpu_threads, discover

    args = _parse_args(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    torch.set_num_threads(cpu_threads(world))  # as hpcnet.train does: the node's cores shared among its ranks
    with shared_errors(comm):
        device = choose_device(world)
    env = environment(comm)
    if world.is_main:
        print(describe_environment(env), flush=True)
    backend = "nccl" if device.type == "cuda" else "gloo"  # DDP and the raw peers run on it
    plane = init_data_plane(comm, world, backend=backend, device=device, timeout_s=300.0)
    try:
        measured = None if args.link_gbit else probe_link_gbit(comm, world)  # the floor's rate, before any model
        results = []
        for name in args.model_list:
            t0 = time.perf_counter()
            res = bench_model(name, SPECS[name], comm, world, args, device, measured)
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
            if world.is_main:
                print()
                print(format_model(res), flush=True)
        env["load_average_end"] = load_average()
        if world.is_main:
            print(f"\nload average at end: {', '.join(f'{x:.2f}' for x in env['load_average_end'])}")
            if args.json:
                write_json(args.json, {"benchmark": "train", "environment": env, "results": results})
        return 0
    finally:
        plane.close()
        comm.Free()
