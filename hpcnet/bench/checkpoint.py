"""Checkpoint save and load rates: hpcnet against torch.save and torch.distributed.checkpoint, and the disk.

Launch:
    mpirun -np 2 python -m mpi4py -m hpcnet.bench checkpoint [--size-mb 512] [--dir DIR] [--json out.json]

One replicated state (as in data parallelism: every rank holds all of it) of
about ``--size-mb`` MB, mostly large fp32 matrices plus a tail of small
tensors, is saved and loaded by:

- disk: every rank writes its 1/N share of the bytes to its own file and
  fsyncs (N writers), and rank 0 alone writes all of them (1 writer); the
  faster is the limit;
- hpcnet: a full checkpoint, synchronous; asynchronous (the time ``save``
  blocks, and the time until ``wait`` returns); load on every rank;
- torch.save of the state on rank 0 (replicated: nothing to gather), fsynced;
  load: ``torch.load(weights_only=True)`` on every rank;
- torch.distributed.checkpoint over gloo, ``FileSystemWriter(sync_files=True)``;
  load into preallocated tensors on every rank.

Every save includes fsync.  Before each load the files are dropped from the
page cache (``posix_fadvise(DONTNEED)``) so loads read the disk where the
kernel allows.  Rates are logical state bytes / seconds, best of ``--repeat``.
"""

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch


def make_state(size_bytes: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state of about ``size_bytes``: 4096-wide fp32 matrices of <= 32 MiB and 64 small tensors."""
    gen = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    row = 4096 * 4
    remaining = size_bytes - 64 * 4096
    i = 0
    while remaining >= row:
        rows = min(remaining // row, (32 << 20) // row)
        state[f"model/layer{i}.weight"] = torch.rand(rows, 4096, generator=gen)
        remaining -= rows * row
        i += 1
    for j in range(64):
        state[f"model/norm{j}.weight"] = torch.rand(1024, generator=gen)
    return state


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def drop_cache(paths: list[Path]) -> None:
    """Ask the kernel to forget the (clean, fsynced) pages of these files."""
    for path in paths:
        for file in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def write_fsync(path: Path, data: memoryview) -> None:
    with open(path, "wb") as handle:
        for start in range(0, len(data), 64 << 20):
            handle.write(data[start:start + (64 << 20)])
        handle.flush()
        os.fsync(handle.fileno())


def timed(comm: Any, fn: Callable[[], Any], repeat: int, before: Callable[[], Any] | None = None) -> float:
    """Best wall time over ``repeat`` runs, barrier to barrier (the slowest rank counts)."""
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        comm.Barrier()
        best = min(best, comm.allreduce(time.perf_counter() - t0, op=_max()))
    return best


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def run(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Collective: every measurement, in one run; returns the results (equal on all ranks)."""
    import numpy as np
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from hpcnet.checkpoint import CheckpointManager

    rank, size = comm.Get_rank(), comm.Get_size()
    base = Path(args.dir)
    state = make_state(int(args.size_mb * 1e6))
    nbytes = state_bytes(state)
    results: dict[str, Any] = {"world_size": size, "state_bytes": nbytes, "tensors": len(state), "repeat": args.repeat}

    def fresh(name: str) -> Path:
        path = base / name
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        comm.Barrier()
        return path

    # The disk: N writers of 1/N each, and one writer of everything.
    disk = fresh("disk")
    share = np.random.default_rng(rank).integers(0, 255, size=nbytes // size, dtype=np.uint8)
    results["disk_n_writers_s"] = timed(comm, lambda: write_fsync(disk / f"part{rank}", memoryview(share)), args.repeat)
    whole = np.random.default_rng(9).integers(0, 255, size=nbytes, dtype=np.uint8) if rank == 0 else None
    results["disk_1_writer_s"] = timed(
        comm, lambda: rank == 0 and write_fsync(disk / "whole", memoryview(whole)), args.repeat)
    del share, whole

    # hpcnet: synchronous, asynchronous, load.
    sync_dir, async_dir = fresh("hpcnet-sync"), fresh("hpcnet-async")
    with CheckpointManager(comm, sync_dir, keep=1, full_every=1, async_save=False) as manager:
        step = iter(range(1, 1000))
        results["hpcnet_save_s"] = timed(comm, lambda: manager.save(next(step), state, {}, {}), args.repeat)
        results["hpcnet_save_phases"] = dict(manager.last_timings)
        latest = manager.committed()[-1].path
        results["hpcnet_load_s"] = timed(comm, lambda: manager.load(latest), args.repeat,
                                         before=lambda: drop_cache([Path(latest)]))
    with CheckpointManager(comm, async_dir, keep=1, full_every=1, async_save=True) as manager:
        blocking = []

        def save_async() -> None:
            manager.save(next(step), state, {}, {})
            blocking.append(comm.allreduce(manager.last_timings["blocking_s"], op=_max()))
            manager.wait()

        results["hpcnet_async_total_s"] = timed(comm, save_async, args.repeat)
        results["hpcnet_async_blocking_s"] = min(blocking)
        results["hpcnet_async_mode"] = "background thread" if manager.async_save else "synchronous (no THREAD_MULTIPLE)"

    # torch.save on rank 0, torch.load everywhere.
    torch_dir = fresh("torch-save")

    def torch_save() -> None:
        if rank == 0:
            with open(torch_dir / "state.pt", "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())

    results["torch_save_s"] = timed(comm, torch_save, args.repeat)
    results["torch_load_s"] = timed(comm, lambda: torch.load(torch_dir / "state.pt", weights_only=True), args.repeat,
                                    before=lambda: drop_cache([torch_dir]))

    # torch.distributed.checkpoint over gloo on the same ranks.
    plane = None
    if size > 1:
        from hpcnet.bootstrap import init_data_plane
        from hpcnet.world import discover

        plane = init_data_plane(comm, discover(comm), backend="gloo", device=torch.device("cpu"), timeout_s=600)
    try:
        dcp_dir = fresh("dcp")
        counter = iter(range(1000))

        def dcp_save() -> None:
            target = dcp_dir / f"save{next(counter)}"
            dcp.save(state, storage_writer=dcp.FileSystemWriter(target, sync_files=True), no_dist=size == 1)

        results["dcp_save_s"] = timed(comm, dcp_save, args.repeat)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        first = dcp_dir / "save0"
        results["dcp_load_s"] = timed(
            comm, lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(first), no_dist=size == 1),
            args.repeat, before=lambda: drop_cache([first]))
        assert all(torch.equal(target[k], state[k]) for k in state)
    finally:
        if plane is not None:
            plane.close()
        comm.Barrier()
        if rank == 0 and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    return results


def report(results: dict[str, Any]) -> str:
    """The table: rates in GB/s (1e9 bytes), and hpcnet against the disk and DCP."""
    nbytes = results["state_bytes"]
    limit_s = min(results["disk_n_writers_s"], results["disk_1_writer_s"])
    rows = [
        ("disk, fsync'd, N writers", results["disk_n_writers_s"], ""),
        ("disk, fsync'd, 1 writer", results["disk_1_writer_s"], ""),
        ("hpcnet save (sync, full)", results["hpcnet_save_s"], f"{limit_s / results['hpcnet_save_s']:.0%} of disk"),
        ("hpcnet save (async): blocking", results["hpcnet_async_blocking_s"], "time save() blocks"),
        ("hpcnet save (async): until written", results["hpcnet_async_total_s"], ""),
        ("hpcnet load (every rank, full state)", results["hpcnet_load_s"], ""),
        ("torch.save on rank 0", results["torch_save_s"], ""),
        ("torch.load on every rank", results["torch_load_s"], ""),
        ("torch.distributed.checkpoint save", results["dcp_save_s"],
         f"hpcnet is {results['dcp_save_s'] / results['hpcnet_save_s']:.2f}x"),
        ("torch.distributed.checkpoint load", results["dcp_load_s"],
         f"hpcnet is {results['dcp_load_s'] / results['hpcnet_load_s']:.2f}x"),
    ]
    lines = [f"checkpoint benchmark: {nbytes / 1e6:.0f} MB state, {results['tensors']} tensors, "
             f"{results['world_size']} rank(s), best of {results['repeat']}",
             f"{'':<40} {'seconds':>8} {'GB/s':>7}  note"]
    for name, seconds, note in rows:
        lines.append(f"{name:<40} {seconds:>8.3f} {nbytes / seconds / 1e9:>7.3f}  {note}")
    phases = results.get("hpcnet_save_phases", {})
    lines.append("hpcnet save phases (last run, rank 0): " + ", ".join(
        f"{k} {v:.3f}" for k, v in phases.items() if k.endswith("_s")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.bench checkpoint``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.world import cpu_threads, discover

    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512.0, help="state size in MB (default 512)")
    parser.add_argument("--dir", default="bench-checkpoint", help="scratch directory on the file system to test")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best counts")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--keep", action="store_true", help="keep the files written")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.size_mb <= 0 or args.repeat < 1:
        parser.error("--size-mb must be positive and --repeat at least 1")
    comm = MPI.COMM_WORLD.Dup()
    try:
        torch.set_num_threads(cpu_threads(discover(comm)))
        results = run(comm, args)
        if comm.Get_rank() == 0:
            print(report(results))
            print("JSON: " + json.dumps(results, sort_keys=True))
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    finally:
        comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
