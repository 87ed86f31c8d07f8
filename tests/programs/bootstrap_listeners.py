"""Under mpirun: a gloo data plane; prints each rank's rendezvous (RESULT) and the listening sockets it opened
(OPENED)."""

import json

import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcnet.comm.bootstrap import init_data_plane
from hpcnet.world import discover
from tests.helpers.comm import listening_sockets

comm = MPI.COMM_WORLD
world = discover(comm)
before = listening_sockets()  # MPI's own listeners, which hpcnet does not open
plane = init_data_plane(comm, world, backend='gloo', device=torch.device('cpu'), timeout_s=60)
t = torch.ones(4) * (world.rank + 1)
dist.all_reduce(t)
opened = sorted({address for inode, (address, _) in listening_sockets().items() if inode not in before})
# Printed by rank 0 alone: lines of several ranks written at once could be interleaved by the launcher.
every = comm.gather((f'RESULT {world.rank} {world.num_nodes} {plane.address} {plane.interface} {t[0].item()}',
                     'OPENED ' + json.dumps([world.rank, opened])), root=0)
if every is not None:
    for result, listeners in every:
        print(result, flush=True)
        print(listeners, flush=True)
plane.close()
