"""Live recovery (``fault.recovery=shrink``): when ranks die, the survivors shrink the job's communicator and
build the trainer again on it, in the same processes, and go on.

The seam is the one a resume uses (docs/architecture.md, "Parts and rebuilds"): ``hpcnet.train`` builds every
holder of a communicator again on the survivors' (the monitor, the data plane, ``DataParallel``, the checkpoint
manager, the loader's sampler, the loop) and hands the parts their state back, from one of two places:

- **memory**, where every rank holds the whole state (``dist.zero=0`` without int8's per-rank residuals): each
  survivor keeps its own parts' entries; survivors that stopped on either side of an update (one finished the
  step's all-reduce, another did not) take the entries of one that is furthest, so every survivor goes on from the
  same step and no step is recomputed;
- **the newest committed checkpoint**, read in-process at the new size, where a lost rank took shards of the state
  with it (``dist.zero`` 1 to 3): the steps since that checkpoint are recomputed.

The job keeps its global batch: the survivors split the same global batches (``GlobalBatchSampler``'s
``global_batch``) and weight their gradients by their slices, so the run goes on training what it trained.
"""

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hpcnet.agree import is_agreed, shared_errors
from hpcnet.config import Config
from hpcnet.errors import UsageError
from hpcnet.fault.survive import is_process_failure, peers_lost, shrink
from hpcnet.fault.ulfm import FaultTolerance, detect, recovery_mode
from hpcnet.stateful import Entries, Saved
from hpcnet.world import World

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Carried:
    """This rank's entries of every part, kept across a rebuild, and the step they are after."""

    step: int
    entries: Entries
    last_saved_step: int


def _digest(entries: Entries) -> int:
    """A checksum of a rank's state (CRC-32 over its tensors' bytes, in order): survivors at one step must hold the
    same. A collective that a dead peer left half done may complete on a survivor with its part missing (seen:
    garbage sizes in a pickled all-gather under Open MPI 5.0's ULFM), so a memory that differs is not trusted."""
    crc = 0
    for name, tensor in entries.tensors.items():
        crc = zlib.crc32(name.encode(), crc)
        if not tensor.is_meta:
            crc = zlib.crc32(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


@dataclass
class Live:
    """What a job that survives lost ranks keeps from one world to the next (``hpcnet.train.run`` holds one)."""

    cfg: Config
    mode: str = ""
    """'shrink' or 'restart', decided at the first start-up (``fault.recovery``)."""
    generation: int = 0
    """How many times the job has shrunk."""
    global_batch: int | None = None
    """Samples a micro-step of all ranks together, once the job has shrunk (None: ``batch_size`` x ranks)."""
    carried: Carried | None = None
    reload: bool = False
    """The next world starts from the newest committed checkpoint, in-process."""
    world: World | None = None
    probed: Any = None
    """The first world's probe (``hpcnet.train._probe``): the links it measured are the survivors' links."""
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    killed: set[int] = field(default_factory=set)
    """The steps whose injected kill has happened (``fault.kill_every_steps``): once in a job, whatever world."""
    _seen_at: float = 0.0
    _phases: dict[str, float] = field(default_factory=dict)
    _last: float = 0.0

    def mark(self, phase: str) -> None:
        """A rebuild's phase ends here (its time goes to the record's ``rebuild_phases_s``); outside one, nothing."""
        if not self._last:
            return
        now = time.perf_counter()
        self._phases[phase] = round(now - self._last, 4)
        self._last = now

    run_dir: Any = None
    mpi: FaultTolerance | None = None
    failed_step: int = -1
    """The step this rank had completed when it saw the loss (-1: before the loop)."""

    def decide(self, comm: Any, world: World, run_dir: Any) -> None:
        """At the first start-up (collective): the recovery mode, logged."""
        self.world, self.run_dir = world, run_dir
        if self.mode:
            return
        self.mpi = detect(comm)
        self.mode = recovery_mode(self.cfg.fault.recovery, self.mpi)  # an agreed ConfigError where impossible
        if world.is_main:
            log.info("recovery from lost ranks: %s (fault.recovery=%s; %s)",
                     "the survivors shrink the job and go on" if self.mode == "shrink"
                     else "the job ends and hpcnet.launch restarts it", self.cfg.fault.recovery, self.mpi.describe())

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole state (then a rebuild takes it from memory)."""
        return self.cfg.dist.zero == 0 and self.cfg.dist.compression != "int8"

    def survives(self, exc: BaseException, comm: Any) -> bool:
        """Whether this error is a lost peer that the job goes on without: an MPI process failure, or an error of
        this rank alone while it knows of a failed peer in ``comm`` (an agreed error is everyone's verdict)."""
        if self.mode != "shrink":
            return False
        return is_process_failure(exc) or (not is_agreed(exc) and peers_lost(comm))

    def keep(self, state: Any, step: int) -> None:
        """In the trainer, as an error that ``survives`` propagates: this rank's parts' entries, where they are
        the whole state (no collective: each part's entries are its own tensors here)."""
        self._seen_at = time.perf_counter()
        self.failed_step = step
        if self.replicated:
            self.carried = Carried(step, state.entries(), state.last_saved_step)

    def recover(self, comm: Any, exc: BaseException) -> Any:
        """Every survivor: revoke, shrink, agree where the state comes from; the survivors' communicator.
        A failure that lost no rank (a revoke with everyone alive) is raised again."""
        if not self._seen_at:
            self._seen_at = time.perf_counter()
        shrunk = shrink(comm)
        if not shrunk.lost:
            raise exc
        new = shrunk.comm
        old_size = comm.Get_size()
        reached = new.allgather((self.carried.step if self.carried is not None else -1, self.failed_step,
                                 _digest(self.carried.entries) if self.carried is not None else 0))
        kept = [step for step, _, _ in reached]
        furthest = {digest for step, _, digest in reached if step == max(kept)}
        if self.replicated and min(kept) >= 0 and len(furthest) == 1:
            if min(kept) != max(kept):  # some finished the interrupted update: every survivor takes theirs
                source = kept.index(max(kept))
                mine = self.carried
                theirs = new.bcast(mine if new.Get_rank() == source else None, root=source)
                theirs.entries.rank_state = mine.entries.rank_state  # its own generators, as ever
                self.carried = theirs
            self.reload = False
        else:  # sharded state, a survivor before the loop, or states that differ at one step: the checkpoint
            self.carried, self.reload = None, True
        assert self.world is not None
        hosts = self.world.hostnames
        if self.global_batch is None:
            self.global_batch = self.cfg.train.batch_size * old_size
        self.generation += 1
        self.recoveries.append({
            "lost": [{"rank": r, "host": hosts[r]} for r in shrunk.lost],
            "world_size": new.Get_size(), "from_world_size": old_size,
            "step": max(step for _, step, _ in reached),
            "state": "memory" if self.carried is not None else "checkpoint",
            "error": f"{type(exc).__name__}: {exc}"[:300], "shrink_s": round(shrunk.shrink_s, 4)})
        self._last, self._phases = time.perf_counter(), {}
        return new

    def route(self, agree: Callable[[], Any], world: World) -> Any:
        """The gradients' route (``agree``: ``hpcnet.comm.route.agree_route`` for this world). After a shrink, an
        option that needs as many ranks on every node (``dist.hierarchical=on``, ``dist.compression=int8``) and
        that the survivors' nodes no longer have falls back to ``auto``, said once: the job goes on rather than
        ending with status 2 (the error is agreed, so every rank takes this path)."""
        dist = self.cfg.dist
        try:
            return agree()
        except UsageError:
            if not self.generation or (dist.hierarchical != "on" and dist.compression != "int8"):
                raise
        if world.is_main:
            log.warning("the survivors' nodes have unequal rank counts: %s falls back to auto for the rest of the "
                        "run", " and ".join(f"dist.{name}={value}" for name, value in
                                           (("hierarchical", dist.hierarchical), ("compression", dist.compression))
                                           if value in ("on", "int8")))
        if dist.hierarchical == "on":
            dist.hierarchical = "auto"
        if dist.compression == "int8":
            dist.compression = "auto"
        return agree()

    def restore(self, state: Any, comm: Any, resume: str) -> int | None:
        """In the rebuilt trainer, where a fresh start or a resume would begin: the step to go on from, the parts
        given back (collective); None where this world is the job's first."""
        if self.carried is not None:  # kept until the rebuild is done: a loss meanwhile starts from it again
            carried = self.carried
            saved = Saved(carried.entries.tensors, carried.entries.meta, carried.entries.rank_state,
                          saved_world_size=self.recoveries[-1]["from_world_size"], step=carried.step,
                          source="the survivors' memory")
            with shared_errors(comm):
                for part in state.parts:
                    part.load_entries(saved)
            state.last_saved_step = carried.last_saved_step
            return carried.step
        if self.reload:
            return state.start("auto", otherwise=resume)
        return None

    def rebuilt(self, comm: Any, world: World, step: int) -> None:
        """The rebuild is done: one line on the new rank 0, and the record's times (collective)."""
        self.carried, self.reload, self.failed_step = None, False, -1
        if not self.recoveries or "rebuild_s" in self.recoveries[-1]:
            return
        record = self.recoveries[-1]
        self.mark("state")
        record["rebuild_s"] = round(time.perf_counter() - self._seen_at - record["shrink_s"], 4)
        record["rebuild_phases_s"], self._last = self._phases, 0.0
        record["resumed_step"] = step
        record["recomputed_steps"] = max(0, record["step"] - step)
        self._seen_at = 0.0
        if world.is_main:
            lost = ", ".join(f"rank {x['rank']} ({x['host']})" for x in record["lost"])
            log.warning("lost %s at step %d: the %s shrank the job in %.3f s and rebuilt it in %.3f s; "
                        "training goes on at step %d from %s%s, global batch %d kept", lost, record["step"],
                        f"{world.size} survivors" if world.size > 1 else "survivor", record["shrink_s"],
                        record["rebuild_s"], step,
                        "memory" if record["state"] == "memory" else "the newest checkpoint",
                        f" ({record['recomputed_steps']} steps to compute again)" if record["recomputed_steps"] else
                        "", self.global_batch * self.cfg.train.grad_accumulation)
        self.world = world

    def summary(self) -> dict[str, Any]:
        """summary.json's ``recovery``."""
        return {"recovery": {"mode": self.mode, "mpi": {} if self.mpi is None else asdict(self.mpi),
                             "recoveries": self.recoveries}}
