"""One measured training step of the plain model on this process: what the memory planner builds on.

``measure_step`` runs a forward, the loss and a backward at one rank's batch, then an optimizer step, and
tracks every tensor torch allocates meanwhile (a ``TorchDispatchMode`` that counts each output storage until
it is freed).  As hpcnet's reducer does, each parameter's gradient is dropped as soon as autograd hands it
over (it lives in a bucket, which the planner counts apart), so what is measured is the step's own transient
memory: activations, the backward's temporaries and the gradients in flight; and the optimizer's temporaries.
The optimizer's state exists before (a first, unmeasured step makes it).  ``measure_model`` gives what the
planner knows of a model (``ModelMemory``): its parameter sizes and its measured steps.
"""

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hpcnet.objective import samples_in


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages created under it that are still alive, and the most at any moment."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.handed = 0  # gradient bytes autograd handed over so far (``_Dropper``)
        self.timeline: list[tuple[int, int]] = []  # (live, handed) at each rise of live
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
        if self.live > self.peak:
            self.peak = self.live
        if not self.timeline or self.timeline[-1] != (self.live, self.handed):
            self.timeline.append((self.live, self.handed))
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
    state_bytes: int
    """The optimizer's state after a step (all parameters)."""
    forward_backward_s: float
    """Seconds of the measured forward and backward."""
    timeline: tuple[tuple[int, int], ...] = ()
    """(transient bytes alive, gradient bytes handed over so far) through the backward: where a rank keeps a
    share of each gradient once its bucket is summed (``dist.zero=2``), its peak is the most of
    ``alive + share * handed``, which may come later than the peak of ``alive`` alone."""
    state_sizes: tuple[int, ...] = ()
    """The optimizer's state bytes of each trainable parameter, in model order: what its owner keeps (AdamW twice
    the parameter, Adafactor a row and a column of each matrix, SGD without momentum nothing).  Empty: in
    proportion to the parameters' bytes."""

    def backward_with_kept(self, fraction: float) -> int:
        """The backward's peak when ``fraction`` of every gradient handed over stays alive until the step ends."""
        if not self.timeline:
            return self.backward
        return int(max(live + fraction * handed for live, handed in self.timeline))


@dataclass(frozen=True)
class ModelMemory:
    """What the planner knows of the model: its trainable parameters' sizes, its blocks' share of them, and the
    measured steps by checkpointing choice ('off', 'blocks')."""

    sizes: list[int]
    shapes: list[tuple[int, ...]]
    block_share: float
    steps: dict[str, StepMemory] = field(default_factory=dict)
    n_blocks: int = 0
    elementwise: bool = True
    """Whether the optimizer's update is elementwise: whether ``dist.zero`` may cut a parameter into row ranges
    (``hpcnet.comm.sharding.layout``); if not, each rank owns whole parameters."""

    def blocks_of(self, checkpointing: "str | int") -> int:
        """How many blocks a choice checkpoints: 'off' none, 'blocks' all, or the number itself."""
        if isinstance(checkpointing, int):
            if not 0 <= checkpointing <= self.n_blocks:
                raise ValueError(f"{checkpointing} blocks checkpointed, the model has {self.n_blocks}")
            return checkpointing
        return {"off": 0, "blocks": self.n_blocks}[checkpointing]

    def label(self, k: int) -> str:
        return "off" if k == 0 else "blocks" if k == self.n_blocks else f"{k} of {self.n_blocks} blocks"

    @property
    def param_bytes(self) -> int:
        return sum(self.sizes)


def measure_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Any, batch: Any
                 ) -> StepMemory:
    """Measure one step (see the module's doc); the model's parameters end as they were (the steps' updates are
    undone), its gradients None, and the optimizer's state as a first step made it."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]

    def step_once() -> None:
        loss_fn(model, batch).backward()
        optimizer.step()
        for p in params:
            p.grad = None

    step_once()  # the optimizer's state, allocated for good
    state_sizes = tuple(_state_bytes(optimizer.state.get(p, {})) for p in params)
    tracker = _LiveBytes()

    def hand_over(p: torch.Tensor) -> None:
        tracker.handed += p.grad.numel() * p.grad.element_size()
        p.grad = None  # as the reducer does once it folded it into its bucket

    hooks = [p.register_post_accumulate_grad_hook(hand_over) for p in params]
    try:
        with tracker:
            loss_fn(model, batch).backward()
        backward, timeline = tracker.peak, _rises(tracker.timeline)
        started = time.perf_counter()  # timed apart: the tracker's bookkeeping slows every operation
        loss_fn(model, batch).backward()
        seconds = time.perf_counter() - started
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
    return StepMemory(backward=backward, optimizer=optimizer_peak, batch=samples_in(batch),
                      state_bytes=sum(state_sizes), forward_backward_s=seconds, timeline=timeline,
                      state_sizes=state_sizes)


def _state_bytes(state: dict[str, Any]) -> int:
    """Bytes of one parameter's optimizer state: its tensors (a step counter on the CPU among them)."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def _rises(timeline: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The points that can be a peak of ``live + f * handed`` for some f in [0, 1]: each a local top of ``live``
    (the last point before it falls)."""
    kept = [point for point, after in zip(timeline, timeline[1:]) if after[0] < point[0]]
    return tuple(kept + timeline[-1:])


def measure_model(model: nn.Module, optimizer_factory: Any, loss_fn: Any, batch: Any, *,
                  elementwise: bool = True) -> ModelMemory:
    """``ModelMemory`` of ``model``: its parameter sizes, its blocks' share, and one measured step
    without checkpointing and, where it has blocks (``model.blocks=auto``), one with them checkpointed.
    ``optimizer_factory(model)`` makes a fresh optimizer (dropped after); ``elementwise``: whether its update is
    (``ModelMemory.elementwise``)."""
    from hpcnet.models.blocks import checkpoint_blocks, find_blocks, uncheckpoint_blocks

    params = [p for p in model.parameters() if p.requires_grad]
    blocks = find_blocks(model)
    inside = {id(p): p.numel() for _, b in blocks for p in b.parameters() if p.requires_grad}
    total = sum(p.numel() for p in params) or 1
    memory = ModelMemory(sizes=[p.numel() * p.element_size() for p in params],
                         shapes=[tuple(p.shape) for p in params], block_share=sum(inside.values()) / total,
                         n_blocks=len(blocks), elementwise=elementwise)
    memory.steps["off"] = measure_step(model, optimizer_factory(model), loss_fn, batch)
    if blocks:
        fresh = [b for _, b in blocks if not getattr(b, "_hpcnet_checkpointed", False)]
        checkpoint_blocks(blocks)
        try:
            memory.steps["blocks"] = measure_step(model, optimizer_factory(model), loss_fn, batch)
        finally:
            uncheckpoint_blocks([(name, b) for name, b in blocks if b in fresh])
    return memory


def measure_config(cfg: Any, model: nn.Module, split: Any) -> ModelMemory:
    """``measure_model`` for a run's configuration: ``train.batch_size`` samples of ``split`` (the first ones),
    the run's optimizer (``optim.*``) and precision (``train.precision``), on the model's device."""
    import numpy as np

    from hpcnet.models.device import map_tensors
    from hpcnet.objective import Objective
    from hpcnet.optim import build_optimizer, is_elementwise

    device = next(model.parameters()).device
    batch = map_tensors(lambda t: t.to(device), split.read(np.arange(min(cfg.train.batch_size, len(split)))))
    # The first optimizer built (a factory's may be known by its class alone) says whether the update is
    # elementwise, then serves the first measured step: built once, not held after it.
    pending = [build_optimizer(model, cfg.optim)]
    elementwise = is_elementwise(pending[0], cfg.optim)
    return measure_model(model, lambda m: pending.pop() if pending else build_optimizer(m, cfg.optim),
                         Objective(cfg.model.loss, device=device, precision=cfg.train.precision), batch,
                         elementwise=elementwise)


def status_kib(field: str) -> int:
    """A field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``); 0 where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def settled_kib() -> int:
    """Resident KiB after freed memory went back to the system (``gc``, then ``malloc_trim``)."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status_kib("VmRSS")


def reset_peak() -> None:
    """Start the high-water mark (``VmHWM``) at the present resident memory (Linux >= 4.0; else nothing)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class ResidentPeak:
    """This process's resident memory above a baseline, and its high-water mark since the last ``reset``; zeros
    where ``/proc`` has neither.  Both the baseline and the reset first return freed memory to the system
    (``settled_kib``), so memory an earlier phase of the process freed but kept is not taken for the run's or
    hidden under the baseline."""

    def __init__(self) -> None:
        self.baseline = settled_kib()

    def reset(self) -> None:
        """Start the high-water mark at the present resident memory (after the planner's own measurement)."""
        settled_kib()
        reset_peak()

    def peak_bytes(self) -> int:
        return max(0, status_kib("VmHWM") - self.baseline) * 1024
