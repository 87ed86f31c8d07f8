"""A dataset for hpcnet.train (``data.dataset=slow_dataset:make_dataset``) that never loads on rank 1."""
import time

import torch
from mpi4py import MPI


def make_dataset(split, n=64):
    if split == "train" and MPI.COMM_WORLD.Get_rank() == 1:
        time.sleep(600)  # start-up never ends on this rank, while its monitor beats
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 8, 8, generator=g), y)
