"""Training samples/s of hpcnet's data-parallel step against torch DistributedDataParallel, same run.

Launch:
    mpirun -np 2 python -m mpi4py -m hpcnet.bench train [--models mlp,resnet18] [--json out.json]

Both contenders train their own copy of the same model (same initial weights,
optimizer, gradient clipping) on the same synthetic batches, already in
memory, so no data loading is timed.  hpcnet runs ``DataParallel.step`` with
the default configuration (``auto`` backend: MPI on CPU, NCCL on GPU); DDP
runs with its defaults on the torch.distributed group (gloo on CPU, NCCL on
GPU).  After a warm-up, blocks of steps alternate between the contenders for
several rounds, so a load change on a shared machine hits both alike;
figures are medians over the rounds.  A third contender without any
communication (``local``) shows the compute floor.  A last, instrumented
block splits the step time and measures how much of hpcnet's communication
hides behind the backward pass.
"""

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hpcnet.bench.common import (describe_environment, environment, load_average, max_over_ranks, summarize, table,
                                 write_json)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A benchmark model: a built-in hpcnet model, its input and its per-rank batch."""

    model: str
    options: dict[str, Any]
    input_shape: tuple[int, ...]
    num_classes: int
    batch_size: int
    kind: str
    target: float
    """The issue's target for hpcnet samples/s over DDP's."""


# Sized so that a step takes roughly 100-300 ms on one core per rank.
SPECS: dict[str, ModelSpec] = {
    # ~29.4 M parameters (118 MB of gradients) for little arithmetic per sample.
    "mlp": ModelSpec("mlp", {"hidden": [4096, 4096]}, (3, 32, 32), 10, 32, "communication-heavy", 1.3),
    # ~11.2 M parameters (45 MB) and ~0.56 GFLOP per 32x32 sample forward.
    "resnet18": ModelSpec("resnet18", {}, (3, 32, 32), 10, 8, "compute-heavy", 1.0),
    "resnet_tiny": ModelSpec("resnet_tiny", {}, (3, 32, 32), 10, 32, "compute-heavy", 1.0),
}
DEFAULT_MODELS = "mlp,resnet18"


@dataclass
class Contender:
    """One way to train: ``step(inputs, targets)`` runs one full optimizer step."""

    name: str
    model: nn.Module
    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    close: Callable[[], None] = lambda: None
    profile: dict[str, list[float]] = field(default_factory=dict)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_contenders(spec: ModelSpec, comm: Any, world: Any, *, device: torch.device, local: bool,
                    seed: int) -> list[Contender]:
    """hpcnet, DDP and (optionally) the no-communication baseline on copies of one model (collective)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from hpcnet.config import DistConfig, OptimConfig
    from hpcnet.dataparallel import DataParallel
    from hpcnet.models import DatasetInfo, build_model
    from hpcnet.train import build_optimizer, compute_loss

    torch.manual_seed(seed)
    base = build_model(spec.model, DatasetInfo("image", spec.input_shape, spec.num_classes), spec.options).to(device)
    optim_cfg = OptimConfig()  # hpcnet's defaults for both (SGD with momentum, weight decay)
    clip = optim_cfg.grad_clip
    contenders = []

    model_h = copy.deepcopy(base)
    dp = DataParallel(model_h, comm, world, DistConfig(), device=device)
    opt_h = build_optimizer(model_h, optim_cfg)

    def hpcnet_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = dp.step([(x, y)], compute_loss)  # forward, backward, averaged gradients
        if clip > 0:
            nn.utils.clip_grad_norm_(model_h.parameters(), clip)
        opt_h.step()
        return loss

    contenders.append(Contender("hpcnet", model_h, hpcnet_step, dp.close))
    contenders[-1].dp = dp  # type: ignore[attr-defined]  # for the instrumented block

    model_d = copy.deepcopy(base)
    ddp = DistributedDataParallel(model_d, device_ids=[device] if device.type == "cuda" else None,
                                  process_group=dist.group.WORLD)
    opt_d = build_optimizer(model_d, optim_cfg)

    def ddp_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt_d.zero_grad(set_to_none=True)
        loss = compute_loss(ddp, x, y)
        loss.backward()  # DDP all-reduces its buckets during backward and waits at its end
        if clip > 0:
            nn.utils.clip_grad_norm_(model_d.parameters(), clip)
        opt_d.step()
        return loss.detach()

    contenders.append(Contender(f"ddp-{dist.get_backend()}", model_d, ddp_step))

    if local:
        model_l = copy.deepcopy(base)
        opt_l = build_optimizer(model_l, optim_cfg)

        def local_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt_l.zero_grad(set_to_none=True)
            loss = compute_loss(model_l, x, y)
            loss.backward()
            if clip > 0:
                nn.utils.clip_grad_norm_(model_l.parameters(), clip)
            opt_l.step()
            return loss.detach()

        contenders.append(Contender("local", model_l, local_step))
    return contenders


def synthetic_batches(spec: ModelSpec, batch_size: int, count: int, rank: int,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random batches, different on every rank, the same for every contender."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(batch_size, *spec.input_shape, generator=gen).to(device),
             torch.randint(0, spec.num_classes, (batch_size,), generator=gen).to(device)) for _ in range(count)]


def run_block(contender: Contender, batches: list[tuple[torch.Tensor, torch.Tensor]], first: int, steps: int,
              comm: Any, device: torch.device) -> float:
    """Seconds for ``steps`` steps, slowest rank (collective)."""
    comm.Barrier()
    t0 = time.perf_counter()
    loss = None
    for i in range(first, first + steps):
        loss = contender.step(*batches[i % len(batches)])
    if loss is not None:
        loss.item()  # the step is finished (GPU: its kernels too)
    _sync(device)
    return max_over_ranks(comm, time.perf_counter() - t0)


# -- the instrumented block ---------------------------------------------------------------------------


def profile_hpcnet(contender: Contender, batches: list, first: int, steps: int, comm: Any,
                   device: torch.device) -> dict[str, float]:
    """Per-step split of hpcnet's step and the overlap of its all-reduces with backward (medians, ms).

    Wraps ``Reducer.finish`` (the exposed wait) and, for the MPI transport,
    the worker's all-reduce call (when each bucket is on the wire) for the
    duration of the block only.
    """
    dp = contender.dp  # type: ignore[attr-defined]
    reducer = dp.reducer
    transport = reducer.transport
    spans: list[tuple[float, float, int]] = []  # per bucket: start, end, bytes (worker thread)
    marks: dict[str, float] = {}
    finish, inner = reducer.finish, getattr(transport, "_allreduce", None)

    def timed_finish() -> None:
        marks["finish_start"] = time.perf_counter()
        finish()
        marks["finish_end"] = time.perf_counter()

    def timed_allreduce(flat: torch.Tensor) -> None:
        t0 = time.perf_counter()
        inner(flat)
        spans.append((t0, time.perf_counter(), flat.numel() * flat.element_size()))

    reducer.finish = timed_finish
    if inner is not None:
        transport._allreduce = timed_allreduce
    rows: dict[str, list[float]] = {k: [] for k in ("step", "forward_backward", "exposed_comm", "optimizer",
                                                     "comm_busy", "comm_hidden", "first_launch")}
    try:
        comm.Barrier()
        for i in range(first, first + steps):
            spans.clear()
            _sync(device)
            t0 = time.perf_counter()
            contender.step(*batches[i % len(batches)]).item()
            _sync(device)
            t1 = time.perf_counter()
            rows["step"].append(t1 - t0)
            rows["forward_backward"].append(marks["finish_start"] - t0)
            rows["exposed_comm"].append(marks["finish_end"] - marks["finish_start"])
            rows["optimizer"].append(t1 - marks["finish_end"])
            if spans:
                rows["comm_busy"].append(sum(e - s for s, e, _ in spans))
                # Wire time that ended, or ran, before backward finished: hidden behind compute.
                rows["comm_hidden"].append(sum(max(0.0, min(e, marks["finish_start"]) - s) for s, e, _ in spans))
                rows["first_launch"].append(min(s for s, _, _ in spans) - t0)
    finally:
        del reducer.finish
        if inner is not None:
            del transport._allreduce
    out = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in rows.items() if v}
    out["buckets"] = len(reducer.buckets)
    out["bucket_mb"] = [round(b.buffer.numel() * b.buffer.element_size() / 2**20, 2) for b in reducer.buckets]
    return out


def profile_plain(contender: Contender, batches: list, first: int, steps: int, comm: Any,
                  device: torch.device, forward_backward: Callable) -> dict[str, float]:
    """Split of a DDP or local step: forward+backward (DDP: its exposed wait included) and optimizer (ms)."""
    rows: dict[str, list[float]] = {"step": [], "forward_backward": [], "optimizer": []}
    comm.Barrier()
    for i in range(first, first + steps):
        x, y = batches[i % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        loss = forward_backward(x, y)
        _sync(device)
        t1 = time.perf_counter()
        contender.finish_step()  # type: ignore[attr-defined]
        loss.item()
        _sync(device)
        t2 = time.perf_counter()
        rows["step"].append(t2 - t0)
        rows["forward_backward"].append(t1 - t0)
        rows["optimizer"].append(t2 - t1)
    return {f"{k}_ms": statistics.median(v) * 1e3 for k, v in rows.items()}
