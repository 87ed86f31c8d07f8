"""Under mpirun: a gloo data plane; prints each rank's rendezvous (RESULT) and the listening sockets it opened (OPENED)."""

import json

import torch
import torch.distributed as dist
from mpi4py import MPI

from hpcnet.comm.bootstrap import init_data_plane
from hpcnet.comm.world import discover
from tests.helpers import listening_sockets

comm = MPI.COMM_WORLD
world = discover(comm)
before = listening_sockets()  # MPI's own listeners, which hpcnet does not open
plane = init_data_plane(comm, world, backend='gloo', device=torch.device('cpu'), timeout_s=60)
t = torch.ones(4) * (world.rank + 1)
dist.all_reduce(t)
opened = sorted({address for inode, (address, _) in listening_sockets().items() if inode not in before})
print(f'RESULT {world.rank} {world.num_nodes} {plane.address} {plane.interface} {t[0].item()}', flush=True)
print('OPENED ' + json.dumps([world.rank, opened]), flush=True)
plane.close()
