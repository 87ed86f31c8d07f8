"""A model's blocks (``model.blocks``) and activation checkpointing over them (``train.activation_checkpointing``).

A *block* is a module that is run as a unit and holds a large share of the parameters: a transformer layer, a
ResNet basic block, an MLP's linear layer.  ``find_blocks`` finds them by itself, or takes them named:

- ``auto``: of the module classes with at least two instances (outermost ones, containers such as
  ``ModuleList`` aside), those made of other layers if any (a transformer layer, a ResNet block; else single
  layers, an MLP's linear layers); of these, the ones whose instances hold at least ``COVERAGE_TOLERANCE`` of
  the parameters the best-covering class's hold, and of those the coarsest (the largest instances): a
  transformer's layers, not their attention modules, even where a large output layer tied to the embedding
  holds more parameters than they do.
- ``package.module.Class``: every instance of that class (outermost only, when they nest).
- module paths, comma-separated (``blocks.0,blocks.1``): exactly those modules.

``checkpoint_blocks`` recomputes each block's activations in backward instead of keeping them
(``torch.utils.checkpoint``, non-reentrant): a block keeps only its input between forward and backward.  The
non-reentrant form runs the recomputation inside the one backward, so each parameter's gradient reaches the
reducer's hook once, as without checkpointing (the reentrant form runs a backward per block; see
``hpcnet.comm.reducer``).  The random state of the forward is replayed (dropout draws the same mask), and the
recomputation leaves batch-norm running statistics as the forward left them, so a run with checkpointing
computes the bits of one without.  Only in training with gradients on: evaluation runs the blocks plainly.
"""

import importlib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpcnet.errors import ConfigError

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
"""Modules that only hold others: never blocks themselves."""
COVERAGE_TOLERANCE = 0.8
"""``auto`` takes the coarsest repeated class whose instances hold at least this share of what the best-covering
class's hold."""


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def auto_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks ``auto`` finds (see the module's doc), in model order; empty when no class repeats."""
    names = {id(m): name for name, m in model.named_modules()}
    by_class: dict[type, list[nn.Module]] = {}
    for name, module in model.named_modules():
        if name and not isinstance(module, CONTAINERS) and _numel(module) > 0:
            by_class.setdefault(type(module), []).append(module)
    candidates = []
    for members in by_class.values():
        outer = _outermost([(names[id(m)], m) for m in members], model)
        if len(outer) < 2:
            continue
        covered = sum({id(p): p.numel() for _, m in outer for p in m.parameters()}.values())
        composite = any(_numel(child) > 0 for child in outer[0][1].children())
        candidates.append((composite, covered, covered / len(outer), outer))
    if not candidates:
        return []
    if any(c[0] for c in candidates):  # layers made of layers first: a tied output layer does not outweigh them
        candidates = [c for c in candidates if c[0]]
    candidates = [c[1:] for c in candidates]
    best = max(covered for covered, _, _ in candidates)
    # The coarsest class that covers nearly as much: a transformer's layers, not the linear layers in them.
    _, _, chosen = max((c for c in candidates if c[0] >= COVERAGE_TOLERANCE * best), key=lambda c: (c[1], c[0]))
    return chosen


def _outermost(found: list[tuple[str, nn.Module]], model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``found`` in model order, without those inside another of them."""
    order = {id(m): k for k, (_, m) in enumerate(model.named_modules())}
    found = sorted(found, key=lambda item: order[id(item[1])])
    kept: list[tuple[str, nn.Module]] = []
    for name, module in found:
        if not any(name.startswith(outer + ".") for outer, _ in kept):
            kept.append((name, module))
    return kept


def find_blocks(model: nn.Module, spec: str = "auto", *, option: str = "model.blocks") -> list[tuple[str, nn.Module]]:
    """The model's blocks, by ``spec`` (see the module's doc), as (module path, module) in model order.

    Raises:
        ConfigError: naming ``option`` when ``spec`` names no module, a path the model lacks, or a class that
            cannot be imported or has no instance in the model.
    """
    spec = spec.strip()
    if spec == "auto":
        return auto_blocks(model)
    modules = dict(model.named_modules())
    parts = [s.strip() for s in spec.split(",") if s.strip()]
    if not parts:
        raise ConfigError(f"{option} is empty: 'auto', a class ('package.module.Class') or module paths")
    tops = {name.split(".")[0] for name in modules if name}
    if len(parts) > 1 or parts[0] in modules or parts[0].split(".")[0] in tops or "." not in parts[0]:
        missing = [p for p in parts if p not in modules]
        if missing:
            close = [name for name in modules if name and name.split(".")[0] == missing[0].split(".")[0]][:5]
            raise ConfigError(f"{option}: the model has no module {missing[0]!r}"
                              + (f" (it has {', '.join(close)} ...)" if close else "")
                              + "; give 'auto', a class 'package.module.Class' or module paths 'blocks.0,blocks.1'")
        return _outermost([(p, modules[p]) for p in parts], model)
    cls = _import_class(parts[0], option)
    found = [(name, m) for name, m in modules.items() if isinstance(m, cls) and name]
    if not found:
        raise ConfigError(f"{option}: the model has no {parts[0]} module")
    return _outermost(found, model)


def _import_class(path: str, option: str) -> type:
    module_name, _, attr = path.rpartition(".")
    try:
        obj: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{option}: cannot import {path!r}: {exc}") from None
    if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
        raise ConfigError(f"{option}: {path!r} is not an nn.Module class")
    return obj


def checkpoint_blocks(blocks: list[tuple[str, nn.Module]]) -> None:
    """Make each block recompute its activations in backward (see the module's doc); in place, idempotent.
    The state dict's names do not change (no wrapper module)."""
    for _, block in blocks:
        if getattr(block, "_hpcnet_checkpointed", False):
            continue
        _wrap(block)
        block._hpcnet_checkpointed = True


def uncheckpoint_blocks(blocks: list[tuple[str, nn.Module]]) -> None:
    """Undo ``checkpoint_blocks``: the blocks run their own forward again."""
    for _, block in blocks:
        if getattr(block, "_hpcnet_checkpointed", False):
            del block.forward
            del block._hpcnet_checkpointed


def _wrap(block: nn.Module) -> None:
    plain = block.forward
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not (block.training and torch.is_grad_enabled()):
            return plain(*args, **kwargs)
        calls = [0]

        def run(*a: Any, **k: Any) -> Any:
            calls[0] += 1
            if calls[0] == 1 or not norms:
                return plain(*a, **k)
            # The recomputation: batch norm would update its running statistics a second time.
            kept = [(b, b.detach().clone()) for m in norms for b in m.buffers()]
            try:
                return plain(*a, **k)
            finally:
                with torch.no_grad():
                    for b, value in kept:
                        b.copy_(value)

        return checkpoint(run, *args, use_reentrant=False, **kwargs)

    block.forward = forward  # an instance attribute: nn.Module.__call__ runs it, hooks and all


def describe(blocks: list[tuple[str, nn.Module]], model: nn.Module) -> str:
    """One line for the log: how many blocks, of what, and their share of the parameters."""
    if not blocks:
        return "no blocks"
    total = max(1, _numel(model))
    inside = {id(p): p.numel() for _, m in blocks for p in m.parameters()}
    kinds = sorted({type(m).__name__ for _, m in blocks})
    return (f"{len(blocks)} blocks ({', '.join(kinds)}; {blocks[0][0]} ... {blocks[-1][0]}), "
            f"{100 * sum(inside.values()) / total:.0f}% of the parameters")
