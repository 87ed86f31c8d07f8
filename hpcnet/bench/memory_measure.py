"""bench memory's measurement: each contender's memory above what the rank held before it was built, then its
step time in rounds of rotated order (``measure``), and ratios of step times paired round by round."""

import argparse
import contextlib
import ctypes
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from torch import nn

from hpcnet.bench.common import summarize
from hpcnet.bench.memory_contenders import Contender, _build, _hpcnet_tensors
from hpcnet.plan.measure import reset_peak as _reset_peak
from hpcnet.plan.measure import settled_kib as _settle
from hpcnet.plan.measure import status_kib as _status_kib


def paired_ratios(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Median and range of the round-by-round ratios of two contenders' per-round step times."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} rounds against {len(denominator)}")
    return summarize([a / b for a, b in zip(numerator, denominator)])


def rotated(names: tuple[str, ...], round_index: int) -> list[str]:
    """Round ``round_index``'s order: every name runs in every position once over ``len(names)`` rounds."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


M_MMAP_THRESHOLD = -3


def _fixed_mmap_threshold() -> None:
    """Every allocation of 128 KiB or more gets its own mapping, returned to the OS when freed: glibc otherwise
    raises the threshold after a large block is freed, later tensors come from its heap, and resident memory
    then keeps what earlier contenders freed (seen here: stage 1 'holding' as much as stage 0)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)



def measure(names: list[str], make_model: Callable[[], nn.Module], batches: list, comm: Any, world: Any,
            args: argparse.Namespace, *, steps: int, rounds: int, round_steps: int
            ) -> tuple[dict[str, Any], dict[str, list[float]], np.ndarray, dict[str, Contender]]:
    """Memory, then step time in rotated rounds, of the contenders ``names``, each training ``make_model()``
    (collective; see the module's doc).

    Returns:
        rank 0's memory figures and per-round medians (empty elsewhere), the slowest rank's step times
        [contender, round, step], and the contenders, alive (the caller closes them).
    """
    from mpi4py import MPI

    memory: dict[str, Any] = {}
    alive: dict[str, Contender] = {}
    for name in names:
        before = _settle()
        comm.Barrier()
        _reset_peak()
        contender = _build(name, make_model(), comm, world, args.optim)
        for _ in range(steps):
            contender.step(batches)
        gc.collect()
        held, peak = _status_kib("VmRSS") - before, _status_kib("VmHWM") - before
        counted = (_hpcnet_tensors(contender.model, contender.dp, contender.optimizer)
                   if contender.dp is not None else None)
        every = comm.gather((held, peak, counted), root=0)
        if world.rank == 0:
            memory[name] = {"held_mib": [h / 1024 for h, _, _ in every], "peak_mib": [p / 1024 for _, p, _ in every],
                            "tensors_mib": [{k: v / 2**20 for k, v in c.items()} if c else None
                                            for _, _, c in every]}
        alive[name] = contender  # idle from here until the timed rounds: its memory does not change
        comm.Barrier()
    # Timed rounds: every contender has taken its steps already (its warm-up).
    local = np.zeros((len(names), rounds, round_steps))
    for r in range(rounds):
        for name in rotated(tuple(names), r):
            for s in range(round_steps):
                comm.Barrier()
                t0 = time.perf_counter()
                alive[name].step(batches)
                local[names.index(name), r, s] = time.perf_counter() - t0
    slowest = np.empty_like(local)
    comm.Allreduce(local, slowest, op=MPI.MAX)
    per_round = ({name: [float(statistics.median(slowest[i, r])) for r in range(rounds)]
                  for i, name in enumerate(names)} if world.rank == 0 else {})
    return memory, per_round, slowest, alive

