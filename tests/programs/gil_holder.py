"""Under mpirun -np 2: on rank 0 a thread takes the GIL for good while the main thread waits in MPI_Barrier."""
import sys
import threading
import time

from mpi4py import MPI

from hpcnet.config import MonitorConfig
from hpcnet.fault.inject import block_holding_the_gil
from hpcnet.fault.monitor import Monitor
from hpcnet.world import discover

comm = MPI.COMM_WORLD.Dup()
monitor = Monitor(MonitorConfig(), comm, discover(comm), sys.argv[1]).start()
if comm.Get_rank() == 0:
    # Takes the GIL for good a second after the main thread entered the barrier.
    threading.Thread(target=lambda: (time.sleep(1.0), block_holding_the_gil()), name="stuck", daemon=True).start()
    print("holding", flush=True)
    comm.Barrier()  # never completes: rank 1 never comes; the main thread waits inside MPI
else:
    time.sleep(600)
