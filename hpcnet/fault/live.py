"""Live recovery (``fault.recovery=shrink``): when ranks die, the survivors shrink the job's communicator and
build the trainer again on it, in the same processes, and go on.

The seam is the one a resume uses (docs/architecture.md, "Parts and rebuilds"): ``hpcnet.train`` builds every
holder of a communicator again on the survivors' (the monitor, the data plane, ``DataParallel``, the checkpoint
manager, the loader's sampler, the loop) and hands the parts their state back, from one of two places:

- **memory**, where every rank holds the whole state (``dist.zero=0`` without int8's per-rank residuals): each
  survivor keeps its own parts' entries; survivors that stopped on either side of an update (one finished the
  step's all-reduce, another did not) take the entries of one that is furthest, so every survivor goes on from the
  same step and no step is recomputed;
- **the mirrors** (``fault.replicas=1``, ``hpcnet.fault.mirror``), where a lost rank took shards of the state with
  it (``dist.zero`` 1 to 3) and its keeper survived: the survivors' snapshots of the last step's end and the lost
  ranks' shards from their keepers, handed over as a grow hands them (``hand_over``);
- **the newest committed checkpoint**, read in-process at the new size, otherwise: the steps since that checkpoint
  are recomputed.

The job keeps its global batch: the survivors split the same global batches (``GlobalBatchSampler``'s
``global_batch``) and weight their gradients by their slices, so the run goes on training what it trained.

With ``fault.grow=spawn`` the survivors then start replacements in the background and grow back to the first size
at a step boundary (``hpcnet.fault.grow``): the same rebuild again, on the merged communicator, with the state
handed over from the ranks that hold it.
"""

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from hpcnet.agree import is_agreed, mark_agreed, shared_errors
from hpcnet.config import Config
from hpcnet.errors import RestartableError, UsageError
from hpcnet.fault.grow import Replacements, hand_over
from hpcnet.fault.mirror import Mirror, mirrored_step, snapshot
from hpcnet.fault.survive import is_process_failure, peers_lost, shrink, track
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
    """A checksum of the tensors of a rank's state that no single rank holds (CRC-32 over their bytes, in order):
    survivors at one step must hold the same. A collective that a dead peer left half done may complete on a
    survivor with its part missing (seen: garbage sizes in a pickled all-gather under Open MPI 5.0's ULFM), so a
    memory that differs is not trusted. Tensors that differ between ranks until the next step makes them equal
    (``Entries.synced``: batch norm's statistics) are left out: the rebuilt job's first step gives every survivor
    the new rank 0's."""
    crc = 0
    for name, tensor in entries.tensors.items():
        crc = zlib.crc32(name.encode(), crc)
        if name not in entries.holders and name not in entries.synced:
            crc = zlib.crc32(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


GROW_WAIT_S = 300.0
"""How long the survivors wait for replacements at ``fault.grow_after_steps``."""
_SENT = ("cfg", "mode", "mpi", "generation", "global_batch", "world", "run_dir", "probed", "recoveries", "grows",
         "killed", "size")
"""What a replacement receives of the survivors' ``Live`` (``Live.grow``, ``Live.receive``)."""


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
    size: int = 0
    """The first world's size: what the job grows back to (``fault.grow``)."""
    replacements: Replacements | None = None
    """Replacements being started, or waiting to join (the survivors' side of ``hpcnet.fault.grow``)."""
    handover: bool = False
    """The next world takes the state from the ranks that hold it (a grow: ``hpcnet.fault.grow.hand_over``)."""
    grows: list[dict[str, Any]] = field(default_factory=list)
    original: bool = True
    """This process is one of the job's first (not a replacement)."""
    mirror: Mirror | None = None
    """``fault.replicas=1``: this rank's snapshot and its ward's mirror (made at the first rebuilt world)."""
    from_mirrors: bool = False
    """The next world takes the state from the mirrors (``hand_over``, from the lost world's size)."""
    _mirror_decided: bool = False
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
        self.size = world.size
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
        self.dismiss(lost=True, gone=shrunk.lost)  # the next rebuild starts replacements for every lost rank
        if not shrunk.lost:
            raise exc
        new = shrunk.comm
        if not new.allreduce(int(self.original)):
            # Open MPI's abort ends the job mpirun started but not the replacements it spawned: every first rank
            # gone at once is what an abort (the monitor's verdict on a hung rank, a lost host) looks like here.
            raise mark_agreed(RestartableError(
                f"every rank that the job started with is gone (lost ranks {list(shrunk.lost)}): the "
                f"{new.Get_size()} replacement(s) left end too, for hpcnet.launch to restart the run"))
        old_size = comm.Get_size()
        reached = new.allgather(self._offer())
        self._choose_state(new, reached, shrunk.lost, old_size)
        assert self.world is not None
        hosts = self.world.hostnames
        if self.global_batch is None:
            self.global_batch = self.cfg.train.batch_size * old_size
        self.generation += 1
        self.recoveries.append({
            "lost": [{"rank": r, "host": hosts[r]} for r in shrunk.lost],
            "world_size": new.Get_size(), "from_world_size": old_size,
            "step": max(step for _, step, *_ in reached),
            "state": "mirror" if self.from_mirrors else "memory" if self.carried is not None else "checkpoint",
            "error": f"{type(exc).__name__}: {exc}"[:300], "shrink_s": round(shrunk.shrink_s, 4)})
        self._last, self._phases = time.perf_counter(), {}
        return new

    def _offer(self) -> tuple[int, int, int, Any]:
        """This survivor's word on where the state comes from: the step and digest of the state it carries, the
        step it had completed, its mirror's offer (``hpcnet.fault.mirror.Offer``; None without one)."""
        carried, mirror = self.carried, self.mirror
        return (carried.step if carried is not None else -1, self.failed_step,
                _digest(carried.entries) if carried is not None else 0,
                mirror.offer(_digest(mirror.own)) if mirror is not None and mirror.own is not None else None)

    def _choose_state(self, comm: Any, reached: list[tuple[int, int, int, Any]], lost: tuple[int, ...],
                      old_size: int) -> None:
        """Every survivor alike, from every survivor's ``_offer``: the state carried into the next world (memory,
        the mirrors) or a reload of the newest checkpoint."""
        kept = [step for step, *_ in reached]
        furthest = {digest for step, _, digest, _ in reached if step == max(kept)}
        offers = [offer for *_, offer in reached]
        mirror, self.from_mirrors = self.mirror, False
        mirrored = mirrored_step(offers, lost) if mirror is not None else None
        if self.replicated and min(kept) >= 0 and len(furthest) == 1:
            if min(kept) != max(kept):  # some finished the interrupted update: every survivor takes theirs
                source = kept.index(max(kept))
                mine = self.carried
                theirs = comm.bcast(mine if comm.Get_rank() == source else None, root=source)
                theirs.entries.rank_state = mine.entries.rank_state  # its own generators, as ever
                self.carried = theirs
            self.reload = False
        elif mirror is not None and mirrored is not None:  # each lost rank's shards from its keeper
            self.carried = Carried(mirrored, mirror.restored(offers, lost, old_size), mirror.last_saved_step)
            self.reload, self.from_mirrors = False, True
        else:  # sharded state, a survivor before the loop, or states that differ at one step: the checkpoint
            self.carried, self.reload = None, True
        if mirror is not None:
            mirror.reset()  # of the world that is gone (the carried entries keep what is restored)

    def hold(self, state: Any, step: int) -> None:
        """Every survivor, at the boundary after ``step`` where replacements are ready (``Growing``, collective):
        copies of the parts' entries, for the grown world's hand-over."""
        self._seen_at = time.perf_counter()
        self.carried = Carried(step, snapshot(state.entries()), state.last_saved_step)
        self.failed_step = step

    def grow(self) -> Any:
        """Every survivor, after ``hold``: the merged communicator of survivors and replacements (a duplicate, for
        hpcnet's own traffic), with this job's recovery state sent to the replacements (``receive``)."""
        assert self.replacements is not None and self.world is not None
        replacements, self.replacements = self.replacements, None
        merged = replacements.merge(self.world.rank)
        new = track(merged.Dup())
        merged.Free()
        self.grows.append({"joined": replacements.count, "world_size": new.Get_size(),
                           "from_world_size": self.world.size, "step": self.failed_step,
                           "started_after_step": replacements.started_at_step,
                           "spawn_s": round(replacements.spawn_s, 4), "ready_s": round(replacements.ready_s, 4)})
        self.handover, self._last, self._phases = True, time.perf_counter(), {}
        new.bcast({name: getattr(self, name) for name in _SENT}, root=0)
        return new

    def receive(self, comm: Any) -> Config:
        """A replacement (collective with the survivors' ``grow``): the job's recovery state; the run's options."""
        for name, value in comm.bcast(None, root=0).items():
            setattr(self, name, value)
        self.handover, self.original = True, False
        self._seen_at = self._last = time.perf_counter()
        return self.cfg

    def dismiss(self, *, lost: bool = False, gone: tuple[int, ...] = ()) -> None:
        """Let replacements that have not joined go: the run ended, or (``lost``) more ranks were lost first
        (``gone``: which, where known: the lowest survivor tells them)."""
        if self.replacements is not None:
            self.replacements.dismiss(self.world.rank if self.world is not None else 0, lost=lost, gone=gone)
            self.replacements = None

    def grow_flag(self, step: int) -> int:
        """This rank's word on growing after ``step``, for the boundary's all-reduce (rank 0 decides; elsewhere
        0): 1 to start the replacements, 2 when they wait to join. ``fault.grow_after_steps`` after the start,
        rank 0 waits for them."""
        reps = self.replacements
        if reps is None or self.world is None or not self.world.is_main or step >= self.cfg.train.steps:
            return 0
        if reps.inter is None:
            return int(step > reps.from_step and reps.due())
        after = self.cfg.fault.grow_after_steps
        if after and step < reps.started_at_step + after:
            return 0  # a join at a known step, not before: whenever the replacements are ready
        return 2 if reps.ready(GROW_WAIT_S if after and step == reps.started_at_step + after else 0.0) else 0

    def start_replacements(self, comm: Any, step: int) -> None:
        """Collective, at the boundary after ``step`` where rank 0's ``grow_flag`` was 1."""
        assert self.replacements is not None
        self.replacements.start(comm, step)

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
        if self.handover or self.from_mirrors:  # a grow, or the mirrors: from the ranks that hold each entry
            carried = self.carried
            saved, last_saved = hand_over(comm, carried.entries if carried is not None else None,
                                          carried.step if carried is not None else 0,
                                          carried.last_saved_step if carried is not None else -1,
                                          (self.grows if self.handover else self.recoveries)[-1]["from_world_size"],
                                          state.before_read)
            with shared_errors(comm):
                for part in state.parts:
                    part.load_entries(saved)
            state.last_saved_step = last_saved
            return saved.step
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
        """The rebuild is done: one line on the new rank 0, and the record's times; after a shrink, replacements
        started where ``fault.grow`` asks (collective)."""
        handover = self.handover
        self.carried, self.reload, self.handover, self.from_mirrors, self.failed_step = None, False, False, False, -1
        if handover:
            self._grown(world, step)
        elif self.recoveries and "rebuild_s" not in self.recoveries[-1]:
            self._shrunk(world, step)
        self.world = world
        self._attach_mirror(world)
        if self.mode == "shrink" and self.cfg.fault.grow == "spawn" and world.size < self.size and step < \
                self.cfg.train.steps and self.replacements is None:
            self.replacements = Replacements(self.size - world.size, from_step=step,
                                             retry_s=self.cfg.fault.grow_retry_s)

    def _shrunk(self, world: World, step: int) -> None:
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
                        {"memory": "memory", "mirror": "the mirrors"}.get(record["state"], "the newest checkpoint"),
                        f" ({record['recomputed_steps']} steps to compute again)" if record["recomputed_steps"] else
                        "", self.global_batch * self.cfg.train.grad_accumulation)

    def _grown(self, world: World, step: int) -> None:
        record = self.grows[-1]
        self.mark("state")
        record["pause_s"] = round(time.perf_counter() - self._seen_at, 4)
        record["rebuild_phases_s"], self._last, self._seen_at = self._phases, 0.0, 0.0
        record["hosts"] = world.hostnames[record["from_world_size"]:]
        record["resumed_step"] = step
        if world.is_main:
            log.warning("%d replacement(s) joined after step %d (on %s): the job is back to %d ranks; the survivors "
                        "paused %.3f s (the replacements were ready %.3f s after they were started)",
                        record["joined"], step, ", ".join(sorted(set(record["hosts"]))), world.size,
                        record["pause_s"], record["ready_s"])

    def _attach_mirror(self, world: World) -> None:
        """``fault.replicas=1``: the mirror set up for this world; at the first, where there is nothing to mirror,
        rank 0 says why (the options are final here: ``dist.memory_cap_gb`` may have chosen ``dist.zero``)."""
        if not self.cfg.fault.replicas:
            return
        if self.mirror is None and not self._mirror_decided:
            self._mirror_decided = True
            why = self._no_mirror(world)
            if not why:
                self.mirror = Mirror()
            elif world.is_main:
                (log.warning if self.mode != "shrink" else log.info)("fault.replicas=1: no mirror is kept: %s", why)
        if self.mirror is not None:
            self.mirror.attach(world)

    def _no_mirror(self, world: World) -> str:
        """Why ``fault.replicas=1`` keeps no mirror in this job ('': it keeps one)."""
        if self.mode != "shrink":
            ft = self.mpi.describe() if self.mpi is not None else "no ULFM"
            return f"fault.recovery={self.cfg.fault.recovery} restarts the job from the newest checkpoint here ({ft})"
        if self.replicated:
            return "every rank holds the whole state (dist.zero=0 without int8), which the survivors keep"
        return "one rank has no other to keep its state" if world.size < 2 else ""

    def summary(self) -> dict[str, Any]:
        """summary.json's ``recovery``."""
        return {"recovery": {"mode": self.mode, "mpi": {} if self.mpi is None else asdict(self.mpi),
                             "recoveries": self.recoveries, "grows": self.grows,
                             **({"mirror": self.mirror.summary()} if self.mirror is not None else {})}}

