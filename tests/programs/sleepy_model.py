"""A dataset and a model for hpcnet.train (``data.dataset=sleepy_model:make_dataset``): rank 1's model falls asleep."""
import time

import torch
from mpi4py import MPI


def make_dataset(split, n=256):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    y = torch.randint(0, 4, (n,), generator=g)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 8, 8, generator=g) + y.view(-1, 1, 1, 1), y)


class Sleepy(torch.nn.Linear):
    """Rank 1 falls asleep in its forward at step 6: the others wait for it in the all-reduce."""

    calls = 0

    def forward(self, x):
        Sleepy.calls += self.training  # training forwards only: not the objective's start-up check (eval mode)
        if self.training and Sleepy.calls == 6 and MPI.COMM_WORLD.Get_rank() == 1:
            time.sleep(120)
        return super().forward(x.flatten(1))


def make_sleepy(info):
    return Sleepy(64, info.num_classes)
