"""The gradient norm taken unit by unit, as ``dist.zero=2`` must take it from the owners' pieces, so that every
stage clips alike, bit for bit (``unit_grad_norm``); and its sharded form, one float a unit gathered from the
owners (``unit_norms``, ``combine``)."""

from typing import Any

import numpy as np
import torch
from torch import nn

from hpcnet.comm.sharding.layout import Unit


@torch.no_grad()
def unit_grad_norm(params: list[torch.Tensor], units: list[Unit], order: list[int]) -> torch.Tensor:
    """The 2-norm of ``params``' gradients taken unit by unit, as ``dist.zero=2`` takes it from the owners'
    pieces: each unit's norm (``torch._foreach_norm``), then the norm of those, stacked by (device, dtype) group
    in parameter order (``order``: ``norm_order``) as ``torch.nn.utils.get_total_norm`` stacks per-parameter
    norms.  Without cut parameters it is ``get_total_norm``'s result, bit for bit; with them, equal to rounding.
    On the device, with no copy to the host (stage 2's trip through float64 is exact both ways, so the bits
    agree)."""
    grads: dict[int, torch.Tensor] = {}
    for k, u in enumerate(units):
        grad = params[u.param].grad
        if grad is not None:
            grads[k] = grad if u.whole else grad[u.lo:u.hi]
    if not grads:
        return torch.tensor(0.0)
    norms: dict[int, torch.Tensor] = {}
    for members in _by_device_and_dtype(grads).values():
        norms.update(zip(members, torch._foreach_norm([grads[k] for k in members], 2.0)))
    device = params[0].device
    vector = torch.stack([norms[k].to(device) for k in _stacking_order(units, order, norms)])
    return torch.linalg.vector_norm(vector, 2.0)


def norm_order(params: list[nn.Parameter]) -> list[int]:
    """The order in which ``get_total_norm`` stacks per-parameter norms: grouped by (device, dtype) in order of
    first appearance, parameter order inside a group."""
    keys: dict[tuple[Any, Any], int] = {}
    for p in params:
        keys.setdefault((p.device, p.dtype), len(keys))
    return sorted(range(len(params)), key=lambda i: (keys[(params[i].device, params[i].dtype)], i))


def unit_norms(grads: dict[int, torch.Tensor], slots: np.ndarray) -> None:
    """Write each unit's gradient norm and a present flag into ``slots`` ([norms | flags], one each a unit)."""
    n = len(slots) // 2
    for members in _by_device_and_dtype(grads).values():
        norms = torch._foreach_norm([grads[k] for k in members], 2.0)
        # One copy to the host per group; a float32 (or lower) norm is exact in float64.
        values = torch.stack(norms).to(torch.float64).cpu().numpy()
        for k, value in zip(members, values):
            slots[k], slots[n + k] = value, 1.0


def combine(slots: np.ndarray, units: list[Unit], order: list[int], params: list[torch.Tensor]) -> torch.Tensor:
    """The total norm from per-unit ``slots`` ([norms | flags]), stacked as ``unit_grad_norm`` stacks them."""
    n = len(units)
    norms, present = slots[:n], slots[n:]
    picked = _stacking_order(units, order, {k for k in range(n) if present[k]})
    if not picked:
        return torch.tensor(0.0)
    device = params[0].device
    vector = torch.stack([torch.tensor(norms[k], dtype=params[units[k].param].dtype) for k in picked]).to(device)
    return torch.linalg.vector_norm(vector, 2.0)


def _by_device_and_dtype(grads: dict[int, torch.Tensor]) -> dict[Any, list[int]]:
    groups: dict[Any, list[int]] = {}
    for k, grad in grads.items():
        groups.setdefault((grad.device, grad.dtype), []).append(k)
    return groups


def _stacking_order(units: list[Unit], order: list[int], present: Any) -> list[int]:
    """The units with a norm (``k in present``), by parameter in ``order``, rows in order within one."""
    of_param: dict[int, list[int]] = {}
    for k, u in enumerate(units):
        of_param.setdefault(u.param, []).append(k)
    return [k for i in order for k in of_param.get(i, []) if k in present]
