"""Memory per rank, step time and capacity of hpcnet's dist.zero=0/1/2/3 against DDP, DDP+ZeroRedundancyOptimizer
and FSDP2, with and without activation checkpointing.

Launch:
    mpirun -np 4 python -m mpi4py -m hpcnet.bench memory [--models transformer] [--cap-gb 0.5] [--json out.json]

The contenders are the entries of ``CONTENDERS``. Those
marked ``+ac`` recompute each block's activations in backward with ``hpcnet.models.blocks.checkpoint_blocks``
(non-reentrant ``torch.utils.checkpoint``), applied to the model before DDP, ``fully_shard`` or hpcnet wrap it,
so every contender checkpoints the same way. Every contender trains its own copy of one model (same weights,
same AdamW or SGD settings, same synthetic batches, gradient clipping at norm 1) in the same processes:

- **Memory**: the contenders are built one after the other and each runs ``--steps`` steps while the ones built
  before it sit idle. Every rank measures its resident memory (``/proc/self/status``) above what it held
  before the contender was built: ``held`` after the steps (parameters, gradients, optimizer state,
  communication buffers) and ``peak`` during them (the high-water mark, reset with ``/proc/self/clear_refs``;
  it adds activations and transient buffers). For hpcnet the tensors are counted as well (exact, where
  resident memory is approximate).
- **Step time**: then ``--rounds`` rounds, each contender ``--round-steps`` steps a round, the order rotated
  every round so none always runs first or after the same neighbour (this machine is shared and noisy). A
  step is timed from a barrier to its end on every rank; the slowest rank's time counts. Ratios to DDP, FSDP2
  and hpcnet ``dist.zero=0`` are taken round by round (the same minute of load on both sides), then their
  median and range.
- **Weights**: after the steps every contender's full weights (FSDP2's gathered) are compared with hpcnet
  ``dist.zero=0``'s, and each checkpointing contender's with its twin's without.
- **Capacity** (``--cap-gb``): the largest transformer of a ladder (rung k: width 64k, k blocks, k heads) that
  each of ``--cap-contenders`` trains with every rank's peak under the cap, where the peak is measured as
  above (what training adds to the process, the analogue of ``max_memory_allocated`` on a GPU). The same
  search for all: a first rung (from the bytes per parameter measured on the table's transformer, or, for a
  checkpointing contender, the rung above its twin's answer), one rung at a time to the largest that fits,
  then that width with more blocks. Every answer is bracketed by measured sizes (the largest that fit, the
  next that did not).
- **On FSDP2's largest model**: memory and step time of ``--cap-time`` as above (``--cap-rounds`` rotated
  rounds, ratios to FSDP2 round by round) on the largest size FSDP2 fitted, without the cap.
"""

import argparse
import contextlib
import copy
import ctypes
import gc
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.bench.common import describe_environment, environment, load_average, summarize, table, write_json
from hpcnet.plan.measure import reset_peak as _reset_peak
from hpcnet.plan.measure import settled_kib as _settle
from hpcnet.plan.measure import status_kib as _status_kib

MODELS = {
    # GPT-style, 8 blocks of width 512, vocabulary 8192 (tied): 29.4 M parameters (112 MiB), in 100 tensors.
    "transformer": ("transformer", {"d_model": 512, "n_layers": 8, "n_heads": 8}, "tokens", (64,), 8192, 4),
    # 29.4 M parameters in 6 tensors, two of them 43% and 57% of the bytes: whole tensors cannot be balanced.
    "mlp-4096": ("mlp", {"hidden": [4096, 4096]}, "image", (3, 32, 32), 10, 8),
    # A seconds-long smoke test.
    "mlp-small": ("mlp", {"hidden": [256, 256]}, "image", (3, 32, 32), 10, 8),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ContenderSpec:
    """How one contender trains."""

    kind: str
    """``ddp``, ``ddp+torch-zero1`` (DDP with torch's ``ZeroRedundancyOptimizer``), ``fsdp2`` (``fully_shard``
    per block with ``reshard_after_forward=True``, then the root) or ``hpcnet``."""
    zero: int = 0
    """hpcnet's ``dist.zero``."""
    checkpointed: bool = False
    """Each block recomputes its activations in backward (``hpcnet.models.blocks.checkpoint_blocks``)."""
    plain: str = ""
    """The same contender without checkpointing: the capacity search starts above its answer, and the weights
    after the table's steps are compared with its."""
    capacity: bool = False
    """In the capacity search by default (``--cap-contenders``)."""
    cap_timed: bool = False
    """Timed on FSDP2's largest model by default (``--cap-time``); DDP is not: four ranks holding 16+ bytes a
    parameter of a model that large would take most of this machine's memory."""
    guess_bytes_per_param: float = 16.0
    """Peak bytes per parameter the capacity search starts from without a figure measured in the run."""


CONTENDERS: dict[str, ContenderSpec] = {
    "ddp": ContenderSpec(kind="ddp", capacity=True, guess_bytes_per_param=20.0),
    "ddp+ac": ContenderSpec(kind="ddp", checkpointed=True, plain="ddp", guess_bytes_per_param=18.0),
    "ddp+torch-zero1": ContenderSpec(kind="ddp+torch-zero1", guess_bytes_per_param=14.0),
    "fsdp2": ContenderSpec(kind="fsdp2", capacity=True, cap_timed=True, guess_bytes_per_param=6.0),
    "fsdp2+ac": ContenderSpec(kind="fsdp2", checkpointed=True, plain="fsdp2", capacity=True, cap_timed=True,
                              guess_bytes_per_param=5.0),
    "hpcnet-zero0": ContenderSpec(kind="hpcnet", zero=0),
    "hpcnet-zero1": ContenderSpec(kind="hpcnet", zero=1, guess_bytes_per_param=12.0),
    "hpcnet-zero2": ContenderSpec(kind="hpcnet", zero=2, capacity=True, cap_timed=True, guess_bytes_per_param=10.0),
    "hpcnet-zero2+ac": ContenderSpec(kind="hpcnet", zero=2, checkpointed=True, plain="hpcnet-zero2", capacity=True,
                                     cap_timed=True, guess_bytes_per_param=9.0),
    "hpcnet-zero3": ContenderSpec(kind="hpcnet", zero=3, capacity=True, cap_timed=True, guess_bytes_per_param=6.0),
    "hpcnet-zero3+ac": ContenderSpec(kind="hpcnet", zero=3, checkpointed=True, plain="hpcnet-zero3", capacity=True,
                                     cap_timed=True, guess_bytes_per_param=5.0),
}
"""Every contender, in the table's order (the capacity search's too)."""
TIME_PEERS = ("ddp", "fsdp2", "hpcnet-zero0")
CAPACITY_TARGETS = {"hpcnet-best / fsdp2-best": 1.25, "hpcnet-zero3 / fsdp2": 1.0, "hpcnet-zero2 / ddp": 2.0}
"""The largest model under the cap, parameters over parameters: the issues' targets (31 for stage 3, 12 for 2)."""
FSDP2_MODEL_TIME_TARGET = ("hpcnet-zero3", 0.9)
"""Issue 31: stage 3's step time on FSDP2's largest model at most this times FSDP2's (median of paired rounds)."""
CAP_CONTENDERS = tuple(name for name, spec in CONTENDERS.items() if spec.capacity)
CAP_TIMED = tuple(name for name, spec in CONTENDERS.items() if spec.cap_timed)
CAP_VOCAB, CAP_SEQ, CAP_BATCH = 8192, 64, 4  # the capacity ladder's data: the table's transformer's
CAP_TOP_RUNG = 32  # width 2048, 32 blocks: 1.6 G parameters, far beyond this machine


# -- pure helpers (tested on one process) -----------------------------------------------
def ladder_options(rung: int) -> dict[str, int]:
    """The transformer of capacity rung ``rung`` (>= 1): width 64 * rung, ``rung`` blocks of ``rung`` heads of 64."""
    if rung < 1:
        raise ValueError(f"a ladder rung is at least 1, got {rung}")
    return {"d_model": 64 * rung, "n_layers": rung, "n_heads": rung}


def transformer_parameters(d_model: int, n_layers: int, vocab: int = CAP_VOCAB, seq: int = CAP_SEQ) -> int:
    """Parameters of ``hpcnet.models.transformer`` with tied embeddings and d_ff = 4 * d_model."""
    per_block = 12 * d_model * d_model + 13 * d_model  # qkv, proj, ff_in, ff_out with biases; two LayerNorms
    return n_layers * per_block + (vocab + seq + 2) * d_model  # token and position embeddings, final LayerNorm


def rung_parameters(rung: int) -> int:
    options = ladder_options(rung)
    return transformer_parameters(options["d_model"], options["n_layers"])


def start_rung(cap_bytes: float, bytes_per_param: float, top: int = CAP_TOP_RUNG) -> int:
    """The largest rung whose parameters times ``bytes_per_param`` fit ``cap_bytes`` (at least 1): a first guess."""
    fitting = [k for k in range(1, top + 1) if rung_parameters(k) * bytes_per_param <= cap_bytes]
    return max(fitting, default=1)


def deeper_options(rung: int, most: int = 4) -> list[dict[str, int]]:
    """The refinement between rung ``rung`` and the next: rung ``rung``'s width with more blocks, while it has
    fewer parameters than rung ``rung + 1`` (the ladder alone moves in steps of 25-45% of parameters); at most
    ``most`` of them, evenly spaced (small rungs, dominated by the embedding, would have dozens)."""
    out = []
    limit = rung_parameters(rung + 1)
    options = ladder_options(rung)
    for extra in range(1, 10 * rung + 10):
        deeper = {**options, "n_layers": rung + extra}
        if transformer_parameters(deeper["d_model"], deeper["n_layers"]) >= limit:
            break
        out.append(deeper)
    step = -(-len(out) // most) if out else 1
    return out[step - 1::step]


def search_largest(fits: Callable[[int], bool], start: int, top: int) -> tuple[int, dict[int, bool]]:
    """The largest k in 1..top with ``fits(k)`` (0 if none), for a ``fits`` that is true up to some k and false
    above it, starting from ``start`` and stepping one rung at a time, so the answer k has ``fits(k)`` and
    ``fits(k + 1)`` (below ``top``) both evaluated. Returns it and every evaluation made."""
    if not 1 <= start <= top:
        raise ValueError(f"the start rung {start} is outside 1..{top}")
    seen: dict[int, bool] = {}
    k = start
    seen[k] = fits(k)
    if seen[k]:
        while k < top:
            seen[k + 1] = fits(k + 1)
            if not seen[k + 1]:
                break
            k += 1
        return k, seen
    while k > 1:
        k -= 1
        seen[k] = fits(k)
        if seen[k]:
            return k, seen
    return 0, seen


def capacity_ratio(found: dict[str, dict[str, Any]], numerator: list[str], denominator: list[str]
                   ) -> dict[str, Any] | None:
    """Parameters of the largest model any of ``numerator`` trained over the largest any of ``denominator`` did.

    Args:
        found: each contender's answer: ``parameters`` of the largest size that fit (0: none) and
            ``next_parameters``, the next size tried, which did not fit (None: none above was tried).

    Returns:
        None where a side is absent or fitted nothing; else the ratio, the contender on each side, and
        ``bracket``: the bounds the true ratio lies in, each side's true largest lying between the largest size
        of its contenders that fit and the largest next size (None where a next size is missing).
    """
    sides = [[found[n] | {"name": n} for n in names if n in found] for names in (numerator, denominator)]
    if not all(sides) or not all(max(f["parameters"] for f in side) for side in sides):
        return None
    (top, low), bounds = [max(side, key=lambda f: f["parameters"]) for side in sides], []
    for side in sides:
        nexts = [f["next_parameters"] for f in side]
        bounds.append(max(nexts) if None not in nexts else None)
    bracket = None
    if None not in bounds:
        bracket = [top["parameters"] / bounds[1], bounds[0] / low["parameters"]]
    return {"ratio": top["parameters"] / low["parameters"], "numerator": top["name"], "denominator": low["name"],
            "bracket": bracket}


def paired_ratios(numerator: list[float], denominator: list[float]) -> dict[str, float]:
    """Median and range of the round-by-round ratios of two contenders' per-round step times."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} rounds against {len(denominator)}")
    return summarize([a / b for a, b in zip(numerator, denominator)])


def rotated(names: tuple[str, ...], round_index: int) -> list[str]:
    """Round ``round_index``'s order: every name runs in every position once over ``len(names)`` rounds."""
    shift = round_index % len(names)
    return [*names[shift:], *names[:shift]]


# -- measuring --------------------------------------------------------------------------
M_MMAP_THRESHOLD = -3


def _fixed_mmap_threshold() -> None:
    """Every allocation of 128 KiB or more gets its own mapping, returned to the OS when freed: glibc otherwise
    raises the threshold after a large block is freed, later tensors come from its heap, and resident memory
    then keeps what earlier contenders freed (seen here: stage 1 'holding' as much as stage 0)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 * 1024)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one bucket count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _hpcnet_tensors(model: nn.Module, dp: Any, optimizer: Any) -> dict[str, int]:
    params = list(model.parameters())
    if dp.sharded_params is not None:  # dist.zero=3: the owned units, beside the (released) parameters
        params += dp.layout.tensors
    grads = [p.grad for p in params if p.grad is not None]
    for bucket in dp.reducer.buckets:
        grads.extend(dp.reducer.placement.tensors(bucket))
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads), "optim": _storage_bytes(state)}


class Contender:
    """One trainer: its model (the module whose parameters are trained), the module that runs the forward, its
    optimizer, hpcnet's DataParallel (or None) and how many steps it took."""

    def __init__(self, name: str, model: nn.Module, forward: nn.Module, optimizer: Any, dp: Any) -> None:
        self.name, self.model, self.forward, self.optimizer, self.dp = name, model, forward, optimizer, dp
        self.steps = 0

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One training step on the next of ``batches`` (collective)."""
        from hpcnet.objective import compute_loss

        x, y = batches[self.steps % len(batches)]
        if self.dp is not None:
            self.dp.step([(x, y)], compute_loss)
            self.dp.clip_grad_norm_(1.0)
        else:
            self.optimizer.zero_grad(set_to_none=True)
            compute_loss(self.forward, (x, y)).backward()
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.steps += 1

    def full_weights(self) -> torch.Tensor:
        """Every parameter, whole, flat in name order (collective for FSDP2: its shards are gathered)."""
        sharded = self.dp.sharded_params if self.dp is not None else None
        if sharded is not None:  # dist.zero=3: gathered for the reading, released after
            sharded.gather_all()
        tensors = []
        for _, p in sorted(self.model.named_parameters(), key=lambda item: item[0]):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            tensors.append(full.detach().reshape(-1))
        flat = torch.cat(tensors)
        if sharded is not None:
            sharded.release_all()
        return flat

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()
        self.dp = self.model = self.forward = self.optimizer = None


def _fsdp_units(model: nn.Module) -> list[nn.Module]:
    """What FSDP2 shards and gathers as one unit, as its examples do: each transformer block (an MLP's each
    linear layer); the root takes the rest (embeddings, the tied head)."""
    from hpcnet.models.transformer import TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    return blocks or [m for m in model.modules() if isinstance(m, nn.Linear)]


def _build(name: str, model: nn.Module, comm: Any, world: Any, optim: str) -> Contender:
    """The contender ``name`` (an entry of ``CONTENDERS``) training ``model`` itself."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from hpcnet.comm.dataparallel import DataParallel
    from hpcnet.comm.route import agree_route
    from hpcnet.config import DistConfig, OptimConfig
    from hpcnet.models.blocks import checkpoint_blocks, find_blocks
    from hpcnet.optim import build_optimizer

    spec = CONTENDERS[name]
    optim_cfg = OptimConfig(name=optim, lr=1e-3)
    if spec.checkpointed:
        # Before any wrapper, as train.activation_checkpointing=blocks does for hpcnet: the same blocks, the same
        # recomputation for every kind (FSDP2 then gathers a block's parameters again for its recomputation).
        blocks = find_blocks(model)
        if not blocks:
            raise ValueError(f"{name}: the model has no blocks to checkpoint")
        checkpoint_blocks(blocks)
    if spec.kind == "hpcnet":
        cfg = DistConfig(zero=spec.zero, owners="uniform")
        dp = DataParallel(model, comm, world, cfg, device=torch.device("cpu"),
                          route=agree_route(comm, world, cfg, device_type="cpu"),
                          blocks=find_blocks(model) if spec.zero == 3 else None)  # FSDP2's units
        return Contender(name, model, model, dp.shard_optimizer(build_optimizer(model, optim_cfg)), dp)
    if spec.kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for unit in _fsdp_units(model):
            fully_shard(unit, reshard_after_forward=True)
        fully_shard(model)
        return Contender(name, model, model, build_optimizer(model, optim_cfg), None)
    ddp = DistributedDataParallel(model)
    if spec.kind == "ddp":
        return Contender(name, model, ddp, build_optimizer(model, optim_cfg), None)
    if spec.kind != "ddp+torch-zero1":
        raise ValueError(f"{name}: unknown kind {spec.kind!r}")
    groups = build_optimizer(model, optim_cfg).param_groups
    cls = torch.optim.AdamW if optim == "adamw" else torch.optim.SGD
    extra = {"betas": tuple(optim_cfg.betas), "eps": optim_cfg.eps} if optim == "adamw" else \
        {"momentum": optim_cfg.momentum}
    zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, lr=optim_cfg.lr,
                                   weight_decay=groups[0]["weight_decay"], process_group=dist.group.WORLD, **extra)
    zero.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
    return Contender(name, model, ddp, zero, None)


def _batches(kind: str, shape: tuple[int, ...], classes: int, batch: int, rank: int) -> list:
    gen = torch.Generator().manual_seed(100 + rank)
    if kind == "tokens":
        return [(torch.randint(0, classes, (batch, *shape), generator=gen),
                 torch.randint(0, classes, (batch, *shape), generator=gen)) for _ in range(2)]
    return [(torch.randn(batch, *shape, generator=gen), torch.randint(0, classes, (batch,), generator=gen))
            for _ in range(2)]


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


def bench_model(key: str, comm: Any, world: Any, args: argparse.Namespace) -> dict[str, Any]:
    from mpi4py import MPI

    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    model_name, options, kind, shape, classes, batch = MODELS[key]
    torch.manual_seed(0)
    base = build_model(model_name, DatasetInfo(kind, shape, classes), options)
    batches = _batches(kind, shape, classes, batch, world.rank)
    n_params = sum(p.numel() for p in base.parameters())
    # One unmeasured step of each kind first: what the first use of autograd, gloo, MPI, FSDP2 and checkpointing
    # allocates for good would otherwise be charged to the first contender of the kind.
    for name in ("ddp", "fsdp2", "hpcnet-zero2", "hpcnet-zero2+ac", "hpcnet-zero3"):
        warm = _build(name, copy.deepcopy(base), comm, world, args.optim)
        warm.step(batches)
        warm.close()
        del warm
    names = list(CONTENDERS)
    memory, per_round, slowest, alive = measure(names, lambda: copy.deepcopy(base), batches, comm, world, args,
                                                steps=args.steps, rounds=args.rounds, round_steps=args.round_steps)
    # Every contender took the same steps on the same batches: their weights agree (hpcnet's stages bit for bit
    # up to 2 ranks; the others sum gradients in other orders; checkpointing changes no bit).
    weights = {name: alive[name].full_weights() for name in names}
    diffs = {name: float((weights[name] - weights["hpcnet-zero0"]).abs().max()) for name in names}
    ac_diffs = {name: float((weights[name] - weights[spec.plain]).abs().max())
                for name, spec in CONTENDERS.items() if spec.plain}
    worst = comm.allreduce(max(diffs.values()), op=MPI.MAX)
    ac_worst = comm.allreduce(max(ac_diffs.values(), default=0.0), op=MPI.MAX)
    del weights
    for name in names:
        alive.pop(name).close()
    if world.rank != 0:
        return {}
    timing = {name: {"step_s": slowest[i].reshape(-1).tolist(), "step_s_rounds": per_round[name],
                     "step_s_summary": summarize(slowest[i].reshape(-1).tolist())}
              for i, name in enumerate(names)}
    ratios = {peer: {name: paired_ratios(per_round[name], per_round[peer]) for name in names}
              for peer in TIME_PEERS}
    return {"model": key, "parameters": n_params, "optimizer": args.optim, "memory": memory, "timing": timing,
            "time_ratios": ratios, "max_weight_difference": worst, "differences": diffs,
            "max_checkpointing_difference": ac_worst, "checkpointing_differences": ac_diffs,
            "targets": targets(memory, ratios, world.size)}


def targets(memory: dict[str, Any], ratios: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """The targets stated at 4 ranks (issue 12's for dist.zero=2, issue 31's held memory for dist.zero=3), each
    with its measured figure."""
    peak = {name: max(r["peak_mib"]) for name, r in memory.items()}
    held = {name: max(r["held_mib"]) for name, r in memory.items()}
    rows = [("hpcnet-zero3 held between steps / FSDP2's (issue 31)", held["hpcnet-zero3"] / held["fsdp2"], 1.05),
            ("hpcnet-zero2 peak / DDP's (issue 12)", peak["hpcnet-zero2"] / peak["ddp"], 0.5),
            ("hpcnet-zero2 peak / DDP+ZeroRedundancyOptimizer's (issue 12)",
             peak["hpcnet-zero2"] / peak["ddp+torch-zero1"], 0.8),
            ("hpcnet-zero2 step time / FSDP2's, median of rounds (issue 12)",
             ratios["fsdp2"]["hpcnet-zero2"]["median"], 1.0),
            ("hpcnet-zero2 step time / hpcnet zero 0's, median of rounds (issue 12)",
             ratios["hpcnet-zero0"]["hpcnet-zero2"]["median"], 1.1)]
    return [{"what": what, "value": float(value), "at_most": bound, "met": bool(value <= bound), "ranks": world_size}
            for what, value, bound in rows]


# -- capacity under a memory cap --------------------------------------------------------
def _ladder_model(options: dict[str, int]) -> nn.Module:
    from hpcnet.data.info import DatasetInfo
    from hpcnet.models import build_model

    torch.manual_seed(0)
    return build_model("transformer", DatasetInfo("tokens", (CAP_SEQ,), CAP_VOCAB), options)


def cap_trial(name: str, rung: int, comm: Any, world: Any, args: argparse.Namespace,
              options: dict[str, int] | None = None) -> dict[str, Any]:
    """Build and train rung ``rung`` (or ``options``, a refinement of it) with ``name`` for ``--cap-steps`` steps;
    its peak above the rank's settled memory before the model was made, the largest rank's (collective)."""
    from mpi4py import MPI

    options = options or ladder_options(rung)
    batches = _batches("tokens", (CAP_SEQ,), CAP_VOCAB, CAP_BATCH, world.rank)
    before = _settle()
    comm.Barrier()
    _reset_peak()
    contender = _build(name, _ladder_model(options), comm, world, args.optim)
    t0 = time.perf_counter()
    for _ in range(args.cap_steps):
        contender.step(batches)
    seconds = (time.perf_counter() - t0) / args.cap_steps
    peak_kib = _status_kib("VmHWM") - before
    contender.close()
    del contender
    peak = comm.allreduce(peak_kib, op=MPI.MAX) * 1024
    return {"contender": name, "rung": rung, "extra_blocks": options["n_layers"] - rung, **options,
            "parameters": transformer_parameters(options["d_model"], options["n_layers"]), "peak_bytes": peak,
            "fits": bool(peak <= args.cap_gb * 1e9),
            "step_s": comm.allreduce(seconds, op=MPI.MAX)}


def bench_capacity(comm: Any, world: Any, args: argparse.Namespace, measured: dict[str, float]) -> dict[str, Any]:
    """The largest ladder size each of ``--cap-contenders`` trains under ``--cap-gb`` (collective).

    Args:
        measured: bytes of peak per parameter each contender showed on the table's transformer in this run
            (where it ran), which picks the first rung to try; the search itself measures.
    """
    cap = args.cap_gb * 1e9
    found: dict[str, Any] = {}
    trials: list[dict[str, Any]] = []
    # An unmeasured trial of each first: seen here, DDP's first trial in a process peaked 120 MiB higher than
    # the same trial after it (what the first use of autograd and gloo allocates for good).
    for name in args.cap_contenders:
        cap_trial(name, 1, comm, world, args)
    for name in args.cap_contenders:
        spec = CONTENDERS[name]
        twin = found.get(spec.plain, {}).get("rung", 0)
        # Checkpointing only lowers the peak: start at the rung above the twin's answer (one trial where it fits
        # no more, one or two fewer than a guess would cost), else from the bytes per parameter.
        start = (min(twin + 1, CAP_TOP_RUNG) if twin else
                 start_rung(cap, measured.get(name, spec.guess_bytes_per_param)))
        results: dict[int, dict[str, Any]] = {}

        def fits(rung: int, name: str = name, results: dict[int, dict[str, Any]] = results) -> bool:
            results[rung] = cap_trial(name, rung, comm, world, args)
            return results[rung]["fits"]

        best, _ = search_largest(fits, start, CAP_TOP_RUNG)
        tried = [results[k] for k in sorted(results)]
        largest = results[best] if best else None
        if best and best < CAP_TOP_RUNG:
            # Then rung ``best``'s width with more blocks, up to the first that does not fit.
            for options in deeper_options(best):
                trial = cap_trial(name, best, comm, world, args, options)
                tried.append(trial)
                if not trial["fits"]:
                    break
                largest = trial
        trials.extend(tried)
        above = min((t for t in tried if not t["fits"] and largest and t["parameters"] > largest["parameters"]),
                    key=lambda t: t["parameters"], default=None)
        found[name] = {"rung": best, "extra_blocks": largest["extra_blocks"] if largest else 0,
                       "parameters": largest["parameters"] if largest else 0,
                       **({k: largest[k] for k in ("d_model", "n_layers", "n_heads")} if largest else {}),
                       "peak_bytes": largest["peak_bytes"] if largest else None,
                       "start_rung": start, "trials": len(tried),
                       "next_parameters": above["parameters"] if above else None,
                       "next_peak_bytes": above["peak_bytes"] if above else None}
        if world.rank == 0:
            print(f"capacity: {name} done ({len(tried)} trials, {time.strftime('%H:%M:%S')})", flush=True)
    hpcnet = [n for n in found if CONTENDERS[n].kind == "hpcnet"]
    fsdp2 = [n for n in found if CONTENDERS[n].kind == "fsdp2"]
    ratios = {"hpcnet-best / fsdp2-best": capacity_ratio(found, hpcnet, fsdp2),
              "hpcnet-zero3 / fsdp2": capacity_ratio(found, ["hpcnet-zero3"], ["fsdp2"]),
              "hpcnet-zero2 / fsdp2": capacity_ratio(found, ["hpcnet-zero2"], ["fsdp2"]),
              "hpcnet-zero2 / ddp": capacity_ratio(found, ["hpcnet-zero2"], ["ddp"])}
    return {"cap_bytes": cap, "steps": args.cap_steps, "batch": [CAP_BATCH, CAP_SEQ], "vocab": CAP_VOCAB,
            "largest": found, "trials": trials, "ratios": {k: v for k, v in ratios.items() if v}}


def bench_fsdp2_model(comm: Any, world: Any, args: argparse.Namespace, cap: dict[str, Any]) -> dict[str, Any] | None:
    """Memory and step time of ``--cap-time`` on the largest size FSDP2 fitted under the cap (collective); None
    where FSDP2 was not searched or fitted nothing."""
    fsdp2 = cap["largest"].get("fsdp2")
    if not fsdp2 or not fsdp2["rung"] or not args.cap_time:
        return None
    options = {k: fsdp2[k] for k in ("d_model", "n_layers", "n_heads")}
    batches = _batches("tokens", (CAP_SEQ,), CAP_VOCAB, CAP_BATCH, world.rank)
    names = list(args.cap_time)
    memory, per_round, slowest, alive = measure(names, lambda: _ladder_model(options), batches, comm, world, args,
                                                steps=args.cap_steps, rounds=args.cap_rounds, round_steps=1)
    for name in names:
        alive.pop(name).close()
    if world.rank != 0:
        return {}
    peer = "fsdp2" if "fsdp2" in names else names[0]
    return {**options, "parameters": fsdp2["parameters"], "rounds": args.cap_rounds, "peer": peer,
            "memory": memory, "step_s_rounds": per_round,
            "step_s_summary": {n: summarize(slowest[i].reshape(-1).tolist()) for i, n in enumerate(names)},
            "time_ratios": {n: paired_ratios(per_round[n], per_round[peer]) for n in names}}


# -- reports ----------------------------------------------------------------------------
def _ms(summary: dict[str, float]) -> str:
    return f"{summary['median'] * 1e3:.0f} ({summary['min'] * 1e3:.0f}-{summary['max'] * 1e3:.0f})"


def _ratio(summary: dict[str, float]) -> str:
    return f"{summary['median']:.2f} ({summary['min']:.2f}-{summary['max']:.2f})"


def report(out: dict[str, Any], args: argparse.Namespace) -> str:
    memory, timing, ratios = out["memory"], out["timing"], out["time_ratios"]
    ddp_held, ddp_peak = max(memory["ddp"]["held_mib"]), max(memory["ddp"]["peak_mib"])
    rows = []
    for name in CONTENDERS:
        r = memory[name]
        held, peak = max(r["held_mib"]), max(r["peak_mib"])
        tensors = [t for t in r["tensors_mib"] if t]
        counted = (" / ".join(f"{max(t[k] for t in tensors):.1f}" for k in ("params", "grads", "optim"))
                   if tensors else "-")
        rows.append([name, f"{held:.1f}", f"{held / ddp_held:.2f}", f"{peak:.1f}", f"{peak / ddp_peak:.2f}",
                     _ms(timing[name]["step_s_summary"]), *(_ratio(ratios[p][name]) for p in TIME_PEERS), counted])
    head = (f"{out['model']}: {out['parameters'] / 1e6:.1f} M parameters ({out['parameters'] * 4 / 2**20:.0f} MiB "
            f"in fp32), {out['optimizer']}")
    lines = [head, table(["contender", "held MiB", "/ddp", "peak MiB", "/ddp", "step ms (range)", "/ddp",
                          "/fsdp2", "/zero0", "hpcnet tensors MiB: params / grads+buckets / optim"], rows)]
    lines.append("held: resident memory after the steps above what the rank held before the contender was built; "
                 "peak: its high-water mark during them; both the largest rank's. step: the slowest rank's, "
                 f"{args.rounds} rounds x {args.round_steps} steps after {args.steps} warm-up steps, median "
                 "(range); ratios paired round by round, median (range). max |weight difference| from "
                 f"hpcnet-zero0 after the steps: {out['max_weight_difference']:.2e} "
                 f"({', '.join(f'{k} {v:.1e}' for k, v in out['differences'].items())}); with checkpointing "
                 f"from without: {out['max_checkpointing_difference']:.2e} "
                 f"({', '.join(f'{k} {v:.1e}' for k, v in out['checkpointing_differences'].items())})")
    for t in out["targets"]:
        lines.append(f"target (stated at 4 ranks; here {t['ranks']}): {t['what']} "
                     f"{t['value']:.2f} <= {t['at_most']}: {'met' if t['met'] else 'NOT met'}")
    return "\n".join(lines)


def report_capacity(cap: dict[str, Any]) -> str:
    rows = []
    for t in cap["trials"]:
        rung = f"{t['rung']}" + (f" +{t['extra_blocks']} blocks" if t.get("extra_blocks") else "")
        rows.append([t["contender"], rung, f"{t['d_model']} x {t['n_layers']}",
                     f"{t['parameters'] / 1e6:.1f}", f"{t['peak_bytes'] / 2**20:.0f}", f"{t['step_s'] * 1e3:.0f}",
                     "yes" if t["fits"] else "no"])
    lines = [f"largest transformer under a cap of {cap['cap_bytes'] / 1e9:g} GB ({cap['cap_bytes'] / 2**20:.0f} MiB) "
             f"of peak per rank (batch {cap['batch'][0]} x {cap['batch'][1]} tokens, vocabulary {cap['vocab']}, "
             f"{cap['steps']} steps a trial); rungs tried:",
             table(["contender", "rung", "width x depth", "M params", "peak MiB", "step ms", "fits"], rows)]
    rows = []
    for name, f in cap["largest"].items():
        rung = f"{f['rung']}" + (f" +{f['extra_blocks']} blocks" if f["extra_blocks"] else "")
        above = (f"{f['next_parameters'] / 1e6:.1f} M: {f['next_peak_bytes'] / 2**20:.0f} MiB"
                 if f["next_parameters"] else "-")
        rows.append([name, rung if f["rung"] else "none", f"{f['d_model']} x {f['n_layers']}" if f["rung"] else "-",
                     f"{f['parameters'] / 1e6:.1f}", f"{f['peak_bytes'] / 2**20:.0f}" if f["rung"] else "-", above,
                     str(f["start_rung"]), str(f["trials"])])
    lines += ["largest that fit, per contender:",
              table(["contender", "rung", "width x depth", "M params", "peak MiB", "next size tried: peak",
                     "first rung", "trials"], rows)]
    for what, r in cap["ratios"].items():
        bounds = ""
        if r["bracket"]:
            bounds = f"; between the sizes tried, the true ratio lies in {r['bracket'][0]:.2f}-{r['bracket'][1]:.2f}"
        bound = CAPACITY_TARGETS.get(what)
        target = f", target >= {bound:g}: {'met' if r['ratio'] >= bound else 'NOT met'}" if bound else ""
        lines.append(f"parameters, {what} ({r['numerator']} / {r['denominator']}): {r['ratio']:.2f}{target}{bounds}")
    return "\n".join(lines)


def report_fsdp2_model(out: dict[str, Any], cap_gb: float) -> str:
    memory, peer = out["memory"], out["peer"]
    peer_held, peer_peak = max(memory[peer]["held_mib"]), max(memory[peer]["peak_mib"])
    rows = []
    for name, r in memory.items():
        held, peak = max(r["held_mib"]), max(r["peak_mib"])
        rows.append([name, f"{held:.0f}", f"{held / peer_held:.2f}", f"{peak:.0f}", f"{peak / peer_peak:.2f}",
                     "yes" if peak * 2**20 <= cap_gb * 1e9 else "no", _ms(out["step_s_summary"][name]),
                     _ratio(out["time_ratios"][name])])
    return "\n".join([
        f"on FSDP2's largest model, {out['d_model']} x {out['n_layers']} ({out['parameters'] / 1e6:.1f} M parameters), "
        f"without the cap; {out['rounds']} rounds x 1 step in rotated order:",
        table(["contender", "held MiB", f"/{peer}", "peak MiB", f"/{peer}", "under cap", "step ms (range)",
               f"/{peer} (paired)"], rows), *_time_target(out)])


def _time_target(out: dict[str, Any]) -> list[str]:
    name, bound = FSDP2_MODEL_TIME_TARGET
    if out["peer"] != "fsdp2" or name not in out["time_ratios"]:
        return []
    median = out["time_ratios"][name]["median"]
    return [f"step time, {name} / fsdp2 (median of paired rounds): {median:.2f}, target <= {bound:g}: "
            f"{'met' if median <= bound else 'NOT met'}"]


def main(argv: list[str] | None = None) -> int:
    from mpi4py import MPI

    from hpcnet.comm.bootstrap import init_data_plane
    from hpcnet.world import discover

    parser = argparse.ArgumentParser(prog="python -m hpcnet.bench memory", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="transformer,mlp-4096",
                        help=f"comma-separated among {', '.join(MODELS)} (default transformer,mlp-4096)")
    parser.add_argument("--optim", default="adamw", choices=["adamw", "sgd"], help="the optimizer (default adamw)")
    parser.add_argument("--steps", type=int, default=3,
                        help="steps per contender for the memory figures, also the timing's warm-up (default 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds on each --models model (default 3: with 9 contenders, each in 3 positions)")
    parser.add_argument("--round-steps", type=int, default=1, help="timed steps per contender a round (default 1)")
    parser.add_argument("--cap-gb", type=float, default=0.5,
                        help="per-rank cap in GB (1e9 bytes) on the peak that training adds, for the largest "
                             "transformer each of --cap-contenders trains under it; 0 skips (default 0.5)")
    parser.add_argument("--cap-contenders", default=",".join(CAP_CONTENDERS),
                        help=f"comma-separated contenders of the capacity search, in order (default "
                             f"{','.join(CAP_CONTENDERS)}; any of {', '.join(CONTENDERS)})")
    parser.add_argument("--cap-steps", type=int, default=2,
                        help="steps per capacity trial, also the warm-up on FSDP2's largest model (default 2)")
    parser.add_argument("--cap-time", default=",".join(CAP_TIMED),
                        help=f"comma-separated contenders timed on FSDP2's largest model (needs fsdp2 in "
                             f"--cap-contenders); empty skips (default {','.join(CAP_TIMED)})")
    parser.add_argument("--cap-rounds", type=int, default=2,
                        help="timed rounds on FSDP2's largest model, 1 step each per contender (default 2)")
    parser.add_argument("--json", default="", help="also write the results to this JSON file (rank 0)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or (not models and args.cap_gb <= 0):
        parser.error(f"--models: unknown {unknown or args.models!r}; choose among {', '.join(MODELS)}")
    for option in ("cap_contenders", "cap_time"):
        names = [n.strip() for n in getattr(args, option).split(",") if n.strip()]
        if [n for n in names if n not in CONTENDERS] or len(set(names)) < len(names):
            parser.error(f"--{option.replace('_', '-')}: {getattr(args, option)!r} must name distinct contenders "
                         f"among {', '.join(CONTENDERS)}")
        setattr(args, option, tuple(names))
    if args.cap_gb > 0 and not args.cap_contenders:
        parser.error("--cap-contenders is empty: name at least one, or skip the search with --cap-gb 0")
    for option in ("steps", "rounds", "round_steps", "cap_steps", "cap_rounds"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be at least 1")
    if args.cap_gb < 0:
        parser.error("--cap-gb must be 0 (skip) or more")
    comm = MPI.COMM_WORLD.Dup()
    world = discover(comm)
    if world.size < 2:
        parser.error("run it with at least 2 ranks (mpirun -np 2 ...): memory is saved by sharding over ranks")
    torch.set_num_threads(1)
    _fixed_mmap_threshold()
    plane = init_data_plane(comm, world, backend="gloo", device=torch.device("cpu"), timeout_s=300)
    env = environment(comm)
    started = time.perf_counter()
    outs = []
    capacity = None
    try:
        measured: dict[str, float] = {}
        for key in models:
            out = bench_model(key, comm, world, args)
            if world.rank == 0:
                out["seconds"] = time.perf_counter() - started
                outs.append(out)
                print(report(out, args), flush=True)
                if key == "transformer":
                    measured = {n: max(out["memory"][n]["peak_mib"]) * 2**20 / out["parameters"]
                                for n in args.cap_contenders}
        if args.cap_gb > 0:
            capacity = bench_capacity(comm, world, args, comm.bcast(measured, root=0))
            if world.rank == 0:
                print(report_capacity(capacity), flush=True)
            at_fsdp2 = bench_fsdp2_model(comm, world, args, capacity)
            if world.rank == 0 and at_fsdp2:
                capacity["fsdp2_model"] = at_fsdp2
                print(report_fsdp2_model(at_fsdp2, args.cap_gb), flush=True)
    finally:
        plane.close()
    if world.rank == 0:
        print(describe_environment(env))
        print(f"load average at end: {', '.join(f'{x:.2f}' for x in load_average())}; "
              f"{time.perf_counter() - started:.0f} s")
        if args.json:
            write_json(args.json, {"benchmark": "memory", "environment": env, "models": outs,
                                   "capacity": capacity})
    comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
