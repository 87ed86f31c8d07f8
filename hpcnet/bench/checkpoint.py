"""Checkpoint save and load rates: hpcnet against torch.save and torch.distributed.checkpoint, and the disk.

Launch:
    mpirun -np 2 python -m mpi4py -m hpcnet.bench checkpoint [--size-mb 512] [--dir DIR] [--json out.json]

One replicated state (as in data parallelism: every rank holds all of it) of
about ``--size-mb`` MB, mostly large fp32 matrices plus a tail of small
tensors, is saved and loaded by:

- disk: every rank writes its 1/N share of the bytes to its own file and
  fsyncs (N writers), and rank 0 alone writes all of them (1 writer); the
  faster is the limit;
- hpcnet: a full checkpoint, synchronous (collective MPI-IO writes, the
  default, and independent ones, ``hpcnet.ckpt_io.COLLECTIVE_WRITES``); asynchronous (the time ``save``
  blocks, and the time until ``wait`` returns); load on every rank;
- torch.save of the state on rank 0 (replicated: nothing to gather), fsynced;
  load: ``torch.load(weights_only=True)`` on every rank;
- torch.distributed.checkpoint over gloo, ``FileSystemWriter(sync_files=True)``;
  load into preallocated tensors on every rank.

Every save includes fsync.  Before each load the files are dropped from the
page cache (``posix_fadvise(DONTNEED)``) so loads read the disk where the
kernel allows.  Before each save the method's older output is deleted and the
file systems synced, untimed, so no method pays for another's clean-up (the
disk here is mounted with ``discard``).  Rates are logical state bytes /
seconds, best of ``--repeat``
rounds; each round runs every method once, in an order rotated from round to
round, so that a change of load on a shared machine hits every method alike.
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


def timed(comm: Any, fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> float:
    """Wall time of one run, barrier to barrier (the slowest rank counts)."""
    from mpi4py import MPI

    if before is not None:
        before()
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    comm.Barrier()
    return comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)


def run(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Collective: every measurement, in rotating rounds; returns the results (equal on all ranks)."""
    import numpy as np
    import torch.distributed.checkpoint as dcp
    from mpi4py import MPI

    from hpcnet.ckpt.manager import CheckpointManager

    rank, size = comm.Get_rank(), comm.Get_size()
    base = Path(args.dir)
    state = make_state(int(args.size_mb * 1e6))
    nbytes = state_bytes(state)
    results: dict[str, Any] = {"world_size": size, "state_bytes": nbytes, "tensors": len(state), "rounds": args.repeat}

    def fresh(name: str) -> Path:
        path = base / name
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        comm.Barrier()
        return path

    disk, torch_dir, dcp_dir = fresh("disk"), fresh("torch-save"), fresh("dcp")
    share = np.random.default_rng(rank).integers(0, 255, size=nbytes // size, dtype=np.uint8)
    whole = np.random.default_rng(9).integers(0, 255, size=nbytes, dtype=np.uint8) if rank == 0 else None
    # keep=2: the save deletes nothing (the bench's own clean-up does, untimed, like for the others).
    sync = CheckpointManager(comm, fresh("hpcnet-sync"), keep=2, full_every=1, async_save=False)
    background = CheckpointManager(comm, fresh("hpcnet-async"), keep=2, full_every=1, async_save=True)
    results["hpcnet_async_mode"] = "background thread" if background.async_save else "synchronous (no THREAD_MULTIPLE)"
    steps = iter(range(1, 1_000_000))
    dcp_saves = iter(range(1_000_000))
    blocking: list[float] = []
    phases: dict[str, float] = {}
    dcp_target = {k: torch.empty_like(v) for k, v in state.items()}
    plane = None
    if size > 1:
        from hpcnet.comm.bootstrap import init_data_plane
        from hpcnet.comm.world import discover

        plane = init_data_plane(comm, discover(comm), backend="gloo", device=torch.device("cpu"), timeout_s=600)

    def hpcnet_sync() -> None:
        sync.save(next(steps), state, {}, {})
        phases.update(sync.last_timings)

    def hpcnet_independent() -> None:
        from hpcnet.ckpt import store as ckpt_io

        ckpt_io.COLLECTIVE_WRITES = False
        try:
            sync.save(next(steps), state, {}, {})
        finally:
            ckpt_io.COLLECTIVE_WRITES = True

    def hpcnet_async() -> None:
        background.save(next(steps), state, {}, {})
        blocking.append(comm.allreduce(background.last_timings["blocking_s"], op=MPI.MAX))
        background.wait()

    def torch_save() -> None:
        if rank == 0:
            with open(torch_dir / "state.pt", "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())

    def dcp_save() -> None:
        target = dcp_dir / f"save{next(dcp_saves)}"
        dcp.save(state, storage_writer=dcp.FileSystemWriter(target, sync_files=True), no_dist=size == 1)

    def newest(directory: Path, pattern: str) -> Path:
        return max(directory.glob(pattern), key=lambda p: p.stat().st_mtime)

    def clean_slate(directory: Path, pattern: str, keep_newest: bool = True) -> Callable[[], None]:
        """Before a save, untimed: delete the method's older output and let the file system settle.

        The disk here is mounted with ``discard``: without this, deleting and
        truncating files hands the next method, whichever it is, the cost.
        """
        def before() -> None:
            if rank == 0:
                old = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime)
                for path in old[:-1] if keep_newest else old:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                os.sync()
            comm.Barrier()
        return before

    methods: list[tuple[str, Callable[[], Any], Callable[[], Any] | None]] = [
        ("disk_n_writers", lambda: write_fsync(disk / f"part{rank}", memoryview(share)),
         clean_slate(disk, "part*", keep_newest=False)),
        ("disk_1_writer", lambda: rank == 0 and write_fsync(disk / "whole", memoryview(whole)),
         clean_slate(disk, "whole", keep_newest=False)),
        ("hpcnet_save", hpcnet_sync, clean_slate(sync.directory, "ckpt-*.h5")),
        ("hpcnet_save_independent", hpcnet_independent, clean_slate(sync.directory, "ckpt-*.h5")),
        ("hpcnet_async_total", hpcnet_async, clean_slate(background.directory, "ckpt-*.h5")),
        ("torch_save", torch_save, clean_slate(torch_dir, "state.pt", keep_newest=False)),
        ("dcp_save", dcp_save, clean_slate(dcp_dir, "save*")),
        ("hpcnet_load", lambda: sync.load(str(newest(sync.directory, "ckpt-*.h5"))),
         lambda: drop_cache([newest(sync.directory, "ckpt-*.h5")])),
        ("torch_load", lambda: torch.load(torch_dir / "state.pt", weights_only=True), lambda: drop_cache([torch_dir])),
        ("dcp_load", lambda: dcp.load(dcp_target, storage_reader=dcp.FileSystemReader(newest(dcp_dir, "save*")),
                                      no_dist=size == 1), lambda: drop_cache([newest(dcp_dir, "save*")])),
    ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    try:
        for round_ in range(args.repeat):  # the first round saves before it loads
            shift = round_ % len(methods)
            for name, fn, before in methods[shift:] + methods[:shift]:
                times[name].append(timed(comm, fn, before))
        assert all(torch.equal(dcp_target[k], state[k]) for k in state)
    finally:
        sync.close()
        background.close()
        if plane is not None:
            plane.close()
        comm.Barrier()
        if rank == 0 and not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    for name, values in times.items():
        results[f"{name}_s"] = min(values)
        results[f"{name}_all_s"] = values
    results["hpcnet_async_blocking_s"] = min(blocking)
    results["hpcnet_save_phases"] = {k: v for k, v in phases.items() if k.endswith("_s")}
    return results


def report(results: dict[str, Any]) -> str:
    """The table: rates in GB/s (1e9 bytes), and hpcnet against the disk and DCP."""
    nbytes = results["state_bytes"]
    limit_s = min(results["disk_n_writers_s"], results["disk_1_writer_s"])
    rows = [
        ("disk, fsync'd, N writers", results["disk_n_writers_s"], ""),
        ("disk, fsync'd, 1 writer", results["disk_1_writer_s"], ""),
        ("hpcnet save (sync, full)", results["hpcnet_save_s"], f"{limit_s / results['hpcnet_save_s']:.0%} of disk"),
        ("  the same, independent MPI-IO writes", results["hpcnet_save_independent_s"],
         f"{limit_s / results['hpcnet_save_independent_s']:.0%} of disk"),
        ("hpcnet save (async): blocking", results["hpcnet_async_blocking_s"], "time save() blocks"),
        ("hpcnet save (async): until written", results["hpcnet_async_total_s"], "save() + wait()"),
        ("hpcnet load (every rank, full state)", results["hpcnet_load_s"], ""),
        ("torch.save on rank 0", results["torch_save_s"], ""),
        ("torch.load on every rank", results["torch_load_s"], ""),
        ("torch.distributed.checkpoint save", results["dcp_save_s"],
         f"hpcnet is {results['dcp_save_s'] / results['hpcnet_save_s']:.2f}x"),
        ("torch.distributed.checkpoint load", results["dcp_load_s"],
         f"hpcnet is {results['dcp_load_s'] / results['hpcnet_load_s']:.2f}x"),
    ]
    lines = [f"checkpoint benchmark: {nbytes / 1e6:.0f} MB state, {results['tensors']} tensors, "
             f"{results['world_size']} rank(s), best of {results['rounds']} rounds",
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

    from hpcnet.comm.world import cpu_threads, discover

    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512.0, help="state size in MB (default 512)")
    parser.add_argument("--dir", default="bench-checkpoint", help="scratch directory on the file system to test")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (each runs every method once); the best counts")
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
