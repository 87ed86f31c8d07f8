"""Steps/s with and without the failure monitor, in alternating blocks of one process.

    mpirun -np 2 python -m mpi4py scripts/monitor_overhead.py [--blocks 8] [--block-s 5] [--interval-s 2]

Each block runs the data-parallel step (forward, backward, bucketed MPI
all-reduce, optimizer, step-boundary all-reduce) for about ``--block-s``
seconds, alternately with the monitor (thread, heartbeats, flight recorder,
memory watch) and without, in ABBA order; alternating in one process cancels
most of the drift of a shared machine's load.  Prints steps/s per block, the median of each, and
the median of the per-pair ratios.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from hpcnet.comm.dataparallel import DataParallel
from hpcnet.comm.route import agree_route
from hpcnet.config import DistConfig, MonitorConfig
from hpcnet.fault.flightrec import NULL_RECORDER
from hpcnet.fault.monitor import Monitor
from hpcnet.world import cpu_threads, discover


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=8, help="blocks of each kind")
    parser.add_argument("--block-s", type=float, default=5.0)
    parser.add_argument("--interval-s", type=float, default=2.0, help="monitor.heartbeat_interval_s")
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    torch.set_num_threads(cpu_threads(world))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 10))
    dist_cfg = DistConfig(backend="mpi", probe=False, fallback="none")
    dp = DataParallel(model, comm, world, dist_cfg, device=torch.device("cpu"),
                      route=agree_route(comm, world, dist_cfg, device_type="cpu"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = [(torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)))]
    flags = np.zeros(2, dtype=np.int64)
    run_dir = Path(comm.bcast(tempfile.mkdtemp(prefix="hpcnet-overhead-") if world.rank == 0 else None))

    def block(monitor: Monitor | None, steps: int) -> float:
        recorder = monitor.recorder if monitor else NULL_RECORDER
        dp.reducer.recorder = recorder
        comm.Barrier()
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            dp.step(batch, lambda m, x, y: F.cross_entropy(m(x), y))
            optimizer.step()
            if monitor:
                monitor.step(step)
            with recorder.op("step_boundary"):
                comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        comm.Barrier()
        return steps / (time.perf_counter() - t0)

    block(None, 20)  # warm-up
    rate = block(None, 50)
    steps = comm.bcast(max(20, int(rate * args.block_s)) if world.rank == 0 else None)
    cfg = MonitorConfig(heartbeat_interval_s=args.interval_s)
    on, off = [], []
    for i in range(args.blocks):
        for with_monitor in ((True, False) if i % 2 == 0 else (False, True)):  # ABBA: cancels a drift
            if with_monitor:
                monitor = Monitor(cfg, comm, world, run_dir).start()
                on.append(block(monitor, steps))
                monitor.stop()
            else:
                off.append(block(None, steps))
    if world.rank == 0:
        ratios = [a / b for a, b in zip(on, off)]
        print(f"{world.size} ranks, {steps} steps per block, heartbeat interval {args.interval_s} s")
        print("with monitor    steps/s: " + " ".join(f"{r:.1f}" for r in on))
        print("without monitor steps/s: " + " ".join(f"{r:.1f}" for r in off))
        print(f"median with {statistics.median(on):.2f}, without {statistics.median(off):.2f}; "
              f"median ratio with/without {statistics.median(ratios):.4f} "
              f"(overhead {100 * (1 - statistics.median(ratios)):+.2f}%)")


if __name__ == "__main__":
    main()
