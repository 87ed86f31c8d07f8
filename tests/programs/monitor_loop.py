"""Monitor on a loop of small collectives: desync, or ranks that stop themselves.

monitor_loop.py desync|stop INTERVAL_S RUN_DIR [RANKS_TO_STOP]
"""
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcnet.config import MonitorConfig
from hpcnet.fault.monitor import Monitor
from hpcnet.world import discover

mode, interval, run_dir = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3])
comm = MPI.COMM_WORLD.Dup()
world = discover(comm)
monitor = Monitor(MonitorConfig(heartbeat_interval_s=interval), comm, world, run_dir).start()
buf = np.zeros(8)
for step in range(1, 10**6):
    op = "step_boundary"
    if mode == "desync" and step == 4 and world.rank == 1:
        op = "loss.allreduce"  # the same MPI call for another purpose: MPI matches it silently
    with monitor.collective(op):
        comm.Allreduce(MPI.IN_PLACE, buf)
    monitor.step(step)
    if mode == "stop" and step == 6 and world.rank in [int(r) for r in sys.argv[4].split(",")]:
        (run_dir / f"stopped.rank{world.rank}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.05)
