"""All-reduce bandwidth of hpcnet's transports against raw mpi4py and torch.distributed, size by size.

Launch:
    mpirun -np 2 python -m mpi4py -m hpcnet.bench allreduce [--max-size 256MiB] [--json out.json]

For every size, each method (hpcnet's transports and their peers: raw
``comm.Allreduce`` and ``torch.distributed.all_reduce``) runs a block of
iterations in turn, and the turns repeat for several rounds in a rotating
order, so that a load change on a shared machine hits every method alike.
Figures are medians over the rounds; the spread is (max - min) / median.
Bandwidths follow nccl-tests: algbw = bytes / time, busbw = algbw * 2(n-1)/n.
"""

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hpcnet.bench.common import (
    algbw,
    busbw,
    describe_environment,
    environment,
    format_size,
    load_average,
    max_over_ranks,
    parse_size,
    size_sweep,
    summarize,
    table,
    write_json,
)

TARGET_SIZE = 25 * 2**20
"""The size of the issue's target (hpcnet busbw >= 0.95 x raw MPI): the default gradient bucket."""
TARGET_RATIO = 0.95
MIN_ROUNDS = 3
"""Rounds always run per size, even past ``--max-size-s``."""


@dataclass
class Runner:
    """One method prepared on one buffer: ``run()`` sums ``tensor`` across the ranks in place."""

    run: Callable[[], Any]
    tensor: torch.Tensor
    """Where the method leaves its result (read after ``run`` by the correctness check)."""
    close: Callable[[], Any] = lambda: None
    feed: Callable[[float], Any] | None = None
    """Set the value every element of the next input has; None: ``tensor`` is the input (filled)."""

    output: Callable[[], torch.Tensor] | None = None
    """Where the result of the last ``run`` is, when not always in ``tensor`` (a fresh gradient each run)."""

    def result(self) -> torch.Tensor:
        return self.output() if self.output is not None else self.tensor

    def set_input(self, value: float) -> None:
        if self.feed is not None:
            self.feed(value)
        else:
            self.tensor.fill_(value)


@dataclass
class Method:
    """One way to sum a flat float32 tensor across the ranks."""

    name: str
    peer: str
    """The method this one is compared with ('' for the peers themselves)."""
    device: str
    prepare: Callable[[torch.Tensor], Runner]
    result_scale: float = 1.0
    """Factor between the sum and what the method leaves (1/n for an average)."""


TIMEOUT_S = 120.0


def build_methods(comm: Any, world: Any, *, device: torch.device, reducer: bool,
                  cleanup: list[Callable[[], Any]], args_progress: str = "auto") -> list[Method]:
    """The methods this job can run: hpcnet's transports and their raw peers (collective).

    Args:
        comm: the job's communicator.
        world: its layout (``hpcnet.world.discover``).
        device: this rank's device; NCCL methods are added on GPUs.
        reducer: add the Reducer over one flat parameter (hpcnet's full bucket path).
        args_progress: ``dist.progress`` for hpcnet's MPI transports ('auto', 'thread', 'inline').
        cleanup: receives what must be closed after the benchmark.
    """
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcnet.comm.route import mpi_progress
    from hpcnet.comm.transport import TorchTransport, build_transport
    from hpcnet.world import cores_per_rank

    methods: list[Method] = []
    peer_comm = comm.Dup()  # the raw peer gets a private communicator too, as MpiTransport does
    cleanup.append(peer_comm.Free)

    def raw_mpi(buf: torch.Tensor) -> Runner:
        array = buf.numpy()
        return Runner(lambda: peer_comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM), buf)

    def raw_torch(group: Any) -> Callable[[torch.Tensor], Runner]:
        return lambda buf: Runner(lambda: dist.all_reduce(buf, group=group), buf)

    def hpcnet_transport(transport: Any) -> Callable[[torch.Tensor], Runner]:
        cleanup.append(transport.close)
        return lambda buf: Runner(lambda: transport.start(buf).wait(TIMEOUT_S), buf)

    methods.append(Method("mpi4py", "", "cpu", raw_mpi))
    progress = mpi_progress(args_progress, cores_per_rank(world))
    methods.append(Method("hpcnet-mpi", "mpi4py", "cpu",
                          hpcnet_transport(build_transport("mpi", False, comm, world, progress=progress))))
    if device.type == "cpu":
        methods.append(_shm_method(comm, world, cleanup))
    gloo_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    methods.append(Method("torch-gloo", "", "cpu", raw_torch(gloo_group)))
    methods.append(Method("hpcnet-gloo", "torch-gloo", "cpu",
                          hpcnet_transport(TorchTransport(gloo_group, "gloo", world.size))))
    primary, primary_peer = ("nccl", "torch-nccl") if device.type == "cuda" else ("mpi", "mpi4py")
    if device.type == "cuda":
        nccl_group = dist.group.WORLD if dist.get_backend() == "nccl" else dist.new_group(backend="nccl")
        methods.append(Method("torch-nccl", "", "cuda", raw_torch(nccl_group)))
        methods.append(Method("hpcnet-nccl", "torch-nccl", "cuda",
                              hpcnet_transport(TorchTransport(nccl_group, "nccl", world.size))))
    if world.num_nodes > 1:  # real nodes, or virtual ones from HPCNET_RANKS_PER_NODE
        methods.append(Method(f"hpcnet-hierarchical-{primary}", primary_peer, device.type,
                              hpcnet_transport(build_transport(primary, True, comm, world, progress=progress))))
    if reducer:
        methods += _reducer_methods(primary, comm, peer_comm, world, device, progress)
    return methods


def _shm_method(comm: Any, world: Any, cleanup: list[Callable[[], Any]]) -> Method:
    """The bare shm transport: each size's bucket in a window of its own, freed after the size."""
    from hpcnet.comm.transport import build_transport

    shm = build_transport("shm", False, comm, world)
    cleanup.append(shm.close)

    def shm_path(buf: torch.Tensor) -> Runner:
        bucket = shm.allocate(buf.numel(), buf.dtype)  # the bucket lives in the shared window
        return Runner(lambda: shm.start(bucket).wait(TIMEOUT_S), bucket, close=lambda: shm.release(bucket))

    return Method("hpcnet-shm", "mpi4py", "cpu", shm_path)


class _Backward:
    """A backward pass that produces a fresh gradient of one flat parameter, every element ``value``: what
    autograd hands the reducer in training (``(param * value).sum()``: one write of the gradient)."""

    def __init__(self, like: torch.Tensor) -> None:
        self.param = torch.nn.Parameter(torch.zeros_like(like))
        self.value = torch.zeros((), dtype=like.dtype, device=like.device)

    def __call__(self) -> None:
        (self.param * self.value).sum().backward()

    def feed(self, value: float) -> None:
        self.value.fill_(value)


def _reducer_methods(primary: str, comm: Any, peer_comm: Any, world: Any, device: torch.device,
                     progress: str) -> list[Method]:
    """Hpcnet's whole bucket path for one flat parameter, and its hand-written peer.

    ``hpcnet-reducer-<backend>``: zero_grad, a backward pass that hands the reducer a fresh gradient, the
    hook folds it (times 1/n) into the bucket and launches it, finish() agrees over the control plane.
    ``backward+mpi4py``: the same backward, then ``Allreduce`` of the gradient and a divide: the least a
    training step can do.  Both are also compared with the bare ``mpi4py`` Allreduce.
    """
    from mpi4py import MPI

    from hpcnet.comm.reducer import Reducer
    from hpcnet.comm.transport import build_transport

    def reducer_path(kind: str) -> Callable[[torch.Tensor], Runner]:
        def prepare(buf: torch.Tensor) -> Runner:
            backward = _Backward(buf)
            red = Reducer([("flat", backward.param)], build_transport(kind, False, comm, world, progress=progress),
                          comm, bucket_bytes=buf.numel() * buf.element_size(), first_bucket_bytes=0,
                          timeout_s=TIMEOUT_S)

            def run() -> None:
                red.zero_grad()  # as every training step starts
                backward()
                red.finish()

            # The bucket may be a fresh tensor each step (a bucket of one parameter is its gradient, no copy).
            return Runner(run, red.buckets[0].buffer, close=red.close, feed=backward.feed,
                          output=lambda: red.buckets[0].buffer)

        return prepare

    def by_hand(buf: torch.Tensor) -> Runner:
        backward = _Backward(buf)
        n = comm.Get_size()

        def run() -> None:
            backward.param.grad = None
            backward()
            grad = backward.param.grad
            peer_comm.Allreduce(MPI.IN_PLACE, grad.numpy(), op=MPI.SUM)
            grad.div_(n)

        backward()  # a gradient from the start
        return Runner(run, backward.param.grad, feed=backward.feed, output=lambda: backward.param.grad)

    scale = 1 / world.size
    if device.type != "cpu":
        return [Method(f"hpcnet-reducer-{primary}", f"torch-{primary}", device.type, reducer_path(primary),
                       result_scale=scale)]
    return [Method("backward+mpi4py", "mpi4py", "cpu", by_hand, result_scale=scale),
            Method(f"hpcnet-reducer-{primary}", "backward+mpi4py", "cpu", reducer_path(primary), result_scale=scale),
            Method("hpcnet-reducer-shm", "backward+mpi4py", "cpu", reducer_path("shm"), result_scale=scale)]


def _check(method: Method, runner: Runner, comm: Any) -> str | None:
    """Run once on (rank + 1) everywhere and compare with n(n+1)/2 (scaled): None or an error message."""
    n, rank = comm.Get_size(), comm.Get_rank()
    runner.set_input(rank + 1)
    runner.run()
    _sync(runner.tensor)
    expected = n * (n + 1) / 2 * method.result_scale
    out = runner.result()
    got = [out[0].item(), out[-1].item()]
    if any(abs(g - expected) > 1e-6 * expected for g in got):
        return f"{method.name}: wrong sum on rank {rank}: {got} instead of {expected}"
    return None


def _sync(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)


def _time_block(runner: Runner, iters: int, comm: Any) -> float:
    """Seconds per operation of ``iters`` back-to-back operations, slowest rank (collective)."""
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        runner.run()
    _sync(runner.tensor)
    return max_over_ranks(comm, time.perf_counter() - t0) / iters


def bench_size(methods: list[Method], nbytes: int, comm: Any, args: argparse.Namespace,
               device: torch.device) -> dict[str, Any]:
    """Every method at one size, alternating in rounds (collective)."""
    numel = max(1, nbytes // 4)  # float32
    buffers = {"cpu": torch.zeros(numel, dtype=torch.float32)}
    if device.type == "cuda":
        buffers["cuda"] = torch.zeros(numel, dtype=torch.float32, device=device)
    runners: list[Runner] = []
    try:
        estimates = [_prepare(method, buffers[method.device], runners, comm, args) for method in methods]
        if args.iters:
            iters = args.iters
        else:
            iters = int(min(args.max_iters, max(1, args.time_budget_s / (args.rounds * sum(estimates)))))
        iters = comm.bcast(iters, root=0)  # every rank must issue the same collectives
        times, iters_used = _play_rounds(list(zip(methods, runners)), iters, comm, args)
    finally:
        for runner in runners:
            runner.close()
    return _size_result(methods, times, iters_used, numel, comm.Get_size())


def _prepare(method: Method, buf: torch.Tensor, runners: list[Runner], comm: Any, args: argparse.Namespace) -> float:
    """Collective: the method's runner (appended to ``runners``), checked on every rank; its warm-up seconds/op."""
    from hpcnet.agree import mark_agreed

    runner = method.prepare(buf)
    runners.append(runner)
    errors = [e for e in comm.allgather(_check(method, runner, comm)) if e]
    if errors:
        raise mark_agreed(RuntimeError("; ".join(errors)))
    runner.set_input(0.0)  # zeros stay zeros: no growth towards inf, no denormals
    runner.tensor.zero_()
    return _time_block(runner, args.warmup, comm)


def _play_rounds(order: list[tuple[Method, Runner]], iters: int, comm: Any,
                 args: argparse.Namespace) -> tuple[dict[str, list[float]], list[int]]:
    """Collective: the alternating rounds of one size; seconds/op per method and round, iterations per round."""
    methods = [m for m, _ in order]
    times: dict[str, list[float]] = {m.name: [] for m in methods}
    iters_used = []
    t_start = time.perf_counter()
    for r in range(args.rounds):
        # Rotate the order each round, so no method always follows the same one.
        shift = r % len(order)
        for method, runner in order[shift:] + order[:shift]:
            times[method.name].append(_time_block(runner, iters, comm))
        iters_used.append(iters)
        over = time.perf_counter() - t_start > args.max_size_s and r + 1 >= MIN_ROUNDS
        if comm.bcast(over, root=0):
            break  # even one iteration per round is too slow here: fewer rounds, bounded time
        if not args.iters and r + 1 < args.rounds:
            # The warm-up estimate can be far off on a loaded machine: keep
            # the size within its budget by shrinking (never growing) the
            # blocks of the remaining rounds.
            left_s = args.time_budget_s - (time.perf_counter() - t_start)
            round_s = sum(times[m.name][-1] for m in methods) * iters
            fit = int(iters * max(0.0, left_s) / (args.rounds - r - 1) / max(round_s, 1e-9))
            iters = comm.bcast(min(iters, max(1, fit)), root=0)
    return times, iters_used


def _size_result(methods: list[Method], times: dict[str, list[float]], iters_used: list[int], numel: int,
                 n: int) -> dict[str, Any]:
    size = numel * 4
    result: dict[str, Any] = {"size_bytes": size, "count": numel, "rounds": len(iters_used), "iters": iters_used[0],
                              "iters_per_round": iters_used, "methods": {}}
    for method in methods:
        t = times[method.name]
        entry = {
            "time_s": summarize(t),
            "algbw_GBps": summarize([algbw(size, x) / 1e9 for x in t]),
            "busbw_GBps": summarize([busbw(size, x, n) / 1e9 for x in t]),
            "time_s_rounds": t,
        }
        for label, peer in (("vs_peer", method.peer), ("vs_mpi4py", "" if method.name == "mpi4py" else "mpi4py")):
            if peer:
                # Paired per round (same moment, same load), then the median.
                entry[f"ratio_{label}"] = summarize([p / x for p, x in zip(times[peer], t)])
        result["methods"][method.name] = entry
    return result


def format_results(results: list[dict[str, Any]], methods: list[Method], rounds: int) -> str:
    compared = [m for m in methods if m.peer]
    header = ["size", "iters", "mpi4py us"] + [m.name for m in methods]
    header += [f"{m.name.removeprefix('hpcnet-')}/{m.peer}" for m in compared]
    rows = []
    for res in results:
        row = [format_size(res["size_bytes"]), str(res["iters"]),
               f"{res['methods']['mpi4py']['time_s']['median'] * 1e6:.1f}"]
        for m in methods:
            bw = res["methods"][m.name]["busbw_GBps"]
            row.append(f"{bw['median']:.3f} ({bw['spread'] * 100:.0f}%)")
        row += [f"{res['methods'][m.name]['ratio_vs_peer']['median']:.2f}" for m in compared]
        rows.append(row)
    caption = (f"busbw GB/s (1e9 B/s) per method: median of the alternating rounds (up to {rounds}; spread = "
               "(max-min)/median); x/peer: hpcnet's busbw over its peer's, paired per round, median")
    return caption + "\n" + table(header, rows)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench allreduce",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("--sizes", default="", help="comma-separated sizes (e.g. 1KiB,25MiB); overrides the sweep")
    parser.add_argument("--min-size", default="1KiB", help="smallest size of the sweep (default 1KiB)")
    parser.add_argument("--max-size", default="256MiB", help="largest size of the sweep (default 256MiB)")
    parser.add_argument("--factor", type=int, default=4, help="size step of the sweep (default x4); 25MiB is added")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per size (default 5)")
    parser.add_argument("--iters", type=int, default=0,
                        help="iterations per method per round; 0 (default) sizes them from --time-budget-s")
    parser.add_argument("--max-iters", type=int, default=2000, help="cap on automatic iterations (default 2000)")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up iterations per method per size (default 2)")
    parser.add_argument("--time-budget-s", type=float, default=4.0,
                        help="timed seconds per size, all methods and rounds together (default 4); at least one "
                             "iteration per method and round is always run")
    parser.add_argument("--max-size-s", type=float, default=20.0,
                        help=f"stop a size's rounds after this many seconds (at least {MIN_ROUNDS} rounds run; "
                             "default 20)")
    parser.add_argument("--progress", choices=("auto", "thread", "inline"), default="auto",
                        help="dist.progress of hpcnet's MPI transports (default auto, as training uses)")
    parser.add_argument("--no-reducer", action="store_true", help="leave out the Reducer (full bucket path)")
    parser.add_argument("--methods", default="", help="comma-separated subset of the methods to run")
    parser.add_argument("--json", default="", help="also write the results to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    for name in ("rounds", "max_iters", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.iters < 0 or args.time_budget_s <= 0 or args.max_size_s <= 0:
        parser.error("--iters must be >= 0, --time-budget-s and --max-size-s > 0")
    try:
        if args.sizes:
            args.size_list = sorted({parse_size(s) for s in args.sizes.split(",") if s.strip()})
        else:
            args.size_list = size_sweep(parse_size(args.min_size), parse_size(args.max_size), args.factor,
                                        extra=(TARGET_SIZE,))
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.bench allreduce``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.agree import shared_errors
    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.world import choose_device, cpu_threads, discover

    args = _parse_args(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD.Dup()
    rank0 = comm.Get_rank() == 0
    world = discover(comm)
    torch.set_num_threads(cpu_threads(world))
    with shared_errors(comm):
        device = choose_device(world)
    env = environment(comm)
    if rank0:
        print(describe_environment(env), flush=True)
    if world.size < 2 and rank0:
        print("note: one rank; every all-reduce is a no-op (launch under mpirun -np 2 or more)")
    backend = "nccl" if device.type == "cuda" else "gloo"  # DDP and the raw peers run on it
    plane = init_data_plane(comm, world, backend=backend, device=device, timeout_s=TIMEOUT_S)
    cleanup: list[Callable[[], Any]] = []
    try:
        methods = _select(build_methods(comm, world, device=device, reducer=not args.no_reducer, cleanup=cleanup,
                                         args_progress=args.progress),
                          args.methods, rank0)
        if methods is None:
            return 2
        if rank0:
            print(f"methods: {', '.join(m.name for m in methods)}; sizes: "
                  f"{', '.join(format_size(s) for s in args.size_list)}", flush=True)
        results = []
        t_start = time.perf_counter()
        for nbytes in args.size_list:
            t0 = time.perf_counter()
            res = bench_size(methods, nbytes, comm, args, device)
            res["wall_s"] = time.perf_counter() - t0
            results.append(res)
            if rank0:
                line = ", ".join(f"{n} {e['busbw_GBps']['median']:.3f}" for n, e in res["methods"].items())
                print(f"  {format_size(nbytes):>7s}: {line} GB/s ({res['iters']} iters x {res['rounds']} rounds, "
                      f"{res['wall_s']:.1f} s)", flush=True)
        env["load_average_end"] = load_average()
        summary = _target(results) if world.size > 1 else None  # one rank: nothing moves, no ratio
        if rank0:
            _report(results, methods, env, summary, args, time.perf_counter() - t_start)
        return 0
    finally:
        for close in reversed(cleanup):
            close()
        plane.close()
        comm.Free()


def _select(methods: list[Method], wanted_text: str, rank0: bool) -> list[Method] | None:
    """The methods ``--methods`` names, with their peers; None (after a message) when one is unknown."""
    if not wanted_text:
        return methods
    wanted = [s.strip() for s in wanted_text.split(",") if s.strip()]
    unknown = sorted(set(wanted) - {m.name for m in methods})
    if unknown:
        if rank0:
            print(f"hpcnet.bench allreduce: unknown method(s) {', '.join(unknown)}; "
                  f"available: {', '.join(m.name for m in methods)}", file=sys.stderr)
        return None
    # A compared method needs its peer (and its peer's peer) in the same rounds, and every method is also
    # compared with the bare mpi4py Allreduce, which the table's first column times.
    keep = set(wanted) | {"mpi4py"}
    peers = {m.name: m.peer for m in methods}
    while missing := {peers[name] for name in keep if peers.get(name)} - keep:
        keep |= missing
    return [m for m in methods if m.name in keep]


def _report(results: list[dict[str, Any]], methods: list[Method], env: dict[str, Any],
            summary: dict[str, Any] | None, args: argparse.Namespace, wall_s: float) -> None:
    """Rank 0: the table, the load, the target line and the JSON file."""
    print()
    print(format_results(results, methods, args.rounds))
    print(f"load average at end: {', '.join(f'{x:.2f}' for x in env['load_average_end'])}; "
          f"{wall_s:.0f} s")
    if summary:
        print(f"target: hpcnet-mpi busbw at {format_size(summary['size_bytes'])} = "
              f"{summary['ratio']:.3f} x raw MPI Allreduce (target >= {TARGET_RATIO}): "
              f"{'met' if summary['met'] else 'NOT met'}")
    if args.json:
        write_json(args.json, {
            "benchmark": "allreduce", "environment": env, "rounds": args.rounds,
            "methods": [{"name": m.name, "peer": m.peer, "device": m.device} for m in methods],
            "results": results, "target": summary,
            "ratio_hpcnet_mpi_vs_mpi4py": {str(r["size_bytes"]): r["methods"]["hpcnet-mpi"]["ratio_vs_peer"]
                                           ["median"] for r in results if "hpcnet-mpi" in r["methods"]},
        })


def _target(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The issue's target at the size closest to 25 MiB, when hpcnet-mpi ran."""
    candidates = [r for r in results if "hpcnet-mpi" in r["methods"]]
    if not candidates:
        return None
    res = min(candidates, key=lambda r: abs(r["size_bytes"] - TARGET_SIZE))
    ratio = res["methods"]["hpcnet-mpi"]["ratio_vs_peer"]["median"]
    return {"size_bytes": res["size_bytes"], "ratio": ratio, "target": TARGET_RATIO, "met": ratio >= TARGET_RATIO}
