"""Each rank's peak predicted for each ``dist.zero`` stage and activation checkpointing choice, from the model's
parameters, the optimizer, the batch and one measured step (``hpcnet.plan.measure``); the fastest choice under a cap.

A rank's memory in a step is what it keeps (parameters; the gradient buckets, or at stage 2 its share of the sums;
the optimizer state, or from stage 1 on the state of the units it owns, as measured parameter by parameter for the
optimizer the run chose) plus what the step itself holds for a while (activations, the backward's temporaries,
gradients on their way to a bucket; the optimizer's temporaries). The planner measures the second part once, on the
plain model at one rank's batch, with and without the blocks checkpointed (``measure_step``), and adds the first
part for each stage from the parameter sizes and the shares the uniform owner plan gives (``hpcnet.comm.sharding``):
units cut into row ranges for an elementwise optimizer, whole parameters for any other (Muon, Adafactor), so a large
matrix weighs on its one owner. The peak is the larger of the backward's and the optimizer step's. At stage 2 the
share of each gradient a rank keeps appears as the backward hands the gradients over, so its backward peak is the
most, over the measured backward, of what is alive plus the share of what was handed over so far
(``StepMemory.backward_with_kept``), and two buckets besides (one being filled, one in the transport). Stage 3 keeps
only its share of the parameters too, and holds whole, during the backward, the root's parameters (those outside the
blocks) and some blocks' (``STAGE3_BLOCKS_GATHERED``), each block taken as the blocks' mean; without blocks, all of
them (``hpcnet.comm.sharding.params``).

The step time of each choice comes from the same measurement and the link model (``hpcnet.comm.costmodel``):
the measured forward and backward (with the blocks' recomputation where they are checkpointed), and the
collectives (an all-reduce of the gradients; from stage 1 on the parameters' all-gather besides; at stage 3 twice,
for the forward and again for the backward).  ``choose`` takes the
fastest choice whose peak fits the cap, and when none does, says what would: more ranks, a smaller batch.
"""

from dataclasses import dataclass, replace
from typing import Any

import torch

from hpcnet.comm.buckets import AUTO_FALLBACK_MB
from hpcnet.comm.costmodel import LinkCost, assign_shards, bucket_share, stage2_bucket_cap
from hpcnet.comm.sharding.assign import DEFAULT_LINK, UPDATE_S_PER_BYTE
from hpcnet.comm.sharding.layout import split_units
from hpcnet.errors import UsageError
from hpcnet.plan.measure import ModelMemory, StepMemory

STAGES = (0, 1, 2, 3)
STAGE3_BLOCKS_GATHERED = 1
"""Blocks whose parameters the planner counts whole beside the root at stage 3's backward peak.  Two are held once
the blocks' backward runs (the one in use and the one prefetched), none at the backward's start, where the
activations are most (only the root is held while the loss and output layer run backward); the measured step does
not tell where each block starts, so the planner takes one: counting two over-predicted stage 3 by up to 14% on the
ladder, one by at most 7% (benchmarks/2026-12-07-memory-planner-zero3.md)."""
ADDRESS_SPACE_BYTES = 2**64
"""The most memory a rank can address: ``cap_in_bytes`` takes a larger cap as this."""
STAGE2_BUCKETS_ALIVE = 2
"""Buckets a rank holds at once at stage 2 during backward: the one being filled and the one being summed (Open
MPI's reduce-scatter keeps a scratch copy of about its size)."""


@dataclass(frozen=True)
class Prediction:
    """One choice and what the planner predicts of it, bytes per rank (the largest rank's) and seconds."""

    stage: int
    checkpointing: str
    """'off', 'blocks' (all of them) or 'k of n blocks' (the first k)."""
    blocks: int
    """How many of the first blocks are checkpointed."""
    ranks: int
    batch: int
    params: int
    grads: int
    optimizer: int
    transient: int
    peak: int
    phase: str
    """Where the peak is: 'backward' or 'optimizer'."""
    step_s: float

    def describe(self) -> str:
        return (f"dist.zero={self.stage}, activation checkpointing {self.checkpointing}: peak "
                f"{self.peak / 1e9:.3f} GB ({self.phase}: parameters {self.params / 1e9:.3f}, gradients "
                f"{self.grads / 1e9:.3f}, optimizer {self.optimizer / 1e9:.3f}, step {self.transient / 1e9:.3f}), "
                f"step {self.step_s * 1e3:.1f} ms")

    def to_json(self) -> dict[str, Any]:
        return {"stage": self.stage, "activation_checkpointing": self.checkpointing, "blocks": self.blocks,
                "ranks": self.ranks,
                "batch": self.batch, "peak_bytes": self.peak, "phase": self.phase, "params_bytes": self.params,
                "grads_bytes": self.grads, "optimizer_bytes": self.optimizer, "step_bytes": self.transient,
                "step_s": self.step_s}


def configured_bucket_bytes(dist: Any) -> int:
    """The bucket size ``dist.bucket_mb`` asks for; 'auto' as without a probed link (``comm.buckets.bucket_bytes``:
    the planner runs before the probe's figures reach the reducer)."""
    mb = AUTO_FALLBACK_MB if dist.bucket_mb == "auto" else float(dist.bucket_mb)
    return int(mb * 2**20)


def largest_share(memory: ModelMemory, ranks: int) -> int:
    """The most parameter bytes one rank owns under the uniform owner plan at ``ranks`` ranks (``owned``)."""
    return max(owned(memory, ranks, memory.sizes)) if ranks > 1 else memory.param_bytes


def owned(memory: ModelMemory, ranks: int, per_param: list[int] | tuple[int, ...]) -> list[int]:
    """Each rank's sum of ``per_param`` (bytes of each parameter, or of its optimizer state) over the units it
    owns under the uniform owner plan at ``ranks`` ranks: units as ``dist.zero`` makes them for the optimizer
    (``memory.elementwise``: cut into row ranges, a range taking its rows' part; else whole parameters)."""
    params = [torch.empty(shape, device="meta") for shape in memory.shapes]
    units = split_units(params, ranks, cut=memory.elementwise)
    unit_bytes = [(u.hi - u.lo) * (memory.sizes[u.param] // max(1, u.rows)) for u in units]
    plan = assign_shards(unit_bytes, [1.0] * ranks, compute_s_per_byte=UPDATE_S_PER_BYTE, link=DEFAULT_LINK)
    out = [0] * ranks
    for u, owner in zip(units, plan.owner):
        out[owner] += per_param[u.param] * (u.hi - u.lo) // max(1, u.rows)
    return out


def state_sizes(step: StepMemory, memory: ModelMemory) -> tuple[int, ...]:
    """The optimizer's state bytes of each parameter as measured; in proportion to the parameters' bytes where
    the measurement has none by parameter."""
    if step.state_sizes:
        return step.state_sizes
    P = memory.param_bytes
    return tuple(step.state_bytes * size // P if P else 0 for size in memory.sizes)


def gathered_bytes(memory: ModelMemory) -> int:
    """Parameter bytes a rank holds whole at stage 3's peak: the root's and ``STAGE3_BLOCKS_GATHERED`` blocks'
    (the blocks' mean size); without blocks, every parameter."""
    P = memory.param_bytes
    if memory.n_blocks == 0:
        return P
    inside = memory.block_share * P
    return int(P - inside + min(memory.n_blocks, STAGE3_BLOCKS_GATHERED) * inside / memory.n_blocks)


def predict(memory: ModelMemory, *, ranks: int, stage: int, checkpointing: "str | int", batch: int | None = None,
            bucket_bytes: int = 25 * 2**20, link: LinkCost | None = None) -> Prediction:
    """Each rank's peak and the step time of one choice (see the module's doc); ``checkpointing`` is 'off',
    'blocks' or how many of the first blocks are checkpointed (their saving taken in proportion between the two
    measured steps: each checkpointed block drops its own activations); ``batch`` other than the measured one
    scales the step's transient memory in proportion (activations grow with the batch)."""
    k = memory.blocks_of(checkpointing)
    step = memory.steps["off" if k == 0 else "blocks"]
    batch = batch or step.batch
    scale = batch / step.batch
    P = memory.param_bytes
    share = largest_share(memory, ranks) if stage and ranks > 1 else P
    # The owner with the most state (an upper bound where another owns the most parameters).
    optimizer = max(owned(memory, ranks, state_sizes(step, memory))) if stage and ranks > 1 else step.state_bytes
    transient_o = int(_measured(memory, k, lambda m: m.optimizer))
    if stage < 2 or ranks == 1:
        grads = P  # the buckets live from step to step
        transient_b = int(_measured(memory, k, lambda m: m.backward) * scale)
        held = P + (gathered_bytes(memory) if stage == 3 else 0)  # one rank: every unit, and the groups in use
        backward = held + grads + optimizer + transient_b
        after = P + grads + optimizer + transient_o
    else:
        bucket = min(bucket_bytes, stage2_bucket_cap(P, ranks, share=bucket_share(stage)))
        kept = _measured(memory, k, lambda m: m.backward_with_kept(share / P))
        transient_b = int(kept * scale) + STAGE2_BUCKETS_ALIVE * bucket
        grads = share
        held = P if stage == 2 else share + gathered_bytes(memory)
        backward = held + optimizer + transient_b
        after = (P if stage == 2 else share) + share + optimizer + transient_o
    phase = "backward" if backward >= after else "optimizer"
    # Measured with the blocks checkpointed where they are; recomputing never makes a step faster (timing noise).
    compute = max(_measured(memory, k, lambda m: m.forward_backward_s),
                  memory.steps["off"].forward_backward_s if "off" in memory.steps else 0.0) * scale
    link = link or DEFAULT_LINK
    comm = link.all_reduce_s(P, ranks) if ranks > 1 else 0.0
    if stage and ranks > 1:
        comm += link.all_gather_s(P, ranks) * (2 if stage == 3 else 1)
    return Prediction(stage=stage, checkpointing=memory.label(k), blocks=k, ranks=ranks, batch=batch,
                      params=held if phase == "backward" else P if stage < 3 else share,
                      grads=grads, optimizer=optimizer, transient=transient_b if phase == "backward" else transient_o,
                      peak=max(backward, after), phase=phase, step_s=compute + comm)


def _measured(memory: ModelMemory, k: int, quantity: Any) -> float:
    """``quantity`` of the step with ``k`` blocks checkpointed: measured for none and for all, in proportion
    between (each checkpointed block drops its own activations)."""
    if k == 0 or "blocks" not in memory.steps:
        return quantity(memory.steps["off"])
    if k == memory.n_blocks or "off" not in memory.steps:
        return quantity(memory.steps["blocks"])
    a, b = quantity(memory.steps["off"]), quantity(memory.steps["blocks"])
    return a + k / memory.n_blocks * (b - a)


def predictions(memory: ModelMemory, *, ranks: int, checkpointing: str = "each", **kwargs: Any) -> list[Prediction]:
    """Every stage with each checkpointing choice, fastest first: ``checkpointing`` 'each' (off and all blocks,
    as measured), 'auto' (every number of blocks), 'off' or 'blocks' (that one)."""
    if checkpointing == "each":
        ks = sorted({memory.blocks_of(c) for c in memory.steps})
    elif checkpointing == "auto":
        ks = list(range(memory.n_blocks + 1)) if "blocks" in memory.steps else [0]
    else:
        ks = [memory.blocks_of(checkpointing)] if checkpointing == "off" or "blocks" in memory.steps else []
        if not ks:
            raise UsageError("train.activation_checkpointing=blocks: the model has no blocks (model.blocks)")
    out = [predict(memory, ranks=ranks, stage=s, checkpointing=k, **kwargs) for k in ks for s in STAGES]
    return sorted(out, key=lambda p: (p.step_s, p.checkpointing != "off", p.peak))


def cap_in_bytes(cap_gb: float) -> int:
    """A cap of ``cap_gb`` GB (1e9 bytes) in bytes.  Past a 64-bit address space it is that space: every choice
    fits it as it fits any cap above its peak, where ``int(cap_gb * 1e9)`` would overflow (above about 1.8e299)."""
    return int(min(cap_gb * 1e9, ADDRESS_SPACE_BYTES))


def choose(memory: ModelMemory, *, ranks: int, cap_bytes: int, option: str = "dist.memory_cap_gb",
           checkpointing: str = "each", **kwargs: Any) -> Prediction:
    """The fastest choice whose predicted peak is at most ``cap_bytes``, checkpointing as ``predictions`` takes it.

    Raises:
        UsageError: naming ``option`` and what would fit (more ranks, a smaller batch, an elementwise optimizer)
            when nothing does.
    """
    every = predictions(memory, ranks=ranks, checkpointing=checkpointing, **kwargs)
    fitting = [p for p in every if p.peak <= cap_bytes]
    if fitting:
        return fitting[0]
    least = min(every, key=lambda p: p.peak)
    hints = []
    more = _ranks_that_fit(memory, least, cap_bytes, ranks, **kwargs)
    if more:
        hints.append(f"{more} ranks at dist.zero={least.stage}")
    smaller = _batch_that_fits(memory, least, cap_bytes, **kwargs)
    if smaller:
        hints.append(f"train.batch_size={smaller} at dist.zero={least.stage}")
    hints += _cut_that_fits(memory, least, cap_bytes, **kwargs)
    raise UsageError(
        f"{option}={cap_bytes / 1e9:g}: no choice fits at {ranks} ranks; the least is "
        f"{least.describe()}" + ("; would fit: " + " or ".join(hints) if hints else
                                   "; neither more ranks nor a smaller batch fits: more memory per rank is needed"))


def _cut_that_fits(memory: ModelMemory, least: Prediction, cap: int, **kwargs: Any) -> list[str]:
    """For an optimizer that is not elementwise, whose owners keep whole parameters: the hint that an elementwise
    one would fit, its large parameters cut into row ranges over the owners (``hpcnet.comm.sharding.layout``)."""
    if memory.elementwise or least.stage == 0:
        return []
    cut = replace(memory, elementwise=True)
    if predict(cut, ranks=least.ranks, stage=least.stage, checkpointing=least.blocks, **kwargs).peak > cap:
        return []
    return [f"an elementwise optimizer at dist.zero={least.stage} (optim.name=adamw, ...; or optim.elementwise=true "
            f"for a factory's that is): this one is stepped a whole parameter at a time, so each parameter's owner "
            f"keeps all of it and its state (the largest {max(memory.sizes) / 1e6:.1f} MB), where an elementwise one "
            f"spreads its rows over the ranks"]


def _ranks_that_fit(memory: ModelMemory, least: Prediction, cap: int, ranks: int, **kwargs: Any) -> int | None:
    n = ranks
    while n < 4096:
        n *= 2
        if predict(memory, ranks=n, stage=least.stage, checkpointing=least.blocks, **kwargs).peak <= cap:
            return n
    return None


def _batch_that_fits(memory: ModelMemory, least: Prediction, cap: int, **kwargs: Any) -> int | None:
    kwargs.pop("batch", None)
    for batch in range(least.batch - 1, 0, -1):
        if predict(memory, ranks=least.ranks, stage=least.stage, checkpointing=least.blocks, batch=batch,
                   **kwargs).peak <= cap:
            return batch
    return None
