"""Who owns what: every unit of ownership gets one owner rank from the cost model
(``hpcnet.comm.costmodel.assign_shards``).  ``dist.owners=uniform`` balances bytes over ranks taken as equally fast;
``auto`` also weighs each rank's measured speed (a timed matmul at start-up, the slowest rank's median, so ranks
of unequal speed own less) and the measured link.  Every rank computes the same owners from the same gathered
inputs."""

import statistics
import time
from typing import Any

import torch

from hpcnet.comm.costmodel import LinkCost, OwnerAssignment, assign_shards, measured_speeds

UPDATE_S_PER_BYTE = 1.0 / 2e9
"""Modelled optimizer update time per parameter byte on the fastest rank: an elementwise update reads and writes
a few tensors of the parameter's size at a few GB/s; only the ratio to the link cost matters to the assignment."""
SPEED_PROBE_ROUNDS = 5
DEFAULT_LINK = LinkCost(latency_s=10e-6, bandwidth_Bps=5e9)
"""The link the assignment assumes without a probe (dist.probe=false)."""


def measure_speed(rounds: int = SPEED_PROBE_ROUNDS, size: int = 192, device: torch.device | None = None) -> float:
    """Seconds for one ``size``-square float32 matmul on ``device`` (default this rank's CPU), median of
    ``rounds`` (milliseconds on a CPU; on a GPU each timed matmul is synchronised, so call it at a boundary)."""
    device = device or torch.device("cpu")
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, a)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def assign_owners(params: list[torch.Tensor], comm: Any, *, mode: str, link: LinkCost | None = None,
                  speeds: list[float] | None = None, device: torch.device | None = None
                  ) -> tuple[OwnerAssignment, list[float]]:
    """Owner ranks for the units ``params`` (a ``ShardLayout``'s tensors, or whole parameters) (collective when
    ``mode='auto'`` and ``speeds`` is None: gathers speeds).

    Returns the owners and the relative rank speeds they were chosen with (1.0 = the fastest).
    """
    size = comm.Get_size()
    if speeds is None:
        if mode == "auto" and size > 1:
            speeds = measured_speeds(comm.allgather(measure_speed(device=device)))
        else:
            speeds = [1.0] * size
    if len(speeds) != size:
        raise ValueError(f"speeds has {len(speeds)} entries for {size} ranks")
    sizes = [p.numel() * p.element_size() for p in params]
    assignment = assign_shards(sizes, speeds, compute_s_per_byte=UPDATE_S_PER_BYTE, link=link or DEFAULT_LINK)
    return assignment, speeds
