"""The training objective: what a micro-batch's loss is, in training and in evaluation (``model.loss``).

Without ``model.loss`` the loss is the cross-entropy of the model's output against the targets of an
``(inputs, targets)`` batch (images, tokens, sequences), where the output is a tensor of logits or carries them as
``.logits`` (a Hugging Face model's output); a dict batch is passed as keywords, ``model(**batch)``, and the output's
own ``.loss`` is the loss (a Hugging Face model given ``labels``).  With ``model.loss = "package.module:function"``
the function is called as ``fn(model, batch)`` and returns the loss, or ``(loss, {name: tensor})`` with metrics of
its own that are averaged over the ranks, logged and evaluated like the loss.  ``batch`` is what the dataset
yields, on the device: a pair, a tuple, a dict, a tensor.

The loss is a micro-batch's mean, as the trainer weights it: by micro-batch count under accumulation, by each
rank's share of the global batch under ``data.balance``. Evaluation weights each batch by its samples (its
targets' elements for the default cross-entropy: tokens count alike). docs/data.md, "Your own objective".
"""

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hpcnet.agree import mark_agreed
from hpcnet.config.importing import load_object
from hpcnet.data.user import describe, first_tensor
from hpcnet.errors import UsageError
from hpcnet.fault.flightrec import NULL_RECORDER

CHECK_SAMPLES = 2
"""Samples of the train split the objective is tried on at start-up (``Objective.check``), on every rank alike."""
RESERVED_METRICS = ("loss", "accuracy", "lr", "epoch", "samples_per_s")
"""Names a user function's metrics cannot take: the loop logs these itself (``train_<name>``, ``eval_<name>``)."""


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward's precision context (``train.precision``): nothing for fp32 (bit for bit the plain forward),
    ``torch.autocast`` in bfloat16 for bf16 (matmuls and convolutions in bf16; losses, norms and softmax stay
    float32, as torch's autocast policy has it; parameters and gradients stay float32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def loss_and_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy and the number of correct predictions (tokens or images)."""
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    loss = F.cross_entropy(logits, targets)
    correct = (logits.argmax(dim=-1) == targets).sum()
    return loss, correct


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the output itself, its ``.logits`` or its ``"logits"``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise UsageError(f"model.loss is not set and the model returned {describe(output)}, not logits (a tensor, "
                     "or an output with .logits): set model.loss to a function fn(model, batch) that computes the "
                     "loss from it")


def compute_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The default training loss of one micro-batch (see the module docstring)."""
    return _default(model, batch)[0]


def samples_in(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (``hpcnet.data.user.first_tensor``); 0 without one."""
    first = first_tensor(batch)
    return 0 if first is None else int(first.shape[0]) if first.dim() else 1


def _default(model: nn.Module, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The default objective: (mean loss, correct predictions or None, elements the mean is over)."""
    if isinstance(batch, Mapping):
        output = model(**batch)
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor):
            raise UsageError(f"model.loss is not set, so a dict batch (keys {', '.join(map(repr, batch))}) is "
                             f"passed as model(**batch), and the model returned {describe(output)} without a "
                             ".loss: put the labels in the batch (a Hugging Face model computes its loss from "
                             "'labels'), or set model.loss")
        return loss, None, samples_in(batch)
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and all(isinstance(t, torch.Tensor) for t in batch)):
        raise UsageError(f"model.loss is not set and the dataset yields {describe(batch)}, not (inputs, targets) "
                         "tensors: set model.loss to a function fn(model, batch) that computes the loss from it")
    inputs, targets = batch
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise UsageError(f"model.loss is not set, so the loss is cross-entropy over classes, and the targets are "
                         f"{targets.dtype}, not class indices: set model.loss (e.g. a function returning "
                         "torch.nn.functional.mse_loss(model(x), y) for regression)")
    logits = logits_of(model(inputs))
    loss, correct = loss_and_correct(logits, targets)
    return loss, correct, targets.numel()


class Objective:
    """The loss of a micro-batch (``__call__``, in training) and the evaluation's sums (``evaluate``).

    A user function's metrics of the step's calls (since ``start_step``) are kept, detached and summed on the
    device, so the loop logs the step's means (``take_metrics``) beside its loss.
    """

    def __init__(self, spec: str = "", *, device: torch.device | None = None, precision: str = "fp32") -> None:
        """The objective of ``model.loss`` and ``train.precision``.

        Args:
            spec: ``model.loss`` (empty: the default).
            device: where the forward runs (``train.precision``'s autocast needs its type).
            precision: ``train.precision``.
        """
        self.spec = spec
        self.fn: Callable[..., Any] | None = load_object(spec, "model.loss") if spec else None
        self.device = device or torch.device("cpu")
        self.precision = precision
        self.names: list[str] = []
        """The user function's metric names, fixed by its first call (``check``), the same on every rank
        (``agree_names``)."""
        self._checked = False
        self._sums: dict[str, torch.Tensor] = {}
        self._calls = 0
        self.slow: Callable[[int], None] | None = None
        """``fault.slow_per_sample_s``: called with a micro-batch's samples before its forward."""

    def _call(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The user function's (loss, metrics), checked."""
        assert self.fn is not None
        result = self.fn(model, batch)
        metrics: Any = {}
        if isinstance(result, tuple):
            if len(result) != 2 or not isinstance(result[1], Mapping):
                raise UsageError(f"model.loss: {self.spec!r} returned a tuple of {len(result)}; return the loss, "
                                 "or (loss, {name: tensor})")
            result, metrics = result
        if not isinstance(result, torch.Tensor) or result.numel() != 1 or not result.is_floating_point():
            raise UsageError(f"model.loss: {self.spec!r} returned {describe(result)} as the loss; return a "
                             "floating-point scalar tensor (the micro-batch's mean)")
        checked = {}
        for name, value in metrics.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise UsageError(f"model.loss: {self.spec!r} returned a metric named {name!r}; metric names are "
                                 "identifiers (letters, digits, '_')")
            if name in RESERVED_METRICS:
                raise UsageError(f"model.loss: {self.spec!r} returned a metric named {name!r}, which hpcnet logs "
                                 f"itself; name it otherwise ({', '.join(RESERVED_METRICS)} are taken)")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = torch.tensor(float(value))
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                raise UsageError(f"model.loss: {self.spec!r} returned metric {name!r} as {describe(value)}; "
                                 "return a scalar tensor or number")
            checked[name] = value.detach().reshape(())
        if self._checked and sorted(checked) != self.names:
            raise UsageError(f"model.loss: {self.spec!r} returned metrics {sorted(checked)}, where its first call "
                             f"returned {self.names}; return the same names every call")
        return result.reshape(()), checked

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The training loss of one micro-batch, under ``train.precision``."""
        if self.slow is not None:
            self.slow(samples_in(batch))
        with autocast(self.device, self.precision):
            if self.fn is None:
                return compute_loss(model, batch)
            loss, metrics = self._call(model, batch)
        if metrics:
            self._calls += 1
            for name, value in metrics.items():  # summed on the device: no synchronisation a micro-batch
                self._sums[name] = self._sums[name] + value if name in self._sums else value.float()
        return loss

    def start_step(self) -> None:
        """Forget the metrics of earlier steps: ``take_metrics`` then gives this step's, as the loss logged."""
        self._sums, self._calls = {}, 0

    def take_metrics(self) -> dict[str, float]:
        """The mean of each metric over the calls since ``start_step`` (the step's micro-batches); empty without a
        user function's metrics."""
        if not self._calls:
            return {}
        taken = {name: total.item() / self._calls for name, total in self._sums.items()}
        self.start_step()
        return taken

    def check(self, model: nn.Module, split: Any, move: Callable[[Any], Any]) -> None:
        """Try the objective on the first samples of ``split`` (in eval mode, the RNG state kept), so that an objective
        that does not fit the data or the model fails at start-up, where every rank sees it (the caller's
        ``shared_errors``), rather than as one rank's failure in the first step: what it returns wrongly is a
        ``UsageError``, an exception in the model or the function a ``RuntimeError`` saying where."""
        samples = min(CHECK_SAMPLES, len(split))
        batch = move(split.read(np.arange(samples)))
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
                with autocast(self.device, self.precision):
                    if self.fn is None:
                        loss = _default(model, batch)[0]
                    else:
                        loss, metrics = self._call(model, batch)
                        self.names, self._checked = sorted(metrics), True
        except UsageError:
            raise
        except Exception as exc:  # the model's or the function's code: a code error (status 1), said on every rank
            what = f"model.loss {self.spec!r}" if self.fn is not None else "the model (default loss: cross-entropy)"
            raise RuntimeError(f"{what} failed on the first {samples} samples of the train split: "
                               f"{type(exc).__name__}: {exc}") from exc
        finally:
            model.train(was_training)
        if not loss.requires_grad:
            raise UsageError(f"{'model.loss: ' + repr(self.spec) if self.fn else 'the loss'} does not depend on "
                             "the model's parameters (no gradient would reach them): compute it from the model's "
                             "output")

    def agree_names(self, comm: Any) -> None:
        """Collective, once after ``check``: every rank's metric names must be rank 0's, as the ranks' values are
        averaged name by name (``evaluate`` sums them by position).  A rank's names never change after its check
        (``_call`` refuses that), so this one exchange holds for the run.

        Raises:
            UsageError: on every rank alike, naming the ranks and their names, when they differ.
        """
        if self.fn is None:
            return
        every = comm.allgather(self.names)
        if all(names == every[0] for names in every):
            return
        ranks: dict[tuple[str, ...], list[int]] = {}
        for rank, names in enumerate(every):
            ranks.setdefault(tuple(names), []).append(rank)
        said = "; ".join(f"rank {r[0]}: {list(names)}" if len(r) == 1 else f"ranks {r}: {list(names)}"
                         for names, r in ranks.items())
        raise mark_agreed(UsageError(f"model.loss: {self.spec!r} returns other metric names on other ranks: {said}; "
                                     "return the same names on every rank (their values are averaged over the "
                                     "ranks name by name)"))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: Any, comm: Any, *, indices: np.ndarray, batch_size: int,
                 max_batches: int, move: Callable[[Any], Any], recorder: Any = NULL_RECORDER,
                 scope: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> dict[str, float]:
        """The mean loss and metrics over this rank's ``indices`` of ``split``, summed over the ranks (collective):
        ``eval_loss``, and ``eval_accuracy`` for the default cross-entropy, or ``eval_<name>`` for each of the
        user function's metrics.  This rank's batches run inside ``scope()`` (``DataParallel.params_in_use``:
        ranks with fewer batches serve the others' gathers at ``dist.zero=3``)."""
        from mpi4py import MPI

        names = ["loss", "accuracy"] if self.fn is None else ["loss", *self.names]
        totals = np.zeros(len(names) + 1)  # weighted sums, then the weight
        was_training = model.training
        model.eval()  # dropout off, batch norm from its running statistics (and not updated by the eval shards)
        try:
            with scope():
                self._evaluate(model, split, indices, batch_size, max_batches, move, totals)
        finally:
            model.train(was_training)
        with recorder.op("eval.allreduce"):
            comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
        weight = max(totals[-1], 1)
        result = {f"eval_{name}": totals[i] / weight for i, name in enumerate(names)}
        if self.fn is None and math.isnan(result["eval_accuracy"]):
            del result["eval_accuracy"]  # a dict batch's own loss: no predictions to count
        return result

    def _evaluate(self, model: nn.Module, split: Any, indices: np.ndarray, batch_size: int, max_batches: int,
                  move: Callable[[Any], Any], totals: np.ndarray) -> None:
        """This rank's weighted sums of ``evaluate``'s figures, into ``totals``."""
        for n, start in enumerate(range(0, len(indices), batch_size)):
            if max_batches and n >= max_batches:
                break
            batch = move(split.read(indices[start:start + batch_size]))
            with autocast(self.device, self.precision):
                if self.fn is None:  # the summed loss, the correct predictions (a dict batch's own loss: none)
                    loss, correct, count = _default(model, batch)
                    sums = [loss.item() * count, math.nan if correct is None else correct.item()]
                else:  # the loss and each metric, weighted by the batch's samples
                    loss, metrics = self._call(model, batch)
                    count = samples_in(batch)
                    sums = [loss.item() * count, *(float(metrics[name]) * count for name in self.names)]
            totals += (*sums, count)

