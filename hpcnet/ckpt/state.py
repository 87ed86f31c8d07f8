"""What a training run saves and restores: its parts (``hpcnet.stateful``), collected by ``TrainState``, and
the RNG, one of them (``RngState``).

``TrainState`` merges the parts' entries into one ``CheckpointManager`` save and hands a loaded checkpoint back to
each; it knows the parts only through the protocol.  When to save is ``hpcnet.ckpt.schedule``'s.
"""

import logging
import random
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpcnet.agree import shared_errors
from hpcnet.ckpt.load import Loaded
from hpcnet.ckpt.manager import CheckpointManager
from hpcnet.config import Config
from hpcnet.config.load import to_dict
from hpcnet.stateful import Entries, Saved, Stateful, wanted_by

log = logging.getLogger(__name__)


def rng_state() -> dict[str, Any]:
    """This rank's torch (CPU and CUDA), numpy and ``random`` generator states, as JSON-able values."""
    name, key, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes().hex(),
        "numpy": {"name": name, "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes().hex() for s in torch.cuda.get_rng_state_all()]
    return state


def _hex_bytes(value: Any, length: int, what: str) -> torch.Tensor:
    if not isinstance(value, str) or len(value) != 2 * length:
        raise ValueError(f"RNG state {what}: expected {length} bytes of hex")
    return torch.frombuffer(bytearray(bytes.fromhex(value)), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned; ValueError if the values are not of the expected form."""
    try:
        torch_state = _hex_bytes(state["torch"], torch.get_rng_state().numel(), "torch")
        np_state = state["numpy"]
        key = np.array(np_state["key"], dtype=np.uint32)
        if np_state["name"] != "MT19937" or key.shape != (624,):
            raise ValueError("RNG state numpy: not an MT19937 state")
        py_state = state["python"]
        internal = tuple(int(v) for v in py_state["internal"])
        if py_state["version"] != 3 or len(internal) != 625:
            raise ValueError("RNG state python: not a version-3 state")
        gauss = py_state["gauss_next"]
        if gauss is not None and not isinstance(gauss, float):
            raise ValueError("RNG state python: bad gauss_next")
        np_tuple = ("MT19937", key, int(np_state["pos"]), int(np_state["has_gauss"]),
                    float(np_state["cached_gaussian"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"RNG state is malformed: {exc!r}") from None
    torch.set_rng_state(torch_state)
    np.random.set_state(np_tuple)
    random.setstate((3, internal, gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        length = torch.cuda.get_rng_state().numel()
        if isinstance(cuda, list) and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_hex_bytes(s, length, "cuda") for s in cuda])


class RngState(Stateful):
    """This rank's random generators (``rng_state``), in its own ``/rank_state`` row; a rank the saving run did not
    have (a resume on more ranks) takes a fresh, distinct, reproducible torch seed from ``seed``, its rank and
    the step."""

    def __init__(self, seed: int, rank: int) -> None:
        self.seed, self.rank = seed, rank

    def state_entries(self) -> Entries:
        return Entries(rank_state=rng_state())

    def load_entries(self, saved: Saved) -> None:
        if saved.rank_state is not None:
            set_rng_state(saved.rank_state)
        else:
            torch.manual_seed(zlib.crc32(f"{self.seed}/{self.rank}/{saved.step}".encode()))


class TrainState:
    """The parts of a run that a checkpoint holds, and the run's saves and resume.

    Args:
        cfg: the run's options, saved in every checkpoint (the meta's ``config``) beside the parts' entries.
        parts: the parts that hold state (``hpcnet.stateful.Stateful``), in the order a checkpoint lists their
            tensors and a resume hands them back (``hpcnet.train`` lists the trainer's).
        manager: where the checkpoints go.
    """

    def __init__(self, cfg: Config, parts: list[Stateful], manager: CheckpointManager) -> None:
        self.cfg, self.parts, self.manager = cfg, list(parts), manager
        self.last_saved_step = -1

    def entries(self) -> Entries:
        """Collective: every part's entries, in the parts' order (ValueError when two offer one name)."""
        entries = Entries()
        for part in self.parts:
            entries.add(part.state_entries())
        return entries

    def save(self, step: int) -> Path:
        """Collective: checkpoint the state after ``step`` (blocks only for the snapshot when async)."""
        entries = self.entries()
        entries.add(Entries(meta={"config": to_dict(self.cfg), "step": step}))
        path = self.manager.save(step, entries.tensors, entries.meta, entries.rank_state, holders=entries.holders)
        self.last_saved_step = step
        timings = self.manager.last_timings
        log.info("checkpoint at step %d: %s (%s, blocked %.3f s)", step, path.name,
                 "writing in the background" if self.manager.async_save else "written",
                 timings.get("blocking_s", 0.0))
        return path

    def is_finite(self) -> bool:
        """Collective: whether the parts' tensors hold only finite numbers on every rank.

        A pass over the whole state, so it runs before saves only: the per-step
        checks see the loss and the gradient norm, not an update that overflowed
        (a finite gradient times a huge learning rate) or statistics a forward
        pass left non-finite.
        """
        from mpi4py import MPI

        checks: dict[torch.device, list[torch.Tensor]] = {}
        for tensor in self.entries().tensors.values():
            if tensor.is_meta:
                continue  # held by another rank (dist.zero), which checks it
            if tensor.is_floating_point() or tensor.is_complex():
                checks.setdefault(tensor.device, []).append(torch.isfinite(tensor).all())
        # One device-to-host copy per device (Adam keeps its step counters on the CPU).
        finite = all(bool(torch.stack(flags).all()) for flags in checks.values())
        return bool(self.manager.comm.allreduce(int(finite), op=MPI.MIN))

    def start(self, which: str, *, otherwise: str = "") -> int:
        """Collective: begin the run, fresh (``''``) or from a checkpoint (``'auto'`` or a path).

        Returns the step to continue from.  A fresh run needs a checkpoint
        directory of its own (see ``CheckpointManager.start_fresh``).  ``otherwise``
        (``checkpoint.resume_else``): where ``'auto'`` starts while the directory holds no
        committed checkpoint ('' fresh): a restart of a run that began from another
        run's checkpoint goes back to it until it has committed one of its own.
        """
        if not which:
            self.manager.start_fresh()
            return 0
        log.info("resume: reading the %s checkpoint of %s", "newest committed" if which == "auto" else "given",
                 which if which != "auto" else self.manager.directory)
        t0 = time.perf_counter()
        # Read straight into the parts' own tensors where they fit (CPU), as torch.distributed.checkpoint loads into
        # the state dict's: a resume then holds no second copy of the model, and with a sharded optimizer no other
        # rank's state either, so it fits wherever a step does.
        into = {name: tensor for name, tensor in self.entries().tensors.items() if not tensor.is_meta}
        loaded = self.manager.resume(which, into=into, wanted_from_meta=self.before_read)
        if loaded is None and otherwise:
            log.info("no checkpoint in %s yet: resuming from %s (checkpoint.resume_else)", self.manager.directory,
                     otherwise)
            loaded = self.manager.resume(otherwise, into=into, wanted_from_meta=self.before_read)
        if loaded is None:
            log.info("no checkpoint in %s yet: starting from step 0", self.manager.directory)
            return 0
        self._restore(loaded)
        log.info("resume: checkpoint read and restored in %.2f s", time.perf_counter() - t0)
        return loaded.step

    def before_read(self, meta: dict[str, Any]) -> Callable[[str], bool] | None:
        """Collective, before the load reads a tensor: every part readies itself for the checkpoint (the owners in
        force take those it was saved under, while the optimizer holds no state: nothing moves), then what this
        rank reads."""
        for part in self.parts:
            part.before_read(meta)
        return wanted_by(self.parts)

    def _restore(self, loaded: Loaded) -> None:
        saved = Saved(loaded.tensors, loaded.meta, loaded.rank_state, loaded.saved_world_size, loaded.step,
                      source=f"checkpoint {str(loaded.path)!r}")
        # Everything here may fail on some ranks only (each restores its own
        # RNG state), so the outcome is shared before the next collective.
        with shared_errors(self.manager.comm):
            for part in self.parts:
                part.load_entries(saved)
        self.last_saved_step = loaded.step
        log.info("resumed from %s at step %d (saved by %d rank(s)%s)", loaded.path, loaded.step,
                 loaded.saved_world_size,
                 f"; skipped {len(loaded.skipped)} unusable newer checkpoint(s)" if loaded.skipped else "")
