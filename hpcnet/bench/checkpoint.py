"""Checkpoint save and load rates: hpcnet against torch.save and torch.distributed.checkpoint, and the disk.

Launch:
    mpirun -np 2 python -m mpi4py -m hpcnet.bench checkpoint [--size-mb 512] [--dir DIR] [--json out.json]

One replicated state (as in data parallelism: every rank holds all of it) of
about ``--size-mb`` MB, mostly large fp32 matrices plus a tail of small
tensors, is saved and loaded by:

- disk: every rank writes its 1/N share of the bytes to its own file and
  fsyncs (N writers), and rank 0 alone writes all of them (1 writer); the
  faster is the limit; and every rank reads its share back (N readers), the
  limit of a load;
- raw collective h5py: one dataset of the same bytes in one file
  (``driver="mpio"``), each rank writing its disjoint 1/N slice collectively,
  in pieces of 64 MiB, then closed and fsynced by every rank;
- hpcnet: a full checkpoint, synchronous (the default: data written with
  pwrite at the datasets' offsets and hashed in threads, ``hpcnet.ckpt.direct``;
  and through h5py's collective MPI-IO writes, ``CheckpointManager(direct_writes=False)``);
  asynchronous (the time ``save`` blocks, and the time until ``wait`` returns);
  load on every rank, into new tensors and in place into preallocated ones
  (``load(into=...)``, as DCP loads);
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
The ratios of hpcnet to its peers are given twice: between the best times, and
round by round (the median and range over the rounds of the ratio within one
round), which a noisy disk moves less.
"""

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def read_into(path: Path, buffer: memoryview) -> None:
    """Read the file into ``buffer`` (as long as the file), in 64 MiB calls."""
    with open(path, "rb", buffering=0) as handle:
        done = 0
        while done < len(buffer):
            got = handle.readinto(buffer[done:done + (64 << 20)])
            if not got:
                raise ValueError(f"{path} ends at byte {done} of {len(buffer)}")
            done += got


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


class _Methods:
    """The measured methods and what they share: directories, managers, counters (collective to build and close)."""

    def __init__(self, comm: Any, args: argparse.Namespace, state: dict[str, torch.Tensor]) -> None:
        import numpy as np

        from hpcnet.ckpt.manager import CheckpointManager

        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.base, self.state = Path(args.dir), state
        nbytes = state_bytes(state)
        self.disk, self.torch_dir, self.dcp_dir = self.fresh("disk"), self.fresh("torch-save"), self.fresh("dcp")
        self.share = np.random.default_rng(self.rank).integers(0, 255, size=nbytes // self.size, dtype=np.uint8)
        self.whole = (np.random.default_rng(9).integers(0, 255, size=nbytes, dtype=np.uint8)
                      if self.rank == 0 else None)
        self.share_back = np.empty_like(self.share)
        # keep=2: the save deletes nothing (the bench's own clean-up does, untimed, like for the others).
        self.sync = CheckpointManager(comm, self.fresh("hpcnet-sync"), keep=2, full_every=1, async_save=False)
        self.through_h5py = CheckpointManager(comm, self.fresh("hpcnet-h5py"), keep=2, full_every=1,
                                              async_save=False, direct_writes=False)
        self.h5py_dir = self.fresh("h5py-collective")
        self.background = CheckpointManager(comm, self.fresh("hpcnet-async"), keep=2, full_every=1, async_save=True)
        self.steps = iter(range(1, 1_000_000))
        self.dcp_saves = iter(range(1_000_000))
        self.blocking: list[float] = []
        self.phases: dict[str, float] = {}
        self.dcp_target = {k: torch.empty_like(v) for k, v in state.items()}
        self.hpcnet_target = {k: torch.empty_like(v) for k, v in state.items()}
        self.load_phases: dict[str, float] = {}
        self.load_phases_all: dict[str, list[dict[str, float]]] = {"hpcnet_load": [], "hpcnet_load_into": []}
        self.plane = None
        if self.size > 1:
            from hpcnet.comm.bootstrap import init_data_plane
            from hpcnet.world import discover

            self.plane = init_data_plane(comm, discover(comm), backend="gloo", device=torch.device("cpu"),
                                         timeout_s=600)

    def fresh(self, name: str) -> Path:
        path = self.base / name
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
        self.comm.Barrier()
        return path

    def hpcnet_sync(self) -> None:
        self.sync.save(next(self.steps), self.state, {}, {})
        self.phases.update(self.sync.last_timings)

    def hpcnet_through_h5py(self) -> None:
        self.through_h5py.save(next(self.steps), self.state, {}, {})

    def hpcnet_load(self, into: dict[str, torch.Tensor] | None) -> None:
        loaded = self.sync.load(str(newest(self.sync.directory, "ckpt-*.h5")), into=into)
        self.load_phases = loaded.timings
        self.load_phases_all["hpcnet_load" if into is None else "hpcnet_load_into"].append(dict(loaded.timings))

    def h5py_collective(self) -> None:
        """The bytes of the N-writer line, in one file: each rank its slice of one dataset, collectively."""
        import h5py

        share = len(self.share)
        path = self.h5py_dir / "raw.h5"
        with h5py.File(path, "w", driver="mpio", comm=self.comm) as f:
            d = f.create_dataset("bytes", shape=(share * self.size,), dtype="u1", fill_time="never")
            for start in range(0, share, 64 << 20):
                end = min(start + (64 << 20), share)
                with d.collective:
                    d[self.rank * share + start:self.rank * share + end] = self.share[start:end]
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def hpcnet_async(self) -> None:
        from mpi4py import MPI

        self.background.save(next(self.steps), self.state, {}, {})
        self.blocking.append(self.comm.allreduce(self.background.last_timings["blocking_s"], op=MPI.MAX))
        self.background.wait()

    def torch_save(self) -> None:
        if self.rank == 0:
            with open(self.torch_dir / "state.pt", "wb") as handle:
                torch.save(self.state, handle)
                handle.flush()
                os.fsync(handle.fileno())

    def dcp_save(self) -> None:
        import torch.distributed.checkpoint as dcp

        target = self.dcp_dir / f"save{next(self.dcp_saves)}"
        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(target, sync_files=True), no_dist=self.size == 1)

    def dcp_load(self) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(self.dcp_target, storage_reader=dcp.FileSystemReader(newest(self.dcp_dir, "save*")),
                 no_dist=self.size == 1)

    def clean_slate(self, directory: Path, pattern: str, keep_newest: bool = True) -> Callable[[], None]:
        """Before a save, untimed: delete the method's older output and let the file system settle.

        The disk here is mounted with ``discard``: without this, deleting and
        truncating files hands the next method, whichever it is, the cost.
        """
        def before() -> None:
            if self.rank == 0:
                old = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime)
                for path in old[:-1] if keep_newest else old:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
                os.sync()
            self.comm.Barrier()
        return before

    def table(self) -> list[tuple[str, Callable[[], Any], Callable[[], Any] | None]]:
        """(name, what is timed, what runs untimed before it), in the order of the first round."""
        rank, clean = self.rank, self.clean_slate
        sync_dir, ckpts = self.sync.directory, "ckpt-*.h5"
        return [
            ("disk_n_writers", lambda: write_fsync(self.disk / f"part{rank}", memoryview(self.share)),
             clean(self.disk, "part*", keep_newest=False)),
            ("disk_1_writer", lambda: rank == 0 and write_fsync(self.disk / "whole", memoryview(self.whole)),
             clean(self.disk, "whole", keep_newest=False)),
            ("disk_n_readers", lambda: read_into(self.disk / f"part{rank}", memoryview(self.share_back)),
             lambda: drop_cache([self.disk / f"part{rank}"])),
            ("hpcnet_save", self.hpcnet_sync, clean(sync_dir, ckpts)),
            ("h5py_collective", self.h5py_collective, clean(self.h5py_dir, "raw.h5", keep_newest=False)),
            ("hpcnet_save_h5py", self.hpcnet_through_h5py, clean(self.through_h5py.directory, ckpts)),
            ("hpcnet_async_total", self.hpcnet_async, clean(self.background.directory, ckpts)),
            ("torch_save", self.torch_save, clean(self.torch_dir, "state.pt", keep_newest=False)),
            ("dcp_save", self.dcp_save, clean(self.dcp_dir, "save*")),
            ("hpcnet_load", lambda: self.hpcnet_load(None), lambda: drop_cache([newest(sync_dir, ckpts)])),
            ("hpcnet_load_into", lambda: self.hpcnet_load(self.hpcnet_target),
             lambda: drop_cache([newest(sync_dir, ckpts)])),
            ("torch_load", lambda: torch.load(self.torch_dir / "state.pt", weights_only=True),
             lambda: drop_cache([self.torch_dir])),
            ("dcp_load", self.dcp_load, lambda: drop_cache([newest(self.dcp_dir, "save*")])),
        ]

    def close(self) -> None:
        self.sync.close()
        self.through_h5py.close()
        self.background.close()
        if self.plane is not None:
            self.plane.close()


def newest(directory: Path, pattern: str) -> Path:
    return max(directory.glob(pattern), key=lambda p: p.stat().st_mtime)


def run(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Collective: every measurement, in rotating rounds; returns the results (equal on all ranks)."""
    state = make_state(int(args.size_mb * 1e6))
    results: dict[str, Any] = {"world_size": comm.Get_size(), "state_bytes": state_bytes(state),
                               "tensors": len(state), "rounds": args.repeat}
    bench = _Methods(comm, args, state)
    results["hpcnet_async_mode"] = ("background thread" if bench.background.async_save
                                    else "synchronous (no THREAD_MULTIPLE)")
    methods = bench.table()
    times: dict[str, list[float]] = {name: [] for name, _, _ in methods}
    try:
        for round_ in range(args.repeat):  # the first round saves before it loads
            shift = round_ % len(methods)
            for name, fn, before in methods[shift:] + methods[:shift]:
                times[name].append(timed(comm, fn, before))
        assert all(torch.equal(bench.dcp_target[k], state[k]) for k in state)
    finally:
        bench.close()
        comm.Barrier()
        if comm.Get_rank() == 0 and not args.keep:
            shutil.rmtree(bench.base, ignore_errors=True)
    for name, values in times.items():
        results[f"{name}_s"] = min(values)
        results[f"{name}_all_s"] = values
    results["hpcnet_async_blocking_s"] = min(bench.blocking)
    results["hpcnet_save_phases"] = {k: v for k, v in bench.phases.items() if k.endswith("_s")}
    results["hpcnet_load_phases"] = dict(bench.load_phases)
    for name, rounds in bench.load_phases_all.items():  # rank 0's, round by round: where a load's time goes
        results[f"{name}_phases_all"] = comm.bcast(rounds, root=0)
    return results


def paired(results: dict[str, Any], ours: str, peer: str) -> tuple[float, float, float]:
    """``peer``'s time over ``ours`` round by round: the median, lowest and highest (above 1: hpcnet is faster)."""
    ratios = sorted(p / o for p, o in zip(results[f"{peer}_all_s"], results[f"{ours}_all_s"]))
    mid = len(ratios) // 2
    median = ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2
    return median, ratios[0], ratios[-1]


PAIRS = [("hpcnet_save", "disk_n_writers", "disk N writers"), ("hpcnet_save", "dcp_save", "DCP save"),
         ("hpcnet_load_into", "disk_n_readers", "disk N readers"), ("hpcnet_load_into", "dcp_load", "DCP load"),
         ("hpcnet_load", "dcp_load", "DCP load")]
"""The ratios of issue 12's targets, also given round by round: (hpcnet's line, its peer's, the peer's name)."""


def report(results: dict[str, Any]) -> str:
    """The table: rates in GB/s (1e9 bytes), and hpcnet against the disk, raw h5py and DCP."""
    nbytes = results["state_bytes"]
    disk_s, h5py_s, dcp_s = results["disk_n_writers_s"], results["h5py_collective_s"], results["dcp_save_s"]
    read_s = results["disk_n_readers_s"]

    def save_note(seconds: float) -> str:
        return f"{disk_s / seconds:.2f}x disk N, {h5py_s / seconds:.2f}x h5py, {dcp_s / seconds:.2f}x DCP"

    def load_note(seconds: float) -> str:
        return f"{read_s / seconds:.2f}x disk N read, {results['dcp_load_s'] / seconds:.2f}x DCP"

    rows = [
        ("disk, fsync'd, N writers", disk_s, ""),
        ("disk, fsync'd, 1 writer", results["disk_1_writer_s"], ""),
        ("h5py collective write, fsync'd", h5py_s, f"{disk_s / h5py_s:.2f}x disk N"),
        ("hpcnet save (sync, full)", results["hpcnet_save_s"], save_note(results["hpcnet_save_s"])),
        ("  the same, h5py collective writes", results["hpcnet_save_h5py_s"], save_note(results["hpcnet_save_h5py_s"])),
        ("hpcnet save (async): blocking", results["hpcnet_async_blocking_s"], "time save() blocks"),
        ("hpcnet save (async): until written", results["hpcnet_async_total_s"], "save() + wait()"),
        ("torch.save on rank 0", results["torch_save_s"], ""),
        ("torch.distributed.checkpoint save", dcp_s, ""),
        ("disk, N readers (page cache dropped)", read_s, "each rank its share"),
        ("hpcnet load (every rank, new tensors)", results["hpcnet_load_s"], load_note(results["hpcnet_load_s"])),
        ("hpcnet load (in place, as DCP)", results["hpcnet_load_into_s"], load_note(results["hpcnet_load_into_s"])),
        ("torch.load on every rank", results["torch_load_s"], ""),
        ("torch.distributed.checkpoint load", results["dcp_load_s"], "in place"),
    ]
    lines = [f"checkpoint benchmark: {nbytes / 1e6:.0f} MB state, {results['tensors']} tensors, "
             f"{results['world_size']} rank(s), best of {results['rounds']} rounds",
             f"{'':<40} {'seconds':>8} {'GB/s':>7}  note"]
    for name, seconds, note in rows:
        lines.append(f"{name:<40} {seconds:>8.3f} {nbytes / seconds / 1e9:>7.3f}  {note}")
    lines.append("hpcnet against its peers round by round (peer's time / hpcnet's; median, range):")
    for ours, peer, name in PAIRS:
        median, low, high = paired(results, ours, peer)
        lines.append(f"  {ours:<17} x {name:<15} {median:.2f} ({low:.2f}-{high:.2f})")
    for what in ("save", "load"):
        phases = results.get(f"hpcnet_{what}_phases", {})
        lines.append(f"hpcnet {what} phases (last run, rank 0): " + ", ".join(
            f"{k} {v:.3f}" for k, v in phases.items() if k.endswith("_s")))
    rounds = results.get("hpcnet_load_into_phases_all", [])
    if rounds:
        lines.append("hpcnet load in place, phases round by round (rank 0): " + "; ".join(
            ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in phases.items()
                      if k in ("open_assign_s", "read_verify_s", "wait_s", "exchange_s")) for phases in rounds))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m hpcnet.bench checkpoint``; the only place that uses COMM_WORLD."""
    from mpi4py import MPI

    from hpcnet.world import cpu_threads, discover

    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench checkpoint", description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=512.0, help="state size in MB (default 512)")
    parser.add_argument("--dir", default="bench-checkpoint", help="scratch directory on the file system to test")
    parser.add_argument("--repeat", type=int, default=5,
                        help="rounds (each runs every method once); the best counts, and the ratios round by round")
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
