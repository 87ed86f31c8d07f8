"""One measured training step of the plain model on this process: what the memory planner builds on.

``measure_step`` runs a forward, the loss and a backward at one rank's batch, then an optimizer step, and
tracks every tensor torch allocates meanwhile (a ``TorchDispatchMode`` that counts each output storage until
it is freed).  As hpcnet's reducer does, each parameter's gradient is dropped as soon as autograd hands it
over (it lives in a bucket, which the planner counts apart), so what is measured is the step's own transient
memory: activations, the backward's temporaries and the gradients in flight; and the optimizer's temporaries.
The optimizer's state exists before (a first, unmeasured step makes it).
"""

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive, and the most at any moment."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._seen or key in inputs or storage.nbytes() == 0:  # in place, or a view
                continue
            self._seen.add(key)
            nbytes = storage.nbytes()
            self.live += nbytes
            weakref.finalize(storage, self._freed, key, nbytes)
        self.peak = max(self.peak, self.live)
        return out


@dataclass(frozen=True)
class StepMemory:
    """A step's transient memory on the plain model at one rank's batch, bytes."""

    backward: int
    """The most the forward, loss and backward held at once beyond parameters, gradient buckets and optimizer
    state: activations, temporaries, gradients on their way to a bucket."""
    optimizer: int
    """The most the optimizer step held at once beyond the state it keeps."""
    batch: int


def measure_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, batch: tuple[Any, Any]
                 ) -> StepMemory:
    """Measure one step (see the module's doc); the model's parameters end as they were (the steps' updates are
    undone), its gradients None, and the optimizer's state as a first step made it."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    inputs, targets = batch

    def step_once() -> None:
        loss_fn(model, inputs, targets).backward()
        optimizer.step()
        for p in params:
            p.grad = None

    step_once()  # the optimizer's state, allocated for good
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
    try:
        with _LiveBytes() as tracker:
            loss_fn(model, inputs, targets).backward()
        backward = tracker.peak
    finally:
        for hook in hooks:
            hook.remove()
    for p in params:
        p.grad = torch.zeros_like(p)
    with _LiveBytes() as tracker:
        optimizer.step()
    optimizer_peak = tracker.peak
    with torch.no_grad():
        for p, value in zip(params, saved):
            p.copy_(value)
            p.grad = None
    return StepMemory(backward=backward, optimizer=optimizer_peak, batch=len(inputs))


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None
