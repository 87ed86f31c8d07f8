"""bench memory's contenders: how each one trains (``CONTENDERS``), one built trainer (``Contender``), and the
synthetic batches every contender trains on.

A contender is DDP, DDP with torch's ``ZeroRedundancyOptimizer``, FSDP2 or hpcnet at a ``dist.zero`` stage, each
with or without activation checkpointing (``+ac``: ``hpcnet.models.blocks.checkpoint_blocks``, applied before
any wrapper). A new contender is one entry of ``CONTENDERS``.
"""

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


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
REFERENCES = ("ddp", "hpcnet-zero0")
"""The contenders the table compares every other with (memory over DDP's, weights against hpcnet-zero0's)."""
REFUSALS: dict[tuple[str, str], str] = {
    # Checked with torch 2.13 on 2 ranks (gloo): the first step raises in DTensor's sharding propagation.
    ("fsdp2", "adafactor"): "torch's Adafactor fails on FSDP2's row-sharded DTensor parameters (its in-place "
                            "aten.pow_ on a partial placement: DTensor refuses in-place ops that change placement)",
    ("ddp+torch-zero1", "muon"): "ZeroRedundancyOptimizer builds one optimizer class from keyword options, and "
                                 "optim.name=muon is two (Muon over the hidden matrices, AdamW over the rest)",
}
"""(contender kind, --optim) -> why that contender cannot train with that optimizer.  FSDP2 with Muon runs:
DTensor gathers the row shards inside Muon's Newton-Schulz products, the whole-matrix update (within bfloat16
rounding of one process's), at the cost of those gathers in every iteration."""
CAP_CONTENDERS = tuple(name for name, spec in CONTENDERS.items() if spec.capacity)
CAP_TIMED = tuple(name for name, spec in CONTENDERS.items() if spec.cap_timed)


def refusal(name: str, optim: str) -> str:
    """Why contender ``name`` cannot train with ``optim`` (``REFUSALS``); empty where it can."""
    return REFUSALS.get((CONTENDERS[name].kind, optim), "")


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
    from hpcnet.optim import build_optimizer, is_elementwise

    spec = CONTENDERS[name]
    if refusal(name, optim):
        raise ValueError(f"{name} with --optim {optim}: {refusal(name, optim)}")
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
        optimizer = build_optimizer(model, optim_cfg)  # before DataParallel, as train builds it: it decides the units
        dp = DataParallel(model, comm, world, cfg, device=torch.device("cpu"),
                          route=agree_route(comm, world, cfg, device_type="cpu"),
                          blocks=find_blocks(model) if spec.zero == 3 else None,  # FSDP2's units
                          elementwise=is_elementwise(optimizer, optim_cfg))
        return Contender(name, model, model, dp.shard_optimizer(optimizer), dp)
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
    full = build_optimizer(model, optim_cfg)
    groups, cls = full.param_groups, type(full)
    # The options as the run's optimizer has them, as the sharded optimizer rebuilds one over the owned units.
    accepted = inspect.signature(cls.__init__).parameters
    options = {k: v for k, v in full.defaults.items() if k in accepted and k != "weight_decay"}
    zero = ZeroRedundancyOptimizer(groups[0]["params"], optimizer_class=cls, weight_decay=groups[0]["weight_decay"],
                                   process_group=dist.group.WORLD, **options)
    zero.add_param_group({"params": groups[1]["params"], "weight_decay": 0.0})
    return Contender(name, model, ddp, zero, None)


def _batches(kind: str, shape: tuple[int, ...], classes: int, batch: int, rank: int) -> list:
    gen = torch.Generator().manual_seed(100 + rank)
    if kind == "tokens":
        return [(torch.randint(0, classes, (batch, *shape), generator=gen),
                 torch.randint(0, classes, (batch, *shape), generator=gen)) for _ in range(2)]
    return [(torch.randn(batch, *shape, generator=gen), torch.randint(0, classes, (batch,), generator=gen))
            for _ in range(2)]

