"""Rank 1 starts an all-reduce in the worker thread that rank 0 never joins, gives up, and exits."""

import sys

import torch
from mpi4py import MPI

from hpcnet.comm.transport import CommFailure, MpiTransport

comm = MPI.COMM_WORLD
transport = MpiTransport(comm, progress="thread")
if comm.Get_rank() == 1:
    try:
        transport.start(torch.ones(1000)).wait(1.0)
    except CommFailure as exc:
        print(f"rank 1 gave up: {exc}", flush=True)
    else:
        sys.exit("rank 1: an all-reduce without rank 0 finished")
transport.close()
print(f"rank {comm.Get_rank()} exiting", flush=True)
